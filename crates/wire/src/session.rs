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
//! - **Urgent channels** ([`Session::make_urgent`]) have a queue of their own that writers
//!   drain first: their frames wait behind what the connections have in flight, never behind
//!   the other channels' queued frames (postcopy's page requests, behind the bulk).
//!
//! - **Parking**: a session that has done its work can give its connections back instead of
//!   closing them ([`Session::park`]): each side sends a `Park` frame after everything it had
//!   queued, and a connection on which both sides have sent one ends as
//!   [`ConnectionEnd::Parked`], ready for the next session's Hello. A connection reused that way
//!   skips TCP's and TLS's handshakes and keeps its congestion window.
//!
//! The session never fails on its own because connections drop; the owner decides how long
//! it waits (see [`Session::idle_for`]) and then calls [`Session::fail`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;

use crate::frame::{ChannelId, Frame, FrameError, FrameKind, Seq, MAX_PAYLOAD_BYTES};
use crate::outbox::{Outbox, MAX_SEND_WINDOW_BYTES, MAX_UNACKED_FRAMES};
use crate::reorder::Reorder;

/// An idle connection sends this often (see `Session::keepalive`).
const KEEPALIVE: Duration = Duration::from_secs(1);
/// A connection that hears nothing for this long is given up (and the session redials): the
/// peer writes at least every [`KEEPALIVE`], so its process stopped or the path swallows
/// everything. TCP's user timeout (`net::USER_TIMEOUT`) catches a black hole only while this
/// side has data unacknowledged, and never a peer whose kernel still acknowledges bytes its
/// process no longer reads.
const SILENCE_LIMIT: Duration = Duration::from_secs(10);

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
    /// What a receiver holds per channel, arrived but not yet consumed (out of order or
    /// ready), at most: payload bytes and frames. A peer that sends more has outrun any window
    /// a sender may have, and the session fails. The defaults are the most an honest sender can
    /// have unacknowledged ([`MAX_SEND_WINDOW_BYTES`] plus the one frame an empty outbox always
    /// takes; [`MAX_UNACKED_FRAMES`] plus room for barriers, which take no room at the sender).
    pub recv_limit_bytes: usize,
    pub recv_limit_frames: usize,
}

/// Channels a receiver keeps at most: the agents use a handful, and each one may hold up to
/// `recv_limit_bytes`.
pub const MAX_RECV_CHANNELS: usize = 16;

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            send_limit_bytes: 4 << 20,
            ack_every_bytes: 128 << 10,
            recv_limit_bytes: MAX_SEND_WINDOW_BYTES + MAX_PAYLOAD_BYTES as usize,
            recv_limit_frames: MAX_UNACKED_FRAMES + 1024,
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
    /// Connections that left the session cleanly (see [`Session::park`]).
    #[serde(default)]
    pub connections_parked: u32,
    /// Unacknowledged payload bytes over all send channels.
    pub unacked_bytes: u64,
}

#[derive(Debug)]
struct RecvChannel {
    reorder: Reorder,
    ready: VecDeque<Frame>,
    /// Payload bytes and frames arrived and not yet consumed (held by `reorder` or ready).
    unconsumed_bytes: usize,
    unconsumed_frames: usize,
    consumed: u64,
    acked: u64,
    bytes_since_ack: usize,
}

#[derive(Debug)]
struct State {
    config: SessionConfig,
    send: BTreeMap<u16, Outbox>,
    queue: VecDeque<Frame>,
    /// Frames of the urgent channels, sent before anything in `queue`.
    urgent: VecDeque<Frame>,
    urgent_channels: BTreeSet<u16>,
    acks_due: BTreeMap<u16, u64>,
    recv: BTreeMap<u16, RecvChannel>,
    failed: Option<String>,
    stats: SessionStats,
    /// When the last connection went down (None while one is up).
    down_since: Option<Instant>,
    /// The owner is done: connections send `Park` once their queue is empty.
    parking: bool,
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
                    urgent: VecDeque::new(),
                    urgent_channels: BTreeSet::new(),
                    acks_due: BTreeMap::new(),
                    recv: BTreeMap::new(),
                    failed: None,
                    stats: SessionStats::default(),
                    down_since: Some(Instant::now()),
                    parking: false,
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
            st.enqueue(frame);
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
        st.enqueue(frame);
        drop(st);
        self.wake();
        Ok(())
    }

    /// From now on `channel`'s frames go out before every other channel's queued frames.
    pub fn make_urgent(&self, channel: ChannelId) {
        self.lock().urgent_channels.insert(channel.0);
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
                let window = st.config.recv_limit_frames;
                let rc = st
                    .recv
                    .entry(channel.0)
                    .or_insert_with(|| recv_channel(window));
                let Some(frame) = rc.ready.pop_front() else {
                    return Ok(None);
                };
                rc.unconsumed_bytes -= frame.payload.len();
                rc.unconsumed_frames -= 1;
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

    /// Gives the session's connections back for reuse: each sends what it has queued, then
    /// `Park`, and ends as [`ConnectionEnd::Parked`] once the peer's `Park` arrived. The session
    /// dials no new connection from here on. Wait with [`Session::parked`], then
    /// [`Session::fail`] to end it.
    pub fn park(&self) {
        self.lock().parking = true;
        self.wake();
    }

    /// Whether [`Session::park`] was called.
    pub fn is_parking(&self) -> bool {
        self.lock().parking
    }

    /// Waits until no connection is up: after [`Session::park`], until every connection has
    /// parked (or dropped). Bound it with a timeout: a peer that never answers keeps it waiting.
    pub async fn parked(&self) -> Result<(), SessionError> {
        self.wait_for(|st| Ok((st.stats.connections_live == 0).then_some(())))
            .await
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

    /// Waits until at most `bytes` of `channel`'s payload are unacknowledged.
    pub async fn unacked_at_most(
        &self,
        channel: ChannelId,
        bytes: u64,
    ) -> Result<(), SessionError> {
        self.wait_for(|st| {
            let held = st.send.get(&channel.0).map_or(0, |o| o.held_bytes() as u64);
            Ok((held <= bytes).then_some(()))
        })
        .await
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

    /// Every send channel's unacknowledged-bytes limit now.
    pub fn send_limit(&self) -> usize {
        self.lock().config.send_limit_bytes
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
        self.ack_hello(hello)?;
        let mut st = self.lock();
        requeue_unacked(&mut st);
        drop(st);
        self.wake();
        Ok(())
    }

    /// What the peer's Hello acknowledges, acknowledged.
    fn ack_hello(&self, hello: &Hello) -> Result<(), SessionError> {
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
        drop(st);
        self.wake();
        Ok(())
    }

    /// Carries the session over one connection whose Hellos were exchanged, until it fails,
    /// the session does, or both sides parked it.
    pub async fn run_connection<S>(&self, stream: S, leftover: BytesMut) -> ConnectionEnd<S>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        self.carry(stream, leftover, false).await
    }

    /// Whether no connection has carried the session yet: its first connection may send before
    /// the peer's Hello arrives (see [`Session::run_connection_before_hello`]).
    pub fn is_fresh(&self) -> bool {
        self.lock().stats.connections_opened == 0
    }

    /// Carries a fresh session over a connection on which only this side's Hello went out: the
    /// peer's Hello is the first frame read. Queued frames go out at once, in the same flight
    /// as the Hello (the destination's Prepare: a round trip saved). Only for a session with
    /// nothing to replay: a peer's Hello arriving later acknowledges what it consumed but puts
    /// nothing back in the queue, so it must have consumed nothing.
    pub async fn run_connection_before_hello<S>(&self, stream: S) -> ConnectionEnd<S>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        self.carry(stream, BytesMut::new(), true).await
    }

    async fn carry<S>(&self, stream: S, leftover: BytesMut, hello_due: bool) -> ConnectionEnd<S>
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
        let mut down = ConnectionDown {
            session: self,
            parked: false,
        };
        let (mut reader, mut writer) = tokio::io::split(stream);
        // Set when the peer's Park arrives: this side then parks the connection too.
        let peer_parked = AtomicBool::new(false);
        let ended = tokio::try_join!(
            self.read_loop(&mut reader, leftover, hello_due, &peer_parked),
            self.write_loop(&mut writer, &peer_parked),
        );
        match ended {
            Ok((leftover, ())) => {
                down.parked = true;
                ConnectionEnd::Parked(reader.unsplit(writer), leftover)
            }
            Err(e) => ConnectionEnd::Lost(e),
        }
    }

    /// Reads frames until the peer parks the connection (returning what followed its `Park`)
    /// or something fails.
    async fn read_loop<R: AsyncRead + Unpin>(
        &self,
        reader: &mut R,
        mut buf: BytesMut,
        mut hello_due: bool,
        peer_parked: &AtomicBool,
    ) -> Result<BytesMut, SessionError> {
        loop {
            while let Some(frame) = Frame::decode(&mut buf)? {
                if hello_due {
                    hello_due = false;
                    self.ack_hello(&Hello::parse(&frame)?)?;
                    continue;
                }
                if frame.kind == FrameKind::Park {
                    peer_parked.store(true, Ordering::Release);
                    self.wake();
                    return Ok(buf);
                }
                self.on_frame(frame)?;
            }
            buf.reserve(256 << 10);
            let n = tokio::select! {
                r = tokio::time::timeout(SILENCE_LIMIT, reader.read_buf(&mut buf)) => {
                    r.map_err(|_| SessionError::Io(format!(
                        "nothing heard from the peer for {}s", SILENCE_LIMIT.as_secs()
                    )))?
                }
                e = self.wait_for(|_| Ok(None::<()>)) => return Err(e.expect_err("never ready")),
            };
            match n {
                Ok(0) => return Err(SessionError::Io("peer closed the connection".into())),
                Ok(n) => self.lock().stats.wire_bytes_in += n as u64,
                Err(e) => return Err(SessionError::Io(e.to_string())),
            }
        }
    }

    /// Fails the session for a peer that broke the protocol in a way a reconnect would only
    /// repeat (its replay would outrun the same limit).
    fn refuse_peer(&self, mut st: MutexGuard<'_, State>, reason: String) -> SessionError {
        st.failed.get_or_insert_with(|| reason.clone());
        drop(st);
        self.wake();
        SessionError::Protocol(reason)
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
                let (limit_bytes, limit_frames) =
                    (st.config.recv_limit_bytes, st.config.recv_limit_frames);
                let channel = frame.channel.0;
                if !st.recv.contains_key(&channel) && st.recv.len() >= MAX_RECV_CHANNELS {
                    return Err(self.refuse_peer(
                        st,
                        format!("the peer opened channel {channel}, more than the {MAX_RECV_CHANNELS} channels a receiver keeps"),
                    ));
                }
                let rc = st
                    .recv
                    .entry(channel)
                    .or_insert_with(|| recv_channel(limit_frames));
                let is_new = rc.reorder.is_new(frame.seq);
                let (bytes, frames) = (
                    rc.unconsumed_bytes + frame.payload.len(),
                    rc.unconsumed_frames + 1,
                );
                if is_new && (bytes > limit_bytes || frames > limit_frames) {
                    return Err(self.refuse_peer(
                        st,
                        format!(
                            "the peer outran its window on channel {channel}: {bytes} bytes in \
                             {frames} frames unconsumed, the limit is {limit_bytes} bytes in \
                             {limit_frames}"
                        ),
                    ));
                }
                let before = rc.reorder.duplicates();
                let mut out = Vec::new();
                rc.reorder
                    .push(frame, &mut out)
                    .map_err(|e| SessionError::Protocol(e.to_string()))?;
                if is_new {
                    (rc.unconsumed_bytes, rc.unconsumed_frames) = (bytes, frames);
                }
                let dups = rc.reorder.duplicates() - before;
                rc.ready.extend(out);
                st.stats.duplicate_frames += dups;
            }
            FrameKind::Hello => {
                return Err(SessionError::Protocol(
                    "Hello in the middle of a connection".into(),
                ))
            }
            FrameKind::Park => unreachable!("the read loop handles Park"),
        }
        drop(st);
        self.wake();
        Ok(())
    }

    /// Writes queued frames until the session parks (or the peer parked this connection) and
    /// nothing is left to send: then writes `Park` and returns.
    async fn write_loop<W: AsyncWrite + Unpin>(
        &self,
        writer: &mut W,
        peer_parked: &AtomicBool,
    ) -> Result<(), SessionError> {
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
                    let Some(frame) = st.urgent.pop_front().or_else(|| st.queue.pop_front()) else {
                        break;
                    };
                    let acked = st.send.get(&frame.channel.0).map_or(Seq(0), |o| o.acked());
                    if frame.seq < acked {
                        continue; // acknowledged while it waited for a replay
                    }
                    bytes += frame.encoded_len();
                    frames.push(frame);
                }
                if frames.is_empty() && (st.parking || peer_parked.load(Ordering::Acquire)) {
                    frames.push(Frame::park());
                }
                Ok((!frames.is_empty()).then_some(frames))
            });
            let batch = match tokio::time::timeout(KEEPALIVE, next).await {
                Ok(b) => b?,
                Err(_) => self.keepalive(),
            };
            out.clear();
            for f in &batch {
                f.encode(&mut out);
            }
            write_out(writer, &out).await?;
            self.lock().stats.wire_bytes_out += out.len() as u64;
            if batch.last().is_some_and(|f| f.kind == FrameKind::Park) {
                return Ok(());
            }
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

/// How a connection left its session.
#[derive(Debug)]
pub enum ConnectionEnd<S> {
    /// Both sides sent `Park`: the stream is at a frame boundary and may carry another
    /// session's Hello; the bytes are what followed the peer's `Park` (nothing, from a peer
    /// that keeps the protocol).
    Parked(S, BytesMut),
    Lost(SessionError),
}

/// Marks a connection gone: counters, the idle clock, and everything unacknowledged queued
/// again.
struct ConnectionDown<'a> {
    session: &'a Session,
    parked: bool,
}

impl Drop for ConnectionDown<'_> {
    fn drop(&mut self) {
        let mut st = self.session.lock();
        st.stats.connections_live -= 1;
        if self.parked {
            st.stats.connections_parked += 1;
        } else {
            st.stats.connections_lost += 1;
        }
        if st.stats.connections_live == 0 {
            st.down_since = Some(Instant::now());
        }
        requeue_unacked(&mut st);
        drop(st);
        self.session.wake();
    }
}

fn recv_channel(window: usize) -> RecvChannel {
    let window = u64::try_from(window).unwrap_or(u64::MAX);
    RecvChannel {
        reorder: Reorder::new(window),
        ready: VecDeque::new(),
        unconsumed_bytes: 0,
        unconsumed_frames: 0,
        consumed: 0,
        acked: 0,
        bytes_since_ack: 0,
    }
}

/// Puts every unacknowledged frame back in the send queue, in order. Frames that are also
/// still in flight on a live connection arrive twice; the receiver drops the second copy.
fn requeue_unacked(st: &mut State) {
    let queued_before = st.queue.len() + st.urgent.len();
    st.queue.clear();
    st.urgent.clear();
    let mut frames: Vec<Frame> = st
        .send
        .values()
        .flat_map(|o| o.unacked().cloned())
        .collect();
    // Oldest first within each channel; channels interleaved by position.
    frames.sort_by_key(|f| (f.seq, f.channel));
    let replayed = frames.len().saturating_sub(queued_before);
    st.stats.replayed_frames += replayed as u64;
    for frame in frames {
        st.enqueue(frame);
    }
}

impl State {
    /// Queues a frame for the writers: an urgent channel's ahead of the others'.
    fn enqueue(&mut self, frame: Frame) {
        if self.urgent_channels.contains(&frame.channel.0) {
            self.urgent.push_back(frame);
        } else {
            self.queue.push_back(frame);
        }
    }
}

/// Writes `bytes` and flushes them. tokio-rustls takes a write into its own buffer and
/// returns once the socket would block, and what the socket did not take stays there until
/// the next write or a flush: without the flush the last frames before a lull in the stream
/// (the switchover's) would wait for the next frame or keepalive, up to a second later.
pub(crate) async fn write_out<W: AsyncWrite + Unpin>(
    writer: &mut W,
    bytes: &[u8],
) -> Result<(), SessionError> {
    let io = |e: std::io::Error| SessionError::Io(e.to_string());
    writer.write_all(bytes).await.map_err(io)?;
    writer.flush().await.map_err(io)
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
        write_out(stream, &out).await?;
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
    read_hello_after(stream, BytesMut::new()).await
}

/// Reads the peer's Hello from `buf` and then the stream (on a parked connection, `buf` holds
/// what followed the peer's `Park`), skipping the keepalives (`Park`) of a parked connection.
pub async fn read_hello_after<S: AsyncRead + Unpin>(
    stream: &mut S,
    mut buf: BytesMut,
) -> Result<(Hello, BytesMut), SessionError> {
    loop {
        while let Some(frame) = Frame::decode(&mut buf)? {
            if frame.kind != FrameKind::Park {
                return Ok((Hello::parse(&frame)?, buf));
            }
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
