//! QEMU's stream on the WAN when the codec is on: the source turns each parsed item into a
//! codec record and the destination turns the records back into exactly the bytes QEMU wrote
//! (both ends hash those bytes, so a codec fault is a digest mismatch, never a wrong page).
//!
//! On the stream channel (bytes, cut into frames anywhere):
//!
//! ```text
//! channel := (le32 length, batch)*            batch: ferry_codec::compress_batch of records
//! record  := 0x00 le32 n, n bytes             QEMU's bytes as they are (headers, markers, devices)
//!          | 0x01 le16 n, n bytes, page       a RAM page: QEMU's record header (address word and
//!                                             block name), then the codec's record of its 4 KiB
//!          | 0x02 page                        a page of a multifd packet: the codec's record of
//!                                             its 4 KiB (the packet's fixed part, which lists
//!                                             the pages' offsets, went before as QEMU's bytes)
//! ```
//!
//! A multifd channel ([`ferry_qemu::multifd`]) is coded on its own, with its own history: QEMU
//! puts a page on whichever channel is free, so a page sent again may find its last version
//! on another channel. Pages QEMU compressed itself travel as they are.
//!
//! A page's codec key is the RAM block's number (in order of first appearance) above its page
//! index, so the page history and the block cache are keyed the same at both ends. Records
//! other than whole pages (QEMU's own zero pages, end-of-section markers) travel as they are:
//! QEMU already made them small.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use ferry_api::agent::{CodecReport, CodecSettings, SeedReport, ZstdLevelReport};
use ferry_codec::shard::shard_of;
use ferry_codec::{
    AdaptiveCompressor, BatchDecompressor, Compressed, Decoder, Encoder, Options, PageKind,
    SeedImage, SeedIndex,
};
use ferry_qemu::multifd;
use ferry_qemu::stream::{Item, RamData, PAGE_SIZE};

const OPAQUE: u8 = 0x00;
const PAGE: u8 = 0x01;
const CHANNEL_PAGE: u8 = 0x02;
/// A batch is compressed and sent once it holds this much (or QEMU has nothing more to read
/// right now): large enough for zstd to find repetition across pages, small next to the
/// send window.
pub const BATCH_BYTES: usize = 1 << 20;
/// A batch is also closed once it carries this much of QEMU's stream (zero and unchanged
/// pages code to a few bytes each): what one batch decodes to at the destination stays
/// bounded.
pub const BATCH_QEMU_BYTES: usize = 16 << 20;
/// The most records a batch holds: the encoder closes it at [`BATCH_BYTES`], after the item
/// that reached it (a page record, or at most an item of QEMU's stream with its header).
pub(crate) const MAX_BATCH_RECORDS: usize = BATCH_BYTES + ferry_qemu::stream::MAX_ITEM_BYTES + 64;
/// The largest length prefix a decoder accepts (a batch plus its header; incompressible
/// records are stored, a few bytes longer).
pub(crate) const MAX_FRAMED: usize = MAX_BATCH_RECORDS + 16;
/// The most QEMU bytes one batch decodes to.
pub(crate) const MAX_BATCH_DECODED: usize = BATCH_QEMU_BYTES + ferry_qemu::stream::MAX_ITEM_BYTES;
/// Page index bits in a codec key; the block number sits above them.
const BLOCK_SHIFT: u32 = 40;

/// The page history never holds more than this, whatever the guest's size.
pub const HISTORY_CAP: u64 = 1 << 30;

/// The page history for a guest of `ram_bytes`: all of its pages up to the cap, so a page
/// sent again finds its last version at both ends.
pub fn history_bytes(ram_bytes: u64) -> u64 {
    ram_bytes.min(HISTORY_CAP)
}

/// The codec's options for the given settings and page history size.
pub fn options(settings: CodecSettings, history_bytes: u64) -> Options {
    Options {
        zero: settings.zero,
        dedup: settings.dedup,
        delta: settings.delta,
        history_bytes: usize::try_from(history_bytes).unwrap_or(usize::MAX),
        ..Options::default()
    }
}

/// Bits of pages sent at least once, per RAM block number: a page sent again is what the last
/// pass carries, so its cost on the wire is what the switchover must plan for.
#[derive(Debug, Default)]
struct SentPages {
    blocks: Vec<Vec<u64>>,
}

impl SentPages {
    /// Marks `key` sent and says whether it was sent before.
    fn mark(&mut self, key: u64) -> bool {
        let (block, page) = (key >> BLOCK_SHIFT, key & ((1 << BLOCK_SHIFT) - 1));
        let (block, word, bit) = (
            usize::try_from(block).expect("block numbers are small"),
            usize::try_from(page / 64).expect("page indices fit in memory"),
            page % 64,
        );
        if self.blocks.len() <= block {
            self.blocks.resize_with(block + 1, Vec::new);
        }
        let bits = &mut self.blocks[block];
        if bits.len() <= word {
            bits.resize(word + 1, 0);
        }
        let before = bits[word] & (1 << bit) != 0;
        bits[word] |= 1 << bit;
        before
    }
}

/// What pages sent again *with new content* cost on the wire per QEMU byte, over recent batches
/// (older batches count less and less). This is what the switchover steering expects QEMU's
/// last pass to cost: that pass carries the pages the guest is rewriting now. Pages resent
/// unchanged (dirtied with the same bytes) are left out: they are nearly free, and a pass
/// reaching a stretch of them drove the estimate from 0.46 to 0.15 in the rewritten-working-set
/// guest's second pass, just before a last pass that cost about 0.5 (its pauses came out
/// 243-313 ms against 300 on that estimate). Should a last pass hold unchanged pages too, the
/// estimate errs high: a slightly later switchover, not a longer pause.
#[derive(Debug, Default)]
struct ResendCost {
    /// In the open batch: QEMU's bytes of resent pages, and their records' bytes.
    batch_qemu: u64,
    batch_records: u64,
    /// Decayed sums over closed batches: QEMU bytes, and wire bytes (records scaled by their
    /// batch's zstd ratio).
    qemu: f64,
    wire: f64,
}

impl ResendCost {
    /// Each closed batch keeps this share of the history before it.
    const DECAY: f64 = 0.8;
    /// Resent bytes needed before the estimate counts.
    const MIN_QEMU_BYTES: f64 = 256.0 * 1024.0;

    fn close_batch(&mut self, zstd_ratio: f64) {
        if self.batch_qemu > 0 {
            self.qemu = self.qemu * Self::DECAY + self.batch_qemu as f64;
            self.wire = self.wire * Self::DECAY + self.batch_records as f64 * zstd_ratio;
        }
        self.batch_qemu = 0;
        self.batch_records = 0;
    }

    fn estimate(&self) -> Option<f64> {
        resend_estimate(self.qemu, self.wire)
    }
}

/// The resend cost from decayed sums of resent pages' QEMU bytes and wire bytes (one
/// encoder's, or several shards' added up); `None` while too few were resent.
pub(crate) fn resend_estimate(qemu: f64, wire: f64) -> Option<f64> {
    (qemu >= ResendCost::MIN_QEMU_BYTES).then(|| wire / qemu)
}

/// Numbers RAM blocks by first appearance and remembers which one `CONTINUE` records mean.
#[derive(Debug, Default)]
pub(crate) struct BlockNumbers {
    numbers: HashMap<Bytes, u64>,
    current: Option<u64>,
}

impl BlockNumbers {
    /// The key of the page at `offset` of `block` (`None`: the block QEMU continues), or
    /// `None` before any block was named.
    pub(crate) fn key(&mut self, block: Option<&Bytes>, offset: u64) -> Option<u64> {
        if let Some(name) = block {
            let next = self.numbers.len() as u64;
            self.current = Some(*self.numbers.entry(name.clone()).or_insert(next));
        }
        Some((self.current? << BLOCK_SHIFT) | (offset / PAGE_SIZE as u64))
    }
}

/// The source's half: items in, framed batches out.
#[derive(Debug)]
pub struct StreamEncoder {
    batches: BatchEncoder,
    blocks: BlockNumbers,
}

impl StreamEncoder {
    pub fn new(settings: CodecSettings, history_bytes: u64, link_rate_mbit: f64) -> StreamEncoder {
        StreamEncoder {
            batches: BatchEncoder::new(settings, options(settings, history_bytes), link_rate_mbit),
            blocks: BlockNumbers::default(),
        }
    }

    /// Pages the destination's seed image holds go as references to it from now on.
    pub fn set_seed(&mut self, index: SeedIndex, offer: SeedReport) {
        self.batches.set_seed(Arc::new(index), offer);
    }

    /// Adds one parsed item; `qemu` is the item's bytes as QEMU wrote them (what both ends
    /// hash).
    pub fn push(&mut self, item: &Item, qemu: &[u8]) {
        self.batches.took(qemu.len());
        if let Item::Ram(record) = item {
            if let RamData::Page(_) = record.data {
                if let Some(key) = self.blocks.key(record.block.as_ref(), record.offset) {
                    let (header, page) = qemu.split_at(qemu.len() - PAGE_SIZE);
                    self.batches.push_page(key, Some(header), page);
                    return;
                }
            } else if let Some(name) = &record.block {
                // Markers and zero pages can name the block that later pages continue.
                self.blocks.key(Some(name), record.offset);
            }
        }
        self.batches.push_opaque(qemu);
    }

    /// Adds one parsed item of a multifd channel; `qemu` is the item's bytes as QEMU wrote
    /// them (what both ends hash).
    pub fn push_channel(&mut self, item: &multifd::Item, qemu: &[u8]) {
        self.batches.took(qemu.len());
        let multifd::Item::Ram(packet) = item else {
            self.batches.push_opaque(qemu);
            return;
        };
        let multifd::Payload::Pages(pages) = &packet.payload else {
            self.batches.push_opaque(qemu);
            return;
        };
        self.batches.push_opaque(&packet.header);
        for (&offset, page) in packet.normal.iter().zip(pages) {
            let key = self
                .blocks
                .key(Some(&packet.block), offset)
                .expect("a named block has a number");
            self.batches.push_page(key, None, page);
        }
    }

    /// Adds one item of a multifd channel as QEMU's bytes, its pages not coded (the test
    /// hook's altered packet: the pages would be coded from the item as parsed).
    pub fn push_channel_as_is(&mut self, qemu: &[u8]) {
        self.batches.took(qemu.len());
        self.batches.push_opaque(qemu);
    }

    /// Bytes of records waiting in the open batch.
    pub fn pending(&self) -> usize {
        self.batches.pending()
    }

    /// Whether the open batch should be closed now: it holds [`BATCH_BYTES`] of records or
    /// [`BATCH_QEMU_BYTES`] of QEMU's stream.
    pub fn is_full(&self) -> bool {
        self.batches.is_full()
    }

    /// Closes the open batch (if any) and appends it, framed, to `out`.
    pub fn flush(&mut self, out: &mut BytesMut) {
        // This framing has no room to say the cache was paused; nothing pauses it here.
        if let Some((batch, _)) = self.batches.close(4) {
            out.put_u32_le(u32::try_from(batch.len()).expect("batches are far below 4 GiB"));
            out.extend_from_slice(batch);
        }
    }

    /// What the codec did so far.
    pub fn report(&self) -> CodecReport {
        self.batches.report()
    }
}

/// One sequence of batches: pages coded against one page history and block cache, records
/// gathered into batches, each batch zstd-compressed on its own. The stream's encoder is one;
/// each shard of the parallel codec ([`crate::engine::pipeline`]) is another. Callers frame
/// the batches.
#[derive(Debug)]
pub(crate) struct BatchEncoder {
    pages: Encoder,
    /// zstd at the level the link, the CPU and the pages call for.
    zstd: AdaptiveCompressor,
    /// Records of the batch being built.
    records: Vec<u8>,
    /// The closed batch, kept from batch to batch.
    batch: Vec<u8>,
    /// Where the length of the open opaque record sits, while consecutive items extend it.
    open_opaque: Option<usize>,
    /// QEMU's bytes in the open batch.
    batch_qemu: usize,
    /// The block cache is paused for the open batch (a batch codes all its pages alike, and
    /// its framing says which way), and what [`BatchEncoder::set_cache_paused`] asked for
    /// from the next batch on.
    cache_paused: bool,
    cache_paused_next: bool,
    sent: SentPages,
    resend: ResendCost,
    report: CodecReport,
}

impl BatchEncoder {
    /// `link_rate_mbit` is the share of the link these batches get (what zstd must keep up
    /// with).
    pub(crate) fn new(
        settings: CodecSettings,
        options: Options,
        link_rate_mbit: f64,
    ) -> BatchEncoder {
        BatchEncoder {
            pages: Encoder::new(options),
            zstd: zstd_for_link(settings, link_rate_mbit),
            records: Vec::with_capacity(BATCH_BYTES + 2 * PAGE_SIZE),
            batch: Vec::with_capacity(BATCH_BYTES + 2 * PAGE_SIZE),
            open_opaque: None,
            batch_qemu: 0,
            cache_paused: false,
            cache_paused_next: false,
            sent: SentPages::default(),
            resend: ResendCost::default(),
            report: CodecReport {
                settings: settings.to_string(),
                ..CodecReport::default()
            },
        }
    }

    pub(crate) fn set_seed(&mut self, index: Arc<SeedIndex>, offer: SeedReport) {
        self.pages.set_seed(index);
        self.report.seed = Some(offer);
    }

    /// Pauses or resumes the block cache from the next batch on (at once when none is open).
    pub(crate) fn set_cache_paused(&mut self, paused: bool) {
        self.cache_paused_next = paused;
        if self.records.is_empty() {
            self.start_batch();
        }
    }

    /// What the next batch codes with.
    fn start_batch(&mut self) {
        self.cache_paused = self.cache_paused_next;
        self.pages.set_cache_paused(self.cache_paused);
    }

    /// Counts `qemu_bytes` of QEMU's stream taken into the open batch (an item's, once,
    /// whatever records it becomes).
    pub(crate) fn took(&mut self, qemu_bytes: usize) {
        self.report.bytes_in += qemu_bytes as u64;
        self.batch_qemu += qemu_bytes;
    }

    pub(crate) fn push_opaque(&mut self, bytes: &[u8]) {
        let at = match self.open_opaque {
            Some(at) => at,
            None => {
                self.records.push(OPAQUE);
                self.records.extend_from_slice(&0u32.to_le_bytes());
                let at = self.records.len() - 4;
                self.open_opaque = Some(at);
                at
            }
        };
        self.records.extend_from_slice(bytes);
        let len = u32::from_le_bytes(self.records[at..at + 4].try_into().expect("4 bytes"));
        let len = len + u32::try_from(bytes.len()).expect("items are far below 4 GiB");
        self.records[at..at + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// A page record: with QEMU's record header (the main stream), or without (a multifd
    /// packet's page, its header already sent).
    pub(crate) fn push_page(&mut self, key: u64, header: Option<&[u8]>, page: &[u8]) {
        self.open_opaque = None;
        let start = self.records.len();
        match header {
            Some(header) => {
                self.records.push(PAGE);
                let n = u16::try_from(header.len()).expect("a record header is at most 264 bytes");
                self.records.extend_from_slice(&n.to_le_bytes());
                self.records.extend_from_slice(header);
            }
            None => self.records.push(CHANNEL_PAGE),
        }
        let kind = self.pages.encode(key, page, &mut self.records);
        if self.sent.mark(key) && kind != PageKind::Unchanged {
            let header_len = header.map_or(0, <[u8]>::len);
            self.resend.batch_qemu += (header_len + page.len()) as u64;
            self.resend.batch_records += (self.records.len() - start) as u64;
        }
    }

    pub(crate) fn pending(&self) -> usize {
        self.records.len()
    }

    pub(crate) fn is_full(&self) -> bool {
        self.records.len() >= BATCH_BYTES || self.batch_qemu >= BATCH_QEMU_BYTES
    }

    /// Closes the open batch and returns it compressed, and whether the block cache was
    /// paused for it (`None`: nothing was open); `framing` is what the caller adds in front
    /// of it on the wire.
    pub(crate) fn close(&mut self, framing: usize) -> Option<(&[u8], bool)> {
        if self.records.is_empty() {
            return None;
        }
        let cache_paused = self.cache_paused;
        if cache_paused {
            self.report.cache_paused_batches += 1;
        }
        self.batch.clear();
        let compressed = self.zstd.compress(&self.records, &mut self.batch);
        let (level, batch_len) = (compressed.level, compressed.len);
        count_level(
            &mut self.report.zstd_levels,
            &self.zstd,
            compressed,
            self.records.len(),
        );
        self.resend
            .close_batch((framing + batch_len) as f64 / self.records.len() as f64);
        self.report.resend_cost = self.resend.estimate();
        self.report.bytes_out += (framing + batch_len) as u64;
        self.report.zstd_level = level;
        self.records.clear();
        self.batch_qemu = 0;
        self.open_opaque = None;
        self.start_batch();
        Some((&self.batch, cache_paused))
    }

    /// The resend cost's decayed sums: (QEMU bytes, wire bytes).
    pub(crate) fn resend_sums(&self) -> (f64, f64) {
        (self.resend.qemu, self.resend.wire)
    }

    pub(crate) fn report(&self) -> CodecReport {
        let s = self.pages.stats();
        CodecReport {
            pages: s.pages,
            raw: s.raw,
            zero: s.zero,
            unchanged: s.unchanged,
            delta: s.delta,
            blocks: s.blocks,
            block_hits: s.block_hits,
            seeded: s.seeded,
            ..self.report.clone()
        }
    }
}

/// zstd for batches on a link of `link_rate_mbit`, at the level the link, the CPU and the
/// data call for, or off when the settings leave zstd out.
pub fn zstd_for_link(settings: CodecSettings, link_rate_mbit: f64) -> AdaptiveCompressor {
    if settings.zstd {
        AdaptiveCompressor::new(link_rate_mbit * 1e6 / 8.0)
    } else {
        AdaptiveCompressor::off()
    }
}

/// Adds a batch `zstd` compressed (`bytes_in` of records) to the per-level figures.
pub fn count_level(
    levels: &mut Vec<ZstdLevelReport>,
    zstd: &AdaptiveCompressor,
    compressed: Compressed,
    bytes_in: usize,
) {
    let Some(level) = compressed.level else {
        return;
    };
    let i = match levels.iter().position(|l| l.level == level) {
        Some(i) => i,
        None => {
            levels.push(ZstdLevelReport {
                level,
                ..ZstdLevelReport::default()
            });
            levels.len() - 1
        }
    };
    let l = &mut levels[i];
    l.batches += 1;
    l.bytes_in += bytes_in as u64;
    l.bytes_out += compressed.len as u64;
    l.seconds += compressed.seconds;
    l.gain = zstd.gain(level);
}

/// The destination's half: framed batches in (cut anywhere), QEMU's bytes out.
#[derive(Debug)]
pub struct StreamDecoder {
    batches: BatchDecoder,
    input: BytesMut,
}

impl StreamDecoder {
    pub fn new(settings: CodecSettings, history_bytes: u64) -> StreamDecoder {
        StreamDecoder {
            batches: BatchDecoder::new(options(settings, history_bytes), None),
            input: BytesMut::new(),
        }
    }

    /// The seed image whose index the source was given.
    pub fn set_seed(&mut self, image: SeedImage) {
        self.batches.set_seed(image);
    }

    /// Takes the next bytes of the channel and appends the QEMU bytes of every batch they
    /// complete to `out`.
    pub fn feed(&mut self, bytes: &[u8], out: &mut BytesMut) -> Result<()> {
        self.input.extend_from_slice(bytes);
        while self.input.len() >= 4 {
            let len = u32::from_le_bytes(self.input[..4].try_into().expect("4 bytes")) as usize;
            ensure!(
                len <= MAX_FRAMED,
                "codec batch of {len} bytes announced, over the limit"
            );
            if self.input.len() < 4 + len {
                break;
            }
            self.input.advance(4);
            let batch = self.input.split_to(len);
            self.batches.decode(&batch, out)?;
        }
        Ok(())
    }

    /// Whether every byte fed so far was decoded (nothing waits for the rest of a batch).
    pub fn is_idle(&self) -> bool {
        self.input.is_empty()
    }
}

/// The other end of a [`BatchEncoder`]: whole batches in, QEMU's bytes out.
#[derive(Debug)]
pub(crate) struct BatchDecoder {
    pages: Decoder,
    batches: BatchDecompressor,
    page: Box<[u8; PAGE_SIZE]>,
    /// `(shard, shards)` when these batches are one shard's: every page must be the shard's.
    shard: Option<(usize, usize)>,
}

impl BatchDecoder {
    pub(crate) fn new(options: Options, shard: Option<(usize, usize)>) -> BatchDecoder {
        BatchDecoder {
            pages: Decoder::new(options),
            batches: BatchDecompressor::new(MAX_BATCH_RECORDS),
            page: Box::new([0; PAGE_SIZE]),
            shard,
        }
    }

    pub(crate) fn set_seed(&mut self, image: SeedImage) {
        self.pages.set_seed(image);
    }

    /// Pauses or resumes the block cache from the next batch on, as the encoder did.
    pub(crate) fn set_cache_paused(&mut self, paused: bool) {
        self.pages.set_cache_paused(paused);
    }

    /// Appends QEMU's bytes for one whole `batch` to `out`.
    pub(crate) fn decode(&mut self, batch: &[u8], out: &mut BytesMut) -> Result<()> {
        let records = self.batches.decompress(batch).context("codec batch")?;
        decode_records(&mut self.pages, &mut self.page, self.shard, records, out)
    }
}

/// Appends QEMU's bytes for one batch's `records` to `out`, decoding pages through `pages`
/// into `page`.
fn decode_records(
    pages: &mut Decoder,
    page: &mut [u8; PAGE_SIZE],
    shard: Option<(usize, usize)>,
    mut records: &[u8],
    out: &mut BytesMut,
) -> Result<()> {
    // Zero and unchanged pages take a few bytes of a batch each and 4 KiB of `out`: what a
    // batch decodes to is checked against what an encoder puts in one, before it is held.
    let mut decoded = 0usize;
    let mut grow = |n: usize| {
        decoded += n;
        ensure!(
            decoded <= MAX_BATCH_DECODED,
            "a codec batch decodes to more than the {MAX_BATCH_DECODED} bytes of QEMU's stream a batch carries"
        );
        Ok(())
    };
    while let Some((&tag, rest)) = records.split_first() {
        records = rest;
        match tag {
            OPAQUE => {
                let n = take_len::<4>(&mut records)?;
                grow(n)?;
                out.extend_from_slice(take(&mut records, n, "passed-through bytes")?);
            }
            PAGE => {
                let n = take_len::<2>(&mut records)?;
                let header = take(&mut records, n, "RAM record header")?;
                ensure!(n >= 8, "RAM record header of {n} bytes");
                grow(n + PAGE_SIZE)?;
                let (key, _) = pages.decode(&mut records, page).context("page record")?;
                // The key must name the page the header does: catches ends out of step.
                let word = u64::from_be_bytes(header[..8].try_into().expect("8 bytes"));
                let index = (word & !ferry_qemu::stream::flag::MASK) / PAGE_SIZE as u64;
                if key & ((1 << BLOCK_SHIFT) - 1) != index {
                    bail!("page record for key {key:#x} under a header for page {index:#x}");
                }
                if let Some((shard, shards)) = shard {
                    let owner = shard_of(key, shards);
                    ensure!(
                        owner == shard,
                        "page {key:#x} of shard {owner} arrived in shard {shard}'s batch"
                    );
                }
                out.extend_from_slice(header);
                out.extend_from_slice(&page[..]);
            }
            CHANNEL_PAGE if shard.is_none() => {
                grow(PAGE_SIZE)?;
                pages.decode(&mut records, page).context("page record")?;
                out.extend_from_slice(&page[..]);
            }
            other => bail!("unknown codec stream record 0x{other:02x}"),
        }
    }
    Ok(())
}

/// The 16 mixes of the techniques the settings switch (seeding aside): what the round-trip
/// tests run under.
#[cfg(test)]
pub(crate) fn every_settings_mix() -> Vec<CodecSettings> {
    (0..16u8)
        .map(|m| CodecSettings {
            zero: m & 1 != 0,
            dedup: m & 2 != 0,
            delta: m & 4 != 0,
            zstd: m & 8 != 0,
            seed: false,
        })
        .collect()
}

fn take<'a>(input: &mut &'a [u8], n: usize, what: &str) -> Result<&'a [u8]> {
    ensure!(input.len() >= n, "codec batch ends inside {what}");
    let (head, rest) = input.split_at(n);
    *input = rest;
    Ok(head)
}

/// A little-endian length of `N` (at most 4) bytes.
fn take_len<const N: usize>(input: &mut &[u8]) -> Result<usize> {
    let raw = take(input, N, "a length")?;
    let mut le = [0u8; 4];
    le[..N].copy_from_slice(raw);
    Ok(usize::try_from(u32::from_le_bytes(le)).expect("usize holds a u32"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_qemu::stream::StreamParser;

    const STREAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../qemu/tests/streams");

    /// Every captured QEMU stream, parsed, encoded, cut into odd pieces and decoded, comes
    /// back byte for byte, under every mix of techniques.
    fn round_trip(stream: &[u8], settings: CodecSettings, cut: usize) -> (Vec<u8>, CodecReport) {
        let mut parser = StreamParser::new();
        let mut input = BytesMut::from(stream);
        let mut enc = StreamEncoder::new(settings, 64 << 20, 100.0);
        let mut wire = BytesMut::new();
        let mut qemu = BytesMut::new();
        while let Some(item) = parser.next_item(&mut input).unwrap() {
            qemu.clear();
            item.encode(&mut qemu);
            enc.push(&item, &qemu);
            if enc.pending() >= 64 << 10 || enc.is_full() {
                enc.flush(&mut wire);
            }
        }
        parser.finish(input.len()).unwrap();
        enc.flush(&mut wire);
        let mut dec = StreamDecoder::new(settings, 64 << 20);
        let mut out = BytesMut::new();
        for piece in wire.chunks(cut) {
            dec.feed(piece, &mut out).unwrap();
        }
        assert!(dec.is_idle());
        (out.to_vec(), enc.report())
    }

    fn captured() -> Vec<Vec<u8>> {
        let mut streams: Vec<Vec<u8>> = std::fs::read_dir(STREAMS)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "zst"))
            .map(|p| zstd::decode_all(std::fs::File::open(p).unwrap()).unwrap())
            .collect();
        streams.sort();
        assert!(!streams.is_empty(), "no captured streams in {STREAMS}");
        streams
    }

    #[test]
    fn captured_streams_come_back_byte_for_byte() {
        let all = every_settings_mix();
        for stream in captured() {
            for (i, &settings) in all.iter().enumerate() {
                let (out, report) = round_trip(&stream, settings, 1 + i * 997);
                assert!(out == stream, "{settings} changed the stream");
                assert_eq!(report.bytes_in, stream.len() as u64);
                assert!(report.pages > 0);
            }
            let (_, none) = round_trip(&stream, CodecSettings::NONE, 4096);
            let (_, all) = round_trip(&stream, CodecSettings::ALL, 4096);
            assert!(
                all.bytes_out < none.bytes_out,
                "the codec saves nothing: {} vs {}",
                all.bytes_out,
                none.bytes_out
            );
        }
    }

    /// Every captured multifd channel, parsed, encoded, cut into odd pieces and decoded, comes
    /// back byte for byte; with QEMU's pages uncompressed, the codec saves bytes.
    #[test]
    fn captured_multifd_channels_come_back_byte_for_byte() {
        let dir = format!("{STREAMS}/multifd");
        let mut channels: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| !p.to_string_lossy().contains(".main."))
            .collect();
        channels.sort();
        assert_eq!(channels.len(), 4, "{channels:?}");
        for path in channels {
            let channel = zstd::decode_all(std::fs::File::open(&path).unwrap()).unwrap();
            let code = |settings: CodecSettings, cut: usize| {
                let mut parser = ferry_qemu::multifd::ChannelParser::new();
                let mut input = BytesMut::from(&channel[..]);
                let mut enc = StreamEncoder::new(settings, 64 << 20, 100.0);
                let (mut wire, mut qemu) = (BytesMut::new(), BytesMut::new());
                while let Some(item) = parser.next_item(&mut input).unwrap() {
                    qemu.clear();
                    item.encode(&mut qemu);
                    enc.push_channel(&item, &qemu);
                    if enc.is_full() {
                        enc.flush(&mut wire);
                    }
                }
                parser.finish(input.len()).unwrap();
                enc.flush(&mut wire);
                let mut dec = StreamDecoder::new(settings, 64 << 20);
                let mut out = BytesMut::new();
                for piece in wire.chunks(cut) {
                    dec.feed(piece, &mut out).unwrap();
                }
                assert!(dec.is_idle());
                assert!(out == channel, "{}: {settings} changed it", path.display());
                enc.report()
            };
            let none = code(CodecSettings::NONE, 4096);
            let all = code(CodecSettings::ALL, 1 + 997);
            assert_eq!(all.bytes_in, channel.len() as u64);
            let qemu_compressed = path.to_string_lossy().contains("zstd.");
            assert_eq!(all.pages == 0, qemu_compressed, "{}", path.display());
            if !qemu_compressed {
                assert!(
                    all.bytes_out < none.bytes_out / 2,
                    "{}: the codec saves little: {} vs {}",
                    path.display(),
                    all.bytes_out,
                    none.bytes_out
                );
            }
        }
    }

    /// One page record of block "pc.ram" at page `index`, holding `content`.
    fn page_item(index: u64, content: &[u8]) -> (Item, BytesMut) {
        let item = Item::Ram(ferry_qemu::stream::RamRecord {
            offset: index * PAGE_SIZE as u64,
            flags: ferry_qemu::stream::flag::PAGE,
            block: Some(Bytes::from_static(b"pc.ram")),
            data: RamData::Page(Bytes::copy_from_slice(content)),
        });
        let mut qemu = BytesMut::new();
        item.encode(&mut qemu);
        (item, qemu)
    }

    /// Pseudo-random bytes: content no technique squeezes.
    fn noise(seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2) | 1;
        (0..PAGE_SIZE)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect()
    }

    /// The resend cost is that of pages sent again with new content: a stretch of pages
    /// resent unchanged (nearly free) does not pull it down, since the last pass carries the
    /// pages being rewritten.
    #[test]
    fn pages_resent_unchanged_leave_the_resend_cost_alone() {
        let mut enc = StreamEncoder::new(CodecSettings::ALL, 64 << 20, 100.0);
        let mut wire = BytesMut::new();
        let mut push = |enc: &mut StreamEncoder, index: u64, content: &[u8]| {
            let (item, qemu) = page_item(index, content);
            enc.push(&item, &qemu);
            if enc.pending() >= 64 << 10 {
                enc.flush(&mut wire);
            }
        };
        // First pass: 512 pages; none is a resend.
        for i in 0..512 {
            push(&mut enc, i, &noise(i));
        }
        assert_eq!(enc.report().resend_cost, None);
        // Rewritten with new noise: a resend costs about a whole page.
        for i in 0..256 {
            push(&mut enc, i, &noise(i + 1000));
        }
        let rewritten = enc.report().resend_cost.expect("256 pages were resent");
        assert!(rewritten > 0.9, "a rewritten page cost {rewritten}");
        // Then a long stretch resent as they were: the estimate stays where it was.
        for i in 256..512 {
            push(&mut enc, i, &noise(i));
        }
        enc.flush(&mut wire);
        let after = enc.report().resend_cost.expect("still measured");
        assert!(
            (after - rewritten).abs() < 0.05,
            "unchanged pages moved the resend cost from {rewritten} to {after}"
        );
    }

    #[test]
    fn a_batch_that_decodes_to_more_than_an_encoder_puts_in_one_is_refused() {
        // Zero pages: a few bytes each in the batch, 4 KiB each decoded.
        let zero = [0u8; PAGE_SIZE];
        let pages = (MAX_BATCH_DECODED / PAGE_SIZE) as u64 + 10;
        let mut enc = StreamEncoder::new(CodecSettings::ALL, 64 << 20, 100.0);
        let (mut wire, mut full_at) = (BytesMut::new(), None);
        for i in 0..pages {
            let (item, qemu) = page_item(i, &zero);
            enc.push(&item, &qemu);
            if enc.is_full() && full_at.is_none() {
                full_at = Some(i + 1);
            }
        }
        // The encoder would have closed the batch at 16 MiB of QEMU's bytes.
        let per_page = page_item(0, &zero).1.len() as u64;
        assert_eq!(full_at, Some((BATCH_QEMU_BYTES as u64).div_ceil(per_page)));
        enc.flush(&mut wire);
        assert!(wire.len() < BATCH_BYTES);
        let mut out = BytesMut::new();
        let err = StreamDecoder::new(CodecSettings::ALL, 64 << 20)
            .feed(&wire, &mut out)
            .unwrap_err();
        assert!(
            format!("{err:#}").contains("a codec batch decodes to more than the 17825792 bytes"),
            "{err:#}"
        );
        assert!(out.len() <= MAX_BATCH_DECODED);
    }

    #[test]
    fn damaged_input_is_an_error() {
        let stream = &captured()[0];
        let mut parser = StreamParser::new();
        let mut input = BytesMut::from(&stream[..]);
        let mut enc = StreamEncoder::new(CodecSettings::ALL, 64 << 20, 100.0);
        let mut qemu = BytesMut::new();
        while let Some(item) = parser.next_item(&mut input).unwrap() {
            qemu.clear();
            item.encode(&mut qemu);
            enc.push(&item, &qemu);
        }
        let mut wire = BytesMut::new();
        enc.flush(&mut wire);
        // A length over the limit, an unknown record, and a damaged zstd body.
        let mut dec = StreamDecoder::new(CodecSettings::ALL, 64 << 20);
        assert!(dec
            .feed(&u32::MAX.to_le_bytes(), &mut BytesMut::new())
            .is_err());
        let mut bad = Vec::new();
        ferry_codec::compress_batch(&[0x7f, 1, 2], None, &mut bad);
        let mut framed = u32::try_from(bad.len()).unwrap().to_le_bytes().to_vec();
        framed.extend_from_slice(&bad);
        let err = StreamDecoder::new(CodecSettings::ALL, 64 << 20)
            .feed(&framed, &mut BytesMut::new())
            .unwrap_err();
        assert!(format!("{err:#}").contains("unknown codec stream record 0x7f"));
        let mut flipped = wire.to_vec();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0x40;
        let mut out = BytesMut::new();
        let r = StreamDecoder::new(CodecSettings::ALL, 64 << 20).feed(&flipped, &mut out);
        assert!(
            r.is_err() || out[..] != stream[..],
            "a flipped bit went unnoticed"
        );
    }
}
