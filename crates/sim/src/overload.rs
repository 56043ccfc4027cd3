//! Overload on a simulated clock (Williams' Overdriver, reference B.6): VMs whose memory was
//! oversubscribed (given `allocated` of the `requested` they asked for) overload now and then;
//! each overload is met by migration only (Overdriver's baseline: migrate at the first sign)
//! or as Overdriver meets it, by ferry's own [`Detector`]: cooperative swap to peers' spare
//! memory while it is transient, a migration once it is sustained.
//!
//! The stated model: every 10 s interval a VM not in overload starts one with probability
//! `start_p`; an overload is transient with probability 0.96 (lasting 1 to 6 intervals,
//! uniform) and sustained otherwise (20 to 90 intervals, uniform): Williams' 16% of intervals
//! overloaded, 4% of overloads sustained, when `start_p` is 0.0335. A migration moves the
//! requested memory, lasting what the cost model predicts on the link; meanwhile (and with
//! migration only, from the overload's start until it ends) the VM pages to its local disk,
//! which is the SLA violation. Cooperative swap costs `swap_bytes_per_s` on the network while
//! it lasts (Williams' Table 6.3 gives 11 to 25 MB/s; 15 is used) and needs the withheld
//! memory as spare at a peer. A migrated VM keeps its new, full allocation for the rest of
//! the overload; the next one finds it oversubscribed again.

use ferry_policy::cost::{Move, Params};
use ferry_policy::overload::{Detector, DetectorSettings, Pressure};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

const MIB: f64 = 1048576.0;
pub const INTERVAL_S: f64 = 10.0;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    pub vms: usize,
    pub hours: f64,
    pub requested_mib: f64,
    pub allocated_mib: f64,
    pub start_p: f64,
    pub swap_bytes_per_s: f64,
    pub link_bits_per_s: f64,
    pub rtt_s: f64,
    /// Migrations by ferry (the cost model: coded, its pages' mix `ws`), or raw as Williams'
    /// Xen moved them (the requested memory at the link's rate).
    pub coded: bool,
    pub seed: u64,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            vms: 150,
            hours: 24.0,
            requested_mib: 1024.0,
            allocated_mib: 640.0,
            start_p: 0.0335,
            swap_bytes_per_s: 15e6,
            link_bits_per_s: 1e9,
            rtt_s: 0.001,
            coded: true,
            seed: 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    MigrationOnly,
    Overdriver,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    pub strategy: Strategy,
    pub overloads: usize,
    pub overloaded_share: f64,
    /// Shares of VM-time in transient and in sustained overloads (by the drawn length): the
    /// capacity planner's probabilities for this pool.
    pub transient_share: f64,
    pub sustained_share: f64,
    pub migrations: usize,
    /// VM-seconds paging to local disk (the SLA violation). Overdriver's is zero by the
    /// model: cooperative swap takes the overflow from the first interval.
    pub violation_s: f64,
    /// VM-seconds on peers' memory.
    pub swap_s: f64,
    pub network_bytes: f64,
    /// The most spare memory in use at once: whole VMs for migrations under way, the
    /// withheld memory for VMs on cooperative swap.
    pub peak_spare_bytes: f64,
}

/// One VM's overload under way.
#[derive(Clone, Copy, Default)]
struct Episode {
    left: u32,
    long: bool,
    /// A migration's remaining intervals, and whether one finished.
    migrating: u32,
    migrated: bool,
}

fn migration_intervals(setup: &Setup, params: &Params) -> (u32, f64) {
    let bytes = setup.requested_mib * MIB;
    let (total_s, wan_bytes) = if setup.coded {
        let cost = params.predict(&Move {
            mem_bytes: bytes,
            used_bytes: None,
            working_set_bytes: setup.allocated_mib * MIB,
            dirty_bytes_per_s: 8.0 * MIB,
            disk_bytes: 0.0,
            link_bits_per_s: setup.link_bits_per_s,
            rtt_s: setup.rtt_s,
            downtime_target_s: 0.3,
            page_mix: "ws".into(),
        });
        (cost.total_s, cost.wan_bytes)
    } else {
        (bytes * 8.0 / setup.link_bits_per_s, bytes)
    };
    let n = (total_s / INTERVAL_S).ceil().max(1.0);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = n as u32;
    (n, wan_bytes)
}

/// Runs `strategy` over `setup`'s VMs (the overloads are the same for both strategies: one
/// seed).
pub fn run(setup: &Setup, params: &Params, strategy: Strategy) -> Outcome {
    let mut rng = StdRng::seed_from_u64(setup.seed);
    let (migration_n, migration_bytes) = migration_intervals(setup, params);
    let withheld = (setup.requested_mib - setup.allocated_mib) * MIB;
    let mut episodes = vec![Episode::default(); setup.vms];
    let mut detectors = vec![Detector::new(DetectorSettings::default()); setup.vms];
    let mut out = Outcome {
        strategy,
        overloads: 0,
        overloaded_share: 0.0,
        transient_share: 0.0,
        sustained_share: 0.0,
        migrations: 0,
        violation_s: 0.0,
        swap_s: 0.0,
        network_bytes: 0.0,
        peak_spare_bytes: 0.0,
    };
    let intervals = (setup.hours * 3600.0 / INTERVAL_S).round();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let intervals = intervals as u64;
    let mut overloaded_intervals = 0u64;
    let mut long_intervals = 0u64;
    for _ in 0..intervals {
        let mut spare = 0.0;
        for (e, d) in episodes.iter_mut().zip(detectors.iter_mut()) {
            if e.left == 0 && rng.random_bool(setup.start_p) {
                e.left = if rng.random_bool(0.96) {
                    rng.random_range(1..=6)
                } else {
                    rng.random_range(20..=90)
                };
                e.long = e.left >= 20;
                e.migrated = false;
                out.overloads += 1;
            }
            long_intervals += u64::from(e.left > 0 && e.long);
            let overloaded = e.left > 0 && !e.migrated;
            overloaded_intervals += u64::from(e.left > 0);
            let pressure = match strategy {
                Strategy::MigrationOnly if overloaded => Pressure::Sustained,
                Strategy::MigrationOnly => Pressure::Normal,
                Strategy::Overdriver => d.observe(overloaded),
            };
            if pressure == Pressure::Sustained && e.migrating == 0 && overloaded {
                e.migrating = migration_n;
                out.migrations += 1;
                out.network_bytes += migration_bytes;
            }
            if e.migrating > 0 {
                spare += setup.requested_mib * MIB;
            }
            if overloaded {
                match strategy {
                    Strategy::MigrationOnly => out.violation_s += INTERVAL_S,
                    Strategy::Overdriver => {
                        out.swap_s += INTERVAL_S;
                        out.network_bytes += setup.swap_bytes_per_s * INTERVAL_S;
                        spare += withheld;
                    }
                }
            }
            if e.migrating > 0 {
                e.migrating -= 1;
                if e.migrating == 0 {
                    e.migrated = true;
                    d.forget();
                }
            }
            e.left = e.left.saturating_sub(1);
        }
        out.peak_spare_bytes = out.peak_spare_bytes.max(spare);
    }
    let all = (intervals * setup.vms as u64).max(1) as f64;
    out.overloaded_share = overloaded_intervals as f64 / all;
    out.sustained_share = long_intervals as f64 / all;
    out.transient_share = out.overloaded_share - out.sustained_share;
    out
}

/// The network traffic of one overload of `duration_s`, met by cooperative swap only, by
/// migration only, and by Overdriver (Williams' Fig. 6.7).
pub fn traffic_of_one(setup: &Setup, params: &Params, duration_s: f64) -> (f64, f64, f64) {
    let (_, migration_bytes) = migration_intervals(setup, params);
    let swap = setup.swap_bytes_per_s * duration_s;
    let mut d = Detector::new(DetectorSettings::default());
    let intervals = (duration_s / INTERVAL_S).ceil();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let intervals = intervals as u64;
    let mut overdriver = 0.0;
    for _ in 0..intervals {
        // Swapping until the migration has taken the VM (the interval it starts in).
        overdriver += setup.swap_bytes_per_s * INTERVAL_S;
        if d.observe(true) == Pressure::Sustained {
            overdriver += migration_bytes;
            break;
        }
    }
    (swap, migration_bytes, overdriver)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consolidation::ferry_params;

    #[test]
    fn overdriver_moves_less_and_violates_less_than_migrating_on_every_overload() {
        // Raw migrations, as in Williams' setting.
        let setup = Setup {
            coded: false,
            ..Setup::default()
        };
        let params = ferry_params();
        let only = run(&setup, &params, Strategy::MigrationOnly);
        let od = run(&setup, &params, Strategy::Overdriver);
        assert_eq!(only.overloads, od.overloads);
        assert!(
            (0.12..0.20).contains(&only.overloaded_share),
            "{}",
            only.overloaded_share
        );
        assert!(od.migrations * 5 < only.migrations, "{od:?}");
        assert!(od.network_bytes < only.network_bytes, "{od:?} {only:?}");
        assert!(only.violation_s >= only.overloads as f64 * INTERVAL_S);
        // ferry's coded migrations cost less than the swap traffic of a transient overload.
        let coded = Setup::default();
        let only = run(&coded, &params, Strategy::MigrationOnly);
        let od = run(&coded, &params, Strategy::Overdriver);
        assert!(od.network_bytes > only.network_bytes, "{od:?} {only:?}");
    }

    #[test]
    fn one_overload_costs_swap_until_it_is_sustained_then_a_migration() {
        let setup = Setup {
            coded: false,
            ..Setup::default()
        };
        let params = ferry_params();
        let (swap, migration, od) = traffic_of_one(&setup, &params, 30.0);
        assert_eq!(od, swap);
        assert!(migration > swap);
        let (swap, migration, od) = traffic_of_one(&setup, &params, 600.0);
        assert!(swap > migration);
        // Eight intervals of swap, then the migration.
        assert!((od - (8.0 * INTERVAL_S * setup.swap_bytes_per_s + migration)).abs() < 1.0);
    }
}
