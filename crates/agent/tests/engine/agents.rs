//! Two real agents in this process, each on its own runtime (so that killing one takes all of
//! it down, as SIGKILL would), site a reaching site b through a [`Link`].

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_agent::client::AgentClient;
use ferry_agent::AgentConfig;
use ferry_api::agent::{Destination, MigrationRequest, MigrationState, MigrationStatus};
use ferry_api::settings::MigrationSettings;
use tokio::runtime::Runtime;

use crate::fake_qemu::{FakeQemu, Gates};
use crate::link::Link;

pub struct Agent {
    pub config: AgentConfig,
    rt: Option<Runtime>,
}

impl Agent {
    fn start(config: AgentConfig) -> Agent {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let name = config.name.clone();
        // A killed predecessor's runtime may still hold its listener for a moment: the socket
        // that answers must be this agent's.
        let _ = std::fs::remove_file(&config.api_socket);
        let run = ferry_agent::run(config.clone());
        rt.spawn(async move {
            if let Err(e) = run.await {
                panic!("agent {name}: {e:#}");
            }
        });
        let agent = Agent {
            config,
            rt: Some(rt),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&agent.config.api_socket).is_err() {
            assert!(
                Instant::now() < deadline,
                "agent {} did not start",
                agent.config.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        agent
    }

    pub fn client(&self) -> AgentClient {
        AgentClient::new(&self.config.api_socket)
    }

    /// Its `/metrics` (Prometheus's text format).
    pub async fn metrics(&self) -> String {
        use http_body_util::BodyExt;
        let stream = tokio::net::UnixStream::connect(&self.config.api_socket)
            .await
            .expect("the agent's API socket");
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .expect("HTTP");
        tokio::spawn(conn);
        let req = hyper::Request::get("/metrics")
            .header("host", "ferry-agent")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .expect("request");
        let resp = sender.send_request(req).await.expect("response");
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        String::from_utf8(body.to_vec()).expect("text")
    }

    /// One figure of its `/metrics`.
    pub async fn metric(&self, name: &str) -> u64 {
        let text = self.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }

    /// Started again from the same config, as after a crash: only what it wrote to disk is left.
    pub fn restart(&mut self) {
        self.kill();
        *self = Agent::start(self.config.clone());
    }

    /// Everything the agent holds in memory is gone, its sockets closed (once this returns, as
    /// after SIGKILL; unlike SIGKILL, its tasks' destructors run).
    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            let stop = || rt.shutdown_timeout(Duration::from_secs(10));
            if tokio::runtime::Handle::try_current().is_ok() {
                tokio::task::block_in_place(stop);
            } else {
                stop();
            }
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Site a's agent and its VM, site b's agent and the QEMU waiting there, the link between.
pub struct Pair {
    /// The agents' directories, the CA, the QEMUs' sockets: removed with the pair.
    _dir: tempfile::TempDir,
    pub a: Agent,
    pub b: Agent,
    pub link: Link,
    pub source: FakeQemu,
    pub destination: FakeQemu,
}

/// A free port on loopback (free when asked; the agent binds it right after).
/// A port for an agent to listen on, free now. Taken below the kernel's ephemeral range
/// (32768 and up), where the tests' own outgoing connections take theirs: a port from
/// `bind(0)`, released and bound again later by the agent, was sometimes taken in between
/// ("Address already in use"). Each call in this process takes the next one.
fn free_port() -> SocketAddr {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let _ = NEXT.compare_exchange(
        0,
        20_000 + (std::process::id() % 10_000) as u16,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    loop {
        let port = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(port < 32_000, "no free port below the ephemeral range");
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().expect("address");
        }
    }
}

fn config(
    dir: &Path,
    name: &str,
    listen: SocketAddr,
    peer: Option<(&str, SocketAddr)>,
) -> AgentConfig {
    let id = ferry_agent::pki::issue(&dir.join("pki"), name).expect("certificate");
    let work = dir.join(name);
    let mut text = format!(
        "name = {name:?}\nlisten = \"{listen}\"\nwork_dir = {:?}\napi_socket = {:?}\n\n\
         [tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
        work.display().to_string(),
        work.join("api.sock").display().to_string(),
        id.ca.display().to_string(),
        id.cert.display().to_string(),
        id.key.display().to_string(),
    );
    if let Some((peer, address)) = peer {
        text += &format!("\n[peers.{peer}]\naddress = \"{address}\"\n");
    }
    std::fs::create_dir_all(&work).expect("work dir");
    AgentConfig::parse(&text, &work.join("agent.toml")).expect("config")
}

/// The real QEMU stream the source migrates (64 MiB guest running its firmware, several
/// passes; captured by `scripts/capture-streams.sh`).
pub fn captured_stream() -> Arc<Vec<u8>> {
    stream("running")
}

/// A captured postcopy stream (the advice, the package, pages after it).
pub fn postcopy_stream() -> Arc<Vec<u8>> {
    stream("postcopy/running")
}

/// Another captured stream (the same VM before it ran): not what the source sends.
pub fn idle_stream() -> Arc<Vec<u8>> {
    stream("idle")
}

fn stream(name: &str) -> Arc<Vec<u8>> {
    let path = format!(
        "{}/../qemu/tests/streams/{name}.qemu.zst",
        env!("CARGO_MANIFEST_DIR")
    );
    Arc::new(zstd::decode_all(std::fs::File::open(&path).expect(&path)).expect("zstd"))
}

/// The agents' log goes to the test's captured output (shown when a test fails), at the level
/// `RUST_LOG` asks for, warnings by default.
fn log_to_the_test() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

impl Pair {
    pub fn up(gates_a: Gates, gates_b: Gates) -> Pair {
        Pair::up_expecting(gates_a, gates_b, captured_stream())
    }

    /// As [`Pair::up`], with a destination QEMU that loads only `expected`.
    pub fn up_expecting(gates_a: Gates, gates_b: Gates, expected: Arc<Vec<u8>>) -> Pair {
        Pair::up_with(gates_a, gates_b, captured_stream(), expected)
    }

    /// As [`Pair::up`], the source migrating `sent` and the destination loading only
    /// `expected`.
    pub fn up_with(
        gates_a: Gates,
        gates_b: Gates,
        sent: Arc<Vec<u8>>,
        expected: Arc<Vec<u8>>,
    ) -> Pair {
        log_to_the_test();
        let dir = tempfile::tempdir().expect("temp dir");
        ferry_agent::pki::init(&dir.path().join("pki"), "engine-test").expect("CA");
        let b_listen = free_port();
        let link = Link::to(b_listen);
        let b = Agent::start(config(dir.path(), "b", b_listen, None));
        let a = Agent::start(config(
            dir.path(),
            "a",
            free_port(),
            Some(("b", link.address)),
        ));
        let source = FakeQemu::source(&dir.path().join("a"), sent, gates_a);
        let destination = FakeQemu::destination(&dir.path().join("b"), expected, gates_b);
        Pair {
            _dir: dir,
            a,
            b,
            link,
            source,
            destination,
        }
    }

    /// A certificate from the pair's CA for another host named `name`: its TLS client setup.
    pub fn peer_tls(&self, name: &str) -> Arc<ferry_wire::tls::ClientConfig> {
        ferry_agent::pki::issue(&self._dir.path().join("pki"), name)
            .expect("certificate")
            .client_config()
            .expect("TLS")
    }

    /// The request for the source's VM to the destination's QEMU.
    pub fn request(&self, settings: MigrationSettings) -> MigrationRequest {
        MigrationRequest {
            vm: "vm1".into(),
            source_qmp: self.source.qmp.clone(),
            to: "b".into(),
            destination: Destination::Qmp(self.destination.qmp.clone()),
            link_rate_mbit: None,
            disks: Vec::new(),
            settings,
        }
    }

    /// Starts a migration at site a; returns its id.
    pub async fn migrate(&self, settings: MigrationSettings) -> String {
        self.a
            .client()
            .start_migration(&self.request(settings))
            .await
            .expect("the agent takes the migration")
            .id
    }

    /// Polls site a's view of migration `id` until `done` holds (within a minute).
    pub async fn wait(
        &self,
        id: &str,
        what: &str,
        done: impl Fn(&MigrationStatus) -> bool,
    ) -> MigrationStatus {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let status = self.a.client().migration(id).await.expect("status");
            if done(&status) {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within 60 s: {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until migration `id` has ended at site a.
    pub async fn finished(&self, id: &str) -> MigrationStatus {
        self.wait(id, "the migration's end", |s| {
            s.state != MigrationState::Running
        })
        .await
    }
}
