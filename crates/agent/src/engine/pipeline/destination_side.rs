//! What the destination's stream loop drives: the sharded decoder on the loop's own task, or
//! with its shards on threads.

use anyhow::Result;
use bytes::BytesMut;

use super::{ShardedDecoder, ThreadedDecoder, MIN_CORES_FOR_THREADS};

#[derive(Debug)]
pub enum DestinationPipeline {
    Inline(ShardedDecoder),
    Threaded(ThreadedDecoder),
}

impl DestinationPipeline {
    /// Threads for the shards of a stream the source cut into `shards` on a host of `cores`:
    /// none for one shard or on a host of fewer than [`MIN_CORES_FOR_THREADS`] (there they
    /// cost more than they gain, as at the source), unless `forced` (a test hook); otherwise
    /// one per shard, at most one per core. A source cuts the stream only where one shard
    /// cannot keep up with its link, so the decoding should not run on one core either.
    pub fn threads_for(shards: usize, cores: usize, forced: bool) -> usize {
        if shards > 1 && (forced || cores >= MIN_CORES_FOR_THREADS) {
            shards.min(cores.max(1))
        } else {
            0
        }
    }

    /// `threads`: 0 decodes on the calling task, otherwise the shards share that many threads
    /// named `name-<i>`. The seed, if any, is set on `decoder` before.
    pub fn new(decoder: ShardedDecoder, threads: usize, name: &str) -> Result<DestinationPipeline> {
        if threads == 0 {
            return Ok(DestinationPipeline::Inline(decoder));
        }
        let shards = decoder.into_shards();
        let threads = threads.min(shards.len());
        Ok(DestinationPipeline::Threaded(ThreadedDecoder::new(
            shards, threads, name,
        )?))
    }

    /// Takes the next bytes of the channel and appends the QEMU bytes of every round now
    /// whole to `out` (on threads, the rounds whose units are decoded; the rest come with
    /// [`DestinationPipeline::next_answer`]).
    pub async fn feed(&mut self, bytes: &[u8], out: &mut BytesMut) -> Result<()> {
        match self {
            DestinationPipeline::Inline(decoder) => decoder.feed(bytes, out),
            DestinationPipeline::Threaded(decoder) => {
                decoder.feed(bytes).await?;
                decoder.take(out).map(drop)
            }
        }
    }

    /// Waits until a worker decoded a unit, then appends the rounds now whole to `out`; never
    /// returns inline or with nothing being decoded. Cancel-safe.
    pub async fn next_answer(&mut self, out: &mut BytesMut) -> Result<()> {
        match self {
            DestinationPipeline::Inline(_) => std::future::pending().await,
            DestinationPipeline::Threaded(decoder) => {
                decoder.next_answer().await?;
                decoder.take(out).map(drop)
            }
        }
    }

    /// Whether every byte fed so far was decoded and placed.
    pub fn is_idle(&self) -> bool {
        match self {
            DestinationPipeline::Inline(decoder) => decoder.is_idle(),
            DestinationPipeline::Threaded(decoder) => decoder.is_idle(),
        }
    }
}
