//! Placement and consolidation (Isci et al.; docs/policies.md): from hosts' capacities and
//! VMs' demand, a plan that spreads VMs off hosts whose demand outgrew them (at once) and
//! empties hosts when the fleet could run on fewer (only once that has lasted a hold time),
//! choosing moves by the cost model, cheapest first, and moving VMs that talk to each other
//! (a group's members on one host) together, to one host.
//!
//! It does not thrash: a host keeps `headroom` of its capacity free, a surplus of running
//! hosts must last `hold_s` and be at least `margin_hosts` before anything is emptied, a VM
//! moved is left alone for `cooldown_s`, and a host started stays on for `min_on_s` (Isci's
//! "minimum time to run").
//!
//! [`Planner`] keeps the one thing that spans decisions (since when the surplus lasts); the
//! clock is the caller's, so the controller and the simulator run the same code.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::cost::Cost;
use crate::fleet::{Fleet, FleetError, Resources};
use crate::placement::Room;

/// What moving a VM to a host costs (the controller and the simulator know the links and
/// the fitted figures; the planner only compares).
pub trait MoveCost {
    fn cost(&self, fleet: &Fleet, vm: usize, to: usize) -> Cost;
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// The share of each host's capacity kept free.
    pub headroom: f64,
    /// How long a surplus of running hosts must last before hosts are emptied.
    pub hold_s: f64,
    /// The surplus (in hosts) worth emptying hosts for.
    pub margin_hosts: usize,
    /// A VM that moved is not moved again for this long.
    pub cooldown_s: f64,
    /// A host that started stays on for at least this long.
    pub min_on_s: f64,
    /// Moves in one plan, at most.
    pub max_moves: usize,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            headroom: 0.2,
            hold_s: 600.0,
            margin_hosts: 1,
            cooldown_s: 1800.0,
            min_on_s: 3600.0,
            max_moves: 1000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    /// Off a host whose demand outgrew it.
    Relieve,
    /// Off a host being emptied.
    Consolidate,
}

/// VMs that move together from one host to another: one VM, or a group's members that
/// share a host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedMove {
    pub vms: Vec<usize>,
    pub from: usize,
    pub to: usize,
    pub reason: Reason,
    /// The members' moves together: the longest time and pause, the sum of the bytes.
    pub cost: Cost,
}

/// Why a plan moves nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum Quiet {
    /// No host is over, and the fleet needs all the hosts it runs.
    Balanced,
    /// Fewer hosts would do, for less than the hold time so far.
    Holding {
        surplus: usize,
        for_s: f64,
        hold_s: f64,
    },
    /// Fewer hosts would do, but no host can be emptied now (its VMs cooling down or moving,
    /// it started too recently, or they fit nowhere else).
    Stuck { surplus: usize },
    /// A host is over and nothing it runs can go anywhere.
    Overloaded { hosts: usize },
}

impl std::fmt::Display for Quiet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Quiet::Balanced => write!(f, "balanced: every running host is needed, none is over"),
            Quiet::Holding {
                surplus,
                for_s,
                hold_s,
            } => write!(
                f,
                "{surplus} host(s) more than needed for {for_s:.0} s; acting after {hold_s:.0} s"
            ),
            Quiet::Stuck { surplus } => write!(
                f,
                "{surplus} host(s) more than needed, but none can be emptied now \
                 (VMs cooling down or moving, hosts started recently, or no room elsewhere)"
            ),
            Quiet::Overloaded { hosts } => write!(
                f,
                "{hosts} host(s) over their capacity, and none of their VMs fits anywhere"
            ),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Cheapest first.
    pub moves: Vec<PlannedMove>,
    /// Hosts to start (moves to them wait for them).
    pub power_on: Vec<usize>,
    /// Hosts to empty: the moves off them are in the plan; they take no VMs from now on
    /// ([`crate::fleet::Host::draining`]).
    pub drain: Vec<usize>,
    /// Hosts to stop: empty, nothing arriving (emptied by an earlier plan, or idle).
    pub power_off: Vec<usize>,
    /// Hosts an earlier plan began to empty that stay on: what is left on them fits nowhere
    /// else now (they take VMs again).
    pub keep: Vec<usize>,
    /// Why nothing moves, when nothing does.
    pub quiet: Option<Quiet>,
}

#[derive(Clone)]
pub struct Planner {
    pub settings: Settings,
    surplus_since_s: Option<f64>,
}

/// Drain candidates costed per extra host to empty: the planner prices the lightest of the
/// fleet's hosts by the model, not every host (the cost follows the memory to move).
const CANDIDATES_PER_HOST: usize = 4;

impl Planner {
    pub fn new(settings: Settings) -> Planner {
        Planner {
            settings,
            surplus_since_s: None,
        }
    }

    /// The plan for `fleet` at `now_s`.
    pub fn plan(
        &mut self,
        now_s: f64,
        fleet: &Fleet,
        cost: &dyn MoveCost,
    ) -> Result<Plan, FleetError> {
        fleet.check()?;
        let loads = fleet.loads();
        let mut on_host = vec![Vec::new(); fleet.hosts.len()];
        let mut group_hosts: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, vm) in fleet.vms.iter().enumerate() {
            on_host[vm.host].push(i);
            if let Some(g) = &vm.group {
                group_hosts.entry(g).or_default().push(vm.host);
            }
        }
        let mut work = Work {
            fleet,
            on_host,
            group_hosts,
            cost,
            settings: &self.settings,
            now_s,
            // Placing keeps a slack below the limit, so that a host filled by a plan is not
            // over again at the next small rise.
            room: Room::new(
                fleet,
                &loads,
                self.settings.headroom + (1.0 - self.settings.headroom) * PLACING_SLACK,
            ),
            loads: loads.clone(),
            plan: Plan {
                moves: Vec::new(),
                power_on: Vec::new(),
                drain: Vec::new(),
                power_off: Vec::new(),
                keep: Vec::new(),
                quiet: None,
            },
        };
        let over = work.relieve();
        work.finish_draining();
        if !work.plan.moves.is_empty() || !work.plan.power_on.is_empty() {
            // Spreading first; emptying hosts waits for a fleet that fits.
            self.surplus_since_s = None;
            return Ok(work.plan);
        }
        let surplus = surplus(fleet, &loads, &work.room);
        if surplus < self.settings.margin_hosts.max(1) {
            self.surplus_since_s = None;
            work.plan.quiet = Some(if over > 0 {
                Quiet::Overloaded { hosts: over }
            } else {
                Quiet::Balanced
            });
            return Ok(work.plan);
        }
        let since = *self.surplus_since_s.get_or_insert(now_s);
        if now_s - since < self.settings.hold_s {
            work.plan.quiet = Some(Quiet::Holding {
                surplus,
                for_s: now_s - since,
                hold_s: self.settings.hold_s,
            });
            return Ok(work.plan);
        }
        if work.consolidate(surplus) == 0 {
            work.plan.quiet = Some(Quiet::Stuck { surplus });
        } else {
            self.surplus_since_s = None;
        }
        Ok(work.plan)
    }
}

/// How many running hosts more than the fleet's demand needs: fewest hosts, largest first,
/// whose usable capacity covers the demand in CPU and memory.
fn surplus(fleet: &Fleet, loads: &[Resources], room: &Room) -> usize {
    let running: Vec<usize> = (0..fleet.hosts.len())
        .filter(|&h| fleet.hosts[h].powered && !fleet.hosts[h].draining)
        .collect();
    // What hosts being emptied still carry needs room among the others too.
    let demand = (0..fleet.hosts.len())
        .filter(|&h| fleet.hosts[h].powered)
        .fold(Resources::default(), |d, h| d.plus(loads[h]));
    let mut usable: Vec<Resources> = running.iter().map(|&h| room.usable(h)).collect();
    usable.sort_by(|a, b| b.cpus.total_cmp(&a.cpus));
    let mut covered = Resources::default();
    let mut needed = 0;
    for u in usable {
        if demand.fits_in(covered) {
            break;
        }
        covered = covered.plus(u);
        needed += 1;
    }
    running.len().saturating_sub(needed.max(1))
}

/// The share of a host's usable capacity that placing leaves free (hysteresis between
/// emptying hosts and spreading VMs).
const PLACING_SLACK: f64 = 0.1;

/// One decision's state.
struct Work<'a> {
    fleet: &'a Fleet,
    /// Each host's VMs, and the hosts each group's members run on (as the fleet stands).
    on_host: Vec<Vec<usize>>,
    group_hosts: HashMap<&'a str, Vec<usize>>,
    cost: &'a dyn MoveCost,
    settings: &'a Settings,
    now_s: f64,
    /// Where VMs may go (each host's capacity less the headroom and the placing slack).
    room: Room,
    /// What each host carries, as the plan so far leaves it.
    loads: Vec<Resources>,
    plan: Plan,
}

/// VMs that move as one: a group's members on one host, or a VM on its own.
struct Unit {
    vms: Vec<usize>,
    demand: Resources,
}

impl Work<'_> {
    fn movable(&self, vm: usize) -> bool {
        let v = &self.fleet.vms[vm];
        !v.pinned
            && v.moving_to.is_none()
            && v.last_moved_s
                .map_or(true, |t| self.now_s - t >= self.settings.cooldown_s)
    }

    /// The units on `host`, heaviest first.
    fn units_on(&self, host: usize) -> Vec<Unit> {
        let mut units: Vec<Unit> = Vec::new();
        for &i in &self.on_host[host] {
            let vm = &self.fleet.vms[i];
            let joined = vm.group.as_ref().and_then(|g| {
                units
                    .iter_mut()
                    .find(|u| self.fleet.vms[u.vms[0]].group.as_ref() == Some(g))
            });
            match joined {
                Some(u) => {
                    u.vms.push(i);
                    u.demand = u.demand.plus(vm.demand);
                }
                None => units.push(Unit {
                    vms: vec![i],
                    demand: vm.demand,
                }),
            }
        }
        units.sort_by(|a, b| b.demand.mem_bytes.total_cmp(&a.demand.mem_bytes));
        units
    }

    fn unit_cost(&self, unit: &Unit, to: usize) -> Cost {
        unit.vms.iter().fold(
            Cost {
                total_s: 0.0,
                wan_bytes: 0.0,
                downtime_s: 0.0,
                passes: 0,
            },
            |sum, &vm| {
                let c = self.cost.cost(self.fleet, vm, to);
                Cost {
                    total_s: sum.total_s.max(c.total_s),
                    wan_bytes: sum.wan_bytes + c.wan_bytes,
                    downtime_s: sum.downtime_s.max(c.downtime_s),
                    passes: sum.passes.max(c.passes),
                }
            },
        )
    }

    /// Where `unit` on `from` goes: beside its group's other members if they have room,
    /// else a host at its own site, else the cheapest at another site.
    fn destination(&self, unit: &Unit, from: usize) -> Option<(usize, Cost)> {
        let except = [from];
        let group = self.fleet.vms[unit.vms[0]].group.as_deref();
        let peers = group.and_then(|g| self.group_hosts.get(g));
        let beside = peers
            .into_iter()
            .flatten()
            .find(|&&h| !except.contains(&h) && self.room.fits(h, unit.demand));
        if let Some(&h) = beside {
            return Some((h, self.unit_cost(unit, h)));
        }
        // Emptying packs (the fullest host that takes it, within the placing slack);
        // spreading does too, so that the lightest hosts stay free to be emptied.
        let pick = |site| self.room.best_fit(site, unit.demand, &except);
        let home = self.room.site_of(from);
        if let Some(h) = pick(home) {
            return Some((h, self.unit_cost(unit, h)));
        }
        (0..self.room.site_count())
            .filter(|&s| s != home)
            .filter_map(pick)
            .map(|h| (h, self.unit_cost(unit, h)))
            .min_by(|a, b| a.1.total_s.total_cmp(&b.1.total_s))
    }

    fn record(&mut self, unit: Unit, from: usize, to: usize, cost: Cost, reason: Reason) {
        self.room.take(to, unit.demand);
        self.room.give(from, unit.demand);
        self.loads[to] = self.loads[to].plus(unit.demand);
        self.loads[from] = self.loads[from].minus(unit.demand);
        self.plan.moves.push(PlannedMove {
            vms: unit.vms,
            from,
            to,
            reason,
            cost,
        });
    }

    /// Each host's limit: its capacity less the headroom.
    fn limit(&self, host: usize) -> Resources {
        self.fleet.hosts[host]
            .capacity
            .scaled(1.0 - self.settings.headroom)
    }

    fn is_over(&self, host: usize) -> bool {
        !self.loads[host].fits_in(self.limit(host))
    }

    /// Spreads the VMs of hosts over their limit onto running hosts: the cheapest move that
    /// relieves a host alone first, else the cheapest moves until it fits; only when the
    /// running hosts cannot take enough does it start hosts that are off. Returns the hosts
    /// still over.
    fn relieve(&mut self) -> usize {
        let mut over: Vec<usize> = (0..self.fleet.hosts.len())
            .filter(|&h| {
                let host = &self.fleet.hosts[h];
                host.powered && !host.draining && self.is_over(h)
            })
            .collect();
        over.sort_by(|&a, &b| {
            let share = |h: usize| self.loads[h].share_of(self.limit(h));
            share(b).total_cmp(&share(a))
        });
        let mut still_over = 0;
        for host in over {
            let units: Vec<Unit> = self
                .units_on(host)
                .into_iter()
                .filter(|u| u.vms.iter().all(|&vm| self.movable(vm)))
                .collect();
            let mut left = Vec::new();
            let mut options: Vec<(Unit, usize, Cost)> = Vec::new();
            for unit in units {
                match self.destination(&unit, host) {
                    Some((to, c)) => options.push((unit, to, c)),
                    None => left.push(unit),
                }
            }
            let excess = self.loads[host].minus(self.limit(host));
            let key = |o: &(Unit, usize, Cost)| (!excess.fits_in(o.0.demand), o.2.total_s);
            options.sort_by(|a, b| {
                let (a, b) = (key(a), key(b));
                a.0.cmp(&b.0).then(a.1.total_cmp(&b.1))
            });
            for (unit, to, c) in options {
                if !self.is_over(host) || self.plan.moves.len() >= self.settings.max_moves {
                    break;
                }
                // An earlier move may have filled the chosen host.
                let to = if self.room.fits(to, unit.demand) {
                    Some((to, c))
                } else {
                    self.destination(&unit, host)
                };
                match to {
                    Some((to, c)) => self.record(unit, host, to, c, Reason::Relieve),
                    None => left.push(unit),
                }
            }
            // Only now a host that is off: none running could take enough.
            for unit in left {
                if !self.is_over(host) || self.plan.moves.len() >= self.settings.max_moves {
                    break;
                }
                if let Some((to, c)) = self.start_host_for(&unit, host) {
                    self.record(unit, host, to, c, Reason::Relieve);
                }
            }
            if self.is_over(host) {
                still_over += 1;
            }
        }
        still_over
    }

    /// Starts a host that is off for `unit`: at its own site if one can take it, else the
    /// cheapest elsewhere.
    fn start_host_for(&mut self, unit: &Unit, from: usize) -> Option<(usize, Cost)> {
        let home = self.room.site_of(from);
        let off = (0..self.fleet.hosts.len()).filter(|&h| {
            !self.fleet.hosts[h].powered
                && !self.plan.power_on.contains(&h)
                && unit.demand.fits_in(self.room.usable(h))
        });
        let chosen = off.map(|h| (h, self.unit_cost(unit, h))).min_by(|a, b| {
            let away = |h: usize| self.room.site_of(h) != home;
            (away(a.0), a.1.total_s)
                .partial_cmp(&(away(b.0), b.1.total_s))
                .unwrap_or(std::cmp::Ordering::Equal)
        })?;
        self.plan.power_on.push(chosen.0);
        self.room.open(chosen.0);
        Some(chosen)
    }

    /// Moves what is still on hosts an earlier plan began to empty (its moves may not have
    /// started yet, or failed), and stops those that are empty.
    fn finish_draining(&mut self) {
        let fleet = self.fleet;
        let mut arriving = vec![false; fleet.hosts.len()];
        for vm in &fleet.vms {
            if let Some(to) = vm.moving_to {
                arriving[to] = true;
            }
        }
        for h in (0..fleet.hosts.len()).filter(|&h| fleet.hosts[h].draining) {
            if self.on_host[h].is_empty() && !arriving[h] {
                self.plan.power_off.push(h);
                continue;
            }
            let mut stuck = false;
            for unit in self.units_on(h) {
                if !unit.vms.iter().all(|&vm| self.movable(vm)) {
                    // Cooling down or moving: it goes at a later plan.
                    continue;
                }
                match self.destination(&unit, h) {
                    Some((to, c)) => self.record(unit, h, to, c, Reason::Consolidate),
                    None => stuck = true,
                }
            }
            if stuck {
                self.plan.keep.push(h);
                self.room.open(h);
            }
        }
    }

    /// Empties up to `surplus` hosts: the cheapest to empty first, each only if all it runs
    /// fits elsewhere. Returns how many it empties.
    fn consolidate(&mut self, surplus: usize) -> usize {
        let fleet = self.fleet;
        let mut mem_on = vec![0.0; fleet.hosts.len()];
        let mut blocked = vec![false; fleet.hosts.len()];
        for (i, vm) in fleet.vms.iter().enumerate() {
            mem_on[vm.host] += vm.demand.mem_bytes;
            blocked[vm.host] |= !self.movable(i);
            if let Some(to) = vm.moving_to {
                blocked[to] = true;
            }
        }
        let mut candidates: Vec<usize> = (0..fleet.hosts.len())
            .filter(|&h| {
                let host = &fleet.hosts[h];
                host.powered
                    && !host.draining
                    && !blocked[h]
                    && self.now_s - host.powered_since_s >= self.settings.min_on_s
            })
            .collect();
        candidates.sort_by(|&a, &b| mem_on[a].total_cmp(&mem_on[b]));
        candidates.truncate(surplus * CANDIDATES_PER_HOST);
        // Priced by the model as things stand, then emptied in that order against the
        // room the earlier ones left.
        let mut priced: Vec<(usize, f64)> = candidates
            .iter()
            .map(|&h| {
                let total: f64 = self
                    .units_on(h)
                    .iter()
                    .map(|u| {
                        self.destination(u, h)
                            .map_or(f64::INFINITY, |(_, c)| c.total_s)
                    })
                    .sum();
                (h, total)
            })
            .filter(|(_, total)| total.is_finite())
            .collect();
        priced.sort_by(|a, b| a.1.total_cmp(&b.1));
        let mut receiving = vec![false; fleet.hosts.len()];
        let mut emptied = 0;
        for (host, _) in priced {
            if emptied >= surplus {
                break;
            }
            if receiving[host] {
                // It takes VMs in this plan.
                continue;
            }
            let units = self.units_on(host);
            if self.plan.moves.len() + units.len() > self.settings.max_moves {
                break;
            }
            self.room.close(host);
            let mut placed: Vec<(Unit, usize, Cost)> = Vec::new();
            let mut all = true;
            for unit in units {
                match self.destination(&unit, host) {
                    Some((to, c)) => {
                        self.room.take(to, unit.demand);
                        placed.push((unit, to, c));
                    }
                    None => {
                        all = false;
                        break;
                    }
                }
            }
            // Undone, to be recorded whole or not at all.
            for (unit, to, _) in &placed {
                self.room.give(*to, unit.demand);
            }
            if !all {
                self.room.open(host);
                continue;
            }
            emptied += 1;
            if placed.is_empty() {
                self.plan.power_off.push(host);
                continue;
            }
            for (unit, to, c) in placed {
                receiving[to] = true;
                self.record(unit, host, to, c, Reason::Consolidate);
            }
            self.plan.drain.push(host);
        }
        self.plan
            .moves
            .sort_by(|a, b| a.cost.total_s.total_cmp(&b.cost.total_s));
        emptied
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{Host, Vm};

    const GIB: f64 = 1073741824.0;

    /// Memory over a link: 1 GB/s within a site, 100 MB/s across.
    struct ByMemory;

    impl MoveCost for ByMemory {
        fn cost(&self, fleet: &Fleet, vm: usize, to: usize) -> Cost {
            let v = &fleet.vms[vm];
            let across = fleet.hosts[v.host].site != fleet.hosts[to].site;
            let rate = if across { 100e6 } else { 1e9 };
            Cost {
                total_s: v.demand.mem_bytes / rate,
                wan_bytes: if across { v.demand.mem_bytes } else { 0.0 },
                downtime_s: 0.1,
                passes: 2,
            }
        }
    }

    fn host(name: &str, site: &str) -> Host {
        Host {
            name: name.into(),
            site: site.into(),
            capacity: Resources::new(10.0, 100.0 * GIB),
            powered: true,
            powered_since_s: -1e6,
            draining: false,
        }
    }

    fn vm(name: &str, host: usize, cpus: f64, mem_gib: f64) -> Vm {
        Vm {
            name: name.into(),
            host,
            demand: Resources::new(cpus, mem_gib * GIB),
            group: None,
            last_moved_s: None,
            moving_to: None,
            pinned: false,
        }
    }

    fn settings() -> Settings {
        Settings {
            headroom: 0.2,
            hold_s: 300.0,
            margin_hosts: 1,
            cooldown_s: 1000.0,
            min_on_s: 600.0,
            max_moves: 100,
        }
    }

    fn names(fleet: &Fleet, m: &PlannedMove) -> Vec<String> {
        m.vms.iter().map(|&v| fleet.vms[v].name.clone()).collect()
    }

    #[test]
    fn an_overloaded_host_sheds_its_cheapest_vms_at_once() {
        // a1 carries 10 CPUs of its 8 usable; a2 has room.
        let fleet = Fleet {
            hosts: vec![host("a1", "a"), host("a2", "a")],
            vms: vec![
                vm("big", 0, 4.0, 40.0),
                vm("small", 0, 3.0, 4.0),
                vm("mid", 0, 3.0, 10.0),
                vm("other", 1, 2.0, 4.0),
            ],
        };
        let mut planner = Planner::new(settings());
        let plan = planner.plan(0.0, &fleet, &ByMemory).unwrap();
        assert_eq!(plan.moves.len(), 1, "{plan:?}");
        assert_eq!(names(&fleet, &plan.moves[0]), ["small"]);
        assert_eq!((plan.moves[0].from, plan.moves[0].to), (0, 1));
        assert_eq!(plan.moves[0].reason, Reason::Relieve);
        assert!(plan.power_on.is_empty() && plan.power_off.is_empty());
    }

    #[test]
    fn with_no_room_running_a_host_is_started_at_the_same_site_first() {
        let mut off_b = host("b2", "b");
        off_b.powered = false;
        let mut off_a = host("a2", "a");
        off_a.powered = false;
        let fleet = Fleet {
            hosts: vec![host("a1", "a"), off_b, off_a],
            vms: vec![vm("x", 0, 5.0, 10.0), vm("y", 0, 5.0, 10.0)],
        };
        let plan = Planner::new(settings())
            .plan(0.0, &fleet, &ByMemory)
            .unwrap();
        assert_eq!(plan.power_on, [2]);
        assert_eq!(plan.moves.len(), 1);
        assert_eq!(plan.moves[0].to, 2);
    }

    #[test]
    fn an_overload_nothing_can_relieve_is_said() {
        let fleet = Fleet {
            hosts: vec![host("a1", "a")],
            vms: vec![vm("x", 0, 9.0, 10.0)],
        };
        let plan = Planner::new(settings())
            .plan(0.0, &fleet, &ByMemory)
            .unwrap();
        assert!(plan.moves.is_empty());
        assert_eq!(plan.quiet, Some(Quiet::Overloaded { hosts: 1 }));
    }

    fn three_light_hosts() -> Fleet {
        Fleet {
            hosts: vec![host("a1", "a"), host("a2", "a"), host("b1", "b")],
            vms: vec![
                vm("a1-x", 0, 2.0, 20.0),
                vm("a1-y", 0, 1.0, 8.0),
                vm("a2-x", 1, 1.0, 2.0),
                vm("b1-x", 2, 3.0, 30.0),
            ],
        }
    }

    #[test]
    fn a_surplus_is_acted_on_only_once_it_has_lasted_the_hold_time() {
        let fleet = three_light_hosts();
        let mut planner = Planner::new(settings());
        let first = planner.plan(0.0, &fleet, &ByMemory).unwrap();
        assert!(first.moves.is_empty());
        assert!(
            matches!(first.quiet, Some(Quiet::Holding { surplus: 2, .. })),
            "{first:?}"
        );
        let later = planner.plan(299.0, &fleet, &ByMemory).unwrap();
        assert!(later.moves.is_empty());
        let plan = planner.plan(300.0, &fleet, &ByMemory).unwrap();
        // a2's one small VM is the cheapest to empty (to a1, at its site); a1 then takes
        // what it is given, and b1's VM too.
        assert_eq!(plan.drain, [1, 2], "{plan:?}");
        assert!(plan.power_off.is_empty());
        assert!(plan.moves.iter().all(|m| m.reason == Reason::Consolidate));
        assert!(plan.moves.iter().all(|m| m.to == 0));
        let costs: Vec<f64> = plan.moves.iter().map(|m| m.cost.total_s).collect();
        assert!(
            costs.windows(2).all(|w| w[0] <= w[1]),
            "cheapest first: {costs:?}"
        );
        // The hold starts again after acting.
        assert!(planner
            .plan(301.0, &fleet, &ByMemory)
            .unwrap()
            .moves
            .is_empty());
    }

    #[test]
    fn a_surplus_that_goes_away_restarts_the_hold() {
        let fleet = three_light_hosts();
        let mut busy = fleet.clone();
        busy.vms[3].demand.cpus = 7.5;
        busy.vms[0].demand.cpus = 6.5;
        busy.vms[2].demand.cpus = 7.5;
        let mut planner = Planner::new(settings());
        planner.plan(0.0, &fleet, &ByMemory).unwrap();
        assert_eq!(
            planner.plan(200.0, &busy, &ByMemory).unwrap().quiet,
            Some(Quiet::Balanced)
        );
        let plan = planner.plan(400.0, &fleet, &ByMemory).unwrap();
        assert!(plan.moves.is_empty() && matches!(plan.quiet, Some(Quiet::Holding { .. })));
    }

    #[test]
    fn a_group_moves_whole_and_to_one_host() {
        let mut fleet = three_light_hosts();
        fleet.vms[0].group = Some("shop".into());
        fleet.vms[1].group = Some("shop".into());
        fleet.hosts.truncate(2);
        fleet.vms.truncate(3);
        fleet.vms[2].demand.mem_bytes = 40.0 * GIB;
        let mut planner = Planner::new(Settings {
            hold_s: 0.0,
            ..settings()
        });
        let plan = planner.plan(0.0, &fleet, &ByMemory).unwrap();
        let shop: Vec<&PlannedMove> = plan.moves.iter().filter(|m| m.from == 0).collect();
        assert_eq!(shop.len(), 1, "{plan:?}");
        assert_eq!(names(&fleet, shop[0]), ["a1-x", "a1-y"]);
        assert_eq!(shop[0].to, 1);
        // Together: the longer of the two moves' times, the sum of their bytes.
        assert!((shop[0].cost.total_s - 20.0 * GIB / 1e9).abs() < 1e-6);
    }

    #[test]
    fn vms_cooling_down_and_hosts_just_started_are_not_emptied() {
        let mut fleet = three_light_hosts();
        fleet.vms[2].last_moved_s = Some(-10.0);
        fleet.hosts[0].powered_since_s = -10.0;
        let mut planner = Planner::new(Settings {
            hold_s: 0.0,
            ..settings()
        });
        let plan = planner.plan(0.0, &fleet, &ByMemory).unwrap();
        // Only b1 may go: a1 started 10 s ago, a2's VM moved 10 s ago.
        assert_eq!(plan.drain, [2], "{plan:?}");
        fleet.vms[3].moving_to = Some(0);
        let plan = planner.plan(0.0, &fleet, &ByMemory).unwrap();
        assert_eq!(plan.quiet, Some(Quiet::Stuck { surplus: 1 }), "{plan:?}");
    }

    #[test]
    fn a_host_being_emptied_keeps_being_emptied_and_is_stopped_once_empty() {
        let mut fleet = three_light_hosts();
        fleet.hosts[1].draining = true;
        fleet.vms[3].moving_to = Some(1);
        let mut planner = Planner::new(settings());
        let plan = planner.plan(0.0, &fleet, &ByMemory).unwrap();
        // a2's VM goes (to a1, its site's other host); a VM arriving keeps a2 on.
        assert_eq!(plan.moves.len(), 1, "{plan:?}");
        assert_eq!((plan.moves[0].vms[0], plan.moves[0].to), (2, 0));
        assert!(plan.power_off.is_empty());
        fleet.vms[3].moving_to = None;
        fleet.vms[2].host = 0;
        let plan = planner.plan(10.0, &fleet, &ByMemory).unwrap();
        assert_eq!(plan.power_off, [1], "{plan:?}");
    }

    #[test]
    fn a_host_nothing_can_relieve_does_not_stop_emptying_the_others() {
        let mut fleet = three_light_hosts();
        fleet.hosts.push(host("c1", "c"));
        fleet.vms.push(vm("huge", 3, 9.0, 10.0));
        let mut planner = Planner::new(Settings {
            hold_s: 0.0,
            ..settings()
        });
        let plan = planner.plan(0.0, &fleet, &ByMemory).unwrap();
        assert!(!plan.drain.is_empty(), "{plan:?}");
        assert!(plan.moves.iter().all(|m| m.from != 3 && m.to != 3));
    }

    #[test]
    fn relief_starts_no_host_when_a_running_one_takes_enough() {
        let mut off = host("a3", "a");
        off.powered = false;
        let fleet = Fleet {
            hosts: vec![host("a1", "a"), host("a2", "a"), off],
            vms: vec![
                vm("x", 0, 6.0, 10.0),
                vm("y", 0, 2.5, 10.0),
                vm("z", 1, 4.0, 10.0),
            ],
        };
        let plan = Planner::new(settings())
            .plan(0.0, &fleet, &ByMemory)
            .unwrap();
        assert!(plan.power_on.is_empty(), "{plan:?}");
        assert_eq!(plan.moves.len(), 1);
        assert_eq!(
            (names(&fleet, &plan.moves[0]), plan.moves[0].to),
            (vec!["y".to_owned()], 1)
        );
    }

    #[test]
    fn what_a_host_being_emptied_cannot_shed_keeps_it_on() {
        let mut fleet = three_light_hosts();
        fleet.hosts[2].draining = true;
        fleet.vms[3].demand.cpus = 7.9;
        fleet.vms[0].demand.cpus = 6.0;
        fleet.vms[2].demand.cpus = 6.0;
        let plan = Planner::new(settings())
            .plan(0.0, &fleet, &ByMemory)
            .unwrap();
        assert_eq!(plan.keep, [2], "{plan:?}");
        assert!(plan.moves.is_empty());
    }

    #[test]
    fn pinned_vms_stay_and_an_empty_fleet_is_balanced() {
        let mut fleet = Fleet {
            hosts: vec![host("a1", "a"), host("a2", "a")],
            vms: vec![vm("x", 0, 5.0, 10.0), vm("y", 0, 5.0, 10.0)],
        };
        fleet.vms[0].pinned = true;
        let plan = Planner::new(settings())
            .plan(0.0, &fleet, &ByMemory)
            .unwrap();
        assert_eq!(plan.moves.len(), 1);
        assert_eq!(names(&fleet, &plan.moves[0]), ["y"]);
        let empty = Fleet::default();
        let plan = Planner::new(settings())
            .plan(0.0, &empty, &ByMemory)
            .unwrap();
        assert_eq!(plan.quiet, Some(Quiet::Balanced));
    }

    #[test]
    fn a_fleet_that_is_wrong_is_refused_with_what_is_wrong() {
        let mut fleet = three_light_hosts();
        fleet.vms[1].host = 7;
        let err = Planner::new(settings())
            .plan(0.0, &fleet, &ByMemory)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "VM a1-y is on host #7, which is not in the fleet"
        );
        let mut fleet = three_light_hosts();
        fleet.hosts[1].powered = false;
        let err = Planner::new(settings())
            .plan(0.0, &fleet, &ByMemory)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "VM a2-x is on host a2, which is not running"
        );
        let mut fleet = three_light_hosts();
        fleet.vms[0].demand.cpus = f64::NAN;
        let err = Planner::new(settings())
            .plan(0.0, &fleet, &ByMemory)
            .unwrap_err();
        assert!(err
            .to_string()
            .starts_with("VM a1-x's demand is not a number"));
    }
}
