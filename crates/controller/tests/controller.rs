//! The controller in-process, without root: its API over real mutual TLS on loopback and its
//! local socket, a SQLite store in a temporary directory, and tests playing the agents (their
//! heartbeats, reports and refusals) and the operators.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::agent::{ApiError, ErrorKind, MigrationState, MigrationStatus, Phase};
use ferry_api::fleet::{
    FleetMigrationReport, FleetMigrationRequest, FleetMigrationState, GroupState, Heartbeat,
    HostState, OverlayReport, PoolRequest, VmKind, VmNic, VmReport,
};
use ferry_api::settings::MigrationSettings;
use ferry_controller::client::{ControllerClient, ControllerRefused, Endpoint};
use ferry_controller::config::ControllerConfig;
use ferry_controller::fleet::Controller;
use ferry_controller::store::Store;
use tokio::net::{TcpListener, UnixListener};

struct Fleet {
    _dir: tempfile::TempDir,
    pki: std::path::PathBuf,
    address: String,
    /// The read-only HTTP listener (dashboard, views, metrics).
    http_address: String,
    socket: std::path::PathBuf,
    controller: Arc<Controller>,
}

impl Fleet {
    /// A controller named ctl1 with operator ops1; certificates for hosts a1, a2 (site a), b1
    /// (site b) and the operator.
    async fn start(extra_config: &str) -> Fleet {
        let dir = tempfile::tempdir().unwrap();
        let pki = dir.path().join("pki");
        ferry_agent::pki::init(&pki, "test").unwrap();
        for name in ["ctl1", "ops1", "a1", "a2", "b1"] {
            ferry_agent::pki::issue(&pki, name).unwrap();
        }
        let socket = dir.path().join("controller.sock");
        let text = format!(
            "name = \"ctl1\"\nlisten = \"127.0.0.1:0\"\napi_socket = {:?}\ndatabase = {:?}\noperators = [\"ops1\"]\n{extra_config}\n[tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
            socket.display().to_string(),
            dir.path().join("fleet.db").display().to_string(),
            pki.join("ca.pem").display().to_string(),
            pki.join("ctl1.pem").display().to_string(),
            pki.join("ctl1.key").display().to_string(),
        );
        let config = ControllerConfig::parse(&text, Path::new("test.toml")).unwrap();
        let store = Store::open(&config.database).await.unwrap();
        let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = tcp.local_addr().unwrap().to_string();
        let local = UnixListener::bind(&socket).unwrap();
        let controller = Arc::new(Controller::new(config, store));
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http_address = http.local_addr().unwrap().to_string();
        tokio::spawn(ferry_controller::serve::serve(
            controller.clone(),
            tcp,
            local,
            Some(http),
        ));
        Fleet {
            _dir: dir,
            pki,
            address,
            http_address,
            socket,
            controller,
        }
    }

    /// A client presenting `name`'s certificate.
    fn as_(&self, name: &str) -> ControllerClient {
        let id = ferry_agent::pki::identity(&self.pki, name);
        ControllerClient::new(Endpoint::Tls {
            address: self.address.clone(),
            server_name: "ctl1".into(),
            tls: id.client_config().unwrap(),
        })
    }

    fn local(&self) -> ControllerClient {
        ControllerClient::new(Endpoint::Local(self.socket.clone()))
    }
}

fn beat(site: &str, peers: &[&str], vms: &[&str]) -> Heartbeat {
    Heartbeat {
        site: site.into(),
        version: "test".into(),
        peer_listen: "127.0.0.1:7070".into(),
        peers: peers.iter().map(|p| (*p).into()).collect(),
        max_outgoing: 1,
        vms: vms
            .iter()
            .map(|n| VmReport {
                name: (*n).into(),
                kind: VmKind::Libvirt,
                state: "running".into(),
                usage: None,
                nics: vec![],
            })
            .collect(),
        migrations: vec![],
        overlay: None,
        vms_listed_unix_ms: None,
        wait_ms: None,
        capacity: None,
        swaps: vec![],
    }
}

/// A heartbeat from a host with an overlay at `address`, pools `ready` up, and VMs each with
/// one NIC on a bridge: (name, MAC, bridge).
fn overlay_beat(
    site: &str,
    peers: &[&str],
    address: &str,
    ready: &[&str],
    vms: &[(&str, &str, &str)],
) -> Heartbeat {
    let mut b = beat(site, peers, &[]);
    b.vms = vms
        .iter()
        .map(|(name, mac, bridge)| VmReport {
            name: (*name).into(),
            kind: VmKind::Libvirt,
            state: "running".into(),
            usage: None,
            nics: vec![VmNic {
                mac: (*mac).into(),
                bridge: (*bridge).into(),
            }],
        })
        .collect();
    b.overlay = Some(OverlayReport {
        address: address.into(),
        ready: ready.iter().map(|r| (*r).to_string()).collect(),
    });
    b
}

fn pool_request(name: &str, vni: u32, hold: &[&str]) -> PoolRequest {
    PoolRequest {
        name: name.into(),
        vni,
        bridge: None,
        learning: false,
        no_repoint: false,
        hold: hold.iter().map(|h| (*h).to_string()).collect(),
    }
}

fn request(vm: &str, to: Option<&str>, to_site: Option<&str>) -> FleetMigrationRequest {
    FleetMigrationRequest {
        vm: vm.into(),
        to: to.map(Into::into),
        to_site: to_site.map(Into::into),
        copy_storage: false,
        settings: MigrationSettings::default(),
    }
}

fn refusal(e: anyhow::Error) -> (Option<ErrorKind>, String) {
    let r = e
        .downcast::<ControllerRefused>()
        .unwrap_or_else(|e| panic!("not a refusal: {e:#}"));
    (r.kind, r.message)
}

fn agent_status(id: &str, vm: &str, state: MigrationState) -> MigrationStatus {
    MigrationStatus {
        state,
        error: (state == MigrationState::Failed).then(|| "libvirt: it broke".into()),
        ..MigrationStatus::starting(id.into(), vm.into(), 1)
    }
}

#[tokio::test]
async fn a_migration_goes_from_request_to_commit_through_heartbeats() {
    let fleet = Fleet::start("").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    a1.heartbeat(&beat("a", &["b1"], &["vm1", "vm2"]))
        .await
        .unwrap();
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();
    let sites = fleet.local().sites().await.unwrap();
    assert_eq!(
        sites
            .iter()
            .map(|s| (s.name.as_str(), s.vms))
            .collect::<Vec<_>>(),
        vec![("a", 2), ("b", 0)]
    );

    // A host may read but not change the fleet; an operator may.
    let (kind, message) = refusal(
        b1.migrate(&request("vm1", None, Some("b")))
            .await
            .unwrap_err(),
    );
    assert_eq!(kind, None);
    assert!(message.contains("b1 may read but not change"), "{message}");
    let m = ops.migrate(&request("vm1", None, Some("b"))).await.unwrap();
    assert_eq!(
        (
            m.state,
            m.source_host.as_str(),
            m.destination_host.as_str(),
            m.requested_by.as_str()
        ),
        (FleetMigrationState::Requested, "a1", "b1", "ops1")
    );
    // One migration per VM at a time.
    let (kind, message) = refusal(
        ops.migrate(&request("vm1", Some("b1"), None))
            .await
            .unwrap_err(),
    );
    assert_eq!(kind, Some(ErrorKind::Conflict), "{message}");

    // The leader schedules it; the source's next heartbeat carries it, and only the source's.
    fleet.controller.lead().await.unwrap();
    assert!(b1
        .heartbeat(&beat("b", &["a1"], &[]))
        .await
        .unwrap()
        .start
        .is_empty());
    let answer = a1
        .heartbeat(&beat("a", &["b1"], &["vm1", "vm2"]))
        .await
        .unwrap();
    assert_eq!(answer.start.len(), 1);
    assert_eq!(
        (answer.start[0].vm.as_str(), answer.start[0].to.as_str()),
        ("vm1", "b1")
    );
    assert_eq!(answer.start[0].fleet_id, m.id);
    // Handed over, it is tracked: the agent reports it even if it fails before it reported it
    // running.
    assert_eq!(answer.track, vec![m.id.clone()]);

    // The host's limit is one outgoing migration: vm2's waits while vm1's runs.
    let m2 = ops
        .migrate(&request("vm2", Some("b1"), None))
        .await
        .unwrap();
    let mut running = beat("a", &["b1"], &["vm1", "vm2"]);
    running.migrations = vec![FleetMigrationReport {
        fleet_id: m.id.clone(),
        status: Some(agent_status("ag1", "vm1", MigrationState::Running)),
        refused: None,
    }];
    let answer = a1.heartbeat(&running).await.unwrap();
    assert!(answer.start.is_empty(), "{answer:?}");
    // The agent is to report it until its end is known.
    assert_eq!(answer.track, vec![m.id.clone()]);
    fleet.controller.lead().await.unwrap();
    assert_eq!(
        ops.migration(&m2.id).await.unwrap().state,
        FleetMigrationState::Requested
    );
    assert_eq!(
        ops.migration(&m.id).await.unwrap().state,
        FleetMigrationState::Running
    );

    // The agent commits; the controller records it, and the VM is then where b1 says.
    let mut done = beat("a", &["b1"], &["vm2"]);
    done.migrations = vec![FleetMigrationReport {
        fleet_id: m.id.clone(),
        status: Some(agent_status("ag1", "vm1", MigrationState::Committed)),
        refused: None,
    }];
    assert!(a1.heartbeat(&done).await.unwrap().track.is_empty());
    b1.heartbeat(&beat("b", &["a1"], &["vm1"])).await.unwrap();
    let m = fleet.local().migration(&m.id).await.unwrap();
    assert_eq!(m.state, FleetMigrationState::Committed);
    assert!(m.finished_unix_ms.is_some());
    assert_eq!(
        m.timeline.iter().map(|e| e.state).collect::<Vec<_>>(),
        vec![
            FleetMigrationState::Requested,
            FleetMigrationState::Scheduled,
            FleetMigrationState::Running,
            FleetMigrationState::Committed
        ]
    );
    assert_eq!(m.agent.unwrap().id, "ag1");
    let vms = fleet.local().vms().await.unwrap();
    assert_eq!(
        vms.iter()
            .map(|v| (v.name.as_str(), v.host.as_str()))
            .collect::<Vec<_>>(),
        vec![("vm1", "b1"), ("vm2", "a1")]
    );

    // Now vm2's is scheduled; the agent refuses it and says why.
    fleet.controller.lead().await.unwrap();
    let answer = a1.heartbeat(&beat("a", &["b1"], &["vm2"])).await.unwrap();
    assert_eq!(answer.start[0].fleet_id, m2.id);
    let mut refused = beat("a", &["b1"], &["vm2"]);
    refused.migrations = vec![FleetMigrationReport {
        fleet_id: m2.id.clone(),
        status: None,
        refused: Some(ApiError {
            error: "libvirt: domain vm2 is not running".into(),
            kind: Some(ErrorKind::Conflict),
        }),
    }];
    a1.heartbeat(&refused).await.unwrap();
    let m2 = ops.migration(&m2.id).await.unwrap();
    assert_eq!(m2.state, FleetMigrationState::Failed);
    assert!(
        m2.error
            .as_deref()
            .unwrap()
            .contains("a1's agent refused it: libvirt: domain vm2 is not running"),
        "{m2:?}"
    );
}

fn group_request(vms: &[&str]) -> ferry_api::fleet::FleetGroupRequest {
    ferry_api::fleet::FleetGroupRequest {
        vms: vms.iter().map(|v| (*v).into()).collect(),
        to: None,
        to_site: Some("b".into()),
        copy_storage: false,
        settings: MigrationSettings::default(),
    }
}

/// Host a1's heartbeat (two outgoing at most) reporting its group members at `phase` and
/// QEMU's pass `iteration`, or failed.
fn members_beat(reports: &[(&str, Phase, u64)]) -> Heartbeat {
    let mut b = beat("a", &["b1"], &["web", "db", "cache"]);
    b.max_outgoing = 2;
    b.migrations = reports
        .iter()
        .map(|(id, phase, iteration)| {
            let state = if *phase == Phase::Failed {
                MigrationState::Failed
            } else {
                MigrationState::Running
            };
            let mut status = agent_status(id, "vm", state);
            status.phase = *phase;
            status.qemu.iteration = *iteration;
            FleetMigrationReport {
                fleet_id: (*id).into(),
                status: Some(status),
                refused: None,
            }
        })
        .collect();
    b
}

/// `b` with QEMU's expected pause (ms) of each member named.
fn expecting(mut b: Heartbeat, pauses: &[(&str, u64)]) -> Heartbeat {
    for report in &mut b.migrations {
        if let Some((_, ms)) = pauses.iter().find(|(id, _)| *id == report.fleet_id) {
            report.status.as_mut().unwrap().qemu.expected_downtime_ms = Some(*ms);
        }
    }
    b
}

#[tokio::test]
async fn a_group_ends_its_passes_together_and_is_released_when_every_member_holds() {
    let fleet = Fleet::start("").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    a1.heartbeat(&members_beat(&[])).await.unwrap();
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();

    // Over the limits, or not a group: refused before anything is stored.
    for (vms, why) in [
        (&["web", "db", "cache"][..], "limits.per_site_pair"),
        (&["web"][..], "2 to 16 VMs"),
        (&["web", "web"][..], "web is named twice"),
        (&["web", "nope"][..], "no VM \"nope\""),
    ] {
        let (_, message) = refusal(ops.migrate_group(&group_request(vms)).await.unwrap_err());
        assert!(message.contains(why), "{vms:?}: {message}");
    }
    assert!(ops.groups().await.unwrap().is_empty());
    assert!(ops.migrations().await.unwrap().is_empty());

    let group = ops
        .migrate_group(&group_request(&["web", "db"]))
        .await
        .unwrap();
    assert_eq!(group.state, GroupState::Open);
    let ids: Vec<String> = group.members.iter().map(|m| m.id.clone()).collect();
    let (web, db) = (ids[0].as_str(), ids[1].as_str());
    // Scheduled together, handed over with their group.
    fleet.controller.lead().await.unwrap();
    let answer = a1.heartbeat(&members_beat(&[])).await.unwrap();
    assert_eq!(answer.start.len(), 2, "{answer:?}");
    assert!(answer
        .start
        .iter()
        .all(|w| w.group.as_ref() == Some(&group.id)));

    // No go until both did a first pass and could stop within their target (300 ms).
    let answer = a1
        .heartbeat(&expecting(
            members_beat(&[(web, Phase::Memory, 2), (db, Phase::DiskCopy, 0)]),
            &[(web, 100)],
        ))
        .await
        .unwrap();
    assert_eq!(answer.groups.len(), 2);
    assert!(
        answer.groups.iter().all(|g| !g.go && !g.release),
        "{answer:?}"
    );
    let answer = a1
        .heartbeat(&expecting(
            members_beat(&[(web, Phase::Memory, 3), (db, Phase::Memory, 2)]),
            &[(web, 100), (db, 2_000)],
        ))
        .await
        .unwrap();
    assert!(answer.groups.iter().all(|g| !g.go), "{answer:?}");
    let answer = a1
        .heartbeat(&expecting(
            members_beat(&[(web, Phase::Memory, 3), (db, Phase::Memory, 3)]),
            &[(web, 100), (db, 250)],
        ))
        .await
        .unwrap();
    assert!(
        answer.groups.iter().all(|g| g.go && !g.release),
        "{answer:?}"
    );

    // web holds: its long-polled heartbeat comes back undecided after its wait...
    let mut held = members_beat(&[(web, Phase::Held, 4), (db, Phase::Memory, 3)]);
    held.wait_ms = Some(200);
    let asked = std::time::Instant::now();
    let answer = a1.heartbeat(&held).await.unwrap();
    assert!(asked.elapsed() >= Duration::from_millis(200));
    assert!(answer
        .groups
        .iter()
        .all(|g| !g.release && g.abort.is_none()));
    assert!(ops.migration(web).await.unwrap().held_unix_ms.is_some());
    // ... and, waiting again, learns the release as soon as db holds too.
    held.wait_ms = Some(5_000);
    let waiting = tokio::spawn({
        let a1 = fleet.as_("a1");
        async move { a1.heartbeat(&held).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished());
    let both = members_beat(&[(web, Phase::Held, 4), (db, Phase::Held, 4)]);
    let answer = a1.heartbeat(&both).await.unwrap();
    assert!(answer.groups.iter().all(|g| g.release), "{answer:?}");
    let answer = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("the waiting heartbeat answers once the group is released")
        .unwrap();
    assert!(answer.groups.iter().all(|g| g.release), "{answer:?}");
    let group = ops.group(&group.id).await.unwrap();
    assert_eq!(group.state, GroupState::Released);
    assert!(group.decided_unix_ms.is_some());
}

#[tokio::test]
async fn a_member_that_fails_aborts_its_group_and_no_member_is_left_to_go() {
    let fleet = Fleet::start("").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    a1.heartbeat(&members_beat(&[])).await.unwrap();
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();
    let group = ops
        .migrate_group(&group_request(&["web", "db"]))
        .await
        .unwrap();
    let (web, db) = (group.members[0].id.clone(), group.members[1].id.clone());
    fleet.controller.lead().await.unwrap();
    a1.heartbeat(&members_beat(&[])).await.unwrap();
    // web holds; db fails (its agent says why): the group is aborted, web told so.
    let answer = a1
        .heartbeat(&members_beat(&[
            (&web, Phase::Held, 3),
            (&db, Phase::Failed, 1),
        ]))
        .await
        .unwrap();
    let web_signal = answer.groups.iter().find(|g| g.fleet_id == web).unwrap();
    let reason = web_signal.abort.as_deref().expect("aborted");
    assert!(reason.contains("db failed: libvirt: it broke"), "{reason}");
    assert!(!web_signal.release);
    let group = ops.group(&group.id).await.unwrap();
    assert_eq!(group.state, GroupState::Aborted);

    // A group whose member is cancelled before it was handed over: the others fail too,
    // and none starts.
    let group = ops
        .migrate_group(&group_request(&["db", "cache"]))
        .await
        .unwrap();
    ops.cancel(&group.members[0].id).await.unwrap();
    fleet.controller.lead().await.unwrap();
    let group = ops.group(&group.id).await.unwrap();
    assert_eq!(group.state, GroupState::Aborted);
    assert!(
        group
            .reason
            .as_deref()
            .unwrap()
            .contains("cancelled by ops1"),
        "{group:?}"
    );
    let cache = &group.members[1];
    assert_eq!(cache.state, FleetMigrationState::Failed);
    assert!(
        cache.error.as_deref().unwrap().contains("was aborted"),
        "{cache:?}"
    );
    assert!(a1
        .heartbeat(&members_beat(&[]))
        .await
        .unwrap()
        .start
        .is_empty());
}

#[tokio::test]
async fn a_running_migration_its_restarted_agent_forgot_fails_with_that_reason() {
    let fleet = Fleet::start("").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    a1.heartbeat(&beat("a", &["b1"], &["vm1"])).await.unwrap();
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();
    let m = ops
        .migrate(&request("vm1", Some("b1"), None))
        .await
        .unwrap();
    fleet.controller.lead().await.unwrap();
    let mut running = beat("a", &["b1"], &["vm1"]);
    running.migrations = vec![FleetMigrationReport {
        fleet_id: m.id.clone(),
        status: Some(agent_status("ag1", "vm1", MigrationState::Running)),
        refused: None,
    }];
    a1.heartbeat(&running).await.unwrap();
    // The agent restarts: its first heartbeat knows nothing of it.
    a1.heartbeat(&beat("a", &["b1"], &["vm1"])).await.unwrap();
    let m = ops.migration(&m.id).await.unwrap();
    assert_eq!(m.state, FleetMigrationState::Failed);
    assert!(m
        .error
        .unwrap()
        .contains("a1's agent no longer knows this migration"));
}

#[tokio::test]
async fn bad_requests_are_refused_with_what_was_wrong() {
    let fleet = Fleet::start("").await;
    let (a1, a2, ops) = (fleet.as_("a1"), fleet.as_("a2"), fleet.as_("ops1"));
    a1.heartbeat(&beat("a", &["b1"], &["vm1"])).await.unwrap();
    a2.heartbeat(&beat("a", &[], &[])).await.unwrap();
    let cases = [
        (
            request("nope", Some("a2"), None),
            ErrorKind::NotFound,
            "no VM \"nope\" in the fleet",
        ),
        (
            request("vm1", Some("zz"), None),
            ErrorKind::NotFound,
            "no host \"zz\" in the fleet",
        ),
        (
            request("vm1", Some("a2"), None),
            ErrorKind::BadRequest,
            "a1's agent has no peer a2 in its config (its peers: b1)",
        ),
        (
            request("vm1", Some("a1"), None),
            ErrorKind::Conflict,
            "vm1 already runs on a1",
        ),
        (
            request("vm1", None, None),
            ErrorKind::BadRequest,
            "no destination",
        ),
        (
            request("vm1", Some("a2"), Some("a")),
            ErrorKind::BadRequest,
            "not both",
        ),
        (
            request("vm1", None, Some("mars")),
            ErrorKind::NotFound,
            "no site \"mars\"",
        ),
    ];
    for (req, kind, text) in cases {
        let (got, message) = refusal(ops.migrate(&req).await.unwrap_err());
        assert_eq!(got, Some(kind), "{message}");
        assert!(message.contains(text), "{message} (wanted {text})");
    }
    let (status, body) = ops
        .raw(
            "POST",
            "/v1/migrations",
            Some(br#"{"vm": "vm1", "to": "b1", "downtime_ms": 100}"#.to_vec()),
        )
        .await
        .unwrap();
    assert_eq!(status, 400);
    let unknown: ApiError = serde_json::from_slice(&body).unwrap();
    let (too_large, _) = ops
        .raw(
            "POST",
            "/v1/migrations",
            Some(vec![b' '; ferry_controller::api::MAX_BODY_BYTES + 1]),
        )
        .await
        .unwrap();
    assert_eq!(too_large, 413);
    assert_eq!(
        unknown.error,
        "unknown field \"downtime_ms\" in the request"
    );
    let mut bad = request("vm1", Some("a2"), None);
    bad.settings.connections = 65;
    let (kind, message) = refusal(ops.migrate(&bad).await.unwrap_err());
    assert_eq!(kind, Some(ErrorKind::BadRequest));
    assert!(
        message.contains("connections 65 is out of range"),
        "{message}"
    );

    // Operators and controllers do not heartbeat; a malformed body says where it broke.
    let (kind, message) = refusal(ops.heartbeat(&beat("a", &[], &[])).await.unwrap_err());
    assert_eq!(kind, None);
    assert!(message.contains("not a host's"), "{message}");
    let (_, message) = refusal(
        fleet
            .local()
            .heartbeat(&beat("a", &[], &[]))
            .await
            .unwrap_err(),
    );
    assert!(message.contains("over mutual TLS"), "{message}");
    let (kind, message) = refusal(a1.heartbeat(&beat("", &[], &[])).await.unwrap_err());
    assert_eq!(kind, Some(ErrorKind::BadRequest), "{message}");
    let (kind, message) = refusal(ops.cancel("m-none").await.unwrap_err());
    assert_eq!(kind, Some(ErrorKind::NotFound), "{message}");
}

#[tokio::test]
async fn a_silent_host_is_marked_down_and_gets_no_migrations() {
    let fleet = Fleet::start("[timing]\nheartbeat_s = 0.2\nhost_timeout_s = 0.5\n").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    a1.heartbeat(&beat("a", &["b1"], &["vm1"])).await.unwrap();
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();
    // b1 goes silent; a1 keeps beating. The leader (this controller: its own loop runs)
    // marks b1 down.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        a1.heartbeat(&beat("a", &["b1"], &["vm1"])).await.unwrap();
        let hosts = ops.hosts().await.unwrap();
        let b = hosts.iter().find(|h| h.name == "b1").unwrap();
        if b.state == HostState::Down {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "b1 never marked down"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(ops.health().await.unwrap().leader.as_deref(), Some("ctl1"));
    let (kind, message) = refusal(
        ops.migrate(&request("vm1", Some("b1"), None))
            .await
            .unwrap_err(),
    );
    assert_eq!(kind, Some(ErrorKind::Unavailable));
    assert!(message.contains("host b1 is down"), "{message}");
    let (kind, message) = refusal(
        ops.migrate(&request("vm1", None, Some("b")))
            .await
            .unwrap_err(),
    );
    assert_eq!(kind, Some(ErrorKind::Unavailable));
    assert!(message.contains("no host of site b is up"), "{message}");
    // Its next heartbeat brings it back.
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();
    let m = ops
        .migrate(&request("vm1", Some("b1"), None))
        .await
        .unwrap();
    // A cancel before it starts ends it at once.
    let m = ops.cancel(&m.id).await.unwrap();
    assert_eq!(m.state, FleetMigrationState::Failed);
    assert_eq!(m.error.as_deref(), Some("cancelled by ops1"));
}

/// The schema of `path`'s `method` answer with `status` in the OpenAPI document, as a JSON
/// Schema whose references resolve within the document.
fn answer_schema(
    doc: &serde_json::Value,
    path: &str,
    method: &str,
    status: u16,
) -> serde_json::Value {
    let schema = &doc["paths"][path][method]["responses"][status.to_string()]["content"]
        ["application/json"]["schema"];
    assert!(
        !schema.is_null(),
        "the OpenAPI document has no {status} answer for {method} {path}"
    );
    let mut schema = schema.clone();
    schema["components"] = doc["components"].clone();
    schema
}

/// Checks a real answer against the document; panics with every violation.
fn conforms(doc: &serde_json::Value, path: &str, method: &str, status: u16, body: &[u8]) {
    let schema = answer_schema(doc, path, method, status);
    let validator = jsonschema::validator_for(&schema)
        .unwrap_or_else(|e| panic!("{method} {path} {status}: not a schema: {e}"));
    let answer: serde_json::Value = serde_json::from_slice(body).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(&answer)
        .map(|e| format!("{e} at {}", e.instance_path))
        .collect();
    assert!(
        errors.is_empty(),
        "{method} {path} {status} does not match the OpenAPI document: {errors:?}\nanswer: {answer}"
    );
}

#[tokio::test]
async fn every_answer_matches_the_openapi_document() {
    let fleet = Fleet::start("").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    let (status, doc) = ops.raw("GET", "/v1/openapi.json", None).await.unwrap();
    assert_eq!(status, 200);
    let doc: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");

    // A fleet with something in every list: hosts, VMs, a migration running with the agent's
    // full status, another refused.
    a1.heartbeat(&beat("a", &["b1"], &["vm1", "vm2"]))
        .await
        .unwrap();
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();
    let body = serde_json::to_vec(&request("vm1", None, Some("b"))).unwrap();
    let (status, created) = ops
        .raw("POST", "/v1/migrations", Some(body.clone()))
        .await
        .unwrap();
    assert_eq!(status, 201);
    conforms(&doc, "/v1/migrations", "post", 201, &created);
    let m: ferry_api::fleet::FleetMigration = serde_json::from_slice(&created).unwrap();
    fleet.controller.lead().await.unwrap();
    let mut running = beat("a", &["b1"], &["vm1", "vm2"]);
    let mut status_now = agent_status("ag1", "vm1", MigrationState::Running);
    status_now.codec = Some(Default::default());
    status_now.disk = Some(Default::default());
    running.migrations = vec![FleetMigrationReport {
        fleet_id: m.id.clone(),
        status: Some(status_now),
        refused: None,
    }];
    let (status, answer) = a1
        .raw(
            "POST",
            "/v1/agent/heartbeat",
            Some(serde_json::to_vec(&running).unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(status, 200);
    conforms(&doc, "/v1/agent/heartbeat", "post", 200, &answer);

    // Pools: created (201), listed, one shown, held, released, refused (409 taken, 404
    // unknown), deleted.
    let (status, body) = ops
        .raw(
            "POST",
            "/v1/pools",
            Some(body_of(&pool_request("red", 1001, &[]))),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    conforms(&doc, "/v1/pools", "post", 201, &body);
    let (status, body) = ops
        .raw(
            "POST",
            "/v1/pools",
            Some(body_of(&pool_request("red", 1001, &[]))),
        )
        .await
        .unwrap();
    assert_eq!(status, 409);
    conforms(&doc, "/v1/pools", "post", 409, &body);
    let (status, body) = ops.raw("GET", "/v1/pools/red", None).await.unwrap();
    assert_eq!(status, 200);
    conforms(&doc, "/v1/pools/{name}", "get", 200, &body);
    let (status, body) = ops.raw("GET", "/v1/pools/blue", None).await.unwrap();
    assert_eq!(status, 404);
    conforms(&doc, "/v1/pools/{name}", "get", 404, &body);
    let (status, body) = ops
        .raw("PUT", "/v1/pools/red/holds/a1", None)
        .await
        .unwrap();
    assert_eq!(status, 409, "a1 has no overlay");
    conforms(&doc, "/v1/pools/{name}/holds/{host}", "put", 409, &body);
    let (status, body) = ops
        .raw("DELETE", "/v1/pools/red/holds/a1", None)
        .await
        .unwrap();
    assert_eq!(status, 200);
    conforms(&doc, "/v1/pools/{name}/holds/{host}", "delete", 200, &body);
    let (status, body) = ops.raw("GET", "/v1/pools", None).await.unwrap();
    assert_eq!(status, 200);
    conforms(&doc, "/v1/pools", "get", 200, &body);
    let (status, body) = ops.raw("DELETE", "/v1/pools/red", None).await.unwrap();
    assert_eq!(status, 200);
    conforms(&doc, "/v1/pools/{name}", "delete", 200, &body);

    for path in [
        "/v1/health",
        "/v1/sites",
        "/v1/hosts",
        "/v1/vms",
        "/v1/pools",
        "/v1/migrations",
    ] {
        let (status, body) = ops.raw("GET", path, None).await.unwrap();
        assert_eq!(status, 200, "{path}");
        conforms(&doc, path, "get", 200, &body);
    }
    let one = format!("/v1/migrations/{}", m.id);
    let (_, body) = ops.raw("GET", &one, None).await.unwrap();
    conforms(&doc, "/v1/migrations/{id}", "get", 200, &body);
    let (status, body) = ops.raw("GET", "/v1/migrations/m-none", None).await.unwrap();
    assert_eq!(status, 404);
    conforms(&doc, "/v1/migrations/{id}", "get", 404, &body);
    // Refusals: the same VM again (409), a host's certificate changing things (403), a
    // malformed body (400).
    let (status, body) = ops
        .raw(
            "POST",
            "/v1/migrations",
            Some(body_of(&request("vm1", Some("b1"), None))),
        )
        .await
        .unwrap();
    assert_eq!(status, 409);
    conforms(&doc, "/v1/migrations", "post", 409, &body);
    let (status, body) = b1
        .raw(
            "POST",
            "/v1/migrations",
            Some(body_of(&request("vm2", Some("b1"), None))),
        )
        .await
        .unwrap();
    assert_eq!(status, 403);
    conforms(&doc, "/v1/migrations", "post", 403, &body);
    let (status, body) = ops
        .raw("POST", "/v1/migrations", Some(b"{\"vm\": 7}".to_vec()))
        .await
        .unwrap();
    assert_eq!(status, 400);
    conforms(&doc, "/v1/migrations", "post", 400, &body);
    let (status, body) = ops
        .raw("POST", &format!("{one}/cancel"), None)
        .await
        .unwrap();
    assert_eq!(status, 200);
    conforms(&doc, "/v1/migrations/{id}/cancel", "post", 200, &body);

    // Groups: refused (400, 404), created (201), listed, one shown, an unknown one (404).
    for (vms, code) in [(&["vm2"][..], 400), (&["vm2", "nope"][..], 404)] {
        let (status, body) = ops
            .raw("POST", "/v1/groups", Some(body_of(&group_request(vms))))
            .await
            .unwrap();
        assert_eq!(status, code, "{}", String::from_utf8_lossy(&body));
        conforms(&doc, "/v1/groups", "post", code, &body);
    }
    let mut two = beat("a", &["b1"], &["vm2", "vm3"]);
    two.max_outgoing = 2;
    a1.heartbeat(&two).await.unwrap();
    let (status, body) = ops
        .raw(
            "POST",
            "/v1/groups",
            Some(body_of(&group_request(&["vm2", "vm3"]))),
        )
        .await
        .unwrap();
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    conforms(&doc, "/v1/groups", "post", 201, &body);
    let g: ferry_api::fleet::FleetGroup = serde_json::from_slice(&body).unwrap();
    let (_, body) = ops.raw("GET", "/v1/groups", None).await.unwrap();
    conforms(&doc, "/v1/groups", "get", 200, &body);
    let (_, body) = ops
        .raw("GET", &format!("/v1/groups/{}", g.id), None)
        .await
        .unwrap();
    conforms(&doc, "/v1/groups/{id}", "get", 200, &body);
    let (status, body) = ops.raw("GET", "/v1/groups/g-none", None).await.unwrap();
    assert_eq!(status, 404);
    conforms(&doc, "/v1/groups/{id}", "get", 404, &body);

    let (status, body) = ops.raw("GET", "/v1/cost-model", None).await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    conforms(&doc, "/v1/cost-model", "get", 200, &body);

    // Every API route is in the document (all but the document itself), and nothing else.
    let mut documented: Vec<&str> = doc["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    documented.sort_unstable();
    assert_eq!(
        documented,
        [
            "/v1/agent/heartbeat",
            "/v1/cost-model",
            "/v1/groups",
            "/v1/groups/{id}",
            "/v1/health",
            "/v1/hosts",
            "/v1/migrations",
            "/v1/migrations/{id}",
            "/v1/migrations/{id}/cancel",
            "/v1/plan",
            "/v1/pools",
            "/v1/pools/{name}",
            "/v1/pools/{name}/holds/{host}",
            "/v1/sites",
            "/v1/vms"
        ]
    );
}

#[tokio::test]
async fn a_pool_has_endpoints_where_its_vms_are_and_a_migration_waits_for_the_destinations() {
    let fleet = Fleet::start("").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    let mac = "52:54:00:00:10:01";
    a1.heartbeat(&overlay_beat(
        "a",
        &["b1"],
        "172.31.0.1",
        &[],
        &[("web", mac, "fp1001")],
    ))
    .await
    .unwrap();
    b1.heartbeat(&overlay_beat("b", &["a1"], "172.31.0.2", &[], &[]))
        .await
        .unwrap();

    // Bad pools are refused with what was wrong.
    for (req, says) in [
        (pool_request("red", 0, &[]), "VNI 0 is out of VXLAN's range"),
        (pool_request("red", 1 << 24, &[]), "out of VXLAN's range"),
        (pool_request("red pool", 5, &[]), "is not a pool name"),
        (pool_request("red", 5, &["nowhere"]), "no host \"nowhere\""),
        (
            PoolRequest {
                bridge: Some("a-bridge-name-too-long".into()),
                ..pool_request("red", 5, &[])
            },
            "is not a network interface name",
        ),
    ] {
        let (_, message) = refusal(ops.create_pool(&req).await.unwrap_err());
        assert!(message.contains(says), "{message}");
    }
    let red = ops
        .create_pool(&pool_request("red", 1001, &[]))
        .await
        .unwrap();
    assert_eq!(red.bridge, "fp1001");
    assert_eq!(red.endpoints.len(), 1, "{red:?}");
    assert_eq!(red.endpoints[0].host, "a1");
    assert_eq!(red.endpoints[0].vms, vec!["web".to_string()]);
    assert!(!red.endpoints[0].ready);
    let blue = ops
        .create_pool(&pool_request("blue", 1002, &["b1"]))
        .await
        .unwrap();
    assert_eq!(blue.held, vec!["b1".to_string()]);
    let (kind, message) = refusal(
        ops.create_pool(&pool_request("green", 1002, &[]))
            .await
            .unwrap_err(),
    );
    assert_eq!(kind, Some(ErrorKind::Conflict));
    assert!(
        message.contains("pool blue (VNI 1002, bridge fp1002)"),
        "{message}"
    );

    // Each host's plan: a1 has red (its VM), b1 has blue (held); the pools do not meet.
    let answer = a1
        .heartbeat(&overlay_beat(
            "a",
            &["b1"],
            "172.31.0.1",
            &["red"],
            &[("web", mac, "fp1001")],
        ))
        .await
        .unwrap();
    let plan = answer.overlay.unwrap();
    assert_eq!(plan.endpoints.len(), 1);
    assert_eq!(
        (plan.endpoints[0].pool.as_str(), plan.endpoints[0].vni),
        ("red", 1001)
    );
    assert!(plan.endpoints[0].remotes.is_empty());
    let answer = b1
        .heartbeat(&overlay_beat("b", &["a1"], "172.31.0.2", &["blue"], &[]))
        .await
        .unwrap();
    let plan = answer.overlay.unwrap();
    assert_eq!(
        plan.endpoints
            .iter()
            .map(|e| e.pool.as_str())
            .collect::<Vec<_>>(),
        ["blue"]
    );

    // web moves to b1: b1 gets red's endpoint, with the move in it; the leader schedules
    // the migration only once b1 reports red's endpoint up (libvirt needs the bridge).
    let m = ops
        .migrate(&request("web", Some("b1"), None))
        .await
        .unwrap();
    fleet.controller.lead().await.unwrap();
    assert_eq!(
        ops.migration(&m.id).await.unwrap().state,
        FleetMigrationState::Requested,
        "b1 has no red endpoint yet"
    );
    let answer = b1
        .heartbeat(&overlay_beat("b", &["a1"], "172.31.0.2", &["blue"], &[]))
        .await
        .unwrap();
    let plan = answer.overlay.unwrap();
    let red_at_b1 = plan.endpoints.iter().find(|e| e.pool == "red").unwrap();
    assert_eq!(red_at_b1.remotes[0].address, "172.31.0.1");
    assert_eq!(red_at_b1.macs[0].mac, mac);
    assert_eq!(red_at_b1.macs[0].host, "a1");
    assert_eq!(
        (
            red_at_b1.moving[0].from.as_str(),
            red_at_b1.moving[0].to.as_str()
        ),
        ("a1", "b1")
    );
    b1.heartbeat(&overlay_beat(
        "b",
        &["a1"],
        "172.31.0.2",
        &["blue", "red"],
        &[],
    ))
    .await
    .unwrap();
    fleet.controller.lead().await.unwrap();
    assert_eq!(
        ops.migration(&m.id).await.unwrap().state,
        FleetMigrationState::Scheduled
    );
    // A pool with VMs cannot go.
    let (kind, message) = refusal(ops.delete_pool("red").await.unwrap_err());
    assert_eq!(kind, Some(ErrorKind::Conflict));
    assert!(message.contains("still has VMs: web"), "{message}");
    // A host without an overlay cannot take a pool's VM.
    fleet
        .as_("a2")
        .heartbeat(&beat("a", &[], &[]))
        .await
        .unwrap();
    let mut a1_beat = overlay_beat(
        "a",
        &["b1", "a2"],
        "172.31.0.1",
        &["red"],
        &[("web", mac, "fp1001")],
    );
    a1_beat.vms.push(VmReport {
        name: "db".into(),
        kind: VmKind::Libvirt,
        state: "running".into(),
        usage: None,
        nics: vec![VmNic {
            mac: "52:54:00:00:10:02".into(),
            bridge: "fp1001".into(),
        }],
    });
    a1.heartbeat(&a1_beat).await.unwrap();
    let (kind, message) = refusal(
        ops.migrate(&request("db", Some("a2"), None))
            .await
            .unwrap_err(),
    );
    assert_eq!(kind, Some(ErrorKind::Conflict));
    assert!(message.contains("host a2 has no overlay"), "{message}");
}

fn body_of<T: serde::Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

#[tokio::test]
async fn metrics_show_the_fleet_and_its_migrations() {
    let fleet = Fleet::start("").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    a1.heartbeat(&beat("a", &["b1"], &["vm1"])).await.unwrap();
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();
    let m = ops
        .migrate(&request("vm1", Some("b1"), None))
        .await
        .unwrap();
    fleet.controller.lead().await.unwrap();
    let mut committed = agent_status("ag1", "vm1", MigrationState::Committed);
    committed.wire.bytes_out = 123_456;
    committed.source_stop_unix_us = Some(10_000_000);
    committed.destination_resume_unix_us = Some(10_250_000);
    let mut done = beat("a", &["b1"], &[]);
    done.migrations = vec![FleetMigrationReport {
        fleet_id: m.id,
        status: Some(committed),
        refused: None,
    }];
    a1.heartbeat(&done).await.unwrap();
    let (status, text) = fleet.local().raw("GET", "/metrics", None).await.unwrap();
    assert_eq!(status, 200);
    let text = String::from_utf8(text.to_vec()).unwrap();
    for line in [
        "ferry_fleet_hosts{state=\"up\"} 2",
        "ferry_fleet_hosts{state=\"down\"} 0",
        "ferry_fleet_migrations{state=\"committed\"} 1",
        "ferry_fleet_agent_migrations{state=\"committed\"} 1",
        "ferry_fleet_agent_wan_bytes_total 123456",
        "ferry_fleet_agent_downtime_seconds_count 1",
        "ferry_fleet_agent_downtime_seconds_sum 0.25",
    ] {
        assert!(text.contains(line), "{line} not in:\n{text}");
    }
}

/// Headless Chromium on `url` with `args` (`--dump-dom`, `--screenshot=...`): its output.
async fn chromium(profile: &Path, args: &[&str], url: &str) -> String {
    let program = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|p| {
            std::process::Command::new(p)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("Chromium is not installed (scripts/setup.sh installs it)");
    let out = tokio::process::Command::new(program)
        // Root in CI: Chromium's sandbox needs a user namespace it cannot have there. The
        // virtual time budget lets the page run its fetches and timers before the dump.
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "chromium {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn the_dashboard_shows_the_fleet_in_a_real_browser() {
    // Hosts stay up for an hour without heartbeats: Chromium's first start on a fresh
    // machine took over 20 s in CI, longer than the default 10 s, and the page then
    // showed both hosts down.
    let fleet = Fleet::start("[timing]\nhost_timeout_s = 3600\n").await;
    let (a1, b1, ops) = (fleet.as_("a1"), fleet.as_("b1"), fleet.as_("ops1"));
    a1.heartbeat(&beat("a", &["b1"], &["web-1", "db-1"]))
        .await
        .unwrap();
    b1.heartbeat(&beat("b", &["a1"], &[])).await.unwrap();
    // A pool held on a1, where it has a VM.
    a1.heartbeat(&overlay_beat(
        "a",
        &["b1"],
        "172.31.0.1",
        &["red"],
        &[("red-web", "52:54:00:00:10:01", "fp1001")],
    ))
    .await
    .unwrap();
    ops.create_pool(&pool_request("red", 1001, &["a1"]))
        .await
        .unwrap();
    a1.heartbeat(&beat("a", &["b1"], &["web-1", "db-1"]))
        .await
        .unwrap();
    // One migration committed with a 250 ms pause, one in its memory phase, 75% done.
    let done = ops
        .migrate(&request("web-1", Some("b1"), None))
        .await
        .unwrap();
    fleet.controller.lead().await.unwrap();
    let mut committed = agent_status("ag1", "web-1", MigrationState::Committed);
    committed.source_stop_unix_us = Some(10_000_000);
    committed.destination_resume_unix_us = Some(10_250_000);
    let mut report = beat("a", &["b1"], &["db-1"]);
    report.overlay = Some(OverlayReport {
        address: "172.31.0.1".into(),
        ready: vec!["red".into()],
    });
    report.migrations = vec![FleetMigrationReport {
        fleet_id: done.id.clone(),
        status: Some(committed),
        refused: None,
    }];
    a1.heartbeat(&report).await.unwrap();
    let moving = ops
        .migrate(&request("db-1", Some("b1"), None))
        .await
        .unwrap();
    fleet.controller.lead().await.unwrap();
    let mut running = agent_status("ag2", "db-1", MigrationState::Running);
    running.phase = ferry_api::agent::Phase::Memory;
    running.qemu.total = 1000;
    running.qemu.remaining = 250;
    running.wire.bytes_out = 3 << 20;
    running.started_unix_ms = ferry_controller::store::now_ms() - 3000;
    report.migrations.push(FleetMigrationReport {
        fleet_id: moving.id.clone(),
        status: Some(running),
        refused: None,
    });
    a1.heartbeat(&report).await.unwrap();

    let url = format!("http://{}/", fleet.http_address);
    let profile = tempfile::tempdir().unwrap();
    let dom = chromium(profile.path(), &["--dump-dom"], &url).await;
    for expected in [
        // The status line drawn from /v1/health, not the error the page shows without it.
        "<div id=\"status\" class=\"\">controller ctl1 · store sqlite · leader ctl1",
        "<td>a</td><td>1 of 1 up</td><td>1</td><td>red</td>",
        "<td>red</td><td>1001</td><td>fp1001</td><td>re-pointed</td><td>a1 (a): held</td>",
        "<td>b1</td><td>b</td><td><span class=\"up\">up</span></td>",
        "<td>db-1</td><td>libvirt</td><td>a1</td>",
        &format!(
            "<code>{}</code></td><td>db-1</td><td>a1 → b1</td>",
            moving.id
        ),
        "<td>memory</td>",
        "width:75.0%",
        "3.0 MiB",
        &format!("<code>{}</code></td><td>web-1</td>", done.id),
        "<span class=\"committed\">committed</span>",
        "<td>250 ms</td>",
        "<svg class=\"timeline\"",
    ] {
        assert!(
            dom.contains(expected),
            "the dashboard lacks {expected:?}:\n{dom}"
        );
    }
    // A screenshot, kept as the test's artifact (target/tmp/dashboard.png).
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    chromium(
        profile.path(),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1280,900",
        ],
        &url,
    )
    .await;
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );

    // The page's listener is read-only.
    let http = tokio::net::TcpStream::connect(&fleet.http_address)
        .await
        .unwrap();
    let (status, body) = ferry_controller::client::exchange_raw(
        http,
        "POST",
        "/v1/migrations",
        Some(body_of(&request("db-1", Some("a1"), None))),
    )
    .await
    .unwrap();
    assert_eq!(status, 403, "{body:?}");
    assert!(String::from_utf8_lossy(&body).contains("read-only"));
}

/// A heartbeat whose host offers `cpus` and `gib`, and whose VMs report their use
/// (name, thousandths of a CPU, MiB; none: not reported).
fn usage_beat(site: &str, cpus: u32, gib: u64, vms: &[(&str, Option<(u64, u64)>)]) -> Heartbeat {
    let names: Vec<&str> = vms.iter().map(|(n, _)| *n).collect();
    let mut b = beat(site, &["a1", "a2", "b1"], &names);
    b.max_outgoing = 4;
    b.capacity = Some(ferry_api::fleet::HostCapacity {
        cpus,
        mem_bytes: gib << 30,
        lend_bytes: 0,
    });
    for (report, (_, usage)) in b.vms.iter_mut().zip(vms) {
        report.usage = usage.map(|(cpu_millis, mib)| ferry_api::fleet::VmUsage {
            cpu_millis,
            mem_bytes: mib << 20,
            used_bytes: None,
            dirty_bytes_per_s: None,
        });
    }
    b
}

#[tokio::test]
async fn the_plan_empties_a_host_the_fleet_does_not_need_and_is_carried_out_as_migrations() {
    let fleet =
        Fleet::start("[policy]\nhold_s = 0\nmin_on_s = 0\nwan_mbit = 100\nwan_rtt_ms = 50\n").await;
    let (a1, a2, b1, ops) = (
        fleet.as_("a1"),
        fleet.as_("a2"),
        fleet.as_("b1"),
        fleet.as_("ops1"),
    );
    let (status, doc) = ops.raw("GET", "/v1/openapi.json", None).await.unwrap();
    assert_eq!(status, 200);
    let doc: serde_json::Value = serde_json::from_slice(&doc).unwrap();

    // a1 and b1 are lightly used; b1 also runs a VM whose use is not known yet. a2 is an
    // agent of an older version: no capacity.
    a1.heartbeat(&usage_beat(
        "a",
        4,
        4,
        &[("web", Some((300, 512))), ("db", Some((200, 1024)))],
    ))
    .await
    .unwrap();
    b1.heartbeat(&usage_beat(
        "b",
        4,
        4,
        &[("cache", Some((100, 256))), ("new", None)],
    ))
    .await
    .unwrap();
    let mut old = beat("a", &[], &["legacy"]);
    old.capacity = None;
    a2.heartbeat(&old).await.unwrap();

    let vms = ops.vms().await.unwrap();
    let web = vms.iter().find(|v| v.name == "web").unwrap();
    assert_eq!(
        web.usage.map(|u| (u.cpu_millis, u.mem_bytes)),
        Some((300, 512 << 20))
    );
    let (status, body) = ops.raw("GET", "/v1/plan", None).await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    conforms(&doc, "/v1/plan", "get", 200, &body);
    let plan: ferry_api::fleet::FleetPlan = serde_json::from_slice(&body).unwrap();
    // b1 cannot be emptied (its unknown VM stays), so a1 is, across to b1.
    assert_eq!(plan.drain, ["a1"], "{plan:?}");
    let moved: Vec<(&str, &str, &str)> = plan
        .moves
        .iter()
        .map(|m| (m.vms[0].as_str(), m.to.as_str(), m.reason.as_str()))
        .collect();
    assert_eq!(
        moved,
        [("web", "b1", "consolidate"), ("db", "b1", "consolidate")]
    );
    // Priced by the model over the 100 Mbit/s link: the larger VM takes longer.
    assert!(plan.moves[1].predicted_s > plan.moves[0].predicted_s);
    assert!(plan.moves[0].predicted_wan_bytes > 0);
    let left: Vec<(&str, &str)> = plan
        .unplanned
        .iter()
        .map(|u| (u.name.as_str(), u.why.as_str()))
        .collect();
    assert!(
        left.contains(&(
            "a2",
            "reports no capacity (an agent older than the planner)"
        )),
        "{left:?}"
    );
    assert!(
        left.iter()
            .any(|(n, why)| *n == "new" && why.contains("not reported")),
        "{left:?}"
    );
    assert!(left.iter().any(|(n, _)| *n == "legacy"), "{left:?}");

    // A host may not carry it out; an operator may.
    let (status, _) = b1.raw("POST", "/v1/plan", None).await.unwrap();
    assert_eq!(status, 403);
    let (status, body) = ops.raw("POST", "/v1/plan", None).await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    conforms(&doc, "/v1/plan", "post", 200, &body);
    let done: ferry_api::fleet::FleetPlan = serde_json::from_slice(&body).unwrap();
    assert_eq!(done.requested.len(), 2, "{done:?}");
    assert!(done.refused.is_empty(), "{done:?}");
    let migrations = ops.migrations().await.unwrap();
    for id in &done.requested {
        let m = migrations.iter().find(|m| &m.id == id).unwrap();
        assert_eq!(
            (m.source_host.as_str(), m.destination_host.as_str()),
            ("a1", "b1")
        );
        assert_eq!(m.requested_by, "ops1");
    }
    // Under way, nothing more is planned for those VMs; a1 stays being emptied.
    let again = ops.plan().await.unwrap();
    assert!(again.moves.is_empty(), "{again:?}");
    assert!(again.unplanned.iter().all(|u| u.name != "web"));
}

/// A heartbeat of `site`'s host offering 1 GiB to VMs and lending `lend_mib` to peers' VMs,
/// with VMs (name, MiB their balloon leaves them, MiB their guest uses) and swaps (domain,
/// peer, MiB, MiB paged out to it).
fn memory_beat(
    site: &str,
    lend_mib: u64,
    vms: &[(&str, u64, u64)],
    swaps: &[(&str, &str, u64, u64)],
) -> Heartbeat {
    let names: Vec<&str> = vms.iter().map(|v| v.0).collect();
    let mut b = beat(site, &["a1", "a2", "b1"], &names);
    b.max_outgoing = 4;
    b.capacity = Some(ferry_api::fleet::HostCapacity {
        cpus: 4,
        mem_bytes: 1 << 30,
        lend_bytes: lend_mib << 20,
    });
    for (report, (_, held, used)) in b.vms.iter_mut().zip(vms) {
        report.usage = Some(ferry_api::fleet::VmUsage {
            cpu_millis: 100,
            mem_bytes: held << 20,
            used_bytes: Some(used << 20),
            dirty_bytes_per_s: None,
        });
    }
    b.swaps = swaps
        .iter()
        .map(|(domain, peer, mib, used)| ferry_api::fleet::SwapReport {
            domain: (*domain).into(),
            peer: (*peer).into(),
            bytes: mib << 20,
            state: ferry_api::fleet::SwapState::Taken,
            used_bytes: Some(used << 20),
            by_controller: true,
            error: None,
        })
        .collect();
    b
}

#[tokio::test]
async fn a_short_overload_swaps_to_a_peer_and_a_lasting_one_migrates() {
    // Sampled every 0.5 s: sustained after 8 samples over (4 s), transient until then.
    let fleet = Fleet::start(
        "[timing]\nheartbeat_s = 0.1\n[policy]\noverload = true\noverload_interval_s = 0.5\ncooldown_s = 0\nmin_on_s = 0\n",
    )
    .await;
    let (a1, a2, b1, ops) = (
        fleet.as_("a1"),
        fleet.as_("a2"),
        fleet.as_("b1"),
        fleet.as_("ops1"),
    );
    // a2 (same site, lends 512 MiB) and b1 (lends 256 MiB) are a1's peers.
    let others = || async {
        let a2_answer = a2
            .heartbeat(&memory_beat("a", 512, &[], &[]))
            .await
            .unwrap();
        b1.heartbeat(&memory_beat("b", 256, &[("cache", 256, 100)], &[]))
            .await
            .unwrap();
        a2_answer
    };
    // Beats until the plan satisfies `ready`, a1 reporting `vms` and `swaps`; returns the plan
    // and a1's last answer.
    let until = |vms: Vec<(&'static str, u64, u64)>,
                 swaps: Vec<(&'static str, &'static str, u64, u64)>,
                 what: &'static str,
                 ready: Box<dyn Fn(&ferry_api::fleet::FleetPlan) -> bool>| {
        let (a1, ops) = (&a1, &ops);
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let answer = a1
                    .heartbeat(&memory_beat("a", 0, &vms, &swaps))
                    .await
                    .unwrap();
                others().await;
                let plan = ops.plan().await.unwrap();
                if ready(&plan) {
                    return (plan, answer);
                }
                assert!(tokio::time::Instant::now() < deadline, "{what}: {plan:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let pressure = |plan: &ferry_api::fleet::FleetPlan| {
        plan.pressure
            .iter()
            .find(|p| p.host == "a1")
            .map(|p| p.pressure.clone())
    };

    // 1000 MiB of 1024 used: normal.
    let calm = vec![("web", 1024, 600), ("db", 512, 400)];
    until(
        calm.clone(),
        vec![],
        "a1 sampled",
        Box::new(move |p| pressure(p).as_deref() == Some("normal")),
    )
    .await;

    // web's guest takes 100 MiB more: 76 MiB over. The largest user swaps to the peer at its
    // own site with the most to lend, squeezed by the excess and a little more.
    let burst = vec![("web", 1024, 700), ("db", 512, 400)];
    let (plan, _) = until(
        burst.clone(),
        vec![],
        "a swap",
        Box::new(|p| !p.swaps.is_empty()),
    )
    .await;
    assert_eq!(pressure(&plan).as_deref(), Some("transient"), "{plan:?}");
    let swap = &plan.swaps[0];
    assert_eq!(
        (swap.host.as_str(), swap.domain.as_str(), swap.peer.as_str()),
        ("a1", "web", "a2")
    );
    assert_eq!(swap.memory_bytes, (1024 - 84) << 20);
    assert_eq!(swap.bytes, 168 << 20);
    // The plan is the host's desired state from the next heartbeat on.
    let answer = a1
        .heartbeat(&memory_beat("a", 0, &burst, &[]))
        .await
        .unwrap();
    assert_eq!(answer.swaps.as_deref(), Some(&plan.swaps[..]));
    assert_eq!(others().await.swaps, Some(vec![]));

    // Taken: web pages out, and the host's memory in use (what it paged out included) stays
    // over while the burst lasts. Then the burst ends: three quiet samples later the swap goes.
    let swapped = vec![("web", "a2", 168, 70)];
    let squeezed = vec![("web", 940, 640), ("db", 512, 400)];
    until(
        squeezed,
        swapped.clone(),
        "still transient",
        Box::new(|p| {
            p.pressure
                .iter()
                .any(|h| h.host == "a1" && h.swapped_bytes == 70 << 20)
        }),
    )
    .await;
    let over = vec![("web", 940, 500), ("db", 512, 400)];
    until(
        over.clone(),
        vec![("web", "a2", 168, 4)],
        "the swap given back",
        Box::new(|p| p.swaps.is_empty()),
    )
    .await;
    let answer = a1
        .heartbeat(&memory_beat("a", 0, &over, &[("web", "a2", 168, 4)]))
        .await
        .unwrap();
    assert_eq!(answer.swaps, Some(vec![]));
    assert!(
        ops.migrations().await.unwrap().is_empty(),
        "a transient overload migrated"
    );

    // A burst that lasts: swap first; sustained, the swap goes back, and only once it has a VM
    // moves, the cheapest that relieves a1 alone, to the host with room at its own site.
    until(
        burst.clone(),
        vec![],
        "a swap again",
        Box::new(|p| !p.swaps.is_empty()),
    )
    .await;
    let (plan, _) = until(
        vec![("web", 940, 640), ("db", 512, 400)],
        vec![("web", "a2", 168, 70)],
        "sustained",
        Box::new(|p| p.swaps.is_empty()),
    )
    .await;
    assert_eq!(pressure(&plan).as_deref(), Some("sustained"), "{plan:?}");
    assert!(
        ops.migrations().await.unwrap().is_empty(),
        "moved before the swap went back"
    );
    until(burst, vec![], "a move", Box::new(|_| true)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let moved = loop {
        a1.heartbeat(&memory_beat(
            "a",
            0,
            &[("web", 1024, 700), ("db", 512, 400)],
            &[],
        ))
        .await
        .unwrap();
        others().await;
        if let Some(m) = ops.migrations().await.unwrap().pop() {
            break m;
        }
        assert!(tokio::time::Instant::now() < deadline, "no migration");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (
            moved.vm.as_str(),
            moved.source_host.as_str(),
            moved.destination_host.as_str(),
            moved.requested_by.as_str()
        ),
        ("db", "a1", "a2", "overload")
    );
}

/// Sends `POST path` with `body` on the controller's local socket and closes the connection's
/// sending side at once, never reading the answer (a client killed, or one that gave up).
async fn post_and_vanish(socket: &Path, path: &str, body: &[u8]) {
    use tokio::io::AsyncWriteExt;
    let mut api = tokio::net::UnixStream::connect(socket).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: ferry-controller\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    api.write_all(head.as_bytes()).await.unwrap();
    api.write_all(body).await.unwrap();
    api.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_request_received_whole_is_carried_out_when_its_client_is_gone() {
    let fleet = Fleet::start("").await;
    let names: Vec<String> = (0..20).map(|i| format!("gone{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        let vni = 2000 + u32::try_from(i).unwrap();
        let body = body_of(&pool_request(name, vni, &[]));
        post_and_vanish(&fleet.socket, "/v1/pools", &body).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let pools = fleet.local().pools().await.unwrap();
        let missing: Vec<&String> = names
            .iter()
            .filter(|n| !pools.iter().any(|p| &p.name == *n))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pools whose request arrived whole were not created: {missing:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
