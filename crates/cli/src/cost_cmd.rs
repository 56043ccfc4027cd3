//! `ferry cost-model FILE...`: the migration cost model (`ferry_policy::cost`) fitted to
//! `ferry bench` records, and its error on the migrations each fit did not see (k-fold
//! cross-validation per system).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_policy::calibrate::{cross_validate, fit, Observed};
use ferry_policy::cost::Move;
use serde_json::Value;

#[derive(Args)]
pub struct CostModelArgs {
    /// `ferry bench` records (JSON lines), e.g. bench/*.jsonl.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Cross-validation folds.
    #[arg(long, default_value_t = 5)]
    folds: usize,
    /// Only these systems (ferry, qemu-plain, qemu-multifd-zstd, ...; default: all).
    #[arg(long, value_delimiter = ',')]
    systems: Vec<String>,
    /// Print the fitted figures of each system too, and its median predicted/observed ratio
    /// per page mix and link (fitted to all of its migrations: where the model is biased).
    #[arg(long)]
    params: bool,
}

pub fn run(a: &CostModelArgs) -> Result<ExitCode> {
    let mut observed = Vec::new();
    let mut skipped = 0usize;
    for file in &a.files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let record: Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not JSON", file.display(), i + 1))?;
            match from_bench_record(&record) {
                Some(o) if a.systems.is_empty() || a.systems.contains(&o.system) => {
                    observed.push(o);
                }
                Some(_) => {}
                None => skipped += 1,
            }
        }
    }
    if observed.is_empty() {
        bail!("no completed migrations with their link, memory and workload in the records");
    }
    println!(
        "{} migrations ({skipped} records without what the model needs skipped); median |predicted/observed - 1| on migrations each fit did not see ({}-fold):",
        observed.len(),
        a.folds
    );
    println!(
        "{:<22} {:>7} {:>9} {:>9} {:>9}",
        "system", "moves", "total", "WAN bytes", "pause"
    );
    for e in cross_validate(&observed, a.folds)? {
        println!(
            "{:<22} {:>7} {:>8.1}% {:>8.1}% {:>9}",
            e.system,
            e.samples,
            e.total * 100.0,
            e.wan_bytes * 100.0,
            e.downtime
                .map_or_else(|| "-".into(), |d| format!("{:.1}%", d * 100.0))
        );
    }
    if a.params {
        let mut systems: Vec<&str> = observed.iter().map(|o| o.system.as_str()).collect();
        systems.sort_unstable();
        systems.dedup();
        let all: Vec<&Observed> = observed.iter().collect();
        for system in systems {
            let params = fit(system, &all)?;
            println!("{system}: {}", serde_json::to_string(&params)?);
            let mut groups: std::collections::BTreeMap<String, Vec<[f64; 3]>> =
                std::collections::BTreeMap::new();
            for o in all.iter().filter(|o| o.system == system) {
                let p = params.predict(&o.planned);
                let key = format!(
                    "{} {} Mbit/s {} ms",
                    o.planned.page_mix,
                    o.planned.link_bits_per_s / 1e6,
                    o.planned.rtt_s * 1e3
                );
                groups.entry(key).or_default().push([
                    p.total_s / o.total_s,
                    p.wan_bytes / o.wan_bytes,
                    o.downtime_s.map_or(f64::NAN, |d| p.downtime_s / d),
                ]);
            }
            for (key, ratios) in groups {
                let med = |i: usize| {
                    let mut v: Vec<f64> = ratios
                        .iter()
                        .map(|r| r[i])
                        .filter(|x| x.is_finite())
                        .collect();
                    v.sort_by(f64::total_cmp);
                    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
                };
                println!(
                    "  {key:<28} {:>3} moves: predicted/observed total {:.2}, bytes {:.2}, pause {:.2}",
                    ratios.len(),
                    med(0),
                    med(1),
                    med(2)
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A `ferry bench` record as an observed migration, if it completed and says what the model
/// needs (records older than the link's figures do not).
fn from_bench_record(r: &Value) -> Option<Observed> {
    if r["completed"] != true {
        return None;
    }
    let mib = |v: &Value| v.as_f64().map(|x| x * 1048576.0);
    let link = &r["link"];
    let planned = Move {
        mem_bytes: mib(&r["mem_mib"])?,
        used_bytes: None,
        working_set_bytes: mib(&r["dirty_mib"])?,
        dirty_bytes_per_s: mib(&r["dirty_rate_mib_s"])?,
        disk_bytes: mib(&r["disk_mib"]).unwrap_or(0.0),
        link_bits_per_s: link["rate_mbit"].as_f64()? * 1e6,
        rtt_s: link["rtt_ms"].as_f64()? / 1e3,
        // The records' migrations ran with the default target.
        downtime_target_s: 0.3,
        page_mix: r["workload"].as_str()?.to_owned(),
    };
    // A return with the older copy's seed is another kind of move than a first one.
    let system = match r["leg"].as_str() {
        Some("return") => format!("{}-return", r["system"].as_str()?),
        _ => r["system"].as_str()?.to_owned(),
    };
    Some(Observed {
        system,
        planned,
        total_s: r["total_ms"].as_f64()? / 1e3,
        wan_bytes: r["wan_bytes"].as_f64()?,
        downtime_s: r["downtime_ms"]
            .as_f64()
            .filter(|d| *d > 0.0)
            .map(|d| d / 1e3),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bench_record_is_an_observed_migration_when_it_says_enough() {
        let record = |extra: &str| -> Value {
            serde_json::from_str(&format!(
                r#"{{"system":"ferry","workload":"ws","link":{{"rate_mbit":100.0,"rtt_ms":50.0}},
                "mem_mib":512,"disk_mib":0,"dirty_mib":256,"dirty_rate_mib_s":2.0,
                "completed":true,"total_ms":15312,"downtime_ms":116.1,"wan_bytes":186470064{extra}}}"#
            ))
            .unwrap()
        };
        let o = from_bench_record(&record("")).unwrap();
        assert_eq!(o.system, "ferry");
        assert_eq!(o.planned.page_mix, "ws");
        assert_eq!(o.planned.mem_bytes, 512.0 * 1048576.0);
        assert_eq!(o.planned.link_bits_per_s, 100e6);
        assert!((o.total_s - 15.312).abs() < 1e-9);
        assert_eq!(
            from_bench_record(&record(r#","leg":"return""#))
                .unwrap()
                .system,
            "ferry-return"
        );
        let mut failed = record("");
        failed["completed"] = false.into();
        assert!(from_bench_record(&failed).is_none());
        let mut old = record("");
        old.as_object_mut().unwrap().remove("link");
        assert!(from_bench_record(&old).is_none());
    }

    /// The model against the repository's own records of the builds since 2026-11-24: what
    /// BENCHMARKS.md reports ("The cost model"), kept from getting worse.
    #[test]
    fn the_model_predicts_ferrys_recorded_migrations_it_did_not_see() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench");
        let mut observed = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let recent = ["2026-11-24", "2026-11-25", "2026-11-26"]
                .iter()
                .any(|d| name.starts_with(d));
            if !recent || !name.ends_with(".jsonl") {
                continue;
            }
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                let record: Value = serde_json::from_str(line).unwrap();
                observed.extend(from_bench_record(&record).filter(|o| o.system == "ferry"));
            }
        }
        assert!(observed.len() >= 70, "{}", observed.len());
        let errors = cross_validate(&observed, 5).unwrap();
        let ferry = &errors[0];
        assert!(ferry.total < 0.10 && ferry.wan_bytes < 0.10, "{ferry:?}");
    }
}
