//! libvirt on this host, asked through its own client (`virsh`, which every libvirt install
//! has): which domain is migrating out, a domain's state, the migration's steering and job
//! figures, and `virsh migrate` itself. libvirt connects QEMU's migration socket itself and
//! hands QEMU the descriptor, so the socket's peer is libvirtd, not the VM's QEMU.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::process::{Child, Command};

use crate::engine::disk::pacing::GuestIo;

/// How long one `virsh` query may take.
const VIRSH_TIMEOUT: Duration = Duration::from_secs(10);

/// A libvirt daemon: this host's, behind its socket, or a peer's through a tunnel.
#[derive(Debug, Clone)]
pub struct Libvirt {
    uri: String,
}

/// What libvirt reports of a migration job (`domjobinfo --rawstats`), in bytes and ms.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobStats {
    pub memory_processed: u64,
    pub memory_remaining: u64,
    pub memory_total: u64,
    pub memory_iteration: u64,
    pub disk_processed: u64,
    pub disk_total: u64,
    /// The vCPU throttle auto-converge applies now, percent (None: not throttled).
    pub cpu_throttle_pct: Option<u64>,
    /// Set once the job completed, at the destination: the VM's real pause, from its stop at
    /// the source to its resume at the destination (libvirt carries the stop's time over).
    /// While the job runs: QEMU's expected pause (`expected-downtime`: the dirty set at its
    /// last sync over its rate).
    pub downtime_ms: Option<u64>,
}

impl Libvirt {
    /// This host's daemon, behind `socket`.
    pub fn new(socket: impl AsRef<Path>) -> Libvirt {
        Libvirt {
            uri: format!("qemu:///system?socket={}", socket.as_ref().display()),
        }
    }

    /// A peer's daemon through the libvirt RPC tunnel whose socket is `tunnel`.
    pub fn through(tunnel: impl AsRef<Path>) -> Libvirt {
        Libvirt {
            uri: format!("qemu+unix:///system?socket={}", tunnel.as_ref().display()),
        }
    }

    /// The URI `virsh -c` and the libvirt API know this daemon by.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The domains with an outgoing migration job.
    pub async fn outgoing_domains(&self) -> Result<Vec<String>> {
        let names = self.virsh(&["list", "--name"]).await?;
        let mut outgoing = Vec::new();
        for name in names.lines().map(str::trim).filter(|n| !n.is_empty()) {
            // A domain that left meanwhile has no job to show: not an error here.
            if let Ok(job) = self.virsh(&["domjobinfo", name]).await {
                if job.contains("Outgoing migration") {
                    outgoing.push(name.to_owned());
                }
            }
        }
        Ok(outgoing)
    }

    /// The active domains (running, paused, ...) with their state in libvirt's words.
    pub async fn active_domains(&self) -> Result<Vec<(String, String)>> {
        // `virsh -q list`: "<id> <name> <state words>" per line.
        Ok(self
            .virsh(&["list"])
            .await?
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let (_id, name) = (fields.next()?, fields.next()?);
                Some((name.to_owned(), fields.collect::<Vec<_>>().join(" ")))
            })
            .collect())
    }

    /// Each active domain's CPU time so far (ns), memory (what its balloon leaves it, or its
    /// size) and, with `dirty_rate`, its last dirty-rate measurement, from one `virsh domstats`.
    pub async fn usage(
        &self,
        dirty_rate: bool,
    ) -> Result<std::collections::HashMap<String, DomainUsage>> {
        let mut args = vec!["domstats", "--cpu-total", "--balloon"];
        if dirty_rate {
            args.push("--dirtyrate");
        }
        args.push("--list-active");
        Ok(parse_domstats(&self.virsh(&args).await?))
    }

    /// The guest's disk operations so far, summed over its disks: QEMU's accounting of each
    /// device (`virsh domstats --block`), which counts the guest's IO and not a block job's.
    pub async fn guest_io(&self, domain: &str) -> Result<GuestIo> {
        parse_block_io(&self.virsh(&["domstats", "--block", domain]).await?)
    }

    /// Whether `domain` runs under KVM (`<domain type='kvm'>`), not emulated.
    pub async fn runs_on_kvm(&self, domain: &str) -> Result<bool> {
        let xml = self.virsh(&["dumpxml", domain]).await?;
        Ok(xml
            .lines()
            .find(|l| l.trim_start().starts_with("<domain"))
            .is_some_and(|l| l.contains("type='kvm'") || l.contains("type=\"kvm\"")))
    }

    /// Starts QEMU's measurement of how fast `domain` dirties its memory over `seconds`, in
    /// dirty-bitmap mode (every written page counted); `domstats --dirtyrate` shows it after.
    pub async fn start_dirty_rate(&self, domain: &str, seconds: u32) -> Result<()> {
        self.virsh(&[
            "domdirtyrate-calc",
            domain,
            "--seconds",
            &seconds.to_string(),
            "--mode",
            "dirty-bitmap",
        ])
        .await
        .map(drop)
    }

    /// The domain's network interfaces plugged into a bridge: (MAC, bridge). `virsh
    /// domiflist`: "<interface> <type> <source> <model> <MAC>" per line under a header.
    pub async fn bridged_nics(&self, domain: &str) -> Result<Vec<(String, String)>> {
        Ok(parse_domiflist(&self.virsh(&["domiflist", domain]).await?))
    }

    /// The domain's state in libvirt's words ("running", "paused", "shut off", ...); an
    /// unknown domain is an error in libvirt's words.
    pub async fn state(&self, domain: &str) -> Result<String> {
        Ok(self.virsh(&["domstate", domain]).await?.trim().to_owned())
    }

    /// Whether libvirt runs a job on the domain (a migration's, until its Confirm step ended).
    pub async fn has_job(&self, domain: &str) -> Result<bool> {
        Ok(job_runs(&self.virsh(&["domjobinfo", domain]).await?))
    }

    /// Pauses the domain (`virsh suspend`).
    pub async fn suspend(&self, domain: &str) -> Result<()> {
        self.virsh(&["suspend", domain]).await.map(drop)
    }

    /// Whether the daemon answers (`virsh version`).
    pub async fn answers(&self) -> Result<()> {
        self.virsh(&["version"]).await.map(drop)
    }

    /// Whether the domain has a persistent definition (not only a running instance).
    pub async fn is_persistent(&self, domain: &str) -> Result<bool> {
        let info = self.virsh(&["dominfo", domain]).await?;
        Ok(info
            .lines()
            .any(|l| l.starts_with("Persistent:") && l.trim_end().ends_with("yes")))
    }

    /// The files of the domain's disks (`domblklist --details`: type, device, target, source).
    pub async fn disk_files(&self, domain: &str) -> Result<Vec<String>> {
        let list = self.virsh(&["domblklist", domain, "--details"]).await?;
        Ok(list
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() == 4 && f[0] == "file" && f[1] == "disk").then(|| f[3].to_owned())
            })
            .collect())
    }

    /// The running domain's file disks with their backing chains (`virsh dumpxml`).
    pub async fn disk_sources(
        &self,
        domain: &str,
    ) -> Result<Vec<crate::libvirt_disks::DiskSource>> {
        crate::libvirt_disks::parse(&self.virsh(&["dumpxml", domain]).await?)
    }

    /// The longest pause QEMU may plan for at switchover.
    pub async fn set_max_downtime(&self, domain: &str, ms: u64) -> Result<()> {
        self.virsh(&["migrate-setmaxdowntime", domain, &ms.to_string()])
            .await
            .map(drop)
    }

    /// The running migration job's figures (`completed`: the last job's, once it ended).
    pub async fn job(&self, domain: &str, completed: bool) -> Result<JobStats> {
        let mut args = vec!["domjobinfo", domain, "--rawstats"];
        if completed {
            // Reading a completed job's figures removes them unless told to keep them.
            args.extend(["--completed", "--keep-completed"]);
        }
        Ok(JobStats::parse(&self.virsh(&args).await?))
    }

    /// Stops the domain's running job (a migration: the source keeps running).
    pub async fn abort_job(&self, domain: &str) -> Result<()> {
        self.virsh(&["domjobabort", domain]).await.map(drop)
    }

    /// Every disk target of the domain (`vda`, ...), whatever its source.
    pub async fn disk_targets(&self, domain: &str) -> Result<Vec<String>> {
        let list = self.virsh(&["domblklist", domain, "--details"]).await?;
        Ok(list
            .lines()
            .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
            .collect())
    }

    /// Hot-plugs (`attach`) or unplugs the device described in `xml` (a file) in the running
    /// domain. An unplug completes when the guest lets the device go: see [`Self::disk_targets`].
    pub async fn hotplug(&self, domain: &str, xml: &Path, attach: bool) -> Result<()> {
        let verb = if attach {
            "attach-device"
        } else {
            "detach-device"
        };
        let file = xml.to_string_lossy();
        self.virsh(&[verb, domain, &file, "--live"]).await.map(drop)
    }

    /// The running domain's memory now (what its balloon leaves it), KiB: `dominfo`'s "Used
    /// memory".
    pub async fn memory_kib(&self, domain: &str) -> Result<u64> {
        let info = self.virsh(&["dominfo", domain]).await?;
        info.lines()
            .find_map(|l| {
                let rest = l.strip_prefix("Used memory:")?;
                rest.split_whitespace().next()?.parse().ok()
            })
            .with_context(|| format!("virsh dominfo {domain} shows no used memory"))
    }

    /// Sets the running domain's balloon target, KiB.
    pub async fn set_memory_kib(&self, domain: &str, kib: u64) -> Result<()> {
        self.virsh(&["setmem", domain, &kib.to_string(), "--live"])
            .await
            .map(drop)
    }

    /// One command to the guest's agent (qemu-guest-agent's JSON protocol); its reply.
    pub async fn guest_agent(
        &self,
        domain: &str,
        command: &serde_json::Value,
    ) -> Result<serde_json::Value> {
        let text = self
            .virsh(&["qemu-agent-command", domain, &command.to_string()])
            .await
            .context("the guest agent")?;
        serde_json::from_str(text.trim())
            .with_context(|| format!("the guest agent answered {:?}", text.trim()))
    }

    /// Starts `virsh migrate ARGS DOMAIN` (no time limit: it lasts as long as the migration).
    pub fn start_migrate(&self, domain: &str, args: &[String]) -> Result<Child> {
        Command::new("virsh")
            .args(["-q", "-c", &self.uri, "migrate", domain])
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("run virsh (libvirt's client)")
    }

    /// `virsh ARGS` on this daemon; its standard output.
    async fn virsh(&self, args: &[&str]) -> Result<String> {
        let out = tokio::time::timeout(
            VIRSH_TIMEOUT,
            Command::new("virsh")
                .args(["-q", "-c", &self.uri])
                .args(args)
                .kill_on_drop(true)
                .output(),
        )
        .await
        .with_context(|| format!("virsh {} did not answer within 10s", args.join(" ")))?
        .context("run virsh (libvirt's client)")?;
        if !out.status.success() {
            bail!("{}", virsh_error(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Bridged interfaces from `virsh domiflist` output: (MAC, bridge).
fn parse_domiflist(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields.as_slice() {
                [_iface, "bridge", source, _model, mac] => {
                    Some(((*mac).to_owned(), (*source).to_owned()))
                }
                _ => None,
            }
        })
        .collect()
}

/// The domains with an outgoing migration job at the libvirt daemon behind `socket`.
pub async fn outgoing_domains(socket: &Path) -> Result<Vec<String>> {
    Libvirt::new(socket).outgoing_domains().await
}

/// Whether `virsh domjobinfo`'s output shows a job: its `Job type` is not `None`.
fn job_runs(domjobinfo: &str) -> bool {
    domjobinfo.lines().any(|line| {
        line.strip_prefix("Job type:")
            .is_some_and(|kind| kind.trim() != "None")
    })
}

/// Whether a virsh error says the domain is unknown (rather than libvirt not answering).
pub fn is_unknown_domain(e: &anyhow::Error) -> bool {
    let text = format!("{e:#}");
    text.contains("failed to get domain") || text.contains("Domain not found")
}

/// virsh's error output as one line: "error: failed to get domain 'x'" and its cause.
pub fn virsh_error(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text
        .lines()
        .map(|l| l.trim().trim_start_matches("error: ").trim())
        .filter(|l| !l.is_empty())
        .collect();
    if lines.is_empty() {
        "virsh failed without a message".into()
    } else {
        lines.join(": ")
    }
}

impl JobStats {
    /// From `domjobinfo --rawstats` (`name: value` or `name=value` per line).
    pub fn parse(text: &str) -> JobStats {
        let fields: HashMap<&str, u64> = text
            .lines()
            .filter_map(|l| l.split_once([':', '=']))
            .filter_map(|(k, v)| Some((k.trim(), v.trim().parse().ok()?)))
            .collect();
        let get = |k: &str| fields.get(k).copied().unwrap_or(0);
        JobStats {
            memory_processed: get("memory_processed"),
            memory_remaining: get("memory_remaining"),
            memory_total: get("memory_total"),
            memory_iteration: get("memory_iteration"),
            disk_processed: get("disk_processed"),
            disk_total: get("disk_total"),
            cpu_throttle_pct: fields
                .get("auto_converge_throttle")
                .copied()
                .filter(|&p| p > 0),
            downtime_ms: fields.get("downtime").copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_stats_are_read_from_either_raw_form() {
        let colon = "Job type:         Unbounded\noperation: 1\nmemory_processed: 10\nmemory_remaining: 20\nmemory_total: 30\nmemory_iteration: 2\ndisk_total: 7\nauto_converge_throttle: 20\n";
        let s = JobStats::parse(colon);
        assert_eq!(
            (s.memory_processed, s.memory_remaining, s.memory_total),
            (10, 20, 30)
        );
        assert_eq!(
            (
                s.memory_iteration,
                s.disk_total,
                s.downtime_ms,
                s.cpu_throttle_pct
            ),
            (2, 7, None, Some(20))
        );
        let eq = JobStats::parse("downtime=123\nmemory_total=5\nauto_converge_throttle=0\n");
        assert_eq!(
            (eq.downtime_ms, eq.memory_total, eq.cpu_throttle_pct),
            (Some(123), 5, None)
        );
    }

    #[test]
    fn bridged_interfaces_are_read_from_domiflist() {
        let text = " Interface   Type      Source   Model    MAC\n\
                    -------------------------------------------------------------\n\
                    vnet0       bridge    fp1001   virtio   52:54:00:77:00:0b\n\
                    -           network   default  virtio   52:54:00:aa:bb:cc\n\
                    vnet2       bridge    br0      e1000    52:54:00:77:00:0c\n";
        assert_eq!(
            parse_domiflist(text),
            vec![
                ("52:54:00:77:00:0b".to_string(), "fp1001".to_string()),
                ("52:54:00:77:00:0c".to_string(), "br0".to_string())
            ]
        );
    }

    #[test]
    fn virsh_errors_become_one_line() {
        let e = virsh_error(b"error: failed to get domain 'nope'\n\n");
        assert_eq!(e, "failed to get domain 'nope'");
        let e = virsh_error(b"error: Failed to connect socket to '/x': No such file or directory\nerror: failed to connect to the hypervisor\n");
        assert_eq!(
            e,
            "Failed to connect socket to '/x': No such file or directory: failed to connect to the hypervisor"
        );
    }
}

/// One domain's counters from `virsh domstats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DomainUsage {
    pub cpu_time_ns: u64,
    pub mem_bytes: u64,
    /// What the guest could free (`MemAvailable`), when its balloon driver reports
    /// statistics (`<memballoon><stats period=...>`).
    pub usable_bytes: Option<u64>,
    /// QEMU's last completed dirty-rate measurement.
    pub dirty_rate: Option<DirtyRate>,
}

/// A completed dirty-rate measurement (`domstats --dirtyrate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirtyRate {
    /// When it started, by QEMU's clock: tells one measurement from the next.
    pub start_time: u64,
    pub mib_per_s: u64,
}

/// One domain's `virsh domstats --block`: `block.<n>.{rd,wr,fl}.{reqs,times}` summed over
/// its disks (times in ns).
fn parse_block_io(text: &str) -> Result<GuestIo> {
    let mut io = GuestIo::default();
    let mut count = None;
    let mut counted = std::collections::BTreeSet::new();
    for line in text.lines() {
        let Some((key, value)) = line.trim().split_once('=') else {
            continue;
        };
        let Some(field) = key.strip_prefix("block.") else {
            continue;
        };
        let number = |v: &str| {
            v.parse::<u64>()
                .with_context(|| format!("virsh domstats: {key}={value} is not a count"))
        };
        if field == "count" {
            count = Some(number(value)?);
            continue;
        }
        // block.<n>.<kind>.<what>
        let Some((disk, stat)) = field.split_once('.') else {
            continue;
        };
        let target = match stat {
            "rd.reqs" | "wr.reqs" | "fl.reqs" => &mut io.ops,
            "rd.times" | "wr.times" | "fl.times" => &mut io.busy_ns,
            _ => continue,
        };
        *target = target.saturating_add(number(value)?);
        counted.insert(disk.to_owned());
    }
    let Some(count) = count else {
        bail!("virsh domstats --block gave no block statistics");
    };
    // libvirt lists a disk without its counters when it could not ask QEMU: a sum without
    // them would read as the guest going idle.
    if (counted.len() as u64) < count {
        bail!(
            "virsh domstats --block gave the counters of {} of {count} disks",
            counted.len()
        );
    }
    Ok(io)
}

/// `virsh domstats` output: a `Domain: 'name'` line, then `  key=value` lines.
fn parse_domstats(text: &str) -> std::collections::HashMap<String, DomainUsage> {
    let mut out = std::collections::HashMap::new();
    let mut current: Option<(String, DomainUsage)> = None;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("Domain: ") {
            out.extend(current.take());
            current = Some((
                name.trim().trim_matches('\'').to_owned(),
                DomainUsage::default(),
            ));
            continue;
        }
        let (Some((_, usage)), Some((key, value))) =
            (current.as_mut(), line.trim().split_once('='))
        else {
            continue;
        };
        let Ok(value) = value.parse::<u64>() else {
            continue;
        };
        match key {
            "cpu.time" => usage.cpu_time_ns = value,
            // KiB; `balloon.current` is what the guest has, `balloon.maximum` its size.
            "balloon.current" => usage.mem_bytes = value.saturating_mul(1024),
            "balloon.maximum" if usage.mem_bytes == 0 => {
                usage.mem_bytes = value.saturating_mul(1024)
            }
            "balloon.usable" => usage.usable_bytes = Some(value.saturating_mul(1024)),
            // 2: measured (0 none yet, 1 measuring); the start time and rate follow.
            "dirtyrate.calc_status" => {
                usage.dirty_rate = (value == 2).then_some(DirtyRate {
                    start_time: 0,
                    mib_per_s: 0,
                });
            }
            "dirtyrate.calc_start_time" => {
                if let Some(r) = usage.dirty_rate.as_mut() {
                    r.start_time = value;
                }
            }
            "dirtyrate.megabytes_per_second" => {
                if let Some(r) = usage.dirty_rate.as_mut() {
                    r.mib_per_s = value;
                }
            }
            _ => {}
        }
    }
    out.extend(current);
    out
}

#[cfg(test)]
mod domstats_tests {
    use super::*;

    #[test]
    fn a_job_shows_by_its_type_and_none_is_no_job() {
        let running = "Job type:         Unbounded\nOperation:        Outgoing migration\n";
        assert!(job_runs(running));
        assert!(!job_runs("Job type:         None\n"));
        assert!(!job_runs(""));
    }

    #[test]
    fn block_domstats_sum_the_guests_operations_and_their_time_over_its_disks() {
        let text = "Domain: 'web'\n  block.count=2\n  block.0.name=vda\n  block.0.path=/var/lib/a.qcow2\n  block.0.rd.reqs=100\n  block.0.rd.bytes=409600\n  block.0.rd.times=5000000\n  block.0.wr.reqs=10\n  block.0.wr.bytes=40960\n  block.0.wr.times=2000000\n  block.0.fl.reqs=1\n  block.0.fl.times=300\n  block.0.allocation=123\n  block.1.name=vdb\n  block.1.rd.reqs=5\n  block.1.rd.times=700\n";
        assert_eq!(
            parse_block_io(text).unwrap(),
            GuestIo {
                ops: 116,
                busy_ns: 7_001_000,
            }
        );
        // A domain without disks says so; one that says nothing of blocks is an error.
        assert_eq!(
            parse_block_io("Domain: 'x'\n  block.count=0\n").unwrap(),
            GuestIo::default()
        );
        assert!(parse_block_io("Domain: 'x'\n").is_err());
        let short = parse_block_io(
            "  block.count=2\n  block.0.name=vda\n  block.0.rd.reqs=1\n  block.1.name=vdb\n",
        )
        .unwrap_err();
        assert_eq!(
            format!("{short:#}"),
            "virsh domstats --block gave the counters of 1 of 2 disks"
        );
        let bad = parse_block_io("  block.count=1\n  block.0.rd.reqs=lots\n").unwrap_err();
        assert_eq!(
            format!("{bad:#}"),
            "virsh domstats: block.0.rd.reqs=lots is not a count: invalid digit found in string"
        );
    }

    #[test]
    fn domstats_give_each_domain_its_cpu_time_and_memory() {
        let text = "Domain: 'web'\n  cpu.time=1500000000\n  cpu.user=1000\n  balloon.current=262144\n  balloon.maximum=524288\n  balloon.usable=102400\n  dirtyrate.calc_status=2\n  dirtyrate.calc_start_time=1534523\n  dirtyrate.calc_period=2\n  dirtyrate.megabytes_per_second=5\n\nDomain: 'db'\n  cpu.time=7\n  balloon.maximum=1024\n  dirtyrate.calc_status=1\n  dirtyrate.calc_start_time=9\n";
        let u = parse_domstats(text);
        assert_eq!(
            u["web"],
            DomainUsage {
                cpu_time_ns: 1_500_000_000,
                mem_bytes: 256 << 20,
                usable_bytes: Some(100 << 20),
                dirty_rate: Some(DirtyRate {
                    start_time: 1_534_523,
                    mib_per_s: 5,
                }),
            }
        );
        assert_eq!(
            u["db"],
            DomainUsage {
                cpu_time_ns: 7,
                mem_bytes: 1 << 20,
                usable_bytes: None,
                // Still measuring: nothing to report.
                dirty_rate: None,
            }
        );
    }
}
