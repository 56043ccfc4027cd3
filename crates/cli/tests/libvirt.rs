//! libvirt-managed VMs through the agents: each lab site runs its own libvirtd (`lab up
//! --libvirt`), and a user's own `virsh migrate --live --p2p` with UNIX-socket URIs pointing
//! at the source agent's tunnels moves a domain across the WAN unchanged. The guest's verifier
//! decides whether its memory arrived intact; the WAN emulator's counters show the stream
//! crossed it.

mod common;

use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use common::TestLab;
use ferry_lab::guest::{GuestLink, Heartbeats};
use ferry_lab::Site;

const FAST_LINK: &[&str] = &["--libvirt", "--rate-mbit", "1000", "--rtt-ms", "10"];

/// The tiny guest as a libvirt domain: direct kernel boot, its serial console a unix socket in
/// the site's host directory, a NIC on the site's bridge.
fn domain_xml(name: &str) -> String {
    let img = ferry_lab::vm::ensure_image().expect("guest image (ferry image build)");
    format!(
        "<domain type='qemu'><name>{name}</name><memory unit='MiB'>128</memory><vcpu>1</vcpu>\
         <os><type arch='x86_64' machine='q35'>hvm</type><kernel>{}</kernel><initrd>{}</initrd>\
         <cmdline>console=ttyS0 quiet loglevel=1 panic=1 ferry_ip=10.77.0.92</cmdline></os>\
         <on_reboot>destroy</on_reboot><devices>\
         <serial type='unix'><source mode='bind' path='/run/ferry-host/{name}.serial'/>\
         <target port='0'/></serial>\
         <interface type='bridge'><source bridge='br0'/><mac address='52:54:00:77:00:5c'/>\
         <model type='virtio'/></interface></devices></domain>",
        img.kernel.display(),
        img.initrd.display()
    )
}

/// `virsh ARGS` as a process of `site`'s host (its own libvirtd at qemu:///system).
fn virsh(t: &TestLab, site: Site, args: &[&str]) -> Output {
    t.lab
        .host_command(site, "virsh")
        .args(["-c", "qemu:///system"])
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn virsh_migrate_with_unix_sockets_goes_through_the_agents() {
    let t = TestLab::up("lvm", FAST_LINK);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = "lv1";
    let xml = t.lab.host_dir(Site::A).join(format!("{name}.xml"));
    std::fs::write(&xml, domain_xml(name)).unwrap();
    ok(&virsh(
        &t,
        Site::A,
        &["define", &format!("/run/ferry-host/{name}.xml")],
    ));
    ok(&virsh(&t, Site::A, &["start", name]));
    let serial_a = t.lab.host_dir(Site::A).join(format!("{name}.serial"));
    let link = rt.block_on(async {
        let link = GuestLink::connect(&serial_a, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        link.wait_ready(Duration::from_secs(120)).await.unwrap();
        link.call(
            "mem start pattern=ws mib=32 rate=1",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        link
    });
    let wan_before = ferry_lab::wan::stats(&t.lab.wan_socket())
        .unwrap()
        .total_bytes();

    // The user's own command: only the URIs name ferry's agent.
    let tunnels = "/run/ferry-host/tunnels/site-b";
    ok(&virsh(
        &t,
        Site::A,
        &[
            "migrate",
            "--live",
            "--p2p",
            name,
            "--desturi",
            &format!("qemu+unix:///system?socket={tunnels}/rpc.sock"),
            "--migrateuri",
            &format!("unix://{tunnels}/mig.sock"),
        ],
    ));
    drop(link);

    // The domain runs at site b and not at site a; its memory arrived intact.
    assert_eq!(
        ok(&virsh(&t, Site::B, &["domstate", name])).trim(),
        "running"
    );
    let at_a = virsh(&t, Site::A, &["domstate", name]);
    assert!(
        !String::from_utf8_lossy(&at_a.stdout).contains("running"),
        "{at_a:?}"
    );
    let serial_b = t.lab.host_dir(Site::B).join(format!("{name}.serial"));
    let errors = rt.block_on(async {
        let link = GuestLink::connect(&serial_b, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        ferry_lab::guest::verify(&link, false)
            .await
            .unwrap()
            .errors()
    });
    assert_eq!(errors, 0, "the guest's memory at site b");
    // It crossed the WAN: at least the guest's 32 MiB working set.
    let wan = ferry_lab::wan::stats(&t.lab.wan_socket())
        .unwrap()
        .total_bytes()
        - wan_before;
    assert!(wan > 32 << 20, "only {wan} bytes crossed the WAN");

    // The source agent lists it, named after the domain: QEMU's stream crossed coded and was
    // fed to the destination QEMU under matching digests.
    let out = t
        .lab
        .host_command(Site::A, common::ferry_bin())
        .args(["migrations", "--json", "--agent"])
        .arg(t.lab.agent_socket(Site::A))
        .output()
        .unwrap();
    let all: serde_json::Value = serde_json::from_slice(&out.stdout).expect("migrations JSON");
    let m = all
        .as_array()
        .and_then(|all| all.iter().find(|m| m["vm"] == name))
        .unwrap_or_else(|| panic!("{name} not among the agent's migrations: {all}"));
    assert_eq!(m["state"], "committed", "{m}");
    assert!(m["digest"].as_str().is_some_and(|d| d.len() == 64), "{m}");
    let codec = &m["codec"];
    assert!(
        codec["pages"].as_u64().unwrap() > 8192,
        "the guest's pages went through the codec: {m}"
    );
    let stream = m["stream_bytes"].as_u64().unwrap();
    assert!(stream > 32 << 20, "QEMU's stream was {stream} bytes: {m}");
}
