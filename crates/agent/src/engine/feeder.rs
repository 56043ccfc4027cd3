//! The destination QEMU's incoming stream, written by a task of its own from a bounded queue.
//!
//! The destination agent takes frames off the session, decodes them and writes QEMU's bytes to
//! QEMU's socket. Done in one loop, a slow write (QEMU loading a run of pages the codec had
//! squeezed thirty to one) stopped the receiving too: the session's acknowledgements paused,
//! the source's window filled, and the WAN idled while the destination caught up. With the
//! writes in their own task, the agent keeps receiving and decoding (on the other core) while
//! QEMU loads, up to a budget. Whatever is queued here when the VM stops must still be loaded
//! during the pause, so the budget counts QEMU's work, not bytes: a RAM record weighs a page
//! (see [`crate::engine::load_sieve`]). Counted in bytes, a run of zero-page records (9 bytes each, and about 4 µs
//! of QEMU's time each: it checks its own copy of the page, faulting it in) let the 16 MiB budget
//! hold more than the guest's whole memory, and the destination QEMU was still working through
//! 350 ms of them, one core busy, after the source stopped the VM.

use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

/// QEMU's work queued at most, in weighed bytes (a single heavier piece is let through alone).
pub const BUDGET_BYTES: usize = 32 << 20;
/// The budget's unit: a permit per KiB.
const UNIT: usize = 1024;

pub struct Feeder {
    queue: Option<mpsc::UnboundedSender<(Bytes, OwnedSemaphorePermit)>>,
    budget: Arc<Semaphore>,
    permits: u32,
    /// Taken once its outcome was read.
    writer: Option<JoinHandle<Result<()>>>,
}

impl Feeder {
    /// Starts the writer on `to_qemu` with a budget of `budget_bytes`.
    pub fn spawn<W>(mut to_qemu: W, budget_bytes: usize) -> Feeder
    where
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let permits = u32::try_from((budget_bytes / UNIT).max(1)).unwrap_or(u32::MAX);
        let (tx, mut rx) = mpsc::unbounded_channel::<(Bytes, OwnedSemaphorePermit)>();
        let writer = tokio::spawn(async move {
            while let Some((bytes, _permit)) = rx.recv().await {
                to_qemu
                    .write_all(&bytes)
                    .await
                    .context("writing the stream to the destination QEMU")?;
            }
            to_qemu
                .flush()
                .await
                .context("flushing the stream to the destination QEMU")
        });
        Feeder {
            queue: Some(tx),
            budget: Arc::new(Semaphore::new(permits as usize)),
            permits,
            writer: Some(writer),
        }
    }

    /// Queues `bytes` for QEMU, weighing `weight` against the budget (see [`crate::engine::load_sieve`]),
    /// waiting while the budget is spent. Fails with the writer's error once the writer has
    /// stopped.
    pub async fn push(&mut self, bytes: Bytes, weight: usize) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let units = u32::try_from(weight.max(bytes.len()).div_ceil(UNIT))
            .unwrap_or(u32::MAX)
            .clamp(1, self.permits);
        let permit = self
            .budget
            .clone()
            .acquire_many_owned(units)
            .await
            .expect("the budget is never closed");
        let queue = self.queue.as_ref().expect("open until finish");
        if queue.send((bytes, permit)).is_err() {
            return Err(self.writer_error().await);
        }
        Ok(())
    }

    /// Waits until QEMU has been given everything queued.
    pub async fn finish(mut self) -> Result<()> {
        self.queue = None;
        match self.writer.take() {
            Some(writer) => writer
                .await
                .map_err(|e| anyhow!("the stream writer task: {e}"))?,
            None => Err(anyhow!("the stream writer had already failed")),
        }
    }

    async fn writer_error(&mut self) -> anyhow::Error {
        match self.writer.take() {
            Some(writer) => match writer.await {
                Ok(Err(e)) => e,
                Ok(Ok(())) => anyhow!("the stream writer stopped early"),
                Err(e) => anyhow!("the stream writer task: {e}"),
            },
            None => anyhow!("the stream writer had already failed"),
        }
    }
}

impl Drop for Feeder {
    /// A migration that failed stops feeding QEMU at once.
    fn drop(&mut self) {
        if let Some(writer) = &self.writer {
            writer.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn bytes_arrive_in_order_and_finish_waits_for_them() {
        let (writer, mut reader) = tokio::io::duplex(4096);
        let mut feeder = Feeder::spawn(writer, 64 << 10);
        let read = tokio::spawn(async move {
            let mut all = Vec::new();
            reader.read_to_end(&mut all).await.unwrap();
            all
        });
        let mut expected = Vec::new();
        for i in 0..200u32 {
            // Pieces from 1 byte to well over the budget.
            let piece: Vec<u8> = (0..(i * 997 % 100_000 + 1))
                .map(|b| (b ^ i).to_le_bytes()[0])
                .collect();
            expected.extend_from_slice(&piece);
            let weight = piece.len() * usize::try_from(i % 3).unwrap();
            feeder.push(Bytes::from(piece), weight).await.unwrap();
        }
        feeder.finish().await.unwrap();
        assert_eq!(read.await.unwrap(), expected);
    }

    #[tokio::test]
    async fn a_closed_qemu_socket_fails_the_next_push() {
        let (writer, reader) = tokio::io::duplex(1024);
        drop(reader);
        let mut feeder = Feeder::spawn(writer, 4096);
        let mut failed = None;
        for _ in 0..100 {
            if let Err(e) = feeder.push(Bytes::from(vec![7u8; 2048]), 2048).await {
                failed = Some(e);
                break;
            }
        }
        let e = failed.expect("a push fails once the writer stopped");
        assert!(format!("{e:#}").contains("writing the stream"), "{e:#}");
    }
}
