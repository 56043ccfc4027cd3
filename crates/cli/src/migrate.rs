//! `ferry migrate VM --to SITE`.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::Args;
use ferry_lab::baseline::{self, MigrateOptions, MigrationOutcome, Progress, QemuMode};
use ferry_lab::guest::{self, GuestLink, Heartbeats, VerifyOutcome};
use ferry_lab::{vm, Lab, Site};
use tokio::sync::watch;

use crate::report;
use crate::settings_flags::SettingsFlags;

/// Migration flags shared by `migrate`, `bench` and `demo`: the system, and its settings.
#[derive(Args, Debug, Clone)]
pub struct MigrationFlags {
    /// Which system migrates: `ferry` (through the sites' agents) or `qemu` (QEMU's own
    /// migration straight across the WAN, in --mode).
    #[arg(long, default_value = "ferry")]
    pub system: String,
    /// QEMU's migration mode (with --system qemu): plain, xbzrle, multifd or multifd-zstd.
    #[arg(long, default_value = "plain")]
    pub mode: String,
    /// QEMU's own migration, VMs with disks: run the mirror in write-blocking copy mode (each
    /// guest write waits for the destination) instead of background.
    #[arg(long)]
    pub qemu_mirror_write_blocking: bool,
    #[command(flatten)]
    pub settings: SettingsFlags,
}

impl MigrationFlags {
    /// Validated options.
    pub fn options(&self) -> Result<MigrateOptions> {
        let ferry = match self.system.as_str() {
            "qemu" => false,
            "ferry" => true,
            other => bail!("unknown --system {other:?} (known: ferry, qemu)"),
        };
        Ok(MigrateOptions {
            ferry,
            mode: QemuMode::parse(&self.mode)?,
            qemu_mirror_write_blocking: self.qemu_mirror_write_blocking,
            settings: self.settings.settings()?,
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
