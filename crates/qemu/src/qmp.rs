//! A typed QMP client.
//!
//! [`Qmp`] owns one QMP connection: a writer shared behind a lock and one reader task that routes
//! each reply to its waiter by `id` and records every asynchronous event with QEMU's own
//! timestamp. Commands are types implementing [`Command`]; QEMU's refusals come back as
//! [`QmpError::Qemu`], apart from transport failures.
//!
//! Invariant: when the reader task ends (QEMU exited, socket closed), every waiting command fails
//! with [`QmpError::Disconnected`] and later commands fail the same way; nothing waits forever.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};

/// The longest a single QMP command may take. QEMU answers almost everything at once; the slow
/// ones (`migrate-incoming` binding, `quit`) take milliseconds. A minute means QEMU is wedged.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// The longest a QMP message line may be; QEMU's replies to our commands are a few KiB.
const MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// Events a connection remembers for [`Qmp::find_event`] (a migration's take tens): the oldest
/// go first, so a QEMU that floods events cannot grow the log.
pub const MAX_EVENTS_KEPT: usize = 4096;

/// A QMP command: the type's fields (serialized) are its arguments.
pub trait Command: Serialize {
    /// The QMP command name, e.g. `query-status`.
    const NAME: &'static str;
    /// What a successful reply's `return` holds.
    type Returns: DeserializeOwned;
}

/// Why a QMP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be opened.
    #[error("connect to QMP socket {}", path.display())]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    /// QEMU's greeting or capabilities negotiation went wrong.
    #[error("QMP handshake on {}: {detail}", path.display())]
    Handshake { path: PathBuf, detail: String },
    /// QEMU answered the command with an error.
    #[error("QEMU refused {command}: {desc} ({class})")]
    Qemu {
        command: &'static str,
        class: String,
        desc: String,
    },
    /// The connection ended before the reply came.
    #[error("QMP connection closed while waiting for {command} (did QEMU exit?)")]
    Disconnected { command: &'static str },
    /// Writing the command failed.
    #[error("QMP write of {command}")]
    Write {
        command: &'static str,
        source: std::io::Error,
    },
    /// The reply did not have the expected shape.
    #[error("QMP reply to {command} is not what was expected: {detail}")]
    Decode {
        command: &'static str,
        detail: String,
    },
    /// No reply within [`COMMAND_TIMEOUT`].
    #[error("QMP command {command} got no reply within {}s", COMMAND_TIMEOUT.as_secs())]
    Timeout { command: &'static str },
}

/// An asynchronous QMP event, with QEMU's host-clock timestamp.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Event {
    /// Event name, e.g. `STOP`, `RESUME`, `MIGRATION`.
    pub event: String,
    /// Event payload (`{}` when QEMU sends none).
    #[serde(default)]
    pub data: Value,
    /// When QEMU emitted it.
    pub timestamp: EventTime,
}

/// QMP's `{seconds, microseconds}` timestamp (host wall clock).
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct EventTime {
    pub seconds: i64,
    pub microseconds: i64,
}

impl EventTime {
    /// Microseconds since the Unix epoch.
    pub fn as_micros(self) -> i64 {
        self.seconds * 1_000_000 + self.microseconds
    }
}

type Reply = Result<Value, (String, String)>;
type Pending = Arc<Mutex<Option<HashMap<u64, oneshot::Sender<Reply>>>>>;

/// One QMP connection. Cheap to share behind an `Arc`; commands may be issued concurrently.
pub struct Qmp {
    path: PathBuf,
    /// The process serving the socket (SO_PEERCRED), when the kernel says.
    peer_pid: Option<u32>,
    writer: tokio::sync::Mutex<WriteHalf>,
    /// The reader task, which owns the read half: ended with the connection.
    reader: tokio::task::AbortHandle,
    next_id: AtomicU64,
    /// `None` once the reader has ended: no new waiter may be added after that.
    pending: Pending,
    events: broadcast::Sender<Event>,
    event_log: Arc<Mutex<VecDeque<Event>>>,
    /// Out-of-band execution was negotiated ([`Qmp::connect_oob`]).
    oob: bool,
}

/// The monitor socket's write half, closed with the socket when the connection is dropped
/// rather than shut down: `shutdown(2)` would end the connection for every process holding a
/// copy of it ([`Qmp::duplicate_socket`]), and QEMU serves one monitor client at a time.
struct WriteHalf(Option<OwnedWriteHalf>);

impl std::ops::Deref for WriteHalf {
    type Target = OwnedWriteHalf;
    fn deref(&self) -> &OwnedWriteHalf {
        self.0.as_ref().expect("taken only on drop")
    }
}

impl std::ops::DerefMut for WriteHalf {
    fn deref_mut(&mut self) -> &mut OwnedWriteHalf {
        self.0.as_mut().expect("taken only on drop")
    }
}

impl Drop for WriteHalf {
    fn drop(&mut self) {
        if let Some(write) = self.0.take() {
            write.forget();
        }
    }
}

impl Drop for Qmp {
    /// The reader task goes with the connection; the socket closes with the read half it owns.
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Qmp {
    /// The pid of the process behind the socket (the QEMU, for a QMP socket), as the kernel
    /// recorded it when it accepted the connection.
    pub fn peer_pid(&self) -> Option<u32> {
        self.peer_pid
    }

    /// Connects to a QMP unix socket, reads the greeting and enters command mode.
    ///
    /// Cancel safety: not cancel safe; a cancelled connect leaves nothing behind but the socket.
    pub async fn connect(path: &Path) -> Result<Qmp, QmpError> {
        Qmp::connect_with(path, false).await
    }

    /// Connects as [`Qmp::connect`], and enables out-of-band execution when QEMU offers it
    /// (a QMP monitor on a socket does). Out-of-band commands ([`Qmp::execute_oob`]) are run by
    /// QEMU's monitor thread even while its main thread is blocked: a postcopy destination's
    /// main thread waits on any page it touches that has not arrived, and recovery
    /// (`migrate-pause`, `migrate-recover`) must reach it then. The connection must be made
    /// before that: the handshake itself needs the main thread.
    pub async fn connect_oob(path: &Path) -> Result<Qmp, QmpError> {
        Qmp::connect_with(path, true).await
    }

    async fn connect_with(path: &Path, want_oob: bool) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| QmpError::Connect {
                path: path.to_owned(),
                source,
            })?;
        let (read, write) = stream.into_split();
        let mut lines = BufReader::new(read);
        let mut greeting = String::new();
        let handshake = |detail: String| QmpError::Handshake {
            path: path.to_owned(),
            detail,
        };
        tokio::time::timeout(
            Duration::from_secs(10),
            read_bounded_line(&mut lines, &mut greeting),
        )
        .await
        .map_err(|_| handshake("no greeting within 10s".into()))?
        .map_err(|e| handshake(format!("reading greeting: {e}")))?;
        let greeting: Value = serde_json::from_str(&greeting)
            .map_err(|e| handshake(format!("greeting is not JSON: {e}")))?;
        if greeting.get("QMP").is_none() {
            return Err(handshake(format!("unexpected greeting {greeting}")));
        }
        let oob = want_oob
            && greeting["QMP"]["capabilities"]
                .as_array()
                .is_some_and(|caps| caps.iter().any(|c| c == "oob"));
        let qmp = Qmp::serve(path, lines, write, 1, oob);
        let capabilities = if oob {
            serde_json::json!({ "enable": ["oob"] })
        } else {
            Value::Object(Default::default())
        };
        qmp.execute_raw("qmp_capabilities", capabilities)
            .await
            .map_err(|e| handshake(format!("qmp_capabilities: {e}")))?;
        Ok(qmp)
    }

    /// Takes over a connection another process made and negotiated (with out-of-band
    /// execution when `oob`), as a restarted agent does with its predecessor's
    /// (`monitor_keeper` in ferry-agent). What comes first may be the rest of a line the other
    /// process half read: it is skipped as not JSON. Its ids start past any that process
    /// can have used (from the clock), so a late reply to one of its commands is never taken
    /// for a reply to this one's.
    pub fn adopt(path: &Path, socket: std::os::fd::OwnedFd, oob: bool) -> Result<Qmp, QmpError> {
        let connect = |source| QmpError::Connect {
            path: path.to_owned(),
            source,
        };
        let socket = std::os::unix::net::UnixStream::from(socket);
        socket.set_nonblocking(true).map_err(connect)?;
        let stream = UnixStream::from_std(socket).map_err(connect)?;
        let (read, write) = stream.into_split();
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let first_id = u64::try_from(since_epoch.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_mul(1_000_000);
        Ok(Qmp::serve(path, BufReader::new(read), write, first_id, oob))
    }

    /// A connection past its greeting: its reader task started.
    fn serve(
        path: &Path,
        lines: BufReader<tokio::net::unix::OwnedReadHalf>,
        write: OwnedWriteHalf,
        first_id: u64,
        oob: bool,
    ) -> Qmp {
        let peer_pid = UnixStream::peer_cred(write.as_ref())
            .ok()
            .and_then(|c| c.pid())
            .and_then(|p| u32::try_from(p).ok());
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        let (events, _) = broadcast::channel(1024);
        let event_log = Arc::new(Mutex::new(VecDeque::new()));
        let reader = tokio::spawn(read_loop(
            lines,
            pending.clone(),
            events.clone(),
            event_log.clone(),
        ))
        .abort_handle();
        Qmp {
            path: path.to_owned(),
            peer_pid,
            writer: tokio::sync::Mutex::new(WriteHalf(Some(write))),
            reader,
            next_id: AtomicU64::new(first_id),
            pending,
            events,
            event_log,
            oob,
        }
    }

    /// A duplicate of the connection's socket, for a process that keeps it open
    /// ([`Qmp::adopt`]).
    pub async fn duplicate_socket(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsFd;
        let writer = self.writer.lock().await;
        let stream: &UnixStream = (**writer).as_ref();
        stream.as_fd().try_clone_to_owned()
    }

    /// Whether the connection has closed (QEMU exited): every command fails from then on,
    /// and no event comes any more.
    pub fn is_closed(&self) -> bool {
        self.pending
            .lock()
            .expect("QMP pending map poisoned")
            .is_none()
    }

    /// The socket this connection uses.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs a typed command and decodes its reply.
    ///
    /// Cancel safety: cancel safe; a reply that arrives after cancellation is dropped.
    pub async fn execute<C: Command>(&self, cmd: &C) -> Result<C::Returns, QmpError> {
        let args = serde_json::to_value(cmd).map_err(|e| QmpError::Decode {
            command: C::NAME,
            detail: format!("arguments do not serialize: {e}"),
        })?;
        let value = self.execute_raw(C::NAME, args).await?;
        serde_json::from_value(value.clone()).map_err(|e| QmpError::Decode {
            command: C::NAME,
            detail: format!("{e} in {value}"),
        })
    }

    /// Runs a typed command out of band when the connection negotiated it (QEMU runs it at
    /// once, beside any in-band command, even with its main thread blocked; only commands
    /// QEMU marks `allow-oob` may go so), in band otherwise.
    pub async fn execute_oob<C: Command>(&self, cmd: &C) -> Result<C::Returns, QmpError> {
        let args = serde_json::to_value(cmd).map_err(|e| QmpError::Decode {
            command: C::NAME,
            detail: format!("arguments do not serialize: {e}"),
        })?;
        let key = if self.oob { "exec-oob" } else { "execute" };
        let value = self.send(key, C::NAME, args).await?;
        serde_json::from_value(value.clone()).map_err(|e| QmpError::Decode {
            command: C::NAME,
            detail: format!("{e} in {value}"),
        })
    }

    /// Whether out-of-band execution was negotiated.
    pub fn has_oob(&self) -> bool {
        self.oob
    }

    /// Runs a command by name with JSON arguments; for commands without a typed wrapper.
    pub async fn execute_raw(&self, command: &'static str, args: Value) -> Result<Value, QmpError> {
        self.send("execute", command, args).await
    }

    async fn send(
        &self,
        key: &'static str,
        command: &'static str,
        args: Value,
    ) -> Result<Value, QmpError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = self.pending.lock().expect("QMP pending map poisoned");
            match pending.as_mut() {
                Some(map) => map.insert(id, tx),
                None => return Err(QmpError::Disconnected { command }),
            };
        }
        let mut msg = serde_json::json!({ key: command, "id": id });
        if args.as_object().is_some_and(|o| !o.is_empty()) {
            msg["arguments"] = args;
        }
        let mut line = msg.to_string();
        line.push('\n');
        {
            let mut w = self.writer.lock().await;
            w.write_all(line.as_bytes())
                .await
                .map_err(|source| QmpError::Write { command, source })?;
        }
        match tokio::time::timeout(COMMAND_TIMEOUT, rx).await {
            Err(_) => Err(QmpError::Timeout { command }),
            Ok(Err(_)) => Err(QmpError::Disconnected { command }),
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err((class, desc)))) => Err(QmpError::Qemu {
                command,
                class,
                desc,
            }),
        }
    }

    /// A receiver of events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// The events received on this connection (the latest [`MAX_EVENTS_KEPT`]), oldest first.
    pub fn events(&self) -> Vec<Event> {
        let log = self.event_log.lock().expect("QMP event log poisoned");
        log.iter().cloned().collect()
    }

    /// The latest recorded event named `name`.
    pub fn latest_event(&self, name: &str) -> Option<Event> {
        let log = self.event_log.lock().expect("QMP event log poisoned");
        log.iter().rev().find(|e| e.event == name).cloned()
    }

    /// The first recorded event named `name` whose data satisfies `pred`.
    pub fn find_event(&self, name: &str, pred: impl Fn(&Value) -> bool) -> Option<Event> {
        let log = self.event_log.lock().expect("QMP event log poisoned");
        log.iter()
            .find(|e| e.event == name && pred(&e.data))
            .cloned()
    }

    /// Waits until an event named `name` satisfying `pred` has been received (including one
    /// already received) or `timeout` passes.
    pub async fn wait_event(
        &self,
        name: &str,
        pred: impl Fn(&Value) -> bool,
        timeout: Duration,
    ) -> Option<Event> {
        let mut rx = self.subscribe();
        if let Some(e) = self.find_event(name, &pred) {
            return Some(e);
        }
        let wait = async {
            loop {
                match rx.recv().await {
                    Ok(e) if e.event == name && pred(&e.data) => return Some(e),
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        if let Some(e) = self.find_event(name, &pred) {
                            return Some(e);
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.ok().flatten()
    }
}

/// Reads one line into `line`, refusing one longer than [`MAX_LINE_BYTES`] before holding more
/// of it than that.
async fn read_bounded_line(
    reader: &mut (impl AsyncBufRead + Unpin),
    line: &mut String,
) -> std::io::Result<usize> {
    let limit = MAX_LINE_BYTES as u64 + 1;
    let n = reader.take(limit).read_line(line).await?;
    if n > MAX_LINE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a line longer than {MAX_LINE_BYTES} bytes"),
        ));
    }
    Ok(n)
}

async fn read_loop(
    mut lines: BufReader<tokio::net::unix::OwnedReadHalf>,
    pending: Pending,
    events: broadcast::Sender<Event>,
    event_log: Arc<Mutex<VecDeque<Event>>>,
) {
    let mut line = String::new();
    loop {
        line.clear();
        match read_bounded_line(&mut lines, &mut line).await {
            Ok(0) => break,
            Err(e) => {
                tracing::warn!("QMP: {e}; the connection is closed");
                break;
            }
            Ok(_) => {}
        }
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            tracing::warn!(line = %line.trim_end(), "QMP: ignoring a line that is not JSON");
            continue;
        };
        if msg.get("event").is_some() {
            match serde_json::from_value::<Event>(msg) {
                Ok(ev) => {
                    tracing::debug!(event = %ev.event, data = %ev.data, "QMP event");
                    let mut log = event_log.lock().expect("QMP event log poisoned");
                    if log.len() == MAX_EVENTS_KEPT {
                        log.pop_front();
                    }
                    log.push_back(ev.clone());
                    drop(log);
                    let _ = events.send(ev);
                }
                Err(e) => tracing::warn!(error = %e, "QMP: malformed event"),
            }
            continue;
        }
        let Some(id) = msg.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let reply = if let Some(err) = msg.get("error") {
            let s = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
            Err((s("class"), s("desc")))
        } else {
            Ok(msg.get("return").cloned().unwrap_or(Value::Null))
        };
        let waiter = pending
            .lock()
            .expect("QMP pending map poisoned")
            .as_mut()
            .and_then(|m| m.remove(&id));
        if let Some(tx) = waiter {
            let _ = tx.send(reply);
        }
    }
    // Dropping every sender wakes every waiter with Disconnected.
    pending.lock().expect("QMP pending map poisoned").take();
}
