//! Disks through the agents: a VM whose guest keeps writing to its disk is migrated by ferry
//! in each mirroring mode, and across a WAN drop during the disk copy. The guest's disk
//! verifier (every acknowledged write, read back with O_DIRECT) decides whether the disk
//! arrived intact.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{json, timeline, TestLab};
use ferry_api::EventKind;
use ferry_lab::Site;

const FAST_LINK: &[&str] = &["--rate-mbit", "1000", "--rtt-ms", "10"];
/// Slow enough that the disk's bulk copy (about 24 MiB here) takes several seconds.
const SLOW_LINK: &[&str] = &["--rate-mbit", "20", "--rtt-ms", "20"];

/// A small VM with a data disk, a gently rewritten working set and a disk writer that keeps
/// rewriting `file_mib` of 4 KiB blocks (O_DIRECT|O_DSYNC) at `rate` MiB/s.
fn start_vm_with_disk_writer(t: &TestLab, name: &str, file_mib: &str, rate: &str) {
    t.ok(&[
        "vm",
        "start",
        name,
        "--disk",
        "--mem-mib",
        "128",
        "--workload",
        "ws",
        "--dirty-mib",
        "16",
        "--dirty-rate-mib-s",
        "1",
    ]);
    t.ok(&[
        "guest",
        name,
        "disk",
        "start",
        &format!("mib={file_mib}"),
        &format!("rate={rate}"),
    ]);
}

fn assert_arrived_intact(v: &serde_json::Value, blocks: u64, what: &str) {
    assert_eq!(v["system"], "ferry", "{what}: {v}");
    assert_eq!(v["outcome"]["completed"], true, "{what}: {v}");
    assert_eq!(v["verify"]["mem_errors"], 0, "{what}: memory: {v}");
    assert!(
        v["verify"]["disk_blocks"].as_u64().unwrap() >= blocks,
        "{what}: the disk verifier checked too little: {v}"
    );
    assert_eq!(
        v["verify"]["disk_errors"], 0,
        "{what}: the disk verifier found lost or corrupt blocks: {v}"
    );
}

/// The disk goes first (XvMotion's order): its copy starts and is ready before memory moves.
fn assert_disk_before_memory(v: &serde_json::Value) {
    let tl = timeline(v);
    let at = |kind: EventKind| {
        tl.events
            .iter()
            .find(|e| e.kind == kind)
            .unwrap_or_else(|| panic!("no {kind:?} event: {:?}", tl.events))
            .t_ms
    };
    assert!(
        at(EventKind::DiskCopyStarted) <= at(EventKind::DiskReady)
            && at(EventKind::DiskReady) <= at(EventKind::MemoryStarted),
        "disk and memory phases out of order: {:?}",
        tl.events
    );
}

#[test]
fn ferry_moves_a_disk_under_guest_writes_in_every_mode() {
    let t = TestLab::up("dsk", FAST_LINK);
    start_vm_with_disk_writer(&t, "d1", "16", "0.5");
    let mut first_frames = 0;
    for (mode, to, site) in [
        ("async", "b", Site::B),
        ("sync", "a", Site::A),
        ("cloudnet", "b", Site::B),
    ] {
        let out = t.ok(&["migrate", "d1", "--to", to, "--disk-mode", mode, "--json"]);
        let v = json(&out);
        assert_arrived_intact(&v, 4096, mode);
        assert_disk_before_memory(&v);
        let disk = &v["outcome"]["disk"];
        assert_eq!(disk["mode"], mode, "{v}");
        // At least the writer's 16 MiB file came through the mirror, and went on the WAN.
        assert!(disk["written_bytes"].as_u64().unwrap() >= 16 << 20, "{v}");
        assert!(disk["frame_bytes"].as_u64().unwrap() > 0, "{v}");
        // The first move copies the disk; each return finds the copy the VM left behind and
        // sends little more than what the writer changed in between (CloudNet's follow the
        // sun): the 64 MiB disk's unchanged blocks go as references.
        let (same, frames) = (
            disk["same_bytes"].as_u64().unwrap(),
            disk["frame_bytes"].as_u64().unwrap(),
        );
        if mode == "async" {
            assert_eq!(same, 0, "nothing at the destination yet: {v}");
            first_frames = frames;
        } else {
            assert!(same >= 48 << 20, "{mode}: the older copy was not used: {v}");
            assert!(
                frames * 3 < first_frames,
                "{mode}: the return sent {frames} disk bytes, the first move {first_frames}: {v}"
            );
        }
        assert_eq!(t.site_of("d1"), site, "{mode}");
    }
    // A wrong mode is refused before anything starts.
    let err = t.fails(&["migrate", "d1", "--to", "a", "--disk-mode", "lazy"], 1);
    assert!(
        err.contains("unknown --disk-mode \"lazy\" (known: async, sync, cloudnet)"),
        "{err}"
    );
    assert_eq!(t.site_of("d1"), Site::B);
}

#[test]
fn a_wan_drop_during_the_disk_copy_resumes_without_starting_over() {
    let t = TestLab::up("dskout", SLOW_LINK);
    start_vm_with_disk_writer(&t, "d2", "24", "0.2");
    let child = Command::new(common::ferry_bin())
        .args(["migrate", "d2", "--to", "b", "--json", "--timeout-s", "300"])
        // A small buffer, so that QEMU's mirror is ready only near the end of the copy.
        .args(["--disk-buffer-mib", "4"])
        .env("FERRY_LAB", &t.lab.name)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let dst_qmp = t.lab.dir().join("vms/d2-b.qmp");
    ferry_lab::topology::wait_until(Duration::from_secs(60), || dst_qmp.exists()).unwrap();
    // A few seconds into the bulk copy (24 MiB at 20 Mbit/s is about 10 s): the connections
    // are torn down, then the WAN is dark for 5 s.
    std::thread::sleep(Duration::from_secs(3));
    t.ok(&["lab", "outage", "reset"]);
    t.ok(&["lab", "outage", "down"]);
    std::thread::sleep(Duration::from_secs(5));
    t.ok(&["lab", "outage", "up"]);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&String::from_utf8_lossy(&out.stdout));
    assert_arrived_intact(&v, 6144, "after the drop");
    assert_eq!(t.site_of("d2"), Site::B);
    let tl = timeline(&v);
    let count = |kind: EventKind| tl.events.iter().filter(|e| e.kind == kind).count();
    assert!(
        count(EventKind::ConnectionLost) >= 1,
        "the drop lost no connection: {:?}",
        tl.events
    );
    // One copy, resumed where it was: the disk phase started once and ended after the drop.
    assert_eq!(count(EventKind::DiskCopyStarted), 1, "{:?}", tl.events);
    let lost = tl
        .events
        .iter()
        .find(|e| e.kind == EventKind::ConnectionLost)
        .unwrap()
        .t_ms;
    let ready = tl
        .events
        .iter()
        .find(|e| e.kind == EventKind::DiskReady)
        .unwrap()
        .t_ms;
    assert!(
        lost < ready,
        "the drop came after the disk copy, so it tested nothing: {:?}",
        tl.events
    );
}

#[test]
fn an_overlay_on_a_template_the_destination_holds_moves_without_its_backing_image() {
    let t = TestLab::up("dsksnap", FAST_LINK);
    // The disk is an overlay on a template with 24 MiB of incompressible data, which both
    // sites' libraries hold (SnapMig): only the overlay (the writer's 8 MiB) may travel.
    t.ok(&[
        "vm",
        "start",
        "s1",
        "--disk-template-mib",
        "24",
        "--mem-mib",
        "128",
        "--workload",
        "ws",
        "--dirty-mib",
        "16",
        "--dirty-rate-mib-s",
        "1",
    ]);
    t.ok(&["guest", "s1", "disk", "start", "mib=8", "rate=0.2"]);
    let v = json(&t.ok(&["migrate", "s1", "--to", "b", "--json"]));
    assert_arrived_intact(&v, 2048, "overlay");
    let disk = &v["outcome"]["disk"];
    assert_eq!(
        disk["overlay_only"], 1,
        "the backing image was not recognised: {v}"
    );
    assert!(
        disk["frame_bytes"].as_u64().unwrap() < 12 << 20,
        "more than the overlay crossed: {v}"
    );
}
