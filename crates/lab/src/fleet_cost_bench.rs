//! `ferry bench --fleet-cost`: the controller's cost model calibrated from its own migrations
//! (docs/policies.md, "The cost model"), in the lab with libvirt and a controller.
//!
//! Four libvirt domains of the tiny guest, of different sizes, each rewriting a working set of
//! its own at its own rate, move between the sites through the fleet one at a time, `rounds`
//! times each (their order turns each round). Before each move the bench waits until the VM's
//! host reports its guest's use (the controller records it as the move's input; the dirty
//! rate is measured under KVM only, so the lab's guests have none and the controller estimates
//! it from their CPU). Per migration it records what the controller predicted when it was requested (by
//! the figures in use then: built-in at first, the fleet's own once enough committed), what the
//! source agent measured, and the bytes the WAN emulator counted. At the end, the controller's
//! own figure: the model fitted to all of them and its error on the migrations each fit did not
//! see (`ferry fleet cost-model`). The memory verifiers of every guest run at the end.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::controller::{fleet, fleet_json};
use crate::guest::{GuestLink, Heartbeats};
use crate::image::Image;
use crate::libvirt::{self, GuestNic};
use crate::topology::{wait_until, Lab, Site};

/// Name, memory (MiB), working set (MiB) and the rate it is rewritten at (MiB/s).
const VMS: [(&str, u32, u32, f64); 4] = [
    ("fc1", 128, 4, 0.5),
    ("fc2", 160, 16, 1.0),
    ("fc3", 192, 24, 2.0),
    ("fc4", 256, 32, 4.0),
];

pub struct FleetCostBench {
    pub rounds: u32,
    pub ferry_exe: PathBuf,
}

/// One migration: what the controller knew and predicted, and what it cost.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FleetMoveRecord {
    pub kind: &'static str,
    pub round: u32,
    pub vm: String,
    pub from: &'static str,
    pub to: &'static str,
    pub completed: bool,
    pub mem_mib: u32,
    pub used_mib: Option<u64>,
    pub dirty_mib_s: Option<f64>,
    /// The figures the prediction was made with: `built-in` or `fleet`.
    pub predicted_by: String,
    pub predicted_ms: u64,
    pub predicted_wan_bytes: u64,
    pub predicted_pause_ms: u64,
    /// The source agent's figures (what the fit sees).
    pub total_ms: u64,
    pub agent_wan_bytes: u64,
    pub pause_ms: Option<f64>,
    /// The WAN emulator's count over the migration (both ways, with headers and libvirt's RPC).
    pub wan_bytes: u64,
    pub error: Option<String>,
}

/// The controller's fit over every migration, at the end.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FleetFitRecord {
    pub kind: &'static str,
    pub migrations: usize,
    pub fitted_samples: Option<usize>,
    pub folds: Option<usize>,
    pub error_total: Option<f64>,
    pub error_wan_bytes: Option<f64>,
    pub error_pause: Option<f64>,
    pub verify_errors: u64,
    pub params: serde_json::Value,
}

/// Runs the bench in `lab` (up with libvirt and a controller); each record goes to `emit` as
/// it is made. Returns the moves that failed.
pub async fn run(
    lab: &Lab,
    img: &Image,
    bench: &FleetCostBench,
    mut emit: impl FnMut(&serde_json::Value) -> Result<()>,
) -> Result<usize> {
    let exe = bench.ferry_exe.as_path();
    wait_until(Duration::from_secs(60), || {
        fleet_json(lab, exe, "hosts")
            .is_ok_and(|h| h.len() == 2 && h.iter().all(|h| h["state"] == "up"))
    })
    .context("the agents did not register with the controller")?;
    for (i, (name, mem_mib, ws_mib, rate)) in VMS.into_iter().enumerate() {
        let nic = GuestNic::lab(80 + u8::try_from(i)?);
        let command = format!("mem start mib={ws_mib} pattern=ws rate={rate} hot={ws_mib}");
        drop(libvirt::start_tiny_domain(lab, img, (name, mem_mib, &nic), &command).await?);
    }
    let mut at: Vec<Site> = vec![Site::A; VMS.len()];
    let mut failures = 0;
    let mut moves = 0;
    for round in 1..=bench.rounds {
        // Each round starts with a different VM: the model never sees one order only.
        let first = usize::try_from(round).unwrap_or(0) % VMS.len();
        for k in 0..VMS.len() {
            let i = (first + k) % VMS.len();
            let to = at[i].other();
            let record = move_once(lab, exe, VMS[i], (at[i], to), round).await;
            emit(&serde_json::to_value(&record)?)?;
            moves += 1;
            if record.completed {
                at[i] = to;
            } else {
                failures += 1;
            }
        }
    }
    let mut fit = FleetFitRecord {
        kind: "fit",
        migrations: moves - failures,
        ..FleetFitRecord::default()
    };
    // The leader refits every few new migrations: wait for the one over all of them.
    let wanted = moves - failures;
    let mut model = serde_json::Value::Null;
    let fitted = wait_until(Duration::from_secs(120), || {
        model = cost_model(lab, exe).unwrap_or_default();
        model["fitted_samples"].as_u64() == Some(wanted as u64)
    });
    if fitted.is_err() {
        tracing::warn!(
            "the controller's fit does not cover all {wanted} migrations: {}",
            model
        );
    }
    fit.fitted_samples = model["fitted_samples"]
        .as_u64()
        .and_then(|n| usize::try_from(n).ok());
    let error = &model["error"];
    fit.folds = error["folds"]
        .as_u64()
        .and_then(|n| usize::try_from(n).ok());
    fit.error_total = error["total"].as_f64();
    fit.error_wan_bytes = error["wan_bytes"].as_f64();
    fit.error_pause = error["pause"].as_f64();
    fit.params = model["params"].clone();
    for ((name, ..), site) in VMS.into_iter().zip(&at) {
        let serial = lab.host_dir(*site).join(format!("{name}.serial"));
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default())).await?;
        fit.verify_errors += crate::guest::verify(&link, false).await?.errors();
    }
    emit(&serde_json::to_value(&fit)?)?;
    Ok(failures)
}

/// The controller's cost model for libvirt domains.
fn cost_model(lab: &Lab, exe: &std::path::Path) -> Result<serde_json::Value> {
    fleet_json(lab, exe, "cost-model")?
        .into_iter()
        .find(|m| m["kind"] == "libvirt")
        .context("no cost model for libvirt domains")
}

async fn move_once(
    lab: &Lab,
    exe: &std::path::Path,
    (name, mem_mib, ..): (&str, u32, u32, f64),
    (from, to): (Site, Site),
    round: u32,
) -> FleetMoveRecord {
    let mut record = FleetMoveRecord {
        kind: "move",
        round,
        vm: name.into(),
        from: from.name(),
        to: to.name(),
        mem_mib,
        ..FleetMoveRecord::default()
    };
    if let Err(e) = measure(lab, exe, (from, to), &mut record).await {
        record.error = Some(format!("{e:#}"));
    }
    record
}

async fn measure(
    lab: &Lab,
    exe: &std::path::Path,
    (from, to): (Site, Site),
    record: &mut FleetMoveRecord,
) -> Result<()> {
    let name = record.vm.clone();
    let host = format!("site-{}", from.name());
    // The move's inputs as the controller will record them.
    wait_until(Duration::from_secs(90), || {
        fleet_json(lab, exe, "vms").is_ok_and(|vms| {
            vms.iter().any(|v| {
                v["name"] == name.as_str()
                    && v["host"] == host.as_str()
                    && v["usage"]["used_bytes"].is_u64()
            })
        })
    })
    .with_context(|| format!("{host} does not report {name}'s use"))?;
    let model_before = cost_model(lab, exe)?;
    record.predicted_by = model_before["source"].as_str().unwrap_or("?").to_owned();
    let wan_before = crate::wan::stats(&lab.wan_socket())?.total_bytes();
    let out = fleet(
        lab,
        exe,
        &["migrate", &name, "--to-site", to.name()].map(String::from),
    );
    record.wan_bytes = crate::wan::stats(&lab.wan_socket())?
        .total_bytes()
        .saturating_sub(wan_before);
    out?;
    let m = fleet_json(lab, exe, "migrations")?
        .into_iter()
        .filter(|m| m["vm"] == name.as_str())
        .max_by_key(|m| m["created_unix_ms"].as_u64())
        .context("the controller lists no migration of the VM")?;
    if m["state"] != "committed" {
        bail!("the migration ended {}: {}", m["state"], m["error"]);
    }
    let planned = &m["planned"];
    record.used_mib = planned["used_bytes"].as_u64().map(|b| b >> 20);
    #[allow(clippy::cast_precision_loss)]
    {
        record.dirty_mib_s = planned["dirty_bytes_per_s"]
            .as_u64()
            .map(|b| b as f64 / 1048576.0);
    }
    record.predicted_ms = planned["predicted_ms"].as_u64().unwrap_or(0);
    record.predicted_wan_bytes = planned["predicted_wan_bytes"].as_u64().unwrap_or(0);
    record.predicted_pause_ms = planned["predicted_pause_ms"].as_u64().unwrap_or(0);
    let agent = &m["agent"];
    let started = agent["started_unix_ms"].as_u64().unwrap_or(0);
    let committed = agent["events"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["kind"] == "committed")
        .and_then(|e| e["unix_ms"].as_u64())
        .context("the agent reported no commit time")?;
    record.total_ms = committed.saturating_sub(started);
    record.agent_wan_bytes = agent["wire"]["bytes_out"].as_u64().unwrap_or(0)
        + agent["wire"]["bytes_in"].as_u64().unwrap_or(0);
    #[allow(clippy::cast_precision_loss)]
    if let (Some(stop), Some(resume)) = (
        agent["source_stop_unix_us"].as_i64(),
        agent["destination_resume_unix_us"].as_i64(),
    ) {
        record.pause_ms = Some((resume - stop) as f64 / 1000.0);
    }
    record.completed = true;
    Ok(())
}
