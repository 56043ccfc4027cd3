//! What the receiver's disks already hold, block by block, so that writes of content already
//! there travel as [`DiskOp::Same`] (CloudNet's follow-the-sun: a disk that returns to a site
//! still holding its older copy sends only what changed).
//!
//! The receiver indexes its copy ([`BaseBuilder`]): a keyed xxh3-128 of every 4 KiB block.
//! The sender keeps the index as the receiver's disk evolves during the migration
//! ([`DiskBase::filter`]): a whole block written or zeroed becomes known with its new content;
//! a partly written or trimmed block becomes unknown. A write whose blocks are known with the
//! same content is sent as SAME; everything else goes as it is.
//!
//! Index format (per migration, little endian):
//! ```text
//! version:u8 (1) | key:u64 | disks:varint | per disk: blocks:varint entries:varint
//!                                           (gap:varint hash:16 bytes){entries}
//! ```
//! Listed blocks are non-zero, in increasing order (`gap` from the previous listed block plus
//! one); every block not listed is all zeros; a listed hash of 0 is a block whose content is
//! not known. The key makes the hash unpredictable to anyone who does not know it, so a guest
//! cannot craft a collision.
//!
//! At the end of a migration the sender's view is an index of the receiver's disks as they now
//! are, which is the sender's own disks as they left ([`DiskBase::serialize`]): kept by the
//! host the VM left, it can stand for that host's copy when the VM comes back, without reading
//! it. A sender whose receiver had no older copy starts from [`DiskBase::zeroed`] and follows
//! the copy with [`DiskBase::track`].

use crate::disk::DiskOp;
use crate::{varint, CodecError, PAGE_SIZE};

const VERSION: u8 = 1;
/// Marks a block whose content at the receiver is not known.
const UNKNOWN: u128 = 0;
/// The most blocks a disk may have in an index (64 TiB of 4 KiB blocks).
const MAX_BLOCKS: u64 = 1 << 34;

fn block_hash(key: u64, block: &[u8]) -> u128 {
    let h = xxhash_rust::xxh3::xxh3_128_with_seed(block, key);
    // A real hash equal to the marker is simply not known (2^-128).
    if h == UNKNOWN {
        1
    } else {
        h
    }
}

/// The most bytes an honest index of disks of these sizes takes: what a receiver may announce
/// before the sender holds it.
pub fn max_index_bytes(sizes: &[u64]) -> u64 {
    let header = 1 + 8 + varint::MAX_BYTES;
    sizes.iter().fold(header, |sum, &size| {
        let entries = blocks_of(size).saturating_mul(varint::MAX_BYTES + 16);
        sum.saturating_add(2 * varint::MAX_BYTES)
            .saturating_add(entries)
    })
}

fn blocks_of(size: u64) -> u64 {
    size.div_ceil(PAGE_SIZE as u64)
}

/// Builds the index of one receiver's disks from their content, read in order.
pub struct BaseBuilder {
    key: u64,
    disks: Vec<(u64, Vec<(u64, u128)>)>,
}

impl BaseBuilder {
    pub fn new(key: u64) -> BaseBuilder {
        BaseBuilder {
            key,
            disks: Vec::new(),
        }
    }

    /// Starts the next disk, `size` bytes.
    pub fn disk(&mut self, size: u64) {
        self.disks.push((blocks_of(size), Vec::new()));
    }

    /// Adds the current disk's bytes at `offset` (a multiple of 4 KiB; a short last block is
    /// treated as padded with zeros).
    pub fn add(&mut self, offset: u64, data: &[u8]) {
        let key = self.key;
        let (_, entries) = self.disks.last_mut().expect("disk() first");
        let mut block = [0u8; PAGE_SIZE];
        for (i, chunk) in data.chunks(PAGE_SIZE).enumerate() {
            if chunk.iter().all(|&b| b == 0) {
                continue;
            }
            block[..chunk.len()].copy_from_slice(chunk);
            block[chunk.len()..].fill(0);
            entries.push((
                offset / PAGE_SIZE as u64 + i as u64,
                block_hash(key, &block),
            ));
        }
    }

    pub fn finish(self) -> Vec<u8> {
        let mut out = vec![VERSION];
        out.extend_from_slice(&self.key.to_le_bytes());
        varint::put(&mut out, self.disks.len() as u64);
        for (blocks, entries) in &self.disks {
            varint::put(&mut out, *blocks);
            varint::put(&mut out, entries.len() as u64);
            let mut next = 0;
            for (b, h) in entries {
                varint::put(&mut out, b - next);
                out.extend_from_slice(&h.to_le_bytes());
                next = b + 1;
            }
        }
        out
    }
}

/// The sender's view of the receiver's disks.
pub struct DiskBase {
    key: u64,
    zero: u128,
    disks: Vec<Vec<u128>>,
    /// Bytes sent as SAME so far.
    pub same_bytes: u64,
}

impl DiskBase {
    /// Parses an index for disks of these sizes.
    pub fn parse(mut input: &[u8], sizes: &[u64]) -> Result<DiskBase, CodecError> {
        let bad = |what: &'static str| CodecError::BadSeedIndex(what);
        let (&version, rest) = input.split_first().ok_or(bad("empty disk index"))?;
        if version != VERSION {
            return Err(bad("unknown disk index version"));
        }
        if rest.len() < 8 {
            return Err(bad("disk index too short for its key"));
        }
        let key = u64::from_le_bytes(rest[..8].try_into().expect("8 bytes"));
        input = &rest[8..];
        if varint::get(&mut input)? != sizes.len() as u64 {
            return Err(bad("disk index for another number of disks"));
        }
        let zero = block_hash(key, &[0u8; PAGE_SIZE]);
        let mut disks = Vec::with_capacity(sizes.len());
        for &size in sizes {
            let blocks = varint::get(&mut input)?;
            if blocks != blocks_of(size) || blocks > MAX_BLOCKS {
                return Err(bad("disk index for a disk of another size"));
            }
            let mut known = vec![zero; usize::try_from(blocks).map_err(|_| bad("disk too large"))?];
            let entries = varint::get(&mut input)?;
            if entries > blocks {
                return Err(bad("more index entries than blocks"));
            }
            let mut next = 0u64;
            for _ in 0..entries {
                let b = next
                    .checked_add(varint::get(&mut input)?)
                    .filter(|&b| b < blocks)
                    .ok_or(bad("index entry beyond the disk"))?;
                if input.len() < 16 {
                    return Err(CodecError::Truncated("disk index entry"));
                }
                known[usize::try_from(b).expect("checked")] =
                    u128::from_le_bytes(input[..16].try_into().expect("16 bytes"));
                input = &input[16..];
                next = b + 1;
            }
            disks.push(known);
        }
        if !input.is_empty() {
            return Err(bad("bytes after the disk index"));
        }
        Ok(DiskBase {
            key,
            zero,
            disks,
            same_bytes: 0,
        })
    }

    /// A view of disks of these sizes that hold only zeros (a receiver with no older copy):
    /// nothing goes as SAME but zeroes, and [`DiskBase::track`] learns what the copy writes.
    pub fn zeroed(key: u64, sizes: &[u64]) -> Result<DiskBase, CodecError> {
        let zero = block_hash(key, &[0u8; PAGE_SIZE]);
        let disks = sizes
            .iter()
            .map(|&size| {
                let blocks = blocks_of(size);
                let blocks = usize::try_from(blocks)
                    .ok()
                    .filter(|_| blocks <= MAX_BLOCKS)
                    .ok_or(CodecError::BadSeedIndex("disk too large"))?;
                Ok(vec![zero; blocks])
            })
            .collect::<Result<_, CodecError>>()?;
        Ok(DiskBase {
            key,
            zero,
            disks,
            same_bytes: 0,
        })
    }

    /// The index of the receiver's disks as this view has them (what [`DiskBase::parse`]
    /// reads back, unknown blocks listed with hash 0).
    pub fn serialize(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        out.extend_from_slice(&self.key.to_le_bytes());
        varint::put(&mut out, self.disks.len() as u64);
        for known in &self.disks {
            varint::put(&mut out, known.len() as u64);
            let listed = known.iter().filter(|&&h| h != self.zero).count();
            varint::put(&mut out, listed as u64);
            let mut next = 0;
            for (b, h) in (0u64..).zip(known).filter(|(_, &h)| h != self.zero) {
                varint::put(&mut out, b - next);
                out.extend_from_slice(&h.to_le_bytes());
                next = b + 1;
            }
        }
        out
    }

    /// How many blocks this view does not know (partly written or trimmed since it began).
    pub fn unknown_blocks(&self) -> u64 {
        self.disks
            .iter()
            .map(|d| d.iter().filter(|&&h| h == UNKNOWN).count() as u64)
            .sum()
    }

    /// The first `n` blocks of disk `disk` this view does not know.
    pub fn unknown_block_list(&self, disk: u8, n: usize) -> Vec<u64> {
        let Some(known) = self.disks.get(usize::from(disk)) else {
            return Vec::new();
        };
        (0u64..)
            .zip(known)
            .filter(|(_, &h)| h == UNKNOWN)
            .map(|(b, _)| b)
            .take(n)
            .collect()
    }

    /// Up to `n` blocks of disk `disk` whose non-zero content this view knows, spread evenly
    /// over them: where to look when checking that a disk is the one this view describes.
    pub fn known_blocks(&self, disk: u8, n: usize) -> Vec<u64> {
        let Some(known) = self.disks.get(usize::from(disk)) else {
            return Vec::new();
        };
        let listed: Vec<u64> = (0u64..)
            .zip(known)
            .filter(|(_, &h)| h != self.zero && h != UNKNOWN)
            .map(|(b, _)| b)
            .collect();
        if listed.len() <= n {
            return listed;
        }
        (0..n).map(|i| listed[i * listed.len() / n]).collect()
    }

    /// Whether `data` (block `block` of disk `disk`, a short last block padded with zeros) is
    /// what this view knows the receiver holds there; None where it knows nothing.
    pub fn holds(&self, disk: u8, block: u64, data: &[u8]) -> Option<bool> {
        let known = *self
            .disks
            .get(usize::from(disk))?
            .get(usize::try_from(block).ok()?)?;
        if known == UNKNOWN || data.len() > PAGE_SIZE {
            return None;
        }
        let mut padded = [0u8; PAGE_SIZE];
        padded[..data.len()].copy_from_slice(data);
        Some(block_hash(self.key, &padded) == known)
    }

    /// Records what the receiver holds after `op`, which goes as it is (nothing is sent as
    /// SAME): how a sender with no older copy to compare against follows its copy.
    pub fn track(&mut self, op: &DiskOp) {
        match op {
            DiskOp::Write { disk, offset, data } => {
                self.learn_write(*disk, *offset, data);
            }
            DiskOp::Zeroes {
                disk, offset, len, ..
            } => {
                self.learn_zeroes(*disk, *offset, *len);
            }
            DiskOp::Trim { disk, offset, len } => self.learn_trim(*disk, *offset, *len),
            DiskOp::Flush { .. } | DiskOp::Same { .. } => {}
        }
    }

    /// Records a write's blocks (a whole block known by its new content, a partly written one
    /// unknown) and returns its runs of blocks the receiver held already or not, as (same?,
    /// start, end) in bytes of the write; None for a disk this view does not have.
    fn learn_write(
        &mut self,
        disk: u8,
        offset: u64,
        data: &[u8],
    ) -> Option<Vec<(bool, usize, usize)>> {
        let page = PAGE_SIZE as u64;
        let known = self.disks.get_mut(usize::from(disk))?;
        let mut runs: Vec<(bool, usize, usize)> = Vec::new();
        let mut at = 0usize;
        while at < data.len() {
            let pos = offset + at as u64;
            let block = usize::try_from(pos / page).expect("in disk");
            let in_block = usize::try_from(pos % page).expect("small");
            let n = (PAGE_SIZE - in_block).min(data.len() - at);
            let same = if n == PAGE_SIZE {
                let h = block_hash(self.key, &data[at..at + n]);
                let same = known.get(block) == Some(&h);
                if let Some(k) = known.get_mut(block) {
                    *k = h;
                }
                same
            } else {
                if let Some(k) = known.get_mut(block) {
                    *k = UNKNOWN;
                }
                false
            };
            match runs.last_mut() {
                Some(r) if r.0 == same => r.2 = at + n,
                _ => runs.push((same, at, at + n)),
            }
            at += n;
        }
        Some(runs)
    }

    /// Records zeroed blocks (a whole block known zero, a partly zeroed one unknown); returns
    /// whether the receiver held zeros there already, the range aligned to blocks. None for a
    /// disk this view does not have.
    fn learn_zeroes(&mut self, disk: u8, offset: u64, len: u64) -> Option<bool> {
        let page = PAGE_SIZE as u64;
        let zero = self.zero;
        let known = self.disks.get_mut(usize::from(disk))?;
        let (first, end) = (offset / page, (offset + len).div_ceil(page));
        let aligned = offset.is_multiple_of(page) && (offset + len).is_multiple_of(page);
        let all_zero = aligned
            && (first..end).all(|b| known.get(usize::try_from(b).expect("in disk")) == Some(&zero));
        for b in first..end {
            let whole = b * page >= offset && (b + 1) * page <= offset + len;
            if let Some(k) = known.get_mut(usize::try_from(b).expect("in disk")) {
                *k = if whole { zero } else { UNKNOWN };
            }
        }
        Some(all_zero)
    }

    /// Records trimmed blocks as unknown (a trim may or may not read back as zeros).
    fn learn_trim(&mut self, disk: u8, offset: u64, len: u64) {
        let page = PAGE_SIZE as u64;
        if let Some(known) = self.disks.get_mut(usize::from(disk)) {
            for b in offset / page..(offset + len).div_ceil(page) {
                if let Some(k) = known.get_mut(usize::try_from(b).expect("in disk")) {
                    *k = UNKNOWN;
                }
            }
        }
    }

    /// Appends to `out` what to send for `op`, given what the receiver holds, and records what
    /// it will hold after it.
    pub fn filter(&mut self, op: DiskOp, out: &mut Vec<DiskOp>) {
        match op {
            DiskOp::Write { disk, offset, data } => {
                let Some(runs) = self.learn_write(disk, offset, &data) else {
                    out.push(DiskOp::Write { disk, offset, data });
                    return;
                };
                if let [(false, _, _)] = runs[..] {
                    // Nothing the receiver holds: the write goes as it is, uncopied.
                    out.push(DiskOp::Write { disk, offset, data });
                    return;
                }
                for (same, a, b) in runs {
                    let off = offset + a as u64;
                    if same {
                        self.same_bytes += (b - a) as u64;
                        out.push(DiskOp::Same {
                            disk,
                            offset: off,
                            len: (b - a) as u64,
                        });
                    } else {
                        out.push(DiskOp::Write {
                            disk,
                            offset: off,
                            data: data[a..b].to_vec(),
                        });
                    }
                }
            }
            DiskOp::Zeroes {
                disk,
                offset,
                len,
                may_trim,
            } => {
                let Some(all_zero) = self.learn_zeroes(disk, offset, len) else {
                    out.push(op);
                    return;
                };
                if all_zero {
                    self.same_bytes += len;
                    out.push(DiskOp::Same { disk, offset, len });
                } else {
                    out.push(DiskOp::Zeroes {
                        disk,
                        offset,
                        len,
                        may_trim,
                    });
                }
            }
            DiskOp::Trim { disk, offset, len } => {
                self.learn_trim(disk, offset, len);
                out.push(op);
            }
            DiskOp::Flush { .. } | DiskOp::Same { .. } => out.push(op),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `len` bytes of blocks that are all different and none zero.
    pub(crate) fn distinct_blocks(len: usize) -> Vec<u8> {
        let mut data = vec![0xa5; len];
        for (n, block) in data.chunks_mut(PAGE_SIZE).enumerate() {
            let n = (n as u64).to_le_bytes();
            let k = n.len().min(block.len());
            block[..k].copy_from_slice(&n[..k]);
        }
        data
    }

    fn block(b: u8) -> Vec<u8> {
        vec![b; PAGE_SIZE]
    }

    fn base_of(disk: &[u8]) -> DiskBase {
        let mut builder = BaseBuilder::new(0x5eed);
        builder.disk(disk.len() as u64);
        builder.add(0, disk);
        DiskBase::parse(&builder.finish(), &[disk.len() as u64]).unwrap()
    }

    #[test]
    fn a_full_index_fits_its_announced_bound() {
        // Every block non-zero and distinct, on two disks (one with a short last block).
        let disks: Vec<Vec<u8>> = [300 * PAGE_SIZE, 20 * PAGE_SIZE + 100]
            .iter()
            .map(|&len| distinct_blocks(len))
            .collect();
        let mut builder = BaseBuilder::new(7);
        for disk in &disks {
            builder.disk(disk.len() as u64);
            builder.add(0, disk);
        }
        let sizes: Vec<u64> = disks.iter().map(|d| d.len() as u64).collect();
        let index = builder.finish();
        assert!(index.len() as u64 <= max_index_bytes(&sizes));
        assert!(index.len() as u64 > max_index_bytes(&sizes) / 2);
    }

    #[test]
    fn unchanged_blocks_go_as_same_and_changed_ones_as_data() {
        let mut disk = vec![0u8; 8 * PAGE_SIZE];
        disk[PAGE_SIZE..2 * PAGE_SIZE].fill(7);
        disk[3 * PAGE_SIZE..4 * PAGE_SIZE].fill(9);
        let mut base = base_of(&disk);
        // The sender's disk: block 1 the same, block 3 changed, block 4 new.
        let mut mine = disk.clone();
        mine[3 * PAGE_SIZE..4 * PAGE_SIZE].fill(1);
        mine[4 * PAGE_SIZE..5 * PAGE_SIZE].fill(2);
        let mut out = Vec::new();
        base.filter(
            DiskOp::Write {
                disk: 0,
                offset: PAGE_SIZE as u64,
                data: mine[PAGE_SIZE..5 * PAGE_SIZE].to_vec(),
            },
            &mut out,
        );
        assert_eq!(
            out,
            vec![
                DiskOp::Same {
                    disk: 0,
                    offset: PAGE_SIZE as u64,
                    len: 2 * PAGE_SIZE as u64
                },
                DiskOp::Write {
                    disk: 0,
                    offset: 3 * PAGE_SIZE as u64,
                    data: mine[3 * PAGE_SIZE..5 * PAGE_SIZE].to_vec()
                },
            ]
        );
        // Zeroing blocks that are zero there is free; elsewhere it goes.
        out.clear();
        base.filter(
            DiskOp::Zeroes {
                disk: 0,
                offset: 5 * PAGE_SIZE as u64,
                len: 3 * PAGE_SIZE as u64,
                may_trim: true,
            },
            &mut out,
        );
        assert!(matches!(out[0], DiskOp::Same { .. }), "{out:?}");
        out.clear();
        base.filter(
            DiskOp::Zeroes {
                disk: 0,
                offset: 4 * PAGE_SIZE as u64,
                len: PAGE_SIZE as u64,
                may_trim: true,
            },
            &mut out,
        );
        assert!(matches!(out[0], DiskOp::Zeroes { .. }), "{out:?}");
    }

    #[test]
    fn content_written_back_after_a_change_is_not_taken_for_the_old_copy() {
        // The receiver held X; the sender wrote Y, then X again: the second X must travel.
        let disk = block(3);
        let mut base = base_of(&disk);
        let mut out = Vec::new();
        for b in [5u8, 3] {
            base.filter(
                DiskOp::Write {
                    disk: 0,
                    offset: 0,
                    data: block(b),
                },
                &mut out,
            );
        }
        assert!(
            out.iter().all(|op| matches!(op, DiskOp::Write { .. })),
            "{out:?}"
        );
        // ...but the same content again, now that the receiver has it, is free.
        out.clear();
        base.filter(
            DiskOp::Write {
                disk: 0,
                offset: 0,
                data: block(3),
            },
            &mut out,
        );
        assert!(matches!(out[0], DiskOp::Same { .. }), "{out:?}");
        // A partial write makes the block unknown.
        out.clear();
        base.filter(
            DiskOp::Write {
                disk: 0,
                offset: 512,
                data: vec![3; 512],
            },
            &mut out,
        );
        base.filter(
            DiskOp::Write {
                disk: 0,
                offset: 0,
                data: block(3),
            },
            &mut out,
        );
        assert!(
            out.iter().all(|op| matches!(op, DiskOp::Write { .. })),
            "{out:?}"
        );
    }

    /// A range of a disk of 16 blocks: as often whole blocks as any bytes.
    #[test]
    fn a_spot_check_finds_the_known_blocks_and_tells_their_content() {
        let mut disk = vec![0u8; 64 * PAGE_SIZE];
        for b in [3usize, 10, 11, 40, 63] {
            disk[b * PAGE_SIZE..(b + 1) * PAGE_SIZE].fill(u8::try_from(b).unwrap());
        }
        let mut builder = BaseBuilder::new(9);
        builder.disk(disk.len() as u64);
        builder.add(0, &disk);
        let base = DiskBase::parse(&builder.finish(), &[disk.len() as u64]).unwrap();
        assert_eq!(base.known_blocks(0, 10), [3, 10, 11, 40, 63]);
        assert_eq!(base.known_blocks(0, 2), [3, 11]);
        assert!(base.known_blocks(1, 2).is_empty(), "no such disk");
        let block = |b: usize| &disk[b * PAGE_SIZE..(b + 1) * PAGE_SIZE];
        assert_eq!(base.holds(0, 40, block(40)), Some(true));
        assert_eq!(base.holds(0, 40, block(10)), Some(false));
        assert_eq!(
            base.holds(0, 5, block(5)),
            Some(true),
            "a zero block is known"
        );
        assert_eq!(base.holds(0, 64, block(5)), None, "past the end");
    }

    #[test]
    fn unknown_blocks_are_listed_and_a_whole_write_makes_one_known() {
        let mut base = DiskBase::zeroed(9, &[16 * PAGE_SIZE as u64]).unwrap();
        for b in [2u64, 7, 8] {
            base.track(&DiskOp::Write {
                disk: 0,
                offset: b * PAGE_SIZE as u64 + 512,
                data: vec![1; 1024],
            });
        }
        assert_eq!(base.unknown_blocks(), 3);
        assert_eq!(base.unknown_block_list(0, 2), [2, 7]);
        let block = vec![1u8; PAGE_SIZE];
        base.track(&DiskOp::Write {
            disk: 0,
            offset: 7 * PAGE_SIZE as u64,
            data: block.clone(),
        });
        assert_eq!(base.unknown_block_list(0, 10), [2, 8]);
        assert_eq!(base.holds(0, 7, &block), Some(true));
    }

    fn range() -> impl Strategy<Value = (u64, u64)> {
        let page = PAGE_SIZE as u64;
        let len = 16 * page;
        prop_oneof![
            (0..len).prop_flat_map(move |offset| (Just(offset), 1..=len - offset)),
            (0..16u64)
                .prop_flat_map(move |b| (Just(b * page), (1..=16 - b).prop_map(move |n| n * page))),
        ]
    }

    /// Operations on a disk of 16 blocks, applied to its bytes here as the receiver would:
    /// writes of whole or partial blocks from a few contents (so that content repeats), zeroes
    /// and trims of whole blocks or any bytes.
    fn ops() -> impl Strategy<Value = Vec<DiskOp>> {
        let op = prop_oneof![
            (0u64..16, 1u64..4, 0u8..3).prop_map(move |(block, blocks, fill)| {
                let offset = block * PAGE_SIZE as u64;
                let blocks = blocks.min(16 - block);
                DiskOp::Write {
                    disk: 0,
                    offset,
                    data: vec![fill; usize::try_from(blocks).unwrap() * PAGE_SIZE],
                }
            }),
            (range(), 0u8..3).prop_map(|((offset, n), fill)| DiskOp::Write {
                disk: 0,
                offset,
                data: vec![fill; usize::try_from(n.min(3 * PAGE_SIZE as u64)).unwrap()],
            }),
            range().prop_map(|(offset, len)| DiskOp::Zeroes {
                disk: 0,
                offset,
                len,
                may_trim: false,
            }),
            range().prop_map(|(offset, len)| DiskOp::Trim {
                disk: 0,
                offset,
                len
            }),
        ];
        proptest::collection::vec(op, 0..40)
    }

    /// `disk` after `op`; a trimmed range reads back as zeros here.
    fn apply(disk: &mut [u8], op: &DiskOp) {
        let at = |o: u64| usize::try_from(o).unwrap();
        match op {
            DiskOp::Write { offset, data, .. } => {
                disk[at(*offset)..at(*offset) + data.len()].copy_from_slice(data)
            }
            DiskOp::Zeroes { offset, len, .. } | DiskOp::Trim { offset, len, .. } => {
                disk[at(*offset)..at(offset + len)].fill(0)
            }
            DiskOp::Flush { .. } | DiskOp::Same { .. } => {}
        }
    }

    /// Every block `base` knows holds what it says in `disk`.
    fn known_blocks_hold(base: &DiskBase, disk: &[u8]) -> Result<usize, TestCaseError> {
        let mut known = 0;
        for (block, &h) in disk.chunks(PAGE_SIZE).zip(&base.disks[0]) {
            if h != UNKNOWN {
                prop_assert_eq!(h, block_hash(base.key, block));
                known += 1;
            }
        }
        Ok(known)
    }

    proptest! {
        /// What the view sends leaves the receiver with the sender's disk; the view after it is
        /// an index of that disk, block by block, and reads back as itself.
        #[test]
        fn the_view_after_any_operations_indexes_the_disk_they_leave(
            start in proptest::collection::vec(0u8..3, 16),
            ops in ops(),
            from_zero in any::<bool>(),
        ) {
            let mut disk: Vec<u8> = start.iter().flat_map(|&b| [b; PAGE_SIZE]).collect();
            let mut base = if from_zero {
                disk.fill(0);
                DiskBase::zeroed(9, &[disk.len() as u64]).unwrap()
            } else {
                base_of(&disk)
            };
            // The receiver's disk, given what the view sends (SAME: what it holds already).
            let mut receiver = disk.clone();
            let mut out = Vec::new();
            for op in &ops {
                if from_zero {
                    base.track(op);
                    apply(&mut receiver, op);
                } else {
                    out.clear();
                    base.filter(op.clone(), &mut out);
                    for sent in &out {
                        apply(&mut receiver, sent);
                    }
                }
                apply(&mut disk, op);
            }
            prop_assert!(receiver == disk, "the receiver's disk differs from the sender's");
            let known = known_blocks_hold(&base, &disk)?;
            let again = DiskBase::parse(&base.serialize(), &[disk.len() as u64]).unwrap();
            prop_assert!(again.disks == base.disks && again.key == base.key);
            // With no partial block, no trim, it is the index the receiver would build.
            if known == 16 {
                let mut builder = BaseBuilder::new(base.key);
                builder.disk(disk.len() as u64);
                builder.add(0, &disk);
                prop_assert_eq!(base.serialize(), builder.finish());
            }
        }
    }

    #[test]
    fn a_copy_tracked_from_zero_is_sent_as_same_the_next_time() {
        // The first move: a bulk copy in 64 KiB writes, one block written only in part.
        let disk = distinct_blocks(64 * PAGE_SIZE);
        let size = disk.len() as u64;
        let mut first = DiskBase::zeroed(3, &[size]).unwrap();
        for (n, chunk) in disk.chunks(16 * PAGE_SIZE).enumerate() {
            first.track(&DiskOp::Write {
                disk: 0,
                offset: (n * 16 * PAGE_SIZE) as u64,
                data: chunk.to_vec(),
            });
        }
        first.track(&DiskOp::Write {
            disk: 0,
            offset: 5 * PAGE_SIZE as u64 + 100,
            data: disk[5 * PAGE_SIZE + 100..5 * PAGE_SIZE + 200].to_vec(),
        });
        assert_eq!(first.same_bytes, 0);
        // The way back, from the kept index: all but the partly written block go as SAME.
        let mut back = DiskBase::parse(&first.serialize(), &[size]).unwrap();
        let mut out = Vec::new();
        back.filter(
            DiskOp::Write {
                disk: 0,
                offset: 0,
                data: disk.clone(),
            },
            &mut out,
        );
        assert_eq!(back.same_bytes, size - PAGE_SIZE as u64, "{out:?}");
        assert!(
            matches!(&out[1], DiskOp::Write { offset, data, .. }
                if *offset == 5 * PAGE_SIZE as u64 && data.len() == PAGE_SIZE),
            "{out:?}"
        );
        // A disk larger than an index may describe is refused before anything is held.
        assert!(DiskBase::zeroed(3, &[(MAX_BLOCKS + 1) * PAGE_SIZE as u64]).is_err());
    }

    #[test]
    fn malformed_indexes_are_refused() {
        let mut builder = BaseBuilder::new(1);
        builder.disk(16 * PAGE_SIZE as u64);
        builder.add(0, &block(1));
        let index = builder.finish();
        assert!(DiskBase::parse(&index, &[16 * PAGE_SIZE as u64]).is_ok());
        assert!(DiskBase::parse(&index, &[32 * PAGE_SIZE as u64]).is_err());
        assert!(DiskBase::parse(&index, &[]).is_err());
        for cut in 0..index.len() {
            assert!(
                DiskBase::parse(&index[..cut], &[16 * PAGE_SIZE as u64]).is_err(),
                "cut at {cut}"
            );
        }
    }
}
