//! The agent's two faces: the local API (HTTP and JSON on a unix socket) and the peer endpoint
//! (TCP with mutual TLS) where other agents open sessions.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use ferry_api::agent::{
    Destination, Health, LibvirtMigrationRequest, MigrationRequest, MigrationState,
    MigrationStatus, SwapRequest, SwapStatus,
};
use ferry_wire::net::{accept, answer, next_hello, Pool};
use ferry_wire::tls::{ClientConfig, ServerConfig};
use ferry_wire::{ConnectionEnd, Session, SessionConfig, SessionId};
use tokio::net::{TcpListener, UnixListener};

use crate::config::AgentConfig;
use crate::engine::control::{self, Control};
use crate::engine::journal::Journal;
use crate::engine::monitor_dir::MonitorDir;
use crate::engine::status::{now_ms, Registry, Shared};
use crate::engine::{destination, postcopy_recovery, recovery, source};
use crate::libvirt::Libvirt;
use crate::refusal::Refusal;
use crate::relay_pacing::RelayPacing;
use crate::{libvirt_migration, tunnel};

/// How long a new session may take to say what it is for.
const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) struct Agent {
    pub(crate) config: AgentConfig,
    client_tls: Arc<ClientConfig>,
    /// Connections to peers that finished a migration, for the next one (warm).
    pool: Arc<Pool>,
    pub(crate) migrations: Registry,
    /// libvirt's migrations carried to peers, when the config has `[libvirt]`.
    pub(crate) tunnels: Option<Arc<tunnel::Tunnels>>,
    /// This host's pool endpoints, when the config has `[overlay]`.
    pub(crate) overlay: Option<Arc<crate::overlay::Overlay>>,
    /// The group members this agent runs, and what the controller says of their groups.
    pub(crate) groups: crate::group::Groups,
    /// The host's bare QEMU VMs, by their monitors (`[qemu] qmp_dir`).
    pub(crate) monitors: Arc<MonitorDir>,
    /// Incoming sessions, by id (at most [`MAX_INCOMING_SESSIONS`]); ids of finished ones are
    /// remembered so that a late connection of an old session cannot start a new one.
    sessions: Mutex<HashMap<SessionId, Session>>,
    finished: Mutex<FinishedSessions>,
    /// This host's memory lent to peers' VMs as swap.
    pub(crate) lender: Arc<crate::lend::Lender>,
    /// This host's domains with swap on peers.
    pub(crate) swaps: crate::borrow::Swaps,
    pub(crate) fleet_swaps: crate::fleet_swap::FleetSwaps,
    /// The migrations' records on disk ([`crate::engine::journal`]).
    pub(crate) journal: Journal,
    /// Incoming migrations under way.
    receiving: AtomicUsize,
    /// Monitors of postcopy migrations that failed past the switch, for their recovery.
    held_monitors: Arc<postcopy_recovery::HeldMonitors>,
}

/// Runs the agent until it is killed.
pub async fn run(config: AgentConfig) -> Result<()> {
    let server_tls = config.identity.server_config()?;
    let client_tls = config.identity.client_config()?;
    for dir in [&config.work_dir, &config.qmp_dir] {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let fastest_link = config
        .peers
        .values()
        .filter_map(|peer| peer.rate_mbit)
        .reduce(f64::max);
    let peers = ferry_wire::net::listen(&config.listen, fastest_link)
        .await
        .with_context(|| format!("listen for peers on {}", config.listen))?;
    let _ = std::fs::remove_file(&config.api_socket);
    let api = UnixListener::bind(&config.api_socket)
        .with_context(|| format!("API socket {}", config.api_socket.display()))?;
    let (pool, migrations) = (Pool::new(), Registry::default());
    let overlay = config
        .overlay
        .clone()
        .map(|o| Arc::new(crate::overlay::Overlay::new(o, config.name.clone())));
    let journal = Journal::new(&config.work_dir);
    let tunnels = config.libvirt.clone().map(|libvirt| {
        Arc::new(tunnel::Tunnels {
            config: libvirt,
            own_name: config.name.clone(),
            peers: config.peers.clone().into_iter().collect(),
            tls: client_tls.clone(),
            pool: pool.clone(),
            registry: migrations.clone(),
            claims: Mutex::default(),
            relays: Mutex::default(),
            streams: Mutex::default(),
            channels: Mutex::default(),
            failures: Mutex::default(),
            overlay: overlay.clone(),
            journal: journal.clone(),
            disk_memory: disk_memory(&config),
        })
    });
    let lender = crate::lend::Lender::new(config.lend_bytes);
    let agent = Arc::new(Agent {
        monitors: MonitorDir::new(config.qmp_dir.clone()),
        config,
        client_tls,
        pool,
        migrations,
        tunnels: tunnels.clone(),
        overlay,
        groups: crate::group::Groups::default(),
        sessions: Mutex::new(HashMap::new()),
        finished: Mutex::new(FinishedSessions::default()),
        lender,
        swaps: crate::borrow::Swaps::default(),
        fleet_swaps: crate::fleet_swap::FleetSwaps::default(),
        journal,
        receiving: AtomicUsize::new(0),
        held_monitors: Arc::default(),
    });
    // What a killed predecessor left: settled before peers are served (the destination's
    // side), or in tasks of their own (a source asking for verdicts).
    recovery::recover_incoming(&agent.journal, &agent.held_monitors).await;
    let peer_of = |name: &str| {
        agent.config.peers.get(name).map(|p| recovery::PeerLink {
            name: name.to_owned(),
            address: p.address.clone(),
            tls: agent.client_tls.clone(),
            pool: agent.pool.clone(),
        })
    };
    recovery::recover_outgoing(
        &agent.journal,
        &agent.migrations,
        &agent.config.work_dir,
        peer_of,
    )
    .await;
    if let Some(tunnels) = &agent.tunnels {
        crate::libvirt_fence::take_up(
            &agent.journal,
            |peer| {
                let known = tunnels.peers.iter().any(|(name, _)| name == peer);
                known.then(|| tunnels.fence_ends(peer))
            },
            &agent.migrations,
        );
    }
    tracing::info!(
        "agent {} listening for peers on {} and for the CLI on {}",
        agent.config.name,
        agent.config.listen,
        agent.config.api_socket.display()
    );
    let app = Router::new()
        .route("/v1/health", get(health))
        .route("/v1/migrations", get(list).post(start))
        .route("/v1/migrations/{id}", get(one))
        .route("/v1/migrations/{id}/cancel", axum::routing::post(cancel))
        .route("/v1/libvirt/migrations", axum::routing::post(start_libvirt))
        .route("/v1/swap", get(swaps))
        .route(
            "/v1/vms/{domain}/swap",
            axum::routing::put(take_swap).delete(give_swap_back),
        )
        .route("/metrics", get(metrics))
        // Requests are a few hundred bytes: a larger body is refused (413) before it is held.
        .layer(axum::extract::DefaultBodyLimit::max(64 << 10))
        .with_state(agent.clone());
    // Prometheus cannot scrape a unix socket: the metrics alone, read-only, on TCP if asked.
    let metrics_only = async {
        match &agent.config.metrics_listen {
            Some(address) => {
                let listener = TcpListener::bind(address)
                    .await
                    .with_context(|| format!("metrics_listen {address}"))?;
                let app = Router::new()
                    .route("/metrics", get(metrics))
                    .with_state(agent.clone());
                axum::serve(listener, app).await.context("metrics server")
            }
            None => std::future::pending().await,
        }
    };
    let tunnels = async {
        match tunnels {
            Some(tunnels) => tunnel::serve_sources(tunnels).await,
            None => std::future::pending().await,
        }
    };
    let fleet = async {
        match agent.config.controllers.clone() {
            links if links.is_empty() => std::future::pending().await,
            links => crate::fleet::report(agent.clone(), links).await,
        }
    };
    tokio::select! {
        r = serve_api(api, app) => r.context("API server")?,
        r = fleet => r?,
        r = metrics_only => r?,
        r = serve_peers(agent.clone(), peers, server_tls) => r?,
        r = tunnels => r?,
        () = release_memory_after_migrations(agent.clone()) => {}
    }
    Ok(())
}

/// Where indexes of disks that left through libvirt are kept: beside the seed images, the
/// other things kept for a return.
fn disk_memory(config: &AgentConfig) -> crate::disk_memory::DiskMemory {
    crate::disk_memory::DiskMemory::new(
        config.seed_dir.join("disks"),
        crate::disk_memory::BUDGET_BYTES,
    )
}

/// Gives back to the system the memory finished migrations freed (see [`crate::memory`]):
/// once a migration has ended and none is under way either way, `malloc_trim`.
async fn release_memory_after_migrations(agent: Arc<Agent>) {
    // What has ended: migrations sent (how many are listed, the latest start) and the last
    // incoming session; it changes whenever one more ends, also once the lists are full.
    let mut ended_before = None;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let statuses = agent.statuses();
        if agent.receiving.load(Ordering::Relaxed) > 0
            || statuses.iter().any(|s| s.state == MigrationState::Running)
        {
            continue;
        }
        let ended = Some((
            statuses.len(),
            statuses.iter().map(|s| s.started_unix_ms).max(),
            agent.finished.lock().expect("lock").order.back().copied(),
        ));
        if ended != ended_before {
            ended_before = ended;
            let _ = tokio::task::spawn_blocking(crate::memory::release_free).await;
        }
    }
}

async fn serve_peers(
    agent: Arc<Agent>,
    listener: TcpListener,
    tls: Arc<ServerConfig>,
) -> Result<()> {
    loop {
        let (tcp, from) = listener
            .accept()
            .await
            .context("accepting peer connections")?;
        let (agent, tls) = (agent.clone(), tls.clone());
        tokio::spawn(async move {
            let (mut stream, mut hello, mut leftover) =
                match accept(tcp, tls, Duration::from_secs(10)).await {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::warn!("peer {from} refused: {e}");
                        return;
                    }
                };
            // One session after another: a connection its session parked waits for the
            // dialer's next one.
            loop {
                let Some(session) = agent.session_for(hello.session) else {
                    tracing::warn!("peer {from}: connection refused");
                    return;
                };
                let (parked, rest) = match answer(&session, stream, &hello, leftover).await {
                    ConnectionEnd::Parked(parked, rest) => (parked, rest),
                    ConnectionEnd::Lost(e) => {
                        tracing::debug!("peer {from}: connection {} ended: {e}", hello.connection);
                        return;
                    }
                };
                (stream, hello, leftover) = match next_hello(parked, rest).await {
                    Ok(next) => next,
                    Err(e) => {
                        tracing::debug!("peer {from}: parked connection closed: {e}");
                        return;
                    }
                };
            }
        });
    }
}

/// Incoming sessions (migrations and tunnels, both ways) an agent carries at once; a peer
/// that opens more is refused until some end (a host runs a few at a time: `[limits]`).
const MAX_INCOMING_SESSIONS: usize = 256;

/// The ids of incoming sessions that ended, the latest [`FinishedSessions::KEPT`]: a late
/// connection of one of them is refused. An older one would open a session that waits for a
/// first message and ends after `FIRST_MESSAGE_TIMEOUT`.
#[derive(Default)]
struct FinishedSessions {
    ids: HashSet<SessionId>,
    order: std::collections::VecDeque<SessionId>,
}

impl FinishedSessions {
    const KEPT: usize = 1 << 16;

    fn contains(&self, id: &SessionId) -> bool {
        self.ids.contains(id)
    }

    fn insert(&mut self, id: SessionId) {
        if self.ids.insert(id) {
            self.order.push_back(id);
        }
        if self.order.len() > Self::KEPT {
            let oldest = self.order.pop_front().expect("over the limit");
            self.ids.remove(&oldest);
        }
    }
}

impl Agent {
    /// A snapshot of every migration this agent knows (either way, any state).
    pub(crate) fn statuses(&self) -> Vec<MigrationStatus> {
        let migrations = self.migrations.lock().expect("lock");
        migrations.values().map(Shared::get).collect()
    }

    /// The incoming session `id`, created (with its destination task) on first contact.
    fn session_for(self: &Arc<Self>, id: SessionId) -> Option<Session> {
        if self.finished.lock().expect("lock").contains(&id) {
            tracing::warn!("session {id} has ended; connection refused");
            return None;
        }

        let mut sessions = self.sessions.lock().expect("lock");
        if let Some(s) = sessions.get(&id) {
            return Some(s.clone());
        }
        // Ended before this process started: its record survived the restart. A record that
        // cannot be read may be such a one: refused too.
        match self.journal.incoming(id) {
            Ok(None) => {}
            Ok(Some(_)) => {
                tracing::warn!(
                    "session {id} has a record from before a restart; connection refused"
                );
                return None;
            }
            Err(e) => {
                tracing::warn!("session {id}: {e:#}; connection refused");
                return None;
            }
        }
        if sessions.len() >= MAX_INCOMING_SESSIONS {
            tracing::warn!(
                "session {id} refused: {MAX_INCOMING_SESSIONS} incoming sessions are open"
            );
            return None;
        }
        let session = Session::new(id, SessionConfig::default());
        sessions.insert(id, session.clone());
        let (agent, s) = (self.clone(), session.clone());
        tokio::spawn(async move {
            // The first message says what the session is for: a migration, or a tunnel.
            match tokio::time::timeout(FIRST_MESSAGE_TIMEOUT, control::recv(&s)).await {
                Ok(Ok(Control::Tunnel {
                    version,
                    kind,
                    coded,
                    multifd,
                    from,
                    slot,
                })) => {
                    tunnel::serve_destination(
                        s,
                        tunnel::Carried {
                            version,
                            kind,
                            coded,
                            multifd,
                            from,
                            slot,
                        },
                        tunnel::Reachable {
                            config: agent.config.libvirt.clone(),
                            disk_memory: disk_memory(&agent.config),
                            own_name: agent.config.name.clone(),
                            overlay: agent.overlay.clone(),
                            lender: agent.lender.clone(),
                        },
                    )
                    .await;
                }
                Ok(Ok(Control::Verdict {
                    of,
                    started_unix_ms,
                    ..
                })) => {
                    // Decided under the lock sessions start under (see `verdict_for`).
                    let decided = {
                        let sessions = agent.sessions.lock().expect("lock");
                        recovery::verdict_for(
                            &agent.journal,
                            of,
                            started_unix_ms,
                            sessions.contains_key(&of),
                        )
                    };
                    let verdict = match decided {
                        Ok(verdict) => verdict,
                        Err(committing) => {
                            recovery::verdict_after_committing(&agent.journal, *committing).await
                        }
                    };
                    tracing::info!("session {id}: the source asks about session {of}: {verdict:?}");
                    if control::send(&s, &Control::VerdictIs { verdict })
                        .await
                        .is_ok()
                    {
                        let _ = tokio::time::timeout(
                            Duration::from_secs(10),
                            s.flushed(control::CONTROL),
                        )
                        .await;
                    }
                    control::park_and_end(&s, "verdict given").await;
                }
                Ok(Ok(Control::ResumePostcopy { of, .. })) => {
                    let old = agent.sessions.lock().expect("lock").get(&of).cloned();
                    let sessions = agent.clone();
                    postcopy_recovery::resume_destination(
                        s,
                        of,
                        old,
                        move || !sessions.sessions.lock().expect("lock").contains_key(&of),
                        postcopy_recovery::DestinationSide {
                            journal: agent.journal.clone(),
                            work_dir: agent.config.work_dir.clone(),
                            held: agent.held_monitors.clone(),
                        },
                    )
                    .await;
                }
                Ok(Ok(first)) => {
                    let dirs = destination::Dirs {
                        work: agent.config.work_dir.clone(),
                        seeds: agent.config.seed_dir.clone(),
                        monitors: agent.monitors.clone(),
                        journal: agent.journal.clone(),
                        held: agent.held_monitors.clone(),
                    };
                    agent.receiving.fetch_add(1, Ordering::Relaxed);
                    destination::run(s, dirs, first).await;
                    agent.receiving.fetch_sub(1, Ordering::Relaxed);
                    agent.journal.prune_later();
                }
                Ok(Err(e)) => {
                    tracing::warn!("session {id}: {e:#}");
                    s.fail(format!("{e:#}"));
                }
                Err(_) => {
                    tracing::warn!("session {id}: the peer said nothing within 30s");
                    s.fail("the peer said nothing within 30s");
                }
            }
            agent.sessions.lock().expect("lock").remove(&id);
            agent.finished.lock().expect("lock").insert(id);
        });
        Some(session)
    }
}

/// `GET /metrics`: Prometheus's text format, from this agent's migrations.
async fn metrics(State(agent): State<Arc<Agent>>) -> Response {
    let statuses = agent.statuses();
    let mut registry = prometheus_client::registry::Registry::with_prefix("ferry_agent");
    ferry_api::metrics::register_migrations(&mut registry, &statuses, now_ms());
    register_footprint(&mut registry, &agent);
    (
        [("content-type", ferry_api::metrics::CONTENT_TYPE)],
        ferry_api::metrics::encode(&registry),
    )
        .into_response()
}

/// What the agent holds between migrations: its resident memory and open descriptors (from
/// /proc), the sessions it carries, the warm connections and the codec's buffers it keeps.
fn register_footprint(registry: &mut prometheus_client::registry::Registry, agent: &Agent) {
    use prometheus_client::metrics::gauge::Gauge;
    let gauge = |registry: &mut prometheus_client::registry::Registry,
                 name: &str,
                 help: &str,
                 value: Option<u64>| {
        if let Some(value) = value.and_then(|v| i64::try_from(v).ok()) {
            let g = Gauge::<i64>::default();
            g.set(value);
            registry.register(name, help, g);
        }
    };
    // statm's second field: resident pages.
    let resident = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|pages| pages * page_size());
    let fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| d.count() as u64);
    let sessions = agent.sessions.lock().expect("lock").len() as u64;
    gauge(
        registry,
        "resident_bytes",
        "The agent process's resident memory",
        resident,
    );
    gauge(
        registry,
        "open_fds",
        "The agent process's open file descriptors",
        fds,
    );
    gauge(
        registry,
        "incoming_sessions",
        "Sessions from peers this agent carries now",
        Some(sessions),
    );
    gauge(
        registry,
        "parked_connections",
        "Warm connections to peers kept for the next migration",
        Some(agent.pool.parked_total() as u64),
    );
    gauge(
        registry,
        "codec_kept_bytes",
        "Buffers kept for the next migration's codec dictionaries (free to the kernel under pressure)",
        Some(ferry_codec::region::kept_bytes() as u64),
    );
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant of the system; no memory of ours is involved.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

async fn swaps(State(agent): State<Arc<Agent>>) -> Json<Vec<SwapStatus>> {
    Json(agent.swaps.list())
}

async fn take_swap(
    State(agent): State<Arc<Agent>>,
    Path(domain): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let taken = match serde_json::from_slice::<SwapRequest>(&body) {
        Ok(req) => {
            let tunnels = agent.tunnels.as_deref();
            crate::borrow::take(&agent.config, tunnels, &agent.swaps, &domain, req).await
        }
        Err(e) => Err(Refusal::SwapRequest(format!("malformed swap request: {e}"))),
    };
    match taken {
        Ok(status) => (StatusCode::CREATED, Json(status)).into_response(),
        Err(refusal) => refusal.into_response(),
    }
}

async fn give_swap_back(State(agent): State<Arc<Agent>>, Path(domain): Path<String>) -> Response {
    let tunnels = agent.tunnels.as_deref();
    match crate::borrow::give_back(tunnels, &agent.swaps, &domain).await {
        Ok(status) => Json(status).into_response(),
        Err(refusal) => refusal.into_response(),
    }
}

async fn health(State(agent): State<Arc<Agent>>) -> Json<Health> {
    Json(Health {
        name: agent.config.name.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        peer_listen: agent.config.listen.clone(),
    })
}

async fn list(State(agent): State<Arc<Agent>>) -> Json<Vec<MigrationStatus>> {
    let mut all = agent.statuses();
    all.sort_by_key(|m| m.started_unix_ms);
    Json(all)
}

async fn one(State(agent): State<Arc<Agent>>, Path(id): Path<String>) -> Response {
    match agent.migrations.lock().expect("lock").get(&id) {
        Some(m) => Json(m.get()).into_response(),
        None => Refusal::NoMigration(id).into_response(),
    }
}

async fn cancel(State(agent): State<Arc<Agent>>, Path(id): Path<String>) -> Response {
    let Some(m) = agent.migrations.lock().expect("lock").get(&id).cloned() else {
        return Refusal::NoMigration(id).into_response();
    };
    if m.request_cancel() {
        Json(m.get()).into_response()
    } else {
        Refusal::TooLateToCancel(id).into_response()
    }
}

/// Serves the API on its unix socket as `axum::serve` would, but with HTTP/1 half-close: a
/// request the agent received whole is carried out (a migration started, a cancel done) even
/// when its client closed the connection before the answer, where hyper otherwise drops the
/// request's handler on reading the end of the connection.
async fn serve_api(listener: UnixListener, app: Router) -> std::io::Result<()> {
    let service = hyper_util::service::TowerToHyperService::new(app);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of descriptors, for one: the connections being served will free some.
            Err(e) => {
                tracing::warn!("API socket: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = service.clone();
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .half_close(true)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            if let Err(e) = connection.await {
                tracing::debug!("API connection: {e}");
            }
        });
    }
}

async fn start(State(agent): State<Arc<Agent>>, body: axum::body::Bytes) -> Response {
    let started = match serde_json::from_slice(&body) {
        Ok(req) => start_migration(&agent, req, None),
        Err(e) => Err(Refusal::Malformed(e.to_string())),
    };
    match started {
        Ok(status) => (StatusCode::CREATED, Json(status)).into_response(),
        Err(refusal) => refusal.into_response(),
    }
}

/// Checks a migration request and starts it, for the fleet controller's migration `fleet_id`
/// if given; returns its first status.
pub(crate) fn start_migration(
    agent: &Arc<Agent>,
    req: MigrationRequest,
    fleet_id: Option<String>,
) -> Result<MigrationStatus, Refusal> {
    let (req, peer_address) = admit(agent, req)?;
    Ok(launch(agent, req, peer_address, fleet_id))
}

/// Checks a migration request whole before anything happens: its settings, its peer, its
/// names, the agent's limits. Returns it with the peer's address and link rate filled in.
fn admit(agent: &Agent, mut req: MigrationRequest) -> Result<(MigrationRequest, String), Refusal> {
    req.settings.validate()?;
    let peer = agent.config.peer(&req.to)?.clone();
    req.link_rate_mbit = req.link_rate_mbit.or(peer.rate_mbit);
    // A QEMU the destination agent starts gets its monitor there under the VM's name.
    if !matches!(req.destination, Destination::Qmp(_)) {
        MonitorDir::check_name(&req.vm).map_err(|e| Refusal::VmName(e.to_string()))?;
    }
    // The seed image names become file names at both ends: refuse what cannot be one now,
    // rather than after the destination QEMU was prepared.
    if req.settings.codec.seed {
        for name in std::iter::once(&req.vm).chain(req.settings.seed_from.as_ref()) {
            crate::engine::seed_store::image_path(&agent.config.seed_dir, name)
                .map_err(|e| Refusal::SeedName(format!("{e:#}")))?;
        }
    }
    check_limits(agent, &agent.migrations.lock().expect("lock"), &req.vm)?;
    Ok((req, peer.address))
}

/// The agent's limits: how many migrations it sends at once, one per VM.
fn check_limits(
    agent: &Agent,
    migrations: &HashMap<String, Shared>,
    vm: &str,
) -> Result<(), Refusal> {
    let running = migrations
        .values()
        .filter(|m| m.update(|s| s.state == MigrationState::Running))
        .count();
    if running >= agent.config.max_outgoing {
        return Err(Refusal::Busy { running });
    }
    if let Some(m) = migrations
        .values()
        .find(|m| m.update(|s| s.state == MigrationState::Running && s.vm == vm))
    {
        return Err(Refusal::AlreadyMigrating {
            vm: vm.to_owned(),
            id: m.get().id,
        });
    }
    Ok(())
}

async fn start_libvirt(State(agent): State<Arc<Agent>>, body: axum::body::Bytes) -> Response {
    let started = match serde_json::from_slice(&body) {
        Ok(req) => start_libvirt_migration(&agent, req, None, None).await,
        Err(e) => Err(Refusal::Malformed(e.to_string())),
    };
    match started {
        Ok(status) => (StatusCode::CREATED, Json(status)).into_response(),
        Err(refusal) => refusal.into_response(),
    }
}

/// A paced disk copy's baseline starts here: the guest's IO before libvirt starts anything.
/// libvirt not saying: the copy is not paced (said in the log).
async fn relay_pacing(libvirt: &Libvirt, req: &LibvirtMigrationRequest) -> Option<RelayPacing> {
    let floor = f64::from(req.settings.disk_pacing_floor_pct?) / 100.0;
    match libvirt.guest_io(&req.domain).await {
        Ok(io) => Some(RelayPacing {
            libvirt: libvirt.clone(),
            domain: req.domain.clone(),
            before: (std::time::Instant::now(), io),
            floor,
        }),
        Err(e) => {
            tracing::warn!(
                "{}'s disk IO is unknown ({e:#}): its disk copy is not paced",
                req.domain
            );
            None
        }
    }
}

/// Checks a libvirt migration request (its settings, its peer, the domain in libvirt, the
/// agent's limits) and starts it, for the fleet controller's migration `fleet_id` if given;
/// returns its first status.
pub(crate) async fn start_libvirt_migration(
    agent: &Arc<Agent>,
    mut req: LibvirtMigrationRequest,
    fleet_id: Option<String>,
    group: Option<String>,
) -> Result<MigrationStatus, Refusal> {
    req.settings.validate()?;
    libvirt_migration::check_settings(&req)?;
    let tunnels = agent.tunnels.clone().ok_or(Refusal::NoLibvirt)?;
    let peer = agent.config.peer(&req.to)?.clone();
    req.link_rate_mbit = req.link_rate_mbit.or(peer.rate_mbit);
    let libvirt = Libvirt::new(&tunnels.config.socket);
    libvirt_migration::check_domain(&libvirt, &req.domain).await?;
    // Its swap disk names this host's tunnel to the lender, and holds some of its pages.
    if agent.swaps.has(&req.domain) {
        return Err(Refusal::MigratingWithSwap(req.domain));
    }
    tunnels.check_peer_libvirt(&req.to).await?;
    let pacing = relay_pacing(&libvirt, &req).await;
    // Read before the domain leaves: which image each export is, here and (libvirt keeps the
    // paths) at the destination.
    let disks = if req.copy_storage {
        let read = libvirt.disk_sources(&req.domain).await;
        Some(read.map_err(|e| format!("{e:#}")))
    } else {
        None
    };
    let id = format!("{:016x}", SessionId::random().0 >> 64);
    let group = match (&fleet_id, group) {
        (Some(fleet_id), Some(group)) => Some(agent.groups.join(fleet_id, &group)),
        _ => None,
    };
    let status = Shared::new(MigrationStatus {
        fleet_id,
        ..MigrationStatus::starting(id.clone(), req.domain.clone(), now_ms())
    });
    {
        let migrations = agent.migrations.lock().expect("lock");
        check_limits(agent, &migrations, &req.domain)?;
        let claim = tunnels.claim(
            &req.to,
            tunnel::Claimed {
                status: status.clone(),
                settings: req.settings.clone(),
                group: group.clone(),
                pacing,
                copies: Arc::new(tunnel::DiskCopies::new(disks)),
            },
        )?;
        drop(migrations);
        crate::engine::status::register(&agent.migrations, id.clone(), status.clone());
        let rate = req.link_rate_mbit;
        tokio::spawn(libvirt_migration::run(
            libvirt,
            tunnels,
            claim,
            req,
            rate,
            group,
            status.clone(),
        ));
    }
    Ok(status.get())
}

/// Starts an admitted migration's task; returns its first status.
fn launch(
    agent: &Arc<Agent>,
    req: MigrationRequest,
    peer_address: String,
    fleet_id: Option<String>,
) -> MigrationStatus {
    // 64 random bits are plenty for ids on one agent.
    let id = format!("{:016x}", SessionId::random().0 >> 64);
    let status = Shared::new(MigrationStatus {
        // Between the source's STOP and the destination's RESUME nothing waits for an answer
        // from the other side: the last bytes and the digest travel together, one way. With
        // QEMU's return path the source QEMU also waits for the destination's confirmation.
        switchover_round_trips: Some(if req.settings.return_path { 1.5 } else { 0.5 }),
        fleet_id,
        ..MigrationStatus::starting(id.clone(), req.vm.clone(), now_ms())
    });
    crate::engine::status::register(&agent.migrations, id.clone(), status.clone());
    tokio::spawn(source::run(
        req,
        peer_address,
        status.clone(),
        agent.client_tls.clone(),
        agent.pool.clone(),
        agent.journal.clone(),
        agent.config.work_dir.clone(),
        agent.config.seed_dir.clone(),
        agent.config.seed_budget_bytes,
    ));
    status.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_sessions_are_remembered_up_to_their_cap_oldest_forgotten_first() {
        let mut finished = FinishedSessions::default();
        let kept = u128::try_from(FinishedSessions::KEPT).unwrap();
        for id in 0..kept + 10 {
            finished.insert(SessionId(id));
            finished.insert(SessionId(id));
        }
        assert_eq!(finished.ids.len(), FinishedSessions::KEPT);
        assert_eq!(finished.order.len(), FinishedSessions::KEPT);
        assert!(!finished.contains(&SessionId(9)));
        assert!(finished.contains(&SessionId(10)));
        assert!(finished.contains(&SessionId(kept + 9)));
    }
}
