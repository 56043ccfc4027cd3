//! The controller's overload response in the lab (Overdriver; docs/policies.md "Overload"):
//! four libvirt domains, three at site a and one at site b, each host offering VMs 240 MiB.
//! A guest's short memory burst takes site a over: the controller gives a VM swap on site b's
//! memory for as long as the burst lasts, and back after, and nothing migrates. A burst that
//! lasts is met by a migration instead: the swap goes back and a VM moves to site b. The
//! guests' own checks (the burst's pages, the memory verifier) decide whether their memory
//! survived both.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::domains::{start_domain, verify};
use common::fleet::{fleet, fleet_json, host_of, wait_for};
use common::TestLab;
use ferry_lab::guest::{GuestLink, GuestReply, Heartbeats};
use ferry_lab::Site;

/// LAN-like (Overdriver's peers share the data center), the controller judging memory
/// pressure every 3 s (each interval by its highest reading), each host offering 240 MiB.
const LAB: &[&str] = &[
    "--libvirt",
    "--controller",
    "--overload-mib",
    "240",
    "--rate-mbit",
    "1000",
    "--rtt-ms",
    "1",
];
const VMS: [&str; 4] = ["ov1", "ov2", "ov3", "ov4"];

/// A command to domain `name`'s guest at `site`, through its serial socket there.
fn guest_call(
    t: &TestLab,
    rt: &tokio::runtime::Runtime,
    site: Site,
    name: &str,
    cmd: &str,
) -> GuestReply {
    let serial = t.lab.host_dir(site).join(format!("{name}.serial"));
    rt.block_on(async {
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        link.call(cmd, Duration::from_secs(30)).await.unwrap()
    })
}

/// `ferry fleet plan --json`: the overload response's view is in it.
fn plan(t: &TestLab) -> serde_json::Value {
    common::json(&common::succeeded(
        "ferry fleet plan",
        &fleet(t, &["plan", "--json"]),
    ))
}

fn pressure_of(plan: &serde_json::Value, host: &str) -> serde_json::Value {
    plan["pressure"]
        .as_array()
        .and_then(|all| all.iter().find(|p| p["host"] == host).cloned())
        .unwrap_or_default()
}

/// Polls the plan until `ready` holds for it, within `limit`; returns it.
fn plan_until(
    t: &TestLab,
    what: &str,
    limit: Duration,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + limit;
    loop {
        let now = plan(t);
        if ready(&now) {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}: {now}\nmigrations: {}",
            migrations_in_brief(t)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The fleet's migrations, one line each: who asked, what moved where, how it ended.
fn migrations_in_brief(t: &TestLab) -> String {
    fleet_json(t, "migrations")
        .iter()
        .map(|m| {
            format!(
                "{} {} -> {} by {}: {} {}",
                m["vm"],
                m["source_host"],
                m["destination_host"],
                m["requested_by"],
                m["state"],
                m["timeline"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The burst's state in `name`'s guest at `site` (`burst stats`).
fn burst(t: &TestLab, rt: &tokio::runtime::Runtime, site: Site, name: &str) -> GuestReply {
    guest_call(t, rt, site, name, "burst stats")
}

fn swaps_at_a(t: &TestLab) -> Vec<serde_json::Value> {
    let agent = t.lab.agent_socket(Site::A);
    let out = common::succeeded(
        "ferry swap list",
        &t.run(&["swap", "list", "--json", "--agent", agent.to_str().unwrap()]),
    );
    common::json(&out).as_array().cloned().unwrap_or_default()
}

#[test]
fn a_short_burst_swaps_to_a_peer_and_a_lasting_one_migrates() {
    let t = TestLab::up("overload", LAB);
    let rt = tokio::runtime::Runtime::new().unwrap();
    wait_for(&t, "hosts", |h| {
        h.len() == 2
            && h.iter()
                .all(|h| h["state"] == "up" && h["capacity"]["mem_bytes"] == 240 << 20)
    });
    // Small workloads for the verifiers; the serial socket takes one client at a time.
    for (name, host) in VMS.iter().zip(51..) {
        drop(start_domain(
            &t,
            &rt,
            (name, host, false, ""),
            &["mem start mib=8 pattern=ws rate=0.5 hot=2"],
        ));
    }
    // The controller knows a VM once its host's agent has listed it (every 2-3 s).
    wait_for(&t, "vms", |v| v.iter().any(|vm| vm["name"] == "ov4"));
    common::succeeded(
        "ferry fleet migrate",
        &fleet(&t, &["migrate", "ov4", "--to-site", "b"]),
    );
    wait_for(&t, "vms", |v| {
        host_of(v, "ov4").as_deref() == Some("site-b")
            && VMS.iter().all(|n| {
                v.iter()
                    .any(|vm| vm["name"] == *n && !vm["usage"]["used_bytes"].is_null())
            })
    });
    // Each guest's agent answers (a guest swaps only through it), and the hosts are calm.
    for (name, site) in [
        ("ov1", Site::A),
        ("ov2", Site::A),
        ("ov3", Site::A),
        ("ov4", Site::B),
    ] {
        common::fleet::wait_until(&format!("{name}'s guest agent"), || {
            t.virsh(
                site,
                &["qemu-agent-command", name, r#"{"execute":"guest-ping"}"#],
            )
            .status
            .success()
        });
    }
    let calm = plan_until(
        &t,
        "both hosts sampled, neither overloaded within the detector's window",
        Duration::from_secs(90),
        |p| {
            // A sample over while the guests booted would count towards the first burst's 8.
            ["site-a", "site-b"].iter().all(|h| {
                let pressure = pressure_of(p, h);
                pressure["pressure"] == "normal" && pressure["overloaded_in_window"] == 0
            })
        },
    );
    eprintln!("calm: {}", calm["pressure"]);
    assert_eq!(calm["swaps"], serde_json::json!([]), "{calm}");
    for name in VMS {
        let vms = fleet_json(&t, "vms");
        eprintln!(
            "{name}: {}",
            vms.iter().find(|v| v["name"] == name).unwrap()["usage"]
        );
    }
    let migrations_before = fleet_json(&t, "migrations").len();

    // A short burst: 48 MiB in ov1, read over for 3 s. Site a goes over (3 x 69 MiB + 48 MiB
    // of 240), and ov1, using the most, swaps to site b (sustained would take 8 samples of 3 s
    // over). Paging its burst in and out under TCG stretches it to some 15-25 s: a burst held
    // for 8 s once reached 8 samples.
    guest_call(&t, &rt, Site::A, "ov1", "burst start mib=48 secs=3");
    let swapping = plan_until(&t, "a swap for site a", Duration::from_secs(60), |p| {
        p["swaps"].as_array().is_some_and(|s| !s.is_empty())
    });
    eprintln!("swapping: {swapping}");
    let swap = &swapping["swaps"][0];
    assert_eq!(swap["host"], "site-a", "{swapping}");
    assert_eq!(swap["peer"], "site-b", "{swapping}");
    assert_eq!(swap["domain"], "ov1", "{swapping}");
    let swapper = "ov1";
    common::fleet::wait_until("the agent takes the swap", || {
        swaps_at_a(&t).iter().any(|s| s["domain"] == swapper)
    });
    // The burst ends; the overload is over three quiet samples later, and the swap goes back.
    let deadline = Instant::now() + Duration::from_secs(120);
    while burst(&t, &rt, Site::A, "ov1").fields["state"] != "done" {
        assert!(Instant::now() < deadline, "the burst never ended");
        std::thread::sleep(Duration::from_secs(1));
    }
    let b = burst(&t, &rt, Site::A, "ov1");
    assert_eq!(b.u64("corrupt").unwrap(), 0, "{}", b.text);
    assert!(b.u64("checked").unwrap() == 48 * 256, "{}", b.text);
    plan_until(&t, "the swap given back", Duration::from_secs(60), |p| {
        p["swaps"].as_array().is_some_and(Vec::is_empty)
    });
    common::fleet::wait_until("the agent gives the swap back", || {
        swaps_at_a(&t).is_empty()
    });
    // Given back because the overload is over, not to make way for a migration (that would
    // be requested before the host reads normal again).
    plan_until(&t, "site a normal", Duration::from_secs(60), |p| {
        pressure_of(p, "site-a")["pressure"] == "normal"
    });
    assert_eq!(
        fleet_json(&t, "migrations").len(),
        migrations_before,
        "a transient overload migrated"
    );
    for name in &VMS[..3] {
        assert_eq!(verify(&t, &rt, Site::A, name, false), 0, "{name}");
    }

    // A burst that lasts: the swap first, then (8 of 12 samples over) a migration. It starts
    // once the first burst's samples have left the detector's window, or they would count
    // towards the 8 and the second could be sustained from its first sample.
    plan_until(
        &t,
        "the first burst out of site a's window",
        Duration::from_secs(120),
        |p| {
            assert_eq!(
                fleet_json(&t, "migrations").len(),
                migrations_before,
                "a transient overload migrated after it ended: {p}\n{}",
                migrations_in_brief(&t)
            );
            pressure_of(p, "site-a")["overloaded_in_window"] == 0
        },
    );
    guest_call(&t, &rt, Site::A, "ov2", "burst start mib=48 secs=600");
    let started = Instant::now();
    plan_until(
        &t,
        "a swap for site a again",
        Duration::from_secs(60),
        |p| p["swaps"].as_array().is_some_and(|s| !s.is_empty()),
    );
    let moved = loop {
        let migrations = fleet_json(&t, "migrations");
        if migrations.len() > migrations_before {
            let m = migrations.last().unwrap().clone();
            assert_eq!(m["requested_by"], "overload", "{m}");
            break m;
        }
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "no migration for a lasting overload: {}",
            plan(&t)
        );
        std::thread::sleep(Duration::from_secs(1));
    };
    eprintln!("moved: {moved}");
    let id = moved["id"].as_str().unwrap();
    common::succeeded("ferry fleet watch", &fleet(&t, &["watch", id]));
    let vm = moved["vm"].as_str().unwrap().to_owned();
    assert_eq!(moved["destination_host"], "site-b", "{moved}");
    assert!(
        swaps_at_a(&t).is_empty(),
        "the swap went back before the move"
    );
    assert_eq!(verify(&t, &rt, Site::B, &vm, false), 0, "{vm} at site b");
    let at_b = if vm == "ov2" { Site::B } else { Site::A };
    let b = burst(&t, &rt, at_b, "ov2");
    assert_eq!(b.fields["state"], "running", "{}", b.text);
    plan_until(
        &t,
        "site a no longer overloaded",
        Duration::from_secs(60),
        |p| pressure_of(p, "site-a")["pressure"] == "normal",
    );
}
