//! The source's shards on threads of their own: the dispatcher stays on the caller's task
//! (it must read QEMU's stream in order), each worker thread codes the shards `s` with
//! `s % workers == w`, and the rounds come back in order.
//!
//! The caller copies each routed record into its worker's job buffer (256 KiB, recycled) and
//! sends full buffers on a bounded channel, so a slow worker stops the caller, which stops
//! reading QEMU: backpressure is the single encoder's, one hop longer. A round is closed by a
//! `Close` to every worker; each answers with its shards' units of the round (full batches
//! closed mid-round included) and their reports. Rounds leave in the order they were closed:
//! every worker's units of round k, then order unit k.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::thread::JoinHandle;

use anyhow::{anyhow, bail, Context, Result};
use bytes::{Buf, BufMut, BytesMut};
use ferry_api::agent::CodecReport;
use ferry_qemu::stream::Item;
use tokio::sync::mpsc;

use super::sharded::{sum_reports, ShardReport};
use super::{saying_panics, Dispatcher, Route, ShardEncoder};
use crate::engine::stream_codec::BATCH_BYTES;

/// Bytes of records the caller gathers for a worker before sending them.
const JOB_BYTES: usize = 256 << 10;
/// Jobs queued per worker before the caller waits.
const JOBS_QUEUED: usize = 8;
/// A round closes once one shard was routed this many of QEMU's bytes in it: a batch of raw
/// pages, so raw passes leave as often as with the single encoder (the caller cannot see a
/// shard's batch fill while a worker codes it).
const SHARD_ROUND_BYTES: usize = BATCH_BYTES;

/// Record kinds in a job.
const OPAQUE: u8 = 0;
const PAGE: u8 = 1;

enum Job {
    /// Records routed to this worker's shards.
    Records(Vec<u8>),
    /// The round ends: every shard's open batch, then the units and reports back.
    Close,
    /// Every shard's block cache paused or resumed from its next batch on.
    CachePaused(bool),
}

/// What a worker says back.
enum Answer {
    /// The units of the round it was asked to close.
    Done(Done),
    /// It panicked (the panic's message): the migration must not wait for it.
    Failed(String),
}

/// A worker's answer to `Close`.
struct Done {
    worker: usize,
    units: BytesMut,
    /// (shard, what it did so far).
    reports: Vec<(usize, ShardReport)>,
}

struct Worker {
    jobs: mpsc::Sender<Job>,
    /// Records gathered for the next job.
    pending: Vec<u8>,
}

/// A closed round whose units are not all back.
struct Round {
    order: BytesMut,
    /// What the caller said to keep with it (the ledger's pages read at its close).
    mark: u64,
    /// Each worker's units, once back.
    units: Vec<Option<BytesMut>>,
}

impl Round {
    fn complete(&self) -> bool {
        self.units.iter().all(Option::is_some)
    }
}

/// The source's half of the sharded codec with its shards on `workers` threads.
pub struct ThreadedEncoder {
    dispatcher: Dispatcher,
    workers: Vec<Worker>,
    done: mpsc::UnboundedReceiver<Answer>,
    /// Job buffers the workers are done with.
    spare: std_mpsc::Receiver<Vec<u8>>,
    rounds: VecDeque<Round>,
    /// QEMU's bytes routed to each shard in the open round.
    shard_round: Vec<usize>,
    /// A shard took [`SHARD_ROUND_BYTES`] in the open round.
    shard_full: bool,
    reports: Vec<ShardReport>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadedEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadedEncoder")
            .field("shards", &self.shard_round.len())
            .field("workers", &self.workers.len())
            .field("rounds", &self.rounds.len())
            .finish_non_exhaustive()
    }
}

impl ThreadedEncoder {
    /// Gives `shards` (shard s at index s) to `workers` threads named `name-<w>`.
    pub fn new(
        dispatcher: Dispatcher,
        shards: Vec<ShardEncoder>,
        workers: usize,
        name: &str,
    ) -> Result<ThreadedEncoder> {
        let count = shards.len();
        assert!(
            (1..=count).contains(&workers),
            "{workers} workers, {count} shards"
        );
        let mut owned: Vec<Vec<(usize, ShardEncoder)>> = (0..workers).map(|_| Vec::new()).collect();
        for (s, shard) in shards.into_iter().enumerate() {
            owned[s % workers].push((s, shard));
        }
        let (done_tx, done) = mpsc::unbounded_channel();
        let (spare_tx, spare) = std_mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut encoder = ThreadedEncoder {
            dispatcher,
            workers: Vec::with_capacity(workers),
            done,
            spare,
            rounds: VecDeque::new(),
            shard_round: vec![0; count],
            shard_full: false,
            reports: vec![ShardReport::default(); count],
            stop: stop.clone(),
            threads: Vec::with_capacity(workers),
        };
        for (w, shards) in owned.into_iter().enumerate() {
            let (jobs, mut queue) = mpsc::channel(JOBS_QUEUED);
            let (done_tx, spare_tx, stop) = (done_tx.clone(), spare_tx.clone(), stop.clone());
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{w}"))
                .spawn(move || {
                    // The queue outlives a panic until it is said: the pump, finding the
                    // queue closed, looks for what the worker said.
                    saying_panics(
                        || run(w, workers, shards, &mut queue, &done_tx, &spare_tx, &stop),
                        |message| {
                            let _ = done_tx.send(Answer::Failed(message));
                        },
                    );
                })
                .context("starting a codec thread")?;
            encoder.threads.push(thread);
            encoder.workers.push(Worker {
                jobs,
                pending: Vec::new(),
            });
        }
        Ok(encoder)
    }

    /// Routes one parsed item; its records go to its shard's worker. Waits while that
    /// worker's queue is full.
    pub async fn push(&mut self, item: &Item, qemu: &[u8]) -> Result<()> {
        debug_assert!(!self.is_full(), "a full round was not closed");
        let workers = self.workers.len();
        let shard = match self.dispatcher.route(item, qemu) {
            Route::Serial => return Ok(()),
            Route::Page {
                shard,
                key,
                header,
                page,
            } => {
                let job = self.job_for(shard % workers);
                job.reserve(16 + header.len() + page.len());
                job.put_u8(PAGE);
                job.put_u8(u8::try_from(shard).expect("at most 16 shards"));
                job.put_u64_le(key);
                job.put_u16_le(u16::try_from(header.len()).expect("a page header is short"));
                job.extend_from_slice(header);
                job.extend_from_slice(page);
                shard
            }
            Route::Opaque { shard, bytes } => {
                let job = self.job_for(shard % workers);
                job.put_u8(OPAQUE);
                job.put_u8(u8::try_from(shard).expect("at most 16 shards"));
                job.put_u32_le(u32::try_from(bytes.len()).expect("an item is far below 4 GiB"));
                job.extend_from_slice(bytes);
                shard
            }
        };
        self.shard_round[shard] += qemu.len();
        self.shard_full |= self.shard_round[shard] >= SHARD_ROUND_BYTES;
        let w = shard % workers;
        if self.workers[w].pending.len() >= JOB_BYTES {
            let job = std::mem::take(&mut self.workers[w].pending);
            self.send(w, Job::Records(job)).await?;
        }
        Ok(())
    }

    /// The job buffer of worker `w`, a recycled one if it had none.
    fn job_for(&mut self, w: usize) -> &mut Vec<u8> {
        let pending = &mut self.workers[w].pending;
        if pending.capacity() == 0 {
            *pending = self
                .spare
                .try_recv()
                .unwrap_or_else(|_| Vec::with_capacity(JOB_BYTES + (64 << 10)));
        }
        pending
    }

    /// Whether the round should be closed now (see [`SHARD_ROUND_BYTES`] and
    /// [`Dispatcher::round_is_full`]).
    pub fn is_full(&self) -> bool {
        self.shard_full || self.dispatcher.round_is_full()
    }

    /// Closes the open round, if anything is in it; `mark` comes back with it from
    /// [`ThreadedEncoder::collect`].
    pub async fn close_round(&mut self, mark: u64) -> Result<()> {
        if self.dispatcher.round_bytes() == 0 {
            return Ok(());
        }
        for w in 0..self.workers.len() {
            self.send_pending(w).await?;
            self.send(w, Job::Close).await?;
        }
        let mut order = BytesMut::new();
        self.dispatcher.close_round(&mut order);
        self.rounds.push_back(Round {
            order,
            mark,
            units: vec![None; self.workers.len()],
        });
        self.shard_round.fill(0);
        self.shard_full = false;
        Ok(())
    }

    /// Pauses or resumes every shard's block cache from its next batch on, after the records
    /// routed so far.
    pub async fn set_cache_paused(&mut self, paused: bool) -> Result<()> {
        for w in 0..self.workers.len() {
            self.send_pending(w).await?;
            self.send(w, Job::CachePaused(paused)).await?;
        }
        Ok(())
    }

    /// Sends worker `w` the records gathered for it, if any.
    async fn send_pending(&mut self, w: usize) -> Result<()> {
        if self.workers[w].pending.is_empty() {
            return Ok(());
        }
        let job = std::mem::take(&mut self.workers[w].pending);
        self.send(w, Job::Records(job)).await
    }

    /// Sends worker `w` a job, waiting while its queue is full; a worker that stopped is
    /// reported with what it said.
    async fn send(&mut self, w: usize, job: Job) -> Result<()> {
        if self.workers[w].jobs.send(job).await.is_err() {
            return Err(self.failure());
        }
        Ok(())
    }

    /// Why a worker stopped: its panic's message, if it said one.
    fn failure(&mut self) -> anyhow::Error {
        while let Ok(answer) = self.done.try_recv() {
            if let Answer::Failed(message) = answer {
                return anyhow!("{message}");
            }
        }
        stopped()
    }

    /// Appends every closed round whose units are all back to `out`, in order (with `wait`,
    /// every closed round), and returns the mark of the last one appended.
    pub async fn collect(&mut self, out: &mut BytesMut, wait: bool) -> Result<Option<u64>> {
        let mut mark = None;
        loop {
            while let Ok(answer) = self.done.try_recv() {
                self.accept(answer)?;
            }
            while self.rounds.front().is_some_and(Round::complete) {
                let round = self.rounds.pop_front().expect("a front round");
                for units in round.units.into_iter().flatten() {
                    out.extend_from_slice(&units);
                }
                out.extend_from_slice(&round.order);
                mark = Some(round.mark);
            }
            if !wait || self.rounds.is_empty() {
                return Ok(mark);
            }
            self.next_done().await?;
        }
    }

    /// Waits until a worker finishes a round (never, when no round is open at the workers).
    /// Cancel-safe.
    pub async fn next_done(&mut self) -> Result<()> {
        if self.rounds.is_empty() {
            return std::future::pending().await;
        }
        let answer = self.done.recv().await.ok_or_else(stopped)?;
        self.accept(answer)
    }

    fn accept(&mut self, answer: Answer) -> Result<()> {
        let done = match answer {
            Answer::Done(done) => done,
            Answer::Failed(message) => bail!("{message}"),
        };
        let round = self
            .rounds
            .iter_mut()
            .find(|r| r.units[done.worker].is_none())
            .expect("a worker answers only the rounds it was asked to close");
        round.units[done.worker] = Some(done.units);
        for (shard, report) in done.reports {
            self.reports[shard] = report;
        }
        Ok(())
    }

    /// What the codec did, as of the rounds the workers finished.
    pub fn report(&self) -> CodecReport {
        CodecReport {
            threads: u32::try_from(self.workers.len()).expect("at most 16 threads"),
            ..sum_reports(&self.dispatcher, self.reports.iter().cloned())
        }
    }
}

impl Drop for ThreadedEncoder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Closing the job channels ends the workers; they skip whatever is still queued.
        self.workers.clear();
        for thread in self.threads.drain(..) {
            // A panic was said when it happened (`Answer::Failed`).
            let _ = thread.join();
        }
    }
}

fn stopped() -> anyhow::Error {
    anyhow!("a codec thread stopped")
}

/// A worker: codes its shards' records, answers each `Close` with the round's units.
fn run(
    worker: usize,
    workers: usize,
    mut shards: Vec<(usize, ShardEncoder)>,
    jobs: &mut mpsc::Receiver<Job>,
    done: &mpsc::UnboundedSender<Answer>,
    spare: &std_mpsc::Sender<Vec<u8>>,
    stop: &AtomicBool,
) {
    let mut units = BytesMut::new();
    while let Some(job) = jobs.blocking_recv() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        match job {
            Job::Records(mut records) => {
                code(&records, &mut shards, workers, &mut units);
                records.clear();
                let _ = spare.send(records);
            }
            Job::CachePaused(paused) => {
                for (_, shard) in &mut shards {
                    shard.set_cache_paused(paused);
                }
            }
            Job::Close => {
                for (_, shard) in &mut shards {
                    shard.flush(&mut units);
                }
                let reports = shards
                    .iter()
                    .map(|(s, shard)| (*s, ShardReport::of(shard)))
                    .collect();
                let answer = Answer::Done(Done {
                    worker,
                    units: units.split(),
                    reports,
                });
                if done.send(answer).is_err() {
                    return;
                }
            }
        }
    }
}

/// Codes one job's records, closing full batches into `units`.
/// Shard s is at index `s / workers` of `shards`.
fn code(
    mut records: &[u8],
    shards: &mut [(usize, ShardEncoder)],
    workers: usize,
    units: &mut BytesMut,
) {
    while records.has_remaining() {
        let kind = records.get_u8();
        let shard = usize::from(records.get_u8());
        let (_, encoder) = &mut shards[shard / workers];
        if kind == PAGE {
            let key = records.get_u64_le();
            let header_len = usize::from(records.get_u16_le());
            let (header, rest) = records.split_at(header_len);
            let (page, rest) = rest.split_at(ferry_qemu::stream::PAGE_SIZE);
            encoder.push_page(key, header, page);
            records = rest;
        } else {
            let len = records.get_u32_le() as usize;
            let (bytes, rest) = records.split_at(len);
            encoder.push_opaque(bytes);
            records = rest;
        }
        if encoder.is_full() {
            encoder.flush(units);
        }
    }
}
