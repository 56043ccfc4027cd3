//! The benchmark harness: one scenario end to end (VM with workload, warm-up, migrate, verify,
//! tear down), reported as one JSON object per migration in ARCHITECTURE.md's contract.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ferry_qemu::Accel;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::baseline::{self, MigrateOptions, System};
use crate::guest::{self, GuestLink, Heartbeats};
use crate::image::Image;
use crate::link::LinkConfig;
use crate::topology::{Lab, Site};
use crate::{floor, vm};

/// A guest workload, after the seeds' applications.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Workload {
    /// `zero`, `delta`, `ws`, `hot` or `idle` (see guest/content.h).
    pub pattern: String,
    /// Size of the region the dirtier owns.
    pub dirty_mib: u32,
    /// Dirtying rate; 0 = as fast as the guest CPU allows.
    pub rate_mib_s: f64,
}

/// The guest's disk writer: a file of `file_mib` MiB on the data disk, 4 KiB blocks rewritten
/// at random at `rate_mib_s` (O_DIRECT|O_DSYNC, like Iometer's random writes).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct DiskWriter {
    pub file_mib: u32,
    pub rate_mib_s: f64,
    /// A hot-set reader over the file's first this many MiB (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_hot_mib: u32,
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl Default for DiskWriter {
    fn default() -> Self {
        DiskWriter {
            file_mib: 16,
            rate_mib_s: 0.5,
            read_hot_mib: 0,
        }
    }
}

/// Patterns the guest dirtier knows.
pub const PATTERNS: [&str; 5] = ["zero", "delta", "ws", "hot", "idle"];

impl Workload {
    /// Checks the pattern name and sizes.
    pub fn validate(&self, mem_mib: u32) -> Result<()> {
        if !PATTERNS.contains(&self.pattern.as_str()) {
            bail!(
                "unknown workload {:?} (known: {})",
                self.pattern,
                PATTERNS.join(", ")
            );
        }
        if self.dirty_mib == 0 || self.dirty_mib + 64 > mem_mib {
            bail!("--dirty-mib {} must be at least 1 and leave 64 MiB of the guest's {mem_mib} MiB to its kernel", self.dirty_mib);
        }
        if !(self.rate_mib_s.is_finite() && self.rate_mib_s >= 0.0) {
            bail!(
                "--dirty-rate-mib-s {} must be a non-negative number",
                self.rate_mib_s
            );
        }
        Ok(())
    }

    /// The guest command that starts it.
    pub fn start_command(&self) -> String {
        format!(
            "mem start pattern={} mib={} rate={}",
            self.pattern, self.dirty_mib, self.rate_mib_s
        )
    }
}

/// Boots a VM at site A, waits for its agent and starts the workload. Returns the record and
/// a serial link to the guest.
pub async fn boot_with_workload(
    lab: &Lab,
    name: &str,
    opts: &vm::VmOptions,
    img: &Image,
    workload: &Workload,
    disk_writer: Option<DiskWriter>,
) -> Result<(vm::VmRecord, GuestLink)> {
    let rec = vm::start(lab, name, Site::A, opts, img).await?;
    let link = GuestLink::connect(&rec.spec.serial_socket, Arc::new(Heartbeats::default())).await?;
    link.wait_ready(Duration::from_secs(120)).await?;
    // Filling the region touches every page once under TCG: allow a minute or two.
    link.call(&workload.start_command(), Duration::from_secs(180))
        .await?;
    if let Some(w) = disk_writer {
        // The initial fill writes the whole file once (O_DIRECT, under TCG): allow minutes.
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
    }
    Ok((rec, link))
}

/// One benchmark migration, as the contract's JSON object.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRecord {
    pub system: String,
    pub workload: String,
    pub link: LinkSummary,
    pub mem_mib: u32,
    pub disk_mib: u32,
    pub dirty_mib: u32,
    pub dirty_rate_mib_s: f64,
    /// completed, total_ms, downtime_ms, qemu_downtime_ms, guest_gap_ms, wan_bytes,
    /// iterations, error: at the top level of the JSON object.
    #[serde(flatten)]
    pub outcome: baseline::MigrationOutcome,
    pub verify_errors: Option<u64>,
    pub floor_bytes: u64,
    pub floor_ms: f64,
    /// CPU seconds the QEMUs and the agents spent during the migration, and per GB on the WAN.
    pub cpu: crate::cpu::MigrationCpu,
    pub accel: Accel,
    pub run: u32,
    /// ferry: how the switchover was decided (`target`: the agent steers QEMU's rule to the
    /// real downtime target; `qemu-rule`; `smart-stop`), with `+converge` when QEMU could
    /// throttle the guest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub switchover: Option<String>,
    /// `return`: the way back to the first site after a migration away from it (none: the
    /// way there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leg: Option<String>,
    /// On the way back: percent of the guest's pages that changed since it arrived at the
    /// other site (measured on its memory file just before the migration back started).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changed_pct: Option<f64>,
    /// With disks: how the guest's writes were mirrored (ferry: async, sync, cloudnet; QEMU's
    /// mirror: background, write-blocking).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_mode: Option<String>,
    /// With a disk on a template: the data the template holds and how many images deep it
    /// is (the VM's own overlay not counted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_template: Option<DiskTemplate>,
    /// With a disk writer: its file and rate, and the latency of its writes during the
    /// migration (from the migrate request to the destination's verifiers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_writer: Option<DiskWriter>,
    /// With a hot-set reader: its reads per second before the migration (the warm-up, or the
    /// time at the other site); `disk_write_latency.reads_per_s` is during it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_reads_before_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_write_latency: Option<guest::DiskLatency>,
    /// On the way back with a disk: percent of its blocks that differ from the copy the VM
    /// left at the site it returns to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_changed_pct: Option<f64>,
    /// The WAN's rate between a tenth and nine tenths of the migration's bytes, Mbit/s: whether
    /// the bulk of it kept the link full ([`ferry_api::timeline::Timeline::bulk_rate_mbit`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wan_bulk_mbit: Option<f64>,
    /// The WAN was down this many seconds once the VM ran at the destination in postcopy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outage_in_postcopy_s: Option<u64>,
}

/// Once the migration's phase says the VM runs at the destination in postcopy (ferry's
/// `postcopy`, which follows the commit; QEMU's own once the lab resumed the destination),
/// takes the WAN down for `length`, then brings it back. The WAN comes back however this
/// ends, the migration's end dropping it included.
async fn outage_in_postcopy(
    lab: &Lab,
    mut progress: watch::Receiver<baseline::Progress>,
    length: Duration,
    came: &std::sync::atomic::AtomicBool,
) -> Result<()> {
    progress
        .wait_for(|p| {
            p.phase.starts_with("postcopy") || p.phase.ends_with(baseline::DESTINATION_RUNS)
        })
        .await
        .context("the migration's progress ended before postcopy")?;
    struct WanBack(std::path::PathBuf);
    impl Drop for WanBack {
        fn drop(&mut self) {
            if let Err(e) = crate::wan::control(&self.0, &crate::wan::ControlRequest::Up) {
                eprintln!("bench: the WAN did not come back up after the outage: {e:#}");
            }
        }
    }
    let socket = lab.wan_socket();
    crate::wan::control(&socket, &crate::wan::ControlRequest::Down)?;
    let back = WanBack(socket);
    came.store(true, std::sync::atomic::Ordering::Relaxed);
    // The fault's length, not a wait for readiness.
    tokio::time::sleep(length).await;
    drop(back);
    Ok(())
}

/// A disk's template, as the record names it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DiskTemplate {
    pub data_mib: u32,
    pub layers: u32,
}

/// The link fields of the contract.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LinkSummary {
    pub rate_mbit: f64,
    pub rtt_ms: f64,
    pub loss_pct: f64,
    /// The sites' default congestion control, when the bench set it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_congestion: Option<crate::link::Congestion>,
    /// The sites coalesced the frames they received (GRO), when the bench asked for it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub receive_gro: bool,
    /// The sites' receive autotuning limit in MiB, when the bench set one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_tcp_rmem_max_mib: Option<u32>,
    /// The agents ran without `CAP_NET_ADMIN`, when the bench asked for it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub agents_without_net_admin: bool,
}

/// One scenario's settings.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub system: System,
    pub workload: Workload,
    pub vm: vm::VmOptions,
    pub link: LinkConfig,
    pub warmup: Duration,
    pub migrate: MigrateOptions,
    pub run: u32,
    /// Write each migration's timeline here, if set.
    pub timeline_dir: Option<std::path::PathBuf>,
    /// Migrate back once this percent of the guest's pages changed at the other site.
    pub return_after_pct: Option<f64>,
    /// Or migrate back after this many seconds at the other site.
    pub return_after_s: Option<u64>,
    /// Once the VM runs at the destination in postcopy, the WAN goes down for this long.
    pub outage_in_postcopy: Option<Duration>,
    /// With a disk: the guest's writer.
    pub disk_writer: DiskWriter,
}

/// Runs one scenario in a lab that is already up: one record for the way there, and one for
/// the way back when the scenario asks for it. The VM is removed afterwards, whatever happened.
pub async fn run_scenario(lab: &Lab, img: &Image, sc: &Scenario) -> Result<Vec<BenchRecord>> {
    let name = format!("bench{}", sc.run);
    let result = scenario_inner(lab, img, sc, &name).await;
    let _ = vm::stop(lab, &name);
    result
}

async fn scenario_inner(
    lab: &Lab,
    img: &Image,
    sc: &Scenario,
    name: &str,
) -> Result<Vec<BenchRecord>> {
    let writer = sc.vm.disk.then_some(sc.disk_writer);
    let (_, link) = boot_with_workload(lab, name, &sc.vm, img, &sc.workload, writer).await?;
    tokio::time::sleep(sc.warmup).await;
    let (there, link) = measured_migration(lab, sc, name, Site::B, link, None).await?;
    let mut records = vec![there];
    if !records[0].outcome.completed {
        return Ok(records);
    }
    let changed = match (sc.return_after_pct, sc.return_after_s) {
        (Some(pct), _) => wait_for_changes(lab, name, pct).await?,
        (None, Some(secs)) => {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            mem_changed_pct(lab, name).await?
        }
        (None, None) => return Ok(records),
    };
    let (back, _) = measured_migration(lab, sc, name, Site::A, link, Some(changed)).await?;
    records.push(back);
    Ok(records)
}

/// The switchover policy of ferry's options, as the record names it.
fn switchover_policy(o: &baseline::MigrateOptions) -> String {
    let rule = if o.settings.qemu_switchover_rule {
        "qemu-rule"
    } else {
        "target"
    };
    let mut p = rule.to_owned();
    if o.settings.smart_stop {
        p.push_str("+smart-stop");
    }
    if o.settings.converge {
        p.push_str("+converge");
    }
    p
}

/// Percent of the guest's pages that differ from the image its first site kept (the seed),
/// for a return after a fixed time.
async fn mem_changed_pct(lab: &Lab, name: &str) -> Result<f64> {
    let rec = vm::load(lab, name)?;
    let mem_file = rec
        .spec
        .mem_file
        .context("bench VMs have a shared memory file")?;
    let seed = crate::agents::seed_dir(lab, Site::A).join(format!("{name}.ram"));
    tokio::task::spawn_blocking(move || -> Result<f64> {
        let Ok(before) = std::fs::read(&seed) else {
            return Ok(f64::NAN);
        };
        Ok(floor::changed_pct(&before, &std::fs::read(&mem_file)?))
    })
    .await?
}

/// Percent of the disk's 4 KiB blocks that differ between the copy the VM left at `kept`
/// and the one it runs on now (read through qemu-img, sparse raw copies in /tmp).
async fn disk_changed_pct(lab: &Lab, name: &str, kept: Site) -> Result<Option<f64>> {
    let rec = vm::load(lab, name)?;
    let (Some(now), Some(old)) = (
        rec.spec.disks.first().map(|d| d.path.clone()),
        vm::spec_at(lab, &rec, kept)
            .disks
            .first()
            .map(|d| d.path.clone()),
    ) else {
        return Ok(None);
    };
    if !old.exists() {
        return Ok(None);
    }
    tokio::task::spawn_blocking(move || -> Result<Option<f64>> {
        let raw = |p: &std::path::Path, tag: &str| -> Result<Vec<u8>> {
            let out =
                std::env::temp_dir().join(format!("ferry-bench-{}-{tag}.raw", std::process::id()));
            crate::sh::run(
                "qemu-img",
                &[
                    "convert",
                    "-U",
                    "-O",
                    "raw",
                    &p.to_string_lossy(),
                    &out.to_string_lossy(),
                ],
            )?;
            let bytes = std::fs::read(&out)?;
            let _ = std::fs::remove_file(&out);
            Ok(bytes)
        };
        Ok(Some(floor::changed_pct(
            &raw(&old, "old")?,
            &raw(&now, "now")?,
        )))
    })
    .await?
}

/// Keeps a copy of the guest's memory as it arrived, then waits until `pct` percent of its
/// pages differ from it; returns the percent reached.
async fn wait_for_changes(lab: &Lab, name: &str, pct: f64) -> Result<f64> {
    let mem_file = vm::load(lab, name)?
        .spec
        .mem_file
        .context("bench VMs have a shared memory file")?;
    let arrived = std::fs::read(&mem_file)
        .with_context(|| format!("read guest memory {}", mem_file.display()))?;
    let arrived = Arc::new(arrived);
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (file, before) = (mem_file.clone(), arrived.clone());
        let changed = tokio::task::spawn_blocking(move || -> Result<f64> {
            let now = std::fs::read(&file)?;
            Ok(floor::changed_pct(&before, &now))
        })
        .await??;
        if changed >= pct {
            return Ok(changed);
        }
        if std::time::Instant::now() > deadline {
            bail!("only {changed:.1}% of the guest's pages changed in 600 s (waiting for {pct}%)");
        }
    }
}

/// Migrates the VM to `to` and measures it: floor first, verifiers after.
async fn measured_migration(
    lab: &Lab,
    sc: &Scenario,
    name: &str,
    to: Site,
    link: GuestLink,
    changed_pct: Option<f64>,
) -> Result<(BenchRecord, GuestLink)> {
    let mem_file = vm::load(lab, name)?
        .spec
        .mem_file
        .context("bench VMs have a shared memory file")?;
    let floor_bytes = tokio::task::spawn_blocking(move || floor::floor_bytes(&mem_file)).await??;
    let (tx, rx) = watch::channel(baseline::Progress::default());
    let mut opts = sc.migrate.clone();
    opts.set_system(sc.system);
    let timeline = std::sync::Mutex::default();
    let disk_changed_pct = match (sc.vm.disk, changed_pct) {
        (true, Some(_)) => disk_changed_pct(lab, name, to).await?,
        _ => None,
    };
    // The hot-set reader's throughput since the last reset (the warm-up, or the time at the
    // other site after the last leg's verifier), without a migration.
    let disk_reads_before_per_s = if sc.vm.disk && sc.disk_writer.read_hot_mib > 0 {
        guest::disk_latency(&link).await?.reads_per_s
    } else {
        None
    };
    if sc.vm.disk {
        guest::reset_disk_latency(&link).await?;
    }
    let outage_came = std::sync::atomic::AtomicBool::new(false);
    let migrate = async {
        let migrate = baseline::migrate(lab, name, to, &opts, link, &tx, &timeline);
        let Some(length) = sc.outage_in_postcopy else {
            return migrate.await;
        };
        tokio::pin!(migrate);
        tokio::select! {
            result = &mut migrate => result,
            outage = outage_in_postcopy(lab, rx, length, &outage_came) => {
                // The migration goes on either way; a failed outage shows in the record.
                if let Err(e) = outage {
                    eprintln!("bench: no outage in postcopy: {e:#}");
                }
                migrate.await
            }
        }
    };
    let (result, cpu) = crate::cpu::measure(lab, name, to.other(), migrate).await;
    let outage_in_postcopy_s = outage_came
        .into_inner()
        .then(|| sc.outage_in_postcopy.map(|d| d.as_secs()))
        .flatten();
    let leg = changed_pct.map(|_| "return".to_owned());
    if let Some(dir) = &sc.timeline_dir {
        let stem = format!(
            "{}-{}-run{}{}",
            sc.workload.pattern,
            sc.system.name(),
            sc.run,
            leg.as_deref().map_or(String::new(), |l| format!("-{l}")),
        );
        baseline::write_timeline(&unused_path(dir, &stem), &timeline)?;
    }
    let wan_bulk_mbit = timeline.lock().expect("timeline poisoned").bulk_rate_mbit();
    let (outcome, dst_link) = result?;
    let disk_write_latency = if sc.vm.disk {
        Some(guest::disk_latency(&dst_link).await?)
    } else {
        None
    };
    let verify_errors = if outcome.completed {
        Some(guest::verify(&dst_link, sc.vm.disk).await?.errors())
    } else {
        None
    };
    if sc.vm.disk && sc.disk_writer.read_hot_mib > 0 {
        // The verifier's full read is not the time at this site: the next leg's "before"
        // starts after it.
        guest::reset_disk_latency(&dst_link).await?;
    }
    let cpu = cpu.with_wan_bytes(outcome.wan_bytes);
    let record = BenchRecord {
        system: sc.system.name(),
        workload: sc.workload.pattern.clone(),
        link: LinkSummary {
            rate_mbit: sc.link.rate_mbit,
            rtt_ms: sc.link.rtt_ms,
            loss_pct: sc.link.loss_pct,
            host_congestion: sc.link.host_congestion,
            receive_gro: sc.link.receive_gro,
            host_tcp_rmem_max_mib: sc.link.host_tcp_rmem_max_mib,
            agents_without_net_admin: sc.link.agents_without_net_admin,
        },
        mem_mib: sc.vm.mem_mib,
        disk_mib: match (sc.vm.disk, sc.vm.disk_mib) {
            (false, _) => 0,
            (true, Some(mib)) => mib,
            (true, None) => u32::try_from(crate::image::DATA_DISK_MIB).unwrap_or(0),
        },
        dirty_mib: sc.workload.dirty_mib,
        dirty_rate_mib_s: sc.workload.rate_mib_s,
        outcome,
        verify_errors,
        floor_bytes,
        floor_ms: floor::floor_ms(floor_bytes, sc.link.rate_mbit),
        cpu,
        accel: sc.vm.accel,
        run: sc.run,
        switchover: matches!(sc.system, System::Ferry { .. })
            .then(|| switchover_policy(&sc.migrate)),
        leg,
        changed_pct,
        disk_mode: sc.vm.disk.then(|| match sc.system {
            System::Ferry { .. }
                if !sc.migrate.settings.disk_background_copy
                    && sc.migrate.settings.disk_mode != ferry_api::agent::DiskMode::Sync =>
            {
                format!("{} blocking-copy", sc.migrate.settings.disk_mode.name())
            }
            System::Ferry { .. } => match sc.migrate.settings.disk_pacing_floor_pct {
                Some(pct) => format!("{} paced {pct}%", sc.migrate.settings.disk_mode.name()),
                None => sc.migrate.settings.disk_mode.name().to_owned(),
            },
            System::Qemu(_) => {
                let copy = if sc.migrate.qemu_mirror_write_blocking {
                    "write-blocking"
                } else {
                    "background"
                };
                if sc.migrate.qemu_mirror_top {
                    format!("{copy} top")
                } else {
                    copy.into()
                }
            }
        }),
        disk_template: sc.vm.disk_template_mib.map(|data_mib| DiskTemplate {
            data_mib,
            layers: sc.vm.disk_template_layers,
        }),
        disk_writer: sc.vm.disk.then_some(sc.disk_writer),
        disk_write_latency,
        disk_reads_before_per_s,
        disk_changed_pct,
        wan_bulk_mbit,
        outage_in_postcopy_s,
    };
    Ok((record, dst_link))
}

/// `dir/stem.json`, or `dir/stem-2.json` and so on when that exists: a second bench writing
/// into the same directory (say, the same workload with and without a disk) keeps the first
/// one's timelines.
fn unused_path(dir: &std::path::Path, stem: &str) -> std::path::PathBuf {
    let mut path = dir.join(format!("{stem}.json"));
    let mut n = 2;
    while path.exists() {
        path = dir.join(format!("{stem}-{n}.json"));
        n += 1;
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timelines_never_overwrite_each_other() {
        let dir = std::env::temp_dir().join(format!("ferry-unused-path-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = unused_path(&dir, "ws-ferry-run1");
        assert_eq!(first, dir.join("ws-ferry-run1.json"));
        std::fs::write(&first, b"{}").unwrap();
        let second = unused_path(&dir, "ws-ferry-run1");
        assert_eq!(second, dir.join("ws-ferry-run1-2.json"));
        std::fs::write(&second, b"{}").unwrap();
        assert_eq!(
            unused_path(&dir, "ws-ferry-run1"),
            dir.join("ws-ferry-run1-3.json")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
