//! Virtual cloud pools (CloudNet's VCP, VirtualWire's re-pointing): where each pool needs an
//! endpoint and what each host's overlay must hold, computed from one snapshot of the store.
//!
//! A pool's VMs are the VMs with a NIC on its bridge. A host has the pool's endpoint while the
//! pool has a VM there, a VM on its way there (any unfinished migration to it: libvirt needs
//! the bridge before the VM arrives), or an operator's hold. Each endpoint floods broadcast
//! and unknown frames to the pool's other endpoints; unless the pool learns (ARP-only), it also
//! gets the controller's directory of where the pool's other VMs are, and the VMs moving now,
//! whose MACs the agents at both ends re-point at the switchover.

use std::collections::{BTreeMap, BTreeSet};

use ferry_api::fleet::{
    EndpointPlan, FleetMigration, FleetMigrationState, Host, MovingMac, OverlayPlan, OverlayRemote,
    Pool, PoolEndpoint, RemoteMac, Vm, VmNic,
};

use crate::store::PoolRecord;

/// The fleet as the pools see it: one snapshot of the store.
pub struct Snapshot<'a> {
    pub pools: &'a [PoolRecord],
    pub hosts: &'a [Host],
    pub vms: &'a [Vm],
    /// Every migration the store holds (unfinished ones place VMs; committed ones correct
    /// reports older than them).
    pub migrations: &'a [FleetMigration],
}

/// A pool's VM: one NIC on the pool's bridge, and the host it runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Member<'a> {
    vm: &'a str,
    mac: &'a str,
    host: &'a str,
}

impl<'a> Snapshot<'a> {
    fn host(&self, name: &str) -> Option<&'a Host> {
        self.hosts.iter().find(|h| h.name == name)
    }

    /// Where a host's endpoints are reached, if it has an overlay. A host marked down keeps
    /// its place in the pools: its agent may only be slow (its tunnels do not depend on it),
    /// and frames sent to a dead host are lost either way.
    fn overlay_address(&self, name: &str) -> Option<&'a str> {
        self.host(name)
            .and_then(|h| h.overlay.as_ref())
            .map(|o| o.address.as_str())
    }

    fn unfinished(&self) -> impl Iterator<Item = &'a FleetMigration> {
        self.migrations.iter().filter(|m| !m.state.finished())
    }

    /// When `host`'s list of VMs was taken.
    fn listed_at(&self, host: &str) -> u64 {
        self.host(host)
            .map_or(0, |h| h.vms_listed_unix_ms.unwrap_or(h.last_seen_unix_ms))
    }

    /// The latest committed migration of `name` from `from` (any host when None) that ended
    /// after the list of VMs of `from` (or of its destination) was taken.
    fn committed_since_listed(&self, name: &str, from: Option<&str>) -> Option<&'a FleetMigration> {
        self.migrations
            .iter()
            .filter(|m| m.vm == name && m.state == FleetMigrationState::Committed)
            .filter(|m| from.is_none_or(|h| m.source_host == h))
            .filter(|m| {
                let listed = self.listed_at(from.unwrap_or(&m.destination_host));
                m.finished_unix_ms.is_some_and(|t| t > listed)
            })
            .max_by_key(|m| m.finished_unix_ms)
    }

    /// The hosts' reports of the VM named `name` that still hold: not those listed by the
    /// source of a migration that committed after they were taken, nor those listed by the
    /// destination of one that failed after (libvirt lists the incoming domain until the
    /// failure removes it).
    pub fn reports(&self, name: &str) -> Vec<&'a Vm> {
        self.vms
            .iter()
            .filter(|vm| vm.name == name)
            .filter(|vm| self.committed_since_listed(name, Some(&vm.host)).is_none())
            .filter(|vm| !self.failed_since_listed(name, &vm.host))
            .collect()
    }

    /// Whether a migration of `name` to `host` failed after `host`'s list was taken.
    fn failed_since_listed(&self, name: &str, host: &str) -> bool {
        let listed = self.listed_at(host);
        self.migrations.iter().any(|m| {
            m.vm == name
                && m.destination_host == host
                && m.state == FleetMigrationState::Failed
                && m.finished_unix_ms.is_some_and(|t| t > listed)
        })
    }

    /// Where the VM named `name` runs: at the source while it migrates (whoever reports it:
    /// the destination lists the incoming domain, the source may already have dropped it);
    /// else where a report that still holds says, or at the destination of a migration that
    /// committed after every report (its destination has not listed it yet).
    fn location(&self, name: &str) -> Option<&'a str> {
        if let Some(m) = self.unfinished().find(|m| m.vm == name) {
            return Some(m.source_host.as_str());
        }
        match self.reports(name).first() {
            Some(vm) => Some(vm.host.as_str()),
            None => self
                .committed_since_listed(name, None)
                .or_else(|| {
                    // Every report was the source's, listed before the commit.
                    self.vms
                        .iter()
                        .find(|vm| vm.name == name)
                        .and_then(|vm| self.committed_since_listed(name, Some(&vm.host)))
                })
                .map(|m| m.destination_host.as_str()),
        }
    }

    /// The VM named `name` as the fleet knows it now: one host's report that still holds, or
    /// the record of the migration that just moved it; `Err` with the hosts when several hold
    /// (two copies: the controller will not choose).
    pub fn vm(&self, name: &str) -> Result<Option<Vm>, Vec<String>> {
        let reports = self.reports(name);
        let mut hosts: Vec<String> = reports.iter().map(|v| v.host.clone()).collect();
        hosts.dedup();
        if hosts.len() > 1 {
            return Err(hosts);
        }
        if let Some(vm) = reports.first() {
            return Ok(Some((*vm).clone()));
        }
        let Some(host) = self.location(name) else {
            return Ok(None);
        };
        let Some(m) = self.migrations.iter().rev().find(|m| m.vm == name) else {
            return Ok(None);
        };
        Ok(Some(Vm {
            name: name.to_owned(),
            kind: m.kind,
            host: host.to_owned(),
            site: self.host(host).map(|h| h.site.clone()).unwrap_or_default(),
            state: "running".into(),
            nics: self.nics(name).into_iter().cloned().collect(),
            usage: None,
        }))
    }

    /// The NICs of the VM named `name`: as reported (by any host), else as its latest
    /// migration recorded them.
    fn nics(&self, name: &str) -> Vec<&'a VmNic> {
        let reported: Vec<&VmNic> = self
            .vms
            .iter()
            .filter(|vm| vm.name == name)
            .flat_map(|vm| &vm.nics)
            .collect();
        if !reported.is_empty() {
            return reported;
        }
        self.migrations
            .iter()
            .filter(|m| m.vm == name)
            .max_by_key(|m| m.created_unix_ms)
            .map(|m| m.nics.iter().collect())
            .unwrap_or_default()
    }

    fn members(&self, pool: &PoolRecord) -> Vec<Member<'a>> {
        let names: BTreeSet<&str> = self
            .vms
            .iter()
            .map(|vm| vm.name.as_str())
            .chain(self.migrations.iter().map(|m| m.vm.as_str()))
            .collect();
        let mut members: Vec<Member> = names
            .into_iter()
            .filter_map(|name| Some((name, self.location(name)?)))
            .flat_map(|(vm, host)| {
                self.nics(vm)
                    .into_iter()
                    .filter(|nic| nic.bridge == pool.bridge)
                    .map(move |nic| Member {
                        vm,
                        mac: &nic.mac,
                        host,
                    })
            })
            .collect();
        members.sort_by(|a, b| (a.mac, a.host).cmp(&(b.mac, b.host)));
        members.dedup();
        members
    }

    /// The pool's VMs' NICs moving now: (MAC, from, to).
    fn moving(&self, pool: &PoolRecord) -> Vec<MovingMac> {
        let members = self.members(pool);
        self.unfinished()
            .flat_map(|m| {
                members
                    .iter()
                    .filter(|member| member.vm == m.vm)
                    .map(|member| MovingMac {
                        mac: member.mac.to_owned(),
                        from: m.source_host.clone(),
                        to: m.destination_host.clone(),
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The hosts with `pool`'s endpoint, each with the pool's VMs there.
    fn endpoints(&self, pool: &PoolRecord) -> BTreeMap<&'a str, Vec<&'a str>> {
        let mut hosts: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for member in self.members(pool) {
            let vms = hosts.entry(member.host).or_default();
            if !vms.contains(&member.vm) {
                vms.push(member.vm);
            }
        }
        let members = self.members(pool);
        for m in self.unfinished() {
            if members.iter().any(|member| member.vm == m.vm) {
                hosts.entry(m.destination_host.as_str()).or_default();
            }
        }
        for held in &pool.held {
            if let Some(host) = self.host(held) {
                hosts.entry(host.name.as_str()).or_default();
            }
        }
        hosts.retain(|host, _| self.overlay_address(host).is_some());
        hosts
    }

    /// What `host`'s overlay must be (None: it has none).
    pub fn plan_for(&self, host: &str) -> Option<OverlayPlan> {
        self.host(host)?.overlay.as_ref()?;
        let endpoints = self
            .pools
            .iter()
            .filter_map(|pool| {
                let endpoints = self.endpoints(pool);
                endpoints.contains_key(host).then(|| {
                    let remotes = endpoints
                        .keys()
                        .filter(|h| **h != host)
                        .filter_map(|h| {
                            Some(OverlayRemote {
                                host: (*h).to_owned(),
                                address: self.overlay_address(h)?.to_owned(),
                            })
                        })
                        .collect();
                    let macs = if pool.learning {
                        Vec::new()
                    } else {
                        self.members(pool)
                            .into_iter()
                            .filter(|m| m.host != host && endpoints.contains_key(m.host))
                            .map(|m| RemoteMac {
                                mac: m.mac.to_owned(),
                                host: m.host.to_owned(),
                            })
                            .collect()
                    };
                    let moving = if pool.learning || !pool.repoint {
                        Vec::new()
                    } else {
                        self.moving(pool)
                    };
                    EndpointPlan {
                        pool: pool.name.clone(),
                        vni: pool.vni,
                        bridge: pool.bridge.clone(),
                        learning: pool.learning,
                        repoint: pool.repoint,
                        remotes,
                        macs,
                        moving,
                    }
                })
            })
            .collect();
        Some(OverlayPlan { endpoints })
    }

    /// The pools as the API shows them.
    pub fn pools(&self) -> Vec<Pool> {
        self.pools
            .iter()
            .map(|pool| Pool {
                name: pool.name.clone(),
                vni: pool.vni,
                bridge: pool.bridge.clone(),
                learning: pool.learning,
                repoint: pool.repoint,
                held: pool.held.clone(),
                endpoints: self
                    .endpoints(pool)
                    .into_iter()
                    .map(|(host, vms)| {
                        let h = self.host(host);
                        PoolEndpoint {
                            host: host.to_owned(),
                            site: h.map(|h| h.site.clone()).unwrap_or_default(),
                            vms: vms.into_iter().map(str::to_owned).collect(),
                            ready: h
                                .and_then(|h| h.overlay.as_ref())
                                .is_some_and(|o| o.ready.contains(&pool.name)),
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    /// The pools `vm` is in (by its NICs' bridges).
    pub fn pools_of(&self, vm: &Vm) -> Vec<&'a PoolRecord> {
        self.pools
            .iter()
            .filter(|p| vm.nics.iter().any(|nic| nic.bridge == p.bridge))
            .collect()
    }

    /// Why `host` cannot take a VM of `pools` now (None: it can): it has no overlay, or its
    /// endpoints are not up yet.
    pub fn not_ready(&self, host: &str, pools: &[&PoolRecord]) -> Option<String> {
        if pools.is_empty() {
            return None;
        }
        let overlay = self.host(host).and_then(|h| h.overlay.as_ref());
        let Some(overlay) = overlay else {
            return Some(format!(
                "host {host} has no overlay (no [overlay] in its agent's config)"
            ));
        };
        let waiting: Vec<&str> = pools
            .iter()
            .filter(|p| !overlay.ready.contains(&p.name))
            .map(|p| p.name.as_str())
            .collect();
        (!waiting.is_empty()).then(|| {
            format!(
                "waiting for pool endpoint(s) {} on {host}",
                waiting.join(", ")
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::fleet::{HostState, OverlayReport, VmKind, VmNic};

    fn host(name: &str, site: &str, overlay: Option<(&str, &[&str])>) -> Host {
        Host {
            name: name.into(),
            site: site.into(),
            state: HostState::Up,
            version: "test".into(),
            peer_listen: String::new(),
            peers: vec![],
            max_outgoing: 1,
            vms: 0,
            first_seen_unix_ms: 0,
            last_seen_unix_ms: 1000,
            overlay: overlay.map(|(address, ready)| OverlayReport {
                address: address.into(),
                ready: ready.iter().map(|r| (*r).to_string()).collect(),
            }),
            vms_listed_unix_ms: None,
            capacity: None,
            swaps: vec![],
        }
    }

    fn vm(name: &str, host: &str, nics: &[(&str, &str)]) -> Vm {
        Vm {
            name: name.into(),
            kind: VmKind::Libvirt,
            host: host.into(),
            site: String::new(),
            state: "running".into(),
            usage: None,
            nics: nics
                .iter()
                .map(|(mac, bridge)| VmNic {
                    mac: (*mac).into(),
                    bridge: (*bridge).into(),
                })
                .collect(),
        }
    }

    fn pool(name: &str, vni: u32, learning: bool, held: &[&str]) -> PoolRecord {
        PoolRecord {
            name: name.into(),
            vni,
            bridge: format!("fp{vni}"),
            learning,
            repoint: !learning,
            held: held.iter().map(|h| (*h).to_string()).collect(),
        }
    }

    fn migration(vm: &str, from: &str, to: &str, state: FleetMigrationState) -> FleetMigration {
        let mut m = crate::store::tests::migration("m-1");
        m.vm = vm.into();
        m.source_host = from.into();
        m.destination_host = to.into();
        m.state = state;
        m
    }

    #[test]
    fn an_endpoint_exists_where_the_pool_has_vms_is_going_or_is_held_and_nowhere_else() {
        let pools = [
            pool("red", 1001, false, &["c1"]),
            pool("blue", 1002, false, &[]),
        ];
        let hosts = [
            host("a1", "a", Some(("10.0.0.1", &["red"]))),
            host("b1", "b", Some(("10.0.0.2", &[]))),
            host("c1", "c", Some(("10.0.0.3", &[]))),
            host("d1", "d", None),
        ];
        let vms = [
            vm("web", "a1", &[("52:54:00:00:00:01", "fp1001")]),
            vm("other", "a1", &[("52:54:00:00:00:09", "br0")]),
        ];
        let idle = Snapshot {
            pools: &pools,
            hosts: &hosts,
            vms: &vms,
            migrations: &[],
        };
        let red = idle.plan_for("a1").unwrap();
        assert_eq!(red.endpoints.len(), 1, "blue has no VM on a1: {red:?}");
        let ep = &red.endpoints[0];
        assert_eq!((ep.pool.as_str(), ep.vni), ("red", 1001));
        assert_eq!(
            ep.remotes,
            vec![OverlayRemote {
                host: "c1".into(),
                address: "10.0.0.3".into()
            }],
            "held at c1"
        );
        assert!(ep.macs.is_empty() && ep.moving.is_empty(), "{ep:?}");
        assert!(idle.plan_for("b1").unwrap().endpoints.is_empty());
        assert_eq!(idle.plan_for("d1"), None, "no overlay, no plan");
        let c1 = idle.plan_for("c1").unwrap();
        assert_eq!(
            c1.endpoints[0].macs,
            vec![RemoteMac {
                mac: "52:54:00:00:00:01".into(),
                host: "a1".into()
            }]
        );

        // On its way to b1: b1 gets the endpoint first, and every end knows the move.
        let moving = [migration("web", "a1", "b1", FleetMigrationState::Running)];
        let during = Snapshot {
            migrations: &moving,
            ..idle
        };
        let b1 = during.plan_for("b1").unwrap();
        assert_eq!(b1.endpoints.len(), 1);
        assert_eq!(
            b1.endpoints[0].moving,
            vec![MovingMac {
                mac: "52:54:00:00:00:01".into(),
                from: "a1".into(),
                to: "b1".into()
            }]
        );
        assert_eq!(b1.endpoints[0].macs[0].host, "a1", "still at a1");
        assert_eq!(
            during.not_ready("b1", &during.pools_of(&vms[0])),
            Some("waiting for pool endpoint(s) red on b1".into())
        );
        assert!(during.not_ready("a1", &during.pools_of(&vms[0])).is_none());
        assert!(
            during.not_ready("d1", &during.pools_of(&vms[1])).is_none(),
            "in no pool"
        );
        assert!(during
            .not_ready("d1", &during.pools_of(&vms[0]))
            .unwrap()
            .contains("no overlay"));
    }

    #[test]
    fn a_commit_moves_the_vm_before_its_old_host_reports_again_and_its_last_vm_gone_removes_the_endpoint(
    ) {
        let pools = [pool("red", 1001, false, &[])];
        let hosts = [
            host("a1", "a", Some(("10.0.0.1", &["red"]))),
            host("b1", "b", Some(("10.0.0.2", &["red"]))),
        ];
        let mut done = migration("web", "a1", "b1", FleetMigrationState::Committed);
        done.finished_unix_ms = Some(2000);
        let done = [done];
        // a1's last report (t=1000) predates the commit (t=2000): the VM is at b1.
        let vms = [vm("web", "a1", &[("52:54:00:00:00:01", "fp1001")])];
        let s = Snapshot {
            pools: &pools,
            hosts: &hosts,
            vms: &vms,
            migrations: &done,
        };
        assert!(
            s.plan_for("a1").unwrap().endpoints.is_empty(),
            "a1 has none left"
        );
        let view = s.pools();
        assert_eq!(view[0].endpoints.len(), 1);
        assert_eq!(view[0].endpoints[0].host, "b1");
        assert_eq!(view[0].endpoints[0].vms, vec!["web".to_string()]);
    }

    #[test]
    fn a_vm_between_its_hosts_reports_keeps_its_pool_at_both_ends() {
        // The source dropped the domain and the destination lists it without interfaces
        // (libvirt still finishing), the controller not told of the commit yet: the VM is
        // still the source's, its NICs those the migration recorded, and the destination
        // keeps its endpoint.
        let pools = [pool("red", 1001, false, &[])];
        let hosts = [
            host("a1", "a", Some(("10.0.0.1", &["red"]))),
            host("b1", "b", Some(("10.0.0.2", &["red"]))),
        ];
        let mut moving = migration("web", "a1", "b1", FleetMigrationState::Running);
        moving.nics = vec![VmNic {
            mac: "52:54:00:00:00:01".into(),
            bridge: "fp1001".into(),
        }];
        let moving = [moving];
        let vms = [vm("web", "b1", &[])];
        let s = Snapshot {
            pools: &pools,
            hosts: &hosts,
            vms: &vms,
            migrations: &moving,
        };
        let b1 = s.plan_for("b1").unwrap();
        assert_eq!(b1.endpoints.len(), 1, "{b1:?}");
        assert_eq!(b1.endpoints[0].macs[0].host, "a1");
        assert_eq!(b1.endpoints[0].moving.len(), 1);
        assert_eq!(s.plan_for("a1").unwrap().endpoints.len(), 1);
    }

    #[test]
    fn a_host_marked_down_keeps_its_place_in_the_pools() {
        let pools = [pool("red", 1001, false, &[])];
        let mut b1 = host("b1", "b", Some(("10.0.0.2", &["red"])));
        b1.state = HostState::Down;
        let hosts = [host("a1", "a", Some(("10.0.0.1", &["red"]))), b1];
        let vms = [
            vm("web", "a1", &[("52:54:00:00:00:01", "fp1001")]),
            vm("db", "b1", &[("52:54:00:00:00:02", "fp1001")]),
        ];
        let s = Snapshot {
            pools: &pools,
            hosts: &hosts,
            vms: &vms,
            migrations: &[],
        };
        let a1 = s.plan_for("a1").unwrap();
        assert_eq!(a1.endpoints[0].remotes[0].host, "b1");
        assert_eq!(a1.endpoints[0].macs[0].mac, "52:54:00:00:00:02");
    }

    #[test]
    fn a_report_listed_before_the_vm_left_does_not_hold() {
        let pools: [PoolRecord; 0] = [];
        let mut a1 = host("a1", "a", None);
        a1.vms_listed_unix_ms = Some(1500);
        let mut b1 = host("b1", "b", None);
        b1.vms_listed_unix_ms = Some(900);
        let hosts = [a1, b1];
        let mut done = migration("web", "a1", "b1", FleetMigrationState::Committed);
        done.finished_unix_ms = Some(2000);
        let done = [done];
        // a1 listed web before the commit; b1 has not listed it yet.
        let vms = [vm("web", "a1", &[])];
        let s = Snapshot {
            pools: &pools,
            hosts: &hosts,
            vms: &vms,
            migrations: &done,
        };
        let web = s.vm("web").unwrap().unwrap();
        assert_eq!(web.host, "b1");
        // Both list it: b1's report holds, a1's does not.
        let vms = [vm("web", "a1", &[]), vm("web", "b1", &[])];
        let s = Snapshot { vms: &vms, ..s };
        assert_eq!(s.vm("web").unwrap().unwrap().host, "b1");
        // a1 lists it again after the commit: two copies, the controller will not choose.
        let mut hosts = hosts.clone();
        hosts[0].vms_listed_unix_ms = Some(2500);
        let s = Snapshot { hosts: &hosts, ..s };
        assert_eq!(s.vm("web"), Err(vec!["a1".to_string(), "b1".to_string()]));
        assert_eq!(s.vm("nope"), Ok(None));
    }

    #[test]
    fn an_incoming_domain_listed_before_its_migration_failed_does_not_hold() {
        let pools: [PoolRecord; 0] = [];
        let (mut a1, mut b1) = (host("a1", "a", None), host("b1", "b", None));
        a1.vms_listed_unix_ms = Some(2500);
        b1.vms_listed_unix_ms = Some(1500);
        let hosts = [a1, b1];
        let mut failed = migration("web", "a1", "b1", FleetMigrationState::Failed);
        failed.finished_unix_ms = Some(2000);
        let failed = [failed];
        let vms = [vm("web", "a1", &[]), vm("web", "b1", &[])];
        let s = Snapshot {
            pools: &pools,
            hosts: &hosts,
            vms: &vms,
            migrations: &failed,
        };
        assert_eq!(s.vm("web").unwrap().unwrap().host, "a1");
        // b1 lists it after the failure: two copies.
        let mut hosts = hosts.clone();
        hosts[1].vms_listed_unix_ms = Some(2600);
        let s = Snapshot { hosts: &hosts, ..s };
        assert!(s.vm("web").is_err());
    }

    #[test]
    fn a_learning_pool_gets_no_directory() {
        let pools = [pool("red", 1001, true, &["b1"])];
        let hosts = [
            host("a1", "a", Some(("10.0.0.1", &[]))),
            host("b1", "b", Some(("10.0.0.2", &[]))),
        ];
        let vms = [vm("web", "a1", &[("52:54:00:00:00:01", "fp1001")])];
        let moving = [migration("web", "a1", "b1", FleetMigrationState::Running)];
        let s = Snapshot {
            pools: &pools,
            hosts: &hosts,
            vms: &vms,
            migrations: &moving,
        };
        let b1 = s.plan_for("b1").unwrap();
        assert!(b1.endpoints[0].learning);
        assert!(b1.endpoints[0].macs.is_empty() && b1.endpoints[0].moving.is_empty());
        assert_eq!(b1.endpoints[0].remotes.len(), 1);
    }
}
