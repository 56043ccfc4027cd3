//! The fleet controller with the lab (`lab up --libvirt --controller`): the controller runs
//! at site a, both sites' agents heartbeat to it across the WAN, and `ferry fleet` drives it.
//! It learns where a libvirt domain runs, moves it through the source agent (libvirt's own
//! migration, carried by the agents), follows it to the commit and then finds it at site b;
//! the guest's verifiers decide whether its memory arrived intact. A host whose agent stops
//! is marked down and gets no migration.

mod common;

use std::time::{Duration, Instant};

use common::domains::{start_domain, verify};
use common::fleet::{fleet, fleet_json, host_of, wait_for, LAB};
use common::TestLab;
use ferry_lab::Site;

#[test]
fn the_controller_moves_a_libvirt_domain_and_knows_where_it_runs() {
    let t = TestLab::up("fleet", LAB);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let hosts = wait_for(&t, "hosts", |h| {
        h.len() == 2 && h.iter().all(|h| h["state"] == "up")
    });
    assert_eq!(hosts[0]["site"], "a", "{hosts:?}");
    let _link = start_domain(
        &t,
        &rt,
        ("fleet1", 21, false, ""),
        &["mem start pattern=ws mib=32 rate=1"],
    );
    // Placed, and its use reported: the request prices the move from that use (`planned`).
    wait_for(&t, "vms", |v| {
        host_of(v, "fleet1").as_deref() == Some("site-a")
            && v.iter()
                .any(|vm| vm["name"] == "fleet1" && !vm["usage"].is_null())
    });

    // Bad requests are refused in the controller's words, and nothing moves.
    let out = fleet(&t, &["migrate", "nope", "--to-site", "b"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no VM \"nope\" in the fleet"));
    let out = fleet(&t, &["migrate", "fleet1", "--to", "site-a"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("fleet1 already runs on site-a"));
    let out = fleet(
        &t,
        &["migrate", "fleet1", "--to-site", "b", "--connections", "65"],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");

    // To site b: the controller picks site-b, the leader schedules it, site a's agent runs it
    // at its next heartbeat. The controller is killed and restarted while it runs: it picks
    // the migration up from its store and the agent's reports, and `watch` follows it to the
    // commit.
    let out = common::succeeded(
        "ferry fleet migrate",
        &fleet(&t, &["migrate", "fleet1", "--to-site", "b", "--no-wait"]),
    );
    assert!(out.contains("site-a -> site-b"), "{out}");
    let id = out.split_whitespace().next().unwrap().to_owned();
    wait_for(&t, "migrations", |m| m[0]["state"] == "running");
    ferry_lab::controller::kill(&t.lab, Site::A).unwrap();
    let store = ferry_lab::controller::sqlite_database(&t.lab);
    ferry_lab::controller::start(
        &t.lab,
        std::path::Path::new(common::ferry_bin()),
        Site::A,
        store.to_str().unwrap(),
        &t.lab.state().unwrap().link,
        None,
    )
    .unwrap();
    let out = common::succeeded("ferry fleet watch", &fleet(&t, &["watch", &id]));
    assert!(out.lines().last().unwrap().contains("committed"), "{out}");
    assert_eq!(t.domstate(Site::B, "fleet1").as_deref(), Some("running"));
    assert_eq!(t.domstate(Site::A, "fleet1"), None);
    assert_eq!(verify(&t, &rt, Site::B, "fleet1", false), 0);

    let migrations = fleet_json(&t, "migrations");
    assert_eq!(migrations.len(), 1, "{migrations:?}");
    let m = &migrations[0];
    assert_eq!(m["state"], "committed", "{m}");
    let states: Vec<&str> = m["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        states,
        ["requested", "scheduled", "running", "committed"],
        "{m}"
    );
    assert_eq!(m["agent"]["state"], "committed", "{m}");
    assert!(
        m["agent"]["digest"].as_str().is_some_and(|d| d.len() == 64),
        "{m}"
    );
    // The request recorded what the cost model priced it from (the lab's 1 Gbit/s, 10 ms
    // link from the controller's [policy]) and what it predicted; the committed migration is
    // then one of the fit's samples, or left out with its reason.
    let planned = &m["planned"];
    assert_eq!(planned["link_bits_per_s"], 1_000_000_000_u64, "{m}");
    assert_eq!(planned["rtt_us"], 10_000, "{m}");
    for figure in ["mem_bytes", "predicted_ms", "predicted_wan_bytes"] {
        assert!(planned[figure].as_u64().is_some_and(|v| v > 0), "{m}");
    }
    let models = fleet_json(&t, "cost-model");
    let libvirt = models.iter().find(|c| c["kind"] == "libvirt").unwrap();
    assert_eq!(libvirt["source"], "built-in", "{libvirt}");
    let left_out = libvirt["left_out"].as_array().unwrap().len();
    assert_eq!(
        libvirt["samples"].as_u64().unwrap() + left_out as u64,
        1,
        "{libvirt}"
    );
    // Site a's agent ran it once, under the controller's id.
    let at_a: Vec<_> = t
        .migrations(Site::A)
        .into_iter()
        .filter(|s| s["fleet_id"] == m["id"])
        .collect();
    assert_eq!(at_a.len(), 1, "{at_a:?}");
    wait_for(&t, "vms", |v| {
        host_of(v, "fleet1").as_deref() == Some("site-b")
    });

    // Prometheus's view: the agent's own figures and the fleet's agree on the one commit.
    let agent = metrics(&rt, &t.lab.agent_socket(Site::A));
    assert!(
        agent.contains("ferry_agent_migrations{state=\"committed\"} 1"),
        "{agent}"
    );
    assert!(
        agent.contains("ferry_agent_downtime_seconds_count 1"),
        "{agent}"
    );
    let fleet_metrics = metrics(&rt, &ferry_lab::controller::socket(&t.lab, Site::A));
    for line in [
        "ferry_fleet_hosts{state=\"up\"} 2",
        "ferry_fleet_migrations{state=\"committed\"} 1",
        "ferry_fleet_agent_downtime_seconds_count 1",
    ] {
        assert!(
            fleet_metrics.contains(line),
            "{line} not in {fleet_metrics}"
        );
    }

    // Site a's agent stops: the controller marks it down, and a move there is refused.
    ferry_lab::agents::kill(&t.lab, Site::A).unwrap();
    wait_for(&t, "hosts", |h| {
        h.iter()
            .any(|h| h["name"] == "site-a" && h["state"] == "down")
    });
    let out = fleet(&t, &["migrate", "fleet1", "--to", "site-a"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("host site-a is down"),
        "{out:?}"
    );
    assert_eq!(t.domstate(Site::B, "fleet1").as_deref(), Some("running"));
}

/// `GET /metrics` through a unix socket (an agent's API, a controller's).
fn metrics(rt: &tokio::runtime::Runtime, socket: &std::path::Path) -> String {
    rt.block_on(async {
        let stream = tokio::net::UnixStream::connect(socket).await.unwrap();
        let (status, body) =
            ferry_controller::client::exchange_raw(stream, "GET", "/metrics", None)
                .await
                .unwrap();
        assert_eq!(status, 200);
        String::from_utf8(body.to_vec()).unwrap()
    })
}

/// `ferry fleet ARGS` against the controller at `site`.
fn fleet_at(t: &TestLab, site: Site, args: &[&str]) -> std::process::Output {
    let socket = ferry_lab::controller::socket(&t.lab, site);
    let mut all = vec!["fleet", "--controller", socket.to_str().unwrap()];
    all.extend_from_slice(args);
    t.run(&all)
}

fn leader(t: &TestLab, site: Site) -> Option<String> {
    let out = common::succeeded("fleet status", &fleet_at(t, site, &["status", "--json"]));
    common::json(&out)["leader"].as_str().map(str::to_owned)
}

#[test]
fn a_second_controller_takes_over_a_migration_when_the_leader_dies() {
    // Two controllers, one at each site, sharing the lab's PostgreSQL at site a.
    let t = TestLab::up(
        "fleetpg",
        &[
            "--libvirt",
            "--controller",
            "--postgres",
            "--rate-mbit",
            "100",
            "--rtt-ms",
            "20",
        ],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(leader(&t, Site::B).as_deref(), Some("controller-a"));
    let _link = start_domain(
        &t,
        &rt,
        ("fleet2", 22, false, ""),
        &["mem start pattern=ws mib=32 rate=1"],
    );
    wait_for(&t, "vms", |v| {
        host_of(v, "fleet2").as_deref() == Some("site-a")
    });

    // Asked of the controller that does not lead; the leader schedules it, site a's agent
    // starts it; then the leader dies.
    let out = common::succeeded(
        "ferry fleet migrate",
        &fleet_at(
            &t,
            Site::B,
            &["migrate", "fleet2", "--to-site", "b", "--no-wait"],
        ),
    );
    let id = out.split_whitespace().next().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = common::succeeded(
            "fleet watch",
            &fleet_at(&t, Site::B, &["migrations", "--json"]),
        );
        let m = common::json(&out)[0].clone();
        if m["state"] == "running" {
            break;
        }
        assert!(Instant::now() < deadline, "never running: {m}");
        std::thread::sleep(Duration::from_millis(100));
    }
    ferry_lab::controller::kill(&t.lab, Site::A).unwrap();

    // The agents turn to controller-b, which takes the lease once it runs out and records
    // the migration to its end: committed once, by the one agent run.
    let out = fleet_at(&t, Site::B, &["watch", &id]);
    let text = common::succeeded("ferry fleet watch", &out);
    assert!(text.lines().last().unwrap().contains("committed"), "{text}");
    assert_eq!(t.domstate(Site::B, "fleet2").as_deref(), Some("running"));
    assert_eq!(t.domstate(Site::A, "fleet2"), None);
    assert_eq!(verify(&t, &rt, Site::B, "fleet2", false), 0);
    let runs: Vec<_> = t
        .migrations(Site::A)
        .into_iter()
        .filter(|s| s["fleet_id"] == id.as_str())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let out = common::succeeded(
        "fleet migrations",
        &fleet_at(&t, Site::B, &["migrations", "--json"]),
    );
    let m = common::json(&out)[0].clone();
    let by: Vec<&str> = m["timeline"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["controller"].as_str().unwrap())
        .collect();
    assert_eq!(by.first(), Some(&"controller-b"), "{m}");
    assert_eq!(by.last(), Some(&"controller-b"), "{m}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while leader(&t, Site::B).as_deref() != Some("controller-b") {
        assert!(
            Instant::now() < deadline,
            "controller-b never took the lease"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // A second migration, asked of the survivor alone, is scheduled by it.
    let out = fleet_at(&t, Site::B, &["migrate", "fleet2", "--to-site", "a"]);
    let text = common::succeeded("ferry fleet migrate back", &out);
    assert!(text.lines().last().unwrap().contains("committed"), "{text}");
    assert_eq!(verify(&t, &rt, Site::A, "fleet2", false), 0);

    // The database goes away: the controller refuses changes and says why; the VM stays.
    ferry_lab::postgres::stop(&t.lab).unwrap();
    let out = fleet_at(&t, Site::B, &["migrate", "fleet2", "--to-site", "b"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("store"), "{err}");
    assert_eq!(t.domstate(Site::A, "fleet2").as_deref(), Some("running"));
}
