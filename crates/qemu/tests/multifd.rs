//! The multifd channel parser against real QEMU 10 channels (captured by
//! `scripts/capture-streams.sh`): every byte comes back out, in any chunking, the pages found
//! are the ones QEMU sent, and damaged channels stop with an error that names what is wrong.

use bytes::BytesMut;
use ferry_qemu::multifd::{
    flag, ChannelParser, Item, MultifdError, Payload, MAX_COMPRESSED_PAYLOAD, PACKET_LEN,
    PAGES_PER_PACKET,
};
use ferry_qemu::stream::{RamData, StreamParser, PAGE_SIZE};
use proptest::prelude::*;

fn channel(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/streams/multifd/{name}.qemu.zst",
        env!("CARGO_MANIFEST_DIR")
    );
    zstd::decode_all(std::fs::File::open(&path).expect(&path)).expect("zstd")
}

/// Feeds `data` in chunks of the given sizes (cycled) and returns the items and the
/// re-encoded bytes.
fn parse_chunked(data: &[u8], chunks: &[usize]) -> Result<(Vec<Item>, Vec<u8>), MultifdError> {
    let mut parser = ChannelParser::new();
    let (mut buf, mut out) = (BytesMut::new(), BytesMut::new());
    let (mut items, mut at, mut i) = (Vec::new(), 0, 0);
    while at < data.len() {
        let n = chunks[i % chunks.len()].max(1).min(data.len() - at);
        i += 1;
        buf.extend_from_slice(&data[at..at + n]);
        at += n;
        while let Some(item) = parser.next_item(&mut buf)? {
            item.encode(&mut out);
            items.push(item);
        }
    }
    parser.finish(buf.len())?;
    Ok((items, out.to_vec()))
}

#[derive(Debug, Default, PartialEq)]
struct Counts {
    syncs: usize,
    packets: usize,
    pages: usize,
    zero: usize,
    compressed: usize,
}

fn count(items: &[Item]) -> Counts {
    let mut c = Counts::default();
    for item in items {
        let Item::Ram(p) = item else { continue };
        c.packets += 1;
        c.syncs += usize::from(p.is_sync());
        c.zero += p.zero.len();
        match &p.payload {
            Payload::Pages(pages) => {
                assert_eq!(pages.len(), p.normal.len());
                assert!(pages.iter().all(|page| page.len() == PAGE_SIZE));
                c.pages += pages.len();
            }
            Payload::Compressed(_) => {
                c.compressed += 1;
                c.pages += p.normal.len();
            }
        }
        if !p.is_sync() {
            assert!(!p.block.is_empty(), "a packet of pages names no block");
            assert!(p
                .normal
                .iter()
                .chain(&p.zero)
                .all(|o| o % PAGE_SIZE as u64 == 0));
        }
    }
    c
}

const CHANNELS: [&str; 4] = ["running.0", "running.1", "zstd.0", "zstd.1"];

#[test]
fn every_captured_channel_comes_back_byte_for_byte_with_its_id_and_pages() {
    for name in CHANNELS {
        let data = channel(name);
        let (items, out) = parse_chunked(&data, &[1 << 20]).unwrap();
        assert!(out == data, "{name}: the bytes differ");
        let Item::Init(init) = &items[0] else {
            panic!("{name}: no init packet first")
        };
        assert_eq!(
            init.id.to_string(),
            name.rsplit('.').next().unwrap(),
            "{name}"
        );
        let c = count(&items[1..]);
        // A sync at the start, at each pass's end and at the completion.
        assert!(c.syncs >= 3, "{name}: {c:?}");
        assert!(c.zero > 0 && c.pages > 0, "{name}: {c:?}");
        let zstd = name.starts_with("zstd");
        assert_eq!(c.compressed > 0, zstd, "{name}: {c:?}");
    }
}

#[test]
fn the_running_vms_channels_carry_every_page_at_least_once_and_some_again() {
    let mut seen = std::collections::HashMap::<u64, usize>::new();
    for name in ["running.0", "running.1"] {
        let (items, _) = parse_chunked(&channel(name), &[65536]).unwrap();
        for item in &items {
            if let Item::Ram(p) = item {
                for o in p.normal.iter().chain(&p.zero) {
                    *seen.entry(*o).or_default() += 1;
                }
            }
        }
    }
    // 64 MiB of guest RAM, each page sent (as data or as zero) in the first pass.
    assert_eq!(seen.len(), 64 << 20 >> 12);
    assert!(seen.values().any(|&n| n > 1), "no page was sent again");
}

#[test]
fn the_main_stream_beside_the_channels_carries_no_pages() {
    for name in ["running.main", "zstd.main"] {
        let data = channel(name);
        let mut parser = StreamParser::new();
        let (mut buf, mut out) = (BytesMut::from(&data[..]), BytesMut::new());
        let mut flushes = 0;
        while let Some(item) = parser.next_item(&mut buf).unwrap() {
            if let ferry_qemu::stream::Item::Ram(r) = &item {
                assert_eq!(r.data, RamData::None, "{name}: a page on the main stream");
                flushes += usize::from(r.flags & ferry_qemu::stream::flag::MULTIFD_FLUSH != 0);
            }
            item.encode(&mut out);
        }
        parser.finish(buf.len()).unwrap();
        assert!(out == data, "{name}: the bytes differ");
        assert!(flushes > 0, "{name}: no multifd flush");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn any_chunking_gives_the_same_items_and_bytes(
        chunks in prop::collection::vec(1usize..9000, 1..8),
        which in 0usize..CHANNELS.len(),
    ) {
        let data = channel(CHANNELS[which]);
        let (whole, _) = parse_chunked(&data, &[data.len()]).unwrap();
        let (items, out) = parse_chunked(&data, &chunks).unwrap();
        prop_assert!(out == data);
        prop_assert_eq!(items, whole);
    }
}

/// Where a captured channel's first packet with pages starts: after the init and a sync.
const FIRST_PAGES_AT: usize = 64 + PACKET_LEN;

#[test]
fn a_damaged_channel_stops_with_what_is_wrong_and_where() {
    let data = channel("running.0");
    let at = FIRST_PAGES_AT;
    let parse = |data: &[u8]| parse_chunked(data, &[4096]).map(|_| ());

    let mut bad = data.clone();
    bad[0] = 0x12;
    let e = parse(&bad).unwrap_err();
    assert!(matches!(e, MultifdError::BadMagic { at: 0, .. }), "{e}");
    assert!(e.to_string().contains("not a QEMU multifd channel"), "{e}");

    let mut bad = data.clone();
    bad[at + 7] = 2;
    assert_eq!(
        parse(&bad).unwrap_err(),
        MultifdError::BadVersion {
            found: 2,
            at: at as u64
        }
    );

    let mut bad = data.clone();
    bad[at + 11] |= 0x80;
    assert!(matches!(
        parse(&bad).unwrap_err(),
        MultifdError::UnknownFlags { .. }
    ));

    // More pages than a packet holds: refused before anything is waited for.
    let mut bad = data.clone();
    bad[at + 32..at + 36]
        .copy_from_slice(&(u32::try_from(PAGES_PER_PACKET).unwrap() + 1).to_be_bytes());
    let e = parse(&bad).unwrap_err();
    assert!(matches!(e, MultifdError::TooManyPages { .. }), "{e}");

    // An uncompressed packet whose payload size does not match its pages.
    let mut bad = data.clone();
    bad[at + 20..at + 24].copy_from_slice(&1u32.to_be_bytes());
    assert!(matches!(
        parse(&bad).unwrap_err(),
        MultifdError::BadPayloadSize { .. }
    ));

    // A compressed payload larger than the cap: refused from the header alone.
    let zstd = channel("zstd.0");
    let mut bad = zstd[..at + PACKET_LEN].to_vec();
    assert_ne!(bad[at + 11] as u32 & flag::COMPRESSION_MASK, 0);
    bad[at + 20..at + 24]
        .copy_from_slice(&(u32::try_from(MAX_COMPRESSED_PAYLOAD).unwrap() + 1).to_be_bytes());
    let mut parser = ChannelParser::new();
    let mut buf = BytesMut::from(&bad[..]);
    assert!(matches!(
        parser.next_item(&mut buf),
        Ok(Some(Item::Init(_)))
    ));
    assert!(matches!(parser.next_item(&mut buf), Ok(Some(Item::Ram(_)))));
    assert!(matches!(
        parser.next_item(&mut buf).unwrap_err(),
        MultifdError::PayloadTooLarge { .. }
    ));

    // Cut anywhere inside a packet or the init.
    for cut in [10, 64 + 5, at + 100, at + PACKET_LEN + 10] {
        let e = parse(&data[..cut]).unwrap_err();
        assert!(matches!(e, MultifdError::Truncated(_)), "cut at {cut}: {e}");
    }
    assert_eq!(
        parse(&[]).unwrap_err(),
        MultifdError::Truncated("the init packet")
    );
}
