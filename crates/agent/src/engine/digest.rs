//! The end-to-end digest: both ends hash what QEMU wrote (its main stream, each multifd
//! channel, the disk writes) and the commit waits for the two to match.
//!
//! BLAKE3 rather than SHA-256: the digest runs over every byte on both agents, and at 1 Gbit/s
//! SHA-256 (with the CPU's SHA extensions) took 12-15% of each agent's CPU. BLAKE3 hashes the
//! 1 KiB chunks of a longer input side by side in SIMD lanes, so the hasher gathers what it is
//! given (pages, record headers, disk operations of a few bytes) into runs of [`RUN`] first.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crossbeam_channel::{Receiver, Sender, TryRecvError, TrySendError};

use blake3::hazmat::{
    merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode,
};

/// Bytes gathered before they are hashed: enough for BLAKE3 to fill its widest SIMD lanes.
const RUN: usize = 64 * 1024;

/// The algorithm's name, for messages and reports.
pub const ALGORITHM: &str = "blake3";

/// The running digest of one stream.
#[derive(Clone)]
pub struct StreamDigest {
    hasher: blake3::Hasher,
    run: Vec<u8>,
}

impl Default for StreamDigest {
    fn default() -> StreamDigest {
        StreamDigest::new()
    }
}

impl std::fmt::Debug for StreamDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDigest")
            .field("hashed", &self.hasher.count())
            .field("gathered", &self.run.len())
            .finish()
    }
}

impl StreamDigest {
    pub fn new() -> StreamDigest {
        StreamDigest {
            hasher: blake3::Hasher::new(),
            run: Vec::with_capacity(RUN),
        }
    }

    pub fn update(&mut self, bytes: &[u8]) {
        if self.run.len() + bytes.len() > RUN {
            self.hasher.update(&self.run);
            self.run.clear();
        }
        if bytes.len() >= RUN {
            self.hasher.update(bytes);
        } else {
            self.run.extend_from_slice(bytes);
        }
    }

    /// The digest of everything so far; the stream may go on.
    pub fn bytes(&self) -> [u8; 32] {
        let mut hasher = self.hasher.clone();
        hasher.update(&self.run);
        *hasher.finalize().as_bytes()
    }

    /// [`Self::bytes`] as lowercase hex, as the control messages carry it.
    pub fn hex(&self) -> String {
        blake3::Hash::from_bytes(self.bytes()).to_hex().to_string()
    }

    /// The hex digest of `bytes` alone.
    pub fn of(bytes: &[u8]) -> String {
        blake3::hash(bytes).to_hex().to_string()
    }
}

/// Bytes of one span of [`TreeDigest`]: a power of two of BLAKE3's 1 KiB chunks, so a span that
/// starts at a multiple of its length is a whole subtree of BLAKE3's tree (the last one may be
/// short) and spans hash independently. Large enough for BLAKE3's widest SIMD lanes and to
/// make a hand-over rare (4,000 per GB), small enough that what is queued when the stream ends
/// is hashed in about a millisecond: the digest at `End` is on the VM's pause.
const SPAN: usize = 256 << 10;

/// Spans queued for the helpers, at most: beyond this the stream's own thread hashes the span
/// it hands out, and a digest asked for hashes what is queued itself rather than wait for the
/// helpers (on a loaded host a helper may wait for a CPU for milliseconds). So at most the
/// spans the helpers are hashing are waited for when the stream ends, on the VM's pause (with
/// 1 MiB spans, 8 queued and only the helpers hashing them, the pause's median grew).
const SPANS_IN_FLIGHT: usize = 4;

/// CPUs the agent may use (`available_parallelism`: the host's cores within its affinity and
/// cgroup quota) for the main stream's digest to get a helper thread. Each agent shares
/// its host with QEMU (vCPUs, migration thread): on 2 cores at 1 Gbit/s those are already
/// full, and a helper there cost the agents 3-12% more CPU for no time gained (BENCHMARKS.md).
const CORES_FOR_A_HELPER: usize = 4;

/// The digest of the main stream, the same value as [`StreamDigest`]'s (BLAKE3 of the whole),
/// with the hashing on helper threads where the host has CPUs to spare: the stream's bytes are
/// cut into [`SPAN`]s by offset, a helper (or this end) hashes each span as a subtree (its
/// chaining value), and this end combines the values in order by BLAKE3's own rule. At
/// 1 Gbit/s the digest was 7% of the source agent's CPU, on the task that also parses and
/// codes the stream; with a helper it runs beside that task.
pub struct TreeDigest {
    span_len: usize,
    /// The bytes after the last span handed out: never empty once the stream has a byte, so
    /// the last span is always here and a stream of one span is hashed as BLAKE3's root.
    span: Vec<u8>,
    /// Spans handed out so far (the next one's index).
    handed_out: u64,
    /// The chaining values of spans `0..combined`, merged as far as BLAKE3's tree allows while
    /// more may follow: one value per 1 bit of `combined` (the stack of BLAKE3's hasher).
    stack: Vec<ChainingValue>,
    combined: u64,
    /// Values hashed ahead of a span still being hashed (helpers and this end finish out of
    /// order).
    early: BTreeMap<u64, ChainingValue>,
    /// `None`: no helpers, each span is hashed inline as it is handed out.
    helpers: Option<Helpers>,
    /// Span buffers hashed, to be filled again.
    spare: Vec<Vec<u8>>,
}

struct Helpers {
    spans: Sender<Span>,
    /// The queue's other end, as the helpers have it: a digest asked for takes spans from it.
    queued: Receiver<Span>,
    hashed: Receiver<Hashed>,
}

/// A span handed out: its index, where it starts in the stream, its bytes.
struct Span {
    index: u64,
    offset: u64,
    bytes: Vec<u8>,
}

/// A span back from a helper with its chaining value, or without one if hashing it panicked
/// there: the stream's thread then hashes it, so a second panic is the migration task's error
/// rather than a digest waiting forever for a span no helper will give back.
struct Hashed {
    value: Option<ChainingValue>,
    span: Span,
}

impl std::fmt::Debug for TreeDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TreeDigest")
            .field("handed_out", &self.handed_out)
            .field("combined", &self.combined)
            .field("gathered", &self.span.len())
            .finish()
    }
}

impl TreeDigest {
    /// A digest hashed on one helper thread where the agent may use [`CORES_FOR_A_HELPER`]
    /// CPUs, else inline (also if the thread cannot be started).
    pub fn new() -> TreeDigest {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        TreeDigest::with_helpers(usize::from(cores >= CORES_FOR_A_HELPER))
    }

    /// A digest hashed on `helpers` threads; 0 hashes inline, on the caller's.
    pub fn with_helpers(helpers: usize) -> TreeDigest {
        TreeDigest::with(helpers, SPAN)
    }

    /// `helpers` threads (0: inline) and spans of `span_len` bytes, a power of two of at
    /// least BLAKE3's chunk.
    fn with(helpers: usize, span_len: usize) -> TreeDigest {
        TreeDigest::with_queue(Helpers::start(helpers), span_len)
    }

    fn with_queue(helpers: Option<Helpers>, span_len: usize) -> TreeDigest {
        assert!(span_len.is_power_of_two() && span_len >= blake3::CHUNK_LEN);
        TreeDigest {
            span_len,
            span: Vec::with_capacity(span_len),
            handed_out: 0,
            stack: Vec::new(),
            combined: 0,
            early: BTreeMap::new(),
            helpers,
            spare: Vec::new(),
        }
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            // A full span is handed out only when a byte after it arrives: until then it may
            // be the last, which BLAKE3 hashes differently when it is the only one.
            if self.span.len() == self.span_len {
                self.hand_out();
            }
            let take = (self.span_len - self.span.len()).min(bytes.len());
            self.span.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
        }
    }

    fn hand_out(&mut self) {
        let next = self
            .spare
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.span_len));
        let index = self.handed_out;
        let span = Span {
            index,
            offset: index * self.span_len as u64,
            bytes: std::mem::replace(&mut self.span, next),
        };
        self.handed_out += 1;
        let span = match &self.helpers {
            Some(helpers) => match helpers.spans.try_send(span) {
                Ok(()) => None,
                // The helpers are behind: this thread hashes rather than wait for them.
                Err(TrySendError::Full(span)) => Some(span),
                Err(TrySendError::Disconnected(_)) => unreachable!("this digest holds a receiver"),
            },
            None => Some(span),
        };
        if let Some(span) = span {
            self.take(Hashed { value: None, span });
        }
        self.take_hashed(false);
    }

    /// Takes the helpers' values; with `all`, until every span handed out is in, hashing the
    /// queued ones here rather than wait for a helper to get to them.
    fn take_hashed(&mut self, all: bool) {
        while self.combined + (self.early.len() as u64) < self.handed_out {
            let Some(helpers) = &self.helpers else {
                unreachable!("spans are hashed as they are handed out without helpers")
            };
            let hashed = match helpers.hashed.try_recv() {
                Ok(hashed) => hashed,
                Err(TryRecvError::Empty | TryRecvError::Disconnected) if all => {
                    match helpers.queued.try_recv() {
                        Ok(span) => Hashed { value: None, span },
                        // Only spans a helper is hashing are left: wait for them.
                        Err(_) => helpers
                            .hashed
                            .recv()
                            .expect("a digest helper ended with a span still to hash"),
                    }
                }
                Err(_) => return,
            };
            self.take(hashed);
        }
    }

    /// Combines a span's value (hashing it here if it has none yet) and keeps its buffer.
    fn take(&mut self, hashed: Hashed) {
        let Hashed { value, mut span } = hashed;
        let value = value.unwrap_or_else(|| subtree(span.offset, &span.bytes));
        self.add(span.index, value);
        span.bytes.clear();
        self.spare.push(span.bytes);
    }

    /// Combines span `index`'s value, and any that waited for it, in stream order.
    fn add(&mut self, index: u64, value: ChainingValue) {
        self.early.insert(index, value);
        while let Some(value) = self.early.remove(&self.combined) {
            push_subtree(&mut self.stack, self.combined, value);
            self.combined += 1;
        }
    }

    /// The digest of everything so far; the stream may go on. Waits for the helpers.
    pub fn bytes(&mut self) -> [u8; 32] {
        self.take_hashed(true);
        if self.handed_out == 0 {
            return *blake3::hash(&self.span).as_bytes();
        }
        let mut stack = self.stack.clone();
        let last = subtree(self.handed_out * self.span_len as u64, &self.span);
        push_subtree(&mut stack, self.handed_out, last);
        while stack.len() > 2 {
            let right = stack.pop().expect("more than two");
            let left = stack.pop().expect("more than two");
            stack.push(merge_subtrees_non_root(&left, &right, Mode::Hash));
        }
        *merge_subtrees_root(&stack[0], &stack[1], Mode::Hash).as_bytes()
    }

    /// [`Self::bytes`] as lowercase hex, as the control messages carry it.
    pub fn hex(&mut self) -> String {
        blake3::Hash::from_bytes(self.bytes()).to_hex().to_string()
    }
}

impl Default for TreeDigest {
    fn default() -> TreeDigest {
        TreeDigest::new()
    }
}

impl Helpers {
    /// Starts `count` threads that hash spans; `None` if none could be started.
    fn start(count: usize) -> Option<Helpers> {
        let (helpers, done) = Helpers::queue();
        let mut started = 0;
        for _ in 0..count {
            let (queue, done) = (helpers.queued.clone(), done.clone());
            let helper = std::thread::Builder::new()
                .name("ferry-digest".into())
                .spawn(move || hash_spans(&queue, &done));
            match helper {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!("digest helper not started, hashing inline: {e}"),
            }
        }
        (started > 0).then_some(helpers)
    }

    /// The queues, and where helpers send what they hashed.
    fn queue() -> (Helpers, Sender<Hashed>) {
        let (spans, queued) = crossbeam_channel::bounded(SPANS_IN_FLIGHT);
        let (done, hashed) = crossbeam_channel::unbounded();
        let helpers = Helpers {
            spans,
            queued,
            hashed,
        };
        (helpers, done)
    }
}

/// A helper's loop: until the digest is dropped, hash the next span handed out.
fn hash_spans(queue: &Receiver<Span>, done: &Sender<Hashed>) {
    while let Ok(span) = queue.recv() {
        let value = catch_unwind(AssertUnwindSafe(|| subtree(span.offset, &span.bytes))).ok();
        if done.send(Hashed { value, span }).is_err() {
            return;
        }
    }
}

/// The chaining value of the span at `offset` in the stream.
fn subtree(offset: u64, span: &[u8]) -> ChainingValue {
    blake3::Hasher::new()
        .set_input_offset(offset)
        .update(span)
        .finalize_non_root()
}

/// Pushes the value of subtree `index` (of equal-sized ones) after merging the ones before it
/// that are now known not to be on the tree's right edge: BLAKE3's hasher keeps one value per
/// 1 bit of the count of subtrees before the new one.
fn push_subtree(stack: &mut Vec<ChainingValue>, index: u64, value: ChainingValue) {
    while stack.len() > index.count_ones() as usize {
        let right = stack.pop().expect("above the count's bits");
        let left = stack.pop().expect("a left subtree for each right one");
        stack.push(merge_subtrees_non_root(&left, &right, Mode::Hash));
    }
    stack.push(value);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// However the stream is cut, the digest is BLAKE3's of the whole, also midway.
        #[test]
        fn any_cutting_gives_the_digest_of_the_whole(
            data in proptest::collection::vec(any::<u8>(), 0..300_000),
            cuts in proptest::collection::vec(0usize..100_000, 0..12),
        ) {
            let mut d = StreamDigest::new();
            fed_in_cuts(&mut d, &data, &cuts)?;
            prop_assert_eq!(d.bytes(), *blake3::hash(&data).as_bytes());
        }

        /// The tree digest equals BLAKE3's of the whole however the stream is cut, with any
        /// span length and any number of helpers, midway (every prefix asked for) and at the
        /// end: spans of 1-16 chunks make trees of every shape from short inputs.
        #[test]
        fn the_tree_digest_is_blake3_of_the_whole(
            data in proptest::collection::vec(any::<u8>(), 0..70_000),
            cuts in proptest::collection::vec(0usize..20_000, 0..10),
            span_chunks in prop_oneof![Just(1usize), Just(2), Just(4), Just(16)],
            helpers in 0usize..4,
        ) {
            let mut d = TreeDigest::with(helpers, span_chunks * blake3::CHUNK_LEN);
            fed_in_cuts(&mut d, &data, &cuts)?;
            prop_assert_eq!(d.bytes(), *blake3::hash(&data).as_bytes());
        }
    }

    /// Either digest, for the same checks.
    trait Fed {
        fn feed(&mut self, bytes: &[u8]);
        fn so_far(&mut self) -> String;
    }

    impl Fed for StreamDigest {
        fn feed(&mut self, bytes: &[u8]) {
            self.update(bytes);
        }
        fn so_far(&mut self) -> String {
            self.hex()
        }
    }

    impl Fed for TreeDigest {
        fn feed(&mut self, bytes: &[u8]) {
            self.update(bytes);
        }
        fn so_far(&mut self) -> String {
            self.hex()
        }
    }

    /// Feeds `data` cut after each of `cuts` (then the rest), checking the digest of every
    /// prefix fed against BLAKE3's of it.
    fn fed_in_cuts(d: &mut impl Fed, data: &[u8], cuts: &[usize]) -> Result<(), TestCaseError> {
        let mut at = 0;
        for &cut in cuts.iter().chain([&data.len()]) {
            let end = (at + cut).min(data.len());
            d.feed(&data[at..end]);
            prop_assert_eq!(d.so_far(), StreamDigest::of(&data[..end]));
            at = end;
        }
        Ok(())
    }

    /// A digest asked for hashes the queued spans itself: helpers that never get to them (on
    /// a host whose CPUs are busy) do not hold it up, nor does one whose hashing panicked and
    /// gave its span back unhashed.
    #[test]
    fn a_digest_asked_for_does_not_wait_for_queued_spans() {
        let data: Vec<u8> = (0..40 * blake3::CHUNK_LEN + 5)
            .map(|i| u8::try_from(i * 7 % 253).expect("below 253"))
            .collect();
        let (helpers, done) = Helpers::queue();
        let queue = helpers.queued.clone();
        let (digested, digest) = std::sync::mpsc::channel();
        let fed = data.clone();
        std::thread::spawn(move || {
            let mut d = TreeDigest::with_queue(Some(helpers), blake3::CHUNK_LEN);
            d.update(&fed[..5000]);
            // The one helper takes the first span and gives it back unhashed, as after a
            // panic; the rest stay queued or are hashed here as the queue is full.
            let first = queue.recv().expect("a span is queued");
            assert_eq!(first.index, 0);
            done.send(Hashed {
                value: None,
                span: first,
            })
            .expect("the digest waits");
            d.update(&fed[5000..]);
            digested.send(d.bytes()).expect("the test waits");
        });
        let digest = digest
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the digest is done without the helpers (a timeout: it waited for them)");
        assert_eq!(digest, *blake3::hash(&data).as_bytes());
    }

    /// At the real span length: streams of exactly one and two spans, one byte either side of
    /// them, and several spans with a short last one; fed in pieces of a page and more.
    #[test]
    fn real_spans_give_blake3_of_the_whole() {
        let data: Vec<u8> = (0..5 * SPAN + 7)
            .map(|i| u8::try_from(i * 31 % 251).expect("below 251"))
            .collect();
        for len in [
            0,
            1,
            SPAN - 1,
            SPAN,
            SPAN + 1,
            2 * SPAN,
            2 * SPAN + 1,
            3 * SPAN,
            data.len(),
        ] {
            for helpers in [0, 1, 3] {
                let mut d = TreeDigest::with(helpers, SPAN);
                for piece in data[..len].chunks(4096 + 13) {
                    d.update(piece);
                }
                assert_eq!(
                    d.bytes(),
                    *blake3::hash(&data[..len]).as_bytes(),
                    "{len} bytes"
                );
            }
        }
    }
}
