//! The migration-stream parser against real QEMU 10 streams (captured by
//! `scripts/capture-streams.sh`): every byte comes back out, in any chunking, and damaged
//! streams stop with an error that names what is wrong.

use bytes::BytesMut;
use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use ferry_qemu::stream::{
    flag, Item, Postcopy, RamBlock, RamData, RamLayout, StreamError, StreamParser, PAGE_SIZE,
};
use proptest::prelude::*;

fn stream(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/streams/{name}.qemu.zst",
        env!("CARGO_MANIFEST_DIR")
    );
    zstd::decode_all(std::fs::File::open(&path).expect(&path)).expect("zstd")
}

/// Feeds `data` in chunks of the given sizes (cycled) and returns the items and the
/// re-encoded bytes, each item's checked against its bytes as they came.
fn parse_chunked(data: &[u8], chunks: &[usize]) -> Result<(Vec<Item>, Vec<u8>), StreamError> {
    parse_chunked_with(StreamParser::new(), data, chunks)
}

fn parse_chunked_with(
    mut parser: StreamParser,
    data: &[u8],
    chunks: &[usize],
) -> Result<(Vec<Item>, Vec<u8>), StreamError> {
    let mut buf = BytesMut::new();
    let mut items = Vec::new();
    let mut out = BytesMut::new();
    let mut at = 0;
    let mut i = 0;
    while at < data.len() {
        let n = chunks[i % chunks.len()].max(1).min(data.len() - at);
        i += 1;
        buf.extend_from_slice(&data[at..at + n]);
        at += n;
        while let Some((item, as_written)) = parser.next_item_with_bytes(&mut buf)? {
            let start = out.len();
            item.encode(&mut out);
            // The item's bytes as QEMU wrote them are what it encodes to, its page or delta
            // a view of them.
            assert_eq!(&out[start..], &as_written[..]);
            items.push(item);
        }
    }
    parser.finish(buf.len())?;
    Ok((items, out.to_vec()))
}

struct Counts {
    pages: usize,
    zero: usize,
    eos: usize,
    named: usize,
}

fn count(items: &[Item]) -> Counts {
    let mut c = Counts {
        pages: 0,
        zero: 0,
        eos: 0,
        named: 0,
    };
    for item in items {
        if let Item::Ram(r) = item {
            match r.data {
                RamData::Page(ref p) => {
                    assert_eq!(p.len(), 4096);
                    c.pages += 1
                }
                RamData::Fill(_) => c.zero += 1,
                _ => {}
            }
            c.eos += usize::from(r.flags & flag::EOS != 0);
            c.named += usize::from(r.block.is_some());
        }
    }
    c
}

#[test]
fn idle_stream_reemits_byte_for_byte() {
    let data = stream("idle");
    let (items, out) = parse_chunked(&data, &[data.len()]).unwrap();
    assert_eq!(out, data);
    let c = count(&items);
    // 64 MiB of RAM plus ROMs: every page appears once, most of them zero.
    assert!(c.zero > 15_000, "zero pages: {}", c.zero);
    assert!(c.pages > 10, "pages: {}", c.pages);
    assert!(c.named >= 2, "block names: {}", c.named);
    assert!(c.eos >= 2, "EOS markers: {}", c.eos);
}

#[test]
fn running_stream_has_several_passes_and_reemits() {
    let data = stream("running");
    let (items, out) = parse_chunked(&data, &[data.len()]).unwrap();
    assert_eq!(out, data);
    // Setup + at least one iteration + the end: three or more EOS markers.
    assert!(count(&items).eos >= 3, "EOS markers: {}", count(&items).eos);
}

#[test]
fn postcopy_stream_reemits_and_marks_the_package() {
    let data = stream("postcopy/running");
    let mut parser = StreamParser::new();
    let mut buf = BytesMut::from(&data[..]);
    let mut out = BytesMut::new();
    let (mut package_end, mut pages_before, mut pages_after) = (None, 0, 0);
    let mut states = vec![parser.postcopy()];
    while let Some(item) = parser.next_item(&mut buf).unwrap() {
        item.encode(&mut out);
        if item.is_page() {
            if package_end.is_some() {
                pages_after += 1;
            } else {
                pages_before += 1;
            }
        }
        if parser.ended_package() {
            assert!(package_end.is_none(), "a second package end");
            package_end = Some(parser.position());
        }
        if states.last() != Some(&parser.postcopy()) {
            states.push(parser.postcopy());
        }
    }
    parser.finish(buf.len()).unwrap();
    assert_eq!(out, data);
    assert_eq!(
        states,
        [
            Postcopy::Off,
            Postcopy::Advised,
            Postcopy::Package,
            Postcopy::Running
        ]
    );
    // The switch came early: most pages crossed after the package.
    assert!(package_end.is_some());
    assert!(pages_before > 0, "pages before the package: {pages_before}");
    assert!(
        pages_after > pages_before,
        "pages after the package: {pages_after}, before: {pages_before}"
    );
}

#[test]
fn a_postcopy_package_command_of_another_size_is_refused() {
    let mut parser = StreamParser::new();
    let mut buf = BytesMut::from(&stream_of(&[0x08, 0, 7, 0, 2, 0, 0])[..]);
    let e = loop {
        match parser.next_item(&mut buf) {
            Ok(Some(_)) => {}
            Ok(None) => panic!("wants more"),
            Err(e) => break e,
        }
    };
    assert_eq!(e, StreamError::BadPackage(2));
}

#[test]
fn a_stream_ending_inside_its_package_is_truncated() {
    let data = stream("postcopy/running");
    let mut parser = StreamParser::new();
    let mut buf = BytesMut::from(&data[..]);
    while parser.next_item(&mut buf).unwrap().is_some() {
        if parser.postcopy() == Postcopy::Package {
            break;
        }
    }
    assert_eq!(
        parser.finish(0),
        Err(StreamError::Truncated("a postcopy package"))
    );
}

/// The captured stream up to the cut (it ends inside an item) and the parser that read it.
fn resumed_first_part() -> StreamParser {
    let data = stream("postcopy/resumed.first");
    let mut parser = StreamParser::new();
    let mut buf = BytesMut::from(&data[..]);
    while parser.next_item(&mut buf).unwrap().is_some() {}
    assert_eq!(
        parser.postcopy(),
        Postcopy::Running,
        "the cut came after the switch"
    );
    parser
}

/// The (block, offset) of every page record in `items`.
fn pages_of(items: &[Item], into: &mut HashSet<(Bytes, u64)>, block: &mut Option<Bytes>) {
    for item in items {
        if let Item::Ram(r) = item {
            if r.block.is_some() {
                block.clone_from(&r.block);
            }
            if !matches!(r.data, RamData::None) {
                into.insert((block.clone().expect("a named block"), r.offset));
            }
        }
    }
}

#[test]
fn a_resumed_postcopy_stream_reemits_and_with_the_first_delivers_every_page() {
    let first = resumed_first_part();
    let layout = first.ram_layout().expect("the RAM setup passed");
    assert!(
        layout.blocks.iter().any(|b| b.name == "pc.ram"),
        "{layout:?}"
    );
    let data = stream("postcopy/resumed.second");
    // No header: postcopy recovery's bitmap requests come first.
    assert_eq!(&data[..3], &[0x08, 0, 10]);
    let (items, out) =
        parse_chunked_with(StreamParser::resumed(&layout).unwrap(), &data, &[7, 4096]).unwrap();
    assert_eq!(out, data);

    // What crossed before the cut and what the resumed stream sent cover every page of every
    // block at least once: the destination QEMU's bitmaps told the source what it lacked.
    let data = stream("postcopy/resumed.first");
    let (mut seen, mut block) = (HashSet::new(), None);
    let mut parser = StreamParser::new();
    let mut buf = BytesMut::from(&data[..]);
    let mut before = Vec::new();
    while let Some(item) = parser.next_item(&mut buf).unwrap() {
        before.push(item);
    }
    pages_of(&before, &mut seen, &mut block);
    let crossed_before = seen.len();
    pages_of(&items, &mut seen, &mut None);
    let sizes: HashMap<_, _> = layout
        .blocks
        .iter()
        .map(|b| (b.name.as_str(), b.size))
        .collect();
    let all: u64 = sizes.values().map(|size| size / PAGE_SIZE as u64).sum();
    assert_eq!(
        seen.len() as u64,
        all,
        "pages before the cut: {crossed_before}"
    );
    assert!(
        crossed_before + 1000 < seen.len(),
        "the resumed stream brought the rest: {crossed_before} of {all} before the cut"
    );
}

#[test]
fn a_resumed_stream_needs_its_layout_and_its_commands_stay_in_it() {
    let layout = resumed_first_part().ram_layout().unwrap();
    let data = stream("postcopy/resumed.second");
    // Read as a first stream: no header.
    assert!(matches!(
        parse_chunked(&data, &[4096]),
        Err(StreamError::BadMagic(_))
    ));
    // A layout without the block the pages name.
    let without_ram = RamLayout {
        blocks: layout
            .blocks
            .iter()
            .filter(|b| b.name != "pc.ram")
            .cloned()
            .collect(),
        ..layout.clone()
    };
    let parser = StreamParser::resumed(&without_ram).unwrap();
    assert_eq!(
        parse_chunked_with(parser, &data, &[4096]).unwrap_err(),
        StreamError::UnknownBlock("pc.ram".into())
    );
    // A layout from a peer is capped like a stream's own block list.
    let named = |name: String| RamBlock { name, size: 4096 };
    for bad in [
        RamLayout {
            section: 1,
            blocks: vec![],
        },
        RamLayout {
            section: 1,
            blocks: (0..1025).map(|i| named(format!("b{i}"))).collect(),
        },
        RamLayout {
            section: 1,
            blocks: vec![named("x".into()), named("x".into())],
        },
        RamLayout {
            section: 1,
            blocks: vec![named("y".repeat(256))],
        },
    ] {
        assert!(
            matches!(StreamParser::resumed(&bad), Err(StreamError::BadLayout(_))),
            "{} blocks",
            bad.blocks.len()
        );
    }
    // RESUME in a first stream, a package in a resumed one.
    let mut parser = StreamParser::new();
    let mut buf = BytesMut::from(&stream_of(&[0x08, 0, 9, 0, 0])[..]);
    let e = loop {
        match parser.next_item(&mut buf) {
            Ok(Some(_)) => {}
            Ok(None) => panic!("wants more"),
            Err(e) => break e,
        }
    };
    assert!(matches!(e, StreamError::MisplacedCommand(9, _)), "{e}");
    let mut parser = StreamParser::resumed(&layout).unwrap();
    let mut buf = BytesMut::from(&[0x08, 0, 7, 0, 4, 0, 0, 0, 1][..]);
    assert!(matches!(
        parser.next_item(&mut buf),
        Err(StreamError::MisplacedCommand(7, _))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Whatever sizes the socket delivers, the same bytes come out.
    #[test]
    fn any_chunking_reemits_the_same_bytes(
        chunks in prop::collection::vec(1usize..9000, 1..16),
        which in 0usize..3,
    ) {
        let data = stream(["idle", "running", "postcopy/running"][which]);
        let (_, out) = parse_chunked(&data, &chunks).unwrap();
        prop_assert_eq!(out, data);
    }
}

#[test]
fn bad_magic_is_named() {
    let mut data = stream("idle");
    data[0] = b'X';
    let err = parse_chunked(&data, &[4096]).unwrap_err();
    assert!(
        err.to_string().contains("not a QEMU migration stream"),
        "{err}"
    );
}

#[test]
fn unknown_section_type_is_named_with_its_offset() {
    let mut data = stream("idle");
    // Right after the configuration (4 + 4 + 1 + 4 + 11 bytes) comes SECTION_START.
    assert_eq!(data[24], 0x01);
    data[24] = 0x42;
    let err = parse_chunked(&data, &[1000]).unwrap_err();
    assert_eq!(err, StreamError::UnknownSection { kind: 0x42, at: 24 });
    assert_eq!(
        err.to_string(),
        "unknown section type 0x42 at stream offset 24"
    );
}

#[test]
fn unknown_ram_flag_stops_the_parse() {
    let data = stream("running");
    // Find the first page record after the setup and set the (removed) compression flag.
    let (items, _) = parse_chunked(&data, &[data.len()]).unwrap();
    let mut at = 0;
    for item in &items {
        if let Item::Ram(r) = item {
            if matches!(r.data, RamData::Page(_)) {
                break;
            }
        }
        at += item.encoded_len();
    }
    let mut bad = data.clone();
    bad[at + 6] |= 0x01; // flags 0x100 live in byte 6 of the be64 word
    let err = parse_chunked(&bad, &[65536]).unwrap_err();
    assert!(
        matches!(err, StreamError::UnsupportedRamFlags { at: a, .. } if a == at as u64),
        "{err}"
    );
}

#[test]
fn truncated_stream_is_reported() {
    let data = stream("running");
    let err = parse_chunked(&data[..200_000], &[65536]).unwrap_err();
    assert_eq!(err.to_string(), "the stream ended inside a RAM section");
}

#[test]
fn device_state_before_ram_ends_is_refused() {
    // QEVM v3, then a SECTION_FULL for "apic" right away.
    let mut data = b"QEVM\0\0\0\x03".to_vec();
    data.extend_from_slice(&[0x04, 0, 0, 0, 9, 4]);
    data.extend_from_slice(b"apic");
    data.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 3]);
    let err = parse_chunked(&data, &[7]).unwrap_err();
    assert_eq!(err, StreamError::EarlyDevice("apic".into()));
}

/// QEVM v3, then `rest`.
fn stream_of(rest: &[u8]) -> Vec<u8> {
    let mut data = b"QEVM\0\0\0\x03".to_vec();
    data.extend_from_slice(rest);
    data
}

#[test]
fn a_stream_with_dirty_bitmaps_reemits_and_keeps_each_chunk_whole() {
    let data = stream("bitmaps");
    for chunks in [&[data.len()][..], &[1, 7, 4096], &[13]] {
        let (items, out) = parse_chunked(&data, chunks).unwrap();
        assert_eq!(out, data, "chunks {chunks:?}");
        // The bitmaps' section ends (its END header, section id 2) with each bitmap's 16
        // chunks of bits (64 MiB at 512-byte granularity, 4 MiB a chunk), a COMPLETE for each
        // and the EOS, every chunk an item of its own.
        let opaque: Vec<&[u8]> = items
            .iter()
            .map(|item| match item {
                Item::Opaque(bytes) => &bytes[..],
                Item::Ram(_) => &[][..],
            })
            .collect();
        let end = opaque
            .iter()
            .position(|b| *b == [0x03, 0, 0, 0, 2])
            .expect("the bitmaps' END");
        let body: Vec<u8> = opaque[end + 1..]
            .iter()
            .take_while(|b| **b != [0x7e, 0, 0, 0, 2])
            .map(|b| b[0])
            .collect();
        let bits = |f: &u8| f & 0x40 != 0 && f & 0x20 == 0;
        assert_eq!(body.len(), 2 * 16 + 2 + 1, "{body:x?}");
        assert_eq!(body.iter().filter(|f| bits(f)).count(), 32, "{body:x?}");
        // The bits the capture set: three chunks of "recording", one of "kept".
        let with_bits = body.iter().filter(|f| bits(f) && *f & 0x02 == 0).count();
        assert_eq!(with_bits, 4, "{body:x?}");
        assert_eq!(body.last(), Some(&0x01));
    }
}

/// A stream whose dirty-bitmap section (id 2) starts with `chunk`: the section's header, the
/// chunk, and nothing after.
fn bitmap_section_of(chunk: &[u8]) -> Vec<u8> {
    let mut rest = vec![0x01, 0, 0, 0, 2, 12];
    rest.extend_from_slice(b"dirty-bitmap");
    rest.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 1]);
    rest.extend_from_slice(chunk);
    stream_of(&rest)
}

#[test]
fn damaged_dirty_bitmap_chunks_are_refused_with_their_place() {
    // Flags with the top bit: longer flags, which QEMU never writes.
    let err = parse_chunked(&bitmap_section_of(&[0x81, 0]), &[5]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "dirty-bitmap chunk with flags 0x81 at stream offset 34, which QEMU does not write"
    );
    // Bits announcing 1 MiB of bitmap in one chunk.
    let mut chunk = vec![0x4c, 1, b'd', 1, b'b'];
    chunk.extend_from_slice(&0u64.to_be_bytes());
    chunk.extend_from_slice(&8u32.to_be_bytes());
    chunk.extend_from_slice(&(1u64 << 20).to_be_bytes());
    let err = parse_chunked(&bitmap_section_of(&chunk), &[3]).unwrap_err();
    assert_eq!(
        err,
        StreamError::BitmapChunkTooLarge {
            size: 1 << 20,
            limit: 10 << 10,
            at: 34
        }
    );
    // A section cut inside its chunks, or between its EOS and its footer.
    for cut in [&[0x1c, 1, b'd'][..], &[0x01]] {
        let err = parse_chunked(&bitmap_section_of(cut), &[7]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the stream ended inside a dirty-bitmap section"
        );
    }
}

#[test]
fn iterable_sections_other_than_ram_and_one_of_dirty_bitmaps_are_refused() {
    let err = parse_chunked(
        &stream_of(&[
            0x01, 0, 0, 0, 3, 5, b'b', b'l', b'o', b'c', b'k', 0, 0, 0, 0, 0, 0, 0, 1,
        ]),
        &[64],
    )
    .unwrap_err();
    assert_eq!(err, StreamError::UnsupportedIterable("block".into()));
    // A dirty-bitmap section whose body ended (EOS, footer), then a second one.
    let mut second = bitmap_section_of(&[0x01, 0x7e, 0, 0, 0, 2]);
    second.extend_from_slice(&bitmap_section_of(&[])[8..]);
    let err = parse_chunked(&second, &[64]).unwrap_err();
    assert_eq!(err, StreamError::UnsupportedIterable("dirty-bitmap".into()));
    // The RAM's section under the bitmaps' id.
    let mut same_id = bitmap_section_of(&[0x01, 0x7e, 0, 0, 0, 2]);
    same_id.extend_from_slice(&[
        0x01, 0, 0, 0, 2, 3, b'r', b'a', b'm', 0, 0, 0, 0, 0, 0, 0, 4,
    ]);
    let err = parse_chunked(&same_id, &[64]).unwrap_err();
    assert_eq!(err, StreamError::UnsupportedIterable("ram".into()));
    // Set up in a resumed stream, which continues sections and starts none.
    let layout = RamLayout {
        section: 1,
        blocks: vec![RamBlock {
            name: "pc.ram".into(),
            size: 1 << 20,
        }],
    };
    let resumed = StreamParser::resumed(&layout).unwrap();
    let err = parse_chunked_with(resumed, &bitmap_section_of(&[])[8..], &[64]).unwrap_err();
    assert_eq!(err, StreamError::UnsupportedIterable("dirty-bitmap".into()));
}

#[test]
fn device_state_before_the_dirty_bitmaps_end_is_refused() {
    // The captured stream up to the bitmaps' END, then a device section.
    let data = stream("bitmaps");
    let end = data
        .windows(5)
        .rposition(|w| w == [0x03, 0, 0, 0, 2])
        .expect("the bitmaps' END");
    let mut early = data[..end].to_vec();
    early.extend_from_slice(&[0x04, 0, 0, 0, 9, 4]);
    early.extend_from_slice(b"apic");
    early.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 3]);
    // Where the RAM has ended already: only the open bitmaps make it early.
    let err = parse_chunked(&early, &[4096]).unwrap_err();
    assert_eq!(err, StreamError::EarlyDevice("apic".into()));
}

#[test]
fn a_configuration_longer_than_any_qemu_writes_is_refused_before_it_is_buffered() {
    // A configuration section announcing 2 GiB of machine type.
    let data = stream_of(&[0x07, 0x7f, 0xff, 0xff, 0xff]);
    let err = parse_chunked(&data, &[3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "an item at stream offset 8 is larger than the 1048576 bytes ferry holds for one"
    );
}

#[test]
fn a_capability_count_beyond_the_cap_is_refused() {
    let mut rest = vec![0x07, 0, 0, 0, 2, b'p', b'c', 0x05];
    let name = b"configuration/capabilities";
    rest.push(u8::try_from(name.len()).unwrap());
    rest.extend_from_slice(name);
    rest.extend_from_slice(&1u32.to_be_bytes()); // version
    rest.extend_from_slice(&1_000_000u32.to_be_bytes()); // count
    let err = parse_chunked(&stream_of(&rest), &[1]).unwrap_err();
    assert_eq!(
        err,
        StreamError::TooMany {
            what: "capabilities",
            count: 1_000_000,
            limit: 256,
            at: 8
        }
    );
}

#[test]
fn a_ram_block_list_beyond_the_cap_is_refused() {
    // SECTION_START "ram", then a MEM_SIZE word announcing 1 TiB and blocks of one page each.
    let mut rest = vec![0x01, 0, 0, 0, 1, 3, b'r', b'a', b'm'];
    rest.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 4]);
    rest.extend_from_slice(&((1u64 << 40) | flag::MEM_SIZE).to_be_bytes());
    for i in 0..2000 {
        let name = format!("block{i}");
        rest.push(u8::try_from(name.len()).unwrap());
        rest.extend_from_slice(name.as_bytes());
        rest.extend_from_slice(&4096u64.to_be_bytes());
    }
    let err = parse_chunked(&stream_of(&rest), &[4096]).unwrap_err();
    assert!(
        matches!(
            err,
            StreamError::TooMany {
                what: "RAM blocks",
                count: 1025,
                limit: 1024,
                ..
            }
        ),
        "{err}"
    );
}
