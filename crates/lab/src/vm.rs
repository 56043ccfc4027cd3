//! The lab's VMs: start one at a site, find it by name, stop it.
//!
//! A VM's record (`<lab dir>/vms/<name>.json`) says where it runs now and with which spec. QEMU
//! runs inside the site's namespace, in a session of its own so it outlives the CLI; its QMP and
//! serial sockets are files, reachable from any namespace.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ferry_qemu::{Accel, Boot, DiskSpec, NicSpec, VmSpec};
use serde::{Deserialize, Serialize};

use crate::image::Image;
use crate::topology::{detach, wait_until, Lab, Site};
use crate::{image, sh};

/// What `ferry vm start` asks for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmOptions {
    pub mem_mib: u32,
    pub vcpus: u32,
    /// Attach an ext4 data disk (as a qcow2 image).
    pub disk: bool,
    /// Its size: None is the image's 64 MiB disk; a size makes a fresh ext4 file system of
    /// that many MiB (sparse: only what the guest writes takes space).
    pub disk_mib: Option<u32>,
    /// Make the disk an overlay on a template holding this many MiB of data, which every
    /// site's library holds (SnapMig's case: the base image is already there).
    pub disk_template_mib: Option<u32>,
    /// How many images deep the template is (1: one base image; each further layer is a
    /// qcow2 overlay on the one below that adds a file of [`LAYER_MIB`] MiB).
    pub disk_template_layers: u32,
    pub accel: Accel,
}

/// A VM of the lab and where it runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    pub name: String,
    pub site: Site,
    pub index: u32,
    pub guest_ip: String,
    pub pid: u32,
    pub spec: VmSpec,
}

impl VmRecord {
    /// Whether the VM has a data disk.
    pub fn has_disk(&self) -> bool {
        !self.spec.disks.is_empty()
    }
}

fn vms_dir(lab: &Lab) -> PathBuf {
    lab.dir().join("vms")
}

/// Per-VM files that must outlive a migration (disks).
pub fn data_dir(lab: &Lab, name: &str) -> PathBuf {
    let base = std::env::var_os("FERRY_DATA_DIR")
        .map_or_else(|| PathBuf::from("/var/lib/ferry"), PathBuf::from);
    base.join(&lab.name).join(name)
}

/// The memory file of VM `name`'s QEMU at `site` (a shared `memory-backend-file`).
pub fn mem_file(lab: &Lab, name: &str, site: Site) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/ferry-{}-{}-{}.mem",
        lab.name,
        name,
        site.name()
    ))
}

/// Removes a lab's VM data and memory files (part of `lab down`).
pub fn remove_lab_files(lab: &Lab) {
    let base = std::env::var_os("FERRY_DATA_DIR")
        .map_or_else(|| PathBuf::from("/var/lib/ferry"), PathBuf::from);
    let _ = fs::remove_dir_all(base.join(&lab.name));
    if let Ok(entries) = fs::read_dir("/dev/shm") {
        let prefix = format!("ferry-{}-", lab.name);
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

/// The size of a disk image, from `qemu-img info`.
fn virtual_size(path: &Path) -> Result<u64> {
    let info = sh::run(
        "qemu-img",
        &["info", "-U", "--output=json", &path.to_string_lossy()],
    )?;
    serde_json::from_str::<serde_json::Value>(&info)?["virtual-size"]
        .as_u64()
        .context("qemu-img info: no virtual-size")
}

/// The backing file of a disk image, if it is an overlay.
fn backing_file(path: &Path) -> Result<Option<PathBuf>> {
    let info = sh::run(
        "qemu-img",
        &["info", "-U", "--output=json", &path.to_string_lossy()],
    )?;
    Ok(
        serde_json::from_str::<serde_json::Value>(&info)?["full-backing-filename"]
            .as_str()
            .map(PathBuf::from),
    )
}

/// An empty qcow2 image of `size` bytes, an overlay on `backing` if given.
fn create_qcow2(path: &Path, size: u64, backing: Option<&Path>) -> Result<()> {
    let mut args = vec![
        "create".to_owned(),
        "-q".into(),
        "-f".into(),
        "qcow2".into(),
    ];
    if let Some(b) = backing {
        args.extend([
            "-b".into(),
            b.to_string_lossy().into_owned(),
            "-F".into(),
            "qcow2".into(),
        ]);
    }
    args.extend([path.to_string_lossy().into_owned(), size.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    sh::run("qemu-img", &args)?;
    Ok(())
}

/// Creates the destination's empty disk images (qcow2, each the size of the source's), for
/// QEMU's own migration (its mirror copies the whole disk into them).
pub fn create_destination_disks(src: &VmSpec, dst: &VmSpec) -> Result<()> {
    for (src_disk, dst_disk) in src.disks.iter().zip(&dst.disks) {
        create_qcow2(&dst_disk.path, virtual_size(&src_disk.path)?, None)?;
    }
    Ok(())
}

/// The destination's disk images for ferry. An image already there (the copy the VM left on
/// an earlier stay) is kept: the agents send only what changed since. Otherwise a new image,
/// and when the source's is an overlay on a template that the destination site's library
/// holds too, an overlay on that one (the agents then copy the overlay only).
pub fn ferry_destination_disks(src: &VmSpec, dst: &VmSpec, from: Site, to: Site) -> Result<()> {
    for (src_disk, dst_disk) in src.disks.iter().zip(&dst.disks) {
        if dst_disk.path.exists() {
            continue;
        }
        let backing = library_backing(&src_disk.path, from, to)?;
        create_qcow2(
            &dst_disk.path,
            virtual_size(&src_disk.path)?,
            backing.as_deref(),
        )?;
    }
    Ok(())
}

/// The destination's disk images for QEMU's mirror of the top image only: each an overlay on
/// the template its source image sits on, as the destination site's library holds it.
pub fn overlay_destination_disks(src: &VmSpec, dst: &VmSpec, from: Site, to: Site) -> Result<()> {
    for (src_disk, dst_disk) in src.disks.iter().zip(&dst.disks) {
        let Some(backing) = library_backing(&src_disk.path, from, to)? else {
            bail!(
                "copying the top image only needs {} to be an overlay on a template that site \
                 {}'s library holds (start the VM with --disk-template-mib)",
                src_disk.path.display(),
                to.name()
            );
        };
        create_qcow2(
            &dst_disk.path,
            virtual_size(&src_disk.path)?,
            Some(&backing),
        )?;
    }
    Ok(())
}

/// Where site `to`'s library holds the template that the image at `image` (at site `from`)
/// is an overlay on, if it is one and that library holds it.
fn library_backing(image: &Path, from: Site, to: Site) -> Result<Option<PathBuf>> {
    Ok(backing_file(image)?.and_then(|b| {
        let name = b.file_name()?.to_owned();
        let theirs = b
            .parent()?
            .ends_with(format!("{TEMPLATES}/{}", from.name()));
        let ours = b.parent()?.parent()?.join(to.name()).join(name);
        (theirs && ours.exists()).then_some(ours)
    }))
}

/// A qcow2 image at `out` holding a fresh ext4 file system of `mib` MiB, populated from `tree`
/// if given (made as a sparse raw file in `work`, then converted).
fn make_ext4_qcow2(work: &Path, mib: u32, tree: Option<&Path>, out: &Path) -> Result<()> {
    let raw = work.join(format!(
        "{}.raw",
        out.file_name()
            .map_or("disk".into(), |n| n.to_string_lossy())
    ));
    sh::run(
        "truncate",
        &["-s", &format!("{mib}M"), &raw.to_string_lossy()],
    )?;
    let tree = tree.map(|t| t.to_string_lossy().into_owned());
    let mut mkfs = vec!["-q", "-F", "-L", "ferry-data"];
    if let Some(t) = &tree {
        mkfs.extend(["-d", t.as_str()]);
    }
    let raw_s = raw.to_string_lossy().into_owned();
    mkfs.push(&raw_s);
    let made = sh::run("mkfs.ext4", &mkfs).and_then(|_| convert_to_qcow2(&raw, out));
    let _ = fs::remove_file(&raw);
    made
}

/// A qcow2 copy of the image at `from` (any format qemu-img reads) at `to`.
fn convert_to_qcow2(from: &Path, to: &Path) -> Result<()> {
    sh::run(
        "qemu-img",
        &[
            "convert",
            "-q",
            "-O",
            "qcow2",
            &from.to_string_lossy(),
            &to.to_string_lossy(),
        ],
    )
    .map(|_| ())
}

/// Where each site keeps its library of template disks.
const TEMPLATES: &str = ".templates";

/// Site `site`'s library of template disks: `template-<disk MiB>-<data MiB>.qcow2` (the base)
/// and `template-<disk MiB>-<data MiB>-l<k>.qcow2` (layer k, on layer k-1).
pub fn template_dir(lab: &Lab, site: Site) -> PathBuf {
    let base = std::env::var_os("FERRY_DATA_DIR")
        .map_or_else(|| PathBuf::from("/var/lib/ferry"), PathBuf::from);
    base.join(&lab.name).join(TEMPLATES).join(site.name())
}

/// Makes, once, a template disk in every site's library: an ext4 file system of `disk_mib`
/// MiB holding `template.bin`, `data_mib` MiB of fixed pseudo-random bytes (as an operating
/// system image a cloud's image library holds at every site). Returns its file name.
fn ensure_template(lab: &Lab, disk_mib: u32, data_mib: u32) -> Result<String> {
    let name = format!("template-{disk_mib}-{data_mib}.qcow2");
    // Made once, then copied: the libraries hold the same bytes (mkfs alone would not give
    // the same file system twice: it draws UUIDs and stamps times).
    let first = template_dir(lab, Site::A).join(&name);
    if !first.exists() {
        let dir = template_dir(lab, Site::A);
        fs::create_dir_all(&dir)?;
        let tree = dir.join(format!("{name}.tree"));
        let _ = fs::remove_dir_all(&tree);
        fs::create_dir_all(&tree)?;
        fs::write(tree.join("template.bin"), pseudo_random(data_mib, 0))?;
        let tmp = dir.join(format!("{name}.partial"));
        make_ext4_qcow2(&dir, disk_mib, Some(&tree), &tmp)?;
        fs::rename(&tmp, &first)?;
        let _ = fs::remove_dir_all(&tree);
    }
    copy_to_every_library(lab, &name)?;
    Ok(name)
}

/// What each template layer above the base adds: a file of this many MiB.
pub const LAYER_MIB: u32 = 4;

/// Makes, once, a template chain `layers` images deep in every site's library (see
/// [`ensure_template`] for the base): layer k is a qcow2 overlay on layer k-1 holding only
/// what adding `/layerk.bin` ([`LAYER_MIB`] MiB of pseudo-random bytes) to the file system
/// changed. Each layer names the one below by its file name alone, so the libraries hold the
/// same bytes and each chain resolves within its own site. Returns the top layer's file name.
fn ensure_template_chain(lab: &Lab, disk_mib: u32, data_mib: u32, layers: u32) -> Result<String> {
    let mut below = ensure_template(lab, disk_mib, data_mib)?;
    for k in 2..=layers {
        let name = format!("template-{disk_mib}-{data_mib}-l{k}.qcow2");
        let dir = template_dir(lab, Site::A);
        let first = dir.join(&name);
        if !first.exists() {
            make_layer(&dir, &below, k, &name)?;
        }
        copy_to_every_library(lab, &name)?;
        below = name;
    }
    Ok(below)
}

/// Makes template layer `k` as `name` in `dir`, on the image `below` there.
fn make_layer(dir: &Path, below: &str, k: u32, name: &str) -> Result<()> {
    let raw = dir.join(format!("{name}.raw"));
    let file = dir.join(format!("layer{k}.bin"));
    let tmp = dir.join(format!("{name}.partial"));
    let made = (|| -> Result<()> {
        sh::run(
            "qemu-img",
            &[
                "convert",
                "-q",
                "-O",
                "raw",
                &dir.join(below).to_string_lossy(),
                &raw.to_string_lossy(),
            ],
        )?;
        fs::write(&file, pseudo_random(LAYER_MIB, u64::from(k)))?;
        let raw_s = raw.to_string_lossy();
        let write = format!("write {} layer{k}.bin", file.display());
        sh::run("debugfs", &["-w", "-R", &write, &raw_s])?;
        // debugfs exits 0 even when its command failed: check that the file is there, whole.
        let stat = sh::run("debugfs", &["-R", &format!("stat layer{k}.bin"), &raw_s])?;
        let size = format!("Size: {}", u64::from(LAYER_MIB) << 20);
        if !stat.contains(&size) {
            bail!(
                "debugfs did not add layer{k}.bin to {}: {stat}",
                raw.display()
            );
        }
        // An overlay on the raw image, rebased (safe mode: clusters compared) onto `below`:
        // it keeps only the clusters that differ. `convert -B` would not compare, and its
        // layer would hide the whole base.
        let tmp_s = tmp.to_string_lossy();
        let below_path = dir.join(below);
        sh::run(
            "qemu-img",
            &[
                "create", "-q", "-f", "qcow2", "-b", &raw_s, "-F", "raw", &tmp_s,
            ],
        )?;
        sh::run(
            "qemu-img",
            &[
                "rebase",
                "-q",
                "-b",
                &below_path.to_string_lossy(),
                "-F",
                "qcow2",
                &tmp_s,
            ],
        )?;
        // The reference by file name alone: resolved next to the image, at every site.
        sh::run(
            "qemu-img",
            &["rebase", "-u", "-b", below, "-F", "qcow2", &tmp_s],
        )?;
        let held = allocated_bytes(&tmp)?;
        if held > (u64::from(LAYER_MIB) + 4) << 20 {
            bail!("template layer {name} holds {held} bytes, more than its file and metadata");
        }
        fs::rename(&tmp, dir.join(name))?;
        Ok(())
    })();
    let _ = fs::remove_file(&raw);
    let _ = fs::remove_file(&file);
    let _ = fs::remove_file(&tmp);
    made
}

/// The bytes of guest data an image holds itself (not through its backing file).
fn allocated_bytes(image: &Path) -> Result<u64> {
    let map = sh::run(
        "qemu-img",
        &["map", "--output=json", &image.to_string_lossy()],
    )?;
    let extents: Vec<serde_json::Value> = serde_json::from_str(&map)?;
    Ok(extents
        .iter()
        .filter(|e| e["depth"] == 0 && e["data"] == true)
        .filter_map(|e| e["length"].as_u64())
        .sum())
}

/// `mib` MiB of pseudo-random bytes (xorshift), the same for the same `seed`.
fn pseudo_random(mib: u32, seed: u64) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ seed.wrapping_mul(0xff51_afd7_ed55_8ccd);
    (0..u64::from(mib) << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

/// Copies the image `name` from site a's library into every other site's that lacks it.
fn copy_to_every_library(lab: &Lab, name: &str) -> Result<()> {
    let first = template_dir(lab, Site::A).join(name);
    for site in Site::ALL {
        let path = template_dir(lab, site).join(name);
        if !path.exists() {
            fs::create_dir_all(template_dir(lab, site))?;
            let tmp = path.with_extension("partial");
            fs::copy(&first, &tmp)?;
            fs::rename(&tmp, &path)?;
        }
    }
    Ok(())
}

/// The spec of VM `name` placed at `site`: sockets, tap and memory file belong to the site.
pub fn spec_at(lab: &Lab, rec: &VmRecord, site: Site) -> VmSpec {
    let dir = vms_dir(lab);
    let mut spec = rec.spec.clone();
    spec.qmp_socket = dir.join(format!("{}-{}.qmp", rec.name, site.name()));
    spec.serial_socket = dir.join(format!("{}-{}.serial", rec.name, site.name()));
    spec.serial_log = Some(dir.join(format!("{}-{}.console.log", rec.name, site.name())));
    spec.mem_file = Some(mem_file(lab, &rec.name, site));
    for n in &mut spec.nics {
        n.tap = format!("fv{}{}", rec.index, site.name());
    }
    for d in &mut spec.disks {
        d.path = data_dir(lab, &rec.name).join(format!("{}-{}.qcow2", d.id, site.name()));
    }
    spec.incoming = None;
    spec.paused = false;
    spec
}

/// Loads a VM's record; an unknown name lists the known ones.
pub fn load(lab: &Lab, name: &str) -> Result<VmRecord> {
    lab.state()?;
    let path = vms_dir(lab).join(format!("{name}.json"));
    match fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .with_context(|| format!("corrupt VM record {}", path.display())),
        Err(_) => {
            let known: Vec<String> = list(lab)?.into_iter().map(|r| r.name).collect();
            bail!(
                "unknown VM {name:?} in lab {:?} (known: {})",
                lab.name,
                if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                }
            )
        }
    }
}

/// Saves a VM's record.
pub fn save(lab: &Lab, rec: &VmRecord) -> Result<()> {
    fs::create_dir_all(vms_dir(lab))?;
    fs::write(
        vms_dir(lab).join(format!("{}.json", rec.name)),
        serde_json::to_string_pretty(rec)?,
    )?;
    Ok(())
}

/// Every VM of the lab.
pub fn list(lab: &Lab) -> Result<Vec<VmRecord>> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(vms_dir(lab)) else {
        return Ok(out);
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "json") {
            if let Ok(rec) = serde_json::from_str::<VmRecord>(&fs::read_to_string(&p)?) {
                out.push(rec);
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 32
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// Creates and boots a VM from the lab image at `site`. Returns once QEMU's QMP socket answers
/// (the guest may still be booting; see [`crate::guest::GuestLink::wait_ready`]).
pub async fn start(
    lab: &Lab,
    name: &str,
    site: Site,
    opts: &VmOptions,
    img: &Image,
) -> Result<VmRecord> {
    lab.state()?;
    if !valid_name(name) {
        bail!("VM name {name:?} is not valid; use up to 32 letters, digits, '-' or '_'");
    }
    if vms_dir(lab).join(format!("{name}.json")).exists() {
        bail!(
            "VM {name:?} already exists in lab {:?} (stop it first: ferry vm stop {name})",
            lab.name
        );
    }
    if !(64..=16384).contains(&opts.mem_mib) {
        bail!(
            "--mem-mib {} is out of range; use 64 to 16384",
            opts.mem_mib
        );
    }
    if !(1..=8).contains(&opts.vcpus) {
        bail!("--vcpus {} is out of range; use 1 to 8", opts.vcpus);
    }
    ferry_qemu::check_qemu()?;
    let index = list(lab)?.iter().map(|r| r.index).max().unwrap_or(0) + 1;
    if index > 200 {
        bail!("the lab has room for 200 VMs");
    }
    let guest_ip = format!("10.77.0.{}", 10 + index);
    let append = format!("console=ttyS0 quiet loglevel=1 panic=1 ferry_ip={guest_ip}");
    let disks = if opts.disk {
        vec![DiskSpec {
            id: "disk0".into(),
            path: PathBuf::new(),
            format: "qcow2".into(),
        }]
    } else {
        vec![]
    };
    let spec = VmSpec {
        name: name.to_owned(),
        mem_mib: opts.mem_mib,
        vcpus: opts.vcpus,
        accel: opts.accel,
        boot: Boot::Kernel {
            kernel: img.kernel.clone(),
            initrd: img.initrd.clone(),
            append,
        },
        disks,
        nics: vec![NicSpec {
            id: "net0".into(),
            tap: String::new(),
            mac: format!("52:54:00:77:00:{index:02x}"),
        }],
        qmp_socket: PathBuf::new(),
        serial_socket: PathBuf::new(),
        serial_log: None,
        mem_file: None,
        incoming: None,
        paused: false,
        // A guest panic ends QEMU instead of rebooting, so a test sees it. virtio's event
        // index is off for the disks: with it, this Debian 6.1 guest under TCG loses a disk
        // completion interrupt now and then when two threads read while the journal writes
        // (its requests completed and signalled by QEMU, the guest waiting for ever), with or
        // without a migration (BENCHMARKS, "Disks"); without it, none in the same loop.
        extra_args: vec![
            "-no-reboot".into(),
            "-global".into(),
            "virtio-blk-pci.event_idx=off".into(),
        ],
    };
    let mut rec = VmRecord {
        name: name.to_owned(),
        site,
        index,
        guest_ip,
        pid: 0,
        spec,
    };
    let spec = spec_at(lab, &rec, site);
    fs::create_dir_all(data_dir(lab, name))?;
    for d in &spec.disks {
        if let Some(data_mib) = opts.disk_template_mib {
            let disk_mib = opts.disk_mib.unwrap_or(64);
            let top = ensure_template_chain(lab, disk_mib, data_mib, opts.disk_template_layers)?;
            let template = template_dir(lab, site).join(top);
            create_qcow2(&d.path, u64::from(disk_mib) << 20, Some(&template))?;
            continue;
        }
        match opts.disk_mib {
            Some(mib) => make_ext4_qcow2(&data_dir(lab, name), mib, None, &d.path)?,
            None => convert_to_qcow2(&img.data_disk, &d.path)?,
        }
    }
    rec.pid = match launch(lab, site, &spec).await {
        Ok(pid) => pid,
        Err(e) => {
            // Leave nothing behind: no tap, no sockets, no disk copy.
            kill_at(lab, &spec, site, 0);
            let _ = fs::remove_dir_all(data_dir(lab, name));
            return Err(e);
        }
    };
    rec.spec = spec;
    save(lab, &rec)?;
    Ok(rec)
}

/// Creates the VM's tap at `site`, starts QEMU there and waits for its QMP socket.
pub async fn launch(lab: &Lab, site: Site, spec: &VmSpec) -> Result<u32> {
    let ns = lab.site_ns(site);
    fs::create_dir_all(vms_dir(lab))?;
    for n in &spec.nics {
        let _ = sh::run_in(&ns, "ip", &["link", "del", "dev", &n.tap]);
        sh::run_in(&ns, "ip", &["tuntap", "add", &n.tap, "mode", "tap"])?;
        sh::run_in(
            &ns,
            "ip",
            &["link", "set", "dev", &n.tap, "master", "br0", "up"],
        )?;
    }
    for s in [&spec.qmp_socket, &spec.serial_socket] {
        let _ = fs::remove_file(s);
    }
    let log_path = vms_dir(lab).join(format!("{}-{}.log", spec.name, site.name()));
    let log = fs::File::create(&log_path)?;
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns, &ferry_qemu::qemu_program()])
        .args(spec.argv())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    detach(&mut cmd);
    // Once asked to stop (Ctrl-C, SIGTERM), no new QEMU: the lab may be coming down, and a
    // bench stops after the migration it cancelled instead of booting its next guest.
    if ferry_agent::interrupt::requested() {
        bail!(
            "stopped by the user before QEMU was started at site {}",
            site.name()
        );
    }
    let mut child = cmd
        .spawn()
        .context("start qemu-system-x86_64 (scripts/setup.sh installs it)")?;
    let pid = child.id();
    let qmp = spec.qmp_socket.clone();
    let ready = tokio::task::spawn_blocking(move || {
        let ready = wait_until(Duration::from_secs(20), || {
            matches!(child.try_wait(), Ok(Some(_)))
                || std::os::unix::net::UnixStream::connect(&qmp).is_ok()
        })
        .map(|()| child.try_wait().ok().flatten());
        crate::topology::reap(child);
        ready
    })
    .await?;
    match ready {
        Ok(None) => Ok(pid),
        Ok(Some(status)) => {
            let log = fs::read_to_string(&log_path).unwrap_or_default();
            bail!("QEMU exited at start ({status}): {}", log.trim())
        }
        Err(_) => {
            // SAFETY: kill(2) on the QEMU we just started and that never became ready.
            unsafe { libc::kill(i32::try_from(pid).expect("pid fits in i32"), libc::SIGKILL) };
            bail!(
                "QEMU's QMP socket {} did not appear within 20s; see {}",
                spec.qmp_socket.display(),
                log_path.display()
            )
        }
    }
}

/// Ends QEMU at `site` (SIGKILL: the VM's state there is not wanted) and removes its tap.
pub fn kill_at(lab: &Lab, spec: &VmSpec, site: Site, pid: u32) {
    if pid != 0 {
        let pid = i32::try_from(pid).expect("pid fits in i32");
        // SAFETY: kill(2) on a pid we started; a stale pid only fails.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        let _ = wait_until(Duration::from_secs(5), || {
            // SAFETY: signal 0 only checks for existence.
            let gone = unsafe { libc::kill(pid, 0) } != 0;
            gone || is_zombie(pid)
        });
    }
    for n in &spec.nics {
        let _ = sh::run_in(&lab.site_ns(site), "ip", &["link", "del", "dev", &n.tap]);
    }
    for s in [&spec.qmp_socket, &spec.serial_socket] {
        let _ = fs::remove_file(s);
    }
    if let Some(m) = &spec.mem_file {
        let _ = fs::remove_file(m);
    }
}

fn is_zombie(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |s| s.split_whitespace().nth(2) == Some("Z"))
}

/// Stops a VM and forgets it.
pub fn stop(lab: &Lab, name: &str) -> Result<()> {
    let rec = load(lab, name)?;
    kill_at(lab, &rec.spec, rec.site, rec.pid);
    let _ = fs::remove_dir_all(data_dir(lab, name));
    // A later VM of the same name must not find this one's memory at the sites it left.
    for site in Site::ALL {
        let _ = fs::remove_file(crate::agents::seed_dir(lab, site).join(format!("{name}.ram")));
    }
    fs::remove_file(vms_dir(lab).join(format!("{name}.json")))?;
    Ok(())
}

/// The image, built if needed (VMs cannot start without it).
pub fn ensure_image() -> Result<Image> {
    Ok(image::build(false)?.0)
}
