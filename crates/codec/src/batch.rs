//! zstd over a batch of records. The records already lost what the dictionary could remove;
//! zstd takes what is left inside the pages (text, repeated structures).
//!
//! Batch format: one byte (0 stored, 1 zstd), the uncompressed length as a varint, the body.
//! A batch that zstd does not shrink is stored, so incompressible data costs a few bytes.

use crate::{varint, CodecError};

const STORED: u8 = 0;
const ZSTD: u8 = 1;

/// Largest batch a compressor takes; each decoder accepts at most what its own sender can make
/// (see [`BatchDecompressor::new`]).
pub const MAX_BATCH: usize = 64 << 20;

/// Appends `records` as one batch to `out`, compressed at `level` (`None`: stored). One-off
/// use; a stream of batches goes through a [`BatchCompressor`].
pub fn compress_batch(records: &[u8], level: Option<i32>, out: &mut Vec<u8>) {
    BatchCompressor::default().compress(records, level, out);
}

/// The records of one whole batch (as [`compress_batch`] wrote it). One-off use; a stream of
/// batches goes through a [`BatchDecompressor`].
pub fn decompress_batch(batch: &[u8]) -> Result<Vec<u8>, CodecError> {
    BatchDecompressor::new(MAX_BATCH)
        .decompress(batch)
        .map(<[u8]>::to_vec)
}

/// Compresses batch after batch with one zstd context and one scratch buffer. A fresh context
/// and output buffer per batch allocated their tables and pages anew each time, and at a
/// gigabit the kernel zeroing those fresh pages cost more CPU than zstd itself (perf:
/// `clear_page_erms` above every codec function).
#[derive(Default)]
pub struct BatchCompressor {
    /// Created on first use, at the level it was last set to.
    context: Option<(zstd::bulk::Compressor<'static>, i32)>,
    packed: Vec<u8>,
}

impl std::fmt::Debug for BatchCompressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchCompressor")
            .field("level", &self.context.as_ref().map(|(_, l)| *l))
            .finish_non_exhaustive()
    }
}

impl BatchCompressor {
    /// Appends `records` as one batch to `out`, compressed at `level` (`None`: stored).
    pub fn compress(&mut self, records: &[u8], level: Option<i32>, out: &mut Vec<u8>) {
        assert!(records.len() <= MAX_BATCH, "batch over {MAX_BATCH} bytes");
        if let Some(level) = level {
            if let Some(packed) = self.zstd(records, level) {
                if packed.len() < records.len() {
                    out.push(ZSTD);
                    varint::put(out, records.len() as u64);
                    out.extend_from_slice(packed);
                    return;
                }
            }
        }
        out.push(STORED);
        varint::put(out, records.len() as u64);
        out.extend_from_slice(records);
    }

    /// `records` compressed at `level`, or `None` if zstd failed (the batch then goes stored).
    fn zstd(&mut self, records: &[u8], level: i32) -> Option<&[u8]> {
        let context = match &mut self.context {
            Some((context, current)) => {
                if *current != level {
                    context.set_compression_level(level).ok()?;
                    *current = level;
                }
                context
            }
            None => {
                let context = zstd::bulk::Compressor::new(level).ok()?;
                &mut self.context.insert((context, level)).0
            }
        };
        self.packed.clear();
        self.packed
            .reserve(zstd::zstd_safe::compress_bound(records.len()));
        context.compress_to_buffer(records, &mut self.packed).ok()?;
        Some(&self.packed)
    }
}

/// Decompresses batch after batch with one zstd context and one buffer for the records (see
/// [`BatchCompressor`] for why).
pub struct BatchDecompressor {
    context: Option<zstd::bulk::Decompressor<'static>>,
    records: Vec<u8>,
    max_len: usize,
}

impl std::fmt::Debug for BatchDecompressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchDecompressor").finish_non_exhaustive()
    }
}

impl BatchDecompressor {
    /// A decompressor refusing batches that announce more than `max_len` bytes of records
    /// (at most [`MAX_BATCH`]): the most its sender makes, so that a peer's header cannot make
    /// it hold more.
    pub fn new(max_len: usize) -> BatchDecompressor {
        BatchDecompressor {
            context: None,
            records: Vec::new(),
            max_len: max_len.min(MAX_BATCH),
        }
    }

    /// The records of one whole batch (as [`BatchCompressor::compress`] wrote it), valid until
    /// the next call.
    pub fn decompress<'a>(&'a mut self, mut batch: &'a [u8]) -> Result<&'a [u8], CodecError> {
        let (&kind, rest) = batch
            .split_first()
            .ok_or(CodecError::Truncated("batch header"))?;
        batch = rest;
        let announced = varint::get(&mut batch)?;
        let len = usize::try_from(announced)
            .ok()
            .filter(|&l| l <= self.max_len)
            .ok_or_else(|| {
                CodecError::BadBatch(format!(
                    "{announced} bytes announced, more than the {} this channel's batches hold",
                    self.max_len
                ))
            })?;
        let records = match kind {
            STORED => batch,
            ZSTD => {
                let zstd_error = |e: std::io::Error| CodecError::BadBatch(format!("zstd: {e}"));
                let context = match &mut self.context {
                    Some(context) => context,
                    None => self
                        .context
                        .insert(zstd::bulk::Decompressor::new().map_err(zstd_error)?),
                };
                self.records.clear();
                self.records.reserve(len);
                context
                    .decompress_to_buffer(batch, &mut self.records)
                    .map_err(zstd_error)?;
                &self.records[..]
            }
            other => return Err(CodecError::BadBatch(format!("unknown kind {other}"))),
        };
        if records.len() != len {
            return Err(CodecError::BadBatch(format!(
                "{} bytes where the header says {len}",
                records.len()
            )));
        }
        Ok(records)
    }
}

/// Picks the zstd level from what the link carries, what the CPU manages and what each level
/// saves: the strongest level that compresses faster than the link can take compressed bytes,
/// with room to spare (its measured speed divided by a margin), so compression does not become
/// the bottleneck (speeds are per second of the thread's CPU: on cores the thread shares, it
/// gets less than that, and the margin is what absorbs it), and that sends at least [`MIN_LEVEL_GAIN`] fewer bytes than the best level
/// below it, so CPU taken from the guest buys something. When even the fastest level cannot
/// keep up, it is still used if it moves more of QEMU's bytes than sending them stored would;
/// otherwise batches go stored.
///
/// Speeds are per level (input bytes per CPU second); the compression ratio is one figure for
/// the data, whatever level measured it, because it depends far more on the pages than on the
/// level. What a level gains is measured against the fastest level on the same batch (the
/// caller compresses a batch twice when [`LevelChooser::probe_level`] asks): data near its
/// entropy limit gains nothing from level 9 at a seventh of level 1's speed, text gains
/// several percent. Every level is compared with the fastest, not with the one just below,
/// because gains do not grow in step: on mostly-zero pages level 3 sent up to 11% more than
/// level 1 on a batch where level 6 saved up to 30% more than level 3, and a chooser that
/// stopped at the first level not worth it never tried level 6. The chooser itself is arithmetic: the caller measures and reports.
#[derive(Debug, Clone)]
pub struct LevelChooser {
    /// From fastest to strongest.
    levels: Vec<i32>,
    /// Input bytes per CPU second per level, averaged over recent batches.
    speed: Vec<Option<f64>>,
    /// Per level, the share of bytes it saves over the fastest level on the same batch,
    /// averaged over recent probes (the fastest's is 0 and never measured).
    gain: Vec<Option<f64>>,
    /// Per level, batches chosen at it since its gain was last measured.
    since_probe: Vec<u32>,
    /// Per level, choices that passed it over for its gain since it was last tried.
    held: Vec<u32>,
    /// Per level, how many of those it waits before it is tried again: [`RETRY_AFTER`],
    /// doubled by every retry up to [`RETRY_AFTER_MAX`], and back to the first once the level
    /// is chosen on its merits.
    retry_after: Vec<u32>,
    /// Output over input of recent batches.
    ratio: Option<f64>,
    /// A level must compress this many times faster than needed.
    margin: f64,
}

/// A stronger zstd level is used only if it sends at least this share fewer bytes than the
/// best level below it.
pub const MIN_LEVEL_GAIN: f64 = 0.02;
/// A level's gain is measured again after this many batches at it. Measuring costs one
/// compression at the fastest level, a half to a seventh of the level measured, and a level
/// chosen on a batch that compressed well stops soon after the pages turn back to ones it
/// gains nothing on (at 16, level 9 coded up to 57 batches of the `delta` guest's first pass
/// for 5% more bytes than level 1).
const PROBE_EVERY: u32 = 4;
/// A level passed over for its gain is tried again after this many batches, in case the data
/// changed: a migration's first pass moves from one kind of memory to another within a few
/// dozen batches (after 64, the zero-heavy guest sent 5% more than with level 6 throughout).
const RETRY_AFTER: u32 = 16;
/// The longest wait between two retries of a level that keeps not being worth it: each retry
/// codes a whole batch at that level, and level 9 costs seven times level 1's CPU.
const RETRY_AFTER_MAX: u32 = 256;

impl Default for LevelChooser {
    fn default() -> Self {
        LevelChooser::new(vec![1, 3, 6, 9], 2.0)
    }
}

impl LevelChooser {
    /// `levels` from fastest to strongest.
    pub fn new(levels: Vec<i32>, margin: f64) -> LevelChooser {
        assert!(!levels.is_empty(), "at least one level");
        let n = levels.len();
        LevelChooser {
            levels,
            speed: vec![None; n],
            gain: vec![None; n],
            since_probe: vec![0; n],
            held: vec![0; n],
            retry_after: vec![RETRY_AFTER; n],
            ratio: None,
            margin,
        }
    }

    /// The level to compress a batch coded at `level` with as well, to measure what `level`
    /// gains over it (the fastest); `None` when that was measured recently (or `level` is the
    /// fastest). Counts the batch.
    pub fn probe_level(&mut self, level: i32) -> Option<i32> {
        let i = self.levels.iter().position(|&l| l == level)?;
        if i == 0 {
            return None;
        }
        self.since_probe[i] = self.since_probe[i].saturating_add(1);
        let due = self.gain[i].is_none() || self.since_probe[i] >= PROBE_EVERY;
        due.then(|| {
            self.since_probe[i] = 0;
            self.levels[0]
        })
    }

    /// Records that on one batch `level` produced `bytes_out` where the fastest level
    /// produced `bytes_out_fastest`.
    pub fn observe_gain(&mut self, level: i32, bytes_out: usize, bytes_out_fastest: usize) {
        let Some(i) = self.levels.iter().position(|&l| l == level) else {
            return;
        };
        if bytes_out_fastest == 0 || i == 0 {
            return;
        }
        let now = 1.0 - bytes_out as f64 / bytes_out_fastest as f64;
        self.gain[i] = Some(self.gain[i].map_or(now, |g| 0.5 * g + 0.5 * now));
    }

    /// What `level` saved over the fastest level, as last measured.
    pub fn gain(&self, level: i32) -> Option<f64> {
        let i = self.levels.iter().position(|&l| l == level)?;
        self.gain[i]
    }

    /// The fastest level (to measure again after the chooser found none worth it).
    pub fn fastest(&self) -> i32 {
        self.levels[0]
    }

    /// Records that `level` turned `bytes_in` into `bytes_out` in `cpu_seconds`.
    pub fn observe(&mut self, level: i32, bytes_in: usize, bytes_out: usize, cpu_seconds: f64) {
        if cpu_seconds <= 0.0 || bytes_in == 0 {
            return;
        }
        let ewma = |old: Option<f64>, now: f64| Some(old.map_or(now, |o| 0.8 * o + 0.2 * now));
        let ratio = (bytes_out as f64 / bytes_in as f64).min(1.0);
        self.ratio = ewma(self.ratio, ratio);
        if let Some(i) = self.levels.iter().position(|&l| l == level) {
            self.speed[i] = ewma(self.speed[i], bytes_in as f64 / cpu_seconds);
        }
    }

    /// The level for the next batch on a link carrying `link_bytes_per_s` (`None`: send it
    /// stored). A level never measured is tried once the levels below it keep up, so the
    /// chooser climbs as far as the CPU allows, and stays at the strongest level the gains
    /// justify.
    pub fn choose(&mut self, link_bytes_per_s: f64) -> Option<i32> {
        // QEMU bytes per second the link carries once compressed.
        let need = link_bytes_per_s / self.ratio.unwrap_or(1.0).max(1e-3);
        let mut best = None;
        // What the best level so far saves over the fastest.
        let mut best_gain = 0.0_f64;
        let mut retry = None;
        // Data that barely compresses gains nothing from stronger levels: stay at the fastest.
        let n = if self.ratio.is_some_and(|r| r >= 0.95) {
            1
        } else {
            self.levels.len()
        };
        for i in 0..n {
            let level = self.levels[i];
            match self.speed[i] {
                None => return Some(level),
                Some(s) if s / self.margin < need => break,
                Some(_) => {}
            }
            let gain = self.gain[i].filter(|_| i > 0);
            match gain {
                Some(g) if 1.0 - (1.0 - g) / (1.0 - best_gain).max(1e-9) < MIN_LEVEL_GAIN => {
                    // Fast enough, but not worth its CPU over the best level below as last
                    // measured; now and then tried again in case the data changed. Its gain
                    // stays as measured until the retry's probe updates it.
                    self.held[i] += 1;
                    if retry.is_none() && self.held[i] >= self.retry_after[i] {
                        retry = Some(i);
                    }
                }
                _ => {
                    best = Some(level);
                    best_gain = gain.unwrap_or(best_gain);
                    self.retry_after[i] = RETRY_AFTER;
                }
            }
        }
        if let Some(i) = retry {
            self.held[i] = 0;
            self.retry_after[i] = (2 * self.retry_after[i]).min(RETRY_AFTER_MAX);
            self.since_probe[i] = PROBE_EVERY;
            return Some(self.levels[i]);
        }
        if best.is_none() && self.ratio.is_some_and(|r| r < 0.95) {
            // Nothing keeps up with room to spare: the fastest level at full speed still beats
            // sending stored if it takes in more than the link carries raw.
            let fastest = self.speed[0].unwrap_or(0.0);
            if fastest > 1.2 * link_bytes_per_s {
                best = Some(self.levels[0]);
            }
        }
        best
    }
}

/// Batches smaller than this (flushed early because there was nothing more to read) do not
/// count in the speed measurement: a call's fixed cost dominates them.
const MEASURE_BYTES: usize = 64 << 10;
/// When no zstd level kept up with the link, the fastest one is tried again after this many
/// batches (the CPU may have been busy only for a moment).
const REPROBE_BATCHES: u32 = 32;

/// zstd at the level the link, the CPU and the data call for: a [`BatchCompressor`] whose
/// [`LevelChooser`] it measures for, batch by batch, compressing a batch twice when the
/// chooser asks what a level gains over the one below.
#[derive(Debug)]
pub struct AdaptiveCompressor {
    compressor: BatchCompressor,
    levels: LevelChooser,
    /// `None`: zstd is off, every batch goes stored.
    link_bytes_per_s: Option<f64>,
    /// Every batch at this level, nothing measured.
    fixed: Option<i32>,
    /// Batches sent stored since zstd last ran.
    batches_without_zstd: u32,
    /// The records compressed at a second level, to measure what the first gains.
    probe: Vec<u8>,
}

/// How one batch was compressed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Compressed {
    /// `None`: stored.
    pub level: Option<i32>,
    /// Its bytes, as appended.
    pub len: usize,
    /// CPU time of the compression that was sent (not of a probe).
    pub seconds: f64,
}

impl AdaptiveCompressor {
    /// For a link carrying `link_bytes_per_s`.
    pub fn new(link_bytes_per_s: f64) -> AdaptiveCompressor {
        AdaptiveCompressor {
            compressor: BatchCompressor::default(),
            levels: LevelChooser::default(),
            link_bytes_per_s: Some(link_bytes_per_s),
            fixed: None,
            batches_without_zstd: 0,
            probe: Vec::new(),
        }
    }

    /// Every batch at `level`.
    pub fn fixed(level: i32) -> AdaptiveCompressor {
        AdaptiveCompressor {
            fixed: Some(level),
            ..AdaptiveCompressor::new(0.0)
        }
    }

    /// Every batch stored.
    pub fn off() -> AdaptiveCompressor {
        AdaptiveCompressor {
            link_bytes_per_s: None,
            ..AdaptiveCompressor::new(0.0)
        }
    }

    /// Appends `records` as one batch to `out`.
    pub fn compress(&mut self, records: &[u8], out: &mut Vec<u8>) -> Compressed {
        let level = self.next_level();
        let start = out.len();
        let started = thread_cpu_seconds();
        self.compressor.compress(records, level, out);
        let seconds = thread_cpu_seconds() - started;
        let len = out.len() - start;
        if let Some(level) =
            level.filter(|_| self.fixed.is_none() && records.len() >= MEASURE_BYTES)
        {
            self.levels.observe(level, records.len(), len, seconds);
            self.measure_gain(level, records, len);
        }
        Compressed {
            level,
            len,
            seconds,
        }
    }

    /// What `level` saved over the fastest level, as last measured.
    pub fn gain(&self, level: i32) -> Option<f64> {
        self.levels.gain(level)
    }

    /// The level for the next batch: the chooser's, or the fastest one now and then when the
    /// chooser found none fast enough, to measure again.
    fn next_level(&mut self) -> Option<i32> {
        if self.fixed.is_some() {
            return self.fixed;
        }
        let link = self.link_bytes_per_s?;
        let level = self.levels.choose(link);
        if level.is_some() {
            self.batches_without_zstd = 0;
            return level;
        }
        self.batches_without_zstd += 1;
        (self.batches_without_zstd >= REPROBE_BATCHES).then(|| {
            self.batches_without_zstd = 0;
            self.levels.fastest()
        })
    }

    /// Compresses `records` again at the fastest level, when the chooser asks.
    fn measure_gain(&mut self, level: i32, records: &[u8], len: usize) {
        let Some(fastest) = self.levels.probe_level(level) else {
            return;
        };
        let started = thread_cpu_seconds();
        self.probe.clear();
        self.compressor
            .compress(records, Some(fastest), &mut self.probe);
        let seconds = thread_cpu_seconds() - started;
        self.levels
            .observe(fastest, records.len(), self.probe.len(), seconds);
        self.levels.observe_gain(level, len, self.probe.len());
    }
}

/// The CPU time this thread has run, in seconds. zstd's speed is what a level costs in CPU,
/// not how long its call took: on cores shared with the guest and the other threads, the
/// wall clock also counts the time the thread waited for a core. Timed that way, level 1
/// looked slower than the link while the block cache was paused and up to an eighth of a
/// migration's records went stored, for up to 1.18x the bytes.
fn thread_cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threads_cpu_clock_stands_still_while_it_sleeps_and_runs_while_it_works() {
        let before = thread_cpu_seconds();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let slept = thread_cpu_seconds() - before;
        assert!(slept < 0.05, "a sleeping thread ran {slept} s");
        // Working, it runs: at least a tenth of the wall time even on a busy machine.
        let before = thread_cpu_seconds();
        let wall = std::time::Instant::now();
        let mut x = 0u64;
        while wall.elapsed() < std::time::Duration::from_millis(100) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let ran = thread_cpu_seconds() - before;
        assert!(
            ran > 0.01,
            "a busy thread ran {ran} s in 100 ms ({x} turns)"
        );
    }

    #[test]
    fn compressible_batches_shrink_and_come_back() {
        let records: Vec<u8> = b"the same words again and again "
            .iter()
            .copied()
            .cycle()
            .take(64 << 10)
            .collect();
        let mut out = Vec::new();
        compress_batch(&records, Some(3), &mut out);
        assert!(out.len() < records.len() / 10);
        assert_eq!(decompress_batch(&out).unwrap(), records);
    }

    #[test]
    fn incompressible_batches_are_stored() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let records: Vec<u8> = (0..10_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect();
        let mut out = Vec::new();
        compress_batch(&records, Some(3), &mut out);
        assert_eq!(out[0], STORED);
        assert!(out.len() <= records.len() + 4);
        assert_eq!(decompress_batch(&out).unwrap(), records);
    }

    #[test]
    fn damaged_batches_are_errors() {
        let mut out = Vec::new();
        compress_batch(&[7u8; 5000], Some(1), &mut out);
        assert!(decompress_batch(&out[..out.len() - 3]).is_err());
        assert!(decompress_batch(&[9, 1, 0]).is_err());
        assert!(decompress_batch(&[]).is_err());
        let mut huge = vec![STORED];
        varint::put(&mut huge, u64::MAX);
        assert!(decompress_batch(&huge).is_err());
    }

    #[test]
    fn a_batch_announcing_more_than_its_channel_holds_is_refused_before_it_is_inflated() {
        // 4 MiB of zeros shrink to a few hundred bytes: the header, not the input, says what
        // the records would take.
        let mut batch = Vec::new();
        compress_batch(&vec![0u8; 4 << 20], Some(3), &mut batch);
        assert!(batch.len() < 1000);
        let err = BatchDecompressor::new(1 << 20)
            .decompress(&batch)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "malformed batch: 4194304 bytes announced, more than the 1048576 this channel's batches hold"
        );
        assert_eq!(
            BatchDecompressor::new(4 << 20)
                .decompress(&batch)
                .unwrap()
                .len(),
            4 << 20
        );
    }

    #[test]
    fn one_context_carries_batches_of_every_size_and_level() {
        let mut compressor = BatchCompressor::default();
        let mut decompressor = BatchDecompressor::new(MAX_BATCH);
        let text = b"pages of a guest, mostly alike but not quite ";
        for (i, level) in [Some(1), Some(3), None, Some(9), Some(1), Some(6)]
            .into_iter()
            .enumerate()
        {
            // Sizes go up and down so a context sized for a big batch meets a small one.
            let len = [200_000, 3, 1 << 20, 70_000, 0, 500_000][i];
            let records: Vec<u8> = text.iter().copied().cycle().skip(i).take(len).collect();
            let mut out = vec![0xee];
            compressor.compress(&records, level, &mut out);
            assert_eq!(out[0], 0xee, "appends after what `out` held");
            if level.is_some() && len > 1000 {
                assert_eq!(out[1], ZSTD, "batch {i}");
            }
            assert_eq!(decompressor.decompress(&out[1..]).unwrap(), &records[..]);
        }
        // A batch that says fewer bytes than its zstd frame holds is refused, not truncated.
        let mut out = Vec::new();
        compressor.compress(&[5u8; 9000], Some(1), &mut out);
        let mut lying = vec![ZSTD];
        varint::put(&mut lying, 4000);
        let mut body = &out[1..];
        varint::get(&mut body).unwrap();
        lying.extend_from_slice(body);
        assert!(decompressor.decompress(&lying).is_err());
        assert!(
            decompressor.decompress(&out).is_ok(),
            "usable after an error"
        );
    }

    #[test]
    fn the_chooser_climbs_while_compression_keeps_ahead_of_the_link() {
        let mut c = LevelChooser::default();
        let slow = 12.5e6; // 100 Mbit/s: 25 MB/s of QEMU bytes at 2:1
        assert_eq!(c.choose(slow), Some(1), "start at the fastest level");
        c.observe(1, 400_000_000, 200_000_000, 1.0);
        assert_eq!(c.choose(slow), Some(3), "keeps up with room: try the next");
        c.observe(3, 150_000_000, 70_000_000, 1.0);
        assert_eq!(c.choose(slow), Some(6));
        c.observe(6, 40_000_000, 19_000_000, 1.0);
        assert_eq!(c.choose(slow), Some(3), "6 is too slow for this link");
        // 1 Gbit/s: level 1 is not three times ahead, but still moves more than stored.
        assert_eq!(c.choose(125e6), Some(1));
        assert_eq!(
            c.choose(10e9 / 8.0),
            None,
            "nothing keeps up with 10 Gbit/s"
        );
        // Incompressible data: no level is worth it once the link outruns the CPU's margin.
        let mut c = LevelChooser::default();
        c.observe(1, 400_000_000, 400_000_000, 1.0);
        assert_eq!(c.choose(250e6), None);
        assert_eq!(
            c.choose(slow),
            Some(1),
            "no climbing on data that does not compress"
        );
    }

    #[test]
    fn a_stronger_level_is_used_only_while_it_saves_enough_over_the_best_below() {
        let mut c = LevelChooser::default();
        let slow = 12.5e6;
        c.observe(1, 400_000_000, 200_000_000, 1.0);
        assert_eq!(c.choose(slow), Some(3), "fast enough: try the next");
        assert_eq!(
            c.probe_level(3),
            Some(1),
            "its first batch is coded at the fastest level too"
        );
        c.observe(3, 300_000_000, 150_000_000, 1.0);
        // Level 3 sends 2% more bytes than level 1 (mostly-zero pages do this).
        c.observe_gain(3, 1_020_000, 1_000_000);
        assert!((c.gain(3).unwrap() + 0.02).abs() < 1e-9);
        assert_eq!(
            c.choose(slow),
            Some(6),
            "a level not worth it does not stop the climb"
        );
        assert_eq!(c.probe_level(6), Some(1), "compared with the fastest");
        c.observe(6, 100_000_000, 50_000_000, 1.0);
        c.observe_gain(6, 700_000, 1_000_000);
        assert_eq!(c.choose(slow), Some(9), "6 saves 30%: try the next");
        // Level 9 saves 31% over level 1: barely 1.4% over level 6.
        c.observe(9, 100_000_000, 50_000_000, 1.0);
        c.observe_gain(9, 690_000, 1_000_000);
        // Two choices were made with level 3 held (the tries of 6 and 9).
        for _ in 0..RETRY_AFTER - 3 {
            assert_eq!(c.choose(slow), Some(6));
        }
        assert_eq!(
            c.choose(slow),
            Some(3),
            "tried again in case the data changed"
        );
        assert_eq!(c.probe_level(3), Some(1), "a retry is measured");
        // A retry that finds it still not worth it doubles the wait before the next one.
        c.observe_gain(3, 1_020_000, 1_000_000);
        assert_eq!(c.choose(slow), Some(6));
        assert_eq!(
            c.choose(slow),
            Some(9),
            "level 9, held from one batch later, is retried one batch later"
        );
        // Level 3 was held in the last two choices already.
        let next = (0..2 * RETRY_AFTER)
            .map(|_| c.choose(slow).unwrap())
            .position(|l| l == 3)
            .expect("retried again");
        assert_eq!(next, 2 * RETRY_AFTER as usize - 3, "after twice the wait");
        // The data changed: level 3 saves 10% over level 1, level 6 still 30%.
        c.observe_gain(3, 800_000, 1_000_000);
        assert!((c.gain(3).unwrap() - 0.09).abs() < 1e-9);
        assert_eq!(c.choose(slow), Some(6), "6 still saves enough over 3");
        // A level's gain is measured again every PROBE_EVERY batches, not on every one.
        let probes = (0..3 * PROBE_EVERY)
            .filter(|_| c.probe_level(6).is_some())
            .count();
        assert_eq!(probes, 3);
        assert_eq!(
            c.probe_level(1),
            None,
            "nothing to compare the fastest with"
        );
        assert_eq!(c.probe_level(4), None, "not a level of this chooser");
    }

    /// Random nibbles in printable bytes: 4 bits of entropy per byte, no repetition, so every
    /// level halves them and no stronger level does better (the lab guest's pages).
    fn entropy_limited(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                0x60 | (x.to_le_bytes()[0] & 0x0f)
            })
            .collect()
    }

    #[test]
    fn on_pages_no_level_improves_the_compressor_stays_at_the_fastest() {
        // A slow link, so that every level keeps up even in an unoptimized build.
        let mut zstd = AdaptiveCompressor::new(1e6);
        let mut decompressor = BatchDecompressor::new(MAX_BATCH);
        let mut levels = Vec::new();
        for i in 0..40 {
            let records = entropy_limited(256 << 10, i + 1);
            let mut out = Vec::new();
            let c = zstd.compress(&records, &mut out);
            assert_eq!(c.len, out.len());
            assert_eq!(decompressor.decompress(&out).unwrap(), &records[..]);
            levels.push(c.level.unwrap());
        }
        let gain = zstd.gain(3).expect("level 3 was tried and compared");
        assert!(gain < MIN_LEVEL_GAIN, "level 3 gained {gain}");
        assert_eq!(levels[..2], [1, 3], "fast enough for the link: tried");
        // Each level above is tried once (level 9 only if it is fast enough in this build),
        // then retried once after RETRY_AFTER batches; the rest go at level 1.
        let tried = levels[2..].iter().take_while(|&&l| l != 1).count();
        let retries = levels[2 + tried..].iter().filter(|&&l| l != 1).count();
        assert!(tried <= 2 && retries <= 3, "{levels:?}");
        assert!(
            levels[levels.len() - 10..].iter().all(|&l| l == 1),
            "{levels:?}"
        );
        // Off: everything stored, no level.
        let mut out = Vec::new();
        let c = AdaptiveCompressor::off().compress(&entropy_limited(1 << 16, 9), &mut out);
        assert_eq!((c.level, out[0]), (None, STORED));
    }

    #[test]
    fn small_batches_between_large_ones_do_not_stop_the_measuring() {
        let mut zstd = AdaptiveCompressor::new(1e6);
        let mut seen = Vec::new();
        for i in 0..200u64 {
            let len = if i % 3 == 2 { 4 << 10 } else { 256 << 10 };
            let mut out = Vec::new();
            let c = zstd.compress(&entropy_limited(len, i + 1), &mut out);
            seen.push((c.level.unwrap(), len));
        }
        assert!(zstd.gain(3).is_some_and(|g| g < MIN_LEVEL_GAIN), "{seen:?}");
        let at_1 = seen.iter().filter(|&&(l, _)| l == 1).count();
        assert!(at_1 >= 180, "{seen:?}");
    }

    #[test]
    fn a_fixed_compressor_keeps_its_level_and_measures_nothing() {
        let mut zstd = AdaptiveCompressor::fixed(3);
        for i in 0..20 {
            let mut out = Vec::new();
            let c = zstd.compress(&entropy_limited(256 << 10, i + 1), &mut out);
            assert_eq!(c.level, Some(3));
        }
        assert_eq!(zstd.gain(3), None, "no level compared");
    }
}
