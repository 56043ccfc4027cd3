//! `ferry bench --overload`: the controller's overload response (Overdriver's cooperative swap
//! while an overload is transient, a migration once it lasts) against a migration at every
//! overload, in a lab each (the response is the controller's config, and a run moves VMs).
//!
//! Four libvirt domains of the tiny guest (128 MiB): three at site a, one at site b, each
//! host offering VMs 240 MiB (`lab up --overload-mib 240`), the controller sampling memory
//! every 3 s. Once the hosts are calm, one guest at site a runs `bursts` memory bursts
//! (`burst start`: 48 MiB written, read over and over, checked, freed) of `burst_s` seconds,
//! `gap_s` apart. Meanwhile the bench reads the fleet's view every half second. Per run:
//! - **SLA**: how long site a's guests used more memory than it offers (the sum of what each
//!   guest uses of the memory its balloon leaves it, as the agents report it; a guest that
//!   swaps to a peer no longer holds what it paged out);
//! - the migrations the controller started and the swaps it had taken;
//! - the bytes on the WAN (the swap's pages and the migrations' streams both cross it);
//! - the bursts' own figures: passes over their memory (how much work the guest got done) and
//!   pages found damaged (must be none), and the memory verifiers of every guest at the end.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::controller::{fleet, fleet_json};
use crate::guest::{GuestLink, Heartbeats};
use crate::image::Image;
use crate::libvirt::{self, GuestNic};
use crate::topology::{wait_until, Lab, Site};

const VMS: [&str; 4] = ["ovb1", "ovb2", "ovb3", "ovb4"];
/// What each host offers VMs, MiB: three idle tiny guests (about 69 MiB each) fit, a burst on
/// top does not.
pub const HOST_MIB: u32 = 240;
const BURST_MIB: u32 = 48;
const GUEST_MIB: u32 = 128;

/// How a run meets overload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Response {
    /// Swap on a peer while transient, a migration once sustained (Overdriver).
    Swap,
    /// A migration at the first overloaded sample.
    MigrateOnly,
}

impl Response {
    pub const ALL: [Response; 2] = [Response::Swap, Response::MigrateOnly];

    pub fn name(self) -> &'static str {
        match self {
            Response::Swap => "swap",
            Response::MigrateOnly => "migrate-only",
        }
    }

    pub fn parse(s: &str) -> Option<Response> {
        Response::ALL.into_iter().find(|r| r.name() == s)
    }
}

pub struct OverloadBench {
    pub bursts: u32,
    pub burst_s: u32,
    pub gap_s: u32,
    pub ferry_exe: PathBuf,
}

#[derive(Debug, Clone, Serialize)]
pub struct OverloadRecord {
    pub response: &'static str,
    pub run: u32,
    pub completed: bool,
    pub bursts: u32,
    pub burst_s: u32,
    /// Time site a's guests used more than it offers, ms (sampled every half second).
    pub over_ms: u64,
    /// The most they used above it, MiB.
    pub peak_over_mib: u64,
    pub migrations: usize,
    /// Swaps the controller had taken (distinct, as `ferry fleet plan` listed them).
    pub swaps: usize,
    pub wan_bytes: u64,
    /// Passes the bursts made over their memory, all bursts together.
    pub burst_passes: u64,
    pub burst_corrupt: u64,
    pub verify_errors: u64,
    pub total_ms: u64,
    pub error: Option<String>,
}

/// One run in `lab`, up with libvirt, a controller and `--overload-mib` [`HOST_MIB`] as
/// `response` wants.
pub async fn run_once(
    lab: &Lab,
    img: &Image,
    bench: &OverloadBench,
    response: Response,
    run: u32,
) -> OverloadRecord {
    let mut record = OverloadRecord {
        response: response.name(),
        run,
        completed: false,
        bursts: bench.bursts,
        burst_s: bench.burst_s,
        over_ms: 0,
        peak_over_mib: 0,
        migrations: 0,
        swaps: 0,
        wan_bytes: 0,
        burst_passes: 0,
        burst_corrupt: 0,
        verify_errors: 0,
        total_ms: 0,
        error: None,
    };
    if let Err(e) = measure(lab, img, bench, &mut record).await {
        record.error = Some(format!("{e:#}"));
    }
    record
}

async fn measure(
    lab: &Lab,
    img: &Image,
    bench: &OverloadBench,
    record: &mut OverloadRecord,
) -> Result<()> {
    let exe = bench.ferry_exe.as_path();
    wait_until(Duration::from_secs(60), || {
        fleet_json(lab, exe, "hosts")
            .is_ok_and(|h| h.len() == 2 && h.iter().all(|h| h["state"] == "up"))
    })
    .context("the agents did not register with the controller")?;
    for (i, name) in VMS.into_iter().enumerate() {
        let nic = GuestNic::lab(60 + u8::try_from(i)?);
        let command = "mem start mib=8 pattern=ws rate=0.5 hot=2";
        drop(libvirt::start_tiny_domain(lab, img, (name, GUEST_MIB, &nic), command).await?);
    }
    fleet(
        lab,
        exe,
        &["migrate", VMS[3], "--to-site", "b"].map(String::from),
    )?;
    for (name, site) in VMS.into_iter().zip([Site::A, Site::A, Site::A, Site::B]) {
        wait_until(Duration::from_secs(60), || {
            libvirt::virsh(
                lab,
                site,
                &["qemu-agent-command", name, r#"{"execute":"guest-ping"}"#],
            )
            .is_ok()
        })
        .with_context(|| format!("{name}'s guest agent does not answer"))?;
    }
    // Calm: every guest's use known, no host over, no swap.
    wait_until(Duration::from_secs(120), || {
        fleet_plan(lab, exe).is_ok_and(|p| {
            let pressure = p["pressure"].as_array().cloned().unwrap_or_default();
            pressure.len() == 2
                && pressure.iter().all(|h| h["pressure"] == "normal")
                && p["swaps"].as_array().is_some_and(Vec::is_empty)
        })
    })
    .context("the hosts never read calm")?;
    let migrations_before = fleet_json(lab, exe, "migrations")?.len();
    let wan_before = crate::wan::stats(&lab.wan_socket())?.total_bytes();
    let started = Instant::now();

    let watcher = {
        let (lab, exe) = (lab.clone(), exe.to_owned());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        (
            stop,
            tokio::task::spawn_blocking(move || watch(&lab, &exe, &flag)),
        )
    };
    let burster = VMS[0];
    let serial = lab.host_dir(Site::A).join(format!("{burster}.serial"));
    for i in 0..bench.bursts {
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default())).await?;
        link.call(
            &format!("burst start mib={BURST_MIB} secs={}", bench.burst_s),
            Duration::from_secs(60),
        )
        .await?;
        drop(link);
        let deadline = Instant::now() + Duration::from_secs(u64::from(bench.burst_s) + 120);
        loop {
            let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default())).await?;
            let stats = link.call("burst stats", Duration::from_secs(60)).await?;
            if stats.fields.get("state").map(String::as_str) == Some("done") {
                record.burst_passes += stats.u64("passes")?;
                record.burst_corrupt += stats.u64("corrupt")?;
                break;
            }
            if Instant::now() > deadline {
                bail!("burst {} did not end: {}", i + 1, stats.text);
            }
            drop(link);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        tokio::time::sleep(Duration::from_secs(u64::from(bench.gap_s))).await;
    }
    let (stop, watching) = watcher;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = watching.await??;
    record.total_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    record.over_ms = seen.over_ms;
    record.peak_over_mib = seen.peak_over_bytes >> 20;
    record.swaps = seen.swaps.len();
    // Migrations the controller started, each followed to its end.
    let migrations = fleet_json(lab, exe, "migrations")?;
    let new = &migrations[migrations_before.min(migrations.len())..];
    record.migrations = new.len();
    for m in new {
        let id = m["id"].as_str().context("a migration without an id")?;
        fleet(lab, exe, &["watch".into(), id.into()])?;
    }
    record.wan_bytes = crate::wan::stats(&lab.wan_socket())?
        .total_bytes()
        .saturating_sub(wan_before);
    let vms = fleet_json(lab, exe, "vms")?;
    for name in VMS {
        let site = match vms.iter().find(|v| v["name"] == name).map(|v| &v["host"]) {
            Some(h) if h == "site-b" => Site::B,
            _ => Site::A,
        };
        let serial = lab.host_dir(site).join(format!("{name}.serial"));
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default())).await?;
        record.verify_errors += crate::guest::verify(&link, false).await?.errors();
    }
    record.completed = true;
    Ok(())
}

/// What the bench saw of site a while the bursts ran.
#[derive(Default)]
struct Seen {
    over_ms: u64,
    peak_over_bytes: u64,
    swaps: std::collections::BTreeSet<String>,
}

/// Reads the fleet every half second until `stop`.
fn watch(lab: &Lab, exe: &Path, stop: &std::sync::atomic::AtomicBool) -> Result<Seen> {
    let capacity = u64::from(HOST_MIB) << 20;
    let mut seen = Seen::default();
    let mut last = Instant::now();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let vms = fleet_json(lab, exe, "vms")?;
        let used: u64 = vms
            .iter()
            .filter(|v| v["host"] == "site-a")
            .filter_map(|v| v["usage"]["used_bytes"].as_u64())
            .sum();
        let now = Instant::now();
        if used > capacity {
            seen.over_ms += u64::try_from(now.duration_since(last).as_millis()).unwrap_or(0);
            seen.peak_over_bytes = seen.peak_over_bytes.max(used - capacity);
        }
        last = now;
        if let Ok(plan) = fleet_plan(lab, exe) {
            for s in plan["swaps"].as_array().into_iter().flatten() {
                if let (Some(d), Some(since)) = (s["domain"].as_str(), s["since_unix_ms"].as_u64())
                {
                    seen.swaps.insert(format!("{d}@{since}"));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Ok(seen)
}

fn fleet_plan(lab: &Lab, exe: &Path) -> Result<serde_json::Value> {
    let out = fleet(lab, exe, &["plan".into(), "--json".into()])?;
    serde_json::from_str(&out).context("ferry fleet plan --json")
}
