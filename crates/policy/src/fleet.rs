//! The fleet as the policies see it: hosts with a capacity, VMs with a demand, placed on
//! hosts by index. The controller builds it from its store, the simulator from its world;
//! [`Fleet::check`] refuses what would make a plan wrong (a VM on a host that is not there or
//! not running, a demand that is not a number) before any policy reads it.

use serde::{Deserialize, Serialize};

/// CPU and memory, as a capacity, a demand or what is left.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    pub cpus: f64,
    pub mem_bytes: f64,
}

impl Resources {
    pub fn new(cpus: f64, mem_bytes: f64) -> Resources {
        Resources { cpus, mem_bytes }
    }

    pub fn plus(self, o: Resources) -> Resources {
        Resources::new(self.cpus + o.cpus, self.mem_bytes + o.mem_bytes)
    }

    pub fn minus(self, o: Resources) -> Resources {
        Resources::new(self.cpus - o.cpus, self.mem_bytes - o.mem_bytes)
    }

    pub fn scaled(self, by: f64) -> Resources {
        Resources::new(self.cpus * by, self.mem_bytes * by)
    }

    /// Both within `limit`.
    pub fn fits_in(self, limit: Resources) -> bool {
        self.cpus <= limit.cpus + 1e-9 && self.mem_bytes <= limit.mem_bytes + 0.5
    }

    /// The larger of the two shares of `of` (how full a host is).
    pub fn share_of(self, of: Resources) -> f64 {
        let share = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        share(self.cpus, of.cpus).max(share(self.mem_bytes, of.mem_bytes))
    }

    fn is_valid(self) -> bool {
        self.cpus.is_finite()
            && self.cpus >= 0.0
            && self.mem_bytes.is_finite()
            && self.mem_bytes >= 0.0
    }
}

/// A host: where it is, what it has, whether it runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Host {
    pub name: String,
    pub site: String,
    pub capacity: Resources,
    /// Running (an agent reports it, or the simulated machine is on). A host that is off
    /// takes no VMs until a plan powers it on.
    pub powered: bool,
    /// Since when it runs (seconds on the caller's clock): a host is kept on for a minimum
    /// time once started (Isci's "minimum time to run").
    pub powered_since_s: f64,
    /// Being emptied by an earlier plan: it takes no VMs, is not counted among the hosts
    /// the fleet needs, and each plan moves what is still on it.
    #[serde(default)]
    pub draining: bool,
}

/// A VM: where it runs and what it needs now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Vm {
    pub name: String,
    /// Index into [`Fleet::hosts`].
    pub host: usize,
    /// What it needs: the CPU it uses and its memory.
    pub demand: Resources,
    /// VMs that talk to each other share a group: the planner moves the members that share
    /// a host together, to one host.
    pub group: Option<String>,
    /// When it last finished a move (its cooldown runs from there).
    pub last_moved_s: Option<f64>,
    /// A move of it under way, to this host: it counts on both until it ends, and no plan
    /// moves it again meanwhile.
    pub moving_to: Option<usize>,
    /// Never moved by a plan (what it uses is not known): it counts on its host, nothing more.
    #[serde(default)]
    pub pinned: bool,
}

/// Hosts and VMs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Fleet {
    pub hosts: Vec<Host>,
    pub vms: Vec<Vm>,
}

/// A fleet no policy can plan over.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FleetError {
    #[error("VM {vm} is on host #{host}, which is not in the fleet")]
    UnknownHost { vm: String, host: usize },
    #[error("VM {vm} is on host {host}, which is not running")]
    HostOff { vm: String, host: String },
    #[error("VM {vm}'s demand is not a number of CPUs and bytes ({demand:?})")]
    BadDemand { vm: String, demand: Resources },
    #[error("host {host}'s capacity is not a positive number of CPUs and bytes ({capacity:?})")]
    BadCapacity { host: String, capacity: Resources },
}

impl Fleet {
    /// Refuses a fleet a plan would be wrong over.
    pub fn check(&self) -> Result<(), FleetError> {
        for h in &self.hosts {
            if !h.capacity.is_valid() || h.capacity.cpus <= 0.0 || h.capacity.mem_bytes <= 0.0 {
                return Err(FleetError::BadCapacity {
                    host: h.name.clone(),
                    capacity: h.capacity,
                });
            }
        }
        for vm in &self.vms {
            for host in std::iter::once(vm.host).chain(vm.moving_to) {
                let Some(h) = self.hosts.get(host) else {
                    return Err(FleetError::UnknownHost {
                        vm: vm.name.clone(),
                        host,
                    });
                };
                if !h.powered {
                    return Err(FleetError::HostOff {
                        vm: vm.name.clone(),
                        host: h.name.clone(),
                    });
                }
            }
            if !vm.demand.is_valid() {
                return Err(FleetError::BadDemand {
                    vm: vm.name.clone(),
                    demand: vm.demand,
                });
            }
        }
        Ok(())
    }

    /// What each host carries: its VMs, and the ones moving to it.
    pub fn loads(&self) -> Vec<Resources> {
        let mut load = vec![Resources::default(); self.hosts.len()];
        for vm in &self.vms {
            load[vm.host] = load[vm.host].plus(vm.demand);
            if let Some(to) = vm.moving_to {
                load[to] = load[to].plus(vm.demand);
            }
        }
        load
    }
}
