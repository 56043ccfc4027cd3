//! The destination's shards on threads of their own: the caller reads the channel's units in
//! order and keeps the splicing (QEMU's bytes must come out in order); each worker thread
//! decodes the units of the shards `s` with `s % workers == w`, in the order they came.
//!
//! A round is placed once its order unit is in and every one of its shard units is decoded:
//! each worker answers its units in order, so the caller counts, per worker, how many of its
//! units each round holds and moves exactly those answers into the [`Splicer`] (which checks
//! each round as on one thread). Units go to the workers on bounded channels: a slow worker
//! stops the caller, which stops taking the session's frames, so the source's window holds the
//! rest, as with one thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{anyhow, bail, ensure, Context, Result};
use bytes::BytesMut;
use tokio::sync::mpsc;

use super::{next_unit, saying_panics, ShardDecoder, Splicer, Unit, ORDER_LANE};
use crate::engine::stream_codec::MAX_BATCH_DECODED;

/// Units queued per worker before the caller waits.
const UNITS_QUEUED: usize = 8;

/// One shard unit's body, for shard `shard`.
struct ShardUnit {
    shard: usize,
    cache_paused: bool,
    body: BytesMut,
}

/// What a worker says back, in the order its units came.
enum Answer {
    Decoded {
        worker: usize,
        shard: usize,
        bytes: BytesMut,
    },
    /// The unit did not decode, or the worker panicked.
    Failed { error: String },
}

/// A round whose order unit arrived: the unit, and how many of each worker's units are its.
struct Round {
    order: BytesMut,
    units: Vec<usize>,
}

/// The destination's half of the sharded codec with its shards on `workers` threads.
pub struct ThreadedDecoder {
    input: BytesMut,
    workers: Vec<mpsc::Sender<ShardUnit>>,
    answers: mpsc::UnboundedReceiver<Answer>,
    /// Per worker, its decoded units not yet placed: (shard, QEMU's bytes), oldest first.
    decoded: Vec<VecDeque<(usize, BytesMut)>>,
    /// Decoded bytes not yet placed, over all workers.
    held: usize,
    /// Per worker, its units sent since the last order unit.
    open: Vec<usize>,
    rounds: VecDeque<Round>,
    /// Units sent and not yet answered, over all workers.
    in_flight: usize,
    shards: usize,
    splicer: Splicer,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadedDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadedDecoder")
            .field("shards", &self.shards)
            .field("workers", &self.workers.len())
            .field("rounds", &self.rounds.len())
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl ThreadedDecoder {
    /// Gives `shards` (shard s at index s) to `workers` threads named `name-<w>`.
    pub fn new(shards: Vec<ShardDecoder>, workers: usize, name: &str) -> Result<ThreadedDecoder> {
        let count = shards.len();
        assert!(
            (1..=count).contains(&workers),
            "{workers} workers, {count} shards"
        );
        let mut owned: Vec<Vec<ShardDecoder>> = (0..workers).map(|_| Vec::new()).collect();
        for (s, shard) in shards.into_iter().enumerate() {
            owned[s % workers].push(shard);
        }
        let (answer_tx, answers) = mpsc::unbounded_channel();
        let stop = Arc::new(AtomicBool::new(false));
        let mut decoder = ThreadedDecoder {
            input: BytesMut::new(),
            workers: Vec::with_capacity(workers),
            answers,
            decoded: (0..workers).map(|_| VecDeque::new()).collect(),
            held: 0,
            open: vec![0; workers],
            rounds: VecDeque::new(),
            in_flight: 0,
            shards: count,
            splicer: Splicer::new(count),
            stop: stop.clone(),
            threads: Vec::with_capacity(workers),
        };
        for (w, shards) in owned.into_iter().enumerate() {
            let (units, mut queue) = mpsc::channel(UNITS_QUEUED);
            let (answer_tx, stop) = (answer_tx.clone(), stop.clone());
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{w}"))
                .spawn(move || {
                    // The queue outlives a panic until it is said: the decoder, finding the
                    // queue closed, looks for what the worker said.
                    saying_panics(
                        || run(w, workers, shards, &mut queue, &answer_tx, &stop),
                        |error| {
                            let _ = answer_tx.send(Answer::Failed { error });
                        },
                    );
                })
                .context("starting a codec thread")?;
            decoder.threads.push(thread);
            decoder.workers.push(units);
        }
        Ok(decoder)
    }

    /// Takes the next bytes of the channel (cut anywhere): shard units go to their workers
    /// (waiting while a worker's queue is full), order units wait for their round.
    pub async fn feed(&mut self, bytes: &[u8]) -> Result<()> {
        self.input.extend_from_slice(bytes);
        while let Some(Unit {
            lane,
            cache_paused,
            body,
        }) = next_unit(&mut self.input)?
        {
            if lane == ORDER_LANE {
                let units = std::mem::replace(&mut self.open, vec![0; self.workers.len()]);
                self.rounds.push_back(Round { order: body, units });
                continue;
            }
            let shard = usize::from(lane - 1);
            ensure!(
                shard < self.shards,
                "codec unit for lane {lane}, beyond the stream's {} shards",
                self.shards
            );
            let w = shard % self.workers.len();
            let unit = ShardUnit {
                shard,
                cache_paused,
                body,
            };
            if self.workers[w].send(unit).await.is_err() {
                return Err(self.failure());
            }
            self.open[w] += 1;
            self.in_flight += 1;
            // What is decoded counts against the bound at once, not only when taken: one
            // frame may hold many small units.
            while let Ok(answer) = self.answers.try_recv() {
                self.accept(answer)?;
            }
        }
        Ok(())
    }

    /// Appends the QEMU bytes of every round that is whole (its order unit in, its units
    /// decoded) to `out`; whether it appended any.
    pub fn take(&mut self, out: &mut BytesMut) -> Result<bool> {
        while let Ok(answer) = self.answers.try_recv() {
            self.accept(answer)?;
        }
        let mut placed = false;
        while let Some(round) = self.rounds.front() {
            let whole = round
                .units
                .iter()
                .zip(&self.decoded)
                .all(|(&n, decoded)| decoded.len() >= n);
            if !whole {
                break;
            }
            let round = self.rounds.pop_front().expect("a front round");
            for (n, decoded) in round.units.into_iter().zip(&mut self.decoded) {
                for (shard, bytes) in decoded.drain(..n) {
                    self.held -= bytes.len();
                    self.splicer.lane(shard).extend_from_slice(&bytes);
                }
            }
            self.splicer.check_held()?;
            self.splicer.splice(&round.order, out)?;
            placed = true;
        }
        Ok(placed)
    }

    /// Waits for a worker's next answer (never, when no unit is being decoded); then
    /// [`ThreadedDecoder::take`] may place a round. Cancel-safe.
    pub async fn next_answer(&mut self) -> Result<()> {
        if self.in_flight == 0 {
            return std::future::pending().await;
        }
        let answer = self.answers.recv().await.ok_or_else(stopped)?;
        self.accept(answer)
    }

    /// Why a worker stopped: the error it said, if it said one.
    fn failure(&mut self) -> anyhow::Error {
        while let Ok(answer) = self.answers.try_recv() {
            if let Answer::Failed { error } = answer {
                return anyhow!("{error}");
            }
        }
        stopped()
    }

    fn accept(&mut self, answer: Answer) -> Result<()> {
        match answer {
            Answer::Decoded {
                worker,
                shard,
                bytes,
            } => {
                self.in_flight -= 1;
                self.held += bytes.len();
                self.decoded[worker].push_back((shard, bytes));
                // Decoded and not placed: at most what the rounds queued that hold units and
                // the open one make (a peer sending shard units without order units, or
                // empty rounds, cannot make this end hold more).
                let rounds = 1 + self
                    .rounds
                    .iter()
                    .filter(|r| r.units.iter().any(|&n| n > 0))
                    .count();
                ensure!(
                    self.held <= rounds * MAX_BATCH_DECODED,
                    "the shards decoded {} bytes that no order unit placed, more than the {MAX_BATCH_DECODED} of each of {rounds} rounds",
                    self.held
                );
                Ok(())
            }
            Answer::Failed { error } => bail!("{error}"),
        }
    }

    /// Whether a unit is being decoded (an answer will come).
    pub fn decoding(&self) -> bool {
        self.in_flight > 0
    }

    /// Whether every byte fed so far was decoded and placed.
    pub fn is_idle(&self) -> bool {
        self.input.is_empty()
            && self.rounds.is_empty()
            && self.in_flight == 0
            && self.held == 0
            && self.open.iter().all(|&n| n == 0)
    }
}

impl Drop for ThreadedDecoder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Closing the unit channels ends the workers; they skip whatever is still queued.
        self.workers.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn stopped() -> anyhow::Error {
    anyhow!("a codec thread stopped")
}

/// A worker: decodes its shards' units in order, each answered.
fn run(
    worker: usize,
    workers: usize,
    mut shards: Vec<ShardDecoder>,
    units: &mut mpsc::Receiver<ShardUnit>,
    answers: &mpsc::UnboundedSender<Answer>,
    stop: &AtomicBool,
) {
    while let Some(unit) = units.blocking_recv() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let mut bytes = BytesMut::new();
        let answer =
            match shards[unit.shard / workers].decode(&unit.body, unit.cache_paused, &mut bytes) {
                Ok(()) => Answer::Decoded {
                    worker,
                    shard: unit.shard,
                    bytes,
                },
                Err(e) => Answer::Failed {
                    error: format!("shard {}: {e:#}", unit.shard),
                },
            };
        let failed = matches!(answer, Answer::Failed { .. });
        if answers.send(answer).is_err() || failed {
            return;
        }
    }
}
