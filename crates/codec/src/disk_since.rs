//! What changed on the sender's disks since the receiver's copy was made, by QEMU's dirty
//! bitmaps: the other way to send an older copy only what changed ([`crate::disk_base`]
//! compares content and needs the receiver to read its whole copy first).
//!
//! When a VM arrives at a host, a bitmap on each disk there starts recording writes; the copy
//! it left behind is exactly what that disk held then. On the way back, a part of the disk
//! whose bitmap is still clean has not been written since, so the receiver holds it: the
//! sender sends it as [`DiskOp::Same`]. A bitmap only ever gains dirty parts, and QEMU marks
//! a write once it completed; the sender marks what it learns ([`ChangedSince::mark_dirty`])
//! after the data it filters was read, so a part still clean then was clean when it was read.

use crate::disk::DiskOp;

/// One disk's dirty parts, one bit per `granularity` bytes.
struct Disk {
    size: u64,
    granularity: u64,
    dirty: Vec<u64>,
}

impl Disk {
    fn granules(&self, offset: u64, len: u64) -> std::ops::Range<u64> {
        let end = offset.saturating_add(len).min(self.size);
        offset / self.granularity..end.div_ceil(self.granularity)
    }

    fn is_dirty(&self, granule: u64) -> bool {
        let (word, bit) = (granule / 64, granule % 64);
        usize::try_from(word)
            .ok()
            .and_then(|w| self.dirty.get(w))
            .is_none_or(|w| w & (1 << bit) != 0)
    }

    fn set_dirty(&mut self, granule: u64) {
        let (word, bit) = (granule / 64, granule % 64);
        if let Some(w) = usize::try_from(word)
            .ok()
            .and_then(|w| self.dirty.get_mut(w))
        {
            *w |= 1 << bit;
        }
    }
}

/// The sender's view of its disks' dirty bitmaps.
pub struct ChangedSince {
    disks: Vec<Disk>,
    /// Bytes sent as SAME so far.
    pub same_bytes: u64,
}

impl ChangedSince {
    /// Disks of these `(size, granularity)`, nothing dirty yet. A granularity is a power of
    /// two of at least 512 bytes (QEMU's rule).
    pub fn new(disks: &[(u64, u64)]) -> ChangedSince {
        ChangedSince {
            disks: disks
                .iter()
                .map(|&(size, granularity)| {
                    assert!(granularity >= 512 && granularity.is_power_of_two());
                    let granules = size.div_ceil(granularity);
                    Disk {
                        size,
                        granularity,
                        dirty: vec![0; usize::try_from(granules.div_ceil(64)).expect("fits")],
                    }
                })
                .collect(),
            same_bytes: 0,
        }
    }

    /// Records that the bitmap of `disk` is dirty over `offset..offset + len`.
    pub fn mark_dirty(&mut self, disk: u8, offset: u64, len: u64) {
        if let Some(d) = self.disks.get_mut(usize::from(disk)) {
            for g in d.granules(offset, len) {
                d.set_dirty(g);
            }
        }
    }

    /// Bytes of every disk marked dirty (whole granules).
    pub fn dirty_bytes(&self) -> u64 {
        self.disks
            .iter()
            .map(|d| {
                let ones: u64 = d.dirty.iter().map(|w| u64::from(w.count_ones())).sum();
                ones * d.granularity
            })
            .sum()
    }

    /// Appends to `out` what to send for `op`: its parts on clean granules as SAME, the rest
    /// as it is. Trims and flushes always go as they are.
    pub fn filter(&mut self, op: DiskOp, out: &mut Vec<DiskOp>) {
        let (disk, offset, len) = match &op {
            DiskOp::Write { disk, offset, data } => (*disk, *offset, data.len() as u64),
            DiskOp::Zeroes {
                disk, offset, len, ..
            } => (*disk, *offset, *len),
            _ => return out.push(op),
        };
        let Some(d) = self.disks.get(usize::from(disk)) else {
            return out.push(op);
        };
        // Runs of (clean?, start, end), in bytes from the op's start.
        let mut runs: Vec<(bool, u64, u64)> = Vec::new();
        let mut at = 0u64;
        while at < len {
            let pos = offset + at;
            let granule = pos / d.granularity;
            let n = ((granule + 1) * d.granularity - pos).min(len - at);
            let clean = !d.is_dirty(granule);
            match runs.last_mut() {
                Some(r) if r.0 == clean => r.2 = at + n,
                _ => runs.push((clean, at, at + n)),
            }
            at += n;
        }
        if let [(false, _, _)] = runs[..] {
            return out.push(op);
        }
        for (clean, a, b) in runs {
            if clean {
                self.same_bytes += b - a;
                out.push(DiskOp::Same {
                    disk,
                    offset: offset + a,
                    len: b - a,
                });
                continue;
            }
            out.push(match &op {
                DiskOp::Write { data, .. } => DiskOp::Write {
                    disk,
                    offset: offset + a,
                    data: data[usize::try_from(a).expect("in write")
                        ..usize::try_from(b).expect("in write")]
                        .to_vec(),
                },
                DiskOp::Zeroes { may_trim, .. } => DiskOp::Zeroes {
                    disk,
                    offset: offset + a,
                    len: b - a,
                    may_trim: *may_trim,
                },
                _ => unreachable!("only writes and zeroes are split"),
            });
        }
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // small test values
mod tests {
    use super::*;

    const G: u64 = 64 << 10;

    fn write(offset: u64, len: usize) -> DiskOp {
        DiskOp::Write {
            disk: 0,
            offset,
            data: (0..len).map(|i| (i % 251) as u8).collect(),
        }
    }

    #[test]
    fn clean_granules_go_as_same_and_dirty_ones_as_they_are() {
        let mut c = ChangedSince::new(&[(16 * G, G)]);
        c.mark_dirty(0, G + 100, 10); // granule 1 only
        let mut out = Vec::new();
        c.filter(write(G / 2, (2 * G) as usize), &mut out);
        let data: Vec<u8> = (0..2 * G as usize).map(|i| (i % 251) as u8).collect();
        assert_eq!(
            out,
            vec![
                DiskOp::Same {
                    disk: 0,
                    offset: G / 2,
                    len: G / 2
                },
                DiskOp::Write {
                    disk: 0,
                    offset: G,
                    data: data[(G / 2) as usize..(G / 2 + G) as usize].to_vec()
                },
                DiskOp::Same {
                    disk: 0,
                    offset: 2 * G,
                    len: G / 2
                },
            ]
        );
        assert_eq!(c.same_bytes, G);
        assert_eq!(c.dirty_bytes(), G);
    }

    #[test]
    fn a_write_on_dirty_granules_only_is_untouched_and_trims_always_pass() {
        let mut c = ChangedSince::new(&[(16 * G, G), (4 * G, G)]);
        c.mark_dirty(0, 0, 4 * G);
        let mut out = Vec::new();
        c.filter(write(4096, 8192), &mut out);
        assert_eq!(out, vec![write(4096, 8192)]);
        let trim = DiskOp::Trim {
            disk: 0,
            offset: 8 * G,
            len: G,
        };
        out.clear();
        c.filter(trim.clone(), &mut out);
        assert_eq!(out, vec![trim]);
        // Zeroes over a clean disk: the receiver's copy holds them already.
        out.clear();
        c.filter(
            DiskOp::Zeroes {
                disk: 1,
                offset: 0,
                len: 4 * G,
                may_trim: true,
            },
            &mut out,
        );
        assert_eq!(
            out,
            vec![DiskOp::Same {
                disk: 1,
                offset: 0,
                len: 4 * G
            }]
        );
    }

    #[test]
    fn marks_past_the_end_and_unknown_disks_are_ignored_and_dirty_stays_dirty() {
        let mut c = ChangedSince::new(&[(3 * G + 512, G)]);
        c.mark_dirty(0, 3 * G, 10 * G); // the short last granule, and beyond
        c.mark_dirty(9, 0, G);
        assert_eq!(c.dirty_bytes(), G);
        c.mark_dirty(0, 3 * G, 1);
        assert_eq!(c.dirty_bytes(), G);
        let mut out = Vec::new();
        c.filter(write(3 * G, 512), &mut out);
        assert_eq!(out, vec![write(3 * G, 512)]);
        // An op on a disk it does not know goes as it is.
        out.clear();
        let other = DiskOp::Write {
            disk: 4,
            offset: 0,
            data: vec![1; 4096],
        };
        c.filter(other.clone(), &mut out);
        assert_eq!(out, vec![other]);
    }
}
