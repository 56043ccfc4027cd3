//! One shard of the sharded codec, at each end: its pages coded against its own history,
//! block cache and zstd context, its batches framed as units of its lane.

use std::sync::Arc;

use anyhow::Result;
use bytes::BytesMut;
use ferry_api::agent::{CodecReport, CodecSettings, SeedReport};
use ferry_codec::{SeedImage, SeedIndex};

use super::{put_unit, shard_options, UNIT_CACHE_PAUSED, UNIT_HEADER};
use crate::engine::stream_codec::{BatchDecoder, BatchEncoder};

/// The source's half of one shard: the pages and records the dispatcher routed to it in,
/// units of its lane out.
#[derive(Debug)]
pub struct ShardEncoder {
    lane: u8,
    batches: BatchEncoder,
}

impl ShardEncoder {
    /// Shard `shard` of `shards`; `link_rate_mbit` is the whole link's (the shard's zstd keeps
    /// up with its share).
    pub fn new(
        settings: CodecSettings,
        history_bytes: u64,
        link_rate_mbit: f64,
        shard: usize,
        shards: usize,
    ) -> ShardEncoder {
        ShardEncoder {
            lane: u8::try_from(shard + 1).expect("at most 16 shards"),
            batches: BatchEncoder::new(
                settings,
                shard_options(settings, history_bytes, shards),
                link_rate_mbit / shards as f64,
            ),
        }
    }

    pub fn set_seed(&mut self, index: Arc<SeedIndex>, offer: SeedReport) {
        self.batches.set_seed(index, offer);
    }

    /// A whole page: QEMU's record header, then its 4 KiB.
    pub fn push_page(&mut self, key: u64, header: &[u8], page: &[u8]) {
        self.batches.took(header.len() + page.len());
        self.batches.push_page(key, Some(header), page);
    }

    /// QEMU's bytes of a record that stays as it is.
    pub fn push_opaque(&mut self, bytes: &[u8]) {
        self.batches.took(bytes.len());
        self.batches.push_opaque(bytes);
    }

    /// Whether the open batch should be closed now (mid-round too).
    pub fn is_full(&self) -> bool {
        self.batches.is_full()
    }

    /// Pauses or resumes the block cache from the next batch on (the unit says so).
    pub fn set_cache_paused(&mut self, paused: bool) {
        self.batches.set_cache_paused(paused);
    }

    /// Closes the open batch (if any) and appends it to `out` as a unit of this shard's lane.
    pub fn flush(&mut self, out: &mut BytesMut) {
        if let Some((batch, cache_paused)) = self.batches.close(UNIT_HEADER) {
            let flags = if cache_paused { UNIT_CACHE_PAUSED } else { 0 };
            put_unit(out, self.lane, flags, batch);
        }
    }

    pub fn report(&self) -> CodecReport {
        self.batches.report()
    }

    /// What pages resent with new content cost: (QEMU bytes, wire bytes), decayed sums.
    pub(super) fn resend_sums(&self) -> (f64, f64) {
        self.batches.resend_sums()
    }
}

/// The destination's half of one shard: units of its lane in, QEMU's bytes out.
#[derive(Debug)]
pub struct ShardDecoder {
    batches: BatchDecoder,
}

impl ShardDecoder {
    pub fn new(
        settings: CodecSettings,
        history_bytes: u64,
        shard: usize,
        shards: usize,
    ) -> ShardDecoder {
        ShardDecoder {
            batches: BatchDecoder::new(
                shard_options(settings, history_bytes, shards),
                Some((shard, shards)),
            ),
        }
    }

    pub fn set_seed(&mut self, image: SeedImage) {
        self.batches.set_seed(image);
    }

    /// Appends the QEMU bytes of one unit's `body` to `out`, coded with the block cache
    /// paused or not as its flags said; a page that is not this shard's is an error.
    pub fn decode(&mut self, body: &[u8], cache_paused: bool, out: &mut BytesMut) -> Result<()> {
        self.batches.set_cache_paused(cache_paused);
        self.batches.decode(body, out)
    }
}
