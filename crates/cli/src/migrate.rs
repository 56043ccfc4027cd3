//! `ferry migrate VM --to SITE`.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::Args;
use ferry_api::agent::DiskMode;
use ferry_lab::baseline::{self, MigrateOptions, MigrationOutcome, Progress, QemuMode};
use ferry_lab::guest::{self, GuestLink, Heartbeats, VerifyOutcome};
use ferry_lab::{vm, Lab, Site};
use tokio::sync::watch;

use crate::report;

/// Migration flags shared by `migrate`, `bench` and `demo`.
#[derive(Args, Debug, Clone)]
pub struct MigrationFlags {
    /// Which system migrates: `ferry` (through the sites' agents) or `qemu` (QEMU's own
    /// migration straight across the WAN, in --mode).
    #[arg(long, default_value = "ferry")]
    pub system: String,
    /// ferry: TCP connections across the WAN.
    #[arg(long, default_value_t = ferry_api::agent::default_connections())]
    pub connections: u32,
    /// ferry: how long the WAN may be down before the migration fails (the source keeps running).
    #[arg(long, default_value_t = 120)]
    pub wan_timeout_s: u64,
    /// Test hook (ferry): flip one bit of the stream at this byte offset, after the source
    /// hashed it, to show that the digest check stops the migration.
    #[arg(long, hide = true)]
    pub test_corrupt_at: Option<u64>,
    /// ferry: turn QEMU's return path on (the destination QEMU confirms it loaded the stream
    /// before the source completes; costs a round trip of downtime).
    #[arg(long)]
    pub return_path: bool,
    /// ferry: the codec's techniques on the WAN: all, none (QEMU's bytes as they are), or a
    /// comma-separated list of zero, dedup, delta, zstd, seed (pages the destination still
    /// holds from the VM's earlier stay there go as references).
    #[arg(long, default_value = "all")]
    pub codec: String,
    /// ferry, with seeding: index this VM's earlier image at the destination instead of the
    /// migrating VM's own (a sibling made from the same template).
    #[arg(long)]
    pub seed_from: Option<String>,
    /// QEMU's migration mode (with --system qemu): plain, xbzrle, multifd or multifd-zstd.
    #[arg(long, default_value = "plain")]
    pub mode: String,
    /// Downtime target, ms (300 is QEMU's default). ferry: the real pause, source STOP to
    /// destination RESUME, which the agent meets by steering QEMU's downtime-limit; qemu (or
    /// ferry with --qemu-switchover-rule): QEMU's own downtime-limit.
    #[arg(long, default_value_t = 300)]
    pub downtime_ms: u64,
    /// ferry: leave the switchover to QEMU's own rule, --downtime-ms as its limit (for
    /// comparison).
    #[arg(long)]
    pub qemu_switchover_rule: bool,
    /// ferry: CloudNet's smart stop: once the guest rewrites memory faster than it travels,
    /// switch over at the first pass with fewer pages left than each of the 4 before it, even
    /// if the pause then exceeds --downtime-ms (use with --no-converge to compare with
    /// throttling).
    #[arg(long)]
    pub smart_stop: bool,
    /// ferry: never throttle the guest (by default QEMU's auto-converge slows its vCPUs, only
    /// as far as needed, when it dirties memory faster than the link carries it).
    #[arg(long)]
    pub no_converge: bool,
    /// ferry, VMs with disks: how the guest's writes during the migration reach the
    /// destination: async (XvMotion: a write completes once in the source agent's bounded
    /// buffer), sync (once the destination applied it), cloudnet (async during the disk's bulk
    /// copy, sync from the memory phase on).
    #[arg(long, default_value = "async")]
    pub disk_mode: String,
    /// ferry, VMs with disks: the source agent's disk transmit buffer, MiB (async mode's bound).
    #[arg(long, default_value_t = 16)]
    pub disk_buffer_mib: u64,
    /// QEMU's own migration, VMs with disks: run the mirror in write-blocking copy mode (each
    /// guest write waits for the destination) instead of background.
    #[arg(long)]
    pub qemu_mirror_write_blocking: bool,
    /// Give up after this many seconds; the source keeps running.
    #[arg(long, default_value_t = 900)]
    pub timeout_s: u64,
}

impl MigrationFlags {
    /// Validated options.
    pub fn options(&self) -> Result<MigrateOptions> {
        let ferry = match self.system.as_str() {
            "qemu" => false,
            "ferry" => true,
            other => bail!("unknown --system {other:?} (known: ferry, qemu)"),
        };
        if !(1..=64).contains(&self.connections) {
            bail!(
                "--connections {} is out of range; use 1 to 64",
                self.connections
            );
        }
        if !(1..=60_000).contains(&self.downtime_ms) {
            bail!(
                "--downtime-ms {} is out of range; use 1 to 60000",
                self.downtime_ms
            );
        }
        if self.timeout_s == 0 {
            bail!("--timeout-s must be at least 1");
        }
        let Some(disk_mode) = DiskMode::parse(&self.disk_mode) else {
            bail!(
                "unknown --disk-mode {:?} (known: async, sync, cloudnet)",
                self.disk_mode
            );
        };
        if !(1..=4096).contains(&self.disk_buffer_mib) {
            bail!(
                "--disk-buffer-mib {} is out of range; use 1 to 4096",
                self.disk_buffer_mib
            );
        }
        Ok(MigrateOptions {
            ferry,
            connections: self.connections,
            wan_timeout_s: self.wan_timeout_s,
            test_corrupt_at: self.test_corrupt_at,
            return_path: self.return_path,
            qemu_switchover_rule: self.qemu_switchover_rule,
            smart_stop: self.smart_stop,
            converge: !self.no_converge,
            seed_from: self.seed_from.clone(),
            disk_mode,
            disk_buffer_mib: self.disk_buffer_mib,
            qemu_mirror_write_blocking: self.qemu_mirror_write_blocking,
            codec: self
                .codec
                .parse()
                .map_err(|e: String| anyhow::anyhow!("--codec: {e}"))?,
            mode: QemuMode::parse(&self.mode)?,
            downtime_limit_ms: self.downtime_ms,
            timeout_s: self.timeout_s,
            ..MigrateOptions::default()
        })
    }
}

#[derive(Args)]
pub struct MigrateArgs {
    /// The VM to move.
    vm: String,
    /// The site to move it to.
    #[arg(long)]
    to: String,
    #[command(flatten)]
    flags: MigrationFlags,
    /// Skip the guest's verifiers after the migration.
    #[arg(long)]
    no_verify: bool,
    /// Print the outcome as JSON instead of the report.
    #[arg(long)]
    json: bool,
    /// Where to write the migration's timeline (default: the lab's timelines directory).
    #[arg(long)]
    timeline: Option<std::path::PathBuf>,
}

pub async fn run(a: MigrateArgs) -> Result<ExitCode> {
    let opts = a.flags.options()?;
    let to = Site::parse(&a.to)?;
    let lab = Lab::from_env();
    let rec = vm::load(&lab, &a.vm)?;
    if rec.site == to {
        bail!("VM {:?} already runs at site {}", a.vm, to.name());
    }
    let src = GuestLink::connect(&rec.spec.serial_socket, Arc::new(Heartbeats::default())).await?;
    let timeline_path = a.timeline.clone().unwrap_or_else(|| {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        lab.dir()
            .join("timelines")
            .join(format!("{}-{ms}.json", a.vm))
    });
    let (outcome, verify) = migrate_with_progress(
        &lab,
        &a.vm,
        to,
        &opts,
        src,
        !a.json,
        !a.no_verify,
        Some(&timeline_path),
    )
    .await?;
    let system = opts.system().name();
    if a.json {
        let v = serde_json::json!({ "system": system, "outcome": outcome, "verify": verify, "timeline": timeline_path });
        println!("{v}");
    } else {
        report::print_report(&system, &outcome, verify.as_ref(), None);
        println!(
            "  timeline             {} (draw it: ferry report FILE)",
            timeline_path.display()
        );
    }
    Ok(exit_code(&outcome, verify.as_ref()))
}

/// 0 when the migration completed and the verifiers found nothing, else 3.
pub fn exit_code(o: &MigrationOutcome, v: Option<&VerifyOutcome>) -> ExitCode {
    if o.completed && v.is_none_or(|v| v.errors() == 0) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(crate::EXIT_MIGRATION_FAILED)
    }
}

/// Migrates with a live progress bar (when `bar`), writes the timeline (when a path is given,
/// whether or not the migration succeeded), then runs the verifiers (when `verify`).
#[allow(clippy::too_many_arguments)]
pub async fn migrate_with_progress(
    lab: &Lab,
    name: &str,
    to: Site,
    opts: &MigrateOptions,
    src: GuestLink,
    bar: bool,
    verify: bool,
    timeline_path: Option<&std::path::Path>,
) -> Result<(MigrationOutcome, Option<VerifyOutcome>)> {
    let (tx, rx) = watch::channel(Progress::default());
    let drawer = bar.then(|| tokio::spawn(report::progress_bar(rx)));
    let has_disk = vm::load(lab, name)?.has_disk();
    let timeline = std::sync::Mutex::default();
    let result = baseline::migrate(lab, name, to, opts, src, &tx, &timeline).await;
    drop(tx);
    if let Some(d) = drawer {
        let _ = d.await;
    }
    if let Some(path) = timeline_path {
        baseline::write_timeline(path, &timeline)?;
    }
    let (outcome, link) = result?;
    let verify = if verify && outcome.completed {
        Some(guest::verify(&link, has_disk).await?)
    } else {
        None
    };
    Ok((outcome, verify))
}
