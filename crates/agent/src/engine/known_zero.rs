//! Which of the destination QEMU's guest pages are known to be zero before the stream arrives.
//!
//! QEMU's source sends a zero-page record for every zero page of its first pass (most of a
//! fresh or idle guest), and the destination QEMU checks its own copy of each one before
//! clearing it. On memory backed by a shared file (tmpfs, hugetlbfs: what vhost-user and the
//! lab use) that check faults in, allocates and reads a page that was a hole: about 4 µs each
//! here, a core busy for half a second per 512 MiB of zeros, and on the switchover's critical
//! path when the last pass has many. A page that lies in a hole of the backend's file is zero
//! without looking at it, so [`crate::engine::load_sieve`] leaves such records out.
//!
//! Only what can be shown is trusted: a `memory-backend-file` mapped shared (QEMU's own writes,
//! a ROM copied in at reset, land in the file), whose file's holes the agent can see with
//! `SEEK_DATA`/`SEEK_HOLE`. Anonymous and memfd memory, private mappings and files whose holes
//! cannot be seen are left to QEMU's own check. Finding nothing is never an error: the
//! migration then simply carries every record to QEMU.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ferry_qemu::commands::{QomGet, QomList};
use ferry_qemu::stream::{flag, RamData, RamRecord, PAGE_SIZE};
use ferry_qemu::Qmp;

/// One bit per page of a RAM block: set while the destination's copy is known to be zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageBits {
    words: Vec<u64>,
    pages: u64,
}

impl PageBits {
    /// `pages` pages, none known zero.
    pub fn new(pages: u64) -> PageBits {
        let words = usize::try_from(pages.div_ceil(64)).expect("a RAM block's bitmap fits memory");
        PageBits {
            words: vec![0; words],
            pages,
        }
    }

    /// `pages` pages, all known zero.
    pub fn full(pages: u64) -> PageBits {
        let mut bits = PageBits::new(pages);
        bits.words.fill(u64::MAX);
        if !pages.is_multiple_of(64) {
            if let Some(last) = bits.words.last_mut() {
                *last = (1 << (pages % 64)) - 1;
            }
        }
        bits
    }

    pub fn get(&self, page: u64) -> bool {
        page < self.pages && self.words[word(page)] & bit(page) != 0
    }

    /// Pages outside the block are ignored (QEMU refuses them itself).
    pub fn set(&mut self, page: u64, zero: bool) {
        if page >= self.pages {
            return;
        }
        if zero {
            self.words[word(page)] |= bit(page);
        } else {
            self.words[word(page)] &= !bit(page);
        }
    }

    /// Marks `pages` (clipped to the block) as zero.
    pub fn set_range(&mut self, pages: std::ops::Range<u64>) {
        for page in pages.start..pages.end.min(self.pages) {
            self.set(page, true);
        }
    }

    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Follows one page record of QEMU's stream for page `page` of this block: whether it
    /// would change nothing (a zero page for a page known zero), and what the page is after it.
    /// The source (to count the destination's work) and the destination (to leave the record
    /// out) keep the same marks this way.
    pub fn follow(&mut self, page: u64, record: &RamRecord) -> bool {
        let zero_fill = matches!(record.data, RamData::Fill(0));
        let only_zero = record.flags & !(flag::ZERO | flag::CONTINUE) == 0;
        if zero_fill && only_zero && self.get(page) {
            return true;
        }
        // QEMU clears the page or gives it content.
        self.set(page, zero_fill);
        false
    }
}

fn word(page: u64) -> usize {
    usize::try_from(page / 64).expect("checked against the block's size")
}

fn bit(page: u64) -> u64 {
    1 << (page % 64)
}

/// Known-zero pages of the RAM blocks that have any, by QEMU's block name.
#[derive(Debug, Default, Clone)]
pub struct ZeroPages {
    blocks: HashMap<Vec<u8>, PageBits>,
}

impl ZeroPages {
    /// Nothing known: every record goes to QEMU.
    pub fn none() -> ZeroPages {
        ZeroPages::default()
    }

    pub fn insert(&mut self, block: &[u8], pages: PageBits) {
        self.blocks.insert(block.to_vec(), pages);
    }

    pub fn block_mut(&mut self, block: &[u8]) -> Option<&mut PageBits> {
        self.blocks.get_mut(block)
    }

    /// Pages known zero, over all blocks.
    pub fn count(&self) -> u64 {
        self.blocks.values().map(PageBits::count).sum()
    }

    /// The blocks whose every page is known zero (a fresh memory file).
    pub fn all_zero_blocks(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .blocks
            .iter()
            .filter(|(_, bits)| bits.count() == bits.pages())
            .map(|(name, _)| String::from_utf8_lossy(name).into_owned())
            .collect();
        names.sort();
        names
    }
}

/// Finds the destination QEMU's file-backed RAM and the holes of its files. Call it before
/// QEMU loads anything (it is waiting for `migrate-incoming`).
pub async fn discover(qmp: &Qmp) -> Result<ZeroPages> {
    let mut found = ZeroPages::none();
    let objects = qmp
        .execute(&QomList {
            path: "/objects".into(),
        })
        .await
        .context("qom-list /objects")?;
    for object in objects {
        if object.kind != "child<memory-backend-file>" {
            continue;
        }
        let path = format!("/objects/{}", object.name);
        let get = |property: &'static str| {
            let path = path.clone();
            async move {
                qmp.execute(&QomGet {
                    path,
                    property: property.into(),
                })
                .await
                .with_context(|| format!("qom-get {property}"))
            }
        };
        if get("share").await?.as_bool() != Some(true) {
            // A private mapping: QEMU's writes do not show in the file.
            continue;
        }
        let mem_path = get("mem-path").await?;
        let Some(mem_path) = mem_path.as_str().map(PathBuf::from) else {
            bail!("{path}: mem-path is {mem_path}");
        };
        let size = get("size").await?.as_u64().context("size")?;
        // `offset` is QEMU 8.1's; without it the mapping starts at the file's beginning.
        let offset = get("offset")
            .await
            .ok()
            .and_then(|v| v.as_u64())
            .unwrap_or(0);
        if mem_path.is_dir() {
            // QEMU made itself an unlinked file there: fresh, but not one we can look at.
            continue;
        }
        let pages = holes(&mem_path, offset, size)
            .with_context(|| format!("{path}: the holes of {}", mem_path.display()))?;
        tracing::debug!(
            "{path}: {} of {} pages are holes in {}",
            pages.count(),
            size / PAGE_SIZE as u64,
            mem_path.display()
        );
        found.insert(object.name.as_bytes(), pages);
    }
    Ok(found)
}

/// The pages of `[offset, offset + size)` of `file` that lie wholly in holes (read as zero).
pub fn holes(file: &Path, offset: u64, size: u64) -> Result<PageBits> {
    let page = PAGE_SIZE as u64;
    // The mapping lies within the file QEMU made (it sizes the file to it): a size beyond
    // that is refused before a bitmap is made for it.
    let f = File::open(file)?;
    let file_len = f.metadata()?.len();
    let end = offset
        .checked_add(size)
        .filter(|&end| end <= file_len)
        .with_context(|| {
            format!("a {size}-byte mapping at offset {offset} of a {file_len}-byte file")
        })?;
    let mut bits = PageBits::new(size / page);
    let mut at = offset;
    while at < end {
        let data = match seek(&f, at, libc::SEEK_DATA)? {
            Some(data) => data.min(end),
            None => end, // no data from here to the end of the file
        };
        // `[at, data)` is a hole: its whole pages, relative to the mapping.
        bits.set_range((at - offset).div_ceil(page)..(data - offset) / page);
        if data >= end {
            break;
        }
        at = seek(&f, data, libc::SEEK_HOLE)?.unwrap_or(end);
    }
    Ok(bits)
}

/// `lseek(fd, at, whence)`; `None` when there is no data (or hole) at or after `at`.
fn seek(f: &File, at: u64, whence: libc::c_int) -> Result<Option<u64>> {
    let at = libc::off_t::try_from(at).context("offset")?;
    // SAFETY: lseek reads no memory of ours; the descriptor is open for the call's duration.
    let r = unsafe { libc::lseek(f.as_raw_fd(), at, whence) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e).context("lseek SEEK_DATA/SEEK_HOLE");
    }
    Ok(Some(u64::try_from(r).expect("non-negative")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn bits_set_clear_and_ignore_pages_outside_the_block() {
        let mut bits = PageBits::new(130);
        bits.set_range(60..70);
        bits.set(129, true);
        bits.set(130, true);
        bits.set(65, false);
        assert_eq!(bits.count(), 10);
        assert!(bits.get(60) && bits.get(69) && bits.get(129));
        assert!(!bits.get(65) && !bits.get(70) && !bits.get(130));
        assert_eq!(PageBits::full(130).count(), 130);
        assert_eq!(PageBits::full(128).count(), 128);
    }

    /// A file with data at a few places: the pages between are holes, the data's are not, and
    /// a mapping at an offset into the file counts from its own start.
    #[test]
    fn holes_of_a_sparse_file() {
        let dir = std::env::temp_dir().join(format!("ferry-holes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mem");
        let page = PAGE_SIZE as u64;
        let mut f = File::create(&path).unwrap();
        f.set_len(64 * page).unwrap();
        for at in [3 * page, 40 * page + 100] {
            f.seek(SeekFrom::Start(at)).unwrap();
            f.write_all(&[1u8; 10]).unwrap();
        }
        f.sync_all().unwrap();
        let all = holes(&path, 0, 64 * page).unwrap();
        // File systems may allocate more than the page written (never less): the written pages
        // are never holes, and most of the file is.
        assert!(!all.get(3) && !all.get(40));
        assert!(all.count() >= 64 - 2 - 30, "{}", all.count());
        let shifted = holes(&path, 8 * page, 32 * page).unwrap();
        assert!(!shifted.get(32) && shifted.count() <= 32);
        for p in 0..32 {
            assert_eq!(shifted.get(p), all.get(p + 8), "page {p}");
        }
        // A file with no data at all: every page is known zero.
        let empty = dir.join("empty");
        File::create(&empty).unwrap().set_len(16 * page).unwrap();
        assert_eq!(holes(&empty, 0, 16 * page).unwrap().count(), 16);
        // A size QEMU could not have mapped is refused before a bitmap is made for it.
        for (offset, size) in [(0, 1 << 50), (8 * page, 16 * page), (u64::MAX, 2 * page)] {
            let err = holes(&empty, offset, size).unwrap_err();
            assert!(err.to_string().contains("-byte mapping at offset"), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
