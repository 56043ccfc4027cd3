//! In-order delivery for one channel.
//!
//! Frames of a channel can arrive out of order (they are spread over several TCP connections)
//! and twice (a reconnect replays everything not yet acknowledged). [`Reorder`] hands them to
//! the consumer exactly once, in sequence order, holding early arrivals in a bounded window.
//!
//! Invariant: `next` is the lowest sequence number not yet delivered; every held frame has a
//! sequence number in `next+1 .. next+window`.

use std::collections::BTreeMap;

use crate::frame::{Frame, Seq};

/// Why a frame could not be accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReorderError {
    /// The frame is too far ahead: the sender outran the window it was given (a protocol
    /// violation, or frames lost without a reconnect).
    #[error("wire: frame {seq} is beyond the reorder window (next expected {next}, window {window} frames)")]
    BeyondWindow { seq: u64, next: u64, window: u64 },
}

/// Reorders one channel's frames.
#[derive(Debug)]
pub struct Reorder {
    next: u64,
    window: u64,
    held: BTreeMap<u64, Frame>,
    duplicates: u64,
}

impl Reorder {
    /// A channel starting at sequence 0 that holds at most `window` early frames.
    pub fn new(window: u64) -> Reorder {
        Reorder {
            next: 0,
            window: window.max(1),
            held: BTreeMap::new(),
            duplicates: 0,
        }
    }

    /// The next sequence number to deliver: every frame below it was delivered (what an
    /// acknowledgement carries).
    pub fn next(&self) -> Seq {
        Seq(self.next)
    }

    /// Frames dropped because they had been seen before.
    pub fn duplicates(&self) -> u64 {
        self.duplicates
    }

    /// Frames waiting for an earlier one.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Whether a frame numbered `seq` would be taken rather than dropped as a duplicate.
    pub fn is_new(&self, seq: Seq) -> bool {
        seq.0 >= self.next && !self.held.contains_key(&seq.0)
    }

    /// Accepts a frame and appends to `out` every frame that is now deliverable, in order.
    pub fn push(&mut self, frame: Frame, out: &mut Vec<Frame>) -> Result<(), ReorderError> {
        let seq = frame.seq.0;
        if seq < self.next || self.held.contains_key(&seq) {
            self.duplicates += 1;
            return Ok(());
        }
        if seq - self.next >= self.window {
            return Err(ReorderError::BeyondWindow {
                seq,
                next: self.next,
                window: self.window,
            });
        }
        if seq == self.next {
            out.push(frame);
            self.next += 1;
            while let Some(f) = self.held.remove(&self.next) {
                out.push(f);
                self.next += 1;
            }
        } else {
            self.held.insert(seq, frame);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::ChannelId;
    use bytes::Bytes;
    use proptest::prelude::*;

    fn frame(seq: u64) -> Frame {
        Frame::data(
            ChannelId(0),
            Seq(seq),
            Bytes::from(seq.to_be_bytes().to_vec()),
        )
    }

    #[test]
    fn early_frames_wait_and_duplicates_vanish() {
        let mut r = Reorder::new(8);
        let mut out = Vec::new();
        r.push(frame(1), &mut out).unwrap();
        r.push(frame(2), &mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(r.held(), 2);
        r.push(frame(0), &mut out).unwrap();
        r.push(frame(1), &mut out).unwrap();
        let seqs: Vec<u64> = out.iter().map(|f| f.seq.0).collect();
        assert_eq!(seqs, [0, 1, 2]);
        assert_eq!(r.next(), Seq(3));
        assert_eq!(r.duplicates(), 1);
    }

    #[test]
    fn a_frame_beyond_the_window_is_refused_with_its_numbers() {
        let mut r = Reorder::new(4);
        let err = r.push(frame(4), &mut Vec::new()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "wire: frame 4 is beyond the reorder window (next expected 0, window 4 frames)"
        );
    }

    proptest! {
        /// A sender that keeps at most `window` frames beyond the receiver's acknowledged
        /// position, spreads them over 3 connections (each in order, delivered in any
        /// interleaving) and replays unacknowledged frames at random: every frame is delivered
        /// exactly once, in order, and the window is never exceeded.
        #[test]
        fn any_interleaving_with_replays_delivers_each_frame_once_in_order(
            n in 1u64..300,
            steps in proptest::collection::vec((0u8..3, 0usize..3, 0u64..8), 1..3000),
        ) {
            let window = 8u64;
            let mut conns: [std::collections::VecDeque<u64>; 3] = Default::default();
            let mut reorder = Reorder::new(window);
            let mut out = Vec::new();
            let mut sent = 0u64;
            let mut step = steps.into_iter().cycle().enumerate();
            while reorder.next().0 < n {
                let (i, (action, conn, back)) = step.next().expect("cycle never ends");
                // Every seventh step delivers (or sends), so every schedule makes progress:
                // replays are finite between deliveries and each connection is in order.
                let (action, conn) = if i % 7 == 6 { (2, (i / 7) % 3) } else { (action, conn) };
                let acked = reorder.next().0;
                match action {
                    0 if sent < n && sent - acked < window => {
                        conns[conn].push_back(sent);
                        sent += 1;
                    }
                    1 if sent > acked => conns[conn].push_back(acked + back % (sent - acked)),
                    _ => {
                        // deliver from this connection, or from any that has something
                        let c = (0..3).map(|i| (conn + i) % 3).find(|c| !conns[*c].is_empty());
                        match c {
                            Some(c) => {
                                let seq = conns[c].pop_front().expect("non-empty");
                                reorder.push(frame(seq), &mut out).unwrap();
                            }
                            None if sent < n && sent - acked < window => {
                                conns[conn].push_back(sent);
                                sent += 1;
                            }
                            None => {}
                        }
                    }
                }
            }
            let seqs: Vec<u64> = out.iter().map(|f| f.seq.0).collect();
            prop_assert_eq!(seqs, (0..n).collect::<Vec<_>>());
        }
    }
}
