//! libvirt domains of the tiny guest in the lab's sites: started with a workload, verified by
//! the guest's own verifiers wherever they run.

use std::sync::Arc;

use ferry_lab::guest::{GuestLink, Heartbeats};
use ferry_lab::libvirt::GuestNic;
use ferry_lab::Site;

use super::TestLab;

/// The tiny guest as domain `name` with `nic`, and `extra` devices.
pub fn domain_xml(name: &str, nic: &GuestNic, disk: bool, extra: &str) -> String {
    let img = ferry_lab::vm::ensure_image().expect("guest image (ferry image build)");
    ferry_lab::libvirt::tiny_domain_xml(&img, name, 128, nic, disk)
        .replace("</devices>", &format!("{extra}</devices>"))
}

/// Defines and starts domain `name` at site a on the sites' shared segment (address
/// 10.77.0.`host`); returns its serial link once the guest's agent answers, with `workload`
/// (guest commands) started.
pub fn start_domain(
    t: &TestLab,
    rt: &tokio::runtime::Runtime,
    (name, host, disk, extra): (&str, u8, bool, &str),
    workload: &[&str],
) -> GuestLink {
    start_domain_on(t, rt, name, &GuestNic::lab(host), (disk, extra), workload)
}

/// [`start_domain`] with its NIC on any bridge.
pub fn start_domain_on(
    t: &TestLab,
    rt: &tokio::runtime::Runtime,
    name: &str,
    nic: &GuestNic,
    (disk, extra): (bool, &str),
    workload: &[&str],
) -> GuestLink {
    let xml = t.lab.host_dir(Site::A).join(format!("{name}.xml"));
    std::fs::write(&xml, domain_xml(name, nic, disk, extra)).unwrap();
    super::succeeded(
        "virsh",
        &t.virsh(Site::A, &["define", &format!("/run/ferry-host/{name}.xml")]),
    );
    super::succeeded("virsh", &t.virsh(Site::A, &["start", name]));
    super::guest_at(rt, t, Site::A, name, workload)
}

/// Domain `name`'s disk: the guest's data disk as its image at site a, and (with
/// `at_destination`) an empty image of the same size at site b (libvirt copies into an image
/// that exists; it creates one only in a storage pool). Returns the disk's size in bytes.
pub fn make_disk(t: &TestLab, name: &str, at_destination: bool) -> u64 {
    let img = ferry_lab::vm::ensure_image().unwrap();
    let disk_a = t.lab.host_dir(Site::A).join(format!("{name}.qcow2"));
    super::qemu_img(&[
        "convert",
        "-O",
        "qcow2",
        &img.data_disk.to_string_lossy(),
        &disk_a.to_string_lossy(),
    ]);
    let size = std::fs::metadata(&img.data_disk).unwrap().len();
    if at_destination {
        empty_disk_at_b(t, name, size);
    }
    size
}

/// An empty image of `size` bytes for domain `name` at site b.
pub fn empty_disk_at_b(t: &TestLab, name: &str, size: u64) {
    let disk_b = t.lab.host_dir(Site::B).join(format!("{name}.qcow2"));
    super::qemu_img(&[
        "create",
        "-f",
        "qcow2",
        &disk_b.to_string_lossy(),
        &size.to_string(),
    ]);
}

/// A NIC (domain XML) on a bridge that only site a has, made here: libvirt at site b refuses
/// a domain with it, which is how the tests make a migration fail at the destination.
pub fn nic_only_at_site_a(t: &TestLab) -> &'static str {
    for args in [
        &["link", "add", "br-only-a", "type", "bridge"][..],
        &["link", "set", "br-only-a", "up"],
    ] {
        let out = t
            .lab
            .host_command(Site::A, "ip")
            .args(args)
            .output()
            .unwrap();
        super::succeeded("ip", &out);
    }
    "<interface type='bridge'><source bridge='br-only-a'/><model type='virtio'/></interface>"
}

/// The errors the guest's verifiers find in domain `name` at `site` (memory, and the disk).
pub fn verify(
    t: &TestLab,
    rt: &tokio::runtime::Runtime,
    site: Site,
    name: &str,
    disk: bool,
) -> u64 {
    let serial = t.lab.host_dir(site).join(format!("{name}.serial"));
    rt.block_on(async {
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        ferry_lab::guest::verify(&link, disk)
            .await
            .unwrap()
            .errors()
    })
}
