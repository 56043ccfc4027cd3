//! The encoder and the decoder, driven by the same sequence of pages, must give back every
//! page exactly, with any mix of techniques, through caches that wrap around, and when every
//! block hash collides.

use ferry_codec::{
    compress_batch, decompress_batch, index_image, Decoder, Encoder, Options, PageKind, SeedImage,
    SeedIndex, BLOCK_SIZE, PAGE_SIZE,
};
use proptest::prelude::*;

/// A page drawn from a few families that occur in guest memory.
#[derive(Debug, Clone)]
enum Shape {
    Zero,
    /// One byte value everywhere.
    Fill(u8),
    /// Pseudo-random bytes from a seed.
    Noise(u64),
    /// A copy of an earlier page of the sequence.
    CopyOf(usize),
    /// An earlier page of the sequence with a few bytes changed.
    Edit(usize, Vec<(u16, u8)>),
    /// Blocks of earlier pages shuffled together.
    Blocks([usize; 4]),
}

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

fn build(shapes: &[(u64, Shape)]) -> Vec<(u64, Vec<u8>)> {
    let mut pages: Vec<(u64, Vec<u8>)> = Vec::new();
    for (key, shape) in shapes {
        let earlier = |i: usize, pages: &Vec<(u64, Vec<u8>)>| {
            if pages.is_empty() {
                vec![0u8; PAGE_SIZE]
            } else {
                pages[i % pages.len()].1.clone()
            }
        };
        let page = match shape {
            Shape::Zero => vec![0u8; PAGE_SIZE],
            Shape::Fill(b) => vec![*b; PAGE_SIZE],
            Shape::Noise(seed) => noise(*seed),
            Shape::CopyOf(i) => earlier(*i, &pages),
            Shape::Edit(i, edits) => {
                let mut p = earlier(*i, &pages);
                for (at, v) in edits {
                    p[usize::from(*at) % PAGE_SIZE] = *v;
                }
                p
            }
            Shape::Blocks(from) => {
                let mut p = vec![0u8; PAGE_SIZE];
                for (b, i) in from.iter().enumerate() {
                    let src = earlier(*i, &pages);
                    p[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE]
                        .copy_from_slice(&src[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE]);
                }
                p
            }
        };
        pages.push((*key, page));
    }
    pages
}

fn shape() -> impl Strategy<Value = Shape> {
    prop_oneof![
        Just(Shape::Zero),
        any::<u8>().prop_map(Shape::Fill),
        any::<u64>().prop_map(Shape::Noise),
        any::<usize>().prop_map(Shape::CopyOf),
        (
            any::<usize>(),
            prop::collection::vec(any::<(u16, u8)>(), 1..40)
        )
            .prop_map(|(i, e)| Shape::Edit(i, e)),
        any::<[usize; 4]>().prop_map(Shape::Blocks),
    ]
}

fn options() -> impl Strategy<Value = Options> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0usize..40,
        0usize..20,
        0usize..PAGE_SIZE,
    )
        .prop_map(
            |(zero, dedup, delta, cache_blocks, history_pages, limit)| Options {
                zero,
                dedup,
                delta,
                // Small caches, so that the rings wrap and the history evicts within a case.
                cache_bytes: cache_blocks * BLOCK_SIZE,
                history_bytes: history_pages * PAGE_SIZE,
                delta_limit: limit,
            },
        )
}

/// Encodes every page in batches of `batch` records, decodes them, and checks each.
fn roundtrip(pages: &[(u64, Vec<u8>)], enc: Encoder, dec: Decoder, batch: usize) -> Vec<PageKind> {
    roundtrip_pausing(pages, enc, dec, batch, &[])
}

/// [`roundtrip`] with the block cache paused at both ends for batch i when `paused[i %
/// paused.len()]` (never when empty), as a batch's framing would say.
fn roundtrip_pausing(
    pages: &[(u64, Vec<u8>)],
    mut enc: Encoder,
    mut dec: Decoder,
    batch: usize,
    paused: &[bool],
) -> Vec<PageKind> {
    let mut kinds = Vec::new();
    for (i, chunk) in pages.chunks(batch.max(1)).enumerate() {
        let pause = !paused.is_empty() && paused[i % paused.len()];
        enc.set_cache_paused(pause);
        dec.set_cache_paused(pause);
        let mut records = Vec::new();
        for (key, page) in chunk {
            kinds.push(enc.encode(*key, page, &mut records));
        }
        let mut wire = Vec::new();
        compress_batch(&records, Some(1), &mut wire);
        let records = decompress_batch(&wire).unwrap();
        let mut input = records.as_slice();
        let mut out = [0u8; PAGE_SIZE];
        for (key, page) in chunk {
            let (got_key, _) = dec.decode(&mut input, &mut out).unwrap();
            assert_eq!(got_key, *key);
            assert!(out.as_slice() == page.as_slice(), "page {key:#x} differs");
        }
        assert!(input.is_empty(), "records left over");
    }
    kinds
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_page_comes_back_exactly(
        opts in options(),
        shapes in prop::collection::vec((0u64..24, shape()), 1..120),
        batch in 1usize..20,
    ) {
        let pages = build(&shapes);
        roundtrip(&pages, Encoder::new(opts), Decoder::new(opts), batch);
    }

    #[test]
    fn seeded_pages_come_back_exactly(
        opts in options(),
        seed_shapes in prop::collection::vec((0u64..24, shape()), 1..40),
        shapes in prop::collection::vec((0u64..24, shape()), 1..80),
        batch in 1usize..20,
    ) {
        // The receiver holds an image; the pages that follow share some of its content
        // (copies and edits of its pages) and not the rest.
        let image: Vec<u8> = build(&seed_shapes).into_iter().flat_map(|(_, p)| p).collect();
        let mut all = seed_shapes.clone();
        all.extend(shapes);
        let pages = build(&all);
        let (index, _) = index_image(&image);
        let mut enc = Encoder::new(opts);
        enc.set_seed(SeedIndex::parse(&index).unwrap());
        let mut dec = Decoder::new(opts);
        dec.set_seed(SeedImage::new(image));
        roundtrip(&pages[seed_shapes.len()..], enc, dec, batch);
    }

    #[test]
    fn every_page_comes_back_exactly_with_the_cache_paused_and_resumed(
        opts in options(),
        shapes in prop::collection::vec((0u64..24, shape()), 1..120),
        batch in 1usize..20,
        paused in prop::collection::vec(any::<bool>(), 1..8),
    ) {
        let pages = build(&shapes);
        let kinds = roundtrip_pausing(&pages, Encoder::new(opts), Decoder::new(opts), batch, &paused);
        // Paused, no page names the cache.
        for (i, kind) in kinds.iter().enumerate() {
            if paused[(i / batch) % paused.len()] {
                prop_assert_ne!(*kind, PageKind::Blocks);
            }
        }
    }

    #[test]
    fn colliding_hashes_never_substitute_a_block(
        shapes in prop::collection::vec((0u64..24, shape()), 1..80),
    ) {
        // Every block hashes alike: each lookup finds a candidate, and only the byte
        // comparison stands between it and a wrong page.
        let opts = Options { cache_bytes: 16 * BLOCK_SIZE, ..Options::default() };
        let pages = build(&shapes);
        roundtrip(&pages, Encoder::with_hasher(opts, |_| 7), Decoder::with_hasher(opts, |_| 7), 8);
    }
}

#[test]
fn a_paused_cache_keeps_what_it_held_and_learns_nothing() {
    let opts = Options {
        delta: false,
        ..Options::default()
    };
    let (before, during) = (noise(1), noise(2));
    // A page of a block seen before the pause and one seen only during it.
    let mut mixed = noise(3);
    mixed[..BLOCK_SIZE].copy_from_slice(&before[..BLOCK_SIZE]);
    mixed[BLOCK_SIZE..2 * BLOCK_SIZE].copy_from_slice(&during[..BLOCK_SIZE]);
    let pages = vec![(1, before.clone()), (2, during), (3, before), (4, mixed)];
    // Batches of one page: the second and third go with the cache paused.
    let kinds = roundtrip_pausing(
        &pages,
        Encoder::new(opts),
        Decoder::new(opts),
        1,
        &[false, true, true, false],
    );
    assert_eq!(
        kinds,
        [
            PageKind::Raw,
            PageKind::Raw,
            PageKind::Raw,
            PageKind::Blocks
        ]
    );
    // The last page found only the block from before the pause.
    let mut enc = Encoder::new(opts);
    let mut records = Vec::new();
    enc.encode(1, &pages[0].1, &mut records);
    enc.set_cache_paused(true);
    enc.encode(2, &pages[1].1, &mut records);
    enc.set_cache_paused(false);
    enc.encode(4, &pages[3].1, &mut records);
    assert_eq!(enc.stats().block_hits, 1);
}

#[test]
fn each_technique_does_its_job() {
    let text: Vec<u8> = b"GNU C compiler output, symbol tables and page cache. "
        .iter()
        .copied()
        .cycle()
        .take(PAGE_SIZE)
        .collect();
    let mut edited = text.clone();
    edited[1000..1004].copy_from_slice(b"1234");
    let mut moved = noise(5);
    moved[..BLOCK_SIZE].copy_from_slice(&text[..BLOCK_SIZE]);
    let pages = vec![
        (1, vec![0u8; PAGE_SIZE]),
        (2, text.clone()),
        (2, text.clone()),
        (2, edited),
        (3, text.clone()),
        (4, moved),
    ];
    let kinds = roundtrip(
        &pages,
        Encoder::new(Options::default()),
        Decoder::new(Options::default()),
        3,
    );
    assert_eq!(
        kinds,
        vec![
            PageKind::Zero,
            PageKind::Raw,
            PageKind::Unchanged,
            PageKind::Delta,
            PageKind::Blocks, // the same text under another key: all four blocks cached
            PageKind::Blocks, // one block of text, three of noise
        ]
    );
    let mut records = Vec::new();
    let mut enc = Encoder::new(Options::none());
    for (key, page) in &pages {
        assert_eq!(enc.encode(*key, page, &mut records), PageKind::Raw);
    }
}

#[test]
fn pages_the_receiver_holds_go_as_references() {
    let held = noise(3);
    let mut image = vec![0u8; PAGE_SIZE];
    image.extend_from_slice(&held);
    let (index, entries) = index_image(&image);
    assert_eq!(entries, 1, "zero pages are not indexed");
    let mut enc = Encoder::new(Options::default());
    enc.set_seed(SeedIndex::parse(&index).unwrap());
    let mut dec = Decoder::new(Options::default());
    dec.set_seed(SeedImage::new(image));
    let pages = vec![
        (5, held.clone()),
        (5, held.clone()),
        (6, held.clone()),
        (7, noise(4)),
    ];
    let kinds = roundtrip(&pages, enc, dec, 4);
    assert_eq!(
        kinds,
        vec![
            PageKind::Seeded,
            PageKind::Unchanged,
            PageKind::Seeded,
            PageKind::Raw
        ]
    );
    // A decoder without the image refuses the reference.
    let mut enc = Encoder::new(Options::default());
    enc.set_seed(SeedIndex::parse(&index).unwrap());
    let mut record = Vec::new();
    enc.encode(5, &held, &mut record);
    let err = Decoder::new(Options::default())
        .decode(&mut record.as_slice(), &mut [0u8; PAGE_SIZE])
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "reference to seed page 1, which the receiver's image does not hold"
    );
}

#[test]
fn a_decoder_out_of_step_fails_instead_of_guessing() {
    let opts = Options::default();
    let mut enc = Encoder::new(opts);
    let page = noise(1);
    let mut first = Vec::new();
    enc.encode(9, &page, &mut first);
    let mut edited = page.clone();
    edited[10] ^= 1;
    let mut second = Vec::new();
    assert_eq!(enc.encode(9, &edited, &mut second), PageKind::Delta);
    // A decoder that missed the first record has no base for the delta.
    let mut dec = Decoder::new(opts);
    let mut out = [0u8; PAGE_SIZE];
    let err = dec.decode(&mut second.as_slice(), &mut out).unwrap_err();
    assert_eq!(
        err.to_string(),
        "delta for page 0x9, which the decoder has no earlier version of"
    );
    // Garbage is refused, whatever it is.
    for bad in [
        &[77u8, 1][..],
        &[0, 1, 2, 3],
        &[4, 1, 0xff],
        &[4, 1, 1, 200, 0, 0, 0],
    ] {
        assert!(
            dec.decode(&mut &bad[..], &mut out).is_err(),
            "{bad:?} decoded"
        );
    }
}
