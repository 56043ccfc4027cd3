//! Disks through the agents: a VM whose guest keeps writing to its disk is migrated by ferry
//! in each mirroring mode, and across a WAN drop during the disk copy. The guest's disk
//! verifier (every acknowledged write, read back with O_DIRECT) decides whether the disk
//! arrived intact.

mod common;

use std::process::Command;
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
        let mut args = vec!["migrate", "d1", "--to", to, "--disk-mode", mode, "--json"];
        if mode == "async" {
            // The first move's background copy is taken for stalled at once, as one that a
            // guest outwrites would be after 10 s: it turns write-blocking mid-copy.
            args.extend(["--test-disk-stall-ms", "0"]);
        }
        if mode == "cloudnet" {
            // The last move's copy is paced by the guest's IO (the guest writes 0.5 MiB/s of
            // 4 KiB blocks, enough to judge).
            args.extend(["--disk-pacing-floor-pct", "50"]);
        }
        let v = json(&t.ok(&args));
        assert_arrived_intact(&v, 4096, mode);
        assert_disk_before_memory(&v);
        let ready = timeline(&v)
            .events
            .into_iter()
            .find(|e| e.kind == EventKind::DiskReady)
            .unwrap();
        assert_eq!(
            ready.detail.contains("the background copy stalled"),
            mode == "async",
            "{mode}: {ready:?}"
        );
        let disk = &v["outcome"]["disk"];
        assert_eq!(disk["mode"], mode, "{v}");
        // Async and cloudnet copy in the background (no guest write waits for the bulk copy)
        // and turn write-blocking once it is done; sync's promise holds from the start.
        let copy = if mode == "sync" {
            "write-blocking"
        } else {
            "background"
        };
        assert_eq!(disk["copy"], copy, "{mode}: {v}");
        assert_eq!(disk["paced_ms"].is_u64(), mode == "cloudnet", "{mode}: {v}");
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
            // The copy the VM left is untouched: the source's dirty bitmaps say what changed,
            // and the destination reads nothing to index it.
            assert_eq!(disk["older_copy"], "bitmap", "{mode}: {v}");
            assert!(disk["index_ms"].is_null(), "{mode}: {v}");
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

/// The name of the `ferry-arrived-` bitmap on `vm`'s disk at `site`, if there is one, and
/// the node it is on.
fn arrived_bitmap(t: &TestLab, vm: &str, site: Site) -> Option<(String, String)> {
    use ferry_qemu::commands::QueryNamedBlockNodes;
    let socket = t.lab.dir().join(format!("vms/{vm}-{}.qmp", site.name()));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let nodes = rt.block_on(async {
        let qmp = ferry_qemu::Qmp::connect(&socket).await.unwrap();
        qmp.execute(&QueryNamedBlockNodes { flat: true })
            .await
            .unwrap()
    });
    nodes.into_iter().find_map(|n| {
        n.dirty_bitmaps
            .iter()
            .find(|b| b.name.starts_with("ferry-arrived-"))
            .map(|b| (n.node_name.clone(), b.name.clone()))
    })
}

fn remove_bitmap(t: &TestLab, vm: &str, site: Site, node: &str, name: &str) {
    use ferry_qemu::commands::BlockDirtyBitmapRemove;
    let socket = t.lab.dir().join(format!("vms/{vm}-{}.qmp", site.name()));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let qmp = ferry_qemu::Qmp::connect(&socket).await.unwrap();
        qmp.execute(&BlockDirtyBitmapRemove {
            node: node.into(),
            name: name.into(),
        })
        .await
        .unwrap()
    });
}

/// The disk image `vm` left at `site`.
fn image_at(t: &TestLab, vm: &str, site: Site) -> std::path::PathBuf {
    let data = ferry_lab::vm::data_dir(&t.lab, vm);
    let suffix = format!("-{}.qcow2", site.name());
    std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(&suffix))
        .unwrap_or_else(|| panic!("no disk image of site {site:?} in {}", data.display()))
}

/// Whether a persistent bitmap of `image` is flagged in use (by a QEMU that has it open, or
/// had it open and never closed it); `None` when `qemu-img` could not read the image (its
/// header in the middle of a rewrite).
fn a_bitmap_in_use(image: &std::path::Path) -> Option<bool> {
    // -U: whoever holds the image holds its lock.
    let out = Command::new("qemu-img")
        .args(["info", "-U", "--output", "json"])
        .arg(image)
        .output()
        .expect("run qemu-img");
    if !out.status.success() {
        return None;
    }
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let bitmaps = &info["format-specific"]["data"]["bitmaps"];
    Some(bitmaps.as_array().is_some_and(|all| {
        all.iter().any(|b| {
            b["flags"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f == "in-use"))
        })
    }))
}

/// A child process, killed and reaped when dropped (also when an assertion fails first).
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Leaves `image`'s persistent bitmaps as a crash does: a QEMU (here `qemu-io`) opens it
/// read-write, which flags them in use, and is killed before it can store them.
fn crash_with_the_image_open(image: &std::path::Path) {
    assert_eq!(
        a_bitmap_in_use(image),
        Some(false),
        "{} before",
        image.display()
    );
    // stdin not a terminal: qemu-io turns a terminal's echo off until it exits cleanly.
    let holder = std::sync::Mutex::new(KilledOnDrop(
        Command::new("qemu-io")
            .args(["-c", "sleep 600000"])
            .arg(image)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    ));
    let exited = || holder.lock().unwrap().0.try_wait().unwrap();
    let opened = ferry_lab::topology::wait_until(Duration::from_secs(30), || {
        a_bitmap_in_use(image) == Some(true) || exited().is_some()
    });
    assert!(exited().is_none(), "qemu-io ended: {:?}", exited());
    assert!(
        opened.is_ok(),
        "qemu-io never flagged {}'s bitmaps",
        image.display()
    );
    drop(holder);
    assert_eq!(
        a_bitmap_in_use(image),
        Some(true),
        "{} after the crash",
        image.display()
    );
}

/// Asserts that the move `v` indexed the destination's older copy, for a reason that says
/// `why`.
fn assert_indexed_because(v: &serde_json::Value, why: &str) {
    let disk = &v["outcome"]["disk"];
    assert_eq!(disk["older_copy"], "index", "{v}");
    assert!(
        disk["older_copy_note"]
            .as_str()
            .is_some_and(|n| n.contains(why)),
        "{v}"
    );
}

/// The return trip falls back to reading and indexing the older copy when the source's
/// bitmap is gone, when the copy left behind was written after the VM left (its own bitmap
/// counts the writes), and when a crash left that bitmap in use (nothing says what it
/// missed); with both markers in place it reads nothing. The guest's verifier decides each
/// time: a copy trusted wrongly would leave its disk garbage.
#[test]
fn a_return_the_bitmaps_cannot_vouch_for_indexes_the_older_copy() {
    let t = TestLab::up("dskbm", FAST_LINK);
    start_vm_with_disk_writer(&t, "d9", "16", "0.5");
    let first = json(&t.ok(&["migrate", "d9", "--to", "b", "--json"]));
    assert_arrived_intact(&first, 1, "first move");
    assert!(first["outcome"]["disk"]["older_copy"].is_null(), "{first}");

    // The bitmap that tracks the writes at b is gone: a goes back to its index.
    let (node, name) = arrived_bitmap(&t, "d9", Site::B).expect("an arrived bitmap at b");
    remove_bitmap(&t, "d9", Site::B, &node, &name);
    let v = json(&t.ok(&["migrate", "d9", "--to", "a", "--json"]));
    assert_arrived_intact(&v, 1, "without the bitmap");
    assert_indexed_because(&v, "the source tracks no writes since an arrival");
    let disk = &v["outcome"]["disk"];
    assert!(disk["index_ms"].as_u64().is_some(), "{v}");
    assert!(disk["same_bytes"].as_u64().unwrap() >= 32 << 20, "{v}");

    // The copy the VM left at b is overwritten whole after it left: b's own bitmap counts it.
    let image = image_at(&t, "d9", Site::B);
    let size = virtual_size(&image);
    let out = Command::new("qemu-io")
        .args(["-c", &format!("write -P 0x5a 0 {size}")])
        .arg(&image)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v = json(&t.ok(&["migrate", "d9", "--to", "b", "--json"]));
    assert_arrived_intact(&v, 1, "to a copy changed since");
    assert_indexed_because(&v, "changed after the VM left");

    // Both markers in place again: nothing is read at the destination.
    let v = json(&t.ok(&["migrate", "d9", "--to", "a", "--json"]));
    assert_arrived_intact(&v, 1, "with both markers");
    assert_eq!(v["outcome"]["disk"]["older_copy"], "bitmap", "{v}");
    assert!(
        v["outcome"]["disk"]["same_bytes"].as_u64().unwrap() >= 32 << 20,
        "{v}"
    );

    // Something opened the copy left at b and crashed: its bitmap may have missed writes.
    crash_with_the_image_open(&image_at(&t, "d9", Site::B));
    let v = json(&t.ok(&["migrate", "d9", "--to", "b", "--json"]));
    assert_arrived_intact(&v, 1, "to a copy whose bitmap a crash left in use");
    assert_indexed_because(&v, "QEMU found it in use when it opened the image");
    let disk = &v["outcome"]["disk"];
    assert!(disk["same_bytes"].as_u64().unwrap() >= 32 << 20, "{v}");
}

#[test]
fn a_wan_drop_during_the_disk_copy_resumes_without_starting_over() {
    let t = TestLab::up("dskout", SLOW_LINK);
    start_vm_with_disk_writer(&t, "d2", "24", "0.2");
    // A small buffer, so that QEMU's mirror is ready only near the end of the copy.
    let child = t.spawn_migrate("d2", &["--disk-buffer-mib", "4"]);
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

/// SnapMig at depth. A disk three images deep (the VM's overlay on a template of two layers,
/// each 4 MiB or more of incompressible data) moves with only its overlay when the
/// destination's library holds both layers below it. When the destination's base differs
/// under a middle layer that is byte for byte the same, the disk moves whole: copying the top
/// alone would have the guest read the wrong base. Either way the guest reads the same files
/// after the move as before (its own digest, read from the disk).
#[test]
fn a_three_deep_chain_moves_only_its_top_and_over_a_different_base_moves_whole() {
    let t = TestLab::up("dskchain", FAST_LINK);
    let files = ["/data/template.bin", "/data/layer2.bin"];

    start_vm_on_template_chain(&t, "c1");
    let before = guest_sums(&t, "c1", &files);
    let v = json(&t.ok(&["migrate", "c1", "--to", "b", "--json"]));
    assert_arrived_intact(&v, 2048, "on the chain both libraries hold");
    let disk = &v["outcome"]["disk"];
    assert_eq!(disk["overlay_only"], 1, "the chain was not recognised: {v}");
    assert!(
        disk["frame_bytes"].as_u64().unwrap() < 12 << 20,
        "more than the overlay crossed: {v}"
    );
    assert_eq!(guest_sums(&t, "c1", &files), before, "c1 reads other bytes");
    t.ok(&["vm", "stop", "c1"]);

    // Site b's base now holds other bytes; its middle layer is still the same file.
    let base = ferry_lab::vm::template_dir(&t.lab, Site::B).join("template-64-24.qcow2");
    let rewritten = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -q -P 0x5a 0 64M"])
        .arg(&base)
        .status()
        .unwrap();
    assert!(rewritten.success(), "rewriting {}", base.display());

    start_vm_on_template_chain(&t, "c2");
    let before = guest_sums(&t, "c2", &files);
    let v = json(&t.ok(&["migrate", "c2", "--to", "b", "--json"]));
    assert_arrived_intact(&v, 2048, "over a different base");
    let disk = &v["outcome"]["disk"];
    assert_eq!(
        disk["overlay_only"], 0,
        "copied top-only over another base: {v}"
    );
    assert!(
        disk["frame_bytes"].as_u64().unwrap() > 24 << 20,
        "the template's data did not cross: {v}"
    );
    assert_eq!(guest_sums(&t, "c2", &files), before, "c2 reads other bytes");
}

/// Starts `vm` at site a with its disk an overlay on the lab's two-layer template (24 MiB of
/// data in the base, 4 MiB in the layer above) and a disk writer.
fn start_vm_on_template_chain(t: &TestLab, vm: &str) {
    t.ok(&[
        "vm",
        "start",
        vm,
        "--disk-template-mib",
        "24",
        "--disk-template-layers",
        "2",
        "--mem-mib",
        "128",
        "--workload",
        "ws",
        "--dirty-mib",
        "16",
        "--dirty-rate-mib-s",
        "1",
    ]);
    t.ok(&["guest", vm, "disk", "start", "mib=8", "rate=0.2"]);
}

/// The guest's digests of `files`, read from its disk.
fn guest_sums(t: &TestLab, vm: &str, files: &[&str]) -> Vec<String> {
    files
        .iter()
        .map(|f| t.ok(&["guest", vm, "disk", "sum", &format!("path={f}")]))
        .collect()
}

/// Starts `ferry migrate` of `vm` with its disk in the background and returns once the source
/// agent reports the disks' bulk copy under way.
fn migrate_until_the_disk_copy(t: &TestLab, vm: &str, extra: &[&str]) -> std::process::Child {
    let mut child = t.spawn_migrate(vm, extra);
    let copying = ferry_lab::topology::wait_until(Duration::from_secs(120), || {
        t.migrations(Site::A)
            .iter()
            .any(|m| m["vm"] == vm && m["phase"] == "disk-copy")
    });
    if let Err(e) = copying {
        let _ = child.kill();
        panic!("the disk copy never showed: {e:#}");
    }
    child
}

/// The migration failed with `message`, and the VM runs at site a with its memory and its
/// disk intact (every write the guest saw acknowledged reads back).
fn assert_failed_and_the_source_runs_with_its_disk(
    t: &TestLab,
    vm: &str,
    out: &std::process::Output,
    message: &str,
) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(message), "{err}");
    assert!(err.contains("the source VM keeps running"), "{err}");
    assert_eq!(t.site_of(vm), Site::A);
    for what in ["mem", "disk"] {
        let reply = t.ok(&["guest", vm, what, "verify"]);
        assert!(
            reply.split_whitespace().any(|w| w == "errors=0"),
            "{what}: {reply}"
        );
    }
}

/// Waits until no QEMU of `vm` runs at `site`.
fn wait_until_no_qemu(t: &TestLab, vm: &str, site: Site) {
    let qmp = t.lab.dir().join(format!("vms/{vm}-{}.qmp", site.name()));
    let gone = ferry_lab::topology::wait_until(Duration::from_secs(60), || {
        !Command::new("pgrep")
            .args(["-f", &qmp.to_string_lossy()])
            .output()
            .unwrap()
            .status
            .success()
    });
    assert!(gone.is_ok(), "the QEMU of {vm} at {site:?} is still there");
}

#[test]
fn the_destination_agent_killed_during_the_disk_copy_fails_it_and_the_source_keeps_its_disk() {
    let t = TestLab::up("dskkil", SLOW_LINK);
    start_vm_with_disk_writer(&t, "d4", "24", "0.2");
    let child = migrate_until_the_disk_copy(&t, "d4", &["--wan-timeout-s", "5"]);
    ferry_lab::agents::kill(&t.lab, Site::B).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_failed_and_the_source_runs_with_its_disk(&t, "d4", &out, "the WAN timeout");
}

/// Either agent killed during the disk copy and started again: the migration fails, the
/// source keeps its VM with its memory and disk, nothing is left behind at either end (the
/// source QEMU's mirror and its target node are gone, the destination's QEMU quit), and the
/// next attempt commits.
#[test]
fn agents_restarted_during_the_disk_copy_fail_it_and_the_next_attempt_commits() {
    let t = TestLab::up("dskrst", SLOW_LINK);
    let ferry = std::path::Path::new(common::ferry_bin());
    start_vm_with_disk_writer(&t, "d7", "24", "0.2");

    // The source agent: its record says `preparing`. The restarted agent lists the migration
    // again, failed, and `ferry migrate` follows it there.
    let child = migrate_until_the_disk_copy(&t, "d7", &["--wan-timeout-s", "5"]);
    ferry_lab::agents::kill(&t.lab, Site::A).unwrap();
    ferry_lab::agents::restart(&t.lab, Site::A, ferry).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_failed_and_the_source_runs_with_its_disk(
        &t,
        "d7",
        &out,
        "the source agent restarted before the stream started",
    );
    assert_nothing_of_ferry_left_in_qemu(&t, "d7", Site::A);
    // Its session gone, the destination agent quits its QEMU at the WAN timeout.
    wait_until_no_qemu(&t, "d7", Site::B);

    // The destination agent: its record says `receiving`. The restarted agent quits its QEMU
    // and tells the source, which asks once the session is silent (the WAN timeout, 120 s
    // here, is not waited for).
    let child = migrate_until_the_disk_copy(&t, "d7", &[]);
    ferry_lab::agents::kill(&t.lab, Site::B).unwrap();
    ferry_lab::agents::restart(&t.lab, Site::B, ferry).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_failed_and_the_source_runs_with_its_disk(
        &t,
        "d7",
        &out,
        "the destination aborted: the destination agent restarted before the commit",
    );
    wait_until_no_qemu(&t, "d7", Site::B);

    let v = json(&t.ok(&["migrate", "d7", "--to", "b", "--json"]));
    assert_arrived_intact(&v, 1, "after both restarts");
    assert_eq!(t.site_of("d7"), Site::B);
}

/// The QEMU of `vm` at `site` has no mirror job or target node of ferry's left.
fn assert_nothing_of_ferry_left_in_qemu(t: &TestLab, vm: &str, site: Site) {
    use ferry_qemu::commands::{QueryBlockJobs, QueryNamedBlockNodes};
    let socket = t.lab.dir().join(format!("vms/{vm}-{}.qmp", site.name()));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (jobs, nodes) = rt.block_on(async {
        let qmp = ferry_qemu::Qmp::connect(&socket).await.unwrap();
        let jobs = qmp.execute(&QueryBlockJobs).await.unwrap();
        let nodes = qmp
            .execute(&QueryNamedBlockNodes { flat: true })
            .await
            .unwrap();
        (jobs, nodes)
    });
    let jobs: Vec<String> = jobs.into_iter().map(|j| j.device).collect();
    assert!(
        !jobs.iter().any(|j| j.starts_with("ferry-")),
        "block jobs left: {jobs:?}"
    );
    let nodes: Vec<String> = nodes.into_iter().map(|n| n.node_name).collect();
    assert!(
        !nodes.iter().any(|n| n.starts_with("ferry-")),
        "block nodes left: {nodes:?}"
    );
}

#[test]
fn the_source_qemu_killed_during_the_disk_copy_fails_it_and_nothing_runs_at_the_destination() {
    let t = TestLab::up("dsksq", SLOW_LINK);
    start_vm_with_disk_writer(&t, "d8", "24", "0.2");
    let child = migrate_until_the_disk_copy(&t, "d8", &[]);
    t.kill_qemu("d8", Site::A);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the source VM could not be resumed")
            && err.contains("the source QEMU went away during the disk copy"),
        "{err}"
    );
    wait_until_no_qemu(&t, "d8", Site::B);
}

#[test]
fn the_destination_qemu_killed_during_the_disk_copy_fails_it_and_the_source_keeps_its_disk() {
    let t = TestLab::up("dskqkil", SLOW_LINK);
    start_vm_with_disk_writer(&t, "d6", "24", "0.2");
    let child = migrate_until_the_disk_copy(&t, "d6", &[]);
    t.kill_qemu("d6", Site::B);
    let out = child.wait_with_output().unwrap();
    assert_failed_and_the_source_runs_with_its_disk(&t, "d6", &out, "the destination aborted");
}

/// A bit of the disk's data flipped after the source hashed it (as a fault above TLS would):
/// the destination's acknowledgement does not match what was sent, the copy fails, and the
/// source keeps its VM and its disk.
#[test]
fn a_corrupted_disk_frame_fails_the_copy_and_the_source_keeps_its_disk() {
    let t = TestLab::up("dskbit", FAST_LINK);
    start_vm_with_disk_writer(&t, "d9", "16", "0.5");
    let out = t.run(&[
        "migrate",
        "d9",
        "--to",
        "b",
        "--test-corrupt-disk-at",
        "1048576",
    ]);
    assert_failed_and_the_source_runs_with_its_disk(&t, "d9", &out, "differ from those sent");
    wait_until_no_qemu(&t, "d9", Site::B);
}

#[test]
fn a_full_destination_disk_fails_the_copy_with_its_reason_and_the_source_keeps_its_disk() {
    let t = TestLab::up("dskful", FAST_LINK);
    start_vm_with_disk_writer(&t, "d5", "24", "0.2");
    // The destination's image, made ahead (as the copy a VM left on an earlier stay would be)
    // on a file system of 8 MiB, where the guest's 24 MiB cannot fit.
    let rec = ferry_lab::vm::load(&t.lab, "d5").unwrap();
    let image_at = |site| {
        ferry_lab::vm::spec_at(&t.lab, &rec, site).disks[0]
            .path
            .clone()
    };
    let source_image = image_at(Site::A);
    let small = SmallFileSystem::mount(&t.lab.dir().join("small-fs"), "8m");
    let destination_image = small.0.join("d5.qcow2");
    common::qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        &destination_image.to_string_lossy(),
        &virtual_size(&source_image).to_string(),
    ]);
    let link = image_at(Site::B);
    std::os::unix::fs::symlink(&destination_image, &link).unwrap();
    let out = t.run(&[
        "migrate",
        "d5",
        "--to",
        "b",
        "--json",
        "--wan-timeout-s",
        "10",
    ]);
    assert_failed_and_the_source_runs_with_its_disk(&t, "d5", &out, "No space left on device");
}

/// The virtual size of a disk image, bytes.
fn virtual_size(image: &std::path::Path) -> u64 {
    let image = image.to_string_lossy();
    // -U: the running VM holds the image's lock.
    let info = common::qemu_img(&["info", "-U", "--output", "json", &image]);
    json(&info)["virtual-size"].as_u64().unwrap()
}

/// A tmpfs of a given size, unmounted when dropped.
struct SmallFileSystem(std::path::PathBuf);

impl SmallFileSystem {
    fn mount(at: &std::path::Path, size: &str) -> SmallFileSystem {
        std::fs::create_dir_all(at).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .unwrap();
        assert!(mounted.success(), "mount a tmpfs at {}", at.display());
        SmallFileSystem(at.to_owned())
    }
}

impl Drop for SmallFileSystem {
    fn drop(&mut self) {
        // Lazily: a QEMU still holding its file must not keep the mount after the test.
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}
