//! `ferry bench`: scenarios end to end, one JSON object per migration on stdout.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_lab::baseline::System;
use ferry_lab::bench::{run_scenario, DiskWriter, Scenario, Workload};
use ferry_lab::{accel, image, Lab};

use crate::lab_cmd::LinkArgs;
use crate::lab_migrate::MigrationFlags;
use crate::report;
use crate::vm_cmd::VmShape;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    link: LinkArgs,
    #[command(flatten)]
    shape: VmShape,
    #[command(flatten)]
    migration: MigrationFlags,
    /// Systems to compare (comma-separated): ferry, ferry-none, ferry-zero+delta, ...,
    /// ferry-postcopy, ferry-postcopy-at-40 (switching at a 40% throttle), or QEMU modes
    /// (plain, multifd-zstd, postcopy, ...); overrides --mode. With --groups: group,
    /// at-once, one-by-one (default all).
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Workloads (comma-separated): zero, delta, ws, hot, idle.
    #[arg(long, value_delimiter = ',', default_value = "ws")]
    workloads: Vec<String>,
    /// Memory each workload owns, MiB.
    #[arg(long, default_value_t = 128)]
    dirty_mib: u32,
    /// Dirtying rate, MiB/s.
    #[arg(long, default_value_t = 4.0)]
    dirty_rate_mib_s: f64,
    /// Runs per (workload, mode).
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Seconds the workload runs before each migration.
    #[arg(long, default_value_t = 5)]
    warmup_s: u64,
    /// One JSON object per line (the default output; kept for scripts that pass it).
    #[arg(long)]
    json: bool,
    /// Write every migration's timeline (JSON, for `ferry report`) into this directory.
    #[arg(long)]
    timelines: Option<std::path::PathBuf>,
    /// After each migration, let the guest run at the other site until this percent of its
    /// pages changed, then migrate it back and report that too (`"leg": "return"`): the
    /// seeded return.
    #[arg(long)]
    return_after_pct: Option<f64>,
    /// Or migrate back after this many seconds at the other site (for disks: the writer's
    /// changes since are measured against the copy left behind, `disk_changed_pct`; with
    /// --libvirt, the same system moves the domain back onto the disk image it left).
    #[arg(long, conflicts_with = "return_after_pct")]
    return_after_s: Option<u64>,
    /// With a postcopy mode: once the VM runs at the destination, the WAN goes down (every
    /// frame dropped) for this many seconds and then returns: what a drop after the switch
    /// costs in time and bytes (`outage_in_postcopy_s` in the record when it came).
    #[arg(long)]
    outage_in_postcopy_s: Option<u64>,
    /// With a disk: the guest writer's file, MiB (written once before the migration, then
    /// rewritten at random).
    #[arg(long, default_value_t = 16)]
    disk_file_mib: u32,
    /// With a disk: the writer's rate, MiB/s of 4 KiB O_DIRECT|O_DSYNC writes.
    #[arg(long, default_value_t = 0.5)]
    disk_rate_mib_s: f64,
    /// With a disk: a guest reader rereads random 4 KiB blocks of the file's first this many
    /// MiB back to back (O_DIRECT): its throughput in the warm-up and during the migration.
    #[arg(long, default_value_t = 0)]
    disk_read_hot_mib: u32,
    /// A libvirt domain moved by ferry (`ferry migrate --libvirt`) and by libvirt alone, each
    /// site running its own libvirtd; --modes names the systems (ferry, ferry-parallel: with
    /// `--parallel 4`, ferry-none: with `--codec none`, ferry-paced: with
    /// `--disk-pacing-floor-pct 50`, ferry-indexed: the return's image indexed, the index
    /// kept when the domain left removed first, ferry-unthrottled: with `--no-converge`, virsh,
    /// virsh-parallel-zstd, virsh-parallel-via-ferry: a user's `virsh migrate --parallel` at
    /// the agents' tunnels, virsh-sync-writes; default ferry, virsh and virsh-parallel-zstd).
    #[arg(long)]
    libvirt: bool,
    /// Virtual cloud pools: a pool VM's client (TCP stall, pings lost) across moves to site b
    /// and back through the fleet, the overlay re-pointed at the switchover against a learning
    /// VXLAN (ARP-only); --runs round trips, the modes interleaved.
    #[arg(long, conflicts_with = "libvirt")]
    pools: bool,
    /// Groups that arrive together: three libvirt domains (working sets of a third, two thirds
    /// and all of --dirty-mib) moved to site b and back through the fleet as a group, all at
    /// once on their own, and one by one; --runs rounds, the modes interleaved.
    #[arg(long, conflicts_with_all = ["libvirt", "pools"])]
    groups: bool,
    /// Memory overload: the controller's response (swap on a peer while an overload is
    /// transient, a migration once it lasts) against a migration at every overload, a fresh
    /// lab per run (four libvirt domains, hosts offering 240 MiB, memory bursts in one guest);
    /// --modes swap, migrate-only (default both), --runs each, interleaved.
    #[arg(long, conflicts_with_all = ["libvirt", "pools", "groups"])]
    overload: bool,
    /// The controller's cost model calibrated from its own migrations: four libvirt domains
    /// of different sizes and dirty rates moved between the sites through the fleet, --runs
    /// rounds of one move each; per move what the controller predicted and what it cost, and
    /// at the end its fit over all of them and its error on the ones each fit did not see.
    #[arg(long, conflicts_with_all = ["libvirt", "pools", "groups", "overload"])]
    fleet_cost: bool,
    /// With --overload: bursts per run.
    #[arg(long, default_value_t = 3)]
    bursts: u32,
    /// With --overload: each burst's length, seconds.
    #[arg(long, default_value_t = 8)]
    burst_s: u32,
    /// With --overload: seconds between bursts.
    #[arg(long, default_value_t = 40)]
    gap_s: u32,
    /// The lab to run in; it is created and removed by the bench.
    #[arg(long, default_value = "ferry-bench")]
    lab: String,
}

pub async fn run(a: BenchArgs) -> Result<ExitCode> {
    let result = run_scenarios(a).await;
    // The bench's lab comes down however it ended (fresh_lab armed its taking down).
    let down = tokio::task::spawn_blocking(crate::stop::run_armed).await?;
    crate::stop::first_error(result, down)
}

async fn run_scenarios(a: BenchArgs) -> Result<ExitCode> {
    let link = a.link.config();
    link.validate()?;
    if a.libvirt {
        return run_libvirt(a).await;
    }
    if a.pools {
        return run_pools(a).await;
    }
    if a.groups {
        return run_groups(a).await;
    }
    if a.overload {
        return run_overload(a).await;
    }
    if a.fleet_cost {
        return run_fleet_cost(a).await;
    }
    let base = a.migration.options()?;
    let systems: Vec<System> = if a.modes.is_empty() {
        vec![base.system()]
    } else {
        a.modes
            .iter()
            .map(|m| System::parse(m))
            .collect::<Result<_>>()?
    };
    let workloads = workloads(&a)?;
    if a.outage_in_postcopy_s.is_some() && !systems.iter().any(|s| s.postcopy()) {
        bail!(
            "--outage-in-postcopy-s needs a postcopy mode in --modes (ferry-postcopy, \
             ferry-postcopy-at-PCT or postcopy)"
        );
    }
    a.shape.validate()?;
    if base.qemu_mirror_top && a.shape.disk_template_mib.is_none() {
        bail!("--qemu-mirror-top copies a template's top image only; add --disk-template-mib");
    }
    let disk_mib = a.shape.disk_mib.unwrap_or(64);
    if a.shape.has_disk() && (a.disk_file_mib == 0 || a.disk_file_mib + 8 > disk_mib) {
        bail!(
            "--disk-file-mib {} must be at least 1 and leave 8 MiB of the {disk_mib} MiB disk to the file system",
            a.disk_file_mib
        );
    }
    if a.disk_read_hot_mib > a.disk_file_mib {
        bail!(
            "--disk-read-hot-mib {} must be at most the file's --disk-file-mib {}",
            a.disk_read_hot_mib,
            a.disk_file_mib
        );
    }
    if !(a.disk_rate_mib_s.is_finite() && a.disk_rate_mib_s >= 0.0) {
        bail!(
            "--disk-rate-mib-s {} must be a non-negative number",
            a.disk_rate_mib_s
        );
    }
    if let Some(pct) = a.return_after_pct {
        if !(pct > 0.0 && pct < 100.0) {
            bail!("--return-after-pct {pct} must be between 0 and 100");
        }
    }
    ferry_lab::topology::require_root()?;
    let (img, _) = tokio::task::spawn_blocking(|| image::build(false)).await??;
    let (accel, why) = tokio::task::spawn_blocking({
        let img = img.clone();
        move || accel::detect(&img)
    })
    .await??;
    eprintln!("bench: accelerator {} ({why})", accel.as_str());
    let (lab, _) = fresh_lab(&a.lab, link, ferry_lab::Services::default()).await?;
    let mut failures = 0;
    for w in &workloads {
        for run in 1..=a.runs {
            // Modes interleave within a run so slow drifts of the machine hit every mode alike.
            for &system in &systems {
                let sc = Scenario {
                    system,
                    workload: w.clone(),
                    vm: a.shape.vm_options(accel),
                    link,
                    warmup: Duration::from_secs(a.warmup_s),
                    migrate: base.clone(),
                    run,
                    timeline_dir: a.timelines.clone(),
                    return_after_pct: a.return_after_pct,
                    return_after_s: a.return_after_s,
                    outage_in_postcopy: a.outage_in_postcopy_s.map(Duration::from_secs),
                    disk_writer: DiskWriter {
                        file_mib: a.disk_file_mib,
                        rate_mib_s: a.disk_rate_mib_s,
                        read_hot_mib: a.disk_read_hot_mib,
                    },
                };
                let what = format!("{} {} run {run}", w.pattern, system.name());
                failures += print_records(run_scenario(&lab, &img, &sc).await, &what)?;
            }
        }
    }
    Ok(finish(&lab, failures))
}

/// `ferry bench --libvirt`: every system on a fresh domain per run, systems interleaved.
async fn run_libvirt(a: BenchArgs) -> Result<ExitCode> {
    use ferry_lab::libvirt_bench::{self, LibvirtScenario, LibvirtSystem};
    let link = a.link.config();
    let systems: Vec<LibvirtSystem> = if a.modes.is_empty() {
        LibvirtSystem::DEFAULT.to_vec()
    } else {
        a.modes
            .iter()
            .map(|m| LibvirtSystem::parse(m))
            .collect::<Result<_>>()?
    };
    if a.return_after_pct.is_some() {
        bail!("--libvirt returns after --return-after-s seconds; --return-after-pct counts pages on ferry's own path");
    }
    if a.shape.disk_mib.is_some() || a.shape.disk_template_mib.is_some() {
        bail!("--libvirt copies the guest image's own data disk; drop --disk-mib and --disk-template-mib");
    }
    let disk = a.shape.has_disk().then_some(DiskWriter {
        file_mib: a.disk_file_mib,
        rate_mib_s: a.disk_rate_mib_s,
        read_hot_mib: a.disk_read_hot_mib,
    });
    let workloads = workloads(&a)?;
    ferry_lab::topology::require_root()?;
    let (img, _) = tokio::task::spawn_blocking(|| image::build(false)).await??;
    let (lab, exe) = fresh_lab(
        &a.lab,
        link,
        ferry_lab::Services {
            libvirt: true,
            ..ferry_lab::Services::default()
        },
    )
    .await?;
    let mut failures = 0;
    for w in &workloads {
        for run in 1..=a.runs {
            for &system in &systems {
                let sc = LibvirtScenario {
                    system,
                    workload: w.clone(),
                    mem_mib: a.shape.mem_mib,
                    warmup: Duration::from_secs(a.warmup_s),
                    run,
                    ferry_exe: exe.clone(),
                    disk,
                    return_after: a.return_after_s.map(Duration::from_secs),
                };
                let what = format!("{} {} run {run}", w.pattern, system.name());
                let records = libvirt_bench::run_scenario(&lab, &img, &sc).await;
                let failed = records
                    .as_ref()
                    .is_ok_and(|r| r.iter().any(|r| !r.completed));
                failures += print_records(records, &what)? + usize::from(failed);
            }
        }
    }
    Ok(finish(&lab, failures))
}

/// `ferry bench --pools`: the lab with libvirt and a controller, [`ferry_lab::pool_bench`].
async fn run_pools(a: BenchArgs) -> Result<ExitCode> {
    let workload = one_workload(&a, "--pools")?;
    let (lab, img, exe) = fleet_lab(&a).await?;
    let bench = ferry_lab::pool_bench::PoolBench {
        runs: a.runs,
        mem_mib: a.shape.mem_mib,
        workload,
        ferry_exe: exe,
    };
    let failures = ferry_lab::pool_bench::run(&lab, &img, &bench, print_record).await;
    Ok(finish(&lab, counted_failures(failures, "pools")))
}

/// `ferry bench --groups`: the lab with libvirt and a controller, [`ferry_lab::group_bench`].
async fn run_groups(a: BenchArgs) -> Result<ExitCode> {
    use ferry_lab::group_bench::Arrival;
    let workload = one_workload(&a, "--groups")?;
    let arrivals = if a.modes.is_empty() {
        Arrival::ALL.to_vec()
    } else {
        a.modes
            .iter()
            .map(|m| {
                Arrival::parse(m).with_context(|| {
                    format!("--modes {m}: with --groups, one of group, at-once, one-by-one")
                })
            })
            .collect::<Result<_>>()?
    };
    let (lab, img, exe) = fleet_lab(&a).await?;
    let bench = ferry_lab::group_bench::GroupBench {
        arrivals,
        runs: a.runs,
        mem_mib: a.shape.mem_mib,
        workload,
        ferry_exe: exe,
    };
    let failures = ferry_lab::group_bench::run(&lab, &img, &bench, print_record).await;
    Ok(finish(&lab, counted_failures(failures, "groups")))
}

/// `ferry bench --fleet-cost`: the lab with libvirt and a controller,
/// [`ferry_lab::fleet_cost_bench`].
async fn run_fleet_cost(a: BenchArgs) -> Result<ExitCode> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let (lab, img, exe) = fleet_lab(&a).await?;
    let bench = ferry_lab::fleet_cost_bench::FleetCostBench {
        rounds: a.runs,
        ferry_exe: exe,
    };
    let failures = ferry_lab::fleet_cost_bench::run(&lab, &img, &bench, print_record).await;
    Ok(finish(&lab, counted_failures(failures, "fleet-cost")))
}

/// `ferry bench --overload`: a fresh lab per run and response, [`ferry_lab::overload_bench`].
async fn run_overload(a: BenchArgs) -> Result<ExitCode> {
    use ferry_lab::overload_bench::{OverloadBench, Response, HOST_MIB};
    let responses = if a.modes.is_empty() {
        Response::ALL.to_vec()
    } else {
        a.modes
            .iter()
            .map(|m| {
                Response::parse(m).with_context(|| {
                    format!("--modes {m}: with --overload, one of swap, migrate-only")
                })
            })
            .collect::<Result<_>>()?
    };
    if a.bursts == 0 || a.burst_s == 0 {
        bail!("--bursts and --burst-s must be at least 1");
    }
    ferry_lab::topology::require_root()?;
    let (img, _) = tokio::task::spawn_blocking(|| image::build(false)).await??;
    let bench = OverloadBench {
        bursts: a.bursts,
        burst_s: a.burst_s,
        gap_s: a.gap_s,
        ferry_exe: std::env::current_exe()?,
    };
    let mut failures = 0;
    let mut last_lab = None;
    for run in 1..=a.runs {
        for &response in &responses {
            let services = ferry_lab::Services {
                libvirt: true,
                controller: true,
                overload_mib: Some(HOST_MIB),
                overload_migrate_only: response == Response::MigrateOnly,
                ..ferry_lab::Services::default()
            };
            let (lab, _) = fresh_lab(&a.lab, a.link.config(), services).await?;
            let record =
                ferry_lab::overload_bench::run_once(&lab, &img, &bench, response, run).await;
            print_record(&record)?;
            if !record.completed {
                failures += 1;
            }
            last_lab = Some(lab);
        }
    }
    match last_lab {
        Some(lab) => Ok(finish(&lab, failures)),
        None => Ok(ExitCode::SUCCESS),
    }
}

/// The one workload a fleet bench runs.
fn one_workload(a: &BenchArgs, flag: &str) -> Result<Workload> {
    match workloads(a)?.as_slice() {
        [w] => Ok(w.clone()),
        _ => bail!("{flag} runs one workload; give one to --workloads"),
    }
}

/// A fresh lab with libvirt at both sites and a controller, and the guest image.
async fn fleet_lab(a: &BenchArgs) -> Result<(Lab, image::Image, std::path::PathBuf)> {
    let link = a.link.config();
    ferry_lab::topology::require_root()?;
    let (img, _) = tokio::task::spawn_blocking(|| image::build(false)).await??;
    let services = ferry_lab::Services {
        libvirt: true,
        controller: true,
        ..ferry_lab::Services::default()
    };
    let (lab, exe) = fresh_lab(&a.lab, link, services).await?;
    Ok((lab, img, exe))
}

fn print_record<T: serde::Serialize>(record: &T) -> Result<()> {
    println!("{}", serde_json::to_string(record)?);
    Ok(())
}

/// A fleet bench's failed moves, or 1 for the error that stopped it (printed).
fn counted_failures(failures: Result<usize>, what: &str) -> usize {
    failures.unwrap_or_else(|e| {
        eprintln!("bench: {what}: {}", report::error_chain(&e));
        1
    })
}

/// The workloads asked for, checked against the guest's memory.
fn workloads(a: &BenchArgs) -> Result<Vec<Workload>> {
    let workloads: Vec<Workload> = a
        .workloads
        .iter()
        .map(|p| Workload {
            pattern: p.clone(),
            dirty_mib: a.dirty_mib,
            rate_mib_s: a.dirty_rate_mib_s,
        })
        .collect();
    for w in &workloads {
        w.validate(a.shape.mem_mib)?;
    }
    Ok(workloads)
}

/// The bench's own lab, brought up afresh with `services`; returns it and the ferry binary the
/// lab's agents run.
async fn fresh_lab(
    name: &str,
    link: ferry_lab::link::LinkConfig,
    services: ferry_lab::Services,
) -> Result<(Lab, std::path::PathBuf)> {
    let lab = Lab {
        name: name.to_owned(),
    };
    let exe = std::env::current_exe()?;
    if std::env::var_os(KEEP_LAB).is_none() {
        // Ctrl-C or SIGTERM from here on, or the bench's end, takes the lab down.
        let lab = lab.clone();
        crate::stop::arm(move || lab.down(true));
    }
    // Asked to stop during a run (its migration cancelled): no lab for the next one.
    if ferry_agent::interrupt::requested() {
        bail!("stopped by the user");
    }
    let (l, e) = (lab.clone(), exe.clone());
    tokio::task::spawn_blocking(move || {
        crate::stop::guarded(|| {
            l.down(true)?;
            l.up(link, &e, services)
        })
    })
    .await??;
    Ok((lab, exe))
}

/// Prints a scenario's records as JSON lines, or its error; returns 1 for an error.
fn print_records<T: serde::Serialize>(records: Result<Vec<T>>, what: &str) -> Result<usize> {
    match records {
        Ok(records) => {
            for r in records {
                println!("{}", serde_json::to_string(&r)?);
            }
            Ok(0)
        }
        Err(e) => {
            eprintln!("bench: {what}: {}", report::error_chain(&e));
            Ok(1)
        }
    }
}

/// The exit code: whether every scenario ran. The lab comes down in [`run`], unless kept.
fn finish(lab: &Lab, failures: usize) -> ExitCode {
    if std::env::var_os(KEEP_LAB).is_some() {
        eprintln!("bench: {KEEP_LAB}: lab {} left up", lab.name);
    }
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Set, a bench leaves its lab up for inspection.
const KEEP_LAB: &str = "FERRY_BENCH_KEEP_LAB";
