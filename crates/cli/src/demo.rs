//! `ferry demo`: boot the tiny guest at site A with a dirtying workload and a TCP client
//! connected to its sequence server, migrate it to site B across the emulated WAN with a live
//! progress bar, and print the report. The demo's lab is its own and is removed at the end.

use ferry_lab::baseline::System;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use ferry_lab::bench::{boot_with_workload, DiskWriter, Workload};
use ferry_lab::tcpseq::TcpSeqClient;
use ferry_lab::{accel, image, Lab, Site};

use crate::lab_cmd::LinkArgs;
use crate::lab_migrate::{
    exit_code, migrate_with_progress, print_guest_checks, MigrationFlags, EMULATOR,
};
use crate::report;
use crate::vm_cmd::VmShape;

/// The demo lab's name: never the user's own lab.
const DEMO_LAB: &str = "ferry-demo";

#[derive(Args)]
pub struct DemoArgs {
    #[command(flatten)]
    link: LinkArgs,
    #[command(flatten)]
    shape: VmShape,
    #[command(flatten)]
    migration: MigrationFlags,
    /// The guest's memory workload: zero, delta, ws, hot or idle.
    #[arg(long, default_value = "ws")]
    workload: String,
    /// Memory the workload owns, MiB.
    #[arg(long, default_value_t = 128)]
    dirty_mib: u32,
    /// Dirtying rate, MiB/s.
    #[arg(long, default_value_t = 4.0)]
    dirty_rate_mib_s: f64,
    /// Seconds the workload runs before the migration starts.
    #[arg(long, default_value_t = 3)]
    warmup_s: u64,
    /// Leave the lab and the VM up afterwards (FERRY_LAB=ferry-demo ferry lab down removes them).
    #[arg(long)]
    keep: bool,
    /// Write the migration's timeline (JSON, for `ferry report`) to this file.
    #[arg(long)]
    timeline: Option<std::path::PathBuf>,
    /// The lab to run in; it is created and removed by the demo.
    #[arg(long, default_value = DEMO_LAB)]
    lab: String,
}

pub async fn run(a: DemoArgs) -> Result<ExitCode> {
    let link = a.link.config();
    link.validate()?;
    let opts = a.migration.options()?;
    let workload = Workload {
        pattern: a.workload.clone(),
        dirty_mib: a.dirty_mib,
        rate_mib_s: a.dirty_rate_mib_s,
    };
    workload.validate(a.shape.mem_mib)?;
    ferry_lab::topology::require_root()?;

    let lab = Lab {
        name: a.lab.clone(),
    };
    {
        let lab = lab.clone();
        tokio::task::spawn_blocking(move || lab.down(true)).await??;
    }
    println!("[1/5] guest image");
    let (img, rebuilt) = tokio::task::spawn_blocking(|| image::build(false)).await??;
    println!(
        "      {} (kernel {})",
        if rebuilt { "built" } else { "cached" },
        img.kernel_version
    );
    let (accel, why) = tokio::task::spawn_blocking({
        let img = img.clone();
        move || accel::detect(&img)
    })
    .await??;
    println!("      accelerator: {} ({why})", accel.as_str());
    println!(
        "[2/5] lab: sites a and b, WAN {} Mbit/s, {} ms RTT",
        link.rate_mbit, link.rtt_ms
    );
    let exe = std::env::current_exe()?;
    if !a.keep {
        // Ctrl-C or SIGTERM from here on takes the lab down with its agents and QEMUs.
        let lab = lab.clone();
        crate::stop::arm(move || lab.down(true));
    }
    let up = {
        let lab = lab.clone();
        tokio::task::spawn_blocking(move || {
            crate::stop::guarded(|| lab.up(link, &exe, ferry_lab::Services::default()))
        })
        .await?
    };
    let result = match up {
        Ok(_) => demo_inner(&lab, &a, &img, accel, &workload, &opts).await,
        Err(e) => Err(e),
    };
    let down = tokio::task::spawn_blocking(crate::stop::run_armed).await?;
    crate::stop::first_error(result, down)
}

async fn demo_inner(
    lab: &Lab,
    a: &DemoArgs,
    img: &image::Image,
    accel: ferry_qemu::Accel,
    workload: &Workload,
    opts: &ferry_lab::baseline::MigrateOptions,
) -> Result<ExitCode> {
    let vm_opts = a.shape.vm_options(accel);
    println!(
        "[3/5] booting VM \"demo\" at site a ({} MiB{}), workload {} on {} MiB at {} MiB/s",
        vm_opts.mem_mib,
        if vm_opts.disk { ", ext4 data disk" } else { "" },
        workload.pattern,
        workload.dirty_mib,
        workload.rate_mib_s
    );
    let writer = vm_opts.disk.then(DiskWriter::default);
    let (rec, link) = boot_with_workload(lab, "demo", &vm_opts, img, workload, writer).await?;
    let addr = format!("{}:7000", rec.guest_ip);
    let ns = lab.site_ns(Site::A);
    let tcp = tokio::task::spawn_blocking(move || {
        TcpSeqClient::connect(&ns, &addr, Duration::from_secs(30))
    })
    .await?
    .context("TCP client at site a")?;
    println!(
        "      TCP client at site a connected to {}:7000",
        rec.guest_ip
    );
    tokio::time::sleep(Duration::from_secs(a.warmup_s)).await;
    let system = opts.system();
    println!(
        "[4/5] migrating to site b with {}",
        match system {
            System::Ferry { .. } => "ferry (the sites' agents, over the WAN)".to_owned(),
            System::Qemu(m) => format!("QEMU's own migration ({})", m.name()),
        }
    );
    let (outcome, verify) = migrate_with_progress(
        lab,
        "demo",
        Site::B,
        opts,
        link,
        true,
        true,
        a.timeline.as_deref(),
    )
    .await?;
    // The connection must keep flowing from the new site: wait for more numbers.
    let tcp = tokio::task::spawn_blocking(move || {
        let _ = tcp.wait_for_more(100, Duration::from_secs(30));
        tcp.stats()
    })
    .await?;
    println!("[5/5] report");
    report::print_report(&system.name(), &outcome, EMULATOR);
    print_guest_checks(verify.as_ref(), Some(&tcp));
    let code = exit_code(&outcome, verify.as_ref());
    Ok(if tcp.intact() {
        code
    } else {
        ExitCode::from(crate::EXIT_MIGRATION_FAILED)
    })
}
