//! The sharded codec on the calling thread: the dispatcher and every shard at the source,
//! every shard and the splicer at the destination.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use bytes::BytesMut;
use ferry_api::agent::{CodecReport, CodecSettings, SeedReport, ZstdLevelReport};
use ferry_codec::{SeedImage, SeedIndex};
use ferry_qemu::stream::Item;

use super::{next_unit, Dispatcher, Route, ShardDecoder, ShardEncoder, Splicer, Unit, ORDER_LANE};
use crate::engine::stream_codec::resend_estimate;

/// The source's half: items in, units out, a round closed where the caller flushes (every
/// shard's open batch, then the order unit).
#[derive(Debug)]
pub struct ShardedEncoder {
    dispatcher: Dispatcher,
    shards: Vec<ShardEncoder>,
    /// The shard the last item went to has a full batch.
    shard_full: bool,
}

impl ShardedEncoder {
    pub fn new(
        settings: CodecSettings,
        history_bytes: u64,
        link_rate_mbit: f64,
        shards: usize,
    ) -> ShardedEncoder {
        ShardedEncoder {
            dispatcher: Dispatcher::new(shards, settings.zstd),
            shards: (0..shards)
                .map(|s| ShardEncoder::new(settings, history_bytes, link_rate_mbit, s, shards))
                .collect(),
            shard_full: false,
        }
    }

    /// Pages the destination's seed image holds go as references to it from now on.
    pub fn set_seed(&mut self, index: SeedIndex, offer: SeedReport) {
        let index = Arc::new(index);
        for shard in &mut self.shards {
            shard.set_seed(index.clone(), offer.clone());
        }
    }

    /// Adds one parsed item. The caller closes the round ([`ShardedEncoder::flush`]) once
    /// [`ShardedEncoder::is_full`] says so, before the next item: that bounds what a round
    /// holds at both ends.
    pub fn push(&mut self, item: &Item, qemu: &[u8]) {
        debug_assert!(!self.is_full(), "a full round was not closed");
        let shard = match self.dispatcher.route(item, qemu) {
            Route::Serial => return,
            Route::Page {
                shard,
                key,
                header,
                page,
            } => {
                self.shards[shard].push_page(key, header, page);
                shard
            }
            Route::Opaque { shard, bytes } => {
                self.shards[shard].push_opaque(bytes);
                shard
            }
        };
        self.shard_full = self.shards[shard].is_full();
    }

    /// Whether the round should be closed now: the dispatcher's round is full, or a shard's
    /// batch is. The destination decodes a shard's batch only once its round's order unit is
    /// there, so a round ends where a batch would: in one shard, QEMU's bytes reach the
    /// destination as soon as with the single encoder.
    pub fn is_full(&self) -> bool {
        self.shard_full || self.dispatcher.round_is_full()
    }

    /// Pauses or resumes every shard's block cache from its next batch on.
    pub fn set_cache_paused(&mut self, paused: bool) {
        for shard in &mut self.shards {
            shard.set_cache_paused(paused);
        }
    }

    /// Closes the round: every shard's open batch, then the order unit.
    pub fn flush(&mut self, out: &mut BytesMut) {
        for shard in &mut self.shards {
            shard.flush(out);
        }
        self.dispatcher.close_round(out);
        self.shard_full = false;
    }

    /// QEMU's bytes in the open round.
    pub fn round_bytes(&self) -> usize {
        self.dispatcher.round_bytes()
    }

    /// Bytes of order units so far.
    pub fn order_bytes(&self) -> u64 {
        self.dispatcher.order_bytes()
    }

    /// What the codec did so far, over all shards; the order units count in `bytes_out`.
    pub fn report(&self) -> CodecReport {
        sum_reports(&self.dispatcher, self.shards.iter().map(ShardReport::of))
    }

    /// The dispatcher and the shards, to be given threads.
    pub(super) fn into_parts(self) -> (Dispatcher, Vec<ShardEncoder>) {
        debug_assert!(
            self.dispatcher.round_bytes() == 0,
            "split with a round open"
        );
        (self.dispatcher, self.shards)
    }
}

/// What one shard's encoder has done so far.
#[derive(Debug, Clone, Default)]
pub(super) struct ShardReport {
    pub report: CodecReport,
    /// What its pages resent with new content cost: (QEMU bytes, wire bytes), decayed sums.
    pub resend: (f64, f64),
}

impl ShardReport {
    pub fn of(shard: &ShardEncoder) -> ShardReport {
        ShardReport {
            report: shard.report(),
            resend: shard.resend_sums(),
        }
    }
}

/// The codec's report over every shard and the order units (counted in `bytes_out` and
/// `zstd_levels`).
pub(super) fn sum_reports(
    dispatcher: &Dispatcher,
    shards: impl IntoIterator<Item = ShardReport>,
) -> CodecReport {
    let mut sum = CodecReport::default();
    let (mut qemu, mut wire) = (0.0, 0.0);
    for shard in shards {
        qemu += shard.resend.0;
        wire += shard.resend.1;
        add_report(&mut sum, shard.report);
        sum.shards += 1;
    }
    sum.order_bytes = dispatcher.order_bytes();
    for level in dispatcher.zstd_levels() {
        add_level(&mut sum.zstd_levels, level.clone());
    }
    // The shards counted their own input; the serial part went to the order units.
    sum.bytes_in = dispatcher.bytes_in();
    sum.bytes_out += dispatcher.order_bytes();
    sum.resend_cost = resend_estimate(qemu, wire);
    sum
}

/// Adds one shard's counts into `sum`.
fn add_report(sum: &mut CodecReport, r: CodecReport) {
    // Every shard runs the same techniques with the same seed.
    if sum.settings.is_empty() {
        sum.settings = r.settings;
    }
    sum.seed = sum.seed.take().or(r.seed);
    sum.bytes_in += r.bytes_in;
    sum.bytes_out += r.bytes_out;
    sum.pages += r.pages;
    sum.raw += r.raw;
    sum.zero += r.zero;
    sum.unchanged += r.unchanged;
    sum.delta += r.delta;
    sum.blocks += r.blocks;
    sum.block_hits += r.block_hits;
    sum.cache_paused_batches += r.cache_paused_batches;
    sum.seeded += r.seeded;
    // A level some shard's latest batch was compressed at.
    sum.zstd_level = sum.zstd_level.or(r.zstd_level);
    for level in r.zstd_levels {
        add_level(&mut sum.zstd_levels, level);
    }
}

fn add_level(levels: &mut Vec<ZstdLevelReport>, level: ZstdLevelReport) {
    match levels.iter_mut().find(|l| l.level == level.level) {
        Some(l) => {
            l.batches += level.batches;
            l.bytes_in += level.bytes_in;
            l.bytes_out += level.bytes_out;
            l.seconds += level.seconds;
        }
        None => levels.push(level),
    }
}

/// The destination's half: units in (cut anywhere), QEMU's bytes out.
#[derive(Debug)]
pub struct ShardedDecoder {
    shards: Vec<ShardDecoder>,
    splicer: Splicer,
    input: BytesMut,
}

impl ShardedDecoder {
    pub fn new(settings: CodecSettings, history_bytes: u64, shards: usize) -> ShardedDecoder {
        ShardedDecoder {
            shards: (0..shards)
                .map(|s| ShardDecoder::new(settings, history_bytes, s, shards))
                .collect(),
            splicer: Splicer::new(shards),
            input: BytesMut::new(),
        }
    }

    /// The seed image whose index the source was given.
    pub fn set_seed(&mut self, image: SeedImage) {
        for shard in &mut self.shards {
            shard.set_seed(image.clone());
        }
    }

    /// Takes the next bytes of the channel and appends the QEMU bytes of every round they
    /// complete to `out`.
    pub fn feed(&mut self, bytes: &[u8], out: &mut BytesMut) -> Result<()> {
        self.input.extend_from_slice(bytes);
        while let Some(Unit {
            lane,
            cache_paused,
            body,
        }) = next_unit(&mut self.input)?
        {
            if lane == ORDER_LANE {
                self.splicer.splice(&body, out)?;
                continue;
            }
            let shard = usize::from(lane - 1);
            let Some(decoder) = self.shards.get_mut(shard) else {
                bail!(
                    "codec unit for lane {lane}, beyond the stream's {} shards",
                    self.shards.len()
                );
            };
            decoder
                .decode(&body, cache_paused, self.splicer.lane(shard))
                .with_context(|| format!("shard {shard}"))?;
            self.splicer.check_held()?;
        }
        Ok(())
    }

    /// The shards' decoders, to be given threads (before anything was fed).
    pub fn into_shards(self) -> Vec<ShardDecoder> {
        debug_assert!(self.is_idle(), "split with units fed");
        self.shards
    }

    /// Whether every byte fed so far was decoded and placed (nothing waits for the rest of a
    /// unit or for a round's order unit).
    pub fn is_idle(&self) -> bool {
        self.input.is_empty() && self.splicer.held() == 0
    }
}
