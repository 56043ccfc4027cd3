//! The fleet's plan (docs/policies.md): ferry-policy's planner over the hosts and VMs the
//! store holds, with what the agents report they offer and use, moves priced by the cost
//! model on the links `[policy]` names. The leader observes the fleet every round (so that a
//! surplus of hosts is timed from when it began), `GET /v1/plan` shows what it would do now,
//! and `POST /v1/plan` (or `[policy] auto`) carries it out as ordinary fleet migrations and
//! groups, which the leader schedules within its limits (`limits.per_site_pair`, each
//! source's `max_outgoing`).
//!
//! What the plan cannot know it leaves out, and says so: hosts down or without a reported
//! capacity, VMs whose use is not reported (they count on their host as nothing and never
//! move), VMs two hosts report.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use ferry_api::fleet::{
    FleetGroupRequest, FleetMigrationState, FleetPlan, HostState, PlanMove, Unplanned, VmKind,
    VmUsage,
};
use ferry_api::settings::MigrationSettings;
use ferry_policy::consolidate::{MoveCost, Plan, Planner, Reason};
use ferry_policy::cost::{Cost, Params};
use ferry_policy::fleet::{Fleet, Host, Resources, Vm};

use crate::config::PolicyConfig;
use crate::cost_model::{move_of, planned_move};
use crate::fleet::{Controller, FleetError, Loaded};
use crate::store::now_ms;

/// The planner's memory across rounds, and the hosts being emptied.
pub struct PlanState {
    planner: Mutex<Planner>,
    draining: Mutex<BTreeSet<String>>,
    /// Each VM's CPU as the planner sees it: it rises with the reports at once and falls by
    /// a tenth of the gap each leader round (a VM's use is sampled every second: a quiet
    /// second must not make a busy VM look idle).
    cpus: Mutex<HashMap<String, f64>>,
}

impl PlanState {
    pub fn new(policy: &PolicyConfig) -> PlanState {
        PlanState {
            planner: Mutex::new(Planner::new(policy.settings.clone())),
            draining: Mutex::new(BTreeSet::new()),
            cpus: Mutex::new(HashMap::new()),
        }
    }
}

/// Moves priced by the model (each kind of VM's figures), on the link between the hosts'
/// sites, from what the VMs' hosts report they use.
struct LinkCost<'a> {
    params: [(VmKind, Params); 2],
    usage: HashMap<&'a str, (VmKind, VmUsage)>,
    policy: &'a PolicyConfig,
}

impl MoveCost for LinkCost<'_> {
    fn cost(&self, fleet: &Fleet, vm: usize, to: usize) -> Cost {
        let v = &fleet.vms[vm];
        let across = fleet.hosts[v.host].site != fleet.hosts[to].site;
        // A VM without reported use never moves (it is pinned); priced as its demand if asked.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let (kind, usage) = self.usage.get(v.name.as_str()).copied().unwrap_or((
            VmKind::Libvirt,
            VmUsage {
                cpu_millis: (v.demand.cpus * 1000.0) as u64,
                mem_bytes: v.demand.mem_bytes as u64,
                used_bytes: None,
                dirty_bytes_per_s: None,
            },
        ));
        let planned = planned_move(&usage, across, self.policy, &MigrationSettings::default());
        let params = &self
            .params
            .iter()
            .find(|(k, _)| *k == kind)
            .expect("every kind")
            .1;
        params.predict(&move_of(&planned))
    }
}

/// The fleet as the planner sees it, and what it leaves out.
pub(crate) struct Snapshot {
    pub fleet: Fleet,
    pub unplanned: Vec<Unplanned>,
}

/// The fleet as the planner sees it: VMs' memory is what they hold, or (`in_use`, for the
/// overload response) what their guests use.
fn snapshot(
    loaded: &Loaded,
    draining: &BTreeSet<String>,
    cpus: &HashMap<String, f64>,
    in_use: Option<&HashMap<String, f64>>,
) -> Snapshot {
    let mut unplanned = Vec::new();
    let mut fleet = Fleet::default();
    for h in &loaded.hosts {
        let why = match (h.state, h.capacity) {
            (HostState::Down, _) => "down: no heartbeat",
            (_, None) => "reports no capacity (an agent older than the planner)",
            (HostState::Up, Some(c)) => {
                fleet.hosts.push(Host {
                    name: h.name.clone(),
                    site: h.site.clone(),
                    capacity: Resources::new(f64::from(c.cpus), c.mem_bytes as f64),
                    powered: true,
                    powered_since_s: h.first_seen_unix_ms as f64 / 1000.0,
                    draining: draining.contains(&h.name),
                });
                continue;
            }
        };
        unplanned.push(Unplanned {
            name: h.name.clone(),
            why: why.into(),
        });
    }
    let index = |name: &str| fleet.hosts.iter().position(|h| h.name == name);
    let view = loaded.view();
    let mut names: Vec<&str> = loaded.vms.iter().map(|v| v.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        let vm = match view.vm(name) {
            Ok(Some(vm)) => vm,
            Ok(None) => continue,
            Err(hosts) => {
                unplanned.push(Unplanned {
                    name: name.into(),
                    why: format!("reported by several hosts ({})", hosts.join(", ")),
                });
                continue;
            }
        };
        let Some(host) = index(&vm.host) else {
            unplanned.push(Unplanned {
                name: name.into(),
                why: format!("its host {} is not planned", vm.host),
            });
            continue;
        };
        let last_moved_s = loaded
            .migrations
            .iter()
            .filter(|m| m.vm == name && m.state == FleetMigrationState::Committed)
            .filter_map(|m| m.finished_unix_ms)
            .max()
            .map(|ms| ms as f64 / 1000.0);
        let moving_to = loaded
            .migrations
            .iter()
            .find(|m| m.vm == name && !m.state.finished())
            .and_then(|m| index(&m.destination_host));
        let pinned = vm.usage.is_none();
        if pinned {
            unplanned.push(Unplanned {
                name: name.into(),
                why: "its use is not reported yet (it stays where it is)".into(),
            });
        }
        let demand = vm.usage.map_or(Resources::default(), |u| {
            let reported = u.cpu_millis as f64 / 1000.0;
            let seen = cpus.get(name).copied().unwrap_or(reported).max(reported);
            let mem = match in_use {
                Some(in_use) => in_use.get(name).copied().unwrap_or(u.mem_bytes as f64),
                None => u.mem_bytes as f64,
            };
            Resources::new(seen, mem)
        });
        fleet.vms.push(Vm {
            name: name.into(),
            host,
            demand,
            // VMs in one pool talk to each other.
            group: view.pools_of(&vm).first().map(|p| p.name.clone()),
            last_moved_s,
            moving_to,
            pinned,
        });
    }
    Snapshot { fleet, unplanned }
}

fn describe(plan: &Plan, snap: &Snapshot) -> FleetPlan {
    let host = |h: usize| snap.fleet.hosts[h].name.clone();
    let hosts = |hs: &[usize]| hs.iter().map(|&h| host(h)).collect::<Vec<_>>();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let moves = plan
        .moves
        .iter()
        .map(|m| PlanMove {
            vms: m
                .vms
                .iter()
                .map(|&v| snap.fleet.vms[v].name.clone())
                .collect(),
            from: host(m.from),
            to: host(m.to),
            reason: match m.reason {
                Reason::Relieve => "relieve",
                Reason::Consolidate => "consolidate",
            }
            .into(),
            predicted_s: m.cost.total_s,
            predicted_wan_bytes: m.cost.wan_bytes.max(0.0) as u64,
            predicted_pause_ms: (m.cost.downtime_s * 1000.0).max(0.0) as u64,
        })
        .collect();
    FleetPlan {
        computed_unix_ms: now_ms(),
        moves,
        drain: hosts(&plan.drain),
        empty: hosts(&plan.power_off),
        keep: hosts(&plan.keep),
        quiet: plan.quiet.as_ref().map(ToString::to_string),
        unplanned: snap.unplanned.clone(),
        requested: Vec::new(),
        refused: Vec::new(),
        pressure: Vec::new(),
        swaps: Vec::new(),
    }
}

impl Controller {
    /// Plans over the fleet as the store holds it, with `planner` (the leader's, advancing
    /// its hold; or a copy, for a preview).
    fn plan_with(
        &self,
        planner: &mut Planner,
        loaded: &Loaded,
    ) -> Result<(Plan, Snapshot), FleetError> {
        self.plan_over(planner, loaded, None)
    }

    /// Plans with VMs' memory as [`snapshot`] takes it.
    pub(crate) fn plan_over(
        &self,
        planner: &mut Planner,
        loaded: &Loaded,
        in_use: Option<&HashMap<String, f64>>,
    ) -> Result<(Plan, Snapshot), FleetError> {
        let draining = self.plans.draining.lock().expect("draining lock").clone();
        let cpus = self.plans.cpus.lock().expect("cpus lock").clone();
        let snap = snapshot(loaded, &draining, &cpus, in_use);
        let cost = LinkCost {
            params: [VmKind::Libvirt, VmKind::Qemu].map(|k| (k, self.cost_model.params(k))),
            usage: loaded
                .vms
                .iter()
                .filter_map(|v| Some((v.name.as_str(), (v.kind, v.usage?))))
                .collect(),
            policy: &self.config.policy,
        };
        let plan = planner
            .plan(now_ms() as f64 / 1000.0, &snap.fleet, &cost)
            .map_err(|e| FleetError::bad(format!("the fleet cannot be planned: {e}")))?;
        Ok((plan, snap))
    }

    /// What the planner would do now (the leader's hold is not advanced).
    pub async fn plan(&self) -> Result<FleetPlan, FleetError> {
        let loaded = self.load().await?;
        let mut planner = self.plans.planner.lock().expect("planner lock").clone();
        let (plan, snap) = self.plan_with(&mut planner, &loaded)?;
        let mut described = describe(&plan, &snap);
        described.pressure = self.pressure();
        described.swaps = self.store.swap_plans(None).await?;
        Ok(described)
    }

    /// The cost model in use for each kind of VM, and how well it predicts.
    pub async fn cost_model(&self) -> Result<Vec<ferry_api::fleet::FleetCostModel>, FleetError> {
        let migrations = self.store.migrations().await?;
        Ok(self.cost_model.describe(&migrations))
    }

    /// The leader's round: the planner observes the fleet (a surplus is timed from when it
    /// began) and, with `[policy] auto`, its plan is carried out.
    pub async fn observe(&self) -> Result<(), FleetError> {
        let loaded = self.load().await?;
        self.cost_model.refit_if_due(&loaded.migrations);
        {
            let mut cpus = self.plans.cpus.lock().expect("cpus lock");
            let mut seen = HashMap::new();
            for vm in &loaded.vms {
                if let Some(u) = vm.usage {
                    let now = u.cpu_millis as f64 / 1000.0;
                    let before = cpus.get(&vm.name).copied().unwrap_or(now);
                    seen.insert(vm.name.clone(), now.max(before * 0.9 + now * 0.1));
                }
            }
            *cpus = seen;
        }
        let (plan, snap) = {
            let mut planner = self.plans.planner.lock().expect("planner lock");
            self.plan_with(&mut planner, &loaded)?
        };
        {
            // A host emptied, or kept on, is no longer being emptied: it takes VMs again
            // (the controller cannot stop it; its next plan reports it empty while it is).
            let mut draining = self.plans.draining.lock().expect("draining lock");
            for &h in plan.power_off.iter().chain(&plan.keep) {
                draining.remove(&snap.fleet.hosts[h].name);
            }
        }
        self.respond_to_overload(&loaded).await?;
        if self.config.policy.auto && (!plan.moves.is_empty() || !plan.power_off.is_empty()) {
            let done = self.carry_out(&plan, &snap, &self.config.name).await;
            tracing::info!(
                "plan carried out: {} requested, {} refused",
                done.requested.len(),
                done.refused.len()
            );
        }
        Ok(())
    }

    /// Carries out the plan as it stands now: its moves become migrations (a group's members
    /// on one host, a group), the hosts it empties take no VMs.
    pub async fn apply_plan(&self, by: &str) -> Result<FleetPlan, FleetError> {
        let loaded = self.load().await?;
        let mut planner = self.plans.planner.lock().expect("planner lock").clone();
        let (plan, snap) = self.plan_with(&mut planner, &loaded)?;
        let done = self.carry_out(&plan, &snap, by).await;
        // What was carried out restarts the leader's hold, as the plan did.
        *self.plans.planner.lock().expect("planner lock") = planner;
        Ok(done)
    }

    async fn carry_out(&self, plan: &Plan, snap: &Snapshot, by: &str) -> FleetPlan {
        let mut done = describe(plan, snap);
        {
            let mut draining = self.plans.draining.lock().expect("draining lock");
            draining.extend(done.drain.iter().cloned());
            for h in done.keep.iter().chain(&done.empty) {
                draining.remove(h);
            }
        }
        for m in &done.moves {
            let group = FleetGroupRequest {
                vms: m.vms.clone(),
                to: Some(m.to.clone()),
                to_site: None,
                copy_storage: false,
                settings: MigrationSettings::default(),
            };
            let requested = if m.vms.len() == 1 {
                let one = group.member(&m.vms[0]);
                self.request(one, by).await.map(|migration| migration.id)
            } else {
                self.request_group(group, by).await.map(|group| group.id)
            };
            match requested {
                Ok(id) => done.requested.push(id),
                Err(e) => done.refused.push(Unplanned {
                    name: m.vms.join(","),
                    why: e.to_string(),
                }),
            }
        }
        done
    }
}
