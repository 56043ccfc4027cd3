//! The WAN emulator: a user-space layer-2 relay between two interfaces, with a bottleneck rate,
//! one-way delay, jitter, random loss and per-direction byte counters.
//!
//! It runs in the lab's middle namespace. Each direction has a receiving thread (blocking
//! `recvfrom` on an `AF_PACKET` socket) that stamps every frame with the time it will leave the
//! far end, and a sending thread that sleeps on a condition variable until the head frame is
//! due, then sends every frame due within [`SEND_SLACK`] in one batch. Nothing busy-polls: idle it
//! uses no CPU; carrying 100 Mbit/s of TCP it used about 18% of a core here.
//!
//! Timing model, per direction, for a frame of `len` bytes arriving at `t`:
//! `start = max(t, link_free)`, `link_free = start + len*8/rate` (serialization at the
//! bottleneck), `due = link_free + delay + U(0, jitter)`, never earlier than the previous frame's
//! `due` (no reordering). A frame that would find more than [`LinkConfig::queue_limit_bytes`]
//! waiting for serialization is dropped (drop-tail), as a router would.
//!
//! The counters are the referee for "bytes on the WAN": they count every frame that crossed,
//! whoever sent it. They are read through the control socket ([`ControlRequest`]).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::link::LinkConfig;

/// Frames larger than this are not expected (offloads are off, MTU 1600); the buffer is larger
/// so an oversized frame is seen and counted rather than truncated silently.
const RX_BUFFER_BYTES: usize = 65536;

// Kernel ABI constants in the widths the structures use (they all fit).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
const ETH_P_ALL_BE: u16 = (libc::ETH_P_ALL as u16).to_be();
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
const AF_PACKET_U16: u16 = libc::AF_PACKET as u16;
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
const PACKET_MR_PROMISC_U16: u16 = libc::PACKET_MR_PROMISC as u16;

/// The size of a socket option or address structure, as the kernel takes it.
#[allow(clippy::cast_possible_truncation)] // every structure passed is a few bytes
fn socklen<T>() -> libc::socklen_t {
    std::mem::size_of::<T>() as libc::socklen_t
}

/// Counters of one direction.
#[derive(Debug, Default)]
struct Counters {
    bytes: AtomicU64,
    frames: AtomicU64,
    dropped_loss: AtomicU64,
    dropped_queue: AtomicU64,
    dropped_down: AtomicU64,
}

/// A snapshot of one direction's counters.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DirectionStats {
    /// Ethernet frame bytes delivered (the WAN byte count).
    pub bytes: u64,
    pub frames: u64,
    pub dropped_loss: u64,
    pub dropped_queue: u64,
    pub dropped_down: u64,
}

/// Both directions' counters and the link as configured now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WanStats {
    pub a_to_b: DirectionStats,
    pub b_to_a: DirectionStats,
    pub link: LinkConfig,
    /// While down, every frame is dropped (an outage).
    pub down: bool,
}

impl WanStats {
    /// Bytes on the WAN in both directions.
    pub fn total_bytes(&self) -> u64 {
        self.a_to_b.bytes + self.b_to_a.bytes
    }

    /// Frames the link dropped, both directions: random loss and a full queue (not an
    /// outage's, which are counted apart).
    pub fn total_drops(&self) -> u64 {
        [&self.a_to_b, &self.b_to_a]
            .iter()
            .map(|d| d.dropped_loss + d.dropped_queue)
            .sum()
    }
}

/// A request on the control socket: one JSON object per line; the reply is one line.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum ControlRequest {
    /// Reply with [`WanStats`].
    Stats,
    /// Change the link; takes effect for the next frame.
    Set { link: LinkConfig },
    /// Start an outage: drop everything.
    Down,
    /// End an outage.
    Up,
}

struct Shared {
    link: Mutex<LinkConfig>,
    down: std::sync::atomic::AtomicBool,
}

struct Queue {
    frames: Mutex<QueueState>,
    ready: Condvar,
}

struct QueueState {
    items: VecDeque<(Instant, Vec<u8>)>,
    link_free: Instant,
    last_due: Instant,
    rng: u64,
}

/// Why a frame did not cross.
#[derive(Debug, PartialEq, Eq)]
enum Dropped {
    Loss,
    Queue,
}

impl QueueState {
    fn new(now: Instant, seed: u64) -> QueueState {
        QueueState {
            items: VecDeque::new(),
            link_free: now,
            last_due: now,
            rng: seed | 1,
        }
    }

    /// The timing model (module doc): when a frame of `len` bytes arriving at `now` leaves the
    /// far end, or why it is dropped.
    fn schedule(
        &mut self,
        link: &LinkConfig,
        now: Instant,
        len: usize,
    ) -> Result<Instant, Dropped> {
        if link.loss_pct > 0.0 && next_unit(&mut self.rng) * 100.0 < link.loss_pct {
            return Err(Dropped::Loss);
        }
        let bytes_per_s = link.rate_mbit * 1e6 / 8.0;
        let start = self.link_free.max(now);
        let backlog_bytes = start.duration_since(now).as_secs_f64() * bytes_per_s;
        if backlog_bytes > link.queue_limit_bytes() {
            return Err(Dropped::Queue);
        }
        self.link_free = start + Duration::from_secs_f64(len as f64 / bytes_per_s);
        let jitter_ms = link.jitter_ms * next_unit(&mut self.rng);
        let delay = Duration::from_secs_f64((link.rtt_ms / 2.0 + jitter_ms) / 1000.0);
        let due = (self.link_free + delay).max(self.last_due);
        self.last_due = due;
        Ok(due)
    }
}

/// An `AF_PACKET` socket bound to one interface.
struct PacketSocket {
    fd: libc::c_int,
    ifindex: libc::c_int,
}

impl PacketSocket {
    fn open(ifname: &str) -> Result<PacketSocket> {
        let cname = std::ffi::CString::new(ifname).context("interface name has a NUL")?;
        // SAFETY: `cname` is a valid NUL-terminated string for the duration of the call.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if ifindex == 0 {
            bail!("no interface {ifname} in this namespace");
        }
        // SAFETY: plain socket(2) call; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW,
                libc::c_int::from(ETH_P_ALL_BE),
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("socket(AF_PACKET) (needs root)");
        }
        let sock = PacketSocket {
            fd,
            ifindex: ifindex as libc::c_int,
        };
        // SAFETY: sockaddr_ll is plain old data; zeroed is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = AF_PACKET_U16;
        addr.sll_protocol = ETH_P_ALL_BE;
        addr.sll_ifindex = sock.ifindex;
        // SAFETY: `addr` is a valid sockaddr_ll and the length matches its type.
        let rc = unsafe {
            libc::bind(
                fd,
                std::ptr::from_ref(&addr).cast(),
                socklen::<libc::sockaddr_ll>(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("bind to {ifname}"));
        }
        // Promiscuous: the relay forwards frames for any MAC, like a cable would.
        // SAFETY: packet_mreq is plain old data; zeroed is valid.
        let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
        mreq.mr_ifindex = sock.ifindex;
        mreq.mr_type = PACKET_MR_PROMISC_U16;
        // SAFETY: `mreq` is a valid packet_mreq and the length matches.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_PACKET,
                libc::PACKET_ADD_MEMBERSHIP,
                std::ptr::from_ref(&mreq).cast(),
                socklen::<libc::packet_mreq>(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("promiscuous mode on {ifname}"));
        }
        // A deep receive buffer absorbs bursts while the receiving thread is descheduled.
        let rcvbuf: libc::c_int = 8 << 20;
        // SAFETY: `rcvbuf` is a valid c_int and the length matches.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                std::ptr::from_ref(&rcvbuf).cast(),
                socklen::<libc::c_int>(),
            );
        }
        Ok(sock)
    }

    /// Receives one incoming frame into `buf`; outgoing frames (our own sends) are skipped.
    fn recv(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            // SAFETY: zeroed sockaddr_ll is valid; recvfrom writes at most `len` bytes into it.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = socklen::<libc::sockaddr_ll>();
            // SAFETY: `buf` is valid for `buf.len()` bytes; `from`/`len` describe a valid buffer.
            let n = unsafe {
                libc::recvfrom(
                    self.fd,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    std::ptr::from_mut(&mut from).cast(),
                    &mut len,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if from.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            return Ok(usize::try_from(n).expect("recvfrom returned a non-negative length"));
        }
    }

    fn send(&self, frame: &[u8]) -> std::io::Result<()> {
        // SAFETY: `frame` is valid for its length; the socket is bound, so no address is needed.
        let n = unsafe { libc::send(self.fd, frame.as_ptr().cast(), frame.len(), 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for PacketSocket {
    fn drop(&mut self) {
        // SAFETY: `fd` is owned by this value and closed once.
        unsafe { libc::close(self.fd) };
    }
}

/// Draws the next xorshift value; uniform enough for loss and jitter.
fn next_unit(rng: &mut u64) -> f64 {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    (*rng >> 11) as f64 / (1u64 << 53) as f64
}

fn receive_loop(rx: &PacketSocket, queue: &Queue, shared: &Shared, counters: &Counters) {
    let mut buf = vec![0u8; RX_BUFFER_BYTES];
    loop {
        let n = match rx.recv(&mut buf) {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(error = %e, "WAN relay: receive failed; direction stops");
                return;
            }
        };
        let now = Instant::now();
        if shared.down.load(Ordering::Relaxed) {
            counters.dropped_down.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let link = *shared.link.lock().expect("link config poisoned");
        let mut q = queue.frames.lock().expect("relay queue poisoned");
        let due = match q.schedule(&link, now, n) {
            Ok(due) => due,
            Err(Dropped::Loss) => {
                counters.dropped_loss.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            Err(Dropped::Queue) => {
                counters.dropped_queue.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        // Due times never decrease, so a sender already waiting for an earlier head needs no
        // wakeup; only an empty queue's indefinite wait does.
        let was_empty = q.items.is_empty();
        q.items.push_back((due, buf[..n].to_vec()));
        drop(q);
        if was_empty {
            queue.ready.notify_one();
        }
    }
}

/// Frames due within this much of now leave together: one wakeup per batch instead of one per
/// frame (a 1514-byte frame takes 121 us at 100 Mbit/s). Half a millisecond early is nothing
/// against a WAN's delay, and the rate holds on average.
const SEND_SLACK: Duration = Duration::from_micros(500);

fn send_loop(tx: &PacketSocket, queue: &Queue, counters: &Counters) {
    let mut batch: Vec<Vec<u8>> = Vec::new();
    let mut q = queue.frames.lock().expect("relay queue poisoned");
    loop {
        let horizon = Instant::now() + SEND_SLACK;
        while q.items.front().is_some_and(|(due, _)| *due <= horizon) {
            batch.push(q.items.pop_front().expect("front was Some").1);
        }
        if batch.is_empty() {
            q = match q.items.front() {
                None => queue.ready.wait(q).expect("relay queue poisoned"),
                Some((due, _)) => {
                    let wait = due.saturating_duration_since(Instant::now());
                    queue
                        .ready
                        .wait_timeout(q, wait)
                        .expect("relay queue poisoned")
                        .0
                }
            };
            continue;
        }
        drop(q);
        for frame in batch.drain(..) {
            if tx.send(&frame).is_ok() {
                counters
                    .bytes
                    .fetch_add(frame.len() as u64, Ordering::Relaxed);
                counters.frames.fetch_add(1, Ordering::Relaxed);
            }
        }
        q = queue.frames.lock().expect("relay queue poisoned");
    }
}

fn snapshot(c: &Counters) -> DirectionStats {
    DirectionStats {
        bytes: c.bytes.load(Ordering::Relaxed),
        frames: c.frames.load(Ordering::Relaxed),
        dropped_loss: c.dropped_loss.load(Ordering::Relaxed),
        dropped_queue: c.dropped_queue.load(Ordering::Relaxed),
        dropped_down: c.dropped_down.load(Ordering::Relaxed),
    }
}

/// Runs the relay between interfaces `if_a` and `if_b` until the process is killed, answering
/// control requests on `control` (a unix socket path, replaced if present).
pub fn run_relay(if_a: &str, if_b: &str, link: LinkConfig, control: &Path) -> Result<()> {
    link.validate()?;
    let sock_a = Arc::new(PacketSocket::open(if_a)?);
    let sock_b = Arc::new(PacketSocket::open(if_b)?);
    let shared = Arc::new(Shared {
        link: Mutex::new(link),
        down: false.into(),
    });
    let counters = [Arc::new(Counters::default()), Arc::new(Counters::default())];
    let _ = std::fs::remove_file(control);
    let listener =
        UnixListener::bind(control).with_context(|| format!("bind {}", control.display()))?;

    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.subsec_nanos().into())
        | 1;
    // direction 0: a -> b, direction 1: b -> a
    for (dir, (rx, tx)) in [
        (sock_a.clone(), sock_b.clone()),
        (sock_b.clone(), sock_a.clone()),
    ]
    .into_iter()
    .enumerate()
    {
        let now = Instant::now();
        let queue = Arc::new(Queue {
            frames: Mutex::new(QueueState::new(now, seed ^ ((dir as u64 + 1) * 0x9e37))),
            ready: Condvar::new(),
        });
        let (q1, s1, c1) = (queue.clone(), shared.clone(), counters[dir].clone());
        std::thread::Builder::new()
            .name(format!("wan-rx{dir}"))
            .spawn(move || receive_loop(&rx, &q1, &s1, &c1))?;
        let c2 = counters[dir].clone();
        std::thread::Builder::new()
            .name(format!("wan-tx{dir}"))
            .spawn(move || send_loop(&tx, &queue, &c2))?;
    }
    tracing::info!(?link, "WAN relay running between {if_a} and {if_b}");

    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        if let Err(e) = serve_control(conn, &shared, &counters) {
            tracing::warn!(error = %e, "WAN relay: control connection failed");
        }
    }
    Ok(())
}

fn serve_control(conn: UnixStream, shared: &Shared, counters: &[Arc<Counters>; 2]) -> Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut writer = conn.try_clone()?;
    for line in BufReader::new(conn).lines() {
        let line = line?;
        let reply = match serde_json::from_str::<ControlRequest>(&line) {
            Err(e) => serde_json::json!({ "error": format!("bad request {line:?}: {e}") }),
            Ok(ControlRequest::Set { link }) => match link.validate() {
                Err(e) => serde_json::json!({ "error": e.to_string() }),
                Ok(()) => {
                    *shared.link.lock().expect("link config poisoned") = link;
                    serde_json::json!({ "ok": true })
                }
            },
            Ok(ControlRequest::Down) => {
                shared.down.store(true, Ordering::Relaxed);
                serde_json::json!({ "ok": true })
            }
            Ok(ControlRequest::Up) => {
                shared.down.store(false, Ordering::Relaxed);
                serde_json::json!({ "ok": true })
            }
            Ok(ControlRequest::Stats) => serde_json::to_value(WanStats {
                a_to_b: snapshot(&counters[0]),
                b_to_a: snapshot(&counters[1]),
                link: *shared.link.lock().expect("link config poisoned"),
                down: shared.down.load(Ordering::Relaxed),
            })?,
        };
        writeln!(writer, "{reply}")?;
    }
    Ok(())
}

/// Sends one control request to a running relay and returns its JSON reply.
pub fn control(socket: &Path, req: &ControlRequest) -> Result<serde_json::Value> {
    let mut conn = UnixStream::connect(socket).with_context(|| {
        format!(
            "WAN emulator control socket {} (is the lab up?)",
            socket.display()
        )
    })?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    writeln!(conn, "{}", serde_json::to_string(req)?)?;
    let mut line = String::new();
    BufReader::new(conn)
        .read_line(&mut line)
        .context("reading the WAN emulator's reply")?;
    let v: serde_json::Value =
        serde_json::from_str(&line).context("WAN emulator reply is not JSON")?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("WAN emulator: {e}");
    }
    Ok(v)
}

/// Reads the relay's counters.
pub fn stats(socket: &Path) -> Result<WanStats> {
    Ok(serde_json::from_value(control(
        socket,
        &ControlRequest::Stats,
    )?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRAME: usize = 1514;

    fn link(rate_mbit: f64, rtt_ms: f64) -> LinkConfig {
        LinkConfig {
            rate_mbit,
            rtt_ms,
            jitter_ms: 0.0,
            loss_pct: 0.0,
            ..LinkConfig::default()
        }
    }

    #[test]
    fn frames_leave_after_serialization_and_one_way_delay() {
        let t0 = Instant::now();
        let mut q = QueueState::new(t0, 7);
        let l = link(100.0, 50.0);
        let first = q.schedule(&l, t0, FRAME).unwrap();
        let second = q.schedule(&l, t0, FRAME).unwrap();
        let ser = FRAME as f64 * 8.0 / 100e6;
        assert!(((first - t0).as_secs_f64() - (ser + 0.025)).abs() < 1e-6);
        // back to back: the second waits for the first's serialization
        assert!(((second - first).as_secs_f64() - ser).abs() < 1e-6);
    }

    #[test]
    fn a_full_queue_drops_the_tail() {
        let t0 = Instant::now();
        let mut q = QueueState::new(t0, 7);
        let l = link(100.0, 50.0);
        let fit = 625_000 / FRAME; // one bandwidth-delay product of 100 Mbit/s x 50 ms
        for i in 0..=fit {
            assert!(
                q.schedule(&l, t0, FRAME).is_ok(),
                "frame {i} of {fit} dropped early"
            );
        }
        assert_eq!(q.schedule(&l, t0, FRAME), Err(Dropped::Queue));
    }

    #[test]
    fn jitter_never_reorders_and_loss_drops_about_its_share() {
        let t0 = Instant::now();
        let mut q = QueueState::new(t0, 99);
        let l = LinkConfig {
            rate_mbit: 1000.0,
            rtt_ms: 20.0,
            jitter_ms: 5.0,
            loss_pct: 10.0,
            ..LinkConfig::default()
        };
        let (mut last, mut lost) = (t0, 0);
        for i in 0..10_000u32 {
            match q.schedule(&l, t0 + Duration::from_micros(u64::from(i) * 20), FRAME) {
                Ok(due) => {
                    assert!(due >= last, "frame {i} overtook its predecessor");
                    last = due;
                }
                Err(Dropped::Loss) => lost += 1,
                Err(Dropped::Queue) => panic!("no queue builds at this rate"),
            }
        }
        assert!((800..1200).contains(&lost), "lost {lost} of 10000 at 10%");
    }
}
