//! What the source's pump drives: the sharded codec on the pump's own task (one shard, or a
//! host without cores to spare) or with its shards on threads.

use anyhow::Result;
use bytes::BytesMut;
use ferry_api::agent::CodecReport;
use ferry_qemu::stream::Item;

use super::{ShardedEncoder, ThreadedEncoder};

#[derive(Debug)]
pub enum SourcePipeline {
    /// Every shard coded on the calling task; `mark`: the last closed round's, until
    /// collected.
    Inline {
        encoder: ShardedEncoder,
        mark: Option<u64>,
    },
    Threaded(ThreadedEncoder),
}

impl SourcePipeline {
    /// `threads`: 0 codes on the calling task, otherwise the shards share that many threads
    /// named `name-<i>`.
    pub fn new(encoder: ShardedEncoder, threads: usize, name: &str) -> Result<SourcePipeline> {
        if threads == 0 {
            return Ok(SourcePipeline::Inline {
                encoder,
                mark: None,
            });
        }
        let (dispatcher, shards) = encoder.into_parts();
        let threads = threads.min(shards.len());
        Ok(SourcePipeline::Threaded(ThreadedEncoder::new(
            dispatcher, shards, threads, name,
        )?))
    }

    /// Adds one parsed item; `qemu` is its bytes as QEMU wrote them. The caller closes the
    /// round once [`SourcePipeline::is_full`] says so, before the next item.
    pub async fn push(&mut self, item: &Item, qemu: &[u8]) -> Result<()> {
        match self {
            SourcePipeline::Inline { encoder, .. } => {
                encoder.push(item, qemu);
                Ok(())
            }
            SourcePipeline::Threaded(encoder) => encoder.push(item, qemu).await,
        }
    }

    /// Pauses or resumes every shard's block cache from its next batch on.
    pub async fn set_cache_paused(&mut self, paused: bool) -> Result<()> {
        match self {
            SourcePipeline::Inline { encoder, .. } => {
                encoder.set_cache_paused(paused);
                Ok(())
            }
            SourcePipeline::Threaded(encoder) => encoder.set_cache_paused(paused).await,
        }
    }

    pub fn is_full(&self) -> bool {
        match self {
            SourcePipeline::Inline { encoder, .. } => encoder.is_full(),
            SourcePipeline::Threaded(encoder) => encoder.is_full(),
        }
    }

    /// Closes the open round; `mark` comes back from [`SourcePipeline::collect`] once the
    /// round is in its `out`. Inline, the round's units go to `out` at once.
    pub async fn close_round(&mut self, out: &mut BytesMut, mark: u64) -> Result<()> {
        match self {
            SourcePipeline::Inline {
                encoder,
                mark: closed,
            } => {
                if encoder.round_bytes() > 0 {
                    encoder.flush(out);
                    *closed = Some(mark);
                }
                Ok(())
            }
            SourcePipeline::Threaded(encoder) => encoder.close_round(mark).await,
        }
    }

    /// Appends every closed round that is coded to `out` (with `wait`, every closed round)
    /// and returns the mark of the last one, if any.
    pub async fn collect(&mut self, out: &mut BytesMut, wait: bool) -> Result<Option<u64>> {
        match self {
            SourcePipeline::Inline { mark, .. } => Ok(mark.take()),
            SourcePipeline::Threaded(encoder) => encoder.collect(out, wait).await,
        }
    }

    /// Waits until a closed round is coded: never inline, where rounds are coded when
    /// closed. Cancel-safe.
    pub async fn round_coded(&mut self) -> Result<()> {
        match self {
            SourcePipeline::Inline { .. } => std::future::pending().await,
            SourcePipeline::Threaded(encoder) => encoder.next_done().await,
        }
    }

    pub fn report(&self) -> CodecReport {
        match self {
            SourcePipeline::Inline { encoder, .. } => encoder.report(),
            SourcePipeline::Threaded(encoder) => encoder.report(),
        }
    }
}
