//! What the destination QEMU is given: QEMU's stream (rebuilt and hashed already), parsed
//! again, with the zero-page records that would change nothing left out, and weighed by the
//! work it gives QEMU.
//!
//! A zero-page record for a page the destination holds as zero (a hole of its memory file,
//! [`crate::engine::known_zero`], or a page QEMU was last told is zero) is a no-op that still costs the
//! destination QEMU a page fault and a page read. Left out, the first pass of a mostly-zero
//! guest costs the destination nothing for its zeros, and the switchover's last pass only what
//! it really changes. A page given any content in this migration loses its known-zero mark, so
//! a later zero-page record for it goes through.
//!
//! QEMU names a RAM block in the first record of a run and leaves it out (`CONTINUE`) in the
//! rest, so a left-out record that named its block hands the name to the next record given to
//! QEMU from that block, if QEMU's idea of the current block is another one.
//!
//! The weight: every RAM record given to QEMU (a page, a zero page, an XBZRLE delta) weighs a
//! whole page, everything else (headers, device state) its bytes; [`crate::engine::feeder`]'s budget
//! counts it. The sieve parses the stream as the source agent did, so it also refuses bytes
//! that are not one before QEMU sees them.
//!
//! In postcopy ([`crate::engine::postcopy`]) the sieve holds the package's last piece back
//! until the destination releases it, and leaves nothing out: a page QEMU never wrote is one
//! its postcopy would ask the source for, and the source answers only for pages it has not
//! sent.

use anyhow::{bail, Context, Result};
use bytes::{Bytes, BytesMut};
use ferry_qemu::stream::{flag, Item, Postcopy, RamData, RamRecord, StreamParser, PAGE_SIZE};

use crate::engine::known_zero::ZeroPages;

pub struct LoadSieve {
    parser: StreamParser,
    pending: BytesMut,
    zero: ZeroPages,
    /// The block the stream's `CONTINUE` records refer to.
    stream_block: Option<Bytes>,
    /// The block QEMU's `CONTINUE` records refer to: the last one it was given by name.
    qemu_block: Option<Bytes>,
    skipped: u64,
    /// The migration may switch to postcopy.
    postcopy: bool,
    /// The package's last piece, until [`LoadSieve::release`]; and where it ends.
    held: Option<Bytes>,
    package_end: Option<u64>,
}

/// The next piece of QEMU's input.
pub struct Sieved {
    pub bytes: Bytes,
    /// QEMU's work in it, in bytes (a page per RAM record).
    pub weight: usize,
}

impl LoadSieve {
    /// A sieve that leaves out zero-page records for the pages in `zero`.
    pub fn new(zero: ZeroPages) -> LoadSieve {
        LoadSieve {
            parser: StreamParser::new(),
            pending: BytesMut::new(),
            zero,
            stream_block: None,
            qemu_block: None,
            skipped: 0,
            postcopy: false,
            held: None,
            package_end: None,
        }
    }

    /// A sieve for a migration that may switch to postcopy: it leaves nothing out and holds
    /// the package's last piece.
    pub fn postcopy() -> LoadSieve {
        LoadSieve {
            postcopy: true,
            ..LoadSieve::new(ZeroPages::none())
        }
    }

    /// Where the postcopy package ends in the stream, once its last piece is here.
    pub fn package_end(&self) -> Option<u64> {
        self.package_end
    }

    /// Gives back the package's held last piece and what followed it.
    pub fn release(&mut self) -> Result<Sieved> {
        let held = self.held.take().context("no postcopy package is held")?;
        let rest = self.sieve_input()?;
        let mut bytes = BytesMut::with_capacity(held.len() + rest.bytes.len());
        bytes.extend_from_slice(&held);
        bytes.extend_from_slice(&rest.bytes);
        Ok(Sieved {
            bytes: bytes.freeze(),
            weight: held.len() + rest.weight,
        })
    }

    /// Zero-page records left out so far.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Takes the next bytes of the stream; gives back what QEMU gets of what is complete (a
    /// record cut between two calls comes out of the call that completes it).
    pub fn pass(&mut self, bytes: &[u8]) -> Result<Sieved> {
        self.pending.extend_from_slice(bytes);
        self.sieve_input()
    }

    /// Where the next bytes of the stream go to be sieved, for a caller that builds them in
    /// place (the codec's decoder) rather than copy them in with [`LoadSieve::pass`].
    pub fn input(&mut self) -> &mut BytesMut {
        &mut self.pending
    }

    /// What QEMU gets of what [`LoadSieve::input`] holds, as [`LoadSieve::pass`] gives it:
    /// everything pending is parsed, up to a held package.
    pub fn sieve_input(&mut self) -> Result<Sieved> {
        let mut out = BytesMut::with_capacity(self.pending.len() + 64);
        let mut weight = 0;
        while self.held.is_none() {
            let Some((item, as_written)) = self
                .parser
                .next_item_with_bytes(&mut self.pending)
                .context("the decoded stream")?
            else {
                break;
            };
            if !self.postcopy && self.parser.postcopy() != Postcopy::Off {
                bail!("the stream switches to postcopy, which this migration did not ask for");
            }
            let is_page = item.is_page();
            // What QEMU gets: mostly the item's bytes as they came, not a copy.
            let bytes = match item {
                Item::Ram(record) => match self.sieve(record) {
                    Some(Sieve::AsWritten) => as_written,
                    Some(Sieve::Renamed(record)) => {
                        let mut bytes = BytesMut::with_capacity(record.encoded_len());
                        record.encode(&mut bytes);
                        bytes.freeze()
                    }
                    None => continue,
                },
                Item::Opaque(_) => as_written,
            };
            if self.parser.ended_package() {
                self.held = Some(bytes);
                self.package_end = Some(self.parser.position());
                break;
            }
            weight += if is_page { PAGE_SIZE } else { bytes.len() };
            out.extend_from_slice(&bytes);
        }
        Ok(Sieved {
            bytes: out.freeze(),
            weight,
        })
    }

    /// The record QEMU gets in place of `record`, if any.
    fn sieve(&mut self, mut record: RamRecord) -> Option<Sieve> {
        if record.block.is_some() {
            self.stream_block.clone_from(&record.block);
        }
        let is_page = !matches!(record.data, RamData::None);
        if !is_page {
            return Some(Sieve::AsWritten);
        }
        let page = record.offset / PAGE_SIZE as u64;
        let known = self
            .stream_block
            .as_deref()
            .and_then(|name| self.zero.block_mut(name));
        if known.is_some_and(|bits| bits.follow(page, &record)) {
            self.skipped += 1;
            return None;
        }
        let renamed = record.block.is_none() && self.qemu_block != self.stream_block;
        if renamed {
            // QEMU's current block is not this record's: name it.
            record.block.clone_from(&self.stream_block);
            record.flags &= !flag::CONTINUE;
        }
        if record.block.is_some() {
            self.qemu_block.clone_from(&record.block);
        }
        Some(if renamed {
            Sieve::Renamed(record)
        } else {
            Sieve::AsWritten
        })
    }
}

/// What the sieve does with a RAM record it does not leave out.
enum Sieve {
    /// QEMU gets it as the stream has it.
    AsWritten,
    /// QEMU gets it with its block named (the record that named it was left out).
    Renamed(RamRecord),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::known_zero::PageBits;
    use std::collections::HashMap;

    /// The captured precopy streams. Not `bitmaps`: QEMU advises postcopy whenever its
    /// dirty-bitmaps capability is on, which only libvirt's tunnels carry, not this sieve.
    fn captured() -> Vec<(String, Vec<u8>)> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../qemu/tests/streams");
        let mut streams = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let advises_postcopy = path.file_name().is_some_and(|n| n == "bitmaps.qemu.zst");
            if path.extension().is_some_and(|x| x == "zst") && !advises_postcopy {
                let stream = zstd::decode_all(std::fs::File::open(&path).unwrap()).unwrap();
                streams.push((path.display().to_string(), stream));
            }
        }
        assert!(!streams.is_empty(), "no captured streams in {dir}");
        streams
    }

    /// Guest memory as a destination QEMU would load it: pages by block and index, a page
    /// absent reads as zero. `CONTINUE` refers to the last block named, as in QEMU.
    #[derive(Default, PartialEq, Eq, Debug)]
    struct Memory {
        pages: HashMap<(Bytes, u64), Vec<u8>>,
    }

    impl Memory {
        fn load(&mut self, stream: &[u8]) {
            let mut parser = StreamParser::new();
            let mut buf = BytesMut::from(stream);
            let mut current = None::<Bytes>;
            while let Some(item) = parser.next_item(&mut buf).unwrap() {
                let Item::Ram(r) = item else { continue };
                if r.block.is_some() {
                    current.clone_from(&r.block);
                }
                let key = || (current.clone().expect("a block named before"), r.offset);
                match &r.data {
                    RamData::None => {}
                    RamData::Fill(_) => {
                        self.pages.remove(&key());
                    }
                    RamData::Page(p) => {
                        self.pages.insert(key(), p.to_vec());
                    }
                    RamData::Xbzrle(_) => unreachable!("plain precopy"),
                }
            }
            assert!(buf.is_empty());
        }
    }

    fn sieved(stream: &[u8], zero: ZeroPages, cut: usize) -> (Vec<u8>, usize, u64) {
        let mut sieve = LoadSieve::new(zero);
        let (mut out, mut weight) = (Vec::new(), 0);
        for piece in stream.chunks(cut) {
            let s = sieve.pass(piece).unwrap();
            out.extend_from_slice(&s.bytes);
            weight += s.weight;
        }
        (out, weight, sieve.skipped())
    }

    /// The blocks a stream names, with their sizes in pages, and the block of most records.
    fn blocks(stream: &[u8]) -> (Vec<(Bytes, u64)>, Bytes) {
        let mut by_block: HashMap<Bytes, u64> = HashMap::new();
        let mut parser = StreamParser::new();
        let mut buf = BytesMut::from(stream);
        let mut current = None::<Bytes>;
        while let Some(item) = parser.next_item(&mut buf).unwrap() {
            if let Item::Ram(r) = item {
                if r.block.is_some() {
                    current.clone_from(&r.block);
                }
                if !matches!(r.data, RamData::None) {
                    let max = by_block.entry(current.clone().unwrap()).or_default();
                    *max = (*max).max(r.offset / PAGE_SIZE as u64 + 1);
                }
            }
        }
        let main = by_block.iter().max_by_key(|(_, n)| **n).unwrap().0.clone();
        (by_block.into_iter().collect(), main)
    }

    /// With nothing known zero, QEMU gets the stream byte for byte, weighed a page per record.
    #[test]
    fn nothing_known_passes_the_stream_unchanged() {
        for (name, stream) in captured() {
            let (mut parser, mut buf) = (StreamParser::new(), BytesMut::from(&stream[..]));
            let (mut pages, mut other) = (0, 0);
            while let Some(item) = parser.next_item(&mut buf).unwrap() {
                match item.is_page() {
                    true => pages += 1,
                    false => other += item.encoded_len(),
                }
            }
            assert!(pages > 0 && other > 0);
            for cut in [1, 4093, 65536] {
                let (out, weight, skipped) = sieved(&stream, ZeroPages::none(), cut);
                assert!(out == stream, "{name} cut every {cut}");
                assert_eq!(skipped, 0);
                assert_eq!(weight, pages * PAGE_SIZE + other, "{name} cut every {cut}");
            }
        }
    }

    /// The destination's memory after the sieved stream is the one after QEMU's whole stream,
    /// when the pages marked known zero are zero there and every other page holds something
    /// else (stale content the stream must overwrite). Most of the main block is marked: its
    /// zero pages are left out, including ones that named their block, whose name then goes
    /// to the next record QEMU gets.
    #[test]
    fn left_out_records_change_nothing_qemu_loads() {
        for (name, stream) in captured() {
            let (blocks, main) = blocks(&stream);
            let mut zero = ZeroPages::none();
            let mut stale = Memory::default();
            for (block, pages) in &blocks {
                let mut bits = PageBits::new(*pages);
                for page in 0..*pages {
                    // Every seventh page of the main block, and all of the others, hold old data.
                    if *block == main && page % 7 != 3 {
                        bits.set(page, true);
                    } else {
                        stale
                            .pages
                            .insert((block.clone(), page * PAGE_SIZE as u64), vec![0xa5; 64]);
                    }
                }
                zero.insert(block, bits);
            }
            let mut expected = Memory {
                pages: stale.pages.clone(),
            };
            expected.load(&stream);
            for cut in [1, 4093, 65536] {
                let (out, _, skipped) = sieved(&stream, zero.clone(), cut);
                assert!(skipped > 0, "{name}: nothing left out");
                assert!(out.len() < stream.len());
                let mut got = Memory {
                    pages: stale.pages.clone(),
                };
                got.load(&out);
                assert!(got == expected, "{name} cut every {cut}: memory differs");
            }
        }
    }

    /// The record QEMU gets in place of `record`, if any.
    fn given(sieve: &mut LoadSieve, record: RamRecord) -> Option<RamRecord> {
        match sieve.sieve(record.clone())? {
            Sieve::AsWritten => Some(record),
            Sieve::Renamed(renamed) => Some(renamed),
        }
    }

    fn record(flags: u64, offset: u64, block: Option<&str>, data: RamData) -> RamRecord {
        RamRecord {
            offset,
            flags,
            block: block.map(|b| Bytes::copy_from_slice(b.as_bytes())),
            data,
        }
    }

    /// A page written in this migration is no longer known zero: a later zero-page record for
    /// it reaches QEMU, and the next one (QEMU has just cleared it) does not. A left-out record
    /// that named a block hands the name on only when QEMU's current block differs.
    #[test]
    fn marks_follow_what_qemu_was_given() {
        let mut zero = ZeroPages::none();
        let mut bits = PageBits::new(8);
        bits.set_range(0..8);
        zero.insert(b"ram0", bits);
        let mut sieve = LoadSieve::new(zero);
        let page = Bytes::from(vec![1u8; PAGE_SIZE]);
        let z = flag::ZERO;
        let c = flag::CONTINUE;
        // Named zero page 0: left out; the page after it gets the name.
        assert!(given(&mut sieve, record(z, 0, Some("ram0"), RamData::Fill(0))).is_none());
        let r = given(
            &mut sieve,
            record(flag::PAGE | c, 4096, None, RamData::Page(page.clone())),
        )
        .unwrap();
        assert_eq!(
            (r.block.as_deref(), r.flags),
            (Some(&b"ram0"[..]), flag::PAGE)
        );
        // Page 1 now holds data: its zero record goes through, with CONTINUE kept (QEMU's
        // current block is ram0); a second one is left out.
        let r = given(&mut sieve, record(z | c, 4096, None, RamData::Fill(0))).unwrap();
        assert_eq!((r.block, r.flags), (None, z | c));
        assert!(given(&mut sieve, record(z | c, 4096, None, RamData::Fill(0))).is_none());
        // Another block in between: the next ram0 record left out names nothing; the one given
        // to QEMU after it names ram0 again.
        let r = given(
            &mut sieve,
            record(flag::PAGE, 0, Some("vga.vram"), RamData::Page(page.clone())),
        )
        .unwrap();
        assert_eq!(r.block.as_deref(), Some(&b"vga.vram"[..]));
        assert!(given(
            &mut sieve,
            record(z, 2 * 4096, Some("ram0"), RamData::Fill(0))
        )
        .is_none());
        let r = given(
            &mut sieve,
            record(flag::PAGE | c, 3 * 4096, None, RamData::Page(page)),
        )
        .unwrap();
        assert_eq!(
            (r.block.as_deref(), r.flags),
            (Some(&b"ram0"[..]), flag::PAGE)
        );
        // Markers pass untouched.
        let eos = given(&mut sieve, record(flag::EOS, 0, None, RamData::None)).unwrap();
        assert_eq!(eos.flags, flag::EOS);
        assert_eq!(sieve.skipped(), 3);
    }

    fn postcopy_stream() -> Vec<u8> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../qemu/tests/streams/postcopy/running.qemu.zst"
        );
        zstd::decode_all(std::fs::File::open(path).unwrap()).unwrap()
    }

    #[test]
    fn a_postcopy_package_is_held_until_released_and_nothing_is_left_out() {
        let stream = postcopy_stream();
        for cut in [1000, 65536, stream.len()] {
            let mut sieve = LoadSieve::postcopy();
            let mut out = Vec::new();
            let mut fed = 0;
            for piece in stream.chunks(cut) {
                out.extend_from_slice(&sieve.pass(piece).unwrap().bytes);
                fed += piece.len();
                if sieve.package_end().is_some() {
                    break;
                }
            }
            let end = usize::try_from(sieve.package_end().expect("a package")).unwrap();
            // Everything before the package's last piece went out, nothing after it.
            assert!(
                out.len() < end && end <= fed,
                "cut {cut}: {} {end} {fed}",
                out.len()
            );
            assert_eq!(out, stream[..out.len()]);
            // More bytes wait behind the held piece.
            out.extend_from_slice(&sieve.pass(&stream[fed..]).unwrap().bytes);
            assert!(out.len() < end, "cut {cut}: released before its time");
            out.extend_from_slice(&sieve.release().unwrap().bytes);
            assert_eq!(out, stream, "cut {cut}");
            assert_eq!(sieve.skipped(), 0);
            assert!(sieve.release().is_err(), "released twice");
        }
    }

    #[test]
    fn a_postcopy_stream_in_a_migration_without_it_is_refused() {
        let mut sieve = LoadSieve::new(ZeroPages::none());
        let e = sieve.pass(&postcopy_stream()).err().unwrap();
        assert!(format!("{e:#}").contains("did not ask for"), "{e:#}");
    }

    #[test]
    fn bytes_that_are_not_a_stream_are_refused() {
        let mut sieve = LoadSieve::new(ZeroPages::none());
        let e = sieve.pass(&[0xde; 64]).err().unwrap();
        assert!(format!("{e:#}").contains("decoded stream"), "{e:#}");
    }
}
