//! Page records: each 4 KiB page as the cheapest of zero, unchanged, delta, blocks from the
//! cache, or raw bytes. The [`Encoder`] and the [`Decoder`] each own a [`Dictionary`] and
//! update it identically, record by record.
//!
//! Record format (all integers LEB128 varints unless said otherwise):
//!
//! | tag | then |
//! |---|---|
//! | 0 raw | key, 4096 bytes |
//! | 1 zero | key |
//! | 2 unchanged | key (identical to the version the decoder has) |
//! | 3 delta | key, length, XOR run-length delta against the decoder's version ([`crate::rle`]) |
//! | 4 blocks | key, a mask byte (bit i: block i is a cache reference), then per block a u32 slot (little endian) or its 1024 bytes |
//! | 5 seed | key, the page number in the receiver's seed image holding this content ([`crate::seed`]) |
//!
//! Order of checks, per page: zero; unchanged; in the seed (when the receiver gave an index); a delta under the threshold (unless every
//! block is in the cache); otherwise blocks (some or all from the cache) or raw. After any record except zero and unchanged,
//! the blocks that missed the cache are inserted, in order; after any record the page becomes
//! the key's version in the history (a zero page is forgotten instead).
//!
//! The block cache can be **paused** (both ends at the same record, which the caller's framing
//! says): paused, pages are neither looked up nor inserted, so the cache stays as it was and
//! resuming is consistent. Deltas and the history go on as before.

use std::sync::Arc;

use crate::dictionary::{BlockCache, BlockHasher, PageHistory, Slot};
use crate::seed::{SeedImage, SeedIndex};
use crate::{rle, varint, CodecError, Options, BLOCK_SIZE, PAGE_SIZE};

const BLOCKS: usize = PAGE_SIZE / BLOCK_SIZE;

const TAG_RAW: u8 = 0;
const TAG_ZERO: u8 = 1;
const TAG_UNCHANGED: u8 = 2;
const TAG_DELTA: u8 = 3;
const TAG_BLOCKS: u8 = 4;
const TAG_SEED: u8 = 5;

/// How a page was sent, for statistics and ablations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    Raw,
    Zero,
    Unchanged,
    Delta,
    Blocks,
    /// A reference to the receiver's seed image.
    Seeded,
}

/// Counts per kind and bytes in and out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageStats {
    pub pages: u64,
    pub raw: u64,
    pub zero: u64,
    pub unchanged: u64,
    pub delta: u64,
    pub blocks: u64,
    pub seeded: u64,
    /// Cache references sent inside block records.
    pub block_hits: u64,
    pub bytes_out: u64,
}

impl PageStats {
    fn count(&mut self, kind: PageKind, bytes: usize) {
        self.pages += 1;
        self.bytes_out += bytes as u64;
        *match kind {
            PageKind::Raw => &mut self.raw,
            PageKind::Zero => &mut self.zero,
            PageKind::Unchanged => &mut self.unchanged,
            PageKind::Delta => &mut self.delta,
            PageKind::Blocks => &mut self.blocks,
            PageKind::Seeded => &mut self.seeded,
        } += 1;
    }
}

/// The state both ends keep identical.
#[derive(Debug)]
struct Dictionary {
    options: Options,
    cache: BlockCache,
    history: PageHistory,
    /// The block cache is neither read nor written (see the module's documentation).
    cache_paused: bool,
}

impl Dictionary {
    fn new(options: Options, hasher: BlockHasher) -> Dictionary {
        let cache_bytes = if options.dedup {
            options.cache_bytes
        } else {
            0
        };
        let history_bytes = if options.delta {
            options.history_bytes
        } else {
            0
        };
        Dictionary {
            cache: BlockCache::new(cache_bytes, hasher),
            history: PageHistory::new(history_bytes),
            options,
            cache_paused: false,
        }
    }

    /// Whether pages are looked up in and added to the block cache now.
    fn uses_cache(&self) -> bool {
        self.cache.enabled() && !self.cache_paused
    }

    /// Each block's hash and its slot if the cache has it (looked up before any insertion).
    fn lookup(&self, page: &[u8]) -> [(u64, Option<Slot>); BLOCKS] {
        std::array::from_fn(|i| {
            let block = &page[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            let hash = self.cache.hash(block);
            (hash, self.cache.find(hash, block))
        })
    }

    /// The update after a record, the same at both ends.
    fn remember(
        &mut self,
        key: u64,
        page: &[u8],
        kind: PageKind,
        found: Option<&[(u64, Option<Slot>); BLOCKS]>,
    ) {
        if kind == PageKind::Zero {
            self.history.forget(key);
            return;
        }
        for (i, (hash, slot)) in found.into_iter().flatten().enumerate() {
            if slot.is_none() {
                self.cache
                    .insert(*hash, &page[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]);
            }
        }
        if kind != PageKind::Unchanged {
            self.history.record(key, page);
        }
    }
}

/// Turns pages into records.
#[derive(Debug)]
pub struct Encoder {
    dict: Dictionary,
    stats: PageStats,
    /// What the receiver's seed image holds, if it gave an index.
    seed: Option<Arc<SeedIndex>>,
}

impl Encoder {
    pub fn new(options: Options) -> Encoder {
        Encoder::with_hasher(options, crate::dictionary::xxh3)
    }

    /// With another block hash (tests force collisions with it). Both ends must use the same.
    pub fn with_hasher(options: Options, hasher: BlockHasher) -> Encoder {
        Encoder {
            dict: Dictionary::new(options, hasher),
            stats: PageStats::default(),
            seed: None,
        }
    }

    /// From now on, pages whose content the receiver's seed image holds go as references to
    /// it (the receiver's [`Decoder::set_seed`] must have the image the index was made from).
    /// The index may be shared by several encoders (the shards of one stream).
    pub fn set_seed(&mut self, index: impl Into<Arc<SeedIndex>>) {
        self.seed = Some(index.into());
    }

    pub fn stats(&self) -> &PageStats {
        &self.stats
    }

    /// Pauses or resumes the block cache from the next page on; the decoder must do the same
    /// at the same record.
    pub fn set_cache_paused(&mut self, paused: bool) {
        self.dict.cache_paused = paused;
    }

    /// Appends `page`'s record to `out` and returns how it was sent. `key` names the page
    /// (a guest-physical page, a disk block): the same key for the same page, every time.
    pub fn encode(&mut self, key: u64, page: &[u8], out: &mut Vec<u8>) -> PageKind {
        assert_eq!(page.len(), PAGE_SIZE, "pages are {PAGE_SIZE} bytes");
        let start = out.len();
        let zero = self.dict.options.zero && is_zero(page);
        let unchanged = !zero
            && self
                .dict
                .history
                .get(key)
                .is_some_and(|b| b.as_slice() == page);
        // Zero and unchanged pages neither use nor change the block cache.
        let found = (self.dict.uses_cache() && !zero && !unchanged).then(|| self.dict.lookup(page));
        let seeded = (!zero && !unchanged)
            .then(|| self.seed.as_ref()?.find(page))
            .flatten();
        let kind = if zero {
            out.push(TAG_ZERO);
            varint::put(out, key);
            PageKind::Zero
        } else if unchanged {
            out.push(TAG_UNCHANGED);
            varint::put(out, key);
            PageKind::Unchanged
        } else if let Some(seed_page) = seeded {
            out.push(TAG_SEED);
            varint::put(out, key);
            varint::put(out, seed_page);
            PageKind::Seeded
        } else {
            self.write_record(key, page, found.as_ref(), out)
        };
        if kind == PageKind::Blocks {
            let hits = found.iter().flatten().filter(|(_, s)| s.is_some()).count();
            self.stats.block_hits += hits as u64;
        }
        self.dict.remember(key, page, kind, found.as_ref());
        self.stats.count(kind, out.len() - start);
        kind
    }

    /// Writes the cheapest record for a page that is neither zero nor unchanged; changes
    /// nothing else.
    fn write_record(
        &self,
        key: u64,
        page: &[u8],
        found: Option<&[(u64, Option<Slot>); BLOCKS]>,
        out: &mut Vec<u8>,
    ) -> PageKind {
        let opts = &self.dict.options;
        let start = out.len();
        let base = self.dict.history.get(key);
        let hits = found.map_or(0, |f| f.iter().filter(|(_, s)| s.is_some()).count());
        if let (Some(base), true) = (base, hits < BLOCKS) {
            out.push(TAG_DELTA);
            varint::put(out, key);
            let mut delta = Vec::with_capacity(opts.delta_limit);
            if rle::encode_delta(base, page, opts.delta_limit, &mut delta) {
                varint::put(out, delta.len() as u64);
                out.extend_from_slice(&delta);
                return PageKind::Delta;
            }
            out.truncate(start);
        }
        match found {
            Some(f) if hits > 0 => {
                out.push(TAG_BLOCKS);
                varint::put(out, key);
                let mask = f
                    .iter()
                    .enumerate()
                    .fold(0u8, |m, (i, (_, s))| m | (u8::from(s.is_some()) << i));
                out.push(mask);
                for (i, (_, slot)) in f.iter().enumerate() {
                    match slot {
                        Some(slot) => out.extend_from_slice(&slot.to_le_bytes()),
                        None => {
                            out.extend_from_slice(&page[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]);
                        }
                    }
                }
                PageKind::Blocks
            }
            _ => {
                out.push(TAG_RAW);
                varint::put(out, key);
                out.extend_from_slice(page);
                PageKind::Raw
            }
        }
    }
}

/// Turns records back into pages.
#[derive(Debug)]
pub struct Decoder {
    dict: Dictionary,
    seed: SeedImage,
}

impl Decoder {
    pub fn new(options: Options) -> Decoder {
        Decoder::with_hasher(options, crate::dictionary::xxh3)
    }

    pub fn with_hasher(options: Options, hasher: BlockHasher) -> Decoder {
        Decoder {
            dict: Dictionary::new(options, hasher),
            seed: SeedImage::default(),
        }
    }

    /// The seed image whose index the sender was given.
    pub fn set_seed(&mut self, image: SeedImage) {
        self.seed = image;
    }

    /// Pauses or resumes the block cache from the next record on, where the encoder did.
    pub fn set_cache_paused(&mut self, paused: bool) {
        self.dict.cache_paused = paused;
    }

    /// Decodes the record at the front of `input` into `page`, advancing `input`; returns the
    /// page's key and how it was sent.
    pub fn decode(
        &mut self,
        input: &mut &[u8],
        page: &mut [u8; PAGE_SIZE],
    ) -> Result<(u64, PageKind), CodecError> {
        let (&tag, rest) = input.split_first().ok_or(CodecError::Truncated("record"))?;
        *input = rest;
        let key = varint::get(input)?;
        let kind = match tag {
            TAG_RAW => {
                page.copy_from_slice(take(input, PAGE_SIZE, "raw page")?);
                PageKind::Raw
            }
            TAG_ZERO => {
                page.fill(0);
                PageKind::Zero
            }
            TAG_UNCHANGED => {
                page.copy_from_slice(self.base(key)?);
                PageKind::Unchanged
            }
            TAG_DELTA => {
                let len = usize::try_from(varint::get(input)?).map_err(|_| CodecError::BadDelta)?;
                let delta = take(input, len, "delta")?;
                page.copy_from_slice(self.base(key)?);
                rle::apply_delta(page, delta)?;
                PageKind::Delta
            }
            TAG_BLOCKS => {
                let mask = take(input, 1, "block mask")?[0];
                if mask >> BLOCKS != 0 {
                    return Err(CodecError::BadMask(mask));
                }
                for i in 0..BLOCKS {
                    let dst = &mut page[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
                    if mask & (1 << i) != 0 {
                        let raw = take(input, 4, "block slot")?;
                        let slot = Slot::from_le_bytes(raw.try_into().expect("4 bytes"));
                        let block = self
                            .dict
                            .cache
                            .block(slot)
                            .ok_or(CodecError::UnknownSlot(slot))?;
                        dst.copy_from_slice(block);
                    } else {
                        dst.copy_from_slice(take(input, BLOCK_SIZE, "literal block")?);
                    }
                }
                PageKind::Blocks
            }
            TAG_SEED => {
                let n = varint::get(input)?;
                page.copy_from_slice(self.seed.page(n)?);
                PageKind::Seeded
            }
            other => return Err(CodecError::UnknownTag(other)),
        };
        // The same update the encoder made: look the blocks up as it did, then remember.
        let found = (self.dict.uses_cache()
            && !matches!(kind, PageKind::Zero | PageKind::Unchanged))
        .then(|| self.dict.lookup(page));
        self.dict.remember(key, page, kind, found.as_ref());
        Ok((key, kind))
    }

    fn base(&self, key: u64) -> Result<&[u8; PAGE_SIZE], CodecError> {
        self.dict.history.get(key).ok_or(CodecError::NoBase(key))
    }
}

fn take<'a>(input: &mut &'a [u8], n: usize, what: &'static str) -> Result<&'a [u8], CodecError> {
    if input.len() < n {
        return Err(CodecError::Truncated(what));
    }
    let (head, rest) = input.split_at(n);
    *input = rest;
    Ok(head)
}

/// Whether every byte of `page` is zero, eight at a time.
pub fn is_zero(page: &[u8]) -> bool {
    let (pre, words, post) = {
        // SAFETY: u64 has no invalid bit patterns; align_to only reinterprets the aligned middle.
        unsafe { page.align_to::<u64>() }
    };
    pre.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && post.iter().all(|&b| b == 0)
}
