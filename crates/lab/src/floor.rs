//! The physical floor of a migration: the zstd-compressed size of the guest's unique non-zero
//! memory at migration start, and the time that takes at the link rate. No migration can send
//! less without knowing something the destination already has.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{Read, Write};
use std::path::Path;

use anyhow::{Context, Result};

const PAGE_BYTES: usize = 4096;
/// zstd's default level: what a careful sender would use on a WAN.
const ZSTD_LEVEL: i32 = 3;

/// Floor bytes of the guest memory in `mem_file` (a shared memory backend).
pub fn floor_bytes(mem_file: &Path) -> Result<u64> {
    let mut f = std::fs::File::open(mem_file)
        .with_context(|| format!("open guest memory {}", mem_file.display()))?;
    let mut seen = HashSet::new();
    let counter = CountingWriter::default();
    let mut enc = zstd::Encoder::new(counter, ZSTD_LEVEL)?;
    let mut chunk = vec![0u8; 256 * PAGE_BYTES];
    loop {
        let n = read_full(&mut f, &mut chunk)?;
        if n == 0 {
            break;
        }
        for page in chunk[..n].chunks(PAGE_BYTES) {
            if page.iter().all(|&b| b == 0) {
                continue;
            }
            let mut h = DefaultHasher::new();
            page.hash(&mut h);
            if seen.insert(h.finish()) {
                enc.write_all(page)?;
            }
        }
    }
    Ok(enc.finish()?.0)
}

/// Percent of the pages of `before` (a copy of guest memory) that differ in `now`.
pub fn changed_pct(before: &[u8], now: &[u8]) -> f64 {
    let pages = before.len().min(now.len()) / PAGE_BYTES;
    let changed = before
        .chunks_exact(PAGE_BYTES)
        .zip(now.chunks_exact(PAGE_BYTES))
        .filter(|(a, b)| a != b)
        .count();
    100.0 * changed as f64 / pages.max(1) as f64
}

/// The time `bytes` take at `rate_mbit`.
pub fn floor_ms(bytes: u64, rate_mbit: f64) -> f64 {
    bytes as f64 * 8.0 / (rate_mbit * 1e6) * 1000.0
}

fn read_full(f: &mut impl Read, buf: &mut [u8]) -> Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let r = f.read(&mut buf[n..])?;
        if r == 0 {
            break;
        }
        n += r;
    }
    Ok(n)
}

#[derive(Default)]
struct CountingWriter(u64);

impl Write for CountingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_pct_counts_pages_that_differ() {
        let before = vec![0u8; 4 * PAGE_BYTES];
        let mut now = before.clone();
        now[PAGE_BYTES + 5] = 1;
        assert!((changed_pct(&before, &now) - 25.0).abs() < 1e-9);
        assert!(changed_pct(&before, &before).abs() < 1e-9);
    }

    #[test]
    fn zero_and_duplicate_pages_cost_nothing() {
        let dir = std::env::temp_dir().join(format!("ferry-floor-{}", std::process::id()));
        let mut mem = vec![0u8; 64 * PAGE_BYTES];
        // one distinct random-ish page, repeated 10 times; the rest zero
        let page: Vec<u8> = (0..PAGE_BYTES)
            .map(|i| u8::try_from(i * 7919 % 251).unwrap())
            .collect();
        for i in 0..10 {
            mem[i * PAGE_BYTES..(i + 1) * PAGE_BYTES].copy_from_slice(&page);
        }
        std::fs::write(&dir, &mem).unwrap();
        let once = floor_bytes(&dir).unwrap();
        std::fs::write(&dir, &mem[..PAGE_BYTES]).unwrap();
        assert_eq!(once, floor_bytes(&dir).unwrap());
        std::fs::write(&dir, vec![0u8; 8 * PAGE_BYTES]).unwrap();
        assert!(floor_bytes(&dir).unwrap() < 32);
        std::fs::remove_file(&dir).unwrap();
    }
}
