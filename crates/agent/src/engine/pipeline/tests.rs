//! The sharded codec against captured QEMU streams, synthetic streams and damaged input.

use bytes::{Bytes, BytesMut};
use ferry_api::agent::{CodecReport, CodecSettings};
use ferry_codec::shard::{shard_of, MAX_SHARDS};
use ferry_qemu::stream::{flag, Item, RamData, RamRecord, StreamParser, PAGE_SIZE};
use proptest::prelude::*;

use super::dispatcher::order_unit;
use super::{
    put_unit, DestinationPipeline, Shape, ShardDecoder, ShardEncoder, ShardedDecoder,
    ShardedEncoder, SourcePipeline, ThreadedDecoder,
};
use crate::engine::stream_codec::{every_settings_mix, MAX_BATCH_DECODED, MAX_FRAMED};

const STREAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../qemu/tests/streams");
const HISTORY: u64 = 64 << 20;
/// A link slow enough that every zstd level keeps up with it on a loaded host: the level
/// chooser drops to stored when compression is slower than twice the link, so on a fast
/// link the bytes out would depend on how busy the host is.
const LINK_MBIT: f64 = 10.0;

/// Every captured main stream, the postcopy one included (not the streams of a resumed
/// postcopy: they travel raw, and start mid-stream).
fn captured() -> Vec<(String, Vec<u8>)> {
    let mut streams = Vec::new();
    for dir in [STREAMS.to_string(), format!("{STREAMS}/postcopy")] {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let resumed = path.to_string_lossy().contains("resumed.");
            if path.extension().is_some_and(|x| x == "zst") && !resumed {
                let bytes = zstd::decode_all(std::fs::File::open(&path).unwrap()).unwrap();
                streams.push((path.display().to_string(), bytes));
            }
        }
    }
    streams.sort();
    assert!(streams.len() >= 3, "captured streams: {}", streams.len());
    streams
}

/// Parses `stream`, encodes it in `shards` shards closing a round every `round_items` items
/// (and wherever the encoder is full), decodes the channel cut into `cut`-byte pieces.
fn round_trip(
    stream: &[u8],
    settings: CodecSettings,
    shards: usize,
    round_items: usize,
    cut: usize,
) -> (Vec<u8>, CodecReport, u64) {
    let mut parser = StreamParser::new();
    let mut input = BytesMut::from(stream);
    let mut enc = ShardedEncoder::new(settings, HISTORY, LINK_MBIT, shards);
    let (mut wire, mut qemu) = (BytesMut::new(), BytesMut::new());
    let mut items = 0;
    while let Some(item) = parser.next_item(&mut input).unwrap() {
        qemu.clear();
        item.encode(&mut qemu);
        enc.push(&item, &qemu);
        items += 1;
        if enc.is_full() || items % round_items == 0 {
            enc.flush(&mut wire);
        }
    }
    parser.finish(input.len()).unwrap();
    enc.flush(&mut wire);
    let report = enc.report();
    assert_eq!(report.bytes_out, wire.len() as u64, "bytes out miscounted");
    // On this slow link every batch is coded at some level (one zstd does not shrink still
    // counts: its CPU was spent), the order units' included.
    let units = if settings.zstd { units(&wire) } else { 0 };
    assert_eq!(
        report.zstd_levels.iter().map(|l| l.batches).sum::<u64>(),
        units,
        "zstd's batches miscounted"
    );
    let mut dec = ShardedDecoder::new(settings, HISTORY, shards);
    let mut out = BytesMut::new();
    for piece in wire.chunks(cut) {
        dec.feed(piece, &mut out).unwrap();
    }
    assert!(dec.is_idle());
    (out.to_vec(), report, enc.order_bytes())
}

/// The units on `wire`, of every lane.
fn units(wire: &[u8]) -> u64 {
    let mut input = BytesMut::from(wire);
    let mut count = 0;
    while super::next_unit(&mut input).unwrap().is_some() {
        count += 1;
    }
    assert!(input.is_empty());
    count
}

#[test]
fn captured_streams_come_back_byte_for_byte_in_any_number_of_shards() {
    let mixes = every_settings_mix();
    for (name, stream) in captured() {
        for shards in [1, 2, 3, 8, 16] {
            for (i, &settings) in mixes.iter().enumerate() {
                // Rounds of a few items to hundreds, cut anywhere.
                let round_items = 7 + i * 61;
                let (out, report, order) =
                    round_trip(&stream, settings, shards, round_items, 1 + i * 997);
                assert!(
                    out == stream,
                    "{name}: {settings} in {shards} shards changed it"
                );
                assert_eq!(report.bytes_in, stream.len() as u64, "{name}");
                assert!(report.pages > 0 && order > 0, "{name}");
            }
        }
    }
}

/// `round_trip` with the shards on `threads` threads, rounds collected as they are coded
/// (every `collect_every` items, without waiting) and all of them at the end. Checks that the
/// marks come back in the order the rounds were closed.
async fn threaded_round_trip(
    stream: &[u8],
    settings: CodecSettings,
    shards: usize,
    threads: usize,
    round_items: usize,
) -> (Vec<u8>, CodecReport) {
    pausing_round_trip(stream, settings, shards, threads, round_items, 0).await
}

/// [`threaded_round_trip`] with the block cache paused and resumed every `pause_items` items
/// (0: never).
async fn pausing_round_trip(
    stream: &[u8],
    settings: CodecSettings,
    shards: usize,
    threads: usize,
    round_items: usize,
    pause_items: u64,
) -> (Vec<u8>, CodecReport) {
    let mut parser = StreamParser::new();
    let mut input = BytesMut::from(stream);
    let encoder = ShardedEncoder::new(settings, HISTORY, LINK_MBIT, shards);
    let mut enc = SourcePipeline::new(encoder, threads, "test-codec").unwrap();
    let (mut wire, mut qemu) = (BytesMut::new(), BytesMut::new());
    let (mut items, mut closed, mut last_mark) = (0u64, 0u64, 0u64);
    let mut take = |mark: Option<u64>, closed: u64| {
        if let Some(mark) = mark {
            assert!(
                mark > last_mark && mark <= closed,
                "mark {mark} after {last_mark}"
            );
            last_mark = mark;
        }
    };
    while let Some(item) = parser.next_item(&mut input).unwrap() {
        qemu.clear();
        item.encode(&mut qemu);
        enc.push(&item, &qemu).await.unwrap();
        items += 1;
        if pause_items > 0 && items % pause_items == 0 {
            let paused = items / pause_items % 2 == 1;
            enc.set_cache_paused(paused).await.unwrap();
        }
        if enc.is_full() || items % round_items as u64 == 0 {
            // The mark: how many items the round ends after.
            enc.close_round(&mut wire, items).await.unwrap();
            closed = items;
        }
        if items % 5 == 0 {
            take(enc.collect(&mut wire, false).await.unwrap(), closed);
        }
    }
    parser.finish(input.len()).unwrap();
    enc.close_round(&mut wire, items).await.unwrap();
    take(enc.collect(&mut wire, true).await.unwrap(), items);
    assert_eq!(last_mark, items, "the last round's mark");
    let report = enc.report();
    assert_eq!(report.bytes_out, wire.len() as u64, "bytes out miscounted");
    // Decoded on threads too: as many as the source's, but at most 3.
    let decoders = ShardedDecoder::new(settings, HISTORY, shards).into_shards();
    let out = threaded_decode(decoders, threads.clamp(1, 3), &wire, 7919)
        .await
        .unwrap();
    (out, report)
}

/// Decodes `wire`, fed in `cut`-byte pieces, with `decoders` on `threads` threads; fails if
/// anything is left unplaced.
async fn threaded_decode(
    decoders: Vec<ShardDecoder>,
    threads: usize,
    wire: &[u8],
    cut: usize,
) -> anyhow::Result<Vec<u8>> {
    let mut dec = ThreadedDecoder::new(decoders, threads, "test-decode")?;
    let mut out = BytesMut::new();
    for piece in wire.chunks(cut) {
        dec.feed(piece).await?;
        dec.take(&mut out)?;
    }
    while dec.decoding() {
        dec.next_answer().await?;
        dec.take(&mut out)?;
    }
    anyhow::ensure!(dec.is_idle(), "bytes left unplaced");
    Ok(out.to_vec())
}

#[tokio::test]
async fn captured_streams_come_back_byte_for_byte_with_shards_on_threads() {
    let mixes = every_settings_mix();
    for (name, stream) in captured() {
        for (shards, threads) in [(1, 1), (2, 1), (2, 2), (3, 2), (8, 3), (16, 4)] {
            for (i, &settings) in mixes.iter().enumerate().step_by(3) {
                let (out, report) =
                    threaded_round_trip(&stream, settings, shards, threads, 3 + i * 41).await;
                assert!(
                    out == stream,
                    "{name}: {settings} in {shards} shards on {threads} threads changed it"
                );
                assert_eq!(report.bytes_in, stream.len() as u64, "{name}");
                assert!(report.pages > 0, "{name}");
                assert_eq!(report.settings, settings.to_string(), "{name}");
                assert_eq!(
                    (report.shards, report.threads),
                    (
                        u32::try_from(shards).unwrap(),
                        u32::try_from(threads).unwrap()
                    ),
                    "{name}"
                );
                assert!(report.order_bytes > 0, "{name}");
            }
        }
    }
}

#[tokio::test]
async fn the_block_cache_paused_and_resumed_anywhere_keeps_every_stream_whole() {
    for (name, stream) in captured() {
        for (shards, threads) in [(1, 0), (3, 0), (3, 2), (8, 3)] {
            let mut paused_batches = 0;
            for (round_items, pause_items) in [(50, 7), (9, 40), (201, 1)] {
                let (out, report) = pausing_round_trip(
                    &stream,
                    CodecSettings::ALL,
                    shards,
                    threads,
                    round_items,
                    pause_items,
                )
                .await;
                assert!(
                    out == stream,
                    "{name}: {shards} shards on {threads} threads, paused every {pause_items}"
                );
                paused_batches += report.cache_paused_batches;
            }
            assert!(
                paused_batches > 0,
                "{name}: {shards} shards: no batch went with the cache paused"
            );
        }
    }
}

#[tokio::test]
async fn with_no_shard_threads_the_pipeline_codes_inline_as_the_sharded_encoder() {
    let (name, stream) = &captured()[0];
    let settings = CodecSettings::ALL;
    let (out, report) = threaded_round_trip(stream, settings, 3, 0, 50).await;
    assert!(out == *stream, "{name}");
    let (_, inline, _) = round_trip(stream, settings, 3, 50, 4096);
    assert_eq!(report.bytes_out, inline.bytes_out, "{name}");
}

#[tokio::test]
async fn a_round_waits_for_no_round_after_it_and_dropping_the_pipeline_ends_its_threads() {
    let (_, stream) = &captured()[0];
    let mut parser = StreamParser::new();
    let mut input = BytesMut::from(&stream[..]);
    let encoder = ShardedEncoder::new(CodecSettings::ALL, HISTORY, LINK_MBIT, 4);
    let mut enc = SourcePipeline::new(encoder, 2, "ending-codec").unwrap();
    // Round 1 is whole once its units are back, with round 2's records pushed behind it.
    let mut wire = BytesMut::new();
    push_items(&mut enc, &mut parser, &mut input, 40).await;
    enc.close_round(&mut wire, 1).await.unwrap();
    push_items(&mut enc, &mut parser, &mut input, 40).await;
    assert_eq!(enc.collect(&mut wire, true).await.unwrap(), Some(1));
    let mut dec = ShardedDecoder::new(CodecSettings::ALL, HISTORY, 4);
    let mut out = BytesMut::new();
    dec.feed(&wire, &mut out).unwrap();
    assert!(dec.is_idle(), "round 1 alone is whole");
    assert!(stream.starts_with(&out) && !out.is_empty());
    enc.close_round(&mut wire, 2).await.unwrap();
    // Nothing is in the open round: waiting for a coded round would never end.
    assert_eq!(enc.collect(&mut wire, true).await.unwrap(), Some(2));
    let pending = tokio::time::timeout(std::time::Duration::from_millis(50), enc.round_coded());
    assert!(pending.await.is_err(), "no round is being coded");
    let names = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
            .filter(|c| c.starts_with("ending-codec"))
            .count()
    };
    assert!(names() >= 2, "the codec's threads run");
    drop(enc);
    // Joined; the kernel takes a thread's entry out of /proc a moment after.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while names() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the codec's threads outlived it"
        );
        std::thread::yield_now();
    }
}

/// Pushes the next `n` items of `input`.
async fn push_items(
    enc: &mut SourcePipeline,
    parser: &mut StreamParser,
    input: &mut BytesMut,
    n: usize,
) {
    let mut qemu = BytesMut::new();
    for _ in 0..n {
        let item = parser.next_item(input).unwrap().unwrap();
        qemu.clear();
        item.encode(&mut qemu);
        enc.push(&item, &qemu).await.unwrap();
    }
}

#[test]
fn the_shape_follows_the_link_and_the_cores() {
    let shape = |link, cores| {
        let s = Shape::choose(Some(link), cores, None);
        (s.shards, s.threads)
    };
    // A link of unknown rate: one shard.
    assert_eq!(
        Shape::choose(None, 64, None),
        Shape {
            shards: 1,
            threads: 0
        }
    );
    // Two cores: no threads whatever the link.
    assert_eq!(shape(10_000.0, 2), (1, 0));
    assert_eq!(shape(100.0, 8), (1, 0));
    assert_eq!(shape(800.0, 8), (1, 0));
    assert_eq!(shape(1000.0, 8), (2, 2));
    assert_eq!(shape(10_000.0, 8), (8, 8));
    assert_eq!(shape(10_000.0, 32), (13, 13));
    assert_eq!(shape(100_000.0, 64), (MAX_SHARDS, MAX_SHARDS));
    // The destination follows the source's shards with threads on a host of 4 cores or
    // more, or when the source's test hook asks.
    assert_eq!(DestinationPipeline::threads_for(1, 8, false), 0);
    assert_eq!(DestinationPipeline::threads_for(3, 2, false), 0);
    assert_eq!(DestinationPipeline::threads_for(3, 2, true), 2);
    assert_eq!(DestinationPipeline::threads_for(8, 4, false), 4);
    assert_eq!(DestinationPipeline::threads_for(2, 8, false), 2);
    // The test hook forces the shards, with threads when more than one (as many as cores).
    assert_eq!(
        Shape::choose(Some(100.0), 2, Some(3)),
        Shape {
            shards: 3,
            threads: 2
        }
    );
    assert_eq!(
        Shape::choose(Some(100.0), 2, Some(1)),
        Shape {
            shards: 1,
            threads: 0
        }
    );
}

/// What the sharding costs on the captured streams: the order units, and the block-cache
/// hits lost between shards. The captured guests are tiny (about 120 whole pages, the rest
/// QEMU's zero pages), and most of their block-cache hits are between stripes, so sharding
/// costs them up to 41% more bytes in 16 shards (dedup hits 145 in one shard, 62 in two; and
/// one shard's batches climb to stronger zstd levels); the codec bench measures typical
/// memory. Bounded here so that a change costing much more shows.
#[test]
fn sharding_the_tiny_captured_guests_costs_at_most_half_more() {
    for (name, stream) in captured() {
        let bytes = |shards| {
            let (_, report, order) = round_trip(&stream, CodecSettings::ALL, shards, 256, 4096);
            (report.bytes_out, order)
        };
        let (one, _) = bytes(1);
        for shards in [2, 4, 16] {
            let (n, order) = bytes(shards);
            eprintln!("{name}: {shards} shards: {n} bytes ({order} of order units) vs {one}");
            assert!(
                n as f64 <= one as f64 * 1.5,
                "{name}: {shards} shards sent {n} bytes against {one} in one"
            );
        }
    }
}

/// One RAM record of block "pc.ram" (named, or continued) at page `index`.
fn record(index: u64, named: bool, flags: u64, data: RamData) -> Item {
    record_in(b"pc.ram", index, named, flags, data)
}

/// One RAM record of block `block` (named, or the block continued) at page `index`.
fn record_in(block: &'static [u8], index: u64, named: bool, flags: u64, data: RamData) -> Item {
    Item::Ram(RamRecord {
        offset: index * PAGE_SIZE as u64,
        flags: if named { flags } else { flags | flag::CONTINUE },
        block: named.then(|| Bytes::from_static(block)),
        data,
    })
}

/// Two RAM blocks the synthetic streams use.
const BLOCKS: [&[u8]; 2] = [b"pc.ram", b"vga.vram"];

/// A page whose content is `kind`: zero, a repeated byte, or noise.
fn content(kind: u8, seed: u64) -> Bytes {
    match kind {
        0 => Bytes::from(vec![0u8; PAGE_SIZE]),
        1 => Bytes::from(vec![seed.to_le_bytes()[0]; PAGE_SIZE]),
        _ => {
            let mut x = seed.wrapping_mul(2) | 1;
            Bytes::from(
                (0..PAGE_SIZE)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x.to_le_bytes()[0]
                    })
                    .collect::<Vec<u8>>(),
            )
        }
    }
}

/// Where a synthetic record goes: a block (named, or the block before continued), and a page
/// in one of 256 stripes of it (so that every shard of 16 gets pages).
#[derive(Debug, Clone)]
struct At {
    block: usize,
    named: bool,
    index: u64,
}

fn at() -> impl Strategy<Value = At> {
    (0..2usize, any::<bool>(), 0..256u64, 0..3u64).prop_map(|(block, named, stripe, page)| At {
        block,
        named,
        index: stripe * ferry_codec::shard::STRIPE_PAGES + page,
    })
}

#[derive(Debug, Clone)]
enum Step {
    Page { at: At, kind: u8, seed: u64 },
    Zero(At),
    Xbzrle(At, Vec<u8>),
    Marker,
    Opaque(Vec<u8>),
    Round,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (at(), 0..3u8, 0..8u64).prop_map(|(at, kind, seed)| Step::Page { at, kind, seed }),
        2 => at().prop_map(Step::Zero),
        1 => (at(), proptest::collection::vec(any::<u8>(), 1..32))
            .prop_map(|(at, delta)| Step::Xbzrle(at, delta)),
        1 => Just(Step::Marker),
        1 => proptest::collection::vec(any::<u8>(), 1..64).prop_map(Step::Opaque),
        1 => Just(Step::Round),
    ]
}

/// The record a step makes (`None`: close the round); `block` is the block named last, which
/// a continued record means.
fn step_item(step: Step, block: &mut usize) -> Option<Item> {
    let mut place = |at: &At| {
        if at.named {
            *block = at.block;
        }
        (BLOCKS[*block], at.index, at.named)
    };
    Some(match step {
        Step::Page { at, kind, seed } => {
            let (name, index, named) = place(&at);
            record_in(
                name,
                index,
                named,
                flag::PAGE,
                RamData::Page(content(kind, seed)),
            )
        }
        Step::Zero(at) => {
            let (name, index, named) = place(&at);
            record_in(name, index, named, flag::ZERO, RamData::Fill(0))
        }
        Step::Xbzrle(at, delta) => {
            let (name, index, named) = place(&at);
            let delta = RamData::Xbzrle(Bytes::from(delta));
            record_in(name, index, named, flag::XBZRLE, delta)
        }
        Step::Marker => Item::Ram(RamRecord {
            offset: 0,
            flags: flag::EOS,
            block: None,
            data: RamData::None,
        }),
        Step::Opaque(bytes) => Item::Opaque(Bytes::from(bytes)),
        Step::Round => return None,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any mix of pages (rewritten, moved between contents, in any order), QEMU's zero pages,
    /// markers and opaque bytes, in any number of shards and rounds, comes back byte for byte.
    #[test]
    fn any_stream_comes_back_in_any_number_of_shards(
        steps in proptest::collection::vec(step(), 1..300),
        shards in 1..=MAX_SHARDS,
        mix in 0..16usize,
        cut in 1..5000usize,
    ) {
        let settings = every_settings_mix()[mix];
        let mut enc = ShardedEncoder::new(settings, HISTORY, LINK_MBIT, shards);
        let (mut wire, mut stream) = (BytesMut::new(), Vec::new());
        // The first record names the block, as QEMU's does.
        let first = record(0, true, flag::ZERO, RamData::Fill(0));
        let mut block = 0;
        let rest: Vec<Option<Item>> = steps.into_iter().map(|s| step_item(s, &mut block)).collect();
        for item in std::iter::once(Some(first)).chain(rest) {
            match item {
                Some(item) => push(&mut enc, &item, &mut stream, &mut wire),
                None => enc.flush(&mut wire),
            }
        }
        enc.flush(&mut wire);
        let mut dec = ShardedDecoder::new(settings, HISTORY, shards);
        let mut out = BytesMut::new();
        for piece in wire.chunks(cut) {
            dec.feed(piece, &mut out).unwrap();
        }
        prop_assert!(dec.is_idle());
        prop_assert!(out[..] == stream[..], "{} shards, {} changed the stream", shards, settings);
    }
}

/// Encodes `item` as QEMU would write it onto `stream`, pushes it into `enc`, and closes the
/// round into `wire` when the encoder is full.
fn push(enc: &mut ShardedEncoder, item: &Item, stream: &mut Vec<u8>, wire: &mut BytesMut) {
    let mut qemu = BytesMut::new();
    item.encode(&mut qemu);
    stream.extend_from_slice(&qemu);
    enc.push(item, &qemu);
    if enc.is_full() {
        enc.flush(wire);
    }
}

/// The key of page `index` of the first block.
fn page_key(index: u64) -> u64 {
    index
}

/// A page record of shard `shard`'s lane: QEMU's header for page `index`, then the page.
fn shard_unit(shard: usize, shards: usize, index: u64, out: &mut BytesMut) {
    let item = record(index, true, flag::PAGE, RamData::Page(content(2, index)));
    let mut qemu = BytesMut::new();
    item.encode(&mut qemu);
    let (header, page) = qemu.split_at(qemu.len() - PAGE_SIZE);
    let mut enc = ShardEncoder::new(CodecSettings::ALL, HISTORY, LINK_MBIT, shard, shards);
    enc.push_page(page_key(index), header, page);
    enc.flush(out);
}

/// The error decoding `wire` gives, the same with the shards on threads.
fn decode_error(shards: usize, wire: &[u8]) -> String {
    let mut out = BytesMut::new();
    let err = ShardedDecoder::new(CodecSettings::ALL, HISTORY, shards)
        .feed(wire, &mut out)
        .expect_err("damaged input was decoded");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for threads in [1, shards.min(3)] {
        let decoders = ShardedDecoder::new(CodecSettings::ALL, HISTORY, shards).into_shards();
        let threaded = runtime
            .block_on(threaded_decode(decoders, threads, wire, 4096))
            .expect_err("damaged input was decoded on threads");
        assert_eq!(
            format!("{threaded:#}"),
            format!("{err:#}"),
            "on {threads} threads"
        );
    }
    format!("{err:#}")
}

#[test]
fn a_codec_threads_panic_is_said_with_its_message() {
    let said = |work: Box<dyn FnOnce()>| {
        let mut message = None;
        super::saying_panics(work, |m| message = Some(m));
        message
    };
    assert_eq!(said(Box::new(|| {})), None);
    assert_eq!(
        said(Box::new(|| panic!("shard {} out of step", 3))).as_deref(),
        Some("a codec thread panicked: shard 3 out of step")
    );
    assert_eq!(
        said(Box::new(|| panic!("a literal"))).as_deref(),
        Some("a codec thread panicked: a literal")
    );
}

#[test]
fn damaged_units_are_errors() {
    // A unit longer than any encoder makes, or too short to hold its lane and flags.
    let mut wire = BytesMut::new();
    wire.extend_from_slice(&u32::try_from(MAX_FRAMED + 3).unwrap().to_le_bytes());
    wire.extend_from_slice(&[0, 0]);
    assert!(decode_error(2, &wire).contains("announced, outside 2..="));
    assert!(decode_error(2, &[1, 0, 0, 0, 0, 0]).contains("announced, outside 2..="));
    // Unknown flags.
    assert!(decode_error(2, &[2, 0, 0, 0, 1, 0x80]).contains("lane 1 with unknown flags 0x80"));
    // The paused cache's flag on an order unit, which has no cache.
    assert!(decode_error(2, &[2, 0, 0, 0, 0, 1]).contains("lane 0 with unknown flags 0x01"));
    // A lane beyond the stream's shards.
    let mut wire = BytesMut::new();
    put_unit(&mut wire, 3, 0, &[0, 0]);
    assert!(decode_error(2, &wire).contains("lane 3, beyond the stream's 2 shards"));
}

#[test]
fn a_page_in_another_shards_batch_is_an_error() {
    let shards = 4;
    let index = (0..).find(|&i| shard_of(page_key(i), shards) == 2).unwrap();
    // Page `index` belongs to shard 2; send it as shard 1's.
    let mut wire = BytesMut::new();
    shard_unit(1, shards, index, &mut wire);
    let err = decode_error(shards, &wire);
    assert!(
        err.contains("of shard 2 arrived in shard 1's batch"),
        "{err}"
    );
}

#[test]
fn order_units_that_do_not_match_their_round_are_errors() {
    let shards = 2;
    let index = (0..).find(|&i| shard_of(page_key(i), shards) == 1).unwrap();
    let mut unit = BytesMut::new();
    shard_unit(1, shards, index, &mut unit);
    let decoded = 8 + 1 + 6 + PAGE_SIZE as u64; // header word, name, page
    let with_order = |runs: &[(u8, u64)], serial: &[u8]| {
        let mut wire = unit.clone();
        order_unit(runs, serial, &mut wire);
        wire
    };
    // Placing more than the shard decoded, or less.
    let err = decode_error(shards, &with_order(&[(2, decoded + 1)], b""));
    assert!(err.contains("which decoded 4111 in its round"), "{err}");
    let err = decode_error(shards, &with_order(&[(2, decoded - 1)], b""));
    assert!(
        err.contains("shard 1 decoded 1 bytes its round's order unit did not place"),
        "{err}"
    );
    // Serial bytes beyond what the unit holds, or left over.
    let err = decode_error(shards, &with_order(&[(2, decoded), (0, 5)], b"abc"));
    assert!(
        err.contains("places 5 serial bytes where it holds 3"),
        "{err}"
    );
    let err = decode_error(shards, &with_order(&[(2, decoded), (0, 2)], b"abc"));
    assert!(
        err.contains("holds 1 serial bytes it does not place"),
        "{err}"
    );
    // A lane the stream does not have.
    let err = decode_error(shards, &with_order(&[(2, decoded), (3, 1)], b""));
    assert!(
        err.contains("names lane 3, beyond the stream's 2 shards"),
        "{err}"
    );
    // The right order: the page and three serial bytes.
    let mut out = BytesMut::new();
    let mut dec = ShardedDecoder::new(CodecSettings::ALL, HISTORY, shards);
    dec.feed(
        &with_order(&[(0, 1), (2, decoded), (0, 2)], b"abc"),
        &mut out,
    )
    .unwrap();
    assert!(dec.is_idle());
    assert_eq!(out.len() as u64, decoded + 3);
    assert_eq!((&out[..1], &out[out.len() - 2..]), (&b"a"[..], &b"bc"[..]));
}

/// Shard 0's units of zero pages, with no order unit: each full batch's wire and the QEMU
/// bytes pushed so far, up to four rounds' worth.
fn unplaced_units(shards: usize) -> impl Iterator<Item = (BytesMut, usize)> {
    let zero = content(0, 0);
    let mut enc = ShardEncoder::new(CodecSettings::ALL, HISTORY, LINK_MBIT, 0, shards);
    let mut pushed = 0usize;
    (0..)
        .filter(move |&i| shard_of(page_key(i), shards) == 0)
        .map_while(move |index| {
            let item = record(index, index == 0, flag::PAGE, RamData::Page(zero.clone()));
            let mut qemu = BytesMut::new();
            item.encode(&mut qemu);
            let (header, page) = qemu.split_at(qemu.len() - PAGE_SIZE);
            enc.push_page(page_key(index), header, page);
            pushed += qemu.len();
            let mut wire = BytesMut::new();
            if enc.is_full() {
                enc.flush(&mut wire);
            }
            (pushed < 4 * MAX_BATCH_DECODED).then_some((wire, pushed))
        })
        .filter(|(wire, _)| !wire.is_empty())
}

/// Shard units with no order unit placing their bytes: the destination holds at most a
/// round's worth (whatever the number of shards), then fails.
#[test]
fn shard_units_without_order_units_are_refused_past_a_round() {
    let shards = 4;
    let mut dec = ShardedDecoder::new(CodecSettings::ALL, HISTORY, shards);
    let mut out = BytesMut::new();
    for (wire, pushed) in unplaced_units(shards) {
        if let Err(err) = dec.feed(&wire, &mut out) {
            assert!(
                format!("{err:#}").contains("without an order unit placing them"),
                "{err:#}"
            );
            assert!(pushed > MAX_BATCH_DECODED);
            return;
        }
    }
    panic!("never refused");
}

/// The same on threads: what the workers decoded and no order unit placed is bounded by a
/// round's worth for each round in flight; fed one unit at a time, or all in one piece.
#[tokio::test]
async fn shard_units_without_order_units_are_refused_on_threads() {
    let shards = 4;
    let refused = |err: anyhow::Error| {
        assert!(
            format!("{err:#}").contains("that no order unit placed"),
            "{err:#}"
        );
    };
    let decoders = ShardedDecoder::new(CodecSettings::ALL, HISTORY, shards).into_shards();
    let mut dec = ThreadedDecoder::new(decoders, 2, "test-unplaced").unwrap();
    let mut out = BytesMut::new();
    let mut all = BytesMut::new();
    let mut done = false;
    for (wire, pushed) in unplaced_units(shards) {
        all.extend_from_slice(&wire);
        if done {
            continue;
        }
        // `feed` counts answers already in against the bound too, so the refusal may come
        // from it as well as from `take` or a later answer, by how the workers are scheduled.
        let mut taken = dec.feed(&wire).await;
        if taken.is_ok() {
            taken = dec.take(&mut out).map(drop);
        }
        while taken.is_ok() && dec.decoding() {
            taken = dec.next_answer().await;
        }
        if let Err(err) = taken {
            refused(err);
            assert!(pushed > MAX_BATCH_DECODED);
            assert!(out.is_empty());
            done = true;
        }
    }
    assert!(done, "never refused");
    let decoders = ShardedDecoder::new(CodecSettings::ALL, HISTORY, shards).into_shards();
    let mut dec = ThreadedDecoder::new(decoders, 2, "test-unplaced").unwrap();
    let mut taken = dec.feed(&all).await;
    while taken.is_ok() && dec.decoding() {
        taken = dec.next_answer().await;
    }
    refused(taken.expect_err("never refused in one piece"));
}

/// Pages the destination's seed image holds go as references to it from every shard (the
/// shards share the source's index and the destination's image).
#[test]
fn seeded_pages_come_back_from_every_shard() {
    let shards = 4;
    let pages: Vec<Bytes> = (0..256u64).map(|i| content(2, i + 100)).collect();
    let image: Vec<u8> = pages.iter().flat_map(|p| p.iter().copied()).collect();
    let (index, _) = ferry_codec::index_image(&image);
    let mut enc = ShardedEncoder::new(CodecSettings::ALL, HISTORY, LINK_MBIT, shards);
    enc.set_seed(
        ferry_codec::SeedIndex::parse(&index).unwrap(),
        ferry_api::agent::SeedReport::default(),
    );
    let (mut wire, mut stream) = (BytesMut::new(), Vec::new());
    for (i, page) in (0u64..).zip(&pages) {
        // The image's pages, in other places of memory.
        let item = record(i * 17, i == 0, flag::PAGE, RamData::Page(page.clone()));
        push(&mut enc, &item, &mut stream, &mut wire);
    }
    enc.flush(&mut wire);
    let report = enc.report();
    assert_eq!(report.seeded, 256, "{report:?}");
    let mut dec = ShardedDecoder::new(CodecSettings::ALL, HISTORY, shards);
    dec.set_seed(ferry_codec::SeedImage::new(image));
    let mut out = BytesMut::new();
    dec.feed(&wire, &mut out).unwrap();
    assert!(out[..] == stream[..]);
    assert!(
        wire.len() < stream.len() / 20,
        "{} bytes for {}",
        wire.len(),
        stream.len()
    );
}

/// The API's bound on the test hook is the format's.
#[test]
fn the_settings_allow_the_shards_the_format_has() {
    assert_eq!(
        usize::try_from(ferry_api::settings::MAX_TEST_SHARDS).unwrap(),
        MAX_SHARDS
    );
}
