//! QEMU's migration stream through a libvirt tunnel ([`crate::tunnel`]): parsed, hashed and
//! coded on the WAN as a ferry migration's stream is, and gated by digests at the destination,
//! so that the destination QEMU (which libvirt resumes by itself once it has loaded the stream)
//! reads only bytes whose digest the source confirmed.
//!
//! ```text
//!  source agent                                          destination agent
//!  QEMU -> parse -> digest -> codec ======STREAM======> decode -> held
//!  when QEMU has nothing more right now, in its tail, with multifd,
//!  or every CHECKPOINT_BYTES:  Checkpoint{n, digest} ==> the held bytes up to n hash to digest?
//!                                                        yes: QEMU reads them; no: abort
//!  QEMU's end of stream:       End{n, digest} ========> the last bytes; QEMU's input ends
//!                                           <========== Delivered
//!  QEMU <----------------------------------RETURN_PATH== QEMU
//! ```
//!
//! The gate keeps the commit point ferry's although libvirt resumes the destination: QEMU
//! cannot finish loading without the stream's last bytes, and those are released only under a
//! digest of everything before them. On a mismatch the destination QEMU's input closes, its
//! load fails, libvirt's Finish step fails and libvirt resumes the source.
//!
//! Both ends use the codec with every technique on and the largest page history (what a page
//! history holds is bounded by the guest's memory anyway); the zstd level follows the peer's
//! configured rate.
//!
//! QEMU's multifd channels (libvirt's `--parallel`) cross the same way, each in a session of
//! its own ([`channel_source`]; the destination's side is the same [`destination`]): parsed as
//! multifd packets, their pages coded, checkpointed and gated. The main stream's gate alone
//! would not do: QEMU loads the pages from the channels, and a channel's corrupted bytes must
//! never reach it. Nor can QEMU finish loading while a channel's last packets are held back,
//! so the commit point stays the main stream's end.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use bytes::{Bytes, BytesMut};
use ferry_api::agent::MultifdChannelReport;
use ferry_api::agent::{CodecSettings, MigrationState, Phase};
use ferry_api::EventKind;
use ferry_qemu::multifd::{self, ChannelParser};
use ferry_qemu::stream::StreamParser;
use ferry_wire::{ChannelId, Received, Session};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use crate::engine::control::{self, Control, PeerAborted, RETURN_PATH, STREAM};
use crate::engine::digest::{StreamDigest, ALGORITHM};
use crate::engine::feeder::{self, Feeder};
use crate::engine::status::{now_ms, Events, Shared};
use crate::engine::stream_codec::{StreamDecoder, StreamEncoder, HISTORY_CAP};
use crate::group::GroupLink;

/// The codec's techniques on a tunnelled stream.
pub const CODEC: CodecSettings = CodecSettings::ALL;
/// Bytes read from QEMU at a time.
const CHUNK: usize = 64 << 10;
/// During the memory passes a checkpoint goes at most every this many stream bytes (when QEMU
/// has nothing more to read), so the destination holds little and waits for no round trip.
const CHECKPOINT_BYTES: u64 = 1 << 20;
/// ... and at least every this many, however busy QEMU keeps the source.
const MAX_UNCHECKED_BYTES: u64 = 8 << 20;
/// How long the source waits for the destination's word that QEMU has the whole stream.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(60);

/// The source's side: QEMU's stream (its first bytes already read into `first`) over
/// `session`, and the return path back into QEMU. Returns when the destination says its QEMU
/// has the whole verified stream.
pub async fn source(source: Source, session: &Session, status: &Shared) -> Result<()> {
    status.update(|s| {
        s.phase = Phase::Memory;
        s.detail = "QEMU sends the VM's memory".into();
        s.event(EventKind::MemoryStarted, "QEMU connected to the tunnel");
    });
    let Source {
        first,
        from_qemu,
        to_qemu,
        link_rate_mbit,
        corrupt_at,
        group,
    } = source;
    let tail = AtomicBool::new(false);
    let pump = pump(
        Parser::Main(StreamParser::new()),
        first,
        from_qemu,
        session,
        status,
        link_rate_mbit,
        corrupt_at,
        &tail,
    );
    let hold = group.map(|group| Hold { group, tail: &tail });
    let return_path = return_path_into(to_qemu, session, status, hold);
    let (total, digest) = tokio::select! {
        r = pump => r?,
        r = return_path => {
            r?;
            bail!("the return path ended before QEMU's stream did")
        }
        _ = status.cancelled() => bail!("cancelled by the user"),
        // The destination speaks during the stream only to give up (a digest that did not
        // match); an Abort's reason names the end that gave up.
        msg = control::recv(session) => match msg? {
            Control::Abort { reason } => return Err(PeerAborted(reason).into()),
            other => bail!("unexpected message from the destination during the stream: {other:?}"),
        },
    };
    // From here the destination decides: its QEMU gets the stream's last bytes.
    if !status.close_cancel() {
        bail!("cancelled by the user");
    }
    status.update(|s| {
        s.phase = Phase::AwaitingCommit;
        s.digest = Some(digest.clone());
        s.event(
            EventKind::StreamEnded,
            format!("{total} bytes, {ALGORITHM} {digest}"),
        );
    });
    let fed_unix_us = end_and_deliver(session, total, digest).await?;
    status.update(|s| {
        s.event(
            EventKind::StreamFed,
            format!("digests matched; the destination QEMU read the stream (at {fed_unix_us} µs)"),
        )
    });
    Ok(())
}

/// The source's side of one of QEMU's multifd channels (its first bytes, the start of its
/// init packet, already read): parsed, hashed, coded and checkpointed like the main stream,
/// ended with `End`. Returns the channel's figures once the destination says its QEMU read the
/// whole verified channel. `held_open`: the connection's other half, kept open until then
/// (QEMU writes nothing back on a channel). `corrupt_at`: the test hook's byte of the channel.
pub async fn channel_source(
    first: Vec<u8>,
    from_qemu: OwnedReadHalf,
    held_open: OwnedWriteHalf,
    session: &Session,
    link_rate_mbit: f64,
    corrupt_at: Option<u64>,
) -> Result<MultifdChannelReport> {
    // The channel's own figures; the main stream's status gets them at the end.
    let status = Shared::new(ferry_api::agent::MigrationStatus::starting(
        session.id().to_string(),
        "(a multifd channel)".into(),
        now_ms(),
    ));
    let id = std::sync::atomic::AtomicU8::new(0);
    let tail = AtomicBool::new(false);
    let pump = pump(
        Parser::Channel(ChannelParser::new(), &id),
        first,
        from_qemu,
        session,
        &status,
        link_rate_mbit,
        corrupt_at,
        &tail,
    );
    let (total, digest) = tokio::select! {
        r = pump => r?,
        msg = control::recv(session) => match msg? {
            Control::Abort { reason } => return Err(PeerAborted(reason).into()),
            other => bail!("unexpected message from the destination during a multifd channel: {other:?}"),
        },
    };
    end_and_deliver(session, total, digest.clone()).await?;
    drop(held_open);
    let done = status.get();
    Ok(MultifdChannelReport {
        id: id.load(Ordering::Relaxed),
        stream_bytes: total,
        wire_bytes: done.wire.bytes_out,
        digest,
        codec: done.codec.unwrap_or_default(),
    })
}

/// Sends the stream's `End` (its length and digest) and waits for the destination's word that
/// its QEMU read all of it; returns when that was (wall clock, µs).
async fn end_and_deliver(session: &Session, bytes: u64, digest: String) -> Result<i64> {
    control::send(
        session,
        &Control::End {
            bytes,
            digest,
            preempt: None,
        },
    )
    .await?;
    match tokio::time::timeout(DELIVERY_TIMEOUT, control::recv(session))
        .await
        .context("no word from the destination within 60s of the stream's end")??
    {
        Control::Delivered { fed_unix_us, .. } => Ok(fed_unix_us),
        Control::Abort { reason } => Err(PeerAborted(reason).into()),
        other => bail!("unexpected message from the destination after the stream: {other:?}"),
    }
}

/// Sends what `from` reads on `channel` until its end of input, then a barrier there.
pub async fn forward(
    from: &mut (impl AsyncReadExt + Unpin),
    session: &Session,
    channel: ChannelId,
) -> Result<()> {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = from
            .read(&mut buf)
            .await
            .context("reading the local socket")?;
        if n == 0 {
            session.barrier(channel)?;
            return Ok(());
        }
        session
            .send(channel, Bytes::copy_from_slice(&buf[..n]))
            .await?;
    }
}

/// The source's ends of a tunnelled stream.
pub struct Source {
    /// QEMU's first bytes, already read (its stream's header).
    pub first: Vec<u8>,
    pub from_qemu: OwnedReadHalf,
    /// The return path into QEMU.
    pub to_qemu: OwnedWriteHalf,
    /// The link's rate, for the codec's zstd level.
    pub link_rate_mbit: f64,
    /// Test hook: flip a bit of the stream at this offset after hashing it.
    pub corrupt_at: Option<u64>,
    /// A group member's: QEMU's switchover waits for its group ([`return_path_into`]).
    pub group: Option<GroupLink>,
}

/// A group member's hold on its switchover: once QEMU's stream is in its tail (the VM is
/// paused, its device state going out), what the destination QEMU says back waits here.
struct Hold<'a> {
    group: GroupLink,
    /// Set by the pump once the stream is in its tail.
    tail: &'a AtomicBool,
}

/// What a tunnelled connection from QEMU carries.
enum Parser<'a> {
    /// QEMU's main stream.
    Main(StreamParser),
    /// One of its multifd channels; the channel's id goes into the atomic once read.
    Channel(ChannelParser, &'a std::sync::atomic::AtomicU8),
}

impl Parser<'_> {
    /// Parses every whole item at the front of `input`, giving each one's bytes (as QEMU
    /// wrote them) to `hash_and_count` and then to the encoder, whose full batches go to
    /// `out`. `hash_and_count` gives the bytes back, and whether the test hook altered them.
    fn drain(
        &mut self,
        input: &mut BytesMut,
        item_bytes: &mut BytesMut,
        encoder: &mut StreamEncoder,
        out: &mut BytesMut,
        mut hash_and_count: impl FnMut(Bytes) -> (Bytes, bool),
    ) -> Result<()> {
        match self {
            Parser::Main(parser) => {
                while let Some((item, bytes)) = parser.next_item_with_bytes(input)? {
                    let (bytes, _) = hash_and_count(bytes);
                    encoder.push(&item, &bytes);
                    if encoder.is_full() {
                        encoder.flush(out);
                    }
                }
            }
            Parser::Channel(parser, id) => {
                while let Some(item) = parser.next_item(input)? {
                    if let multifd::Item::Init(init) = &item {
                        id.store(init.id, Ordering::Relaxed);
                    }
                    item_bytes.clear();
                    item.encode(item_bytes);
                    let (bytes, altered) = hash_and_count(item_bytes.split().freeze());
                    if altered {
                        // The packet's pages are coded from the parsed item: altered bytes
                        // must cross as they are.
                        encoder.push_channel_as_is(&bytes);
                    } else {
                        encoder.push_channel(&item, &bytes);
                    }
                    if encoder.is_full() {
                        encoder.flush(out);
                    }
                }
            }
        }
        Ok(())
    }

    fn finish(&self, left: usize) -> Result<()> {
        match self {
            Parser::Main(parser) => parser.finish(left).context("QEMU's stream"),
            Parser::Channel(parser, _) => parser.finish(left).context("QEMU's multifd channel"),
        }
    }

    /// The stream is in its tail (the VM paused, its device state going out).
    fn in_tail(&self) -> bool {
        matches!(self, Parser::Main(parser) if parser.in_tail())
    }

    /// Whether every pause in QEMU's writing gets a checkpoint, however few bytes are
    /// unchecked. With multifd the destination QEMU cannot wait for 1 MiB: its main loop reads
    /// each new connection's first bytes before it accepts the next, and its channels stop at
    /// each pass's sync until the main stream's flush (a few bytes) arrives, and the main
    /// stream's loader until every channel's sync packet does.
    fn checkpoints_each_pause(&self) -> bool {
        match self {
            Parser::Main(parser) => parser.multifd(),
            Parser::Channel(..) => true,
        }
    }
}

/// Reads, parses, hashes and codes QEMU's stream (or channel) until its end; returns its
/// length and digest.
#[allow(clippy::too_many_arguments)]
async fn pump(
    mut parser: Parser<'_>,
    first: Vec<u8>,
    from_qemu: OwnedReadHalf,
    session: &Session,
    status: &Shared,
    link_rate_mbit: f64,
    corrupt_at: Option<u64>,
    tail: &AtomicBool,
) -> Result<(u64, String)> {
    let mut encoder = StreamEncoder::new(CODEC, HISTORY_CAP, link_rate_mbit);
    let mut input = BytesMut::from(&first[..]);
    let (mut item_bytes, mut out) = (BytesMut::new(), BytesMut::new());
    let mut hash = StreamDigest::new();
    let (mut total, mut checkpointed) = (0u64, 0u64);
    loop {
        input.reserve(CHUNK);
        // `drained`: QEMU has nothing more to read right now (or its stream ended).
        let (eof, drained) = match from_qemu.try_read_buf(&mut input) {
            Ok(n) => (n == 0, n == 0),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => (false, true),
            Err(e) => return Err(anyhow::Error::new(e).context("reading QEMU's stream")),
        };
        parser.drain(
            &mut input,
            &mut item_bytes,
            &mut encoder,
            &mut out,
            |item_bytes| {
                hash.update(&item_bytes[..]);
                let (item_bytes, altered) =
                    crate::engine::source::corrupt_for_test(item_bytes, total, corrupt_at);
                total += item_bytes.len() as u64;
                (item_bytes, altered)
            },
        )?;
        if eof {
            parser.finish(input.len())?;
        }
        if parser.in_tail() {
            tail.store(true, Ordering::Release);
        }
        let unchecked = total - checkpointed;
        let checkpoint = !eof
            && unchecked > 0
            && ((drained
                && (parser.in_tail()
                    || parser.checkpoints_each_pause()
                    || unchecked >= CHECKPOINT_BYTES))
                || unchecked >= MAX_UNCHECKED_BYTES);
        if drained || checkpoint {
            encoder.flush(&mut out);
        }
        while !out.is_empty() {
            let frame = out.split_to(out.len().min(CHUNK)).freeze();
            session.send(STREAM, frame).await?;
        }
        if checkpoint {
            let digest = hash.hex();
            control::send(
                session,
                &Control::Checkpoint {
                    bytes: total,
                    digest,
                },
            )
            .await?;
            checkpointed = total;
        }
        let report = encoder.report();
        status.update(|s| {
            s.stream_bytes = total;
            s.codec = Some(report);
        });
        record_wire(status, session);
        if eof {
            return Ok((total, hash.hex()));
        }
        if drained {
            from_qemu
                .readable()
                .await
                .context("waiting for QEMU's stream")?;
        }
    }
}

/// Writes what arrives on the return path into `to_qemu` until the destination's end of it.
///
/// With a `hold` (a group member), what arrives once the stream is in its tail is kept back:
/// QEMU's switchover waits for the destination QEMU's word that it loaded the whole stream
/// (the return path's `SHUT`, then its end), and the destination resumes only after that (libvirt's
/// Finish). When the destination QEMU has loaded everything (its return path ended) the member
/// holds; the group's release lets QEMU have the words, its abort fails the stream (QEMU's
/// migration fails: libvirt resumes the source and removes the destination's copy).
async fn return_path_into(
    mut to_qemu: OwnedWriteHalf,
    session: &Session,
    status: &Shared,
    mut hold: Option<Hold<'_>>,
) -> Result<()> {
    let mut held: Vec<Bytes> = Vec::new();
    loop {
        match session.recv(RETURN_PATH).await? {
            Received::Data(bytes) => {
                status.update(|s| s.return_path_bytes += bytes.len() as u64);
                if hold
                    .as_ref()
                    .is_some_and(|h| h.tail.load(Ordering::Acquire))
                {
                    held.push(bytes);
                    continue;
                }
                to_qemu
                    .write_all(&bytes)
                    .await
                    .context("writing QEMU's return path")?;
            }
            Received::Barrier => {
                if let Some(Hold { group, .. }) = hold.as_mut() {
                    status.update(|s| {
                        s.phase = Phase::Held;
                        s.detail = "the destination QEMU loaded the whole verified stream; \
                                    held until the group is released"
                            .into();
                    });
                    group.holding();
                    if let Err(reason) = group.decision().await {
                        bail!("the group was aborted: {reason}");
                    }
                    status.update(|s| {
                        s.phase = Phase::AwaitingCommit;
                        s.detail = "released with the group".into();
                    });
                    for bytes in held.drain(..) {
                        to_qemu
                            .write_all(&bytes)
                            .await
                            .context("writing QEMU's return path")?;
                    }
                }
                let _ = to_qemu.shutdown().await;
                // Its end is not the stream's: keep waiting for the stream.
                return std::future::pending().await;
            }
        }
    }
}

/// The destination's side: the stream decoded, verified and fed to QEMU (`to_qemu`), QEMU's
/// return path (`from_qemu`) carried back.
pub async fn destination(
    session: &Session,
    mut from_qemu: OwnedReadHalf,
    to_qemu: OwnedWriteHalf,
) -> Result<()> {
    let return_path = async {
        forward(&mut from_qemu, session, RETURN_PATH)
            .await
            .context("QEMU's return path")?;
        std::future::pending::<Result<()>>().await
    };
    let feed = async {
        let mut decoder = StreamDecoder::new(CODEC, HISTORY_CAP);
        let mut decoded = BytesMut::new();
        let mut gate = Gate::default();
        let mut feeder = Feeder::spawn(to_qemu, feeder::BUDGET_BYTES);
        while !gate.finished() {
            tokio::select! {
                r = session.recv(STREAM), if gate.has_room() => match r? {
                    Received::Data(chunk) => {
                        decoder.feed(&chunk, &mut decoded).context("decoding the stream")?;
                        gate.arrived(&decoded.split())?;
                    }
                    Received::Barrier => {}
                },
                msg = control::recv(session) => match msg? {
                    Control::Checkpoint { bytes, digest } => gate.expect(bytes, digest, false)?,
                    Control::End { bytes, digest, .. } => gate.expect(bytes, digest, true)?,
                    Control::Abort { reason } => return Err(PeerAborted(reason).into()),
                    other => bail!("unexpected control message during the stream: {other:?}"),
                },
            }
            let verified = gate.release()?;
            let weight = verified.len();
            feeder.push(verified, weight).await?;
        }
        ensure!(
            decoder.is_idle(),
            "codec bytes left over after the stream's last byte"
        );
        // QEMU's input ends once it has read everything.
        feeder.finish().await?;
        control::send(
            session,
            &Control::Delivered {
                fed_unix_us: i64::try_from(now_ms()).unwrap_or(i64::MAX) * 1000,
                postcopy_blocktime_ms: None,
            },
        )
        .await
    };
    tokio::select! {
        r = feed => r,
        r = return_path => r,
    }
}

/// The session's counters into the status.
fn record_wire(status: &Shared, session: &Session) {
    let wire = session.stats();
    status.update(|s| {
        s.wire.bytes_out = wire.wire_bytes_out;
        s.wire.bytes_in = wire.wire_bytes_in;
        s.wire.connections_live = wire.connections_live;
        s.wire.replayed_frames = wire.replayed_frames;
        s.wire.unacked_bytes = wire.unacked_bytes;
    });
}

/// The source's status once a tunnelled stream ended: the destination has it all (libvirt
/// decides the rest), or the reason it does not. `is_final`: nobody here drives the migration,
/// so this is its verdict; otherwise the driver gives it when libvirt is done.
pub fn conclude(status: &Shared, session: &Session, result: &Result<()>, is_final: bool) {
    record_wire(status, session);
    status.update(|s| match result {
        // A migration this agent drives ends when libvirt says so.
        Ok(()) if !is_final => {
            s.phase = Phase::AwaitingCommit;
            s.detail = "the destination QEMU read the whole stream under matching digests; libvirt finishes there".into();
        }
        Err(e) if !is_final => s.event(EventKind::Failed, format!("the stream: {e:#}")),
        Ok(()) => {
            s.state = MigrationState::Committed;
            s.phase = Phase::Committed;
            s.detail = "the destination QEMU read the whole stream under matching digests; libvirt resumes it there".into();
            s.event(EventKind::Committed, "digests matched");
        }
        Err(e) => {
            s.state = MigrationState::Failed;
            s.phase = Phase::Failed;
            s.error = Some(format!("{e:#}"));
            s.event(EventKind::Failed, format!("{e:#}"));
        }
    });
}

/// Decoded bytes the gate holds before the destination stops reading the stream until a digest
/// releases some: the source checkpoints at least every [`MAX_UNCHECKED_BYTES`], so only a
/// peer that breaks that promise meets it (and then waits, holding no more).
pub const HELD_CAP: usize = 64 << 20;
/// Digests announced ahead of the bytes they cover, at most.
pub const EXPECTED_CAP: usize = 4096;

/// The destination's gate: decoded bytes are held until a digest from the source covers them.
#[derive(Debug, Default)]
pub struct Gate {
    /// Bytes released (verified) so far, and their running hash.
    released: u64,
    hash: StreamDigest,
    /// Decoded bytes after `released`.
    held: BytesMut,
    /// Digests announced by the source, in order: (stream length, digest, whether it is the
    /// end).
    expected: VecDeque<(u64, String, bool)>,
    /// Set once the end is verified.
    done: bool,
}

impl Gate {
    /// Takes decoded bytes.
    pub fn arrived(&mut self, bytes: &[u8]) -> Result<()> {
        ensure!(!self.done || bytes.is_empty(), "stream bytes after its end");
        self.held.extend_from_slice(bytes);
        if let Some((end, _, true)) = self.expected.back() {
            let have = self.released + self.held.len() as u64;
            ensure!(
                have <= *end,
                "received {have} stream bytes, the source announced {end}"
            );
        }
        Ok(())
    }

    /// Whether more stream bytes may be taken ([`HELD_CAP`]).
    pub fn has_room(&self) -> bool {
        self.held.len() < HELD_CAP
    }

    /// Takes a digest of the first `bytes` of the stream.
    pub fn expect(&mut self, bytes: u64, digest: String, end: bool) -> Result<()> {
        ensure!(
            self.expected.len() < EXPECTED_CAP,
            "the source announced more than {EXPECTED_CAP} digests ahead of the stream"
        );
        let last = self.expected.back().map_or(self.released, |e| e.0);
        ensure!(
            bytes >= last && !self.expected.back().is_some_and(|e| e.2),
            "digest for {bytes} stream bytes after one for {last}"
        );
        self.expected.push_back((bytes, digest, end));
        // An end that is already exceeded is an error now, not when more bytes come.
        self.arrived(&[])
    }

    /// Verifies every announced digest whose bytes have all arrived; returns the bytes they
    /// cover (QEMU may read them). A digest that does not match is an error.
    pub fn release(&mut self) -> Result<Bytes> {
        // Every length below counts from `released` as it was on entry.
        let mut upto = 0usize;
        while let Some((bytes, digest, end)) = self.expected.front() {
            let len = usize::try_from(bytes - self.released).expect("held in memory");
            if len > self.held.len() {
                break;
            }
            self.hash.update(&self.held[upto..len]);
            let ours = self.hash.hex();
            ensure!(
                &ours == digest,
                "stream digest mismatch at byte {bytes}: the source hashed {digest}, this end {ours}"
            );
            upto = len;
            self.done = *end;
            self.expected.pop_front();
        }
        self.released += upto as u64;
        Ok(self.held.split_to(upto).freeze())
    }

    /// Whether the end was verified and released.
    pub fn finished(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(bytes: &[u8]) -> String {
        StreamDigest::of(bytes)
    }

    #[test]
    fn nothing_is_released_before_a_digest_covers_it() {
        let stream: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let mut gate = Gate::default();
        gate.arrived(&stream[..6000]).unwrap();
        assert!(gate.release().unwrap().is_empty());
        gate.expect(4000, sha(&stream[..4000]), false).unwrap();
        gate.expect(5000, sha(&stream[..5000]), false).unwrap();
        assert_eq!(gate.release().unwrap(), &stream[..5000]);
        // A digest for bytes not yet arrived waits for them.
        gate.expect(10_000, sha(&stream), true).unwrap();
        assert!(gate.release().unwrap().is_empty());
        assert!(!gate.finished());
        gate.arrived(&stream[6000..]).unwrap();
        assert_eq!(gate.release().unwrap(), &stream[5000..]);
        assert!(gate.finished());
    }

    #[test]
    fn the_gate_holds_at_most_its_cap_and_a_bounded_number_of_digests() {
        let mut gate = Gate::default();
        let chunk = vec![1u8; 1 << 20];
        while gate.has_room() {
            gate.arrived(&chunk).unwrap();
        }
        assert_eq!(gate.held.len(), HELD_CAP);
        let mut gate = Gate::default();
        for i in 0..EXPECTED_CAP as u64 {
            gate.expect(i, String::new(), false).unwrap();
        }
        let err = format!(
            "{:#}",
            gate.expect(1 << 40, String::new(), false).unwrap_err()
        );
        assert!(err.contains("more than 4096 digests"), "{err}");
    }

    #[test]
    fn a_flipped_bit_stops_the_stream_before_the_bytes_it_covers() {
        let stream = vec![7u8; 3000];
        let mut corrupted = stream.clone();
        corrupted[2500] ^= 1;
        let mut gate = Gate::default();
        gate.arrived(&corrupted).unwrap();
        gate.expect(2000, sha(&stream[..2000]), false).unwrap();
        assert_eq!(gate.release().unwrap().len(), 2000);
        gate.expect(3000, sha(&stream), true).unwrap();
        let err = format!("{:#}", gate.release().unwrap_err());
        assert!(
            err.starts_with("stream digest mismatch at byte 3000: the source hashed "),
            "{err}"
        );
        assert!(!gate.finished());
    }

    #[test]
    fn bytes_past_the_announced_end_and_digests_out_of_order_are_refused() {
        let mut gate = Gate::default();
        gate.expect(10, sha(&[0; 10]), true).unwrap();
        assert_eq!(
            format!("{:#}", gate.arrived(&[0; 11]).unwrap_err()),
            "received 11 stream bytes, the source announced 10"
        );
        let mut gate = Gate::default();
        gate.expect(10, sha(&[0; 10]), false).unwrap();
        assert_eq!(
            format!("{:#}", gate.expect(5, sha(&[0; 5]), false).unwrap_err()),
            "digest for 5 stream bytes after one for 10"
        );
    }
}
