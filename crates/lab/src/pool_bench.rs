//! `ferry bench --pools`: what a pool VM's clients see of its move between sites, with the
//! overlay re-pointed at the switchover (the controller's directory, VirtualWire), with the
//! same directory updated only once the controller learns of the commit, and with a plain
//! learning VXLAN that finds the VM again when the VM's own announcement reaches it (ARP-only,
//! what a stretched L2 segment without a controller does).
//!
//! A pool per mode, each held at site a with a VM (libvirt domain of the tiny guest)
//! at 10.0.0.10 and a client port beside it at 10.0.0.20 (site a). Each run moves each VM to
//! site b and back through the fleet (`ferry fleet migrate`), the modes interleaved; on every
//! move the client holds a fresh TCP connection to the guest's sequence server (a number every
//! 10 ms: the longest gap between two numbers is the stall) and pings the guest every 10 ms
//! (the echoes lost are the frames lost, either way).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::bench::Workload;
use crate::controller::{fleet, fleet_json};
use crate::guest::GuestLink;
use crate::image::Image;
use crate::libvirt::{self, GuestNic};
use crate::pools::PoolPort;
use crate::tcpseq::TcpSeqClient;
use crate::topology::{wait_until, Lab, Site};

/// How a pool finds a moved VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// The controller's directory, re-pointed by the agents at the switchover.
    Repointed,
    /// The same directory, updated when the controller learns of the commit.
    Directory,
    /// A learning VXLAN: the VM's announcement after it resumes.
    Learning,
}

impl PoolMode {
    pub const ALL: [PoolMode; 3] = [PoolMode::Repointed, PoolMode::Directory, PoolMode::Learning];

    pub fn name(self) -> &'static str {
        match self {
            PoolMode::Repointed => "repointed",
            PoolMode::Directory => "directory",
            PoolMode::Learning => "arp-only",
        }
    }

    fn vni(self) -> u32 {
        match self {
            PoolMode::Repointed => 2001,
            PoolMode::Learning => 2002,
            PoolMode::Directory => 2003,
        }
    }

    fn vm(self) -> String {
        format!("pool-{}", self.name())
    }

    fn nic(self) -> GuestNic {
        GuestNic {
            bridge: format!("fp{}", self.vni()),
            mac: format!("52:54:00:20:{:02x}:0a", self.vni() % 256),
            ip: "10.0.0.10".into(),
        }
    }
}

/// One move of a pool's VM, as its client saw it.
#[derive(Debug, Clone, Serialize)]
pub struct PoolMoveRecord {
    pub mode: &'static str,
    pub run: u32,
    pub from: &'static str,
    pub to: &'static str,
    /// Where the client is, relative to the move: `source` (site a, a->b) or `destination`.
    pub client_at: &'static str,
    pub completed: bool,
    /// `ferry fleet migrate`'s wall time (queueing and the endpoint's making included).
    pub total_ms: u64,
    /// The longest gap between two of the guest's numbers on the client's connection.
    pub max_stall_ms: u64,
    /// Every number arrived once, in order, and the connection is still open.
    pub tcp_intact: bool,
    pub pings_sent: u64,
    pub pings_lost: u64,
    /// The guest's real pause, libvirt's figure as the source agent reported it.
    pub downtime_ms: Option<u64>,
    pub error: Option<String>,
}

/// The bench's settings.
pub struct PoolBench {
    pub runs: u32,
    pub mem_mib: u32,
    pub workload: Workload,
    pub ferry_exe: PathBuf,
}

/// Runs the bench in a lab up with libvirt and a controller; `emit` gets each move's record.
/// Returns how many moves failed.
pub async fn run(
    lab: &Lab,
    img: &Image,
    bench: &PoolBench,
    mut emit: impl FnMut(&PoolMoveRecord) -> Result<()>,
) -> Result<usize> {
    let exe = bench.ferry_exe.as_path();
    wait_until(Duration::from_secs(60), || {
        fleet_json(lab, exe, "hosts").is_ok_and(|h| {
            h.len() == 2
                && h.iter()
                    .all(|h| h["state"] == "up" && !h["overlay"].is_null())
        })
    })
    .context("the agents did not report their overlays to the controller")?;
    for mode in PoolMode::ALL {
        let mut args = vec![
            "pool".to_owned(),
            "create".into(),
            mode.name().into(),
            "--vni".into(),
            mode.vni().to_string(),
            "--hold".into(),
            "site-a".into(),
        ];
        match mode {
            PoolMode::Repointed => {}
            PoolMode::Directory => args.push("--no-repoint".into()),
            PoolMode::Learning => args.push("--learning".into()),
        }
        fleet(lab, exe, &args)?;
    }
    wait_until(Duration::from_secs(60), || {
        fleet_json(lab, exe, "pools").is_ok_and(|pools| {
            pools.iter().all(|p| {
                p["endpoints"].as_array().is_some_and(|e| {
                    e.iter()
                        .any(|e| e["host"] == "site-a" && e["ready"] == true)
                })
            })
        })
    })
    .context("the pools' endpoints did not come up at site a")?;

    let mut ports = Vec::new();
    let mut links = Vec::new();
    for mode in PoolMode::ALL {
        links.push(start_vm(lab, img, bench, mode).await?);
        let nic = mode.nic();
        ports.push(PoolPort::attach(
            lab,
            Site::A,
            &nic.bridge,
            mode.name(),
            &format!("52:54:00:20:{:02x}:14", mode.vni() % 256),
            "10.0.0.20/24",
        )?);
    }
    drop(links);
    wait_until(Duration::from_secs(60), || {
        fleet_json(lab, exe, "vms").is_ok_and(|vms| {
            PoolMode::ALL
                .iter()
                .all(|m| vms.iter().any(|v| v["name"] == m.vm().as_str()))
        })
    })
    .context("the controller does not list the pools' VMs")?;

    let mut failures = 0;
    for run in 1..=bench.runs {
        for (from, to, client_at) in [
            (Site::A, Site::B, "source"),
            (Site::B, Site::A, "destination"),
        ] {
            for (mode, port) in PoolMode::ALL.into_iter().zip(&ports) {
                let record = move_once(lab, exe, mode, port, (from, to, client_at), run).await;
                failures += usize::from(!record.completed);
                emit(&record)?;
            }
        }
    }
    Ok(failures)
}

/// Defines and starts the mode's VM at site a with the workload running.
async fn start_vm(lab: &Lab, img: &Image, bench: &PoolBench, mode: PoolMode) -> Result<GuestLink> {
    libvirt::start_tiny_domain(
        lab,
        img,
        (&mode.vm(), bench.mem_mib, &mode.nic()),
        &bench.workload.start_command(),
    )
    .await
}

async fn move_once(
    lab: &Lab,
    exe: &Path,
    mode: PoolMode,
    port: &PoolPort,
    (from, to, client_at): (Site, Site, &'static str),
    run: u32,
) -> PoolMoveRecord {
    let mut record = PoolMoveRecord {
        mode: mode.name(),
        run,
        from: from.name(),
        to: to.name(),
        client_at,
        completed: false,
        total_ms: 0,
        max_stall_ms: 0,
        tcp_intact: false,
        pings_sent: 0,
        pings_lost: 0,
        downtime_ms: None,
        error: None,
    };
    if let Err(e) = measure(lab, exe, mode, port, to, &mut record).await {
        record.error = Some(format!("{e:#}"));
    }
    record
}

async fn measure(
    lab: &Lab,
    exe: &Path,
    mode: PoolMode,
    port: &PoolPort,
    to: Site,
    record: &mut PoolMoveRecord,
) -> Result<()> {
    let tcp = TcpSeqClient::connect(&port.ns, "10.0.0.10:7000", Duration::from_secs(30))?;
    tcp.wait_for_more(20, Duration::from_secs(30))?;
    let pinger = Pinger::start(&port.ns, "10.0.0.10")?;
    let started = Instant::now();
    let moved = {
        let (lab, exe, vm, host) = (
            lab.clone(),
            exe.to_owned(),
            mode.vm(),
            format!("site-{}", to.name()),
        );
        tokio::task::spawn_blocking(move || {
            fleet(&lab, &exe, &["migrate".into(), vm, "--to".into(), host])
        })
        .await?
    };
    record.total_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    // A second of traffic after the move: the stall is over once numbers flow again.
    let waited = tcp.wait_for_more(100, Duration::from_secs(60));
    let (sent, received) = pinger.stop()?;
    (record.pings_sent, record.pings_lost) = (sent, sent.saturating_sub(received));
    let stats = tcp.stats();
    (record.max_stall_ms, record.tcp_intact) = (stats.max_stall_ms, stats.intact());
    moved?;
    waited?;
    record.completed = true;
    let migrations = fleet_json(lab, exe, "migrations")?;
    // libvirt's figure, as the agent recorded it: the stop and resume it implies.
    record.downtime_ms = migrations
        .iter()
        .rev()
        .find(|m| m["vm"] == mode.vm().as_str())
        .and_then(|m| {
            let agent = &m["agent"];
            let us = agent["destination_resume_unix_us"].as_i64()?
                - agent["source_stop_unix_us"].as_i64()?;
            u64::try_from(us / 1000).ok()
        });
    Ok(())
}

/// `busybox ping` every 10 ms from a namespace until stopped.
struct Pinger {
    child: std::process::Child,
}

impl Pinger {
    fn start(ns: &str, ip: &str) -> Result<Pinger> {
        let child = Command::new("ip")
            .args([
                "netns", "exec", ns, "busybox", "ping", "-q", "-i", "0.01", ip,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("start busybox ping")?;
        Ok(Pinger { child })
    }

    /// Stops it (SIGINT: it prints its summary); returns (sent, received).
    fn stop(self) -> Result<(u64, u64)> {
        let pid = i32::try_from(self.child.id()).context("pid")?;
        // SAFETY: signals our own child, still unreaped.
        unsafe { libc::kill(pid, libc::SIGINT) };
        let out = self.child.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        parse_ping_summary(&text).with_context(|| format!("ping's summary: {text:?}"))
    }
}

/// "N packets transmitted, M packets received, ..." -> (N, M).
fn parse_ping_summary(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.contains("packets transmitted"))?;
    let mut numbers = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .map(|w| w.parse::<u64>());
    Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pings_summary_is_read() {
        let text = "PING 10.0.0.10 (10.0.0.10): 56 data bytes\n\n--- 10.0.0.10 ping statistics ---\n1204 packets transmitted, 1187 packets received, 1% packet loss\n";
        assert_eq!(parse_ping_summary(text), Some((1204, 1187)));
        assert_eq!(parse_ping_summary("nothing"), None);
    }
}
