//! The stream channel's codec cut into shards that can run in parallel (issue 19;
//! docs/plans/parallel-pipeline.md). Pages are spread over S shards by
//! [`ferry_codec::shard::shard_of`], each coded by a [`ShardEncoder`] with its own page
//! history, block cache and zstd context; everything else of QEMU's stream, and the order in
//! which the shards' outputs make up QEMU's bytes, goes in order units from the
//! [`Dispatcher`]. At the destination each shard's units go to its [`ShardDecoder`] and the
//! [`Splicer`] rebuilds QEMU's stream byte for byte from the order units.
//!
//! On the channel (bytes, cut into frames anywhere):
//!
//! ```text
//! channel := unit*
//! unit    := le32 len, u8 lane, u8 flags, body    len counts lane, flags and body
//! lane 0  : an order unit; body = a ferry_codec batch of
//!           varint n, run * n, serial bytes       run := varint(bytes << 5 | lane)
//! lane s  : (1..=S) a batch of shard s-1, as crate::engine::stream_codec's records
//! flags   : bit 0 (shard lanes only): the batch was coded with the shard's block cache
//!           paused (ferry_codec::page); other bits are refused
//! ```
//!
//! A run says "the next `bytes` of QEMU's stream come from `lane`'s decoded output" (lane 0:
//! the next bytes of this order unit's serial part). Runs count QEMU's bytes, not records, so
//! the order does not depend on how a shard merges records or cuts its batches.
//!
//! The encoder works in **rounds**: every shard unit of round k goes out before order unit
//! k, and nothing of round k+1 before it. So no unit of a later round is needed to rebuild
//! an earlier one, and at the end of each order unit every shard's decoded output has been
//! placed (the decoder checks that it has).
//!
//! What goes where: whole RAM pages to their page's shard as page records; QEMU's own zero
//! pages and XBZRLE pages (they name a page too) to that page's shard as QEMU's bytes, so a
//! pass's runs stay long; the rest (headers, sections, markers, commands, device state) to
//! the order unit's serial part.
//!
//! At the source the shards run on the calling task ([`ShardedEncoder`]) or on threads of
//! their own ([`ThreadedEncoder`]); [`SourcePipeline`] is either. At the destination the
//! shards run on the calling task ([`ShardedDecoder`]) or on threads ([`ThreadedDecoder`]);
//! [`DestinationPipeline`] is either. The threads of all of an agent's migrations come from
//! one [`budget::ThreadBudget`].

pub mod budget;
mod decode_workers;
mod destination_side;
mod dispatcher;
pub mod governor;
mod shard;
mod sharded;
mod source_side;
mod splicer;
mod workers;

pub use decode_workers::ThreadedDecoder;
pub use destination_side::DestinationPipeline;
pub use dispatcher::{Dispatcher, Route};
pub use governor::{CachePauser, Governor};
pub use shard::{ShardDecoder, ShardEncoder};
pub use sharded::{ShardedDecoder, ShardedEncoder};
pub use source_side::SourcePipeline;
pub use splicer::Splicer;
pub use workers::ThreadedEncoder;

use bytes::{Buf, BufMut, BytesMut};
use ferry_api::agent::CodecSettings;
use ferry_codec::Options;

use crate::engine::stream_codec::{options, MAX_FRAMED};

/// The order units' lane.
pub const ORDER_LANE: u8 = 0;
/// A unit's bytes before its body: its length, its lane, its flags.
pub const UNIT_HEADER: usize = 6;
/// The largest unit length a decoder accepts (a batch and its header, lane and flags).
pub const MAX_UNIT: usize = MAX_FRAMED + 2;
/// Bits of a run's lane.
const LANE_BITS: u32 = 5;
/// A unit's flag: its batch was coded with the block cache paused.
const UNIT_CACHE_PAUSED: u8 = 1;

/// How the stream channel is coded: in how many shards, and on how many threads of their own
/// (0: on the pump's task).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub shards: usize,
    pub threads: usize,
}

/// Cores a host needs before the codec takes threads of its own. On 2 the guest's vCPU, both
/// QEMUs, both agents and the lab's WAN already keep them busy at 1 Gbit/s (BENCHMARKS.md, "A
/// fast link"): threads there only add hand-offs.
pub const MIN_CORES_FOR_THREADS: usize = 4;
/// QEMU's bytes per WAN byte in a zero-heavy first pass (`zero`: 148 MB of stream for 34 MB
/// on the WAN), and QEMU's bytes one shard codes per second with room left for TLS and the
/// guest (the one-core pipeline does 590 MiB/s): how many shards a link needs.
const QEMU_BYTES_PER_WAN_BYTE: f64 = 4.0;
const SHARD_BYTES_PER_S: f64 = 400e6;

impl Shape {
    /// The shape for a link of `link_rate_mbit` (none: unknown, one shard) on a host of
    /// `cores` (what `std::thread::available_parallelism` says: affinity and cgroups count);
    /// `test_shards` forces the shard count, with threads whenever there is more than one.
    pub fn choose(link_rate_mbit: Option<f64>, cores: usize, test_shards: Option<usize>) -> Shape {
        let threads_for = |shards: usize| if shards > 1 { shards.min(cores) } else { 0 };
        if let Some(shards) = test_shards {
            return Shape {
                shards,
                threads: threads_for(shards),
            };
        }
        let Some(link_rate_mbit) = link_rate_mbit.filter(|_| cores >= MIN_CORES_FOR_THREADS) else {
            return Shape {
                shards: 1,
                threads: 0,
            };
        };
        let qemu_bytes_per_s = link_rate_mbit.max(0.0) * 1e6 / 8.0 * QEMU_BYTES_PER_WAN_BYTE;
        // Clamped below; a float beyond usize saturates.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let needed = (qemu_bytes_per_s / SHARD_BYTES_PER_S).ceil() as usize;
        let shards = needed.clamp(1, cores.min(ferry_codec::shard::MAX_SHARDS));
        Shape {
            shards,
            threads: threads_for(shards),
        }
    }
}

/// The codec's options for one of `shards` shards: the stream's page history and block cache
/// shared out, so the total memory is the single encoder's.
pub fn shard_options(settings: CodecSettings, history_bytes: u64, shards: usize) -> Options {
    let whole = options(settings, history_bytes);
    Options {
        history_bytes: whole.history_bytes / shards,
        cache_bytes: whole.cache_bytes / shards,
        ..whole
    }
}

/// One unit as read: its lane, whether its batch was coded with the block cache paused, its
/// body.
struct Unit {
    lane: u8,
    cache_paused: bool,
    body: BytesMut,
}

/// Takes the next whole unit off `input` (none: not all of it is there).
fn next_unit(input: &mut BytesMut) -> anyhow::Result<Option<Unit>> {
    if input.len() < UNIT_HEADER {
        return Ok(None);
    }
    let len = u32::from_le_bytes(input[..4].try_into().expect("4 bytes")) as usize;
    anyhow::ensure!(
        (2..=MAX_UNIT).contains(&len),
        "codec unit of {len} bytes announced, outside 2..={MAX_UNIT}"
    );
    if input.len() < 4 + len {
        return Ok(None);
    }
    let (lane, flags) = (input[4], input[5]);
    let known = if lane == ORDER_LANE {
        0
    } else {
        UNIT_CACHE_PAUSED
    };
    anyhow::ensure!(
        flags & !known == 0,
        "codec unit for lane {lane} with unknown flags {flags:#04x}"
    );
    input.advance(UNIT_HEADER);
    Ok(Some(Unit {
        lane,
        cache_paused: flags & UNIT_CACHE_PAUSED != 0,
        body: input.split_to(len - 2),
    }))
}

/// Runs a codec thread's `work`; if it panics, `say` gets the panic's message. The other
/// workers keep the answer channel open, so without a word the pipeline would wait for the
/// panicked worker's answer forever.
fn saying_panics(work: impl FnOnce(), say: impl FnOnce(String)) {
    let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) else {
        return;
    };
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "no message".to_owned());
    say(format!("a codec thread panicked: {message}"));
}

/// Appends one unit to `out`.
fn put_unit(out: &mut BytesMut, lane: u8, flags: u8, body: &[u8]) {
    let len = u32::try_from(body.len() + 2).expect("units are far below 4 GiB");
    out.reserve(UNIT_HEADER + body.len());
    out.put_u32_le(len);
    out.put_u8(lane);
    out.put_u8(flags);
    out.extend_from_slice(body);
}

#[cfg(test)]
mod tests;
