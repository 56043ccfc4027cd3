//! The agent's seed images: the memory a VM had when it left this host, kept so that when it
//! comes back (or a sibling made from the same template arrives) the pages still here travel
//! as references instead of 4 KiB each (CloudNet's follow-the-sun; the codec's [`ferry_codec::seed`]).
//!
//! One file per VM, `<seed dir>/<vm>.ram`: the guest's physical memory from address 0, as
//! QEMU's `pmemsave` writes it from the paused source after the commit. Only the first
//! [`SAVED_BYTES_MAX`] are saved: on x86 machines RAM above that may sit above the PCI hole,
//! where one linear dump would not find it. The content, not the layout, is what matters:
//! the destination indexes the image by page content.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ferry_api::agent::SeedReport;
use ferry_codec::{index_image, SeedImage};
use ferry_qemu::commands::Pmemsave;
use ferry_qemu::Qmp;

/// The part of guest-physical memory saved: every x86 machine type QEMU has keeps RAM up to
/// 2 GiB contiguous from address 0.
pub const SAVED_BYTES_MAX: u64 = 2 << 30;

/// The file holding `vm`'s image; the name must be a plain file name (it comes from a peer).
pub fn image_path(seed_dir: &Path, vm: &str) -> Result<PathBuf> {
    let plain = !vm.is_empty()
        && !vm.starts_with('.')
        && vm
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !plain {
        bail!("{vm:?} is not a VM name a seed image can have (letters, digits, '-', '_', '.')");
    }
    Ok(seed_dir.join(format!("{vm}.ram")))
}

/// Saves the memory of the paused VM behind `qmp` as `vm`'s image, replacing any earlier one
/// only once the new one is whole.
pub async fn save(qmp: &Qmp, seed_dir: &Path, vm: &str, ram_bytes: u64) -> Result<u64> {
    let path = image_path(seed_dir, vm)?;
    std::fs::create_dir_all(seed_dir).with_context(|| format!("create {}", seed_dir.display()))?;
    let partial = path.with_extension("ram.partial");
    let size = ram_bytes.min(SAVED_BYTES_MAX);
    qmp.execute(&Pmemsave {
        val: 0,
        size,
        filename: partial.display().to_string(),
    })
    .await
    .context("QEMU's pmemsave")?;
    std::fs::rename(&partial, &path)
        .with_context(|| format!("rename {} to {}", partial.display(), path.display()))?;
    Ok(size)
}

/// Removes the oldest images (by modification time) until those in `seed_dir` take at most
/// `budget_bytes`, never `keep`'s (the one just saved). Returns the VMs whose images went.
/// A mapped image being read by a migration stays readable: removing unlinks the name only.
pub fn evict(seed_dir: &Path, budget_bytes: u64, keep: &str) -> Result<Vec<String>> {
    let mut images = Vec::new();
    for entry in
        std::fs::read_dir(seed_dir).with_context(|| format!("list {}", seed_dir.display()))?
    {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(vm) = name.strip_suffix(".ram") else {
            continue;
        };
        let meta = entry.metadata()?;
        images.push((meta.modified()?, meta.len(), vm.to_owned()));
    }
    let mut total: u64 = images.iter().map(|(_, len, _)| len).sum();
    images.sort();
    let mut evicted = Vec::new();
    for (_, len, vm) in images {
        if total <= budget_bytes {
            break;
        }
        if vm == keep {
            continue;
        }
        std::fs::remove_file(seed_dir.join(format!("{vm}.ram")))
            .with_context(|| format!("remove {vm}'s seed image"))?;
        total -= len;
        evicted.push(vm);
    }
    Ok(evicted)
}

/// An image, mapped into memory, with its index for the source. Nothing writes the mapped
/// file: a new image for the same VM is a new file renamed over it, and the mapping keeps the
/// old one (and a byte changed anyway would fail the stream's digest check, not the guest).
pub struct Loaded {
    pub image: SeedImage,
    pub index: Vec<u8>,
    pub report: SeedReport,
}

/// Reads and indexes `vm`'s image if this agent holds one. Blocking: call it off the runtime.
pub fn load(seed_dir: &Path, vm: &str) -> Result<Option<Loaded>> {
    let path = image_path(seed_dir, vm)?;
    let started = Instant::now();
    let file = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(anyhow::Error::new(e).context(format!("open {}", path.display()))),
    };
    // SAFETY: the agent owns the seed directory and never writes a file in place (see above).
    let bytes =
        unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("map {}", path.display()))?;
    let (index, pages) = index_image(&bytes);
    let report = SeedReport {
        image: vm.to_owned(),
        pages,
        index_bytes: index.len() as u64,
        index_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    };
    Ok(Some(Loaded {
        image: SeedImage::new(bytes),
        index,
        report,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_a_peer_cannot_leave_the_seed_dir() {
        let dir = Path::new("/seeds");
        assert_eq!(
            image_path(dir, "web-1.eu").unwrap(),
            Path::new("/seeds/web-1.eu.ram")
        );
        for bad in ["", "../etc/passwd", "a/b", ".hidden", "x y"] {
            assert!(image_path(dir, bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_oldest_images_go_first_beyond_the_budget() {
        let dir = std::env::temp_dir().join(format!("ferry-seed-evict-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let t0 = std::time::SystemTime::now() - std::time::Duration::from_secs(100);
        for (i, vm) in ["old", "mid", "new"].iter().enumerate() {
            let path = dir.join(format!("{vm}.ram"));
            std::fs::write(&path, vec![1u8; 4096]).unwrap();
            let f = std::fs::File::options().write(true).open(&path).unwrap();
            f.set_modified(t0 + std::time::Duration::from_secs(10 * i as u64))
                .unwrap();
        }
        std::fs::write(dir.join("other.txt"), b"not an image").unwrap();
        // The newest is kept even when it is the only one over the budget's head.
        assert_eq!(evict(&dir, 2 * 4096, "new").unwrap(), ["old"]);
        assert_eq!(evict(&dir, 0, "new").unwrap(), ["mid"]);
        assert!(dir.join("new.ram").exists() && dir.join("other.txt").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_image_is_none_and_a_present_one_is_indexed() {
        let dir = std::env::temp_dir().join(format!("ferry-seed-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(load(&dir, "vm1").unwrap().is_none());
        let mut image = vec![0u8; 3 * 4096];
        image[4096] = 1;
        image[8192] = 2;
        std::fs::write(dir.join("vm1.ram"), &image).unwrap();
        let loaded = load(&dir, "vm1").unwrap().unwrap();
        assert_eq!(loaded.report.pages, 2);
        assert_eq!(loaded.report.index_bytes, loaded.index.len() as u64);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
