//! Consolidation on a simulated clock (Isci et al.'s energy study, reference A.7): a fleet
//! whose VMs follow [`crate::trace`] days, planned every minute by ferry's own
//! [`Planner`] and carried out within ferry's own [`schedule`] limits, each move lasting what
//! the cost model predicts for it on the link between its hosts. What comes out: the energy
//! against static consolidation, the hosts running over the day, the migrations, and the
//! demand the hosts could not serve (the SLA).
//!
//! The model of a host: `idle_w` when on (and while it starts, `boot_s`), plus `busy_w` at
//! full CPU, linear between; the busy power follows the work demanded, the same in both
//! runs (work a host over its capacity could not serve is done later). A host over its
//! capacity serves its capacity; the rest is unserved demand, and each VM on it is "short"
//! that minute. Static consolidation, the baseline, runs the fewest hosts that hold every
//! VM's daily peak (CPU and memory) within `static_headroom`, all day. The migration's own
//! CPU cost is not modelled.

use std::time::Instant;

use ferry_policy::consolidate::{MoveCost, PlannedMove, Planner, Reason, Settings};
use ferry_policy::cost::{Cost, Move, Params};
use ferry_policy::fleet::{Fleet, Host, Resources, Vm};
use ferry_policy::schedule::{startable, Hop, Limits};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::trace::{Shape, Trace};

const GIB: f64 = 1073741824.0;

/// ferry's figures fitted to the lab's migrations ([`Params::ferry_fitted`]).
pub fn ferry_params() -> Params {
    Params::ferry_fitted()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    pub hosts: usize,
    pub vms: usize,
    pub sites: usize,
    pub host_cpus: f64,
    pub host_mem_gib: f64,
    pub hours: f64,
    /// The clock's step, which is also how often the planner runs.
    pub step_s: f64,
    pub boot_s: f64,
    /// The link between hosts of one site, and between sites.
    pub lan_bits_per_s: f64,
    pub lan_rtt_s: f64,
    pub wan_bits_per_s: f64,
    pub wan_rtt_s: f64,
    pub idle_w: f64,
    pub busy_w: f64,
    pub seed: u64,
    /// The headroom static consolidation keeps (fixed, so that every setting of the planner
    /// is compared with one baseline).
    pub static_headroom: f64,
    pub shape: Shape,
    pub settings: Settings,
    pub limits: Limits,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            hosts: 200,
            vms: 2000,
            sites: 2,
            host_cpus: 64.0,
            host_mem_gib: 512.0,
            hours: 24.0,
            step_s: 60.0,
            boot_s: 120.0,
            lan_bits_per_s: 10e9,
            lan_rtt_s: 0.0005,
            wan_bits_per_s: 1e9,
            wan_rtt_s: 0.03,
            idle_w: 150.0,
            busy_w: 150.0,
            seed: 1,
            static_headroom: 0.2,
            shape: Shape::default(),
            settings: Settings {
                headroom: 0.2,
                hold_s: 600.0,
                margin_hosts: 1,
                cooldown_s: 1800.0,
                min_on_s: 3600.0,
                max_moves: 1_000_000,
            },
            limits: Limits {
                per_host: 2,
                per_link: 10_000,
            },
        }
    }
}

/// What a simulated run gives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    pub energy_kwh: f64,
    /// Static consolidation's, for the same days and work.
    pub static_kwh: f64,
    pub static_hosts: usize,
    pub mean_hosts_on: f64,
    pub migrations: usize,
    /// Of them, off hosts over their capacity (the rest emptied hosts).
    pub relief_migrations: usize,
    pub migrations_per_hour: f64,
    pub wan_bytes: f64,
    /// Moves' times: the median, and the longest.
    pub median_move_s: f64,
    pub max_move_s: f64,
    /// CPU demand the hosts could not serve, as a share of all demand.
    pub unserved_share: f64,
    /// VM-minutes spent on a host over its capacity, as a share of all VM-minutes.
    pub short_share: f64,
    /// Hosts running, by the hour.
    pub hosts_on: Vec<(f64, usize)>,
    /// Real time the run took.
    pub wall_s: f64,
}

impl Outcome {
    pub fn normalized_energy(&self) -> f64 {
        self.energy_kwh / self.static_kwh
    }
}

/// Costs a move by the fitted model, on the link between the hosts' sites.
struct ModelCost<'a> {
    params: &'a Params,
    setup: &'a Setup,
}

impl ModelCost<'_> {
    fn planned(&self, fleet: &Fleet, vm: usize, to: usize) -> Move {
        let v = &fleet.vms[vm];
        let across = fleet.hosts[v.host].site != fleet.hosts[to].site;
        let (link_bits_per_s, rtt_s) = if across {
            (self.setup.wan_bits_per_s, self.setup.wan_rtt_s)
        } else {
            (self.setup.lan_bits_per_s, self.setup.lan_rtt_s)
        };
        Move {
            mem_bytes: v.demand.mem_bytes,
            used_bytes: None,
            working_set_bytes: v.demand.mem_bytes / 4.0,
            dirty_bytes_per_s: v.demand.cpus * self.setup.shape.dirty_bytes_per_cpu_s,
            disk_bytes: 0.0,
            link_bits_per_s,
            rtt_s,
            downtime_target_s: 0.3,
            page_mix: "ws".into(),
        }
    }
}

impl MoveCost for ModelCost<'_> {
    fn cost(&self, fleet: &Fleet, vm: usize, to: usize) -> Cost {
        self.params.predict(&self.planned(fleet, vm, to))
    }
}

/// A move under way.
struct Running {
    vms: Vec<usize>,
    hop: Hop,
    ends_s: f64,
}

/// The fewest hosts that hold every VM's peak (its daily peak with noise, and its memory)
/// within the same headroom the planner keeps.
fn static_hosts(setup: &Setup, traces: &[Trace], mem: &[f64]) -> usize {
    let cpus: f64 = traces
        .iter()
        .map(|t| t.peak_cpus * (1.0 + setup.shape.noise))
        .sum();
    let mem: f64 = mem.iter().sum();
    let usable = 1.0 - setup.static_headroom;
    let by_cpu = cpus / (setup.host_cpus * usable);
    let by_mem = mem / (setup.host_mem_gib * GIB * usable);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = by_cpu.max(by_mem).ceil() as usize;
    n.clamp(1, setup.hosts)
}

/// Runs `setup` with the planner on (`planned`), or static consolidation's placement all day.
pub fn run(setup: &Setup, params: &Params, planned: bool) -> Outcome {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(setup.seed);
    let sizes = [2.0, 4.0, 4.0, 8.0, 8.0, 16.0];
    let mem: Vec<f64> = (0..setup.vms)
        .map(|_| sizes[rng.random_range(0..sizes.len())] * GIB)
        .collect();
    let mut traces: Vec<Trace> = mem
        .iter()
        .map(|m| {
            // CPUs follow memory loosely: a 4 GiB VM peaks at 1 to 3 CPUs.
            let peak = m / GIB / 2.0 * rng.random_range(0.5..1.5);
            Trace::new(peak, &setup.shape, &mut rng)
        })
        .collect();
    let n_static = static_hosts(setup, &traces, &mem);
    let mut fleet = Fleet {
        hosts: (0..setup.hosts)
            .map(|h| Host {
                name: format!("host-{h}"),
                site: format!("site-{}", h % setup.sites),
                capacity: Resources::new(setup.host_cpus, setup.host_mem_gib * GIB),
                powered: h < n_static,
                powered_since_s: -1e9,
                draining: false,
            })
            .collect(),
        vms: mem
            .iter()
            .enumerate()
            .map(|(i, &m)| Vm {
                name: format!("vm-{i}"),
                host: i % n_static,
                demand: Resources::new(traces[i].peak_cpus, m),
                group: None,
                last_moved_s: None,
                moving_to: None,
                pinned: false,
            })
            .collect(),
    };
    let cost = ModelCost { params, setup };
    let mut planner = Planner::new(setup.settings.clone());
    let mut ready_s = vec![0.0; setup.hosts];
    let mut running: Vec<Running> = Vec::new();
    let mut estimate: Vec<f64> = traces.iter().map(|t| t.peak_cpus).collect();
    let mut out = Outcome {
        energy_kwh: 0.0,
        static_kwh: 0.0,
        static_hosts: n_static,
        mean_hosts_on: 0.0,
        migrations: 0,
        relief_migrations: 0,
        migrations_per_hour: 0.0,
        wan_bytes: 0.0,
        median_move_s: 0.0,
        max_move_s: 0.0,
        unserved_share: 0.0,
        short_share: 0.0,
        hosts_on: Vec::new(),
        wall_s: 0.0,
    };
    let mut move_s: Vec<f64> = Vec::new();
    let (mut demand_total, mut unserved, mut short, mut vm_steps, mut on_steps) =
        (0.0, 0.0, 0usize, 0usize, 0usize);
    let steps = (setup.hours * 3600.0 / setup.step_s).round();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let steps = steps as u64;
    let step_h = setup.step_s / 3600.0;
    let mut cpu_now = vec![0.0; setup.vms];
    let mut next_sample_s = 0.0;
    for step in 0..steps {
        let now = step as f64 * setup.step_s;
        for (i, t) in traces.iter_mut().enumerate() {
            let c = t.cpus(now, &setup.shape, &mut rng);
            cpu_now[i] = c;
            // The planner sees a demand that rises at once and falls slowly (a tenth a minute).
            estimate[i] = c.max(estimate[i] * 0.9 + c * 0.1);
        }
        // Moves that ended.
        running.retain(|r| {
            if r.ends_s > now {
                return true;
            }
            for &vm in &r.vms {
                let v = &mut fleet.vms[vm];
                v.host = r.hop.to;
                v.moving_to = None;
                v.last_moved_s = Some(r.ends_s);
            }
            false
        });
        if planned {
            for (v, e) in fleet.vms.iter_mut().zip(&estimate) {
                v.demand.cpus = *e;
            }
            let plan = planner
                .plan(now, &fleet, &cost)
                .expect("the simulated fleet is consistent");
            for &h in &plan.power_on {
                let host = &mut fleet.hosts[h];
                host.powered = true;
                host.draining = false;
                host.powered_since_s = now;
                ready_s[h] = now + setup.boot_s;
            }
            for &h in &plan.power_off {
                fleet.hosts[h].powered = false;
                fleet.hosts[h].draining = false;
            }
            for &h in &plan.drain {
                fleet.hosts[h].draining = true;
            }
            for &h in &plan.keep {
                fleet.hosts[h].draining = false;
            }
            start_moves(
                setup,
                &cost,
                &mut fleet,
                plan.moves,
                &mut running,
                &ready_s,
                now,
                &mut out,
                &mut move_s,
            );
        }
        // This minute's service and energy.
        let mut load = vec![0.0; setup.hosts];
        let mut count = vec![0usize; setup.hosts];
        for (v, c) in fleet.vms.iter().zip(&cpu_now) {
            load[v.host] += c;
            count[v.host] += 1;
        }
        let mut on = 0;
        for (h, host) in fleet.hosts.iter().enumerate() {
            if !host.powered {
                continue;
            }
            on += 1;
            unserved += (load[h] - setup.host_cpus).max(0.0);
            if load[h] > setup.host_cpus {
                short += count[h];
            }
        }
        let work: f64 = cpu_now.iter().sum();
        out.energy_kwh +=
            (on as f64 * setup.idle_w + setup.busy_w * work / setup.host_cpus) * step_h / 1000.0;
        demand_total += work;
        vm_steps += setup.vms;
        on_steps += on;
        out.static_kwh += (n_static as f64 * setup.idle_w + setup.busy_w * work / setup.host_cpus)
            * step_h
            / 1000.0;
        if now >= next_sample_s {
            out.hosts_on.push((now / 3600.0, on));
            next_sample_s += 3600.0;
        }
    }
    out.mean_hosts_on = on_steps as f64 / steps.max(1) as f64;
    out.migrations_per_hour = out.migrations as f64 / setup.hours;
    out.unserved_share = unserved / demand_total.max(1e-9);
    out.short_share = short as f64 / vm_steps.max(1) as f64;
    move_s.sort_by(f64::total_cmp);
    out.median_move_s = move_s.get(move_s.len() / 2).copied().unwrap_or(0.0);
    out.max_move_s = move_s.last().copied().unwrap_or(0.0);
    out.wall_s = started.elapsed().as_secs_f64();
    out
}

/// Starts the planned moves the limits allow whose destination is up and whose VMs are
/// still where the plan found them; the rest are dropped (the next minute's plan proposes
/// what still holds).
#[allow(clippy::too_many_arguments)]
fn start_moves(
    setup: &Setup,
    cost: &ModelCost<'_>,
    fleet: &mut Fleet,
    pending: Vec<PlannedMove>,
    running: &mut Vec<Running>,
    ready_s: &[f64],
    now: f64,
    out: &mut Outcome,
    move_s: &mut Vec<f64>,
) {
    let site = |h: usize| h % setup.sites;
    let hop = |m: &PlannedMove| Hop {
        from: m.from,
        to: m.to,
        from_site: site(m.from),
        to_site: site(m.to),
    };
    let ready: Vec<usize> = (0..pending.len())
        .filter(|&i| ready_s[pending[i].to] <= now)
        .collect();
    let hops: Vec<Hop> = ready.iter().map(|&i| hop(&pending[i])).collect();
    let busy: Vec<Hop> = running.iter().map(|r| r.hop).collect();
    for k in startable(&hops, &busy, setup.limits) {
        let m = &pending[ready[k]];
        if m.vms
            .iter()
            .any(|&v| fleet.vms[v].host != m.from || fleet.vms[v].moving_to.is_some())
        {
            continue;
        }
        let mut longest: f64 = 0.0;
        for &v in &m.vms {
            let c = cost.cost(fleet, v, m.to);
            longest = longest.max(c.total_s);
            out.wan_bytes += if site(m.from) == site(m.to) {
                0.0
            } else {
                c.wan_bytes
            };
            fleet.vms[v].moving_to = Some(m.to);
            out.migrations += 1;
            out.relief_migrations += usize::from(m.reason == Reason::Relieve);
        }
        move_s.push(longest);
        running.push(Running {
            vms: m.vms.clone(),
            hop: hop(m),
            ends_s: now + longest,
        });
    }
}

/// One migration speed's best setting (Isci's optimisation: the least energy that meets the
/// SLA, over a grid of headroom and minimum time on).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub lan_bits_per_s: f64,
    pub headroom: f64,
    pub min_on_s: f64,
    /// Whether any setting met the SLA (if none did, the one closest to it).
    pub meets_sla: bool,
    pub outcome: Outcome,
}

/// The share of VM-minutes short of CPU a setting may cause (Isci's SLA: at most 1% of
/// transactions slower than 2 s).
pub const SLA_SHORT_SHARE: f64 = 0.01;

/// For each speed (within a site; across sites a tenth of it), the best of `grid`'s
/// (headroom, minimum time on) settings.
pub fn sweep(base: &Setup, params: &Params, speeds: &[f64], grid: &[(f64, f64)]) -> Vec<Point> {
    speeds
        .iter()
        .map(|&lan| {
            let runs = grid.iter().map(|&(headroom, min_on_s)| {
                let mut setup = base.clone();
                setup.lan_bits_per_s = lan;
                setup.wan_bits_per_s = lan / 10.0;
                setup.settings.headroom = headroom;
                setup.settings.min_on_s = min_on_s;
                (headroom, min_on_s, run(&setup, params, true))
            });
            let best = runs
                .min_by(|a, b| {
                    let rank = |o: &Outcome| {
                        let over = (o.short_share - SLA_SHORT_SHARE).max(0.0);
                        (over, o.energy_kwh)
                    };
                    let (ra, rb) = (rank(&a.2), rank(&b.2));
                    ra.0.total_cmp(&rb.0).then(ra.1.total_cmp(&rb.1))
                })
                .expect("a grid with settings");
            Point {
                lan_bits_per_s: lan,
                headroom: best.0,
                min_on_s: best.1,
                meets_sla: best.2.short_share <= SLA_SHORT_SHARE,
                outcome: best.2,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planned_day_saves_energy_over_static_consolidation_and_serves_the_demand() {
        let setup = Setup::default();
        let out = run(&setup, &ferry_params(), true);
        eprintln!("{out:#?}");
        assert!(
            out.normalized_energy() < 0.85,
            "{}",
            out.normalized_energy()
        );
        assert!(out.migrations > 0);
        assert!(out.short_share < 0.01, "{}", out.short_share);
        assert!(out.hosts_on.len() == 24);
        let night = out.hosts_on[4].1;
        let afternoon = out.hosts_on[15].1;
        assert!(afternoon > 2 * night, "{:?}", out.hosts_on);
        // Unplanned, the static placement moves nothing.
        let fixed = run(&setup, &ferry_params(), false);
        assert_eq!(fixed.migrations, 0);
        assert_eq!(fixed.hosts_on[15].1, fixed.static_hosts);
    }

    #[test]
    fn slower_migrations_cost_energy() {
        let base = Setup {
            hosts: 60,
            vms: 600,
            ..Setup::default()
        };
        let grid = [(0.1, 900.0), (0.2, 3600.0), (0.4, 3600.0)];
        let points = sweep(&base, &ferry_params(), &[0.05e9, 10e9], &grid);
        let (slow, fast) = (&points[0].outcome, &points[1].outcome);
        assert!(slow.median_move_s > 20.0 * fast.median_move_s);
        assert!(slow.energy_kwh > fast.energy_kwh, "{points:#?}");
    }
}
