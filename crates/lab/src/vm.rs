//! The lab's VMs: start one at a site, find it by name, stop it.
//!
//! A VM's record (`<lab dir>/vms/<name>.json`) says where it runs now and with which spec. QEMU
//! runs inside the site's namespace, in a session of its own so it outlives the CLI; its QMP and
//! serial sockets are files, reachable from any namespace.

use std::fs;
use std::path::PathBuf;
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
    /// Attach the image's ext4 data disk (as a qcow2 copy).
    pub disk: bool,
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
fn data_dir(lab: &Lab, name: &str) -> PathBuf {
    let base = std::env::var_os("FERRY_DATA_DIR")
        .map_or_else(|| PathBuf::from("/var/lib/ferry"), PathBuf::from);
    base.join(&lab.name).join(name)
}

fn mem_file(lab: &Lab, name: &str, site: Site) -> PathBuf {
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

/// Creates the destination's empty disk images (qcow2, each the size of the source's), for
/// a migration that copies the disks. With `reuse`, an image already at the destination (the
/// copy the VM left there when it moved away) is kept: ferry then sends only what changed.
pub fn create_destination_disks(src: &VmSpec, dst: &VmSpec, reuse: bool) -> Result<()> {
    for (src_disk, dst_disk) in src.disks.iter().zip(&dst.disks) {
        if reuse && dst_disk.path.exists() {
            continue;
        }
        let info = sh::run(
            "qemu-img",
            &[
                "info",
                "-U",
                "--output=json",
                &src_disk.path.to_string_lossy(),
            ],
        )?;
        let size = serde_json::from_str::<serde_json::Value>(&info)?["virtual-size"]
            .as_u64()
            .context("qemu-img info: no virtual-size")?;
        sh::run(
            "qemu-img",
            &[
                "create",
                "-q",
                "-f",
                "qcow2",
                &dst_disk.path.to_string_lossy(),
                &size.to_string(),
            ],
        )?;
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
        // A guest panic ends QEMU instead of rebooting, so a test sees it.
        extra_args: vec!["-no-reboot".into()],
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
        sh::run(
            "qemu-img",
            &[
                "convert",
                "-q",
                "-O",
                "qcow2",
                &img.data_disk.to_string_lossy(),
                &d.path.to_string_lossy(),
            ],
        )?;
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
