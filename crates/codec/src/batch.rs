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

/// Picks the zstd level from what the link carries and what the CPU manages: the strongest
/// level that compresses faster than the link can take compressed bytes, with room to spare
/// (its measured speed divided by a margin), so compression never becomes the bottleneck and
/// leaves the CPU to the guest. When even the fastest level cannot keep up, it is still used
/// if it moves more of QEMU's bytes than sending them stored would; otherwise batches go
/// stored.
///
/// Speeds are per level (input bytes per CPU second); the compression ratio is one figure for
/// the data, whatever level measured it, because it depends far more on the pages than on the
/// level. The chooser itself is arithmetic: the caller measures and reports.
#[derive(Debug, Clone)]
pub struct LevelChooser {
    /// From fastest to strongest.
    levels: Vec<i32>,
    /// Input bytes per CPU second per level, averaged over recent batches.
    speed: Vec<Option<f64>>,
    /// Output over input of recent batches.
    ratio: Option<f64>,
    /// A level must compress this many times faster than needed.
    margin: f64,
}

impl Default for LevelChooser {
    fn default() -> Self {
        LevelChooser::new(vec![1, 3, 6, 9], 2.0)
    }
}

impl LevelChooser {
    /// `levels` from fastest to strongest.
    pub fn new(levels: Vec<i32>, margin: f64) -> LevelChooser {
        assert!(!levels.is_empty(), "at least one level");
        let speed = vec![None; levels.len()];
        LevelChooser {
            levels,
            speed,
            ratio: None,
            margin,
        }
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
    /// stored). A level never measured is tried once the level below it keeps up, so the
    /// chooser climbs as far as the CPU allows and no further.
    pub fn choose(&self, link_bytes_per_s: f64) -> Option<i32> {
        // QEMU bytes per second the link carries once compressed.
        let need = link_bytes_per_s / self.ratio.unwrap_or(1.0).max(1e-3);
        let mut best = None;
        // Data that barely compresses gains nothing from stronger levels: stay at the fastest.
        let levels = if self.ratio.is_some_and(|r| r >= 0.95) {
            &self.levels[..1]
        } else {
            &self.levels[..]
        };
        for (i, &level) in levels.iter().enumerate() {
            match self.speed[i] {
                Some(s) if s / self.margin >= need => best = Some(level),
                Some(_) => break,
                None => return Some(level),
            }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
