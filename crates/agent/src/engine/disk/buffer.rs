//! The source's disk transmit buffer (XvMotion's transmit snapshots): every write the mirror
//! target receives joins the *active snapshot*, where a later write to the same bytes replaces
//! the earlier one (coalescing), so a snapshot's pieces never overlap and may be applied in any
//! order. The sender takes the active snapshot whenever it is ready for more (a new one starts
//! empty); snapshots are applied at the destination in the order they were taken.
//!
//! The buffer is bounded: a write waits until it fits, which is how a slow WAN slows the guest
//! (its writes complete when they are buffered). The mirror's bulk copy gets at most three
//! quarters of the room, so the guest's own writes are not starved by it. Snapshots are
//! numbered; the destination acknowledges each once applied, which is what synchronous
//! mirroring waits for.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use ferry_codec::DiskOp;
use tokio::sync::{watch, Notify};

/// The applied count once acknowledgements stopped.
const STOPPED: u64 = u64::MAX;

/// What a piece of a snapshot does to its range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Extent {
    Data(Bytes),
    Zeroes { may_trim: bool },
    Trim,
}

/// The bytes a zero or trim range holds in the buffer (its bookkeeping, not its length).
const RANGE_COST: u64 = 32;
/// Writes at least this long are taken for the mirror's bulk copy (QEMU's bulk ops run up to
/// 1 MiB over runs of dirty chunks; the guest's own writes are usually smaller).
pub const BULK_WRITE: u64 = 64 * 1024;

#[derive(Debug, Clone)]
struct Piece {
    end: u64,
    what: Extent,
}

impl Piece {
    fn cost(&self, start: u64) -> u64 {
        match &self.what {
            Extent::Data(_) => self.end - start,
            _ => RANGE_COST,
        }
    }

    /// The part `[from, to)` of this piece, which starts at `start`.
    fn part(&self, start: u64, from: u64, to: u64) -> Piece {
        let what = match &self.what {
            Extent::Data(d) => {
                let (a, b) = (from - start, to - start);
                // A copy, so that the buffer's accounting is the memory it holds.
                Extent::Data(Bytes::copy_from_slice(
                    &d[usize::try_from(a).expect("in piece")
                        ..usize::try_from(b).expect("in piece")],
                ))
            }
            other => other.clone(),
        };
        Piece { end: to, what }
    }
}

/// A set of non-overlapping pieces and the disks to flush after them.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub seq: u64,
    pieces: BTreeMap<(u8, u64), Piece>,
    flushes: BTreeSet<u8>,
    bytes: u64,
}

impl Snapshot {
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty() && self.flushes.is_empty()
    }

    /// The bytes it holds in the buffer.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keys of the pieces that overlap `[start, end)` on `disk`.
    fn overlapping(&self, disk: u8, start: u64, end: u64) -> Vec<(u8, u64)> {
        let mut keys = Vec::new();
        if let Some((&k, p)) = self.pieces.range(..(disk, start)).next_back() {
            if k.0 == disk && p.end > start {
                keys.push(k);
            }
        }
        keys.extend(
            self.pieces
                .range((disk, start)..(disk, end))
                .map(|(&k, _)| k),
        );
        keys
    }

    /// How much the buffer grows if `[start, end)` becomes `what` (negative when the new
    /// piece replaces more than it adds).
    fn growth(&self, disk: u8, start: u64, end: u64, what: &Extent) -> i64 {
        let new = Piece {
            end,
            what: what.clone(),
        };
        let mut g = i64::try_from(new.cost(start)).expect("small");
        for k in self.overlapping(disk, start, end) {
            let p = &self.pieces[&k];
            g -= i64::try_from(p.cost(k.1)).expect("small");
            if k.1 < start {
                g += i64::try_from(cost_of(&p.what, k.1, start)).expect("small");
            }
            if p.end > end {
                g += i64::try_from(cost_of(&p.what, end, p.end)).expect("small");
            }
        }
        g
    }

    /// Makes `[start, end)` of `disk` hold `what`, cutting what was there before.
    pub fn insert(&mut self, disk: u8, start: u64, end: u64, what: Extent) {
        for k in self.overlapping(disk, start, end) {
            let p = self.pieces.remove(&k).expect("listed");
            self.bytes -= p.cost(k.1);
            if k.1 < start {
                let left = p.part(k.1, k.1, start);
                self.bytes += left.cost(k.1);
                self.pieces.insert(k, left);
            }
            if p.end > end {
                let right = p.part(k.1, end, p.end);
                self.bytes += right.cost(end);
                self.pieces.insert((disk, end), right);
            }
        }
        let new = Piece { end, what };
        self.bytes += new.cost(start);
        self.pieces.insert((disk, start), new);
    }

    pub fn flush(&mut self, disk: u8) {
        self.flushes.insert(disk);
    }

    /// The operations to apply: every piece (in any order), then the flushes.
    pub fn into_ops(self) -> impl Iterator<Item = DiskOp> {
        let pieces = self
            .pieces
            .into_iter()
            .map(|((disk, offset), p)| match p.what {
                Extent::Data(d) => DiskOp::Write {
                    disk,
                    offset,
                    data: d.to_vec(),
                },
                Extent::Zeroes { may_trim } => DiskOp::Zeroes {
                    disk,
                    offset,
                    len: p.end - offset,
                    may_trim,
                },
                Extent::Trim => DiskOp::Trim {
                    disk,
                    offset,
                    len: p.end - offset,
                },
            });
        pieces.chain(self.flushes.into_iter().map(|disk| DiskOp::Flush { disk }))
    }
}

fn cost_of(what: &Extent, from: u64, to: u64) -> u64 {
    match what {
        Extent::Data(_) => to - from,
        _ => RANGE_COST,
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the disk transmit buffer is closed (the migration is ending)")]
pub struct Closed;

/// Counters for the status and the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BufferStats {
    /// Bytes written into the buffer (data, as the guest and the mirror wrote them).
    pub written: u64,
    /// Bytes replaced by a later write before they were sent.
    pub coalesced: u64,
    /// Bytes held now.
    pub held: u64,
    /// Snapshots taken.
    pub snapshots: u64,
}

struct State {
    active: Snapshot,
    /// Bytes of snapshots taken but not yet sent.
    in_transit: u64,
    /// Bytes sent since the buffer was made.
    sent_total: u64,
    limit: u64,
    closed: bool,
    /// Closed because the migration failed: what it refuses goes nowhere anyway.
    abandoned: bool,
    stats: BufferStats,
}

impl State {
    fn held(&self) -> u64 {
        self.active.bytes + self.in_transit
    }
}

pub struct TransmitBuffer {
    state: Mutex<State>,
    changed: Notify,
    /// Snapshots applied at the destination: all with seq below this.
    applied: watch::Sender<u64>,
    /// Synchronous mirroring: writes complete once applied at the destination.
    synchronous: AtomicBool,
}

impl TransmitBuffer {
    pub fn new(limit: u64, synchronous: bool) -> TransmitBuffer {
        TransmitBuffer {
            state: Mutex::new(State {
                active: Snapshot::default(),
                in_transit: 0,
                sent_total: 0,
                limit,
                closed: false,
                abandoned: false,
                stats: BufferStats::default(),
            }),
            changed: Notify::new(),
            applied: watch::channel(0).0,
            synchronous: AtomicBool::new(synchronous),
        }
    }

    pub fn is_synchronous(&self) -> bool {
        self.synchronous.load(Ordering::Relaxed)
    }

    /// Switches between asynchronous and synchronous mirroring (writes already acknowledged
    /// stay so; the next ones follow the new mode).
    pub fn set_synchronous(&self, on: bool) {
        self.synchronous.store(on, Ordering::Relaxed);
    }

    /// A new bound on the bytes held; writes wait until they fit under it.
    pub fn set_limit(&self, limit: u64) {
        self.lock().limit = limit;
        self.changed.notify_waiters();
    }

    pub fn stats(&self) -> BufferStats {
        let s = self.lock();
        BufferStats {
            held: s.held(),
            ..s.stats
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("transmit buffer poisoned")
    }

    /// Puts `what` over `[offset, offset + len)` of `disk` once it fits; returns the number of
    /// the snapshot it joined.
    pub async fn put(&self, disk: u8, offset: u64, len: u64, what: Extent) -> Result<u64, Closed> {
        let bulk = matches!(what, Extent::Data(_)) && len >= BULK_WRITE;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = self.lock();
                if s.closed {
                    return Err(Closed);
                }
                let growth = s.active.growth(disk, offset, offset + len, &what);
                let room = if bulk { s.limit / 4 * 3 } else { s.limit };
                let held = s.held();
                // An empty buffer takes anything, so that one write larger than the bound
                // still gets through.
                if held == 0 || i128::from(held) + i128::from(growth) <= i128::from(room) {
                    if let Extent::Data(_) = what {
                        s.stats.written += len;
                    }
                    let before = s.active.bytes;
                    let new_cost = cost_of(&what, offset, offset + len);
                    s.active.insert(disk, offset, offset + len, what);
                    s.stats.coalesced += (before + new_cost).saturating_sub(s.active.bytes);
                    let seq = s.active.seq;
                    drop(s);
                    self.changed.notify_waiters();
                    return Ok(seq);
                }
            }
            notified.await;
        }
    }

    /// Asks for `disk` to be flushed after the active snapshot; returns its number.
    pub fn flush(&self, disk: u8) -> Result<u64, Closed> {
        let mut s = self.lock();
        if s.closed {
            return Err(Closed);
        }
        s.active.flush(disk);
        let seq = s.active.seq;
        drop(s);
        self.changed.notify_waiters();
        Ok(seq)
    }

    /// The active snapshot, once it holds something; None once closed and empty.
    pub async fn take(&self) -> Option<Snapshot> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = self.lock();
                if !s.active.is_empty() {
                    let next = Snapshot {
                        seq: s.active.seq + 1,
                        ..Snapshot::default()
                    };
                    let snap = std::mem::replace(&mut s.active, next);
                    s.in_transit += snap.bytes;
                    s.stats.snapshots += 1;
                    return Some(snap);
                }
                if s.closed {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// `bytes` of a taken snapshot have been handed to the WAN (all of it or a part).
    pub fn sent(&self, bytes: u64) {
        let mut s = self.lock();
        s.in_transit -= bytes;
        s.sent_total += bytes;
        drop(s);
        self.changed.notify_waiters();
    }

    /// Bytes sent since the buffer was made.
    pub fn sent_total(&self) -> u64 {
        self.lock().sent_total
    }

    /// Waits until the buffer holds at most `bytes`, or until as much as it held when asked
    /// has been sent (a guest that writes as fast as the link drains would keep it above
    /// forever), or until it closes.
    pub async fn drain_to(&self, bytes: u64) {
        let until_sent = {
            let s = self.lock();
            s.sent_total + s.held()
        };
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let s = self.lock();
                if s.held() <= bytes || s.sent_total >= until_sent || s.closed {
                    return;
                }
            }
            notified.await;
        }
    }

    /// No more writes: the sender ends once the rest is taken.
    pub fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_waiters();
    }

    /// No more writes, because the migration failed: see [`TransmitBuffer::is_abandoned`].
    pub fn abandon(&self) {
        let mut s = self.lock();
        s.closed = true;
        s.abandoned = true;
        drop(s);
        self.changed.notify_waiters();
    }

    /// Whether the buffer closed because the migration failed (not at its switchover).
    pub fn is_abandoned(&self) -> bool {
        self.lock().abandoned
    }

    /// The destination applied every snapshot numbered below `seq`.
    pub fn applied(&self, seq: u64) {
        self.applied.send_if_modified(|v| {
            let newer = seq > *v;
            if newer {
                *v = seq;
            }
            newer
        });
    }

    /// Waits until snapshot `seq` has been applied at the destination. None if the buffer's
    /// acknowledgements stopped first (the migration ended without it).
    pub async fn wait_applied(&self, seq: u64) -> Option<()> {
        let mut rx = self.applied.subscribe();
        let applied = *rx.wait_for(|v| *v > seq).await.ok()?;
        (applied != STOPPED).then_some(())
    }

    /// Ends every wait in [`TransmitBuffer::wait_applied`], now and later, with None (their
    /// writes did not reach the destination; the migration is over).
    pub fn stop_acknowledging(&self) {
        self.applied.send_modify(|v| *v = STOPPED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, b: u8) -> Extent {
        Extent::Data(Bytes::from(vec![b; len]))
    }

    /// Applies ops to a model disk.
    fn apply(disk: &mut [u8], ops: impl Iterator<Item = DiskOp>) {
        for op in ops {
            match op {
                DiskOp::Write { offset, data, .. } => {
                    let o = usize::try_from(offset).unwrap();
                    disk[o..o + data.len()].copy_from_slice(&data);
                }
                DiskOp::Zeroes { offset, len, .. } => {
                    let o = usize::try_from(offset).unwrap();
                    disk[o..o + usize::try_from(len).unwrap()].fill(0);
                }
                _ => {}
            }
        }
    }

    #[test]
    fn a_later_write_replaces_the_overlapped_part_of_earlier_ones() {
        let mut s = Snapshot::default();
        s.insert(0, 0, 8192, data(8192, 1));
        s.insert(0, 4096, 6144, data(2048, 2));
        s.insert(0, 1024, 2048, Extent::Zeroes { may_trim: false });
        let mut disk = vec![9u8; 16384];
        let bytes = s.bytes();
        apply(&mut disk, s.into_ops());
        assert!(disk[..1024].iter().all(|&b| b == 1));
        assert!(disk[1024..2048].iter().all(|&b| b == 0));
        assert!(disk[2048..4096].iter().all(|&b| b == 1));
        assert!(disk[4096..6144].iter().all(|&b| b == 2));
        assert!(disk[6144..8192].iter().all(|&b| b == 1));
        assert_eq!(bytes, 8192 - 1024 + RANGE_COST);
    }

    #[test]
    fn pieces_of_one_snapshot_never_overlap_and_growth_is_exact() {
        // Pseudo-random writes over a small disk: the snapshot applied in any order equals
        // the writes applied in order.
        let mut x = 12345u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut s = Snapshot::default();
        let mut model = vec![0u8; 131072];
        for i in 0..500u64 {
            let start = next(120) * 512;
            let len = (1 + next(16)) * 512;
            let b = u8::try_from(i % 250).unwrap() + 1;
            let what = if next(5) == 0 {
                Extent::Zeroes { may_trim: true }
            } else {
                data(usize::try_from(len).unwrap(), b)
            };
            let g = s.growth(0, start, start + len, &what);
            let before = s.bytes();
            apply(
                &mut model,
                std::iter::once(match &what {
                    Extent::Data(d) => DiskOp::Write {
                        disk: 0,
                        offset: start,
                        data: d.to_vec(),
                    },
                    _ => DiskOp::Zeroes {
                        disk: 0,
                        offset: start,
                        len,
                        may_trim: true,
                    },
                }),
            );
            s.insert(0, start, start + len, what);
            assert_eq!(i128::from(before) + i128::from(g), i128::from(s.bytes()));
        }
        let mut ends = Vec::new();
        for (&(_, start), p) in &s.pieces {
            ends.push((start, p.end));
        }
        for w in ends.windows(2) {
            assert!(w[0].1 <= w[1].0, "pieces overlap: {w:?}");
        }
        let mut disk = vec![0u8; 131072];
        let mut ops: Vec<DiskOp> = s.into_ops().collect();
        ops.reverse();
        apply(&mut disk, ops.into_iter());
        assert!(disk == model);
    }

    #[tokio::test]
    async fn a_full_buffer_makes_writes_wait_until_the_sender_takes_and_sends() {
        let buf = std::sync::Arc::new(TransmitBuffer::new(8192, false));
        buf.put(0, 0, 8192, data(8192, 1)).await.unwrap();
        // A write elsewhere does not fit...
        let b2 = buf.clone();
        let waiter = tokio::spawn(async move { b2.put(0, 65536, 4096, data(4096, 2)).await });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        // ...a rewrite of held bytes does (it adds nothing)...
        buf.put(0, 0, 4096, data(4096, 3)).await.unwrap();
        assert_eq!(buf.stats().coalesced, 4096);
        // ...and once the snapshot is sent, the waiter gets in, into the next snapshot.
        let snap = buf.take().await.unwrap();
        assert_eq!(snap.seq, 0);
        buf.sent(snap.bytes());
        assert_eq!(waiter.await.unwrap().unwrap(), 1);
        buf.close();
        assert_eq!(buf.take().await.unwrap().seq, 1);
        assert!(buf.take().await.is_none());
        assert!(buf.put(0, 0, 512, data(512, 4)).await.is_err());
    }

    #[tokio::test]
    async fn bulk_writes_leave_a_quarter_of_the_room_to_the_guest() {
        let buf = TransmitBuffer::new(256 * 1024, false);
        for i in 0..3 {
            buf.put(0, i * BULK_WRITE, BULK_WRITE, data(65536, 1))
                .await
                .unwrap();
        }
        let bulk = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            buf.put(0, 10 * BULK_WRITE, BULK_WRITE, data(65536, 1)),
        )
        .await;
        assert!(bulk.is_err(), "a fourth bulk write must wait");
        buf.put(0, 1 << 30, 4096, data(4096, 2)).await.unwrap();
    }

    /// The memory phase waits for the buffer to drain to its bound, but not forever: once as
    /// much as it held has been sent, however much the guest wrote meanwhile.
    #[tokio::test]
    async fn a_drain_ends_at_the_bound_or_once_what_was_held_went() {
        let buf = TransmitBuffer::new(1 << 20, false);
        buf.put(0, 0, 65536, data(65536, 1)).await.unwrap();
        buf.drain_to(65536).await; // already there
        let snap = buf.take().await.unwrap();
        let drain = buf.drain_to(4096);
        tokio::pin!(drain);
        assert!(pending(drain.as_mut()).await);
        buf.sent(32768);
        assert!(pending(drain.as_mut()).await, "half of it went");
        // The guest writes as much again: the buffer holds more than the bound...
        buf.put(0, 1 << 20, 65536, data(65536, 2)).await.unwrap();
        buf.sent(snap.bytes() - 32768);
        // ...but what it held when asked has gone.
        assert!(!pending(drain.as_mut()).await);
        assert!(buf.stats().held > 4096);
    }

    /// Whether `f` is still waiting after it was polled (and its wake-ups ran).
    async fn pending(f: std::pin::Pin<&mut impl std::future::Future>) -> bool {
        tokio::select! {
            biased;
            _ = f => false,
            () = tokio::task::yield_now() => true,
        }
    }
}
