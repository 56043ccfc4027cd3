//! libvirt domains of the tiny guest in the lab's sites: started with a workload, verified by
//! the guest's own verifiers wherever they run.

use std::sync::Arc;
use std::time::Duration;

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
    let serial_a = t.lab.host_dir(Site::A).join(format!("{name}.serial"));
    rt.block_on(async {
        let link = GuestLink::connect(&serial_a, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        link.wait_ready(Duration::from_secs(120)).await.unwrap();
        for command in workload {
            link.call(command, Duration::from_secs(60)).await.unwrap();
        }
        link
    })
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
