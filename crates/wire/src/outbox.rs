//! The sender's side of one channel: numbering, bounded buffering and replay.
//!
//! Every frame sent stays in the [`Outbox`] until the peer acknowledges it, so that after a
//! connection drops, everything the peer may not have is sent again ([`Outbox::unacked`]); the
//! receiver's [`crate::Reorder`] drops what it already had. The outbox is bounded in bytes:
//! when it is full the producer must wait, which is how a slow or broken WAN pushes back on
//! whoever feeds the channel (ultimately QEMU).
//!
//! Invariant: the frames held are exactly those with `acked <= seq < next`, in order.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::frame::{ChannelId, Frame, FrameKind, Seq};

/// The most unacknowledged payload any sender may hold per channel (the agents size theirs
/// from the link, at most this): a receiver holds what arrived but was not consumed up to
/// about this much per channel, and refuses a peer that sends more.
pub const MAX_SEND_WINDOW_BYTES: usize = 256 << 20;

/// The most unacknowledged frames a sender holds per channel, whatever their size: small
/// frames must not let the receiver's bookkeeping grow where the byte limit would not.
pub const MAX_UNACKED_FRAMES: usize = 1 << 16;

/// Why the outbox refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OutboxError {
    /// Holding this payload would exceed the byte limit; wait for acknowledgements.
    #[error(
        "wire: channel {channel} outbox full ({held_bytes} of {limit_bytes} bytes unacknowledged)"
    )]
    Full {
        channel: u16,
        held_bytes: usize,
        limit_bytes: usize,
    },
    /// The peer acknowledged frames that were never sent: it is confused or not our peer.
    #[error(
        "wire: channel {channel} peer acknowledged up to {acked} but only {sent} frames were sent"
    )]
    AckBeyondSent { channel: u16, acked: u64, sent: u64 },
}

/// One channel's unacknowledged frames.
#[derive(Debug)]
pub struct Outbox {
    channel: ChannelId,
    frames: VecDeque<Frame>,
    held_bytes: usize,
    limit_bytes: usize,
    next: u64,
    acked: u64,
}

impl Outbox {
    /// An empty outbox holding at most `limit_bytes` of payload (capped at
    /// [`MAX_SEND_WINDOW_BYTES`]) in at most [`MAX_UNACKED_FRAMES`] frames (at least one frame
    /// always fits when the outbox is empty, whatever its size).
    pub fn new(channel: ChannelId, limit_bytes: usize) -> Outbox {
        Outbox {
            channel,
            frames: VecDeque::new(),
            held_bytes: 0,
            limit_bytes: limit_bytes.min(MAX_SEND_WINDOW_BYTES),
            next: 0,
            acked: 0,
        }
    }

    /// Numbers `payload` as the channel's next data frame and keeps it until acknowledged.
    pub fn push(&mut self, payload: Bytes) -> Result<Frame, OutboxError> {
        self.push_frame(FrameKind::Data, payload)
    }

    /// Numbers a barrier: a point in the channel the receiver reaches only after everything
    /// before it. Barriers carry nothing and take no room.
    pub fn push_barrier(&mut self) -> Frame {
        self.push_frame(FrameKind::Barrier, Bytes::new())
            .expect("an empty frame always fits")
    }

    fn push_frame(&mut self, kind: FrameKind, payload: Bytes) -> Result<Frame, OutboxError> {
        if !payload.is_empty() && !self.has_room(payload.len()) {
            return Err(OutboxError::Full {
                channel: self.channel.0,
                held_bytes: self.held_bytes,
                limit_bytes: self.limit_bytes,
            });
        }
        let frame = Frame {
            kind,
            channel: self.channel,
            seq: Seq(self.next),
            payload,
        };
        self.next += 1;
        self.held_bytes += frame.payload.len();
        self.frames.push_back(frame.clone());
        Ok(frame)
    }

    /// The peer has every frame below `seq`: release them. Old or repeated acknowledgements
    /// are harmless; one beyond what was sent is an error.
    pub fn ack(&mut self, seq: Seq) -> Result<(), OutboxError> {
        if seq.0 > self.next {
            return Err(OutboxError::AckBeyondSent {
                channel: self.channel.0,
                acked: seq.0,
                sent: self.next,
            });
        }
        while self.acked < seq.0 {
            let f = self
                .frames
                .pop_front()
                .expect("held frames cover acked..next");
            self.held_bytes -= f.payload.len();
            self.acked += 1;
        }
        Ok(())
    }

    /// Every frame the peer may not have, oldest first: what to send again after a reconnect.
    pub fn unacked(&self) -> impl Iterator<Item = &Frame> {
        self.frames.iter()
    }

    /// Payload bytes awaiting acknowledgement.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// The next sequence number to be assigned.
    pub fn next(&self) -> Seq {
        Seq(self.next)
    }

    /// Every frame below this was acknowledged.
    pub fn acked(&self) -> Seq {
        Seq(self.acked)
    }

    /// Whether there is room for `len` more payload bytes (an empty outbox always takes one
    /// frame, so a frame larger than the limit cannot block forever).
    pub fn has_room(&self, len: usize) -> bool {
        self.frames.is_empty()
            || (self.held_bytes + len <= self.limit_bytes && self.frames.len() < MAX_UNACKED_FRAMES)
    }

    /// Changes the byte limit (the session sizes it from the measured rate and RTT), at most
    /// [`MAX_SEND_WINDOW_BYTES`].
    pub fn set_limit(&mut self, limit_bytes: usize) {
        self.limit_bytes = limit_bytes.min(MAX_SEND_WINDOW_BYTES);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Reorder;
    use proptest::prelude::*;

    #[test]
    fn a_full_outbox_pushes_back_until_acknowledged() {
        let mut o = Outbox::new(ChannelId(2), 10);
        o.push(Bytes::from_static(b"123456")).unwrap();
        let err = o.push(Bytes::from_static(b"123456")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "wire: channel 2 outbox full (6 of 10 bytes unacknowledged)"
        );
        o.ack(Seq(1)).unwrap();
        assert_eq!(o.held_bytes(), 0);
        o.push(Bytes::from_static(b"123456")).unwrap();
        assert_eq!(o.next(), Seq(2));
    }

    #[test]
    fn an_ack_beyond_what_was_sent_is_refused() {
        let mut o = Outbox::new(ChannelId(0), 100);
        o.push(Bytes::from_static(b"x")).unwrap();
        assert_eq!(
            o.ack(Seq(5)).unwrap_err().to_string(),
            "wire: channel 0 peer acknowledged up to 5 but only 1 frames were sent"
        );
        o.ack(Seq(1)).unwrap();
        o.ack(Seq(0)).unwrap(); // stale: harmless
        assert_eq!(o.unacked().count(), 0);
    }

    proptest! {
        /// Outbox and Reorder together across a link that drops whole connections: frames in
        /// flight on a dropped connection are lost, acknowledgements come late, and after each
        /// drop the sender replays everything unacknowledged. The receiver gets every payload
        /// exactly once, in order, and the sender's memory stays within its bound.
        #[test]
        fn replay_after_drops_delivers_every_payload_once_in_order(
            n in 1u64..200,
            steps in proptest::collection::vec(0u8..10, 1..2000),
        ) {
            let limit = 64usize;
            let mut outbox = Outbox::new(ChannelId(0), limit);
            let mut reorder = Reorder::new(1024);
            let mut in_flight: VecDeque<Frame> = VecDeque::new();
            let mut delivered = Vec::new();
            let mut produced = 0u64;
            let mut step = steps.into_iter().cycle().enumerate();
            while reorder.next().0 < n {
                let (i, action) = step.next().expect("cycle never ends");
                // Every seventh step a frame arrives, so every schedule makes progress.
                let forced = i % 7 == 6;
                let action = if forced { 9 } else { action };
                match action {
                    // produce, if the outbox has room
                    0..=3 if produced < n => {
                        if let Ok(f) = outbox.push(Bytes::from(produced.to_be_bytes().to_vec())) {
                            in_flight.push_back(f);
                            produced += 1;
                        }
                    }
                    // the connection drops: in-flight frames are lost; reconnect and replay
                    4 => {
                        in_flight.clear();
                        in_flight.extend(outbox.unacked().cloned());
                    }
                    // an acknowledgement arrives
                    5 => outbox.ack(reorder.next()).unwrap(),
                    // a frame arrives
                    _ => match in_flight.pop_front() {
                        Some(f) => {
                            reorder.push(f, &mut delivered).unwrap();
                            if forced {
                                // the receiver acknowledges: replays start past what it has
                                outbox.ack(reorder.next()).unwrap();
                            }
                        }
                        None => {
                            // nothing in flight: the sender's timer replays what is
                            // unacknowledged, or the producer, with nothing outstanding, goes on
                            outbox.ack(reorder.next()).unwrap();
                            in_flight.extend(outbox.unacked().cloned());
                            if in_flight.is_empty() && produced < n {
                                in_flight.push_back(outbox.push(Bytes::from(produced.to_be_bytes().to_vec())).unwrap());
                                produced += 1;
                            }
                        }
                    },
                }
                prop_assert!(outbox.held_bytes() <= limit);
            }
            let got: Vec<u64> = delivered
                .iter()
                .map(|f| u64::from_be_bytes(f.payload[..].try_into().unwrap()))
                .collect();
            prop_assert_eq!(got, (0..n).collect::<Vec<_>>());
        }
    }
}
