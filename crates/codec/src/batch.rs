//! zstd over a batch of records. The records already lost what the dictionary could remove;
//! zstd takes what is left inside the pages (text, repeated structures).
//!
//! Batch format: one byte (0 stored, 1 zstd), the uncompressed length as a varint, the body.
//! A batch that zstd does not shrink is stored, so incompressible data costs a few bytes.

use crate::{varint, CodecError};

const STORED: u8 = 0;
const ZSTD: u8 = 1;

/// Largest batch a decoder accepts: bounds the memory a damaged length can ask for.
pub const MAX_BATCH: usize = 64 << 20;

/// Appends `records` as one batch to `out`, compressed at `level` (`None`: stored).
pub fn compress_batch(records: &[u8], level: Option<i32>, out: &mut Vec<u8>) {
    assert!(records.len() <= MAX_BATCH, "batch over {MAX_BATCH} bytes");
    if let Some(level) = level {
        if let Ok(packed) = zstd::bulk::compress(records, level) {
            if packed.len() < records.len() {
                out.push(ZSTD);
                varint::put(out, records.len() as u64);
                out.extend_from_slice(&packed);
                return;
            }
        }
    }
    out.push(STORED);
    varint::put(out, records.len() as u64);
    out.extend_from_slice(records);
}

/// The records of one whole batch (as [`compress_batch`] wrote it).
pub fn decompress_batch(mut batch: &[u8]) -> Result<Vec<u8>, CodecError> {
    let (&kind, rest) = batch
        .split_first()
        .ok_or(CodecError::Truncated("batch header"))?;
    batch = rest;
    let len = usize::try_from(varint::get(&mut batch)?)
        .ok()
        .filter(|&l| l <= MAX_BATCH)
        .ok_or_else(|| CodecError::BadBatch("length over the limit".into()))?;
    let records = match kind {
        STORED => batch.to_vec(),
        ZSTD => zstd::bulk::decompress(batch, len)
            .map_err(|e| CodecError::BadBatch(format!("zstd: {e}")))?,
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

/// Picks the zstd level from what the link carries and what the CPU manages: the highest
/// level whose measured compression speed still keeps ahead of the link (with a margin), so
/// compression never becomes the bottleneck, and none when even the fastest level cannot.
///
/// Speeds are fed in by the caller (bytes in per second of CPU at each level, measured on the
/// migration's own batches); the chooser itself is arithmetic.
#[derive(Debug, Clone)]
pub struct LevelChooser {
    levels: Vec<i32>,
    /// Input bytes per CPU second, per level (an average of the latest measurements).
    speed: Vec<Option<f64>>,
    /// Input must compress at least this many times faster than the link carries it.
    margin: f64,
}

impl Default for LevelChooser {
    fn default() -> Self {
        LevelChooser::new(vec![1, 3, 6, 9], 2.0)
    }
}

impl LevelChooser {
    pub fn new(levels: Vec<i32>, margin: f64) -> LevelChooser {
        let speed = vec![None; levels.len()];
        LevelChooser {
            levels,
            speed,
            margin,
        }
    }

    /// The fastest level (to measure again after the chooser found none fast enough).
    pub fn fastest(&self) -> i32 {
        self.levels[0]
    }

    /// Records that `level` compressed `bytes` in `cpu_seconds`.
    pub fn observe(&mut self, level: i32, bytes: usize, cpu_seconds: f64) {
        if cpu_seconds <= 0.0 {
            return;
        }
        if let Some(i) = self.levels.iter().position(|&l| l == level) {
            let now = bytes as f64 / cpu_seconds;
            self.speed[i] = Some(self.speed[i].map_or(now, |s| 0.8 * s + 0.2 * now));
        }
    }

    /// The level for a link carrying `link_bytes_per_s`. A level never measured counts as fast
    /// enough once the level below it is comfortably so (so the chooser tries it and learns).
    pub fn choose(&self, link_bytes_per_s: f64) -> Option<i32> {
        let need = link_bytes_per_s * self.margin;
        let mut best = None;
        for (i, &level) in self.levels.iter().enumerate() {
            match self.speed[i] {
                Some(s) if s >= need => best = Some(level),
                Some(_) => break,
                None => {
                    // Untried: worth a try when the level below has twice the margin.
                    let below_fast = i == 0 || self.speed[i - 1].is_some_and(|s| s >= 2.0 * need);
                    if below_fast {
                        best = Some(level);
                    }
                    break;
                }
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
    fn the_chooser_keeps_compression_ahead_of_the_link() {
        let mut c = LevelChooser::default();
        let link = 12.5e6; // 100 Mbit/s
        assert_eq!(c.choose(link), Some(1), "start at the fastest level");
        c.observe(1, 500_000_000, 1.0);
        assert_eq!(c.choose(link), Some(3), "fast enough: try the next");
        c.observe(3, 300_000_000, 1.0);
        c.observe(6, 20_000_000, 1.0);
        assert_eq!(c.choose(link), Some(3), "6 is too slow for this link");
        assert_eq!(
            c.choose(10e9 / 8.0),
            None,
            "no level keeps up with 10 Gbit/s"
        );
    }
}
