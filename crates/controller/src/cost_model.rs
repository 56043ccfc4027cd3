//! The cost model the planner prices moves with (docs/policies.md, "The cost model"),
//! calibrated from the fleet's own migrations.
//!
//! When a migration is requested the controller records what it knows of the move
//! ([`PlannedMove`]: the VM's memory, its guest's use and dirty rate, the link `[policy]`
//! names between the sites) and what the model predicts. Once it commits, the source agent's
//! figures say what it cost: the time from its start to the commit, the bytes its transport
//! carried, the pause from the source's stop to the destination's resume. With
//! [`SAMPLES_NEEDED`] such migrations of a kind (libvirt domains and bare QEMU VMs are fitted
//! apart: libvirt's own steps cost time QEMU's do not) the leader fits ferry-policy's model to
//! the most recent [`SAMPLES_KEPT`], measures its error by k-fold cross-validation, and the
//! planner prices that kind's moves with the fit; before, with ferry's built-in figures (fitted
//! to the lab's benchmarks). A fit runs on a blocking thread; a refit waits for
//! [`REFIT_AFTER`] new samples.
//!
//! Migrations that copied their disks are left out (the controller does not know a disk's
//! size before), as are those whose VM's use was not reported when requested.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ferry_api::fleet::{
    CostModelError, FleetCostModel, FleetMigration, FleetMigrationState, PlannedMove, Unplanned,
    VmKind, VmUsage,
};
use ferry_api::settings::MigrationSettings;
use ferry_api::EventKind;
use ferry_policy::calibrate::{cross_validate, fit, Observed};
use ferry_policy::cost::{Move, Params};

use crate::config::PolicyConfig;
use crate::store::now_ms;

/// Committed migrations of a kind before the fleet's own fit replaces the built-in figures.
pub const SAMPLES_NEEDED: usize = 8;
/// The fit covers the most recent ones: the current build's and links' behaviour.
pub const SAMPLES_KEPT: usize = 200;
/// New samples after which the model is fitted again.
pub const REFIT_AFTER: usize = 4;
const FOLDS: usize = 5;

/// The dirty rate assumed per CPU a VM uses, when its agent has not measured one.
const DIRTY_BYTES_PER_CPU_S: f64 = 4.0 * 1048576.0;
/// The round trip assumed within a site.
const LAN_RTT_S: f64 = 0.0005;

/// The figures in use per kind of VM, and the fits' state.
#[derive(Default)]
pub struct CostModelState {
    fitted: Arc<Mutex<BTreeMap<&'static str, Fitted>>>,
    /// A fit is running (one at a time).
    fitting: Arc<Mutex<bool>>,
}

#[derive(Clone)]
struct Fitted {
    params: Params,
    samples: usize,
    unix_ms: u64,
    error: Option<CostModelError>,
}

/// What the controller knows of moving a VM that uses `usage` across the link between two
/// sites (`across`) or within one, with `settings`.
pub fn planned_move(
    usage: &VmUsage,
    across: bool,
    policy: &PolicyConfig,
    settings: &MigrationSettings,
) -> PlannedMove {
    let (link_bits_per_s, rtt_s) = if across {
        (policy.wan_bits_per_s, policy.wan_rtt_s)
    } else {
        (policy.lan_bits_per_s, LAN_RTT_S)
    };
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    PlannedMove {
        mem_bytes: usage.mem_bytes,
        used_bytes: usage.used_bytes,
        dirty_bytes_per_s: usage.dirty_bytes_per_s,
        cpu_millis: usage.cpu_millis,
        link_bits_per_s: link_bits_per_s.max(0.0) as u64,
        rtt_us: (rtt_s * 1e6).max(0.0) as u64,
        downtime_target_ms: settings.downtime_ms,
        predicted_ms: 0,
        predicted_wan_bytes: 0,
        predicted_pause_ms: 0,
    }
}

/// The cost model's input for a planned move. The guest's use bounds what it keeps rewriting
/// (a quarter of its memory when unknown); its measured dirty rate, or a rate per CPU it uses.
#[allow(clippy::cast_precision_loss)]
pub fn move_of(p: &PlannedMove) -> Move {
    let mem = p.mem_bytes as f64;
    Move {
        mem_bytes: mem,
        used_bytes: p.used_bytes.map(|u| u as f64),
        working_set_bytes: p.used_bytes.map_or(mem / 4.0, |u| u as f64),
        dirty_bytes_per_s: p.dirty_bytes_per_s.map_or_else(
            || p.cpu_millis as f64 / 1000.0 * DIRTY_BYTES_PER_CPU_S,
            |d| d as f64,
        ),
        disk_bytes: 0.0,
        link_bits_per_s: p.link_bits_per_s as f64,
        rtt_s: p.rtt_us as f64 / 1e6,
        downtime_target_s: p.downtime_target_ms as f64 / 1000.0,
        // The controller cannot tell a guest's pages apart: one mix per fleet.
        page_mix: "ws".into(),
    }
}

/// A committed migration as the fit sees it, or why it cannot be one.
pub fn observed(m: &FleetMigration) -> Result<Observed, &'static str> {
    if m.state != FleetMigrationState::Committed {
        return Err("not committed");
    }
    if m.copy_storage {
        return Err("copied its disks (their size is not known before)");
    }
    let planned = m
        .planned
        .as_ref()
        .ok_or("its VM's use was not reported when it was requested")?;
    let agent = m.agent.as_ref().ok_or("its agent reported no figures")?;
    let committed_ms = agent
        .events
        .iter()
        .find(|e| e.kind == EventKind::Committed)
        .map(|e| e.unix_ms)
        .ok_or("its agent reported no commit time")?;
    let total_ms = committed_ms
        .checked_sub(agent.started_unix_ms)
        .filter(|ms| *ms > 0)
        .ok_or("its agent's commit time is not after its start")?;
    let wan_bytes = agent.wire.bytes_out + agent.wire.bytes_in;
    if wan_bytes == 0 {
        return Err("its agent counted no bytes on the WAN");
    }
    let pause_us = match (agent.source_stop_unix_us, agent.destination_resume_unix_us) {
        (Some(stop), Some(resume)) if resume > stop => Some(resume - stop),
        _ => None,
    };
    #[allow(clippy::cast_precision_loss)]
    Ok(Observed {
        system: m.kind.name().to_owned(),
        planned: move_of(planned),
        total_s: total_ms as f64 / 1000.0,
        wan_bytes: wan_bytes as f64,
        downtime_s: pause_us.map(|us| us as f64 / 1e6),
    })
}

/// The kinds the model is fitted for.
const KINDS: [VmKind; 2] = [VmKind::Libvirt, VmKind::Qemu];

impl CostModelState {
    /// The figures `kind`'s moves are priced with.
    pub fn params(&self, kind: VmKind) -> Params {
        self.fitted
            .lock()
            .expect("cost model lock")
            .get(kind.name())
            .map_or_else(Params::ferry_fitted, |f| f.params.clone())
    }

    /// `planned` with the model's prediction filled in.
    pub fn predict(&self, kind: VmKind, mut planned: PlannedMove) -> PlannedMove {
        let cost = self.params(kind).predict(&move_of(&planned));
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        {
            planned.predicted_ms = (cost.total_s * 1000.0).max(0.0) as u64;
            planned.predicted_wan_bytes = cost.wan_bytes.max(0.0) as u64;
            planned.predicted_pause_ms = (cost.downtime_s * 1000.0).max(0.0) as u64;
        }
        planned
    }

    /// Fits again, in the background, each kind with enough new committed migrations among
    /// `migrations` (oldest first).
    pub fn refit_if_due(&self, migrations: &[FleetMigration]) {
        for kind in KINDS {
            let samples = samples_of(kind, migrations);
            let due = samples.len() >= SAMPLES_NEEDED
                && self
                    .fitted
                    .lock()
                    .expect("cost model lock")
                    .get(kind.name())
                    .is_none_or(|f| samples.len() >= f.samples + REFIT_AFTER);
            if !due {
                continue;
            }
            {
                let mut fitting = self.fitting.lock().expect("fitting lock");
                if *fitting {
                    return;
                }
                *fitting = true;
            }
            let fitted = self.fitted.clone();
            let fitting = self.fitting.clone();
            tokio::task::spawn_blocking(move || {
                match fit_and_check(kind, &samples) {
                    Ok(f) => {
                        tracing::info!(
                            "cost model for {} VMs fitted to {} migrations: median error on unseen ones {:.1}% in time, {:.1}% in WAN bytes",
                            kind.name(),
                            f.samples,
                            f.error.as_ref().map_or(f64::NAN, |e| e.total * 100.0),
                            f.error.as_ref().map_or(f64::NAN, |e| e.wan_bytes * 100.0),
                        );
                        fitted
                            .lock()
                            .expect("cost model lock")
                            .insert(kind.name(), f);
                    }
                    Err(e) => tracing::warn!("fitting the cost model for {}: {e}", kind.name()),
                }
                *fitting.lock().expect("fitting lock") = false;
            });
            // One kind per round.
            return;
        }
    }

    /// What `GET /v1/cost-model` shows for each kind.
    pub fn describe(&self, migrations: &[FleetMigration]) -> Vec<FleetCostModel> {
        let fitted = self.fitted.lock().expect("cost model lock").clone();
        KINDS
            .iter()
            .map(|&kind| {
                let mut left_out = Vec::new();
                let mut samples = 0;
                for m in migrations
                    .iter()
                    .filter(|m| m.kind == kind && m.state == FleetMigrationState::Committed)
                {
                    match observed(m) {
                        Ok(_) => samples += 1,
                        Err(why) => left_out.push(Unplanned {
                            name: format!("{} ({})", m.id, m.vm),
                            why: why.into(),
                        }),
                    }
                }
                let f = fitted.get(kind.name());
                FleetCostModel {
                    kind: kind.name().into(),
                    source: if f.is_some() { "fleet" } else { "built-in" }.into(),
                    samples,
                    samples_needed: SAMPLES_NEEDED,
                    fitted_samples: f.map(|f| f.samples),
                    fitted_unix_ms: f.map(|f| f.unix_ms),
                    error: f.and_then(|f| f.error.clone()),
                    params: serde_json::to_value(
                        f.map_or_else(Params::ferry_fitted, |f| f.params.clone()),
                    )
                    .unwrap_or_default(),
                    left_out,
                }
            })
            .collect()
    }
}

/// `kind`'s most recent committed migrations the fit can use (at most [`SAMPLES_KEPT`]).
fn samples_of(kind: VmKind, migrations: &[FleetMigration]) -> Vec<Observed> {
    let mut samples: Vec<(u64, Observed)> = migrations
        .iter()
        .filter(|m| m.kind == kind)
        .filter_map(|m| Some((m.finished_unix_ms?, observed(m).ok()?)))
        .collect();
    samples.sort_by_key(|(at, _)| *at);
    let skip = samples.len().saturating_sub(SAMPLES_KEPT);
    samples.into_iter().skip(skip).map(|(_, o)| o).collect()
}

/// The model fitted to all of `samples`, with its error on the ones each fold's fit did not
/// see.
fn fit_and_check(kind: VmKind, samples: &[Observed]) -> Result<Fitted, String> {
    let all: Vec<&Observed> = samples.iter().collect();
    let params = fit(kind.name(), &all).map_err(|e| e.to_string())?;
    let error = cross_validate(samples, FOLDS)
        .map_err(|e| e.to_string())?
        .into_iter()
        .next()
        .map(|e| CostModelError {
            samples: e.samples,
            folds: FOLDS.min(e.samples),
            total: e.total,
            wan_bytes: e.wan_bytes,
            pause: e.downtime,
        });
    Ok(Fitted {
        params,
        samples: samples.len(),
        unix_ms: now_ms(),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::agent::{AgentEvent, MigrationStatus};
    use std::time::{Duration, Instant};

    fn policy() -> PolicyConfig {
        crate::config::ControllerConfig::parse(
            include_str!("../../../contrib/controller.toml"),
            std::path::Path::new("/etc/ferry/controller.toml"),
        )
        .unwrap()
        .policy
    }

    /// A committed migration of a VM using `usage`, which took what `truth` predicts of it
    /// (times a little noise), as its source agent would report it.
    fn committed(i: usize, usage: VmUsage, truth: &Params) -> FleetMigration {
        let state = CostModelState::default();
        let planned = state.predict(
            VmKind::Libvirt,
            planned_move(&usage, true, &policy(), &MigrationSettings::default()),
        );
        let cost = truth.predict(&move_of(&planned));
        #[allow(clippy::cast_precision_loss)]
        let noise = 1.0 + 0.03 * (((i * 7919) % 11) as f64 / 10.0 - 0.5);
        let started = 1_000_000 + 100_000 * i as u64;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let total_ms = (cost.total_s * 1000.0 * noise) as u64;
        let mut status = MigrationStatus::starting("a".into(), "vm1".into(), started);
        status.state = ferry_api::agent::MigrationState::Committed;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        {
            status.wire.bytes_out = (cost.wan_bytes * noise) as u64;
            let stop = (started + total_ms) as i64 * 1000 - (cost.downtime_s * 1e6 * noise) as i64;
            status.source_stop_unix_us = Some(stop);
        }
        status.destination_resume_unix_us = Some((started + total_ms) as i64 * 1000);
        status.events.push(AgentEvent {
            unix_ms: started + total_ms,
            kind: EventKind::Committed,
            detail: String::new(),
        });
        let mut m = crate::store::tests::migration(&format!("m{i}"));
        m.state = FleetMigrationState::Committed;
        m.finished_unix_ms = Some(started + total_ms + 500);
        m.planned = Some(planned);
        m.agent = Some(status);
        m
    }

    fn usage(i: usize) -> VmUsage {
        VmUsage {
            cpu_millis: 100,
            mem_bytes: [128u64, 256, 512, 1024][i % 4] << 20,
            used_bytes: Some([60u64, 90, 120][i % 3] << 20),
            dirty_bytes_per_s: Some([0u64, 1, 2, 4, 8][i % 5] << 20),
        }
    }

    fn truth() -> Params {
        let mut p = Params::initial(&["ws".into()]);
        p.link_share = 0.85;
        p.start_s = 1.5;
        p.pause_s = 0.05;
        p.coding[0].1.first_pass = 0.6;
        p.coding[0].1.dirty = 0.4;
        p.free_coding = Some(0.002);
        p
    }

    #[test]
    fn a_committed_migration_is_observed_from_its_plan_and_its_agents_figures() {
        let m = committed(0, usage(0), &truth());
        let o = observed(&m).unwrap();
        assert_eq!(o.system, "libvirt");
        assert_eq!(o.planned.mem_bytes, 128.0 * 1048576.0);
        assert_eq!(o.planned.used_bytes, Some(60.0 * 1048576.0));
        assert_eq!(o.planned.dirty_bytes_per_s, 0.0);
        assert_eq!(o.planned.link_bits_per_s, policy().wan_bits_per_s);
        let agent = m.agent.as_ref().unwrap();
        #[allow(clippy::cast_precision_loss)]
        {
            assert_eq!(o.wan_bytes, agent.wire.bytes_out as f64);
            assert_eq!(
                o.total_s,
                (agent.events[0].unix_ms - agent.started_unix_ms) as f64 / 1e3
            );
        }
        assert!(o.downtime_s.unwrap() > 0.0);
        // The prediction made when it was requested is kept with it.
        assert!(m.planned.as_ref().unwrap().predicted_ms > 0);
    }

    #[test]
    fn migrations_without_what_the_fit_needs_are_left_out_and_say_why() {
        let good = committed(0, usage(0), &truth());
        type Spoil = fn(&mut FleetMigration);
        let cases: [(Spoil, &str); 5] = [
            (|m| m.state = FleetMigrationState::Failed, "not committed"),
            (
                |m| m.copy_storage = true,
                "copied its disks (their size is not known before)",
            ),
            (
                |m| m.planned = None,
                "its VM's use was not reported when it was requested",
            ),
            (
                |m| m.agent.as_mut().unwrap().events.clear(),
                "its agent reported no commit time",
            ),
            (
                |m| m.agent.as_mut().unwrap().wire.bytes_out = 0,
                "its agent counted no bytes on the WAN",
            ),
        ];
        for (spoil, why) in cases {
            let mut m = good.clone();
            spoil(&mut m);
            assert_eq!(observed(&m).unwrap_err(), why);
        }
        let state = CostModelState::default();
        let mut copied = good.clone();
        copied.copy_storage = true;
        let described = state.describe(&[good, copied]);
        assert_eq!(described[0].kind, "libvirt");
        assert_eq!(described[0].source, "built-in");
        assert_eq!(described[0].samples, 1);
        assert_eq!(described[0].left_out.len(), 1);
        assert_eq!(described[1].kind, "qemu");
        assert_eq!(described[1].samples, 0);
    }

    /// The fleet's own migrations replace the built-in figures once there are enough, and the
    /// fit predicts the ones it did not see.
    #[tokio::test]
    async fn enough_migrations_fit_the_model_and_report_its_error_on_unseen_ones() {
        let truth = truth();
        let all: Vec<FleetMigration> = (0..24).map(|i| committed(i, usage(i), &truth)).collect();
        let state = CostModelState::default();
        state.refit_if_due(&all[..SAMPLES_NEEDED - 1]);
        assert!(!*state.fitting.lock().unwrap(), "too few to fit");
        state.refit_if_due(&all);
        let deadline = Instant::now() + Duration::from_secs(120);
        while state.describe(&all)[0].source != "fleet" {
            assert!(Instant::now() < deadline, "no fit within 2 minutes");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let d = &state.describe(&all)[0];
        assert_eq!(d.fitted_samples, Some(24));
        let e = d.error.as_ref().unwrap();
        assert_eq!((e.samples, e.folds), (24, 5));
        assert!(e.total < 0.1 && e.wan_bytes < 0.1, "{e:?}");
        // Priced with the fleet's figures now.
        let planned = planned_move(&usage(3), true, &policy(), &MigrationSettings::default());
        let by_fleet = state.params(VmKind::Libvirt).predict(&move_of(&planned));
        let by_truth = truth.predict(&move_of(&planned));
        assert!((by_fleet.wan_bytes / by_truth.wan_bytes - 1.0).abs() < 0.1);
        assert_eq!(state.params(VmKind::Qemu), Params::ferry_fitted());
        // No refit until enough new ones arrived.
        state.refit_if_due(&all);
        assert!(!*state.fitting.lock().unwrap());
    }
}
