//! Virtual cloud pools with the lab (`lab up --libvirt --controller`): two tenants, red and
//! blue, each with a VM at site a at the same address (10.0.0.10) and a client port beside
//! it at the same address (10.0.0.20). The agents make each pool's bridge and VXLAN as the
//! controller plans: red's VM moves to site b and back through the fleet while its client's
//! TCP connection to it keeps every byte; site b gets red's endpoint only while red has a VM
//! there; and no frame of one tenant ever reaches the other's bridges.

mod common;

use std::time::Duration;

use common::domains::{start_domain_on, verify};
use common::fleet::{fleet, fleet_json, host_of, wait_for, LAB};
use common::TestLab;
use ferry_lab::libvirt::GuestNic;
use ferry_lab::pools::{bridge_macs, has_interface, PoolPort};
use ferry_lab::tcpseq::TcpSeqClient;
use ferry_lab::Site;

/// A tenant: its pool, its VM and its client port.
struct Tenant {
    pool: &'static str,
    vni: u32,
    vm: &'static str,
    vm_mac: &'static str,
    client_mac: &'static str,
}

impl Tenant {
    fn bridge(&self) -> String {
        format!("fp{}", self.vni)
    }
}

const RED: Tenant = Tenant {
    pool: "red",
    vni: 1001,
    vm: "red-vm",
    vm_mac: "52:54:00:0e:d0:0a",
    client_mac: "52:54:00:0e:d0:14",
};
const BLUE: Tenant = Tenant {
    pool: "blue",
    vni: 1002,
    vm: "blue-vm",
    vm_mac: "52:54:00:0b:10:0a",
    client_mac: "52:54:00:0b:10:14",
};

fn pool<'a>(pools: &'a [serde_json::Value], name: &str) -> Option<&'a serde_json::Value> {
    pools.iter().find(|p| p["name"] == name)
}

/// The hosts with `name`'s endpoint up, as the controller sees them.
fn ready_hosts(pools: &[serde_json::Value], name: &str) -> Vec<String> {
    pool(pools, name)
        .and_then(|p| p["endpoints"].as_array())
        .map(|eps| {
            eps.iter()
                .filter(|e| e["ready"] == true)
                .filter_map(|e| e["host"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn two_tenants_pools_span_the_sites_apart_and_a_vm_moves_with_its_connection() {
    let t = TestLab::up("pools", LAB);
    let rt = tokio::runtime::Runtime::new().unwrap();
    wait_for(&t, "hosts", |h| {
        h.len() == 2
            && h.iter()
                .all(|h| h["state"] == "up" && !h["overlay"].is_null())
    });

    // Bad input first: a VNI out of range, a taken one, a hold on an unknown host.
    let out = fleet(&t, &["pool", "create", "red", "--vni", "0"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("out of VXLAN's range"));
    for tenant in [&RED, &BLUE] {
        common::succeeded(
            "ferry fleet pool create",
            &fleet(
                &t,
                &[
                    "pool",
                    "create",
                    tenant.pool,
                    "--vni",
                    &tenant.vni.to_string(),
                    "--hold",
                    "site-a",
                ],
            ),
        );
    }
    let out = fleet(&t, &["pool", "create", "green", "--vni", "1001"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("taken by pool red"),
        "{out:?}"
    );
    let out = fleet(&t, &["pool", "hold", "red", "site-z"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no host \"site-z\""));
    wait_for(&t, "pools", |p| {
        ready_hosts(p, "red") == ["site-a"] && ready_hosts(p, "blue") == ["site-a"]
    });
    assert!(
        !has_interface(&t.lab, Site::B, &RED.bridge()),
        "no red VM at b yet"
    );

    // Each tenant: a VM at 10.0.0.10 and a client at 10.0.0.20, the same in both pools.
    let mut links = Vec::new();
    let mut ports = Vec::new();
    for tenant in [&RED, &BLUE] {
        let nic = GuestNic {
            bridge: tenant.bridge(),
            mac: tenant.vm_mac.into(),
            ip: "10.0.0.10".into(),
        };
        links.push(start_domain_on(
            &t,
            &rt,
            tenant.vm,
            &nic,
            (false, ""),
            &["mem start pattern=ws mib=16 rate=1"],
        ));
        ports.push(
            PoolPort::attach(
                &t.lab,
                Site::A,
                &tenant.bridge(),
                tenant.pool,
                tenant.client_mac,
                "10.0.0.20/24",
            )
            .unwrap(),
        );
    }
    let clients: Vec<TcpSeqClient> = ports
        .iter()
        .map(|port| {
            let c =
                TcpSeqClient::connect(&port.ns, "10.0.0.10:7000", Duration::from_secs(60)).unwrap();
            c.wait_for_more(20, Duration::from_secs(30)).unwrap();
            c
        })
        .collect();
    // Each client reached its own tenant's VM.
    for (tenant, port) in [&RED, &BLUE].into_iter().zip(&ports) {
        assert_eq!(port.neighbour("10.0.0.10").as_deref(), Some(tenant.vm_mac));
    }
    wait_for(&t, "vms", |v| {
        host_of(v, RED.vm).is_some() && host_of(v, BLUE.vm).is_some()
    });

    // Red's VM to site b: b gets red's endpoint (not blue's) before the VM arrives; the
    // connection keeps every number across the switchover.
    let out = common::succeeded(
        "ferry fleet migrate",
        &fleet(&t, &["migrate", RED.vm, "--to", "site-b"]),
    );
    assert!(out.lines().last().unwrap().contains("committed"), "{out}");
    assert_eq!(t.domstate(Site::B, RED.vm).as_deref(), Some("running"));
    assert!(has_interface(&t.lab, Site::B, &RED.bridge()));
    assert!(!has_interface(&t.lab, Site::B, &BLUE.bridge()));
    clients[0]
        .wait_for_more(20, Duration::from_secs(30))
        .unwrap();
    let there = clients[0].stats();
    assert!(there.intact(), "red's connection after the move: {there:?}");
    eprintln!(
        "red's connection across the move to b: longest stall {} ms",
        there.max_stall_ms
    );
    let pools = wait_for(&t, "pools", |p| ready_hosts(p, "red").len() == 2);
    let red = pool(&pools, "red").unwrap();
    let at_b = red["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["host"] == "site-b")
        .unwrap();
    assert_eq!(at_b["vms"], serde_json::json!([RED.vm]), "{red}");
    let seen_at_b = bridge_macs(&t.lab, Site::B, &RED.bridge()).unwrap();
    assert!(seen_at_b.iter().any(|m| m == RED.vm_mac), "{seen_at_b:?}");
    for mac in [BLUE.vm_mac, BLUE.client_mac] {
        assert!(
            !seen_at_b.iter().any(|m| m == mac),
            "{mac} reached red's bridge at b"
        );
    }

    // And back: site b's red endpoint goes once its last VM left.
    let out = common::succeeded(
        "ferry fleet migrate",
        &fleet(&t, &["migrate", RED.vm, "--to", "site-a"]),
    );
    assert!(out.lines().last().unwrap().contains("committed"), "{out}");
    clients[0]
        .wait_for_more(20, Duration::from_secs(30))
        .unwrap();
    let back = clients[0].stats();
    assert!(back.intact(), "red's connection after the return: {back:?}");
    wait_for(&t, "pools", |p| ready_hosts(p, "red") == ["site-a"]);
    common::fleet::wait_until("site b's red endpoint removed", || {
        !has_interface(&t.lab, Site::B, &RED.bridge())
    });

    // Blue never noticed, and no frame crossed: every MAC that reached a bridge of one pool
    // is that pool's own.
    let blue = clients[1].stats();
    assert!(blue.intact(), "blue's connection: {blue:?}");
    assert_eq!(
        ports[1].neighbour("10.0.0.10").as_deref(),
        Some(BLUE.vm_mac)
    );
    for (tenant, other) in [(&RED, &BLUE), (&BLUE, &RED)] {
        let seen = bridge_macs(&t.lab, Site::A, &tenant.bridge()).unwrap();
        assert!(seen.iter().any(|m| m == tenant.vm_mac), "{seen:?}");
        assert!(seen.iter().any(|m| m == tenant.client_mac), "{seen:?}");
        for mac in [other.vm_mac, other.client_mac] {
            assert!(
                !seen.iter().any(|m| m == mac),
                "{mac} of {} reached {}'s bridge: {seen:?}",
                other.pool,
                tenant.pool
            );
        }
    }
    // The verifiers speak on the serial consoles the first links still hold.
    drop(links);
    for tenant in [&RED, &BLUE] {
        assert_eq!(verify(&t, &rt, Site::A, tenant.vm, false), 0);
    }
    assert_eq!(
        host_of(&fleet_json(&t, "vms"), RED.vm).as_deref(),
        Some("site-a")
    );
    // A pool with VMs is not deleted.
    let out = fleet(&t, &["pool", "delete", "red"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("still has VMs: red-vm"),
        "{out:?}"
    );
}
