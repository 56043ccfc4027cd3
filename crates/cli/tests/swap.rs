//! Swap on a peer's memory (Overdriver's cooperative swap) for a libvirt domain in the lab:
//! `ferry swap on` hot-plugs a disk served from site b's agent's RAM through the swap tunnel,
//! the guest's agent swaps on it, and the balloon squeezes the guest below its working set;
//! the guest pages out across the WAN and its memory verifier still finds every page.
//! `ferry swap off` gives the memory back, swaps off and unplugs the disk: the verifier is
//! clean again. Bad requests are refused with what is wrong, and the guest runs throughout.

mod common;

use common::domains::{start_domain, verify};
use common::TestLab;
use ferry_lab::Site;

/// Overdriver's peers share the data center: a LAN-like link (each page the guest faults in
/// waits one round trip; at 10 ms the verifier's pass over half-swapped memory thrashes).
const LINK: &[&str] = &["--libvirt", "--rate-mbit", "1000", "--rtt-ms", "1"];
const VM: &str = "swap1";

/// `ferry swap on DOMAIN --peer PEER --mib MIB --keep-mib KEEP`'s arguments.
fn on<'a>(domain: &'a str, peer: &'a str, mib: &'a str, keep: &'a str) -> [&'a str; 8] {
    [
        "on",
        domain,
        "--peer",
        peer,
        "--mib",
        mib,
        "--keep-mib",
        keep,
    ]
}

/// `ferry swap ARGS --agent <site a's agent>`.
fn swap(t: &TestLab, args: &[&str]) -> std::process::Output {
    let agent = t.lab.agent_socket(Site::A);
    let mut all = vec!["swap", "--agent", agent.to_str().unwrap()];
    all.extend_from_slice(args);
    t.run(&all)
}

/// `ferry swap ARGS` must fail, saying `why`.
fn refused(t: &TestLab, args: &[&str], why: &str) {
    let out = swap(t, args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ferry swap {args:?} succeeded");
    assert!(stderr.contains(why), "ferry swap {args:?}: {stderr}");
}

/// One figure of `virsh domstats --balloon` for the domain at site a.
fn balloon(t: &TestLab, field: &str) -> u64 {
    let out = common::succeeded("virsh", &t.virsh(Site::A, &["domstats", "--balloon", VM]));
    out.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("balloon.{field}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_guest_swaps_to_a_peers_memory_while_squeezed_and_gets_it_back_intact() {
    let t = TestLab::up("swap", LINK);
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 128 MiB of guest, 32 MiB of it the workload's, of which it rewrites 4 MiB at 1 MiB/s
    // (its working set; Overdriver's bursts leave the rest cold).
    // The serial socket takes one client at a time: the verifier's calls connect anew.
    drop(start_domain(
        &t,
        &rt,
        (VM, 61, false, ""),
        &["mem start mib=32 pattern=ws rate=1 hot=4"],
    ));

    // Wrong requests: nothing is plugged, the guest runs on.
    refused(&t, &on(VM, "nowhere", "64", "64"), "nowhere");
    refused(&t, &on(VM, "site-b", "64", "512"), "the balloon may leave");
    refused(&t, &on(VM, "site-b", "4096", "64"), "MiB left to lend");
    refused(&t, &on("no-such-vm", "site-b", "64", "64"), "no-such-vm");
    refused(&t, &["off", VM], "swaps to no peer");

    // Squeezed to 88 MiB (the guest kernel keeps about 33 MiB of them and about 30 MiB of the
    // rest is its own and the initramfs', which cannot swap): part of the workload pages out to
    // site b.
    let args = [&on(VM, "site-b", "128", "88")[..], &["--json"]].concat();
    let taken = common::json(&common::succeeded("ferry swap on", &swap(&t, &args)));
    assert_eq!(taken[0]["target"], "vdb", "{taken}");
    refused(&t, &on(VM, "site-b", "64", "64"), "already swaps");
    // Some of its pages are at site b, behind this host's tunnel: it cannot migrate so.
    let agent = t.lab.agent_socket(Site::A);
    let out = t.run(&[
        "migrate",
        "--libvirt",
        VM,
        "--to",
        "site-b",
        "--agent",
        agent.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("give its swap back first"),
        "{err}"
    );
    // Every page is read back by the verifier: those swapped out come from site b.
    assert_eq!(verify(&t, &rt, Site::A, VM, false), 0, "while swapping");
    // The guest's own count, as its balloon reports it (every second).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let swapped_out = loop {
        let out = balloon(&t, "swap_out");
        if out > 0 || std::time::Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    };
    assert!(swapped_out > 0, "the guest swapped nothing out");
    let listed = common::json(&common::succeeded(
        "ferry swap list",
        &swap(&t, &["list", "--json"]),
    ));
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");

    // Given back: full memory, no swap, no disk; every page intact.
    common::succeeded("ferry swap off", &swap(&t, &["off", VM]));
    let disks = common::succeeded("virsh", &t.virsh(Site::A, &["domblklist", VM]));
    assert!(!disks.contains("vdb"), "the swap disk is still plugged");
    assert_eq!(balloon(&t, "current"), 128 << 10);
    assert_eq!(verify(&t, &rt, Site::A, VM, false), 0, "after swapping off");
    let listed = common::json(&common::succeeded(
        "ferry swap list",
        &swap(&t, &["list", "--json"]),
    ));
    assert_eq!(listed, serde_json::json!([]));
    eprintln!("swapped out {swapped_out} KiB to site b");
}
