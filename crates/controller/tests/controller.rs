//! The controller in-process, without root: its API over real mutual TLS on loopback and its
//! local socket, a SQLite store in a temporary directory, and tests playing the agents (their
//! heartbeats, reports and refusals) and the operators.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_api::agent::{ApiError, ErrorKind, MigrationState, MigrationStatus};
use ferry_api::fleet::{
    FleetMigrationReport, FleetMigrationRequest, FleetMigrationState, Heartbeat, HostState, VmKind,
    VmReport,
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
        let controller = Arc::new(Controller { config, store });
        tokio::spawn(ferry_controller::serve::serve(
            controller.clone(),
            tcp,
            local,
        ));
        Fleet {
            _dir: dir,
            pki,
            address,
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
            })
            .collect(),
        migrations: vec![],
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
    a1.heartbeat(&done).await.unwrap();
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
    let mut bad = request("vm1", Some("a2"), None);
    bad.settings.connections = 0;
    let (kind, message) = refusal(ops.migrate(&bad).await.unwrap_err());
    assert_eq!(kind, Some(ErrorKind::BadRequest));
    assert!(
        message.contains("connections 0 is out of range"),
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
