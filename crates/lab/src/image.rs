//! The tiny guest image: Debian's cloud kernel, a busybox initramfs with the `guest/` programs,
//! and a small ext4 data disk, all from Debian packages.
//!
//! The build is cached under [`cache_dir`]: a manifest records a hash of every input (guest
//! sources, init script, kernel package, busybox version, this builder's version) and the image
//! is rebuilt only when that hash changes.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::sh;

/// Bump when the build steps change in a way the inputs do not show.
/// 2: the virtio_console and virtio_balloon modules.
const BUILDER_VERSION: u32 = 2;

/// The data disk's size: small enough to copy in seconds at test link rates.
pub const DATA_DISK_MIB: u64 = 64;

/// The meta-package whose dependency names the current cloud kernel image package.
const KERNEL_META_PACKAGE: &str = "linux-image-cloud-amd64";

/// virtio drivers, in the order they must be loaded (PLATFORM.md).
const MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    // The QEMU guest agent's virtio-serial port, and the memory balloon.
    "virtio_console",
    "virtio_balloon",
];

/// The guest programs' sources, built into the binary so `ferry image build` needs no checkout.
const GUEST_SOURCES: &[(&str, &str)] = &[
    ("content.h", include_str!("../../../guest/content.h")),
    ("guest.h", include_str!("../../../guest/guest.h")),
    ("main.c", include_str!("../../../guest/main.c")),
    ("mem.c", include_str!("../../../guest/mem.c")),
    ("burst.c", include_str!("../../../guest/burst.c")),
    ("disk.c", include_str!("../../../guest/disk.c")),
    ("tcpseq.c", include_str!("../../../guest/tcpseq.c")),
    ("qga.c", include_str!("../../../guest/qga.c")),
];
/// The C files of [`GUEST_SOURCES`], compiled together into `ferry-guest`.
pub fn guest_c_files() -> impl Iterator<Item = &'static str> {
    GUEST_SOURCES
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| name.ends_with(".c"))
}
const INIT_SCRIPT: &str = include_str!("guest_init.sh");

/// A built image.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Image {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// A pristine ext4 data disk; each VM gets a qcow2 copy.
    pub data_disk: PathBuf,
    pub kernel_version: String,
    pub inputs_sha256: String,
}

/// Where images are cached (`FERRY_CACHE_DIR`, default `/var/cache/ferry`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("FERRY_CACHE_DIR")
        .map_or_else(|| PathBuf::from("/var/cache/ferry"), PathBuf::from)
}

fn image_dir() -> PathBuf {
    cache_dir().join("image")
}

/// The cached image, if one was built (whatever its inputs).
pub fn load() -> Result<Image> {
    let manifest = image_dir().join("manifest.json");
    let text = fs::read_to_string(&manifest).with_context(|| {
        format!(
            "no guest image at {} (run `ferry image build`)",
            manifest.display()
        )
    })?;
    serde_json::from_str(&text).with_context(|| format!("corrupt manifest {}", manifest.display()))
}

/// The image package the cloud kernel meta-package depends on now, e.g.
/// `linux-image-6.1.0-56-cloud-amd64`.
fn kernel_package() -> Result<String> {
    let out = sh::run("apt-cache", &["depends", KERNEL_META_PACKAGE])?;
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-"))
        .map(str::to_owned)
        .with_context(|| {
            format!("apt-cache knows no kernel for {KERNEL_META_PACKAGE}; run apt-get update")
        })
}

fn busybox_version() -> Result<String> {
    let v = sh::run("dpkg-query", &["-W", "-f=${Version}", "busybox-static"])
        .context("busybox-static is not installed (scripts/setup.sh installs it)")?;
    Ok(v)
}

fn inputs_hash(kernel_pkg: &str, busybox: &str) -> String {
    let mut h = Sha256::new();
    h.update(BUILDER_VERSION.to_le_bytes());
    for (name, text) in GUEST_SOURCES {
        h.update(name.as_bytes());
        h.update(text.as_bytes());
    }
    h.update(INIT_SCRIPT.as_bytes());
    h.update(kernel_pkg.as_bytes());
    h.update(busybox.as_bytes());
    h.update(DATA_DISK_MIB.to_le_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Builds the image unless the cached one has the same inputs. Returns it and whether it was
/// rebuilt.
pub fn build(force: bool) -> Result<(Image, bool)> {
    let kernel_pkg = kernel_package()?;
    let busybox = busybox_version()?;
    let hash = inputs_hash(&kernel_pkg, &busybox);
    if !force {
        if let Ok(img) = load() {
            if img.inputs_sha256 == hash
                && img.kernel.exists()
                && img.initrd.exists()
                && img.data_disk.exists()
            {
                return Ok((img, false));
            }
        }
    }
    let dir = image_dir();
    let work = cache_dir().join("image-build");
    if work.exists() {
        fs::remove_dir_all(&work).with_context(|| format!("remove {}", work.display()))?;
    }
    fs::create_dir_all(&work)?;
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;

    // Kernel: download the package, unpack it, index its modules.
    let work_s = work.to_string_lossy().into_owned();
    sh::shell(&format!(
        "cd '{work_s}' && apt-get download -q '{kernel_pkg}'"
    ))
    .with_context(|| format!("downloading {kernel_pkg}"))?;
    let deb = fs::read_dir(&work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download produced no .deb")?;
    let root = work.join("kernel");
    sh::run(
        "dpkg",
        &["-x", &deb.to_string_lossy(), &root.to_string_lossy()],
    )?;
    let version = kernel_pkg.trim_start_matches("linux-image-").to_owned();
    sh::run("depmod", &["-b", &root.to_string_lossy(), &version])?;
    let vmlinuz = root.join("boot").join(format!("vmlinuz-{version}"));
    if !vmlinuz.exists() {
        bail!("{} has no {}", deb.display(), vmlinuz.display());
    }

    // Initramfs tree.
    let tree = work.join("initramfs");
    for d in [
        "bin",
        "sbin",
        "proc",
        "sys",
        "dev",
        "tmp",
        "lib/modules",
        "data",
    ] {
        fs::create_dir_all(tree.join(d))?;
    }
    fs::copy("/bin/busybox", tree.join("bin/busybox")).context("copy /bin/busybox")?;
    let moddir = root.join("lib/modules").join(&version);
    for m in MODULES {
        let found = find_module(&moddir, m)?;
        fs::copy(&found, tree.join("lib/modules").join(format!("{m}.ko")))?;
    }
    let src = work.join("guest-src");
    fs::create_dir_all(&src)?;
    for (name, text) in GUEST_SOURCES {
        fs::write(src.join(name), text)?;
    }
    let guest_bin = tree.join("bin/ferry-guest");
    let mut gcc_args: Vec<String> = ["-O2", "-static", "-pthread", "-Wall", "-o"]
        .into_iter()
        .map(String::from)
        .collect();
    gcc_args.push(guest_bin.to_string_lossy().into_owned());
    gcc_args.extend(guest_c_files().map(|c| src.join(c).to_string_lossy().into_owned()));
    let gcc_args: Vec<&str> = gcc_args.iter().map(String::as_str).collect();
    sh::run("gcc", &gcc_args).context("building the guest programs (gcc -static)")?;
    let init = tree.join("init");
    fs::write(&init, INIT_SCRIPT)?;
    sh::run("chmod", &["755", &init.to_string_lossy()])?;
    let initrd_tmp = work.join("initramfs.img");
    sh::shell(&format!(
        "cd '{}' && find . | cpio -o -H newc --quiet | gzip -1 > '{}'",
        tree.display(),
        initrd_tmp.display()
    ))?;

    // Data disk: a small empty ext4 file system.
    let disk_tmp = work.join("data.raw");
    sh::run(
        "truncate",
        &[
            "-s",
            &format!("{DATA_DISK_MIB}M"),
            &disk_tmp.to_string_lossy(),
        ],
    )?;
    sh::run(
        "mkfs.ext4",
        &["-q", "-F", "-L", "ferry-data", &disk_tmp.to_string_lossy()],
    )?;

    let img = Image {
        kernel: dir.join("vmlinuz"),
        initrd: dir.join("initramfs.img"),
        data_disk: dir.join("data.raw"),
        kernel_version: version,
        inputs_sha256: hash,
    };
    fs::rename(&vmlinuz, &img.kernel).or_else(|_| fs::copy(&vmlinuz, &img.kernel).map(|_| ()))?;
    fs::rename(&initrd_tmp, &img.initrd)?;
    fs::rename(&disk_tmp, &img.data_disk)?;
    fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&img)?,
    )?;
    fs::remove_dir_all(&work)?;
    Ok((img, true))
}

fn find_module(dir: &Path, name: &str) -> Result<PathBuf> {
    let want = format!("{name}.ko");
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).with_context(|| format!("read {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p
                .file_name()
                .is_some_and(|f| f.to_string_lossy().replace('-', "_") == want)
            {
                return Ok(p);
            }
        }
    }
    bail!(
        "kernel module {name} not found under {} (is it built in, or compressed?)",
        dir.display()
    )
}
