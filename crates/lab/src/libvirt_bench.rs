//! `ferry bench --libvirt`: a libvirt-managed VM moved from site a to site b by ferry (`ferry
//! migrate --libvirt`, through the agents) and by libvirt alone (`virsh migrate --p2p` straight
//! across the WAN to site b's daemon: plain, or QEMU's multifd channels with zstd), on the same
//! guest, workload and link. Every system is measured the same way: the wall time of the
//! command that migrates, the bytes the WAN emulator counted, and libvirt's own figure of the
//! real pause (the completed job at the destination: its stop at the source to its resume at
//! the destination). With a disk, the domain's image is copied too (`--copy-storage` /
//! `--copy-storage-all`, into an empty image of the same size at site b) while the guest's
//! writer keeps rewriting its file. With a return, the domain then runs at site b for a while
//! and the same system moves it back onto the image it left at site a (libvirt reuses an
//! image that exists), measured the same way (`"leg": "return"`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tokio_util::task::AbortOnDropHandle;

use crate::bench::{DiskWriter, Workload};
use crate::guest::{GuestLink, Heartbeats};
use crate::image::Image;
use crate::libvirt::{self, virsh, virsh_command};
use crate::pki;
use crate::topology::{Lab, Site};

/// Who migrates the domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibvirtSystem {
    /// `ferry migrate --libvirt`: libvirt's migration carried, coded and steered by the agents.
    Ferry,
    /// `ferry migrate --libvirt --parallel 4`: the same, QEMU's memory on four multifd
    /// channels, each coded by the agents.
    FerryParallel,
    /// `ferry migrate --libvirt --codec none`: carried and steered by the agents, QEMU's bytes
    /// as they are (what the codec's CPU costs the guest, apart from the rest).
    FerryUncoded,
    /// `ferry migrate --libvirt --disk-pacing-floor-pct 50`: the relay takes libvirt's bulk
    /// disk copy at a speed paced by the guest's IO, down to half its unpaced rate.
    FerryPaced,
    /// `ferry`, but its return indexes the image the domain left: the index site a's agent
    /// kept when the domain left is removed before the return (what a return costs without it).
    FerryIndexed,
    /// `ferry migrate --libvirt --no-converge`: auto-converge off, the guest's vCPU never
    /// throttled (what the throttle costs the guest's IO, apart from the rest).
    FerryUnthrottled,
    /// `virsh migrate --live --p2p` straight to the destination's libvirtd.
    Plain,
    /// The same with `--parallel --compressed --comp-methods zstd` (multifd with zstd).
    ParallelZstd,
    /// A user's own `virsh migrate --live --p2p --parallel` (multifd, four channels, no
    /// compression) at the source agent's tunnels: each channel coded and gated by ferry.
    ParallelViaFerry,
    /// Plain, with the disk mirror in write-blocking mode (`--copy-storage-synchronous-writes`:
    /// each guest write waits for the destination), libvirt's way to make a copy converge.
    SyncWrites,
}

impl LibvirtSystem {
    pub const ALL: [LibvirtSystem; 10] = [
        LibvirtSystem::Ferry,
        LibvirtSystem::FerryIndexed,
        LibvirtSystem::FerryParallel,
        LibvirtSystem::FerryUncoded,
        LibvirtSystem::FerryPaced,
        LibvirtSystem::FerryUnthrottled,
        LibvirtSystem::Plain,
        LibvirtSystem::ParallelZstd,
        LibvirtSystem::ParallelViaFerry,
        LibvirtSystem::SyncWrites,
    ];

    /// What `--libvirt` compares when no --modes are given.
    pub const DEFAULT: [LibvirtSystem; 3] = [
        LibvirtSystem::Ferry,
        LibvirtSystem::Plain,
        LibvirtSystem::ParallelZstd,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LibvirtSystem::Ferry => "ferry",
            LibvirtSystem::FerryParallel => "ferry-parallel",
            LibvirtSystem::FerryUncoded => "ferry-none",
            LibvirtSystem::FerryPaced => "ferry-paced",
            LibvirtSystem::FerryIndexed => "ferry-indexed",
            LibvirtSystem::FerryUnthrottled => "ferry-unthrottled",
            LibvirtSystem::Plain => "virsh",
            LibvirtSystem::ParallelZstd => "virsh-parallel-zstd",
            LibvirtSystem::ParallelViaFerry => "virsh-parallel-via-ferry",
            LibvirtSystem::SyncWrites => "virsh-sync-writes",
        }
    }

    pub fn parse(s: &str) -> Result<LibvirtSystem> {
        LibvirtSystem::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .with_context(|| {
                let known: Vec<_> = LibvirtSystem::ALL.iter().map(|m| m.name()).collect();
                format!(
                    "unknown system {s:?} for --libvirt (known: {})",
                    known.join(", ")
                )
            })
    }
}

/// One migration of a libvirt domain.
#[derive(Debug, Clone, Serialize)]
pub struct LibvirtRecord {
    pub system: &'static str,
    /// `there` (site a to b) or `return` (back onto the disk image left at site a).
    pub leg: &'static str,
    pub workload: String,
    pub run: u32,
    pub mem_mib: u32,
    pub completed: bool,
    /// The migrating command's wall time.
    pub total_ms: u64,
    /// Both directions, counted by the WAN emulator.
    pub wan_bytes: u64,
    /// libvirt's real pause, read at the destination.
    pub downtime_ms: Option<u64>,
    /// The guest's memory verifier at the destination.
    pub mem_errors: Option<u64>,
    /// With a disk: its verifier at the destination.
    pub disk_errors: Option<u64>,
    pub disk_writer: Option<DiskWriter>,
    /// With a disk: the guest's write latencies (and its hot-set reads) from just before the
    /// migration to the verifier at the destination, by the guest's own tool.
    pub disk_write_latency: Option<crate::guest::DiskLatency>,
    /// The hot-set reader's rate at the source before the migration (the warm-up, or the stay
    /// there), for the reads during it.
    pub disk_reads_before_per_s: Option<f64>,
    /// ferry's own disk figures (`ferry migrate --json`): disk frames on the WAN, bytes sent
    /// as SAME (held by an older copy there), the older copy's index time.
    pub disk_frame_bytes: Option<u64>,
    pub disk_same_bytes: Option<u64>,
    pub disk_index_ms: Option<u64>,
    /// How the source knew what the destination's older copy holds (`index`, `remembered`).
    pub disk_older_copy: Option<String>,
    /// How long ferry's pacing held the disk copy below its unpaced rate (paced runs only).
    pub disk_paced_ms: Option<u64>,
    /// With a reader: its reads in each second of the guest's time from the same start as
    /// `disk_write_latency` (the guest's clock stops in the pause).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_reads_by_s: Option<Vec<u32>>,
    /// When libvirt's job at the source first showed memory sent, ms from that start (polled
    /// every [`JOB_POLL`]): before it the disks are copied, after it the memory. None: never
    /// seen (a move whose memory phase fell between two polls, or a failed one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_phase_at_ms: Option<u64>,
    /// ferry's runs: the highest vCPU throttle auto-converge applied, percent, and the vCPU
    /// time it took, s (None: never throttled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_pct: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throttle_vcpu_s: Option<f64>,
    pub error: Option<String>,
}

/// One scenario: `system` moves a fresh domain of `mem_mib` MiB running `workload`.
pub struct LibvirtScenario {
    pub system: LibvirtSystem,
    pub workload: Workload,
    pub mem_mib: u32,
    pub warmup: Duration,
    pub run: u32,
    /// `ferry`, for `ferry migrate --libvirt`.
    pub ferry_exe: PathBuf,
    /// A data disk (the image's, copied) and the guest's writer on it.
    pub disk: Option<DiskWriter>,
    /// After the move, run this long at site b and move back (a second record).
    pub return_after: Option<Duration>,
}

/// Runs one scenario in a lab up with libvirt; the domain is removed afterwards whatever
/// happened.
pub async fn run_scenario(
    lab: &Lab,
    img: &Image,
    sc: &LibvirtScenario,
) -> Result<Vec<LibvirtRecord>> {
    let name = format!("bench-{}-{}", sc.system.name(), sc.run);
    let result = measure(lab, img, sc, &name).await;
    for site in Site::ALL {
        let _ = virsh(lab, site, &["destroy", &name]);
        let _ = virsh(lab, site, &["undefine", &name]);
        let _ = std::fs::remove_file(disk_path(lab, site, &name));
    }
    result
}

/// Domain `name`'s disk image at `site` (`/run/ferry-host/NAME.qcow2` there).
fn disk_path(lab: &Lab, site: Site, name: &str) -> PathBuf {
    lab.host_dir(site).join(format!("{name}.qcow2"))
}

/// The domain's disk: the image's data disk as qcow2 at site a, an empty image of the same
/// size at site b (libvirt copies into an image that exists).
fn make_disks(lab: &Lab, img: &Image, name: &str) -> Result<()> {
    let a = disk_path(lab, Site::A, name);
    let size = std::fs::metadata(&img.data_disk)?.len().to_string();
    crate::sh::run(
        "qemu-img",
        &[
            "convert",
            "-q",
            "-O",
            "qcow2",
            &img.data_disk.to_string_lossy(),
            &a.to_string_lossy(),
        ],
    )?;
    let b = disk_path(lab, Site::B, name);
    crate::sh::run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", &b.to_string_lossy(), &size],
    )?;
    Ok(())
}

async fn measure(
    lab: &Lab,
    img: &Image,
    sc: &LibvirtScenario,
    name: &str,
) -> Result<Vec<LibvirtRecord>> {
    let xml = lab.host_dir(Site::A).join(format!("{name}.xml"));
    if sc.disk.is_some() {
        make_disks(lab, img, name)?;
    }
    std::fs::write(
        &xml,
        libvirt::tiny_domain_xml(
            img,
            name,
            sc.mem_mib,
            &libvirt::GuestNic::lab(95),
            sc.disk.is_some(),
        ),
    )?;
    virsh(
        lab,
        Site::A,
        &["define", &format!("/run/ferry-host/{name}.xml")],
    )?;
    virsh(lab, Site::A, &["start", name])?;
    let serial = |site| lab.host_dir(site).join(format!("{name}.serial"));
    let link = GuestLink::connect(&serial(Site::A), Arc::new(Heartbeats::default())).await?;
    link.wait_ready(Duration::from_secs(120)).await?;
    link.call(&sc.workload.start_command(), Duration::from_secs(180))
        .await?;
    if let Some(w) = sc.disk {
        // The first fill writes the whole file once (O_DIRECT, under TCG): allow minutes.
        link.call(
            &format!("disk start mib={} rate={}", w.file_mib, w.rate_mib_s),
            Duration::from_secs(600),
        )
        .await?;
        if w.read_hot_mib > 0 {
            link.call(
                &format!("disk read hot={}", w.read_hot_mib),
                Duration::from_secs(30),
            )
            .await?;
        }
        crate::guest::reset_disk_latency(&link).await?;
    }
    tokio::time::sleep(sc.warmup).await;
    drop(link);
    let there = leg(lab, sc, name, (Site::A, Site::B)).await?;
    let mut records = vec![there];
    if let (Some(stay), true) = (sc.return_after, records[0].completed) {
        tokio::time::sleep(stay).await;
        if sc.system == LibvirtSystem::FerryIndexed {
            let kept = crate::agents::seed_dir(lab, Site::A)
                .join("disks")
                .join(name);
            match std::fs::remove_dir_all(&kept) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("remove {}", kept.display()));
                }
                _ => {}
            }
        }
        let mut back = leg(lab, sc, name, (Site::B, Site::A)).await?;
        back.leg = "return";
        records.push(back);
    }
    Ok(records)
}

/// Moves domain `name` from `from` to `to` and measures it; the guest's verifiers run at `to`.
async fn leg(
    lab: &Lab,
    sc: &LibvirtScenario,
    name: &str,
    (from, to): (Site, Site),
) -> Result<LibvirtRecord> {
    let serial = |site: Site| lab.host_dir(site).join(format!("{name}.serial"));
    let reader = sc.disk.is_some_and(|w| w.read_hot_mib > 0);
    // The guest's IO figures start here; the reader's rate so far is the one without a move.
    let mut disk_reads_before_per_s = None;
    if sc.disk.is_some() {
        let link = GuestLink::connect(&serial(from), Arc::new(Heartbeats::default())).await?;
        if reader {
            disk_reads_before_per_s = crate::guest::disk_latency(&link).await?.reads_per_s;
        }
        crate::guest::reset_disk_latency(&link).await?;
    }
    let wan_before = crate::wan::stats(&lab.wan_socket())?.total_bytes();
    let started = Instant::now();
    // Stopped when its handle goes, however this ends: a move that failed leaves no poller.
    let memory_phase = reader.then(|| {
        let source = libvirt::site_dir(lab, from).join("run/libvirt-sock");
        AbortOnDropHandle::new(tokio::spawn(memory_phase_start(
            ferry_agent::libvirt::Libvirt::new(source),
            name.to_owned(),
            started,
        )))
    });
    let migrated = {
        let (lab, system, name, exe, disk) = (
            lab.clone(),
            sc.system,
            name.to_owned(),
            sc.ferry_exe.clone(),
            sc.disk.is_some(),
        );
        tokio::task::spawn_blocking(move || migrate(&lab, system, &name, &exe, disk, (from, to)))
            .await?
    };
    let total_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let memory_phase_at_ms = match memory_phase {
        Some(mut poll) => {
            poll.abort();
            (&mut poll).await.ok().flatten()
        }
        None => None,
    };
    let wan_bytes = crate::wan::stats(&lab.wan_socket())?.total_bytes() - wan_before;
    let ferry_outcome = migrated
        .as_ref()
        .ok()
        .and_then(|out| serde_json::from_str::<serde_json::Value>(out).ok())
        .map(|v| v["outcome"].clone())
        .unwrap_or_default();
    let ferry_disk = &ferry_outcome["disk"];
    let mut record = LibvirtRecord {
        system: sc.system.name(),
        leg: "there",
        workload: sc.workload.pattern.clone(),
        run: sc.run,
        mem_mib: sc.mem_mib,
        completed: migrated.is_ok(),
        total_ms,
        wan_bytes,
        downtime_ms: None,
        mem_errors: None,
        disk_errors: None,
        disk_writer: sc.disk,
        disk_write_latency: None,
        disk_reads_before_per_s,
        disk_frame_bytes: ferry_disk["frame_bytes"].as_u64(),
        disk_same_bytes: ferry_disk["same_bytes"].as_u64(),
        disk_index_ms: ferry_disk["index_ms"].as_u64(),
        disk_older_copy: ferry_disk["older_copy"].as_str().map(str::to_owned),
        disk_paced_ms: ferry_disk["paced_ms"].as_u64(),
        disk_reads_by_s: None,
        memory_phase_at_ms,
        cpu_throttle_pct: ferry_outcome["cpu_throttle_pct"].as_u64(),
        throttle_vcpu_s: ferry_outcome["throttle_vcpu_s"].as_f64(),
        error: migrated.err().map(|e| format!("{e:#}")),
    };
    if record.completed {
        let at_destination =
            ferry_agent::libvirt::Libvirt::new(libvirt::site_dir(lab, to).join("run/libvirt-sock"));
        record.downtime_ms = at_destination
            .job(name, true)
            .await
            .ok()
            .and_then(|j| j.downtime_ms);
        let link = GuestLink::connect(&serial(to), Arc::new(Heartbeats::default())).await?;
        if sc.disk.is_some() {
            record.disk_write_latency = Some(crate::guest::disk_latency(&link).await?);
        }
        if reader {
            record.disk_reads_by_s = Some(crate::guest::disk_read_counts(&link).await?);
        }
        let verified = crate::guest::verify(&link, sc.disk.is_some()).await?;
        record.mem_errors = Some(verified.mem_errors);
        record.disk_errors = sc.disk.map(|_| verified.disk_errors);
        if reader {
            // The verifier's full read is not the stay here: the next leg's "before" starts
            // after it.
            crate::guest::reset_disk_latency(&link).await?;
        }
    }
    Ok(record)
}

/// How often [`memory_phase_start`] asks libvirt.
const JOB_POLL: Duration = Duration::from_millis(500);

/// Polls libvirt's job for `domain` until it shows memory sent: ms since `started`. Runs until
/// then or until aborted (a poll libvirt does not answer is skipped).
async fn memory_phase_start(
    libvirt: ferry_agent::libvirt::Libvirt,
    domain: String,
    started: Instant,
) -> Option<u64> {
    loop {
        tokio::time::sleep(JOB_POLL).await;
        if libvirt
            .job(&domain, false)
            .await
            .is_ok_and(|job| job.memory_processed > 0)
        {
            return u64::try_from(started.elapsed().as_millis()).ok();
        }
    }
}

/// Moves domain `name` from `from` to `to` with `system`, its disk copied if `disk`; what the
/// command printed.
fn migrate(
    lab: &Lab,
    system: LibvirtSystem,
    name: &str,
    ferry: &Path,
    disk: bool,
    (from, to): (Site, Site),
) -> Result<String> {
    let direct = || -> Vec<String> {
        let destination = to.underlay_ip();
        [
            "migrate",
            "--live",
            "--p2p",
            "--persistent",
            "--undefinesource",
            "--auto-converge",
            name,
            &libvirt::tcp_uri(to),
            "--migrateuri",
            &format!("tcp://{destination}"),
        ]
        .map(str::to_owned)
        .into_iter()
        .chain(disk.then(|| "--copy-storage-all".to_owned()))
        .collect()
    };
    let command = match system {
        LibvirtSystem::Ferry
        | LibvirtSystem::FerryIndexed
        | LibvirtSystem::FerryParallel
        | LibvirtSystem::FerryUncoded
        | LibvirtSystem::FerryPaced
        | LibvirtSystem::FerryUnthrottled => lab
            .host_command(from, ferry)
            .args(["migrate", "--libvirt", name, "--to"])
            .arg(pki::agent_name(to))
            .args(["--json", "--agent"])
            .arg(lab.agent_socket(from))
            .args(disk.then_some("--copy-storage"))
            .args(
                (system == LibvirtSystem::FerryParallel)
                    .then_some(["--parallel", "4"])
                    .into_iter()
                    .flatten(),
            )
            .args(
                (system == LibvirtSystem::FerryUncoded)
                    .then_some(["--codec", "none"])
                    .into_iter()
                    .flatten(),
            )
            .args(
                (system == LibvirtSystem::FerryPaced)
                    .then_some(["--disk-pacing-floor-pct", "50"])
                    .into_iter()
                    .flatten(),
            )
            .args((system == LibvirtSystem::FerryUnthrottled).then_some("--no-converge"))
            .spawn_piped()?,
        LibvirtSystem::Plain => virsh_command(lab, from).args(direct()).spawn_piped()?,
        LibvirtSystem::ParallelZstd => virsh_command(lab, from)
            .args(direct())
            .args(["--parallel", "--compressed", "--comp-methods", "zstd"])
            .spawn_piped()?,
        LibvirtSystem::ParallelViaFerry => {
            // The paths the source agent's tunnels listen on (the same inside every site).
            let tunnels = format!(
                "{}/tunnels/{}",
                crate::topology::HOST_DIR,
                pki::agent_name(to)
            );
            virsh_command(lab, from)
                .args([
                    "migrate",
                    "--live",
                    "--p2p",
                    "--persistent",
                    "--undefinesource",
                    "--auto-converge",
                    "--parallel",
                    "--parallel-connections",
                    "4",
                    name,
                    "--desturi",
                    &format!("qemu+unix:///system?socket={tunnels}/rpc.sock"),
                    "--migrateuri",
                    &format!("unix://{tunnels}/mig.sock"),
                ])
                .args(
                    disk.then(|| {
                        [
                            "--copy-storage-all".to_owned(),
                            "--disks-uri".to_owned(),
                            format!("unix://{tunnels}/nbd.sock"),
                        ]
                    })
                    .into_iter()
                    .flatten(),
                )
                .spawn_piped()?
        }
        LibvirtSystem::SyncWrites => virsh_command(lab, from)
            .args(direct())
            .args(disk.then_some("--copy-storage-synchronous-writes"))
            .spawn_piped()?,
    };
    let out = finish_within(lab, command, name, DEADLINE, from)?;
    if !out.status.success() {
        bail!(
            "{}: {}",
            system.name(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// How long any system may take: libvirt's own disk mirror may never converge with a guest
/// that keeps writing, and its job is then aborted.
pub const DEADLINE: Duration = Duration::from_secs(180);

trait SpawnPiped {
    fn spawn_piped(&mut self) -> std::io::Result<std::process::Child>;
}

impl SpawnPiped for Command {
    fn spawn_piped(&mut self) -> std::io::Result<std::process::Child> {
        self.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
    }
}

/// Waits for the migrating command; past `deadline`, aborts domain `name`'s job at `source`
/// (which keeps running) and reports that.
fn finish_within(
    lab: &Lab,
    mut child: std::process::Child,
    name: &str,
    deadline: Duration,
    source: Site,
) -> Result<std::process::Output> {
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > deadline {
            let _ = virsh(lab, source, &["domjobabort", name]);
            let _ = child.wait_with_output();
            bail!(
                "did not finish within {} s (the job was aborted)",
                deadline.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(child.wait_with_output()?)
}
