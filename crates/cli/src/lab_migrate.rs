//! `ferry migrate VM --to SITE` for the lab's VMs (with the guest's verifiers), and the
//! migration flags of `bench` and `demo`.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::Args;
use ferry_lab::baseline::{self, MigrateOptions, MigrationOutcome, Progress, QemuMode};
use ferry_lab::guest::{self, GuestLink, Heartbeats, VerifyOutcome};
use ferry_lab::tcpseq::TcpSeqStats;
use ferry_lab::{vm, Lab, Site};
use tokio::sync::watch;

use crate::report;
use crate::settings_flags::SettingsFlags;

/// Which system moves a lab VM.
#[derive(Args, Debug, Clone)]
pub struct SystemFlags {
    /// Lab VMs: which system migrates: `ferry` (through the sites' agents) or `qemu` (QEMU's
    /// own migration straight across the WAN, in --mode).
    #[arg(long, default_value = "ferry")]
    pub system: String,
    /// Lab VMs, QEMU's migration mode (with --system qemu): plain, xbzrle, multifd,
    /// multifd-zstd or postcopy (plain, switching to postcopy after the first pass).
    #[arg(long, default_value = "plain")]
    pub mode: String,
    /// Lab VMs, QEMU's own migration with disks: run the mirror in write-blocking copy mode
    /// (each guest write waits for the destination) instead of background.
    #[arg(long)]
    pub qemu_mirror_write_blocking: bool,
    /// Lab VMs, QEMU's own migration with disks on a template: copy only the top image
    /// (`sync=top`, libvirt's `--copy-storage-inc`) into an overlay on the destination site's
    /// copy of the template, trusting that it holds the same bytes.
    #[arg(long)]
    pub qemu_mirror_top: bool,
}

/// Migration flags shared by `bench` and `demo`: the system, and its settings.
#[derive(Args, Debug, Clone)]
pub struct MigrationFlags {
    #[command(flatten)]
    pub system: SystemFlags,
    #[command(flatten)]
    pub settings: SettingsFlags,
}

impl MigrationFlags {
    /// Validated options.
    pub fn options(&self) -> Result<MigrateOptions> {
        options(&self.system, &self.settings)
    }
}

/// The lab's options from the flags, validated.
pub fn options(system: &SystemFlags, settings: &SettingsFlags) -> Result<MigrateOptions> {
    let ferry = match system.system.as_str() {
        "qemu" => false,
        "ferry" => true,
        other => bail!("unknown --system {other:?} (known: ferry, qemu)"),
    };
    Ok(MigrateOptions {
        ferry,
        mode: QemuMode::parse(&system.mode)?,
        qemu_mirror_write_blocking: system.qemu_mirror_write_blocking,
        qemu_mirror_top: system.qemu_mirror_top,
        settings: settings.settings()?,
        ..MigrateOptions::default()
    })
}

/// `ferry migrate` flags only lab VMs take.
#[derive(Args, Debug, Clone)]
pub struct LabFlags {
    #[command(flatten)]
    pub system: SystemFlags,
    /// Lab VMs: skip the guest's verifiers after the migration.
    #[arg(long)]
    pub no_verify: bool,
}

/// `ferry migrate VM --to SITE` for a VM of the lab.
pub async fn run(
    vm_name: &str,
    to: &str,
    lab_flags: &LabFlags,
    settings: &SettingsFlags,
    json: bool,
    timeline: Option<std::path::PathBuf>,
) -> Result<ExitCode> {
    let opts = options(&lab_flags.system, settings)?;
    let to = Site::parse(to)?;
    let lab = Lab::from_env();
    let rec = vm::load(&lab, vm_name)?;
    if rec.site == to {
        bail!("VM {vm_name:?} already runs at site {}", to.name());
    }
    let src = GuestLink::connect(&rec.spec.serial_socket, Arc::new(Heartbeats::default())).await?;
    let timeline_path = timeline.unwrap_or_else(|| {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        lab.dir()
            .join("timelines")
            .join(format!("{vm_name}-{ms}.json"))
    });
    let (outcome, verify) = migrate_with_progress(
        &lab,
        vm_name,
        to,
        &opts,
        src,
        !json,
        !lab_flags.no_verify,
        Some(&timeline_path),
    )
    .await?;
    let system = opts.system().name();
    if json {
        let v = serde_json::json!({ "system": system, "outcome": outcome, "verify": verify, "timeline": timeline_path });
        println!("{v}");
    } else {
        report::print_report(&system, &outcome, EMULATOR);
        print_guest_checks(verify.as_ref(), None);
        println!(
            "  timeline             {} (draw it: ferry report FILE)",
            timeline_path.display()
        );
    }
    Ok(exit_code(&outcome, verify.as_ref()))
}

/// Who counts the lab's WAN bytes.
pub const EMULATOR: &str = "the emulator";

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

/// The lab's checks after a migration: the guest's verifiers, and its TCP client's.
pub fn print_guest_checks(verify: Option<&VerifyOutcome>, tcp: Option<&TcpSeqStats>) {
    if let Some(v) = verify {
        println!(
            "  verifier             {} ({} pages{})",
            if v.errors() == 0 {
                "OK, no lost or stale pages".to_owned()
            } else {
                format!("{} ERRORS", v.errors())
            },
            v.mem_pages,
            if v.disk_blocks > 0 {
                format!(", {} disk blocks", v.disk_blocks)
            } else {
                String::new()
            }
        );
    }
    if let Some(t) = tcp {
        println!(
            "  TCP connection       {} ({} numbers, last {}, longest stall {} ms{})",
            if t.intact() {
                "intact: kept every sequence number"
            } else {
                "BROKEN"
            },
            t.received,
            t.last.map_or_else(|| "-".into(), |l| l.to_string()),
            t.max_stall_ms,
            if t.missing + t.out_of_order > 0 {
                format!(", {} missing, {} out of order", t.missing, t.out_of_order)
            } else {
                String::new()
            }
        );
        if let Some(e) = &t.error {
            println!("                       {e}");
        }
    }
}
