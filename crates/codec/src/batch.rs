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

/// Picks the zstd level that moves the most of QEMU's bytes per second through the link,
/// from what each level was measured to do on the migration's own batches: a level delivers
/// the smaller of its compression speed (input bytes per CPU second, divided by a margin that
/// leaves the agent time for its other work) and the link's rate divided by its ratio.
/// Sending batches stored delivers the link's rate; a level is chosen only when it beats that,
/// so compression never becomes the bottleneck, and on a slow link the highest level that
/// still keeps up wins.
///
/// The chooser itself is arithmetic: the caller measures and reports.
#[derive(Debug, Clone)]
pub struct LevelChooser {
    levels: Vec<i32>,
    /// Per level: input bytes per CPU second and output/input, averaged over recent batches.
    measured: Vec<Option<Measured>>,
    /// Compression gets at most 1/margin of a CPU's speed in the estimate.
    margin: f64,
}

#[derive(Debug, Clone, Copy)]
struct Measured {
    speed: f64,
    ratio: f64,
}

impl Default for LevelChooser {
    fn default() -> Self {
        LevelChooser::new(vec![1, 3, 6, 9], 1.5)
    }
}

impl LevelChooser {
    /// `levels` from fastest to strongest.
    pub fn new(levels: Vec<i32>, margin: f64) -> LevelChooser {
        assert!(!levels.is_empty(), "at least one level");
        let measured = vec![None; levels.len()];
        LevelChooser {
            levels,
            measured,
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
        if let Some(i) = self.levels.iter().position(|&l| l == level) {
            let now = Measured {
                speed: bytes_in as f64 / cpu_seconds,
                ratio: (bytes_out as f64 / bytes_in as f64).min(1.0),
            };
            self.measured[i] = Some(self.measured[i].map_or(now, |m| Measured {
                speed: 0.8 * m.speed + 0.2 * now.speed,
                ratio: 0.8 * m.ratio + 0.2 * now.ratio,
            }));
        }
    }

    /// Input bytes per second `level`'s measurement promises through a link of
    /// `link_bytes_per_s`, and whether compression or the link limits it.
    fn delivers(&self, m: Measured, link_bytes_per_s: f64) -> (f64, bool) {
        let cpu = m.speed / self.margin;
        let link = link_bytes_per_s / m.ratio.max(1e-6);
        (cpu.min(link), link < cpu)
    }

    /// The level for the next batch on a link carrying `link_bytes_per_s` (`None`: send it
    /// stored). A level never measured is tried once the level below it compresses and is
    /// comfortably link-bound (the link, not the CPU, limits it by 2x), so the chooser climbs
    /// as far as the CPU allows and no further.
    pub fn choose(&self, link_bytes_per_s: f64) -> Option<i32> {
        let mut best = (link_bytes_per_s, None);
        for (i, &level) in self.levels.iter().enumerate() {
            let Some(m) = self.measured[i] else {
                return Some(level);
            };
            let (rate, link_bound) = self.delivers(m, link_bytes_per_s);
            if rate > best.0 {
                best = (rate, Some(level));
            }
            // Climb only while this level compresses at all and has CPU to spare.
            let room = m.speed / self.margin >= 2.0 * link_bytes_per_s / m.ratio.max(1e-6);
            if !(link_bound && room && m.ratio < 0.98) {
                break;
            }
        }
        best.1
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
    fn the_chooser_picks_the_level_that_moves_the_most() {
        let mut c = LevelChooser::default();
        let slow = 12.5e6; // 100 Mbit/s
        assert_eq!(c.choose(slow), Some(1), "start at the fastest level");
        c.observe(1, 400_000_000, 200_000_000, 1.0);
        assert_eq!(
            c.choose(slow),
            Some(3),
            "link-bound with room: try the next"
        );
        c.observe(3, 150_000_000, 66_000_000, 1.0);
        assert_eq!(c.choose(slow), Some(6), "still link-bound with room");
        c.observe(6, 30_000_000, 63_000_000 / 5 * 2, 1.0);
        // 6 compresses a little better but only 20 MB/s of CPU: 3 delivers more.
        assert_eq!(c.choose(slow), Some(3));
        // On a fast link only level 1 beats sending stored, and on a very fast one nothing.
        assert_eq!(c.choose(125e6), Some(1));
        assert_eq!(c.choose(10e9 / 8.0), None);
        // Incompressible data: no level beats sending stored.
        let mut c = LevelChooser::default();
        c.observe(1, 400_000_000, 400_000_000, 1.0);
        assert_eq!(c.choose(slow), None);
    }
}
