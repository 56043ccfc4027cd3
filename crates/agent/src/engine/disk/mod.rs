//! Disks over the WAN. The source agent is the NBD target of QEMU's `blockdev-mirror`
//! (write-blocking copy mode, so every guest write reaches the agent before the guest sees it
//! complete); writes gather in a bounded, coalescing [`buffer`] and travel as snapshots on the
//! disk channel ([`mirror`]); the destination agent applies each snapshot through an NBD client
//! to the destination QEMU's writable export and acknowledges it ([`apply`]).
//!
//! Disk channel frame: `seq: u64 LE | flags: u8 | batch` where the batch is the codec's
//! ([`ferry_codec::BatchCompressor`], one zstd context per channel) over disk records
//! ([`ferry_codec::disk`]). Flag 1: the
//! last frame of snapshot `seq`; flag 2: the last frame of all (the buffer closed; `seq` is the
//! number of snapshots sent). Acknowledgement frame: `applied: u64 LE | sha256: [u8; 32]`,
//! every snapshot below `applied`, and the digest of their operations.
//!
//! Both ends hash the operations (not the bytes on the wire, so that a codec fault shows
//! too): every acknowledgement carries the destination's digest through the snapshots it
//! applied, which the source checks against its own before it lets anything wait on them
//! proceed ([`SentDigests`]); the destination commits only when the final hashes match
//! ([`Control::DiskEnd`]).
//!
//! [`Control::DiskEnd`]: crate::engine::control::Control::DiskEnd

pub mod apply;
pub mod backing;
pub mod buffer;
pub mod image;
pub mod layers;
pub mod mirror;
pub mod pacing;
pub mod relay;
pub mod since;

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::engine::digest::StreamDigest;
use anyhow::{bail, Result};
use bytes::{BufMut, Bytes, BytesMut};
use ferry_api::agent::CodecSettings;
use ferry_codec::{AdaptiveCompressor, Compressed, DiskOp, Options};

const LAST_OF_SNAPSHOT: u8 = 1;
const LAST_OF_ALL: u8 = 2;
/// Records per frame before compression: large enough for zstd to find repeats, small enough
/// that several connections share a snapshot.
const FRAME_RECORDS: usize = 256 << 10;
/// The largest write one record carries: a frame closes after the record that reached
/// [`FRAME_RECORDS`], so with this it stays far below the wire's largest payload even when
/// nothing compresses (a guest's or the bulk copy's write may be up to 32 MiB).
const WRITE_PIECE: usize = 1 << 20;
/// What the page codec adds to a 4 KiB block at most: a raw page's tag and its key, a varint
/// of up to 10 bytes (the disk's number is in the key's top byte).
const MAX_BLOCK_OVERHEAD: usize = 1 + 10;
/// The most records a frame's batch holds (a receiver refuses more): records up to
/// [`FRAME_RECORDS`] less a byte, then one piece whose every block goes raw (incompressible,
/// never seen), and the write's own header.
pub const MAX_FRAME_RECORDS: usize =
    FRAME_RECORDS + WRITE_PIECE + (WRITE_PIECE / 4096) * MAX_BLOCK_OVERHEAD + 64;

/// `op`, with a write cut into pieces of at most [`WRITE_PIECE`] (both ends hash the pieces).
fn split_write(op: DiskOp) -> Vec<DiskOp> {
    match op {
        DiskOp::Write { disk, offset, data } if data.len() > WRITE_PIECE => data
            .chunks(WRITE_PIECE)
            .enumerate()
            .map(|(i, piece)| DiskOp::Write {
                disk,
                offset: offset + (i * WRITE_PIECE) as u64,
                data: piece.to_vec(),
            })
            .collect(),
        op => vec![op],
    }
}

/// The codec options for disk blocks: the memory stream's techniques, a 100 MB block cache
/// (CloudNet's) and a 64 MiB history of blocks sent, for deltas of rewritten blocks.
pub fn codec_options(settings: CodecSettings) -> Options {
    Options {
        zero: settings.zero,
        dedup: settings.dedup,
        delta: settings.delta,
        cache_bytes: 100 << 20,
        history_bytes: 64 << 20,
        ..Options::default()
    }
}

/// zstd for disk frames: the memory stream's level chooser (the level the link, the CPU and
/// what each level saves call for). Level 3 on every frame, kept while a guest disk that
/// stopped after a move was unexplained, took twice the agents' CPU and left the guest's reads
/// during the move at 73-77% of their rate before it, against 79%; the stop was the lab
/// guest losing an interrupt, moved or not (BENCHMARKS, "Disks").
pub fn disk_frame_zstd(settings: CodecSettings, link_rate_mbit: f64) -> AdaptiveCompressor {
    crate::engine::stream_codec::zstd_for_link(settings, link_rate_mbit)
}

#[derive(Debug, PartialEq, Eq)]
pub struct Frame {
    pub seq: u64,
    pub last_of_snapshot: bool,
    pub last_of_all: bool,
    pub batch: Bytes,
}

impl Frame {
    /// The frame of `records`, compressed at `level` with the channel's one zstd context.
    pub fn encode(seq: u64, flags: u8, records: &[u8], zstd: &mut AdaptiveCompressor) -> Bytes {
        Frame::encode_counted(seq, flags, records, zstd).0
    }

    /// [`Frame::encode`], and how its records were compressed.
    pub fn encode_counted(
        seq: u64,
        flags: u8,
        records: &[u8],
        zstd: &mut AdaptiveCompressor,
    ) -> (Bytes, Compressed) {
        let mut out = Vec::with_capacity(records.len() / 2 + 16);
        out.extend_from_slice(&seq.to_le_bytes());
        out.push(flags);
        let compressed = zstd.compress(records, &mut out);
        (Bytes::from(out), compressed)
    }

    pub fn decode(b: Bytes) -> Result<Frame> {
        if b.len() < 9 {
            bail!("disk frame of {} bytes (at least 9 expected)", b.len());
        }
        let seq = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let flags = b[8];
        if flags & !(LAST_OF_SNAPSHOT | LAST_OF_ALL) != 0 {
            bail!("disk frame with unknown flags {flags:#x}");
        }
        Ok(Frame {
            seq,
            last_of_snapshot: flags & LAST_OF_SNAPSHOT != 0,
            last_of_all: flags & LAST_OF_ALL != 0,
            batch: b.slice(9..),
        })
    }
}

/// The digest ([`crate::engine::digest`]) of the disk operations through some snapshot.
/// The key of a session's disk index (`codec::disk_base`): both ends know it, the guest does
/// not, so it cannot craft blocks that collide with the destination's.
pub fn index_key(session: &ferry_wire::Session) -> u64 {
    u64::try_from(session.id().0 & u128::from(u64::MAX)).expect("masked")
}

pub type Digest32 = [u8; 32];

pub fn ack_frame(applied: u64, digest: &Digest32) -> Bytes {
    let mut b = BytesMut::with_capacity(40);
    b.put_u64_le(applied);
    b.put_slice(digest);
    b.freeze()
}

pub fn parse_ack(b: &[u8]) -> Result<(u64, Digest32)> {
    if b.len() != 40 {
        bail!("disk acknowledgement of {} bytes (40 expected)", b.len());
    }
    let applied = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
    Ok((applied, b[8..].try_into().expect("32 bytes")))
}

/// The source's digest through each snapshot sent, kept until the destination acknowledges
/// that snapshot with its own.
#[derive(Default)]
pub struct SentDigests(Mutex<BTreeMap<u64, Digest32>>);

impl SentDigests {
    /// Snapshot `seq` was sent; the operations through it hash to `digest`.
    pub fn record(&self, seq: u64, digest: Digest32) {
        self.0.lock().expect("digests lock").insert(seq, digest);
    }

    /// The destination applied every snapshot below `applied`, and their operations hash to
    /// `digest` there.
    pub fn check(&self, applied: u64, digest: &Digest32) -> Result<()> {
        let Some(last) = applied.checked_sub(1) else {
            bail!("the destination acknowledged no snapshot");
        };
        let mut sent = self.0.lock().expect("digests lock");
        let Some(ours) = sent.get(&last).copied() else {
            bail!("the destination acknowledged snapshot {last}, which was not sent");
        };
        *sent = sent.split_off(&last);
        if &ours != digest {
            bail!("the disk writes applied at the destination differ from those sent (digests through snapshot {last})");
        }
        Ok(())
    }
}

/// The digest of what `h` has hashed so far.
pub fn digest_so_far(h: &StreamDigest) -> Digest32 {
    h.bytes()
}

/// Adds one operation to a digest both ends compute the same way.
pub fn hash_op(h: &mut StreamDigest, op: &DiskOp) {
    match op {
        DiskOp::Write { disk, offset, data } => {
            h.update(&[1, *disk]);
            h.update(&offset.to_le_bytes());
            h.update(&(data.len() as u64).to_le_bytes());
            h.update(data);
        }
        DiskOp::Zeroes {
            disk,
            offset,
            len,
            may_trim,
        } => {
            h.update(&[2, *disk, u8::from(*may_trim)]);
            h.update(&offset.to_le_bytes());
            h.update(&len.to_le_bytes());
        }
        DiskOp::Trim { disk, offset, len } => {
            h.update(&[3, *disk]);
            h.update(&offset.to_le_bytes());
            h.update(&len.to_le_bytes());
        }
        DiskOp::Flush { disk } => h.update(&[4, *disk]),
        DiskOp::Same { disk, offset, len } => {
            h.update(&[5, *disk]);
            h.update(&offset.to_le_bytes());
            h.update(&len.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_write_goes_in_pieces_that_keep_a_frame_under_the_wire_limit() {
        let data: Vec<u8> = (0..(5 * WRITE_PIECE + 7))
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect();
        let pieces = split_write(DiskOp::Write {
            disk: 1,
            offset: 4096,
            data: data.clone(),
        });
        assert_eq!(pieces.len(), 6);
        let mut joined = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let DiskOp::Write { disk, offset, data } = piece else {
                panic!("{piece:?}")
            };
            assert_eq!((*disk, *offset), (1, 4096 + (i * WRITE_PIECE) as u64));
            joined.extend_from_slice(data);
        }
        assert_eq!(joined, data);
        // Records up to FRAME_RECORDS and then one more piece, stored as they are: still
        // under the wire's limit.
        let mut records = Vec::new();
        let mut encoder = ferry_codec::DiskEncoder::new(codec_options(CodecSettings::NONE));
        while records.len() < FRAME_RECORDS {
            encoder.encode(&pieces[0], &mut records);
        }
        assert!(records.len() <= MAX_FRAME_RECORDS);
        let frame = Frame::encode(1, 0, &records, &mut AdaptiveCompressor::off());
        assert!(frame.len() < ferry_wire::frame::MAX_PAYLOAD_BYTES as usize);
        let zeroes = DiskOp::Zeroes {
            disk: 0,
            offset: 0,
            len: 1 << 40,
            may_trim: true,
        };
        assert_eq!(split_write(zeroes.clone()), vec![zeroes]);
    }

    /// The worst frame: records one byte short of [`FRAME_RECORDS`], then a whole piece of
    /// never-seen data at the largest key (disk 255, far into the disk), every block raw. A
    /// Debian guest's disk made such a frame 242 bytes over the old bound, and the
    /// destination refused it.
    #[test]
    fn a_frame_of_incompressible_never_seen_writes_stays_within_the_bound() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut noise = |len: usize| -> Vec<u8> {
            (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    (state >> 56) as u8
                })
                .collect()
        };
        let mut encoder = ferry_codec::DiskEncoder::new(codec_options(CodecSettings::ALL));
        let mut records = Vec::new();
        let mut offset = 1u64 << 39;
        while records.len() < FRAME_RECORDS - 5000 {
            let op = DiskOp::Write {
                disk: 255,
                offset,
                data: noise(4096),
            };
            encoder.encode(&op, &mut records);
            offset += 4096;
        }
        let filler = FRAME_RECORDS - 1 - records.len() - 40;
        encoder.encode(
            &DiskOp::Write {
                disk: 255,
                offset: offset + 7,
                data: noise(filler),
            },
            &mut records,
        );
        assert!(records.len() < FRAME_RECORDS, "{}", records.len());
        encoder.encode(
            &DiskOp::Write {
                disk: 255,
                offset: (1u64 << 40) - 2 * WRITE_PIECE as u64,
                data: noise(WRITE_PIECE),
            },
            &mut records,
        );
        assert!(
            records.len() > FRAME_RECORDS + WRITE_PIECE + 2048,
            "the blocks went raw: {}",
            records.len()
        );
        assert!(records.len() <= MAX_FRAME_RECORDS, "{}", records.len());
        let mut zstd = crate::engine::stream_codec::zstd_for_link(CodecSettings::ALL, 100.0);
        let frame = Frame::encode(1, 0, &records, &mut zstd);
        assert!(frame.len() < ferry_wire::frame::MAX_PAYLOAD_BYTES as usize);
        let mut zstd = ferry_codec::BatchDecompressor::new(MAX_FRAME_RECORDS);
        let parsed = Frame::decode(frame).unwrap();
        assert_eq!(zstd.decompress(&parsed.batch).unwrap().len(), records.len());
    }

    #[test]
    fn frames_round_trip_and_bad_ones_are_named() {
        let f = Frame::encode(
            7,
            LAST_OF_SNAPSHOT,
            b"records",
            &mut crate::engine::stream_codec::zstd_for_link(CodecSettings::ALL, 100.0),
        );
        let d = Frame::decode(f).unwrap();
        assert_eq!(d.seq, 7);
        assert!(d.last_of_snapshot && !d.last_of_all);
        assert_eq!(
            ferry_codec::decompress_batch(&d.batch).unwrap(),
            b"records".to_vec()
        );
        assert_eq!(
            Frame::decode(Bytes::from_static(b"short"))
                .unwrap_err()
                .to_string(),
            "disk frame of 5 bytes (at least 9 expected)"
        );
        let mut bad = vec![0u8; 8];
        bad.push(0x80);
        assert_eq!(
            Frame::decode(Bytes::from(bad)).unwrap_err().to_string(),
            "disk frame with unknown flags 0x80"
        );
        assert_eq!(parse_ack(&ack_frame(42, &[7; 32])).unwrap(), (42, [7; 32]));
        assert!(parse_ack(b"123").is_err());
    }

    #[test]
    fn acknowledgements_are_checked_against_what_was_sent() {
        let sent = SentDigests::default();
        sent.record(0, [1; 32]);
        sent.record(1, [2; 32]);
        sent.record(2, [3; 32]);
        sent.check(2, &[2; 32]).unwrap();
        // Snapshots before an acknowledged one are forgotten.
        assert!(sent.check(1, &[1; 32]).is_err());
        assert_eq!(
            sent.check(3, &[9; 32]).unwrap_err().to_string(),
            "the disk writes applied at the destination differ from those sent (digests through snapshot 2)"
        );
        assert_eq!(
            sent.check(5, &[0; 32]).unwrap_err().to_string(),
            "the destination acknowledged snapshot 4, which was not sent"
        );
    }
}
