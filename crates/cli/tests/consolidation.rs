//! The fleet's planner in the lab (`lab up --libvirt --controller`): four libvirt domains, two
//! at each site, lightly used. `ferry fleet plan` empties one site's host, and `--apply` moves
//! its VMs to the other; the emptied host is then reported empty. Two VMs then use all the
//! CPU they can: the host is over its capacity, and the plan spreads a VM back. The
//! guests' verifiers decide whether their memory arrived intact.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::domains::{start_domain, verify};
use common::fleet::{fleet, host_of, wait_for, LAB};
use common::TestLab;
use ferry_lab::guest::{GuestLink, Heartbeats};
use ferry_lab::Site;

const VMS: [&str; 4] = ["con1", "con2", "con3", "con4"];

/// `ferry fleet plan [--apply] --json`.
fn plan(t: &TestLab, apply: bool) -> serde_json::Value {
    let mut args = vec!["plan", "--json"];
    if apply {
        args.push("--apply");
    }
    common::json(&common::succeeded("ferry fleet plan", &fleet(t, &args)))
}

/// Applies the plan until it requests migrations for `reason` (the VMs' use is sampled every
/// second: a plan can miss a move by a hair), within two minutes; returns the plan.
fn apply_until(t: &TestLab, reason: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = plan(t, true);
        let requested = done["requested"].as_array().map_or(0, Vec::len);
        let moves = done["moves"].as_array().cloned().unwrap_or_default();
        if requested > 0 {
            assert!(moves.iter().all(|m| m["reason"] == reason), "{done}");
            assert!(done["refused"].as_array().unwrap().is_empty(), "{done}");
            return done;
        }
        assert!(Instant::now() < deadline, "no {reason} moves: {done}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Follows each requested migration to its commit.
fn watch_all(t: &TestLab, done: &serde_json::Value) {
    for id in done["requested"].as_array().unwrap() {
        let id = id.as_str().unwrap();
        common::succeeded("ferry fleet watch", &fleet(t, &["watch", id]));
    }
}

/// A command to domain `name`'s guest at `site`, through its serial socket there.
fn guest_call(t: &TestLab, rt: &tokio::runtime::Runtime, site: Site, name: &str, cmd: &str) {
    let serial = t.lab.host_dir(site).join(format!("{name}.serial"));
    rt.block_on(async {
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        link.call(cmd, Duration::from_secs(10)).await.unwrap();
    });
}

fn site_of(vms: &[serde_json::Value], name: &str) -> String {
    host_of(vms, name).unwrap_or_default()
}

fn other(site: &str) -> &'static str {
    if site == "site-a" {
        "site-b"
    } else {
        "site-a"
    }
}

fn lab_site(host: &str) -> Site {
    if host == "site-a" {
        Site::A
    } else {
        Site::B
    }
}

#[test]
fn the_planner_empties_a_host_when_demand_falls_and_spreads_vms_when_it_rises() {
    let t = TestLab::up("consolidation", LAB);
    let rt = tokio::runtime::Runtime::new().unwrap();
    wait_for(&t, "hosts", |h| {
        h.len() == 2
            && h.iter()
                .all(|h| h["state"] == "up" && h["capacity"]["cpus"] == 2)
    });
    // Idle guests (their verifiers still check every page) use little CPU: the demand is low.
    let _links: Vec<_> = VMS
        .iter()
        .zip(41..)
        .map(|(name, host)| start_domain(&t, &rt, (name, host, false, ""), &[]))
        .collect();
    // Two of them at site b: the fleet runs two VMs at each site.
    for name in &VMS[2..] {
        common::succeeded(
            "ferry fleet migrate",
            &fleet(&t, &["migrate", name, "--to-site", "b"]),
        );
    }
    wait_for(&t, "vms", |v| {
        site_of(v, "con1") == "site-a"
            && site_of(v, "con2") == "site-a"
            && site_of(v, "con3") == "site-b"
            && site_of(v, "con4") == "site-b"
            && VMS.iter().all(|n| {
                v.iter()
                    .any(|vm| vm["name"] == *n && !vm["usage"].is_null())
            })
    });

    // Four idle tiny guests fit on one host: one host is emptied, its two VMs go across.
    let done = apply_until(&t, "consolidate");
    let drained = done["drain"][0].as_str().unwrap().to_owned();
    let full = other(&drained);
    assert_eq!(done["drain"].as_array().unwrap().len(), 1, "{done}");
    let moves = done["moves"].as_array().unwrap();
    assert_eq!(moves.len(), 2, "{done}");
    assert!(moves.iter().all(|m| m["from"] == drained.as_str()
        && m["to"] == full
        && m["predicted_s"].as_f64().unwrap() > 0.0));
    watch_all(&t, &done);
    let vms = wait_for(&t, "vms", |v| VMS.iter().all(|n| site_of(v, n) == full));
    assert_eq!(vms.len(), 4, "{vms:?}");
    for name in VMS {
        assert_eq!(
            verify(&t, &rt, lab_site(full), name, false),
            0,
            "{name} at {full}"
        );
    }
    assert_eq!(
        t.virsh(lab_site(&drained), &["list", "--name"])
            .stdout
            .trim_ascii(),
        b""
    );
    // The emptied host is reported empty (it may be stopped).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = plan(&t, false);
        if now["empty"] == serde_json::json!([drained]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{drained} never reported empty: {now}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    // Demand rises: two guests rewrite their memory as fast as their CPU allows. The host is
    // over its capacity, and the cheapest move that relieves it alone goes to the emptied host
    // once its cooldown (30 s in the lab) is over: one of the busy guests, or an idle one when
    // that is enough (idle emulated guests use a share of a CPU, and the busy ones' shares of
    // the shared machine vary).
    for name in ["con1", "con3"] {
        guest_call(
            &t,
            &rt,
            lab_site(full),
            name,
            "mem start pattern=ws mib=4 rate=0",
        );
    }
    let done = apply_until(&t, "relieve");
    let moves = done["moves"].as_array().unwrap();
    assert_eq!(moves.len(), 1, "{done}");
    let moved = moves[0]["vms"][0].as_str().unwrap().to_owned();
    assert_eq!(moves[0]["to"], drained.as_str(), "{done}");
    watch_all(&t, &done);
    wait_for(&t, "vms", |v| site_of(v, &moved) == drained);
    assert_eq!(
        verify(&t, &rt, lab_site(&drained), &moved, false),
        0,
        "{moved} at {drained}"
    );
    for name in VMS.iter().filter(|n| **n != moved) {
        assert_eq!(
            verify(&t, &rt, lab_site(full), name, false),
            0,
            "{name} at {full}"
        );
    }
}
