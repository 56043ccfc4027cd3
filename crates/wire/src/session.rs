//! A session: reliable, ordered channels between two agents over any number of connections
//! that come and go.
//!
//! Each side keeps an [`Outbox`] per channel it sends on and a [`Reorder`] per channel it
//! receives on. Every live connection runs a writer, which takes the next frame from the
//! session's one send queue (so N connections share the load, each as fast as its TCP window
//! allows), and a reader, which puts what arrives into the channels' reorder buffers.
//!
//! - **Acknowledgements** say what the *consumer* has taken, not what arrived: so the bytes
//!   a sender may have unacknowledged bound everything in between (its queue, the sockets,
//!   the receiver's reorder buffer and ready queue). That bound is the backpressure: a full
//!   outbox makes [`Session::send`] wait, and the producer (the agent reading QEMU's socket)
//!   stops reading, so QEMU's own bandwidth estimate becomes the WAN's rate.
//! - **Reconnects**: a connection starts with a `Hello` each way carrying the session id and,
//!   per channel, how far the sender of the Hello has consumed. The other side drops what that
//!   acknowledges and puts everything else unacknowledged back in the send queue. When any
//!   connection drops, all unacknowledged frames are queued again: the receiver's reorder
//!   buffer discards the duplicates, so a frame is delivered exactly once.
//! - **Barriers** are numbered like data and delivered in order: a consumer that receives one
//!   knows it has everything sent before it on that channel.
//!
//! The session never fails on its own because connections drop; the owner decides how long
//! it waits (see [`Session::idle_for`]) and then calls [`Session::fail`].

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;

use crate::frame::{ChannelId, Frame, FrameError, FrameKind, Seq};
use crate::outbox::Outbox;
use crate::reorder::Reorder;

/// An idle connection sends this often (see `Session::keepalive`).
const KEEPALIVE: Duration = Duration::from_secs(1);

/// A session's identity, chosen by the side that opens it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionId(pub u128);

impl SessionId {
    pub fn random() -> SessionId {
        let mut b = [0u8; 16];
        getrandom(&mut b);
        SessionId(u128::from_be_bytes(b))
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .expect("/dev/urandom is readable");
}

/// The first frame on a connection, both ways.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    pub session: SessionId,
    /// Which of the opener's connections this is (for logs).
    pub connection: u32,
    /// Per channel, how many frames the sender of this Hello has consumed: the other side
    /// treats it as an acknowledgement.
    pub consumed: BTreeMap<u16, u64>,
}

impl Hello {
    pub fn frame(&self) -> Frame {
        Frame {
            kind: FrameKind::Hello,
            channel: ChannelId(0),
            seq: Seq(0),
            payload: Bytes::from(serde_json::to_vec(self).expect("Hello serializes")),
        }
    }

    pub fn parse(frame: &Frame) -> Result<Hello, SessionError> {
        if frame.kind != FrameKind::Hello {
            return Err(SessionError::Protocol(format!(
                "expected a Hello frame first, got {:?}",
                frame.kind
            )));
        }
        serde_json::from_slice(&frame.payload)
            .map_err(|e| SessionError::Protocol(format!("malformed Hello: {e}")))
    }
}

/// Tuning for one session.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Unacknowledged bytes allowed per channel before `send` waits.
    pub send_limit_bytes: usize,
    /// The consumer acknowledges after taking this many bytes (and whenever it has taken
    /// everything that arrived).
    pub ack_every_bytes: usize,
    /// Frames a receiver holds out of order at most (far more than a sender's limit allows).
    pub reorder_window: u64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            send_limit_bytes: 4 << 20,
            ack_every_bytes: 128 << 10,
            reorder_window: 1 << 20,
        }
    }
}

/// What a consumer receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    Data(Bytes),
    /// Everything sent on the channel before the barrier has been received.
    Barrier,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SessionError {
    #[error("session failed: {0}")]
    Failed(String),
    #[error("wire protocol error: {0}")]
    Protocol(String),
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("connection lost: {0}")]
    Io(String),
}

/// Counters for progress reports and timelines.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SessionStats {
    /// Frame bytes written to connections (replays included).
    pub wire_bytes_out: u64,
    /// Frame bytes read from connections.
    pub wire_bytes_in: u64,
    /// Payload bytes accepted from the producer.
    pub payload_bytes_sent: u64,
    /// Payload bytes handed to consumers.
    pub payload_bytes_received: u64,
    /// Frames sent again after a connection dropped.
    pub replayed_frames: u64,
    /// Duplicates the receiver discarded.
    pub duplicate_frames: u64,
    pub connections_live: u32,
    pub connections_opened: u32,
    pub connections_lost: u32,
    /// Unacknowledged payload bytes over all send channels.
    pub unacked_bytes: u64,
}

#[derive(Debug)]
struct RecvChannel {
    reorder: Reorder,
    ready: VecDeque<Frame>,
    consumed: u64,
    acked: u64,
    bytes_since_ack: usize,
}

#[derive(Debug)]
struct State {
    config: SessionConfig,
    send: BTreeMap<u16, Outbox>,
    queue: VecDeque<Frame>,
    acks_due: BTreeMap<u16, u64>,
    recv: BTreeMap<u16, RecvChannel>,
    failed: Option<String>,
    stats: SessionStats,
    /// When the last connection went down (None while one is up).
    down_since: Option<Instant>,
}

#[derive(Debug)]
struct Inner {
    id: SessionId,
    state: Mutex<State>,
    changed: Notify,
}

/// One side of a session. Cheap to clone; all clones are the same session.
#[derive(Debug, Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

impl Session {
    pub fn new(id: SessionId, config: SessionConfig) -> Session {
        Session {
            inner: Arc::new(Inner {
                id,
                state: Mutex::new(State {
                    config,
                    send: BTreeMap::new(),
                    queue: VecDeque::new(),
                    acks_due: BTreeMap::new(),
                    recv: BTreeMap::new(),
                    failed: None,
                    stats: SessionStats::default(),
                    down_since: Some(Instant::now()),
                }),
                changed: Notify::new(),
            }),
        }
    }

    pub fn id(&self) -> SessionId {
        self.inner.id
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().expect("session lock")
    }

    /// Waits until `ready` returns something, re-checking after every change to the session.
    async fn wait_for<T>(
        &self,
        mut ready: impl FnMut(&mut State) -> Result<Option<T>, SessionError>,
    ) -> Result<T, SessionError> {
        loop {
            let notified = self.inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                if let Some(reason) = &st.failed {
                    return Err(SessionError::Failed(reason.clone()));
                }
                if let Some(v) = ready(&mut st)? {
                    return Ok(v);
                }
            }
            notified.await;
        }
    }

    fn wake(&self) {
        self.inner.changed.notify_waiters();
    }

    /// Queues `payload` on `channel`, waiting while the channel's unacknowledged bytes are at
    /// the limit.
    pub async fn send(&self, channel: ChannelId, payload: Bytes) -> Result<(), SessionError> {
        let len = payload.len();
        let mut payload = Some(payload);
        self.wait_for(|st| {
            let limit = st.config.send_limit_bytes;
            let outbox = st
                .send
                .entry(channel.0)
                .or_insert_with(|| Outbox::new(channel, limit));
            if !outbox.has_room(len) {
                return Ok(None);
            }
            let frame = outbox
                .push(payload.take().expect("pushed once"))
                .expect("room was checked");
            st.stats.payload_bytes_sent += len as u64;
            st.queue.push_back(frame);
            Ok(Some(()))
        })
        .await?;
        self.wake();
        Ok(())
    }

    /// Queues a barrier on `channel`.
    pub fn barrier(&self, channel: ChannelId) -> Result<(), SessionError> {
        let mut st = self.lock();
        if let Some(reason) = &st.failed {
            return Err(SessionError::Failed(reason.clone()));
        }
        let limit = st.config.send_limit_bytes;
        let frame = st
            .send
            .entry(channel.0)
            .or_insert_with(|| Outbox::new(channel, limit))
            .push_barrier();
        st.queue.push_back(frame);
        drop(st);
        self.wake();
        Ok(())
    }

    /// Waits until everything sent on `channel` so far has been consumed by the peer.
    pub async fn flushed(&self, channel: ChannelId) -> Result<(), SessionError> {
        self.wait_for(|st| {
            Ok(st
                .send
                .get(&channel.0)
                .is_none_or(|o| o.acked() == o.next())
                .then_some(()))
        })
        .await
    }

    /// The next thing received on `channel`, in order, exactly once.
    pub async fn recv(&self, channel: ChannelId) -> Result<Received, SessionError> {
        let received = self
            .wait_for(|st| {
                let ack_every = st.config.ack_every_bytes;
                let window = st.config.reorder_window;
                let rc = st
                    .recv
                    .entry(channel.0)
                    .or_insert_with(|| recv_channel(window));
                let Some(frame) = rc.ready.pop_front() else {
                    return Ok(None);
                };
                rc.consumed += 1;
                rc.bytes_since_ack += frame.payload.len();
                // Acknowledge in batches, and at once when the consumer has caught up, so the
                // sender's window reopens without waiting for more data.
                let ack =
                    (rc.bytes_since_ack >= ack_every || rc.ready.is_empty()).then_some(rc.consumed);
                if let Some(upto) = ack {
                    rc.bytes_since_ack = 0;
                    rc.acked = upto;
                    st.acks_due.insert(channel.0, upto);
                }
                st.stats.payload_bytes_received += frame.payload.len() as u64;
                Ok(Some((frame, ack.is_some())))
            })
            .await;
        let (frame, acked) = received?;
        if acked {
            self.wake();
        }
        Ok(match frame.kind {
            FrameKind::Barrier => Received::Barrier,
            _ => Received::Data(frame.payload),
        })
    }

    /// Ends the session: every waiting and later call returns `reason`, connections close.
    pub fn fail(&self, reason: impl Into<String>) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(reason.into());
        }
        drop(st);
        self.wake();
    }

    /// Why the session failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    pub fn stats(&self) -> SessionStats {
        let st = self.lock();
        let mut stats = st.stats.clone();
        stats.unacked_bytes = st.send.values().map(|o| o.held_bytes() as u64).sum();
        stats
    }

    /// Unacknowledged payload bytes on one channel.
    pub fn unacked_bytes_on(&self, channel: ChannelId) -> u64 {
        self.lock()
            .send
            .get(&channel.0)
            .map_or(0, |o| o.held_bytes() as u64)
    }

    /// How long no connection has been up (zero while one is).
    pub fn idle_for(&self) -> Duration {
        self.lock()
            .down_since
            .map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Changes every send channel's unacknowledged-bytes limit (sized from the link).
    pub fn set_send_limit(&self, bytes: usize) {
        let mut st = self.lock();
        st.config.send_limit_bytes = bytes;
        for o in st.send.values_mut() {
            o.set_limit(bytes);
        }
        drop(st);
        self.wake();
    }

    /// The Hello this side sends on a new connection.
    pub fn hello(&self, connection: u32) -> Hello {
        let st = self.lock();
        Hello {
            session: self.inner.id,
            connection,
            consumed: st.recv.iter().map(|(ch, rc)| (*ch, rc.consumed)).collect(),
        }
    }

    /// Applies the peer's Hello: what it consumed is acknowledged, the rest will be sent again.
    pub fn accept_hello(&self, hello: &Hello) -> Result<(), SessionError> {
        if hello.session != self.inner.id {
            return Err(SessionError::Protocol(format!(
                "peer's Hello is for session {}, this is {}",
                hello.session, self.inner.id
            )));
        }
        let mut st = self.lock();
        for (ch, consumed) in &hello.consumed {
            if let Some(outbox) = st.send.get_mut(ch) {
                outbox.ack(Seq(*consumed)).map_err(|e| {
                    SessionError::Protocol(format!("peer's Hello does not fit: {e}"))
                })?;
            }
        }
        requeue_unacked(&mut st);
        drop(st);
        self.wake();
        Ok(())
    }

    /// Carries the session over one connection whose Hellos were exchanged, until it fails
    /// or the session does. Returns why the connection ended.
    pub async fn run_connection<S>(&self, stream: S, leftover: BytesMut) -> SessionError
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        {
            let mut st = self.lock();
            st.stats.connections_live += 1;
            st.stats.connections_opened += 1;
            st.down_since = None;
        }
        // The bookkeeping for a lost connection runs even if this future is dropped.
        let _down = ConnectionDown(self);
        let (reader, writer) = tokio::io::split(stream);
        tokio::select! {
            e = self.read_loop(reader, leftover) => e,
            e = self.write_loop(writer) => e,
        }
    }

    async fn read_loop<R: AsyncRead + Unpin>(
        &self,
        mut reader: R,
        mut buf: BytesMut,
    ) -> SessionError {
        loop {
            loop {
                match Frame::decode(&mut buf) {
                    Ok(Some(frame)) => {
                        if let Err(e) = self.on_frame(frame) {
                            return e;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => return e.into(),
                }
            }
            buf.reserve(256 << 10);
            let n = tokio::select! {
                r = reader.read_buf(&mut buf) => r,
                e = self.wait_for(|_| Ok(None::<()>)) => return e.expect_err("never ready"),
            };
            match n {
                Ok(0) => return SessionError::Io("peer closed the connection".into()),
                Ok(n) => self.lock().stats.wire_bytes_in += n as u64,
                Err(e) => return SessionError::Io(e.to_string()),
            }
        }
    }

    fn on_frame(&self, frame: Frame) -> Result<(), SessionError> {
        let mut st = self.lock();
        match frame.kind {
            // A keepalive from a peer that has received nothing yet.
            FrameKind::Ack if frame.seq == Seq(0) && !st.send.contains_key(&frame.channel.0) => {}
            FrameKind::Ack => {
                let outbox = st.send.get_mut(&frame.channel.0).ok_or_else(|| {
                    SessionError::Protocol(format!(
                        "ack for channel {} that was never sent on",
                        frame.channel.0
                    ))
                })?;
                outbox
                    .ack(frame.seq)
                    .map_err(|e| SessionError::Protocol(e.to_string()))?;
            }
            FrameKind::Data | FrameKind::Barrier => {
                let window = st.config.reorder_window;
                let rc = st
                    .recv
                    .entry(frame.channel.0)
                    .or_insert_with(|| recv_channel(window));
                let before = rc.reorder.duplicates();
                let mut out = Vec::new();
                rc.reorder
                    .push(frame, &mut out)
                    .map_err(|e| SessionError::Protocol(e.to_string()))?;
                let dups = rc.reorder.duplicates() - before;
                rc.ready.extend(out);
                st.stats.duplicate_frames += dups;
            }
            FrameKind::Hello => {
                return Err(SessionError::Protocol(
                    "Hello in the middle of a connection".into(),
                ))
            }
        }
        drop(st);
        self.wake();
        Ok(())
    }

    async fn write_loop<W: AsyncWrite + Unpin>(&self, mut writer: W) -> SessionError {
        let mut out = BytesMut::new();
        loop {
            let next = self.wait_for(|st| {
                let mut frames = Vec::new();
                for (ch, upto) in std::mem::take(&mut st.acks_due) {
                    frames.push(Frame::ack(ChannelId(ch), Seq(upto)));
                }
                // Up to 256 KiB per write: enough to fill a TCP window, small enough that
                // one connection does not take the whole queue from the others.
                let mut bytes = 0;
                while bytes < 256 << 10 {
                    let Some(frame) = st.queue.pop_front() else {
                        break;
                    };
                    let acked = st.send.get(&frame.channel.0).map_or(Seq(0), |o| o.acked());
                    if frame.seq < acked {
                        continue; // acknowledged while it waited for a replay
                    }
                    bytes += frame.encoded_len();
                    frames.push(frame);
                }
                Ok((!frames.is_empty()).then_some(frames))
            });
            let batch = match tokio::time::timeout(KEEPALIVE, next).await {
                Ok(Ok(b)) => b,
                Ok(Err(e)) => return e,
                Err(_) => self.keepalive(),
            };
            out.clear();
            for f in &batch {
                f.encode(&mut out);
            }
            if let Err(e) = writer.write_all(&out).await {
                return SessionError::Io(e.to_string());
            }
            self.lock().stats.wire_bytes_out += out.len() as u64;
        }
    }

    /// What an idle connection sends: the acknowledgements again (they are cumulative, so
    /// repeating them is harmless). Without traffic a connection whose peer gave up on it (its
    /// own timeout fired during an outage) would look alive here forever, with this side
    /// waiting for acknowledgements that can only come on a new connection; writing finds out
    /// (a reset, or TCP's user timeout) and the session redials.
    fn keepalive(&self) -> Vec<Frame> {
        let st = self.lock();
        let mut frames: Vec<Frame> = st
            .recv
            .iter()
            .map(|(ch, rc)| Frame::ack(ChannelId(*ch), Seq(rc.acked)))
            .collect();
        if frames.is_empty() {
            frames.push(Frame::ack(ChannelId(0), Seq(0)));
        }
        frames
    }
}

/// Marks a connection gone: counters, the idle clock, and everything unacknowledged queued
/// again.
struct ConnectionDown<'a>(&'a Session);

impl Drop for ConnectionDown<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.stats.connections_live -= 1;
        st.stats.connections_lost += 1;
        if st.stats.connections_live == 0 {
            st.down_since = Some(Instant::now());
        }
        requeue_unacked(&mut st);
        drop(st);
        self.0.wake();
    }
}

fn recv_channel(window: u64) -> RecvChannel {
    RecvChannel {
        reorder: Reorder::new(window),
        ready: VecDeque::new(),
        consumed: 0,
        acked: 0,
        bytes_since_ack: 0,
    }
}

/// Puts every unacknowledged frame back in the send queue, in order. Frames that are also
/// still in flight on a live connection arrive twice; the receiver drops the second copy.
fn requeue_unacked(st: &mut State) {
    let queued_before = st.queue.len();
    st.queue.clear();
    let mut frames: Vec<Frame> = st
        .send
        .values()
        .flat_map(|o| o.unacked().cloned())
        .collect();
    // Oldest first within each channel; channels interleaved by position.
    frames.sort_by_key(|f| (f.seq, f.channel));
    let replayed = frames.len().saturating_sub(queued_before);
    st.stats.replayed_frames += replayed as u64;
    st.queue.extend(frames);
}

/// Exchanges Hellos on a fresh connection: sends ours, reads theirs (with whatever bytes
/// followed it), and returns theirs. The caller checks it belongs to the session.
pub async fn exchange_hello<S>(
    stream: &mut S,
    ours: &Hello,
    timeout: Duration,
) -> Result<(Hello, BytesMut), SessionError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let work = async {
        let mut out = BytesMut::new();
        ours.frame().encode(&mut out);
        stream
            .write_all(&out)
            .await
            .map_err(|e| SessionError::Io(e.to_string()))?;
        read_hello(stream).await
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| SessionError::Io(format!("no Hello from the peer within {timeout:?}")))?
}

/// Reads the peer's Hello (the first frame), returning the bytes that followed it.
pub async fn read_hello<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<(Hello, BytesMut), SessionError> {
    let mut buf = BytesMut::new();
    loop {
        if let Some(frame) = Frame::decode(&mut buf)? {
            return Ok((Hello::parse(&frame)?, buf));
        }
        let n = stream
            .read_buf(&mut buf)
            .await
            .map_err(|e| SessionError::Io(e.to_string()))?;
        if n == 0 {
            return Err(SessionError::Io(
                "peer closed the connection before its Hello".into(),
            ));
        }
    }
}
