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
//! one); every block not listed is all zeros. The key makes the hash unpredictable to anyone
//! who does not know it, so a guest cannot craft a collision.

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

    /// Appends to `out` what to send for `op`, given what the receiver holds, and records what
    /// it will hold after it.
    pub fn filter(&mut self, op: DiskOp, out: &mut Vec<DiskOp>) {
        let page = PAGE_SIZE as u64;
        match op {
            DiskOp::Write { disk, offset, data } => {
                let Some(known) = self.disks.get_mut(usize::from(disk)) else {
                    out.push(DiskOp::Write { disk, offset, data });
                    return;
                };
                // Runs of blocks: (same?, start, end) in bytes of the write.
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
                let zero = self.zero;
                let Some(known) = self.disks.get_mut(usize::from(disk)) else {
                    out.push(op);
                    return;
                };
                let (first, end) = (offset / page, (offset + len).div_ceil(page));
                let aligned = offset % page == 0 && (offset + len) % page == 0;
                let all_zero = aligned
                    && (first..end)
                        .all(|b| known.get(usize::try_from(b).expect("in disk")) == Some(&zero));
                for b in first..end {
                    let whole = b * page >= offset && (b + 1) * page <= offset + len;
                    if let Some(k) = known.get_mut(usize::try_from(b).expect("in disk")) {
                        *k = if whole { zero } else { UNKNOWN };
                    }
                }
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
                if let Some(known) = self.disks.get_mut(usize::from(disk)) {
                    for b in offset / page..(offset + len).div_ceil(page) {
                        if let Some(k) = known.get_mut(usize::try_from(b).expect("in disk")) {
                            *k = UNKNOWN;
                        }
                    }
                }
                out.push(op);
            }
            DiskOp::Flush { .. } | DiskOp::Same { .. } => out.push(op),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

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
