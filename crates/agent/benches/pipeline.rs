//! The agents' work per byte of QEMU's stream, without I/O: the source's (parse, digest, page
//! codec, zstd) and the destination's (zstd, page codec, digest, load sieve), on one thread
//! each but for the digest's spans, hashed on a helper thread as in agents on hosts of 4 cores
//! or more; and the digest alone. What is left out is the transport (TLS, sockets), which
//! `ferry bench` measures with the rest. Then the same codec in shards (the parallel
//! pipeline's, issue 19), on one thread: its bytes and CPU per S, and the serial stage it
//! cannot spread; and the source's shards on threads, as the agent runs them (wall time).
//!
//! The stream is a real QEMU 10 stream (`crates/qemu/tests/streams/running`: the setup, its
//! passes over the guest's memory and the device state) whose pages, and seven in eight of its
//! zero pages, are replaced with a mix of typical ones, as in the codec's own benchmark:
//! text-like, repeated elsewhere, incompressible; a page sent again is its last version with a
//! few bytes changed. Throughput counts QEMU's bytes.

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ferry_agent::engine::digest::{StreamDigest, TreeDigest};
use ferry_agent::engine::known_zero::ZeroPages;
use ferry_agent::engine::load_sieve::LoadSieve;
use ferry_agent::engine::pipeline::{
    Dispatcher, Route, ShardedDecoder, ShardedEncoder, SourcePipeline,
};
use ferry_agent::engine::stream_codec::{StreamDecoder, StreamEncoder, HISTORY_CAP};
use ferry_api::agent::CodecSettings;
use ferry_qemu::stream::{flag, Item, RamData, StreamParser, PAGE_SIZE};

/// The link the source's zstd level is chosen for, Mbit/s: a fast one, where level 1 keeps up.
const LINK_MBIT: f64 = 1000.0;
/// How QEMU's bytes reach the source agent, and the WAN's frames the destination.
const READ: usize = 256 << 10;
const FRAME: usize = 64 << 10;

fn noise(seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..PAGE_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[3]
        })
        .collect()
}

/// The first version of page `i`.
fn typical_page(i: u64) -> Vec<u8> {
    let words = b"static int do_page_fault(struct pt_regs *regs, unsigned long address) { ";
    match i % 8 {
        0 => vec![0; PAGE_SIZE],
        1..=3 => {
            let mut p: Vec<u8> = words
                .iter()
                .copied()
                .cycle()
                .skip(usize::try_from(i % 61).expect("small"))
                .take(PAGE_SIZE)
                .collect();
            p[..8].copy_from_slice(&i.to_le_bytes());
            p
        }
        4 => noise(i % 512), // 512 distinct pages, repeated
        _ => noise(i + 1_000_000),
    }
}

/// The captured stream with typical pages in place of the guest's.
fn stream() -> Vec<u8> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../qemu/tests/streams/running.qemu.zst"
    );
    let captured = zstd::decode_all(std::fs::File::open(path).expect(path)).expect("zstd");
    let mut parser = StreamParser::new();
    let mut input = BytesMut::from(&captured[..]);
    let mut out = BytesMut::with_capacity(captured.len());
    // Each page's current version, by the offset of its record (blocks differ in their name
    // only where QEMU names them, so the offset and the count of names seen so far will do).
    let mut pages: HashMap<(usize, u64), Vec<u8>> = HashMap::new();
    let mut block = 0usize;
    while let Some(item) = parser.next_item(&mut input).expect("a captured stream") {
        let Item::Ram(mut record) = item else {
            item.encode(&mut out);
            continue;
        };
        if record.block.is_some() {
            block += 1;
        }
        let key = (block, record.offset / PAGE_SIZE as u64);
        if matches!(record.data, RamData::Fill(_)) && !key.1.is_multiple_of(8) {
            // The tiny guest's memory is mostly zero: give it content, as a guest in use has.
            record.flags = record.flags & !flag::ZERO | flag::PAGE;
            record.data = RamData::Page(Bytes::new());
        }
        if let RamData::Page(_) = record.data {
            let page = pages
                .entry(key)
                .and_modify(|p| {
                    let at = usize::try_from(key.1 * 97).expect("small") % PAGE_SIZE;
                    p[at] ^= 0x5a;
                    p[(at * 31) % PAGE_SIZE] ^= 0x11;
                })
                .or_insert_with(|| typical_page(key.1));
            record.data = RamData::Page(Bytes::copy_from_slice(page));
        }
        record.encode(&mut out);
    }
    out.to_vec()
}

/// What the source's loop sees of QEMU's stream, read `READ` bytes at a time.
enum Read<'a> {
    /// A parsed item, and its bytes as QEMU wrote them.
    Item(&'a Item, &'a [u8]),
    /// Everything read so far was parsed: QEMU has nothing more right now.
    Drained,
}

/// Reads `stream` as the source agent reads QEMU's socket.
fn read_stream(stream: &[u8], mut each: impl FnMut(Read<'_>)) {
    let mut parser = StreamParser::new();
    let mut input = BytesMut::with_capacity(2 * READ);
    for read in stream.chunks(READ) {
        input.extend_from_slice(read);
        while let Some((item, bytes)) = parser
            .next_item_with_bytes(&mut input)
            .expect("a whole stream")
        {
            each(Read::Item(&item, &bytes));
        }
        each(Read::Drained);
    }
}

/// Feeds `channel` to `feed` in the WAN's frames; returns the QEMU bytes it gave.
fn feed_frames(channel: &[u8], mut feed: impl FnMut(&[u8], &mut BytesMut)) -> usize {
    let mut out = BytesMut::new();
    let mut fed = 0;
    for frame in channel.chunks(FRAME) {
        feed(frame, &mut out);
        fed += out.len();
        out.clear();
    }
    fed
}

/// The source agent's work: QEMU's bytes in, the stream channel's bytes out.
fn source(stream: &[u8]) -> Vec<u8> {
    let mut encoder = StreamEncoder::new(CodecSettings::ALL, HISTORY_CAP, LINK_MBIT);
    let mut digest = TreeDigest::with_helpers(1);
    let mut out = BytesMut::new();
    read_stream(stream, |read| match read {
        Read::Item(item, bytes) => {
            digest.update(bytes);
            encoder.push(item, bytes);
            if encoder.is_full() {
                encoder.flush(&mut out);
            }
        }
        Read::Drained => encoder.flush(&mut out),
    });
    digest.hex();
    out.to_vec()
}

/// The source's codec in `shards` shards, all on this thread (no digest): the cost of the
/// sharding in bytes (returned: the channel, and the order units' bytes) and in CPU.
fn sharded_source(stream: &[u8], shards: usize) -> (Vec<u8>, u64) {
    let mut encoder = ShardedEncoder::new(CodecSettings::ALL, HISTORY_CAP, LINK_MBIT, shards);
    let mut out = BytesMut::new();
    read_stream(stream, |read| match read {
        Read::Item(item, bytes) => {
            encoder.push(item, bytes);
            if encoder.is_full() {
                encoder.flush(&mut out);
            }
        }
        Read::Drained => encoder.flush(&mut out),
    });
    (out.to_vec(), encoder.order_bytes())
}

/// The source's codec in `shards` shards on `threads` threads, driven as the pump drives it
/// (a round closed where the pipeline is full and at every drain, coded rounds collected
/// without waiting, all of them at the end; no digest): wall time, so on more than one core
/// it shows what the threads gain.
fn threaded_source(
    runtime: &tokio::runtime::Runtime,
    stream: &[u8],
    shards: usize,
    threads: usize,
) -> usize {
    runtime.block_on(async {
        let encoder = ShardedEncoder::new(CodecSettings::ALL, HISTORY_CAP, LINK_MBIT, shards);
        let mut pipeline = SourcePipeline::new(encoder, threads, "bench-codec").expect("threads");
        let mut out = BytesMut::new();
        let mut parser = StreamParser::new();
        let mut input = BytesMut::with_capacity(2 * READ);
        let mut sent = 0;
        for read in stream.chunks(READ) {
            input.extend_from_slice(read);
            while let Some((item, bytes)) = parser
                .next_item_with_bytes(&mut input)
                .expect("a whole stream")
            {
                pipeline.push(&item, &bytes).await.expect("coded");
                if pipeline.is_full() {
                    pipeline.close_round(&mut out, 0).await.expect("closed");
                }
            }
            pipeline.close_round(&mut out, 0).await.expect("closed");
            pipeline.collect(&mut out, false).await.expect("collected");
            // As if sent.
            sent += out.len();
            out.clear();
        }
        pipeline.collect(&mut out, true).await.expect("collected");
        sent + out.len()
    })
}

fn sharded_destination(channel: &[u8], shards: usize) -> usize {
    let mut decoder = ShardedDecoder::new(CodecSettings::ALL, HISTORY_CAP, shards);
    feed_frames(channel, |frame, out| {
        decoder.feed(frame, out).expect("a whole channel")
    })
}

/// The source's serial stage alone, the bound on what shards on other cores can gain: parse,
/// route, and copy each shard's bytes out (as into a worker's job).
fn serial_stage(stream: &[u8], shards: usize) -> usize {
    let mut dispatcher = Dispatcher::new(shards, true);
    let mut jobs: Vec<Vec<u8>> = vec![Vec::with_capacity(READ); shards];
    let mut out = BytesMut::new();
    let mut copied = 0;
    read_stream(stream, |read| match read {
        Read::Item(item, bytes) => match dispatcher.route(item, bytes) {
            Route::Serial => {}
            Route::Page {
                shard,
                header,
                page,
                ..
            } => {
                jobs[shard].extend_from_slice(header);
                jobs[shard].extend_from_slice(page);
            }
            Route::Opaque { shard, bytes } => jobs[shard].extend_from_slice(bytes),
        },
        Read::Drained => {
            for job in &mut jobs {
                copied += job.len();
                job.clear();
            }
            dispatcher.close_round(&mut out);
            out.clear();
        }
    });
    copied
}

/// The single encoder alone (no digest), as [`sharded_source`] runs the shards: its baseline.
fn single_source(stream: &[u8]) -> Vec<u8> {
    let mut encoder = StreamEncoder::new(CodecSettings::ALL, HISTORY_CAP, LINK_MBIT);
    let mut out = BytesMut::new();
    read_stream(stream, |read| match read {
        Read::Item(item, bytes) => {
            encoder.push(item, bytes);
            if encoder.is_full() {
                encoder.flush(&mut out);
            }
        }
        Read::Drained => encoder.flush(&mut out),
    });
    out.to_vec()
}

/// The single decoder alone (no digest, no sieve), as [`sharded_destination`].
fn single_destination(channel: &[u8]) -> usize {
    let mut decoder = StreamDecoder::new(CodecSettings::ALL, HISTORY_CAP);
    feed_frames(channel, |frame, out| {
        decoder.feed(frame, out).expect("a whole channel")
    })
}

/// The sharded codec on one thread, S in 1, 2, 4, 8, beside the single encoder and decoder
/// doing the same work: bytes out (printed), CPU per QEMU byte at each end, and the serial
/// stage alone.
fn sharded(c: &mut Criterion, stream: &[u8], unsharded: usize) {
    let mut g = c.benchmark_group("sharded");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(stream.len() as u64));
    let channel = single_source(stream);
    g.bench_function("source/single", |b| b.iter(|| single_source(stream).len()));
    g.bench_function("destination/single", |b| {
        b.iter(|| single_destination(&channel))
    });
    for shards in [1, 2, 4, 8] {
        let (channel, order) = sharded_source(stream, shards);
        assert_eq!(sharded_destination(&channel, shards), stream.len());
        eprintln!(
            "sharded/{shards}: {} bytes out ({order} of order units), {:.4}x the unsharded {unsharded}",
            channel.len(),
            channel.len() as f64 / unsharded as f64
        );
        g.bench_function(format!("source/{shards}"), |b| {
            b.iter(|| sharded_source(stream, shards).0.len())
        });
        g.bench_function(format!("destination/{shards}"), |b| {
            b.iter(|| sharded_destination(&channel, shards))
        });
        g.bench_function(format!("serial/{shards}"), |b| {
            b.iter(|| serial_stage(stream, shards))
        });
    }
    g.finish();
}

/// The source's shards on threads: wall time per QEMU byte beside one shard on the caller's
/// thread, and the bytes out.
fn threaded(c: &mut Criterion, stream: &[u8], unsharded: usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    let mut g = c.benchmark_group("threaded");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(stream.len() as u64));
    for (shards, threads) in [(1, 0), (2, 1), (2, 2), (4, 2), (4, 4)] {
        let bytes = threaded_source(&runtime, stream, shards, threads);
        eprintln!(
            "threaded/{shards}x{threads}: {bytes} bytes out, {:.4}x the unsharded {unsharded}",
            bytes as f64 / unsharded as f64
        );
        g.bench_function(format!("source/{shards}x{threads}"), |b| {
            b.iter(|| threaded_source(&runtime, stream, shards, threads))
        });
    }
    g.finish();
}

/// The destination agent's work: the stream channel's bytes in, QEMU's bytes out (their
/// length returned).
fn destination(channel: &[u8]) -> usize {
    let mut decoder = StreamDecoder::new(CodecSettings::ALL, HISTORY_CAP);
    let mut sieve = LoadSieve::new(ZeroPages::none());
    let mut digest = TreeDigest::with_helpers(1);
    let mut fed = 0;
    for frame in channel.chunks(FRAME) {
        let input = sieve.input();
        let start = input.len();
        decoder.feed(frame, input).expect("a whole channel");
        digest.update(&input[start..]);
        fed += sieve.sieve_input().expect("the stream").bytes.len();
    }
    digest.hex();
    fed
}

/// The digest alone, fed QEMU's stream in pages as the source feeds it: one hasher on the
/// caller's thread, and the tree digest with its spans on 0 (inline), 1, 2 and 4 helpers.
fn digests(c: &mut Criterion, stream: &[u8]) {
    let mut g = c.benchmark_group("digest");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(stream.len() as u64));
    g.bench_function("stream", |b| {
        b.iter(|| {
            let mut digest = StreamDigest::new();
            stream
                .chunks(PAGE_SIZE)
                .for_each(|page| digest.update(page));
            digest.hex()
        })
    });
    for helpers in [0, 1, 2, 4] {
        g.bench_function(format!("tree/{helpers}"), |b| {
            b.iter(|| {
                let mut digest = TreeDigest::with_helpers(helpers);
                stream
                    .chunks(PAGE_SIZE)
                    .for_each(|page| digest.update(page));
                digest.hex()
            })
        });
    }
    g.finish();
}

fn bench(c: &mut Criterion) {
    let stream = stream();
    let channel = source(&stream);
    assert_eq!(destination(&channel), stream.len(), "QEMU gets every byte");
    let mut g = c.benchmark_group("pipeline");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(stream.len() as u64));
    g.bench_function("source", |b| b.iter(|| source(&stream).len()));
    g.bench_function("destination", |b| b.iter(|| destination(&channel)));
    g.finish();
    sharded(c, &stream, channel.len());
    threaded(c, &stream, channel.len());
    digests(c, &stream);
}

criterion_group!(benches, bench);
criterion_main!(benches);
