//! What a domain's disks held when they left this host through libvirt's migration, kept
//! for their return (CloudNet's follow the sun on libvirt's path, issue 21).
//!
//! libvirt keeps the image a domain leaves. When the domain comes back, the destination
//! (this host) must tell the source what that image holds, so that unchanged blocks cross as
//! SAME. Reading and hashing the image costs about 1.5 s per GiB. But when the domain left,
//! the relay followed every write the copy made at the other end, so it knew, block by block,
//! what the image here held as it left ([`crate::engine::disk::relay::Left`]). That index is
//! kept here, with a fingerprint of the image and its backing files (device, inode, size,
//! modification time). If they are unchanged when the domain comes back, nothing wrote the
//! image since, and the kept index stands for it; otherwise the image is indexed as before.
//!
//! A departure is kept only if no file of the chain was modified after the relay ended: the
//! source QEMU writes nothing after the pause, which comes before that, so the image then
//! holds what the index says. A record is used once.
//!
//! Layout: `<dir>/<domain>/<export>.json` (the fingerprints) and `.idx` (the index), each
//! written whole under a temporary name first. The oldest records go first beyond the budget.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::engine::disk::relay::{Arrival, KeptIndexes, Left};

/// The most bytes of kept indexes (about 4.5 MiB per fully written GiB of disk).
pub const BUDGET_BYTES: u64 = 1 << 30;

/// Where the indexes are kept, and how much of them.
#[derive(Debug, Clone)]
pub struct DiskMemory {
    dir: PathBuf,
    budget_bytes: u64,
}

/// One file of a disk's chain as it was when the domain left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub path: PathBuf,
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i128,
}

/// What is kept beside an index.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    /// The disk's size, as the export had it.
    size: u64,
    /// The image first, then its backing files.
    chain: Vec<Fingerprint>,
}

/// Why a departure's index was not kept, or why a kept one cannot stand for the image.
#[derive(Debug, thiserror::Error)]
pub enum NotKept {
    #[error("{0:?} is not a name a kept index can have (letters, digits, '-', '_', '.')")]
    Name(String),
    #[error("{} is not a regular file", .0.display())]
    NotAFile(PathBuf),
    #[error("{} was modified after the domain left", .0.display())]
    WrittenAfter(PathBuf),
    #[error("no index kept from the domain's departure")]
    None,
    #[error("the image at the destination changed after the domain left ({0})")]
    Changed(String),
    #[error("the domain's disk here is not the one it left ({0})")]
    Other(String),
    #[error("{0}")]
    Io(String),
}

impl DiskMemory {
    pub fn new(dir: PathBuf, budget_bytes: u64) -> DiskMemory {
        DiskMemory { dir, budget_bytes }
    }

    /// Keeps what `left` says `domain`'s disk held as it left this host, whose image and
    /// backing files are `chain` (top first), replacing an earlier record. Returns the index's
    /// size.
    pub fn remember(&self, domain: &str, left: &Left, chain: &[PathBuf]) -> Result<u64, NotKept> {
        let (dir, base) = self.paths(domain, &left.export)?;
        let chain = chain
            .iter()
            .map(|path| {
                let print = fingerprint(path)?;
                if print.mtime_ns > unix_ns(left.ended) {
                    return Err(NotKept::WrittenAfter(path.clone()));
                }
                Ok(print)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let record = Record {
            size: left.size,
            chain,
        };
        let json = serde_json::to_vec_pretty(&record).expect("a record serializes");
        let io = |what: &str, e: std::io::Error| NotKept::Io(format!("{what}: {e}"));
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir.display().to_string(), e))?;
        // The index first: a record is only read once its fingerprints are there.
        write_whole(&with_suffix(&base, "idx"), &left.index).map_err(|e| io("index", e))?;
        write_whole(&with_suffix(&base, "json"), &json).map_err(|e| io("record", e))?;
        if let Err(e) = self.evict(&base) {
            tracing::warn!("kept disk indexes: {e}");
        }
        Ok(left.index.len() as u64)
    }

    /// The index kept for `domain`'s disk `export` of `size` bytes, if its image and backing
    /// files here are `chain` (the image first) and untouched since the domain left. The
    /// record goes either way, and only one caller gets it: a return writes the image.
    pub fn recall(
        &self,
        domain: &str,
        export: &str,
        size: u64,
        chain: &[PathBuf],
    ) -> Result<Vec<u8>, NotKept> {
        let (_, base) = self.paths(domain, export)?;
        // Claimed by renaming it away first: a second caller finds nothing.
        let taken = with_suffix(&base, &format!("taken-{}", std::process::id()));
        if std::fs::rename(with_suffix(&base, "json"), &taken).is_err() {
            let _ = std::fs::remove_file(with_suffix(&base, "idx"));
            return Err(NotKept::None);
        }
        let record = std::fs::read(&taken);
        let index = std::fs::read(with_suffix(&base, "idx"));
        let _ = std::fs::remove_file(&taken);
        let _ = std::fs::remove_file(with_suffix(&base, "idx"));
        let (Ok(record), Ok(index)) = (record, index) else {
            return Err(NotKept::None);
        };
        let record: Record = serde_json::from_slice(&record)
            .map_err(|e| NotKept::Io(format!("{}: {e}", base.display())))?;
        if record.size != size {
            return Err(NotKept::Other(format!(
                "it was {} bytes, the export is {size}",
                record.size
            )));
        }
        // libvirt opens the chain its XML names, not the one the image's header names: the
        // whole chain must be the one recorded.
        let left: Vec<&Path> = record.chain.iter().map(|f| f.path.as_path()).collect();
        let now: Vec<&Path> = chain.iter().map(PathBuf::as_path).collect();
        if left != now {
            return Err(NotKept::Other(format!(
                "it is {}, it left {}",
                show_chain(&now),
                show_chain(&left)
            )));
        }
        for kept in &record.chain {
            let print = fingerprint(&kept.path).map_err(|e| NotKept::Changed(format!("{e}")))?;
            if &print != kept {
                return Err(NotKept::Changed(format!(
                    "{} was written",
                    kept.path.display()
                )));
            }
        }
        Ok(index)
    }

    /// `<dir>/<domain>` and `<dir>/<domain>/<export>` (without extension); both names come
    /// from a peer or from libvirt and must stay plain file names.
    fn paths(&self, domain: &str, export: &str) -> Result<(PathBuf, PathBuf), NotKept> {
        for name in [domain, export] {
            if !plain_name(name) {
                return Err(NotKept::Name(name.to_owned()));
            }
        }
        let dir = self.dir.join(domain);
        let base = dir.join(export);
        Ok((dir, base))
    }

    /// Removes the oldest records until all take at most the budget, never `keep`'s.
    fn evict(&self, keep: &Path) -> std::io::Result<()> {
        let mut records = Vec::new();
        for domain in std::fs::read_dir(&self.dir)? {
            let domain = domain?.path();
            if !domain.is_dir() {
                continue;
            }
            for entry in std::fs::read_dir(&domain)? {
                let path = entry?.path();
                if path.extension().is_some_and(|e| e == "idx") {
                    let meta = std::fs::metadata(&path)?;
                    records.push((meta.modified()?, meta.len(), path.with_extension("")));
                }
            }
        }
        let mut total: u64 = records.iter().map(|r| r.1).sum();
        records.sort();
        for (_, len, base) in records {
            if total <= self.budget_bytes {
                break;
            }
            if base == keep {
                continue;
            }
            let _ = std::fs::remove_file(with_suffix(&base, "json"));
            std::fs::remove_file(with_suffix(&base, "idx"))?;
            tracing::info!(
                "kept disk indexes: {} removed (over budget)",
                base.display()
            );
            total -= len;
        }
        Ok(())
    }
}

impl KeptIndexes for DiskMemory {
    fn recall(&self, a: &Arrival) -> Result<Vec<u8>, String> {
        let index = DiskMemory::recall(self, &a.domain, &a.export, a.size, &a.chain);
        let index = index.map_err(|e| e.to_string())?;
        // The source named the paths; the process serving the export must hold those very
        // files (a libvirt hook may rewrite a migrating domain's disk paths). The relay then
        // reads a few blocks back, which ties the export itself to the index.
        let pid = a
            .server_pid
            .ok_or("the process serving the export is not known")?;
        for path in &a.chain {
            if !holds_open(pid, path)? {
                return Err(format!(
                    "the domain's disk here is not the one it left ({} is not open in process {pid}, which serves the export)",
                    path.display()
                ));
            }
        }
        Ok(index)
    }
}

/// Whether process `pid` has `path`'s file open (by device and inode).
fn holds_open(pid: i32, path: &Path) -> Result<bool, String> {
    let want = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map_err(|e| format!("the files process {pid} holds open: {e}"))?;
    Ok(fds.flatten().any(|fd| {
        std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == want.dev() && m.ino() == want.ino())
    }))
}

/// `base` with `.suffix` appended (an export's name may hold dots of its own).
fn with_suffix(base: &Path, suffix: &str) -> PathBuf {
    let mut name = base.as_os_str().to_owned();
    name.push(".");
    name.push(suffix);
    PathBuf::from(name)
}

fn show_chain(chain: &[&Path]) -> String {
    let names: Vec<String> = chain.iter().map(|p| p.display().to_string()).collect();
    names.join(" over ")
}

fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn fingerprint(path: &Path) -> Result<Fingerprint, NotKept> {
    let meta =
        std::fs::metadata(path).map_err(|e| NotKept::Io(format!("{}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(NotKept::NotAFile(path.to_owned()));
    }
    Ok(Fingerprint {
        path: path.to_owned(),
        dev: meta.dev(),
        ino: meta.ino(),
        size: meta.len(),
        mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
    })
}

fn unix_ns(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

fn write_whole(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let partial = with_suffix(path, "partial");
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, DiskMemory, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("vm.qcow2");
        std::fs::write(&image, b"image").unwrap();
        let memory = DiskMemory::new(dir.path().join("disks"), BUDGET_BYTES);
        (dir, memory, image)
    }

    fn left(index: &[u8]) -> Left {
        Left {
            export: "drive-virtio-disk0".into(),
            size: 1 << 20,
            index: index.to_vec(),
            unknown_blocks: 0,
            ended: SystemTime::now(),
        }
    }

    #[test]
    fn a_kept_index_is_recalled_once_while_its_image_is_untouched() {
        let (_dir, memory, image) = setup();
        let chain = [image];
        assert_eq!(memory.remember("vm", &left(b"index"), &chain).unwrap(), 5);
        let recalled = memory.recall("vm", "drive-virtio-disk0", 1 << 20, &chain);
        assert_eq!(recalled.unwrap(), b"index");
        let again = memory.recall("vm", "drive-virtio-disk0", 1 << 20, &chain);
        assert!(matches!(again, Err(NotKept::None)), "{again:?}");
    }

    #[test]
    fn a_written_image_another_file_or_size_is_not_recalled() {
        let (_dir, memory, image) = setup();
        let chain = [image.clone()];
        let export = "drive-virtio-disk0";
        memory.remember("vm", &left(b"i"), &chain).unwrap();
        std::fs::write(&image, b"written").unwrap();
        let e = memory.recall("vm", export, 1 << 20, &chain).unwrap_err();
        assert!(e.to_string().contains("was written"), "{e}");

        memory.remember("vm", &left(b"i"), &chain).unwrap();
        let e = memory.recall("vm", export, 2 << 20, &chain).unwrap_err();
        assert!(e.to_string().contains("the export is 2097152"), "{e}");

        memory.remember("vm", &left(b"i"), &chain).unwrap();
        let other = [image.with_extension("raw")];
        let e = memory.recall("vm", export, 1 << 20, &other).unwrap_err();
        assert!(e.to_string().contains("not the one it left"), "{e}");

        // The same image over another backing file, or over none: libvirt would open that.
        let base = image.with_extension("base");
        std::fs::write(&base, b"base").unwrap();
        let layered = [image.clone(), base.clone()];
        memory.remember("vm", &left(b"i"), &layered).unwrap();
        let e = memory.recall("vm", export, 1 << 20, &chain).unwrap_err();
        assert!(e.to_string().contains("it left"), "{e}");
        memory.remember("vm", &left(b"i"), &layered).unwrap();
        std::fs::write(&base, b"rebased").unwrap();
        let e = memory.recall("vm", export, 1 << 20, &layered).unwrap_err();
        assert!(e.to_string().contains("vm.base was written"), "{e}");
    }

    #[test]
    fn export_names_with_dots_keep_records_of_their_own() {
        let (_dir, memory, image) = setup();
        let chain = [image];
        for export in ["disk.a", "disk.b"] {
            let mut l = left(export.as_bytes());
            l.export = export.into();
            memory.remember("vm", &l, &chain).unwrap();
        }
        for export in ["disk.a", "disk.b"] {
            let index = memory.recall("vm", export, 1 << 20, &chain).unwrap();
            assert_eq!(index, export.as_bytes());
        }
    }

    #[test]
    fn an_image_modified_after_the_relay_ended_is_not_kept() {
        let (_dir, memory, image) = setup();
        let mut early = left(b"i");
        early.ended = SystemTime::now() - std::time::Duration::from_secs(60);
        let e = memory.remember("vm", &early, &[image]).unwrap_err();
        assert!(matches!(e, NotKept::WrittenAfter(_)), "{e}");
        let dir = memory.dir.join("vm");
        assert!(!dir.join("drive-virtio-disk0.idx").exists());
    }

    #[test]
    fn a_kept_index_stands_only_for_a_file_the_exports_server_holds_open() {
        let (_dir, memory, image) = setup();
        let arrival = |pid| Arrival {
            domain: "vm".into(),
            export: "drive-virtio-disk0".into(),
            size: 1 << 20,
            chain: vec![image.clone()],
            server_pid: Some(pid),
        };
        let me = i32::try_from(std::process::id()).unwrap();
        memory
            .remember("vm", &left(b"i"), std::slice::from_ref(&image))
            .unwrap();
        let e = KeptIndexes::recall(&memory, &arrival(me)).unwrap_err();
        assert!(e.contains("is not open in process"), "{e}");
        let _open = std::fs::File::open(&image).unwrap();
        memory
            .remember("vm", &left(b"i"), std::slice::from_ref(&image))
            .unwrap();
        assert_eq!(KeptIndexes::recall(&memory, &arrival(me)).unwrap(), b"i");
    }

    #[test]
    fn names_from_a_peer_cannot_leave_the_directory() {
        let (_dir, memory, image) = setup();
        for bad in ["../x", "", ".hidden", "a/b"] {
            let e = memory.recall(bad, "drive-virtio-disk0", 1, std::slice::from_ref(&image));
            assert!(matches!(e, Err(NotKept::Name(_))), "{bad}: {e:?}");
            let e = memory.recall("vm", bad, 1, std::slice::from_ref(&image));
            assert!(matches!(e, Err(NotKept::Name(_))), "{bad}: {e:?}");
        }
    }

    #[test]
    fn the_oldest_records_go_first_beyond_the_budget() {
        let (_dir, mut memory, image) = setup();
        memory.budget_bytes = 10;
        let chain = [image];
        for domain in ["a", "b", "c"] {
            memory.remember(domain, &left(b"12345"), &chain).unwrap();
        }
        let kept = |d: &str| memory.dir.join(d).join("drive-virtio-disk0.idx").exists();
        assert!(kept("c") && kept("b"), "the newest two fit");
        assert!(!kept("a"), "the oldest went");
    }
}
