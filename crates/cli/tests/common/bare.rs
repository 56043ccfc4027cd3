//! A VM its owner starts by hand at a site (its own command line, not `ferry vm start` or
//! libvirt): the tiny guest, a QMP socket, a disk and a NIC on a tap of the site's bridge, as a
//! process of the site's host (its view of [`HOST_DIR`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_lab::guest::{GuestLink, Heartbeats};
use ferry_lab::topology::HOST_DIR;
use ferry_lab::Site;
use ferry_qemu::{Accel, Boot, DiskSpec, NicSpec, VmSpec};

use super::TestLab;

/// VM `name`, its monitor at `qmp_socket` (a path of the site's host), its guest address
/// 10.77.0.`octet`. Its disk, serial socket and pid file are `HOST_DIR/<name>.*`.
pub fn spec(name: &str, qmp_socket: PathBuf, octet: u8) -> VmSpec {
    let img = ferry_lab::vm::ensure_image().expect("guest image (ferry image build)");
    let host = Path::new(HOST_DIR);
    VmSpec {
        name: name.to_owned(),
        mem_mib: 128,
        vcpus: 1,
        accel: if std::env::var("FERRY_ACCEL").as_deref() == Ok("kvm") {
            Accel::Kvm
        } else {
            Accel::Tcg
        },
        boot: Boot::Kernel {
            kernel: img.kernel.clone(),
            initrd: img.initrd.clone(),
            append: format!("console=ttyS0 quiet loglevel=1 panic=1 ferry_ip=10.77.0.{octet}"),
        },
        disks: vec![DiskSpec {
            id: "disk0".into(),
            path: host.join(format!("{name}.qcow2")),
            format: "qcow2".into(),
        }],
        nics: vec![NicSpec {
            id: "net0".into(),
            tap: format!("{name}t"),
            mac: format!("52:54:00:77:00:{octet:02x}"),
        }],
        qmp_socket,
        serial_socket: host.join(format!("{name}.serial")),
        serial_log: None,
        mem_file: None,
        incoming: None,
        paused: false,
        extra_args: vec![
            "-no-reboot".into(),
            "-daemonize".into(),
            "-pidfile".into(),
            host.join(format!("{name}.pid")).display().to_string(),
        ],
    }
}

/// What the VM needs at both sites before it can move: its NIC's tap at each (a host's
/// network setup, done by its owner); its disk at site a, from the guest's data disk.
/// Returns the disk's size (an image of that size at site b takes the copy).
pub fn prepare(t: &TestLab, spec: &VmSpec) -> u64 {
    for site in Site::ALL {
        let ns = t.lab.site_ns(site);
        let tap = spec.nics[0].tap.as_str();
        ferry_lab::sh::run_in(&ns, "ip", &["tuntap", "add", tap, "mode", "tap"]).unwrap();
        ferry_lab::sh::run_in(
            &ns,
            "ip",
            &["link", "set", "dev", tap, "master", "br0", "up"],
        )
        .unwrap();
    }
    let img = ferry_lab::vm::ensure_image().unwrap();
    let disk_a = disk(t, Site::A, &spec.name);
    super::qemu_img(&[
        "convert",
        "-O",
        "qcow2",
        &img.data_disk.to_string_lossy(),
        &disk_a.to_string_lossy(),
    ]);
    std::fs::metadata(&img.data_disk).unwrap().len()
}

/// The VM's disk image at `site`, as a path outside the site.
pub fn disk(t: &TestLab, site: Site, name: &str) -> PathBuf {
    t.lab.host_dir(site).join(format!("{name}.qcow2"))
}

/// Starts the VM at site a as its owner would; its pid.
pub fn start_at_a(t: &TestLab, spec: &VmSpec) -> u32 {
    let out = t
        .lab
        .host_command(Site::A, ferry_qemu::qemu_program())
        .args(spec.argv())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", super::text(&out));
    pid_of(t, Site::A, &spec.name)
}

/// The pid its pid file at `site` holds.
pub fn pid_of(t: &TestLab, site: Site, name: &str) -> u32 {
    let path = t.lab.host_dir(site).join(format!("{name}.pid"));
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The guest's memory and disk verifiers through its serial socket at `site`: its link and
/// the errors they found.
pub fn verify(
    rt: &tokio::runtime::Runtime,
    t: &TestLab,
    site: Site,
    name: &str,
) -> (GuestLink, u64) {
    let serial = t.lab.host_dir(site).join(format!("{name}.serial"));
    rt.block_on(async {
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        let v = ferry_lab::guest::verify(&link, true).await.unwrap();
        (link, v.errors())
    })
}
