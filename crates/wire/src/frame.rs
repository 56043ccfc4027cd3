//! The frame: the unit the transport sends, acknowledges and replays.
//!
//! | offset | size | field   | meaning |
//! |-------:|-----:|---------|---------|
//! | 0      | 2    | magic   | `0xFE77`; anything else is not a ferry peer |
//! | 2      | 1    | version | [`WIRE_VERSION`]; a peer speaking another is refused |
//! | 3      | 1    | kind    | [`FrameKind`]; 0 is reserved, so zeroed memory never parses |
//! | 4      | 2    | channel | [`ChannelId`]: which logical stream (memory, disk, control) |
//! | 6      | 2    | flags   | reserved, must be 0 |
//! | 8      | 8    | seq     | [`Seq`]: position in the channel, from 0, no gaps |
//! | 16     | 4    | length  | payload bytes, at most [`MAX_PAYLOAD_BYTES`] |
//! | 20     | n    | payload | opaque |
//!
//! All integers are big-endian. For `Ack` frames `seq` is the acknowledged position (every
//! frame below it arrived) and the payload is empty.
//!
//! Versioning: the version byte changes when any field changes meaning; peers negotiate at
//! connect time and refuse a version they do not speak.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// First two bytes of every frame.
pub const MAGIC: u16 = 0xFE77;
/// The frame format this build speaks.
pub const WIRE_VERSION: u8 = 1;
/// Fixed header size.
pub const HEADER_BYTES: usize = 20;
/// The largest payload a peer may announce: 4 MiB holds a batch of 1,000 pages with room to
/// spare, and bounds what one bad length can make us buffer.
pub const MAX_PAYLOAD_BYTES: u32 = 4 << 20;

/// A logical stream within a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelId(pub u16);

/// A frame's position within its channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Seq(pub u64);

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Payload for the channel's consumer.
    Data = 1,
    /// Every frame of the channel below `seq` arrived.
    Ack = 2,
    /// Deliver nothing after this point of the channel before everything before it.
    Barrier = 3,
    /// First frame on every connection, both ways: the session it belongs to and what the
    /// sender has consumed per channel (JSON payload, see `session`).
    Hello = 4,
    /// The sender's last frame on this connection for the session: the connection leaves the
    /// session cleanly, and once both sides have sent one it may carry another session's Hello
    /// (a warm connection kept between migrations, see `net::Pool`). The dialer may send more
    /// before its next Hello; their payload is padding, ignored (see `net::dial`).
    Park = 5,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<FrameKind> {
        match v {
            1 => Some(FrameKind::Data),
            2 => Some(FrameKind::Ack),
            3 => Some(FrameKind::Barrier),
            4 => Some(FrameKind::Hello),
            5 => Some(FrameKind::Park),
            _ => None,
        }
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub channel: ChannelId,
    pub seq: Seq,
    pub payload: Bytes,
}

/// Why bytes from a peer are not a frame. Every variant names what was wrong and what was
/// expected.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    #[error("wire: bad magic {found:#06x} (expected {MAGIC:#06x}; is the peer a ferry agent?)")]
    BadMagic { found: u16 },
    #[error("wire: frame version {found} is not supported (this ferry speaks {WIRE_VERSION})")]
    Version { found: u8 },
    #[error("wire: unknown frame kind {found} (known: 1 data, 2 ack, 3 barrier, 4 hello, 5 park)")]
    Kind { found: u8 },
    #[error("wire: reserved flags {found:#06x} are set (expected 0)")]
    Flags { found: u16 },
    #[error("wire: frame length {found} exceeds limit {MAX_PAYLOAD_BYTES}")]
    TooLong { found: u32 },
    #[error("wire: {kind:?} frame carries {found} payload bytes (expected none)")]
    UnexpectedPayload { kind: FrameKind, found: u32 },
}

impl Frame {
    /// A data frame.
    pub fn data(channel: ChannelId, seq: Seq, payload: Bytes) -> Frame {
        Frame {
            kind: FrameKind::Data,
            channel,
            seq,
            payload,
        }
    }

    /// An acknowledgement of every frame of `channel` below `seq`.
    pub fn ack(channel: ChannelId, seq: Seq) -> Frame {
        Frame {
            kind: FrameKind::Ack,
            channel,
            seq,
            payload: Bytes::new(),
        }
    }

    /// A barrier at position `seq` of `channel`.
    pub fn barrier(channel: ChannelId, seq: Seq) -> Frame {
        Frame {
            kind: FrameKind::Barrier,
            channel,
            seq,
            payload: Bytes::new(),
        }
    }

    /// The last frame this side sends on a connection it parks.
    pub fn park() -> Frame {
        Frame::park_padded(0)
    }

    /// `Park` with `padding` bytes of payload (see `net::dial`).
    pub fn park_padded(padding: usize) -> Frame {
        Frame {
            kind: FrameKind::Park,
            channel: ChannelId(0),
            seq: Seq(0),
            payload: Bytes::from(vec![0u8; padding]),
        }
    }

    /// Bytes this frame takes on the wire.
    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + self.payload.len()
    }

    /// Appends the encoded frame to `out`.
    ///
    /// # Panics
    /// If the payload exceeds [`MAX_PAYLOAD_BYTES`]: building such a frame is our bug.
    pub fn encode(&self, out: &mut BytesMut) {
        let len = u32::try_from(self.payload.len())
            .ok()
            .filter(|l| *l <= MAX_PAYLOAD_BYTES)
            .expect("frame payloads are built below MAX_PAYLOAD_BYTES");
        out.reserve(self.encoded_len());
        out.put_u16(MAGIC);
        out.put_u8(WIRE_VERSION);
        out.put_u8(self.kind as u8);
        out.put_u16(self.channel.0);
        out.put_u16(0);
        out.put_u64(self.seq.0);
        out.put_u32(len);
        out.put_slice(&self.payload);
    }

    /// Takes one whole frame off the front of `buf`. `Ok(None)` means more bytes are needed
    /// (nothing is consumed); an error means the peer sent something that is not a frame, and
    /// the connection must be dropped.
    pub fn decode(buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        if buf.len() < HEADER_BYTES {
            return Ok(None);
        }
        let mut h = &buf[..HEADER_BYTES];
        let magic = h.get_u16();
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        let version = h.get_u8();
        if version != WIRE_VERSION {
            return Err(FrameError::Version { found: version });
        }
        let raw_kind = h.get_u8();
        let kind = FrameKind::from_u8(raw_kind).ok_or(FrameError::Kind { found: raw_kind })?;
        let channel = ChannelId(h.get_u16());
        let flags = h.get_u16();
        if flags != 0 {
            return Err(FrameError::Flags { found: flags });
        }
        let seq = Seq(h.get_u64());
        let len = h.get_u32();
        // Cap before anything is buffered or allocated for it.
        if len > MAX_PAYLOAD_BYTES {
            return Err(FrameError::TooLong { found: len });
        }
        if matches!(kind, FrameKind::Ack | FrameKind::Barrier) && len != 0 {
            return Err(FrameError::UnexpectedPayload { kind, found: len });
        }
        let total = HEADER_BYTES + usize::try_from(len).expect("u32 fits in usize");
        if buf.len() < total {
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        buf.advance(HEADER_BYTES);
        let payload = buf.split_to(total - HEADER_BYTES).freeze();
        Ok(Some(Frame {
            kind,
            channel,
            seq,
            payload,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encoded(f: &Frame) -> BytesMut {
        let mut b = BytesMut::new();
        f.encode(&mut b);
        b
    }

    #[test]
    fn a_frame_round_trips_and_partial_input_waits() {
        let f = Frame::data(ChannelId(3), Seq(42), Bytes::from_static(b"page bytes"));
        let whole = encoded(&f);
        for cut in 0..whole.len() {
            let mut part = BytesMut::from(&whole[..cut]);
            assert_eq!(Frame::decode(&mut part), Ok(None), "cut at {cut}");
            assert_eq!(part.len(), cut, "a partial frame is not consumed");
        }
        let mut buf = whole.clone();
        buf.extend_from_slice(&encoded(&Frame::ack(ChannelId(3), Seq(43))));
        assert_eq!(Frame::decode(&mut buf).unwrap(), Some(f));
        buf.extend_from_slice(&encoded(&Frame::park()));
        assert_eq!(
            Frame::decode(&mut buf).unwrap(),
            Some(Frame::ack(ChannelId(3), Seq(43)))
        );
        assert_eq!(Frame::decode(&mut buf).unwrap(), Some(Frame::park()));
        assert!(buf.is_empty());
    }

    #[test]
    fn zeroed_bytes_are_not_a_frame() {
        let mut buf = BytesMut::from(&[0u8; 64][..]);
        assert_eq!(
            Frame::decode(&mut buf).unwrap_err().to_string(),
            "wire: bad magic 0x0000 (expected 0xfe77; is the peer a ferry agent?)"
        );
    }

    #[test]
    fn each_bad_header_field_is_named() {
        let base = encoded(&Frame::barrier(ChannelId(1), Seq(7)));
        let bad = |at: usize, bytes: &[u8]| {
            let mut b = base.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            Frame::decode(&mut b).unwrap_err()
        };
        assert_eq!(bad(2, &[9]), FrameError::Version { found: 9 });
        assert_eq!(bad(3, &[0]), FrameError::Kind { found: 0 });
        assert_eq!(bad(6, &[0, 1]), FrameError::Flags { found: 1 });
        assert_eq!(
            bad(16, &[0, 0, 0, 5]),
            FrameError::UnexpectedPayload {
                kind: FrameKind::Barrier,
                found: 5
            }
        );
        assert_eq!(
            bad(16, &[0xff, 0xff, 0xff, 0xff]).to_string(),
            "wire: frame length 4294967295 exceeds limit 4194304"
        );
    }

    proptest! {
        #[test]
        fn any_frame_sequence_round_trips(
            frames in proptest::collection::vec(
                (0u16..4, any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300)), 0..20)
        ) {
            let frames: Vec<Frame> = frames
                .into_iter()
                .map(|(c, s, p)| Frame::data(ChannelId(c), Seq(s), Bytes::from(p)))
                .collect();
            let mut buf = BytesMut::new();
            for f in &frames {
                f.encode(&mut buf);
            }
            let mut back = Vec::new();
            while let Some(f) = Frame::decode(&mut buf).unwrap() {
                back.push(f);
            }
            prop_assert_eq!(back, frames);
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(_)) = Frame::decode(&mut buf) {}
        }
    }
}
