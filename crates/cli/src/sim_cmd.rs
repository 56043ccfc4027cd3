//! `ferry simulate`: the fleet simulator (`ferry_sim`), which runs ferry's own policy code on
//! a simulated clock. Isci et al.'s study: for each migration speed, the least energy a
//! setting of the planner reaches within the SLA, against static consolidation. Williams'
//! Overdriver study: a pool's overloads met by migration only or by cooperative swap and
//! migration, with raw and with ferry's migrations. Tables on stdout, JSON and SVG pictures
//! in `--out`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_policy::capacity::spare;
use ferry_sim::consolidation::{ferry_params, run as run_day, sweep, Point, Setup};
use ferry_sim::overload::{self, Strategy};
use ferry_sim::plot::{lines, Series};

#[derive(Args)]
pub struct SimulateArgs {
    #[arg(long, default_value_t = 200)]
    hosts: usize,
    #[arg(long, default_value_t = 2000)]
    vms: usize,
    /// Simulated hours.
    #[arg(long, default_value_t = 24.0)]
    hours: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Migration speeds within a site, in Gbit/s (across sites a tenth).
    #[arg(long, value_delimiter = ',', default_value = "0.05,0.1,0.3,1,3,10")]
    speeds: Vec<f64>,
    /// Run one day at the first speed with the default settings only (the timing at scale).
    #[arg(long)]
    once: bool,
    /// Where the JSON and the SVG pictures go.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Headroom and minimum time on (seconds) tried at each speed.
const GRID: [(f64, f64); 9] = [
    (0.1, 900.0),
    (0.1, 3600.0),
    (0.1, 14400.0),
    (0.2, 900.0),
    (0.2, 3600.0),
    (0.2, 14400.0),
    (0.35, 900.0),
    (0.35, 3600.0),
    (0.35, 14400.0),
];

pub fn run(a: &SimulateArgs) -> Result<ExitCode> {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if a.hosts == 0 || a.vms == 0 || !positive(a.hours) {
        bail!("--hosts, --vms and --hours must be above zero");
    }
    if a.speeds.is_empty() || a.speeds.iter().any(|s| !positive(*s)) {
        bail!("--speeds must be rates above zero, in Gbit/s");
    }
    let base = Setup {
        hosts: a.hosts,
        vms: a.vms,
        hours: a.hours,
        seed: a.seed,
        ..Setup::default()
    };
    let params = ferry_params();
    if a.once {
        let mut setup = base;
        setup.lan_bits_per_s = a.speeds[0] * 1e9;
        setup.wan_bits_per_s = setup.lan_bits_per_s / 10.0;
        let out = run_day(&setup, &params, true);
        println!(
            "{} hosts, {} VMs, {} h at {} Gbit/s: {:.1} s of real time; energy {:.3} of static \
             ({} hosts), {:.1} hosts on average, {} migrations ({:.0}/h), median move {:.1} s, \
             VM-minutes short {:.3}%",
            a.hosts,
            a.vms,
            a.hours,
            a.speeds[0],
            out.wall_s,
            out.normalized_energy(),
            out.static_hosts,
            out.mean_hosts_on,
            out.migrations,
            out.migrations_per_hour,
            out.median_move_s,
            out.short_share * 100.0
        );
        if let Some(dir) = &a.out {
            write(dir, "day.json", &serde_json::to_string_pretty(&out)?)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let points = sweep(
        &base,
        &params,
        &a.speeds.iter().map(|s| s * 1e9).collect::<Vec<_>>(),
        &GRID,
    );
    println!(
        "{} hosts, {} VMs, {} h; static consolidation: {} hosts",
        a.hosts, a.vms, a.hours, points[0].outcome.static_hosts
    );
    println!(
        "{:>9} {:>10} {:>9} {:>8} {:>7} {:>9} {:>8} {:>11} {:>8}",
        "Gbit/s",
        "median s",
        "headroom",
        "min on",
        "energy",
        "hosts on",
        "moves/h",
        "short %",
        "SLA"
    );
    for p in &points {
        let o = &p.outcome;
        println!(
            "{:>9} {:>10.1} {:>9.2} {:>7.0}m {:>7.3} {:>9.1} {:>8.0} {:>11.3} {:>8}",
            p.lan_bits_per_s / 1e9,
            o.median_move_s,
            p.headroom,
            p.min_on_s / 60.0,
            o.normalized_energy(),
            o.mean_hosts_on,
            o.migrations_per_hour,
            o.short_share * 100.0,
            if p.meets_sla { "met" } else { "missed" }
        );
    }
    if let Some(dir) = &a.out {
        pictures(dir, &points)?;
    }
    overload_study(a)?;
    Ok(ExitCode::SUCCESS)
}

fn overload_study(a: &SimulateArgs) -> Result<()> {
    let params = ferry_params();
    let base = overload::Setup {
        hours: a.hours,
        seed: a.seed,
        ..overload::Setup::default()
    };
    println!();
    println!(
        "Overload: {} VMs of {} MiB given {} MiB, {} h, 1 Gbit/s",
        base.vms, base.requested_mib, base.allocated_mib, base.hours
    );
    println!(
        "{:>10} {:>15} {:>10} {:>11} {:>13} {:>10} {:>11}",
        "migrations", "strategy", "overloads", "migrations", "disk-swap s", "swap s", "network GB"
    );
    let mut outcomes = Vec::new();
    for coded in [false, true] {
        let setup = overload::Setup {
            coded,
            ..base.clone()
        };
        for strategy in [Strategy::MigrationOnly, Strategy::Overdriver] {
            let o = overload::run(&setup, &params, strategy);
            println!(
                "{:>10} {:>15} {:>10} {:>11} {:>13.0} {:>10.0} {:>11.1}",
                if coded { "ferry" } else { "raw" },
                format!("{strategy:?}"),
                o.overloads,
                o.migrations,
                o.violation_s,
                o.swap_s,
                o.network_bytes / 1e9
            );
            outcomes.push((coded, o));
        }
    }
    let gib = 1073741824.0;
    let withheld = (base.requested_mib - base.allocated_mib) * 1048576.0;
    // The pool's own shares of time in each kind of overload (the same for every run).
    let shares = &outcomes[0].1;
    let s = spare(
        base.vms as u64,
        base.requested_mib * 1048576.0,
        withheld,
        shares.transient_share,
        shares.sustained_share,
        0.97,
    );
    println!(
        "Spare memory at 97% by the capacity planner (time in transient overload {:.1}%, \
         sustained {:.1}%): {:.1} GiB with Overdriver ({} sustained, {} transient at once), \
         {:.1} GiB migrating on every overload",
        shares.transient_share * 100.0,
        shares.sustained_share * 100.0,
        s.overdriver_bytes / gib,
        s.sustained,
        s.transient,
        s.migration_only_bytes / gib
    );
    for (coded, o) in &outcomes {
        println!(
            "  peak spare memory in use, {} migrations, {:?}: {:.2} GiB",
            if *coded { "ferry" } else { "raw" },
            o.strategy,
            o.peak_spare_bytes / gib
        );
    }
    if let Some(dir) = &a.out {
        write(
            dir,
            "overload.json",
            &serde_json::to_string_pretty(&outcomes)?,
        )?;
        let durations: Vec<f64> = (1..=30).map(|i| f64::from(i) * 20.0).collect();
        let mut series = Vec::new();
        for coded in [false, true] {
            let setup = overload::Setup {
                coded,
                ..base.clone()
            };
            let of = |pick: fn((f64, f64, f64)) -> f64| -> Vec<(f64, f64)> {
                durations
                    .iter()
                    .map(|&d| (d, pick(overload::traffic_of_one(&setup, &params, d)) / 1e6))
                    .collect()
            };
            let name = if coded { "ferry" } else { "raw" };
            if !coded {
                series.push(Series {
                    name: "cooperative swap only".into(),
                    points: of(|t| t.0),
                });
            }
            series.push(Series {
                name: format!("migration only ({name})"),
                points: of(|t| t.1),
            });
            series.push(Series {
                name: format!("Overdriver ({name} migration)"),
                points: of(|t| t.2),
            });
        }
        let svg = lines(
            "Network traffic of one overload (Williams' Fig. 6.7)",
            "overload duration, s",
            "MB",
            false,
            &series,
        )?;
        write(dir, "overload-traffic.svg", &svg)?;
    }
    Ok(())
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let path = dir.join(name);
    std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))
}

fn pictures(dir: &std::path::Path, points: &[Point]) -> Result<()> {
    write(
        dir,
        "consolidation.json",
        &serde_json::to_string_pretty(points)?,
    )?;
    let energy = lines(
        "Energy against migration time (static consolidation = 1)",
        "median migration time, s (log)",
        "energy",
        true,
        &[Series {
            name: "planned by ferry's policy".into(),
            points: points
                .iter()
                .map(|p| (p.outcome.median_move_s, p.outcome.normalized_energy()))
                .collect(),
        }],
    )?;
    write(dir, "consolidation-energy.svg", &energy)?;
    let moves = lines(
        "Migrations per hour against migration time",
        "median migration time, s (log)",
        "migrations per hour",
        true,
        &[Series {
            name: "planned by ferry's policy".into(),
            points: points
                .iter()
                .map(|p| (p.outcome.median_move_s, p.outcome.migrations_per_hour))
                .collect(),
        }],
    )?;
    write(dir, "consolidation-migrations.svg", &moves)?;
    let day: Vec<Series> = [points.first(), points.last()]
        .into_iter()
        .flatten()
        .map(|p| Series {
            name: format!("{} Gbit/s", p.lan_bits_per_s / 1e9),
            points: p
                .outcome
                .hosts_on
                .iter()
                .map(|&(h, n)| (h, n as f64))
                .collect(),
        })
        .collect();
    let hosts = lines(
        "Hosts running over the day",
        "hour",
        "hosts running",
        false,
        &day,
    )?;
    write(dir, "consolidation-hosts.svg", &hosts)?;
    Ok(())
}
