//! How fast the codec encodes "typical" guest pages, per core: a mix of zero pages, text-like
//! pages, pages that repeat elsewhere, and pages rewritten in a few places (the second pass of
//! a migration). Issue 4's target: at least 1 GB/s per core.
//!
//! Each iteration makes a fresh encoder, as each migration does. Its dictionaries take the
//! buffers the previous one gave back to the process's pool, as an agent's second and later
//! migrations do; the `first` cases free the pool before each iteration, as in an agent's
//! first migration, whose dictionaries write into memory fresh from the kernel.

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use ferry_codec::{compress_batch, region, Encoder, Options, PAGE_SIZE};

const PAGES: usize = 16 * 1024; // 64 MiB

fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[3]
        })
        .collect()
}

/// Two passes over the same keys: the first pass fills the caches, the second is what later
/// iterations look like (a quarter of the pages edited in a few places).
fn memory() -> Vec<(u64, Vec<u8>)> {
    let words = b"static int do_page_fault(struct pt_regs *regs, unsigned long address) { ";
    let mut first = Vec::with_capacity(PAGES);
    for i in 0..PAGES {
        let page = match i % 8 {
            0..=2 => vec![0u8; PAGE_SIZE],
            3..=4 => {
                let mut p: Vec<u8> = words
                    .iter()
                    .copied()
                    .cycle()
                    .skip(i % 61)
                    .take(PAGE_SIZE)
                    .collect();
                p[..8].copy_from_slice(&(i as u64).to_le_bytes());
                p
            }
            5 => noise(i as u64 % 512, PAGE_SIZE), // repeats: 512 distinct noise pages
            _ => noise(i as u64 + 1_000_000, PAGE_SIZE), // unique, incompressible
        };
        first.push((i as u64, page));
    }
    let mut pages = first.clone();
    for (i, (key, page)) in first.into_iter().enumerate() {
        if i % 4 == 0 {
            let mut p = page;
            p[(i * 97) % PAGE_SIZE] ^= 0x5a;
            p[(i * 31) % PAGE_SIZE] ^= 0x11;
            pages.push((key, p));
        }
    }
    pages
}

fn encode_all(pages: &[(u64, Vec<u8>)], opts: Options, level: Option<i32>) -> usize {
    let mut enc = Encoder::new(opts);
    let mut records = Vec::with_capacity(1 << 20);
    let mut wire = Vec::with_capacity(1 << 20);
    let mut total = 0;
    for chunk in pages.chunks(64) {
        records.clear();
        for (key, page) in chunk {
            enc.encode(*key, page, &mut records);
        }
        wire.clear();
        compress_batch(&records, level, &mut wire);
        total += wire.len();
    }
    total
}

fn bench(c: &mut Criterion) {
    let pages = memory();
    let bytes = (pages.len() * PAGE_SIZE) as u64;
    let mut g = c.benchmark_group("encode");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(bytes));
    for (name, opts, level) in [
        ("none", Options::none(), None),
        ("zero+dedup+delta", Options::default(), None),
        ("all+zstd1", Options::default(), Some(1)),
        ("all+zstd3", Options::default(), Some(3)),
    ] {
        let out = encode_all(&pages, opts, level);
        eprintln!(
            "{name}: {bytes} bytes -> {out} ({:.1}%)",
            out as f64 * 100.0 / bytes as f64
        );
        g.bench_with_input(BenchmarkId::from_parameter(name), &pages, |b, p| {
            b.iter(|| encode_all(p, opts, level));
        });
    }
    for (name, opts, level) in [
        ("zero+dedup+delta, first", Options::default(), None),
        ("all+zstd1, first", Options::default(), Some(1)),
    ] {
        g.bench_with_input(BenchmarkId::from_parameter(name), &pages, |b, p| {
            b.iter_batched(
                region::release,
                |()| encode_all(p, opts, level),
                BatchSize::PerIteration,
            );
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
