//! A fake QEMU behind a QMP socket: as much of QEMU as the engine uses, with gates a test holds
//! to put a fault in a chosen phase. The source writes a real captured stream when told to
//! migrate; the destination loads a stream, and says it completed only if it got exactly those
//! bytes (a real QEMU's device state would not load otherwise), else that it failed.
//!
//! A postcopy stream (one with a package) goes as QEMU 10.0 sends it: the source writes up to
//! the package, waits there for `migrate-start-postcopy`, stops the VM and is `postcopy-active`
//! from then on (a failure then leaves it `postcopy-paused`, and `migrate_cancel` is refused);
//! the destination, once it read the package, stays paused and takes `cont` before the stream
//! ends. With `postcopy-preempt` on at both, the source opens a second connection at the
//! switch and writes [`PREEMPT_PAGES`] on it once the package is out (the pages the guest
//! faulted on); the destination completes only if they arrived on its second connection.
//!
//! Postcopy recovery as QEMU's: a postcopy migration whose connection breaks goes
//! `postcopy-paused` at either end. The destination's `migrate-recover` listens again, and
//! the source's `migrate resume=true` connects there (and a new preempt channel, with
//! [`PREEMPT_PAGES`] again) and writes everything after the package again, which the
//! destination takes in place of what it had after the package (the bitmap exchange of a
//! real QEMU, abridged). While the destination's migration is paused its main thread is
//! taken to wait on a page fault, as a real one's does once it touches a missing page: it
//! answers in-band commands (the QMP handshake of a new connection too) only once the pages
//! flow again, and out-of-band ones (`exec-oob`: `migrate-recover`, `migrate-pause`) at once
//! on a connection that negotiated them. It announces its migration's states in `MIGRATION`
//! events.
//!
//! Each fake runs on its own runtime, so that [`FakeQemu::kill`] takes all of it down at once,
//! as a killed process would: its sockets close, its migration stops half way.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::runtime::Runtime;
use tokio::sync::{mpsc, watch};

/// The guest's memory as `query-memory-size-summary` tells it (the captured streams' VM).
const RAM_BYTES: u64 = 64 << 20;
/// The source writes its stream in pieces of this size.
pub const PIECE: usize = 16 << 10;
/// A postcopy stream's source has throttled its guest this hard (percent) where it waits for
/// the switch.
pub const THROTTLE_AT_THE_SWITCH: u64 = 40;
/// What the source writes on its postcopy preempt channel.
pub const PREEMPT_PAGES: &[u8] = &[0x5a; 3 * 4096];

/// A point a fake stops at until the test opens it; the test can see that it was reached.
#[derive(Clone)]
pub struct Gate {
    open: watch::Sender<bool>,
    reached: watch::Sender<bool>,
}

impl Gate {
    fn new(open: bool) -> Gate {
        Gate {
            open: watch::Sender::new(open),
            reached: watch::Sender::new(false),
        }
    }

    /// Waits (in the fake) until the gate is open, saying it was reached.
    async fn pass(&self) {
        self.reached.send_replace(true);
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|&o| o).await;
    }

    /// Waits (in the test) until the fake stands at the gate.
    pub async fn wait_reached(&self, what: &str) {
        let mut reached = self.reached.subscribe();
        tokio::time::timeout(Duration::from_secs(60), reached.wait_for(|&r| r))
            .await
            .unwrap_or_else(|_| panic!("{what}: not reached within 60 s"))
            .expect("gate");
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Shuts the gate again, to hold the fake the next time it comes by.
    pub fn close(&self) {
        self.open.send_replace(false);
        self.reached.send_replace(false);
    }
}

/// Where a fake stops until the test lets it on; all open unless a test closes one.
#[derive(Clone)]
pub struct Gates {
    /// Source: before writing the stream byte at this offset (`None`: never stops).
    pub stream_at: Option<(u64, Gate)>,
    /// Destination: before reading the stream beyond this offset (`None`: never stops).
    pub read_at: Option<(u64, Gate)>,
    /// Destination: with the whole stream read, before it says whether it loaded.
    pub load: Gate,
    /// Destination: `cont` received, before the VM resumes and QEMU answers.
    pub cont: Gate,
    /// Destination: how many `cont`s are refused (the VM not resumed) before one is taken.
    pub refuse_cont: Arc<std::sync::atomic::AtomicU32>,
    /// Source: `pmemsave` received (the agent keeps the VM's memory for its return, after
    /// the commit and before it quits QEMU), before it answers (that it has no such command).
    pub pmemsave: Gate,
}

impl Default for Gates {
    fn default() -> Gates {
        Gates {
            stream_at: None,
            read_at: None,
            load: Gate::new(true),
            cont: Gate::new(true),
            refuse_cont: Arc::default(),
            pmemsave: Gate::new(true),
        }
    }
}

impl Gates {
    /// Gates with the source's stream held at `offset`.
    pub fn stream_held_at(offset: u64) -> Gates {
        Gates {
            stream_at: Some((offset, Gate::new(false))),
            ..Gates::default()
        }
    }

    /// Gates with the destination's reading held at `offset`.
    pub fn read_held_at(offset: u64) -> Gates {
        Gates {
            read_at: Some((offset, Gate::new(false))),
            ..Gates::default()
        }
    }

    pub fn read(&self) -> &Gate {
        &self.read_at.as_ref().expect("a read gate").1
    }

    pub fn load_held() -> Gates {
        Gates {
            load: Gate::new(false),
            ..Gates::default()
        }
    }

    pub fn cont_held() -> Gates {
        Gates {
            cont: Gate::new(false),
            ..Gates::default()
        }
    }

    pub fn pmemsave_held() -> Gates {
        Gates {
            pmemsave: Gate::new(false),
            ..Gates::default()
        }
    }

    pub fn cont_refused_once() -> Gates {
        let gates = Gates::default();
        gates
            .refuse_cont
            .store(1, std::sync::atomic::Ordering::SeqCst);
        gates
    }

    pub fn stream(&self) -> &Gate {
        &self.stream_at.as_ref().expect("a stream gate").1
    }
}

/// What the fake did, for the test's assertions.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// `query-status`'s status: running, inmigrate, paused, postmigrate.
    pub status: String,
    /// `query-migrate`'s status, once a migration started.
    pub migration: Option<String>,
    pub error: Option<String>,
    /// Every command, in order.
    pub commands: Vec<String>,
    /// Source: stream bytes written. Destination: stream bytes read.
    pub stream_bytes: u64,
    /// Destination: whether what it read was exactly the expected stream.
    pub loaded: bool,
    /// QMP clients that have come and gone.
    pub clients_gone: u32,
    /// Whether a QMP client is connected now.
    pub client_connected: bool,
    /// Destination: the stream bytes it had read when it resumed the VM.
    pub resumed_at_bytes: Option<u64>,
    /// Capabilities set on.
    pub capabilities: Vec<String>,
    /// Migration parameters as last set (`migrate-set-parameters`), by QMP name.
    pub parameters: serde_json::Map<String, Value>,
    /// Source: preempt-channel bytes written. Destination: read, and the main stream's bytes
    /// read when they were.
    pub preempt_bytes: u64,
    pub preempt_at_stream_bytes: Option<u64>,
}

impl Seen {
    pub fn running(&self) -> bool {
        self.status == "running"
    }

    pub fn ran(&self, command: &str) -> bool {
        self.commands.iter().any(|c| c == command)
    }

    pub fn has(&self, capability: &str) -> bool {
        self.capabilities.iter().any(|c| c == capability)
    }
}

#[derive(Clone)]
enum Role {
    /// Migrates this stream when told.
    Source(Arc<Vec<u8>>),
    /// Loads a stream, which must be this one.
    Destination(Arc<Vec<u8>>),
}

struct Shared {
    role: Role,
    /// Where the stream's postcopy package starts and ends, if it has one.
    package: Option<(usize, usize)>,
    /// Source: `migrate-start-postcopy` asked for.
    postcopy_asked: watch::Sender<bool>,
    gates: Gates,
    seen: Mutex<Seen>,
    /// The connected client's event queue.
    events: Mutex<Option<mpsc::UnboundedSender<String>>>,
    /// Source: `migrate_cancel` asked for.
    cancel: watch::Sender<bool>,
    /// Destination: what it had read when its postcopy migration paused.
    paused_with: Mutex<Option<Vec<u8>>>,
    /// Destination: its main thread waits on a page fault (in-band commands wait).
    main_blocked: watch::Sender<bool>,
}

impl Shared {
    fn update<T>(&self, f: impl FnOnce(&mut Seen) -> T) -> T {
        f(&mut self.seen.lock().expect("seen"))
    }

    /// A destination's migration state, announced as QEMU does.
    fn set_migration(&self, status: &str) {
        self.update(|s| s.migration = Some(status.into()));
        self.event("MIGRATION", json!({ "status": status }));
    }

    fn event(&self, name: &str, data: Value) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock");
        let line = json!({
            "event": name,
            "data": data,
            "timestamp": {"seconds": now.as_secs(), "microseconds": now.subsec_micros()},
        });
        if let Some(tx) = &*self.events.lock().expect("events") {
            let _ = tx.send(format!("{line}\n"));
        }
    }
}

pub struct FakeQemu {
    pub qmp: PathBuf,
    shared: Arc<Shared>,
    rt: Option<Runtime>,
}

impl FakeQemu {
    /// A running VM that will migrate `stream`.
    pub fn source(dir: &Path, stream: Arc<Vec<u8>>, gates: Gates) -> FakeQemu {
        FakeQemu::start(
            dir.join("source.qmp"),
            Role::Source(stream),
            gates,
            "running",
        )
    }

    /// A QEMU started with `-incoming defer`, waiting for `stream`.
    pub fn destination(dir: &Path, stream: Arc<Vec<u8>>, gates: Gates) -> FakeQemu {
        FakeQemu::start(
            dir.join("destination.qmp"),
            Role::Destination(stream),
            gates,
            "inmigrate",
        )
    }

    fn start(qmp: PathBuf, role: Role, gates: Gates, status: &str) -> FakeQemu {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let package = match &role {
            Role::Source(stream) | Role::Destination(stream) => package_of(stream),
        };
        let shared = Arc::new(Shared {
            role,
            package,
            postcopy_asked: watch::Sender::new(false),
            gates,
            seen: Mutex::new(Seen {
                status: status.into(),
                ..Seen::default()
            }),
            events: Mutex::new(None),
            cancel: watch::Sender::new(false),
            paused_with: Mutex::new(None),
            main_blocked: watch::Sender::new(false),
        });
        let _ = std::fs::remove_file(&qmp);
        let listener = {
            let _guard = rt.enter();
            UnixListener::bind(&qmp).expect("bind the fake's QMP socket")
        };
        rt.spawn(serve_qmp(listener, shared.clone()));
        FakeQemu {
            qmp,
            shared,
            rt: Some(rt),
        }
    }

    pub fn seen(&self) -> Seen {
        self.shared.update(|s| s.clone())
    }

    pub fn gates(&self) -> &Gates {
        &self.shared.gates
    }

    /// The process dies: every socket closes, nothing more is written or answered.
    /// Its monitor is gone when this returns: a connection refused, never one accepted and
    /// then reset by a runtime still shutting down.
    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            let flavor = tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
            match flavor {
                Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                    tokio::task::block_in_place(|| rt.shutdown_timeout(Duration::from_secs(10)));
                }
                Ok(_) => rt.shutdown_background(),
                Err(_) => rt.shutdown_timeout(Duration::from_secs(10)),
            }
        }
    }
}

impl Drop for FakeQemu {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One QMP client at a time, as QEMU's monitor.
async fn serve_qmp(listener: UnixListener, shared: Arc<Shared>) {
    while let Ok((conn, _)) = listener.accept().await {
        shared.update(|s| s.client_connected = true);
        let (r, mut w) = conn.into_split();
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        *shared.events.lock().expect("events") = Some(tx.clone());
        let writer = tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                if w.write_all(line.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
        let _ = tx.send("{\"QMP\": {\"version\": {}, \"capabilities\": [\"oob\"]}}\n".into());
        let mut lines = BufReader::new(r).lines();
        let mut oob = false;
        while let Ok(Some(line)) = lines.next_line().await {
            let Ok(cmd) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            let out_of_band = cmd["exec-oob"].is_string();
            let name = cmd[if out_of_band { "exec-oob" } else { "execute" }]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            if name == "qmp_capabilities" {
                oob = cmd["arguments"]["enable"]
                    .as_array()
                    .is_some_and(|caps| caps.iter().any(|c| c == "oob"));
            }
            if out_of_band && !(oob && matches!(name.as_str(), "migrate-recover" | "migrate-pause"))
            {
                let reply = json!({
                    "error": {"class": "GenericError", "desc": format!("{name} cannot run out of band here")},
                    "id": cmd["id"],
                });
                let _ = tx.send(format!("{reply}\n"));
                continue;
            }
            if !out_of_band && *shared.main_blocked.borrow() {
                // The main thread waits on a page: the command runs once it has it.
                let (shared, tx) = (shared.clone(), tx.clone());
                tokio::spawn(async move {
                    let mut free = shared.main_blocked.subscribe();
                    let _ = free.wait_for(|blocked| !blocked).await;
                    let _ = tx.send(run_command(&shared, &name, &cmd).await);
                });
                continue;
            }
            let _ = tx.send(run_command(&shared, &name, &cmd).await);
            if name == "quit" {
                break;
            }
        }
        // The next client gets its own queue; this one's writer ends with its last sender.
        *shared.events.lock().expect("events") = None;
        drop(tx);
        let _ = writer.await;
        shared.update(|s| {
            s.clients_gone += 1;
            s.client_connected = false;
        });
    }
}

/// Runs one command and gives its reply line.
async fn run_command(shared: &Arc<Shared>, name: &str, cmd: &Value) -> String {
    shared.update(|s| s.commands.push(name.to_owned()));
    let reply = match execute(shared, name, &cmd["arguments"]).await {
        Ok(value) => json!({"return": value, "id": cmd["id"]}),
        Err(desc) => json!({
            "error": {"class": "GenericError", "desc": desc},
            "id": cmd["id"],
        }),
    };
    format!("{reply}\n")
}

async fn execute(shared: &Arc<Shared>, name: &str, args: &Value) -> Result<Value, String> {
    let seen = shared.update(|s| s.clone());
    match name {
        "qmp_capabilities" => Ok(json!({})),
        "migrate-set-parameters" => {
            let set = args.as_object().cloned().unwrap_or_default();
            shared.update(|s| s.parameters.extend(set));
            Ok(json!({}))
        }
        "migrate-set-capabilities" => {
            let caps = args["capabilities"].as_array().cloned().unwrap_or_default();
            shared.update(|s| {
                for cap in caps {
                    let name = cap["capability"].as_str().unwrap_or_default().to_string();
                    s.capabilities.retain(|c| *c != name);
                    if cap["state"] == true {
                        s.capabilities.push(name);
                    }
                }
            });
            Ok(json!({}))
        }
        "query-status" => Ok(json!({"running": seen.running(), "status": seen.status})),
        "query-memory-size-summary" => Ok(json!({"base-memory": RAM_BYTES})),
        "query-migrate" => Ok(query_migrate(shared, &seen)),
        "migrate" => {
            let Role::Source(stream) = &shared.role else {
                return Err("not a source".into());
            };
            let path = unix_path(args)?;
            if args["resume"] == true {
                if seen.migration.as_deref() != Some("postcopy-paused") {
                    return Err("Cannot resume if there is no paused migration".into());
                }
                shared.update(|s| s.migration = Some("postcopy-recover".into()));
                tokio::spawn(send_resumed(shared.clone(), stream.clone(), path));
                return Ok(json!({}));
            }
            shared.update(|s| s.migration = Some("active".into()));
            tokio::spawn(send_stream(shared.clone(), stream.clone(), path));
            Ok(json!({}))
        }
        "migrate-recover" => {
            let Role::Destination(expected) = &shared.role else {
                return Err("not a destination".into());
            };
            let Some(got) = shared.paused_with.lock().expect("paused").take() else {
                return Err("Migrate recover can only be run when postcopy is paused.".into());
            };
            let path = unix_path(args)?;
            let listener = UnixListener::bind(&path).map_err(|e| format!("bind: {e}"))?;
            shared.set_migration("postcopy-recover");
            tokio::spawn(load_resumed(
                shared.clone(),
                expected.clone(),
                listener,
                got,
            ));
            Ok(json!({}))
        }
        "migrate_cancel" => {
            if seen
                .migration
                .as_deref()
                .is_some_and(|m| m.starts_with("postcopy"))
            {
                return Err("Postcopy migration in progress, cannot cancel.".into());
            }
            shared.cancel.send_replace(true);
            Ok(json!({}))
        }
        "migrate-start-postcopy" => {
            shared.postcopy_asked.send_replace(true);
            Ok(json!({}))
        }
        "migrate-incoming" => {
            let Role::Destination(expected) = &shared.role else {
                return Err("not a destination".into());
            };
            let path = unix_path(args)?;
            let listener = UnixListener::bind(&path).map_err(|e| format!("bind: {e}"))?;
            shared.set_migration("active");
            tokio::spawn(load_stream(shared.clone(), expected.clone(), listener));
            Ok(json!({}))
        }
        "cont" => {
            if seen.status == "inmigrate" && seen.migration.as_deref() != Some("completed") {
                return Err("the VM has not been loaded yet".into());
            }
            shared.gates.cont.pass().await;
            let refusals = &shared.gates.refuse_cont;
            if refusals
                .fetch_update(
                    std::sync::atomic::Ordering::SeqCst,
                    std::sync::atomic::Ordering::SeqCst,
                    |n| n.checked_sub(1),
                )
                .is_ok()
            {
                return Err("cont refused (a test's fault)".into());
            }
            shared.update(|s| {
                s.status = "running".into();
                s.resumed_at_bytes = Some(s.stream_bytes);
            });
            shared.event("RESUME", json!({}));
            Ok(json!({}))
        }
        "quit" => {
            shared.update(|s| s.status = "shutdown".into());
            Ok(json!({}))
        }
        "pmemsave" => {
            shared.gates.pmemsave.pass().await;
            Err("the fake QEMU keeps no memory image".into())
        }
        // What a real QEMU has and this one does not: the engine must get by without it
        // (known-zero discovery, the seed image).
        other => Err(format!("the fake QEMU has no {other}")),
    }
}

fn query_migrate(shared: &Shared, seen: &Seen) -> Value {
    let Some(status) = &seen.migration else {
        return json!({});
    };
    let total = match &shared.role {
        Role::Source(stream) | Role::Destination(stream) => stream.len() as u64,
    };
    json!({
        "status": status,
        "error-desc": seen.error,
        "ram": {
            "transferred": seen.stream_bytes,
            "remaining": total.saturating_sub(seen.stream_bytes),
            "total": RAM_BYTES,
            // A postcopy stream's first pass is done where it waits for the switch.
            "dirty-sync-count": match shared.package {
                Some((start, _)) if seen.stream_bytes >= start as u64 => 2,
                _ => 1,
            },
        },
        // And auto-converge has throttled the guest by then.
        "cpu-throttle-percentage": match shared.package {
            Some((start, _)) if seen.stream_bytes >= start as u64 => THROTTLE_AT_THE_SWITCH,
            _ => 0,
        },
    })
}

/// Where `stream`'s postcopy package starts (its command) and ends, if it has one.
pub fn package_of(stream: &[u8]) -> Option<(usize, usize)> {
    use ferry_qemu::stream::{Postcopy, StreamParser};
    let mut parser = StreamParser::new();
    let mut buf = bytes::BytesMut::from(stream);
    let mut start = None;
    loop {
        let before = parser.position();
        parser.next_item(&mut buf).ok()??;
        if parser.postcopy() == Postcopy::Package {
            start.get_or_insert(before);
        }
        if parser.ended_package() {
            let start = usize::try_from(start.unwrap_or(before)).ok()?;
            return Some((start, usize::try_from(parser.position()).ok()?));
        }
    }
}

fn unix_path(args: &Value) -> Result<PathBuf, String> {
    args["uri"]
        .as_str()
        .and_then(|u| u.strip_prefix("unix:"))
        .map(PathBuf::from)
        .ok_or_else(|| format!("unsupported uri {}", args["uri"]))
}

/// The source's migration: the stream into the agent's socket, then QEMU's end of it.
async fn send_stream(shared: Arc<Shared>, stream: Arc<Vec<u8>>, path: PathBuf) {
    let mut cancel = shared.cancel.subscribe();
    let fail = |why: String| {
        shared.update(|s| {
            s.error = Some(why);
            if s.migration.as_deref() == Some("postcopy-active") {
                // QEMU 10.0 neither fails nor resumes a postcopy migration.
                s.migration = Some("postcopy-paused".into());
            } else {
                s.migration = Some("failed".into());
                s.status = "running".into();
            }
        });
    };
    let mut conn = match UnixStream::connect(&path).await {
        Ok(conn) => conn,
        Err(e) => return fail(format!("connect {}: {e}", path.display())),
    };
    let mut at = 0usize;
    let last_piece = stream.len().saturating_sub(PIECE);
    let mut preempt: Option<UnixStream> = None;
    let mut faulted = false;
    while at < stream.len() {
        if let (Some(conn), Some((_, end)), false) = (&mut preempt, shared.package, faulted) {
            if at >= end {
                // The guest runs at the destination and faults: its pages come first.
                if let Err(e) = conn.write_all(PREEMPT_PAGES).await {
                    return fail(format!("writing the preempt channel: {e}"));
                }
                faulted = true;
                shared.update(|s| s.preempt_bytes = PREEMPT_PAGES.len() as u64);
            }
        }
        if let Some((offset, gate)) = &shared.gates.stream_at {
            if at as u64 <= *offset && *offset < (at + PIECE) as u64 {
                gate.pass().await;
            }
        }
        if let Some((start, _)) = shared.package {
            if at + PIECE > start && shared.update(|s| s.status == "running") {
                // Only what comes before the package, then the switch.
                if at < start {
                    if let Err(e) = conn.write_all(&stream[at..start]).await {
                        return fail(format!("writing the stream: {e}"));
                    }
                    at = start;
                    shared.update(|s| s.stream_bytes = at as u64);
                }
                let mut asked = shared.postcopy_asked.subscribe();
                tokio::select! {
                    _ = asked.wait_for(|&a| a) => {}
                    _ = cancel.wait_for(|&c| c) => {
                        shared.update(|s| {
                            s.migration = Some("cancelled".into());
                            s.status = "running".into();
                        });
                        return;
                    }
                }
                shared.update(|s| {
                    s.status = "finish-migrate".into();
                    s.migration = Some("postcopy-active".into());
                });
                shared.event("STOP", json!({}));
                if shared.update(|s| s.has("postcopy-preempt")) {
                    // QEMU 10.0 connects its preempt channel before it sends the package.
                    match UnixStream::connect(&path).await {
                        Ok(c) => preempt = Some(c),
                        Err(e) => return fail(format!("connect the preempt channel: {e}")),
                    }
                }
                continue;
            }
        }
        if at >= last_piece && shared.update(|s| s.status == "running") {
            // The last pass: the VM stops.
            shared.update(|s| s.status = "finish-migrate".into());
            shared.event("STOP", json!({}));
        }
        let end = (at + PIECE).min(stream.len());
        tokio::select! {
            r = conn.write_all(&stream[at..end]) => if let Err(e) = r {
                return fail(format!("writing the stream: {e}"));
            },
            _ = cancel.wait_for(|&c| c) => {
                shared.update(|s| {
                    s.migration = Some("cancelled".into());
                    s.status = "running".into();
                });
                return;
            }
        }
        at = end;
        shared.update(|s| s.stream_bytes = at as u64);
    }
    let _ = conn.shutdown().await;
    if let Some(mut conn) = preempt {
        let _ = conn.shutdown().await;
    }
    shared.update(|s| {
        s.migration = Some("completed".into());
        s.status = "postmigrate".into();
    });
    shared.event("MIGRATION", json!({"status": "completed"}));
}

/// The source's resumed postcopy migration: everything after the package again, with the
/// faulted pages on a new preempt channel.
async fn send_resumed(shared: Arc<Shared>, stream: Arc<Vec<u8>>, path: PathBuf) {
    let fail = |why: String| {
        shared.update(|s| {
            s.error = Some(why);
            s.migration = Some("postcopy-paused".into());
        });
    };
    let (_, package_end) = shared.package.expect("a postcopy stream");
    let mut conn = match UnixStream::connect(&path).await {
        Ok(conn) => conn,
        Err(e) => return fail(format!("connect {}: {e}", path.display())),
    };
    let mut preempt = match UnixStream::connect(&path).await {
        Ok(conn) => conn,
        Err(e) => return fail(format!("connect the preempt channel: {e}")),
    };
    shared.update(|s| s.migration = Some("postcopy-active".into()));
    if let Err(e) = preempt.write_all(PREEMPT_PAGES).await {
        return fail(format!("writing the preempt channel: {e}"));
    }
    for (i, piece) in stream[package_end..].chunks(PIECE).enumerate() {
        // The stream's gate holds a resumed stream too, at the same place in it.
        let at = (package_end + i * PIECE) as u64;
        if let Some((offset, gate)) = &shared.gates.stream_at {
            if at <= *offset && *offset < at + PIECE as u64 {
                gate.pass().await;
            }
        }
        if let Err(e) = conn.write_all(piece).await {
            return fail(format!("writing the resumed stream: {e}"));
        }
        shared.update(|s| s.stream_bytes += piece.len() as u64);
    }
    let _ = conn.shutdown().await;
    let _ = preempt.shutdown().await;
    shared.update(|s| {
        s.migration = Some("completed".into());
        s.status = "postmigrate".into();
    });
    shared.event("MIGRATION", json!({"status": "completed"}));
}

/// The destination's load: the whole stream, then whether it was the one expected.
async fn load_stream(shared: Arc<Shared>, expected: Arc<Vec<u8>>, listener: UnixListener) {
    let Ok((mut conn, _)) = listener.accept().await else {
        return;
    };
    // The preempt channel: the second connection, read to its end.
    let preempt = shared.update(|s| s.has("postcopy-preempt")).then(|| {
        let shared = shared.clone();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.ok()?;
            let mut got = Vec::new();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        got.extend_from_slice(&buf[..n]);
                        shared.update(|s| {
                            s.preempt_bytes = got.len() as u64;
                            s.preempt_at_stream_bytes.get_or_insert(s.stream_bytes);
                        });
                    }
                }
            }
            Some(got)
        })
    });
    let mut got = Vec::with_capacity(expected.len());
    let mut buf = vec![0u8; 64 << 10];
    while got.len() < expected.len() {
        let mut want = buf.len();
        if let Some((offset, gate)) = &shared.gates.read_at {
            let offset = usize::try_from(*offset).expect("small");
            if got.len() >= offset {
                gate.pass().await;
            } else {
                want = want.min(offset - got.len());
            }
        }
        match conn.read(&mut buf[..want]).await {
            Ok(0) | Err(_) => {
                if shared.update(|s| s.migration.as_deref() == Some("postcopy-active")) {
                    // The VM runs here without all of its pages: it waits for a recovery.
                    *shared.paused_with.lock().expect("paused") = Some(got);
                    shared.main_blocked.send_replace(true);
                    shared.set_migration("postcopy-paused");
                    return;
                }
                break;
            }
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                let package_loaded = shared
                    .package
                    .is_some_and(|(_, end)| got.len() >= end && got[..end] == expected[..end]);
                shared.update(|s| {
                    s.stream_bytes = got.len() as u64;
                    if package_loaded && s.status == "inmigrate" {
                        // The device state loaded; started with -S, it waits for `cont`.
                        s.status = "paused".into();
                        s.migration = Some("postcopy-active".into());
                    }
                });
            }
        }
    }
    shared.gates.load.pass().await;
    // A postcopy migration completes once its preempt channel ended too, with what the
    // source wrote on it.
    let switched = shared.update(|s| s.migration.as_deref() == Some("postcopy-active"));
    let preempt_intact = match preempt {
        Some(task) if switched => task.await.ok().flatten().as_deref() == Some(PREEMPT_PAGES),
        _ => true,
    };
    finish_load(&shared, &expected, &got, preempt_intact);
}

/// The destination's resumed postcopy migration: the source's stream after the package again
/// (main connection), and its new preempt channel.
async fn load_resumed(
    shared: Arc<Shared>,
    expected: Arc<Vec<u8>>,
    listener: UnixListener,
    mut got: Vec<u8>,
) {
    let Ok((mut conn, _)) = listener.accept().await else {
        return;
    };
    shared.set_migration("postcopy-active");
    // The page its main thread waited for arrives first.
    shared.main_blocked.send_replace(false);
    // The preempt channel, the second connection, whenever it comes.
    let preempt = tokio::spawn(async move {
        let (mut preempt, _) = listener.accept().await.ok()?;
        let mut faulted = vec![0u8; PREEMPT_PAGES.len()];
        preempt.read_exact(&mut faulted).await.ok()?;
        Some(faulted)
    });
    let (_, package_end) = shared.package.expect("a postcopy stream");
    got.truncate(package_end);
    // As QEMU, it knows from what it read when it has everything (its agent keeps the
    // connections open).
    let mut resumed = vec![0u8; expected.len().saturating_sub(package_end)];
    let faulted = match conn.read_exact(&mut resumed).await {
        Ok(_) => preempt.await.ok().flatten(),
        Err(_) => {
            preempt.abort();
            None
        }
    };
    let Some(faulted) = faulted else {
        // Its connection broke again: paused again, for another recovery.
        *shared.paused_with.lock().expect("paused") = Some(got);
        shared.main_blocked.send_replace(true);
        shared.set_migration("postcopy-paused");
        return;
    };
    got.extend_from_slice(&resumed);
    shared.update(|s| {
        s.stream_bytes = got.len() as u64;
        s.preempt_bytes = faulted.len() as u64;
    });
    finish_load(&shared, &expected, &got, faulted == PREEMPT_PAGES);
}

fn finish_load(shared: &Shared, expected: &[u8], got: &[u8], preempt_intact: bool) {
    let loaded = got == expected && preempt_intact;
    shared.event(
        "MIGRATION",
        json!({ "status": if loaded { "completed" } else { "failed" } }),
    );
    shared.update(|s| {
        s.loaded = loaded;
        if loaded {
            s.migration = Some("completed".into());
            if s.status != "running" {
                s.status = "paused".into();
            }
        } else {
            s.migration = Some("failed".into());
            let at = got
                .iter()
                .zip(expected.iter())
                .take_while(|(a, b)| a == b)
                .count();
            s.error = Some(format!("load of migration failed: bad stream at byte {at}"));
        }
    });
}
