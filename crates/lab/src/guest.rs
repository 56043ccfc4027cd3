//! The host's side of the guest's serial protocol (see `guest/main.c` and docs/guest.md).
//!
//! A [`GuestLink`] holds one connection to a VM's serial socket. Its reader task routes
//! `R <id> ...` replies to waiting commands and feeds `H <seq> ...` heartbeats, stamped with the
//! host's clock on arrival, into a shared [`Heartbeats`] tracker. During a migration the source's
//! and the destination's links feed the same tracker, so the longest gap between two beats is
//! the longest pause the guest itself experienced, switchover included.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::oneshot;

/// Host-side record of the guest's heartbeats.
#[derive(Debug, Default)]
pub struct Heartbeats {
    inner: Mutex<HeartbeatState>,
}

#[derive(Debug, Default)]
struct HeartbeatState {
    last: Option<Instant>,
    count: u64,
    max_gap: Duration,
}

impl Heartbeats {
    fn beat(&self, at: Instant) {
        let mut s = self.inner.lock().expect("heartbeat state poisoned");
        if let Some(last) = s.last {
            s.max_gap = s.max_gap.max(at.saturating_duration_since(last));
        }
        s.last = Some(at);
        s.count += 1;
    }

    /// Forgets the longest gap so far (start of a measured window).
    pub fn reset_max_gap(&self) {
        let mut s = self.inner.lock().expect("heartbeat state poisoned");
        s.max_gap = Duration::ZERO;
    }

    /// The longest gap between two consecutive beats since the last reset.
    pub fn max_gap(&self) -> Duration {
        self.inner.lock().expect("heartbeat state poisoned").max_gap
    }

    /// Beats received so far.
    pub fn count(&self) -> u64 {
        self.inner.lock().expect("heartbeat state poisoned").count
    }
}

/// A parsed `R <id> ok k=v ...` reply.
#[derive(Debug, Clone, Default)]
pub struct GuestReply {
    /// Every `key=value` field of the reply.
    pub fields: HashMap<String, String>,
    /// The reply's words after `ok`, as sent.
    pub text: String,
}

impl GuestReply {
    /// A numeric field, or an error naming the field and the reply.
    pub fn u64(&self, key: &str) -> Result<u64> {
        self.fields
            .get(key)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("guest reply {:?} has no numeric field {key}", self.text))
    }

    /// A decimal field, or an error naming the field and the reply.
    pub fn f64(&self, key: &str) -> Result<f64> {
        self.fields
            .get(key)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("guest reply {:?} has no decimal field {key}", self.text))
    }
}

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<GuestReply, String>>>>>;
/// The guest's diagnostic lines (`D ...`: a stalled disk write's report, docs/guest.md), kept
/// for the error of a command it never answers: the VM's console log goes with the VM.
type Diagnostics = Arc<Mutex<Vec<String>>>;

/// At most this many diagnostic lines are kept (a report is a few hundred).
const MAX_DIAGNOSTICS: usize = 1000;

/// One connection to a guest's serial console.
pub struct GuestLink {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    waiters: Waiters,
    diagnostics: Diagnostics,
    next_id: AtomicU64,
    heartbeats: Arc<Heartbeats>,
}

impl GuestLink {
    /// Connects to the serial socket; heartbeats go to `heartbeats`.
    pub async fn connect(serial: &Path, heartbeats: Arc<Heartbeats>) -> Result<GuestLink> {
        let stream = UnixStream::connect(serial)
            .await
            .with_context(|| format!("connect to guest serial {}", serial.display()))?;
        let (read, write) = stream.into_split();
        let waiters: Waiters = Arc::default();
        let diagnostics: Diagnostics = Arc::default();
        tokio::spawn(read_loop(
            BufReader::new(read),
            waiters.clone(),
            diagnostics.clone(),
            heartbeats.clone(),
        ));
        // Ids start from the clock so replies meant for an earlier connection never match.
        let base = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs() % 1_000_000 * 1000);
        Ok(GuestLink {
            writer: tokio::sync::Mutex::new(write),
            waiters,
            diagnostics,
            next_id: AtomicU64::new(base),
            heartbeats,
        })
    }

    /// The tracker this link feeds.
    pub fn heartbeats(&self) -> &Arc<Heartbeats> {
        &self.heartbeats
    }

    /// Sends one command (e.g. `mem verify`) and waits for its reply.
    pub async fn call(&self, command: &str, timeout: Duration) -> Result<GuestReply> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .expect("guest waiters poisoned")
            .insert(id, tx);
        {
            let mut w = self.writer.lock().await;
            w.write_all(format!("{id} {command}\n").as_bytes())
                .await
                .context("write to guest serial")?;
        }
        let reply = tokio::time::timeout(timeout, rx).await;
        self.waiters
            .lock()
            .expect("guest waiters poisoned")
            .remove(&id);
        match reply {
            Err(_) => {
                let report = self
                    .diagnostics
                    .lock()
                    .expect("guest diagnostics poisoned")
                    .join("\n");
                let silent = format!(
                    "guest did not answer {command:?} within {:.0}s",
                    timeout.as_secs_f64()
                );
                if report.is_empty() {
                    bail!(silent)
                }
                bail!("{silent}; what it reported meanwhile:\n{report}")
            }
            Ok(Err(_)) => {
                bail!("guest serial closed while waiting for {command:?} (did the VM stop?)")
            }
            Ok(Ok(Err(msg))) => bail!("guest refused {command:?}: {msg}"),
            Ok(Ok(Ok(r))) => Ok(r),
        }
    }

    /// Waits until the guest agent answers a ping (it has booted).
    pub async fn wait_ready(&self, deadline: Duration) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.call("ping", Duration::from_secs(1)).await.is_ok() {
                return Ok(());
            }
            if start.elapsed() > deadline {
                bail!("guest agent did not answer within {:.0}s (boot failed? see the VM's console log, <lab run dir>/vms/NAME-SITE.console.log)", deadline.as_secs_f64());
            }
        }
    }
}

async fn read_loop(
    mut reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    waiters: Waiters,
    diagnostics: Diagnostics,
    heartbeats: Arc<Heartbeats>,
) {
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end();
        // Kernel messages share the console; anything not ours is ignored.
        if line.starts_with("H ") {
            heartbeats.beat(Instant::now());
            continue;
        }
        if line.starts_with("D ") {
            let mut kept = diagnostics.lock().expect("guest diagnostics poisoned");
            if kept.len() < MAX_DIAGNOSTICS {
                kept.push(line.to_owned());
            }
            continue;
        }
        let Some(rest) = line.strip_prefix("R ") else {
            continue;
        };
        let mut parts = rest.splitn(3, ' ');
        let (Some(id), Some(status)) = (
            parts.next().and_then(|i| i.parse::<u64>().ok()),
            parts.next(),
        ) else {
            continue;
        };
        let text = parts.next().unwrap_or("").to_owned();
        let result = if status == "ok" {
            let fields = text
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            Ok(GuestReply { fields, text })
        } else {
            Err(text)
        };
        if let Some(tx) = waiters.lock().expect("guest waiters poisoned").remove(&id) {
            let _ = tx.send(result);
        }
    }
    waiters.lock().expect("guest waiters poisoned").clear();
}

/// The outcome of the guest's verifiers after a migration.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct VerifyOutcome {
    pub mem_pages: u64,
    pub mem_errors: u64,
    pub disk_blocks: u64,
    pub disk_errors: u64,
}

impl VerifyOutcome {
    /// Memory and disk errors together.
    pub fn errors(&self) -> u64 {
        self.mem_errors + self.disk_errors
    }
}

/// Runs the memory verifier, and the disk verifier when `disk` is set.
pub async fn verify(link: &GuestLink, disk: bool) -> Result<VerifyOutcome> {
    // A full-memory check recomputes every page under TCG: allow minutes.
    let mem = link.call("mem verify", Duration::from_secs(300)).await?;
    let mut out = VerifyOutcome {
        mem_pages: mem.u64("checked")?,
        mem_errors: mem.u64("errors")?,
        ..Default::default()
    };
    if disk {
        let d = link.call("disk verify", Duration::from_secs(300)).await?;
        out.disk_blocks = d.u64("checked")?;
        out.disk_errors = d.u64("errors")?;
    }
    Ok(out)
}

/// The guest's disk write latencies since the last reset (`disk reset-stats`), and what its
/// hot-set reader read meanwhile.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct DiskLatency {
    pub writes: u64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    /// The hot-set reader's 4 KiB reads per second of the guest's time (None: no reader).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reads_per_s: Option<f64>,
}

/// Starts a new measurement of the guest's disk write latencies.
pub async fn reset_disk_latency(link: &GuestLink) -> Result<()> {
    link.call("disk reset-stats", Duration::from_secs(30))
        .await?;
    Ok(())
}

/// The guest's disk write latencies since [`reset_disk_latency`].
pub async fn disk_latency(link: &GuestLink) -> Result<DiskLatency> {
    let d = link.call("disk stats", Duration::from_secs(30)).await?;
    Ok(DiskLatency {
        writes: d.u64("lat_writes")?,
        p50_us: d.u64("lat_p50_us")?,
        p99_us: d.u64("lat_p99_us")?,
        p999_us: d.u64("lat_p999_us")?,
        max_us: d.u64("lat_max_us")?,
        reads_per_s: match (d.u64("reads")?, d.f64("read_s")?) {
            (0, _) => None,
            #[allow(clippy::cast_precision_loss)]
            (reads, secs) => Some(reads as f64 / secs.max(1e-3)),
        },
    })
}

/// The hot-set reader's reads in each second of the guest's time since the last
/// [`reset_disk_latency`] (the last second still running; the guest's clock stops while it is
/// paused). All zeros without a reader.
pub async fn disk_read_counts(link: &GuestLink) -> Result<Vec<u32>> {
    // The guest keeps ten minutes; a guest that claims more is not believed past that.
    const MAX_SECONDS: usize = 600;
    let mut counts = Vec::new();
    while counts.len() < MAX_SECONDS {
        let d = link
            .call(
                &format!("disk read-counts from={}", counts.len()),
                Duration::from_secs(30),
            )
            .await?;
        let page = parse_counts(d.fields.get("counts").map_or("", String::as_str))?;
        let seconds = usize::try_from(d.u64("seconds")?)?;
        let done = page.is_empty() || counts.len() + page.len() >= seconds;
        counts.extend(page);
        if done {
            break;
        }
    }
    counts.truncate(MAX_SECONDS);
    Ok(counts)
}

/// `C,C,...` (empty: none).
fn parse_counts(list: &str) -> Result<Vec<u32>> {
    list.split(',')
        .filter(|c| !c.is_empty())
        .map(|c| {
            c.parse()
                .with_context(|| format!("the guest's read count {c:?} is not a number"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn read_counts_are_a_comma_list_or_nothing() {
        assert_eq!(parse_counts("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_counts("3,0,12").unwrap(), vec![3, 0, 12]);
        assert!(parse_counts("3,x").is_err());
    }

    /// A fake guest: kernel noise, heartbeats, an ok reply with fields and a refusal.
    #[tokio::test]
    async fn replies_and_heartbeats_are_routed_and_noise_ignored() {
        let path =
            std::env::temp_dir().join(format!("ferry-guest-test-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            let mut lines = BufReader::new(r).lines();
            w.write_all(b"[    1.234] virtio_net: noise\nH 0 10\nH 1 15\n")
                .await
                .unwrap();
            while let Some(line) = lines.next_line().await.unwrap() {
                let (id, cmd) = line.split_once(' ').unwrap();
                let reply = match cmd {
                    "mem verify" => format!(
                        "H 2 20\nR {id} ok checked=42 stale=0 corrupt=1 errors=1 first_bad=3\n"
                    ),
                    _ => format!("R {id} err unknown command \"{cmd}\" (known: ping mem disk)\n"),
                };
                w.write_all(reply.as_bytes()).await.unwrap();
            }
        });
        let hb = Arc::new(Heartbeats::default());
        let link = GuestLink::connect(&path, hb.clone()).await.unwrap();
        let out = verify(&link, false).await.unwrap();
        assert_eq!((out.mem_pages, out.mem_errors), (42, 1));
        let err = link.call("frob", Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "guest refused \"frob\": unknown command \"frob\" (known: ping mem disk)"
        );
        assert_eq!(hb.count(), 3);
        let _ = std::fs::remove_file(&path);
    }

    /// A guest whose disk write stalled: its report comes with the command it never answers.
    #[tokio::test]
    async fn a_command_never_answered_carries_the_guests_stall_report() {
        let path = std::env::temp_dir().join(format!(
            "ferry-guest-stall-test-{}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let (reported_tx, reported_rx) = oneshot::channel();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            w.write_all(
                b"D stall: a disk write has waited 20 s; the kernel's view follows\n\
                  H 0 10\nD blocked task 98 (jbd2/vda-8)\n",
            )
            .await
            .unwrap();
            let _ = reported_tx.send(());
            // Reads the command and never answers it.
            let mut lines = BufReader::new(r).lines();
            while lines.next_line().await.unwrap().is_some() {}
        });
        let hb = Arc::new(Heartbeats::default());
        let link = GuestLink::connect(&path, hb.clone()).await.unwrap();
        reported_rx.await.unwrap();
        let err = link
            .call("disk verify", Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "guest did not answer \"disk verify\" within 0s; what it reported meanwhile:\n\
             D stall: a disk write has waited 20 s; the kernel's view follows\n\
             D blocked task 98 (jbd2/vda-8)"
        );
        assert_eq!(hb.count(), 1, "heartbeats are not diagnostics");
        let _ = std::fs::remove_file(&path);
    }
}
