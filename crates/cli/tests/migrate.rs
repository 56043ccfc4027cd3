//! End to end: real guests under QEMU (TCG) migrated across the lab's WAN with QEMU's own
//! migration (and, for Ctrl-C, ferry's). The guest's verifiers and a TCP connection decide whether the VM arrived intact.

mod common;

use std::time::Duration;

use common::TestLab;
use ferry_lab::tcpseq::TcpSeqClient;
use ferry_lab::Site;

/// A fast link keeps these tests short; the 100 Mbit/s, 50 ms scenarios are `ferry bench`'s.
const FAST_LINK: &[&str] = &["--rate-mbit", "1000", "--rtt-ms", "10"];

fn migrate_json(t: &TestLab, vm: &str, to: &str, mode: &str) -> serde_json::Value {
    let out = t.ok(&[
        "migrate", vm, "--to", to, "--system", "qemu", "--mode", mode, "--json",
    ]);
    serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("migrate --json printed {out:?}: {e}"))
}

/// The migration's timeline has samples and the phases in order, and `ferry report` draws it.
fn assert_timeline_tells_the_story(t: &TestLab, v: &serde_json::Value) {
    let path = v["timeline"]
        .as_str()
        .expect("migrate --json names its timeline");
    let tl: ferry_api::Timeline =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(tl.samples.len() >= 3, "too few samples in {path}");
    assert!(
        tl.samples.windows(2).all(|w| w[0].t_ms <= w[1].t_ms),
        "samples out of order in {path}"
    );
    use ferry_api::EventKind::*;
    let order = [
        DestinationStarted,
        DiskCopyStarted,
        DiskReady,
        MemoryStarted,
        SourceStopped,
        DestinationLoaded,
        DestinationResumed,
    ];
    let times: Vec<u64> = order
        .iter()
        .map(|k| {
            tl.find(*k)
                .unwrap_or_else(|| panic!("no {k:?} in {path}"))
                .t_ms
        })
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "phases out of order in {path}: {times:?}"
    );
    let svg = t.ok(&["report", path, "-o", &format!("{path}.svg")]);
    assert!(std::fs::read_to_string(svg.trim())
        .unwrap()
        .contains("<polyline"));
}

#[test]
fn every_qemu_mode_moves_memory_disk_and_tcp_intact() {
    let t = TestLab::up("mig", FAST_LINK);
    t.ok(&[
        "vm",
        "start",
        "t1",
        "--disk",
        "--workload",
        "ws",
        "--dirty-mib",
        "32",
        "--dirty-rate-mib-s",
        "2",
    ]);
    t.ok(&["guest", "t1", "disk", "start", "mib=8", "rate=0.2"]);
    let ip = ferry_lab::vm::load(&t.lab, "t1").unwrap().guest_ip;
    let tcp = TcpSeqClient::connect(
        &t.lab.site_ns(Site::A),
        &format!("{ip}:7000"),
        Duration::from_secs(30),
    )
    .unwrap();
    tcp.wait_for_more(20, Duration::from_secs(30)).unwrap();

    for (mode, to, site) in [
        ("plain", "b", Site::B),
        ("multifd-zstd", "a", Site::A),
        ("xbzrle", "b", Site::B),
    ] {
        let v = migrate_json(&t, "t1", to, mode);
        assert_eq!(v["system"], format!("qemu-{mode}"));
        assert_eq!(v["outcome"]["completed"], true, "{mode}: {v}");
        assert!(
            v["verify"]["mem_pages"].as_u64().unwrap() >= 8192,
            "{mode}: {v}"
        );
        assert_eq!(
            v["verify"]["mem_errors"], 0,
            "{mode}: memory verifier found errors: {v}"
        );
        assert!(
            v["verify"]["disk_blocks"].as_u64().unwrap() >= 2048,
            "{mode}: {v}"
        );
        assert_eq!(
            v["verify"]["disk_errors"], 0,
            "{mode}: disk verifier found errors: {v}"
        );
        assert!(
            v["outcome"]["wan_bytes"].as_u64().unwrap() > 16 << 20,
            "{mode}: too few WAN bytes: {v}"
        );
        assert!(
            v["outcome"]["downtime_ms"].as_f64().unwrap() > 0.0,
            "{mode}: {v}"
        );
        // The guest cannot beat while it is paused: its longest gap covers the real downtime.
        let gap = v["outcome"]["guest_gap_ms"]
            .as_f64()
            .expect("a heartbeat gap was measured");
        let downtime = v["outcome"]["downtime_ms"].as_f64().unwrap();
        assert!(
            gap >= downtime - 5.0,
            "{mode}: guest gap {gap} ms shorter than the downtime {downtime} ms: {v}"
        );
        assert_eq!(t.site_of("t1"), site);
        assert_timeline_tells_the_story(&t, &v);
        // The guest keeps serving the same TCP connection from its new site.
        tcp.wait_for_more(30, Duration::from_secs(30)).unwrap();
        let s = tcp.stats();
        assert!(s.intact(), "{mode}: TCP sequence broken: {s:?}");
    }
    // The verifiers that passed above do catch what they claim to: a lost update (a page or
    // block put back to its previous version) and a flipped byte, at the destination.
    t.ok(&["guest", "t1", "mem", "set", "pattern=idle"]);
    t.ok(&["guest", "t1", "disk", "set", "rate=0"]);
    for what in ["mem", "disk"] {
        t.ok(&["guest", "t1", what, "inject", "kind=stale"]);
        t.ok(&["guest", "t1", what, "inject", "kind=corrupt"]);
        let reply = t.ok(&["guest", "t1", what, "verify"]);
        assert!(
            reply.contains(" stale=1 corrupt=1 errors=2 "),
            "{what} verifier missed injected faults: {reply}"
        );
    }
}

#[test]
fn a_migration_into_a_dead_wan_fails_and_the_source_keeps_running() {
    let t = TestLab::up("dead", FAST_LINK);
    t.ok(&[
        "vm",
        "start",
        "t2",
        "--workload",
        "delta",
        "--dirty-mib",
        "32",
        "--dirty-rate-mib-s",
        "2",
    ]);
    t.ok(&["lab", "outage", "down"]);
    let out = t.run(&[
        "migrate",
        "t2",
        "--to",
        "b",
        "--system",
        "qemu",
        "--timeout-s",
        "8",
        "--json",
    ]);
    t.ok(&["lab", "outage", "up"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(
        out.status.code(),
        Some(0),
        "a migration across a dead WAN succeeded: {stdout}"
    );
    if out.status.code() == Some(3) {
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["outcome"]["completed"], false);
        assert!(
            v["outcome"]["error"]
                .as_str()
                .unwrap()
                .contains("did not converge within 8s"),
            "{v}"
        );
        let path = v["timeline"].as_str().unwrap();
        let tl: ferry_api::Timeline =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let failed = tl
            .find(ferry_api::EventKind::Failed)
            .expect("a failed migration's timeline says so");
        assert!(failed.detail.contains("did not converge"), "{failed:?}");
    } else {
        assert!(stderr.contains("the source VM keeps running"), "{stderr}");
    }
    // Still at site a, running, and its memory intact.
    assert_eq!(t.site_of("t2"), Site::A);
    let reply = t.ok(&["guest", "t2", "mem", "verify"]);
    assert!(reply.contains(" errors=0 "), "{reply}");
    let stats1 = t.ok(&["guest", "t2", "mem", "stats"]);
    std::thread::sleep(Duration::from_millis(500));
    let stats2 = t.ok(&["guest", "t2", "mem", "stats"]);
    assert_ne!(
        stats1, stats2,
        "the source guest is not running (its dirtier made no progress)"
    );
    // And once the WAN is back, the same VM migrates.
    let out = t.ok(&["migrate", "t2", "--to", "b", "--system", "qemu", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["verify"]["mem_errors"], 0, "{v}");
    assert_eq!(t.site_of("t2"), Site::B);
}

#[test]
fn ctrl_c_during_a_migration_cancels_it_and_the_source_keeps_running() {
    // A slow link so the migration is still copying when the interrupt arrives.
    let t = TestLab::up("intr", &["--rate-mbit", "20", "--rtt-ms", "20"]);
    t.ok(&[
        "vm",
        "start",
        "t3",
        "--workload",
        "ws",
        "--dirty-mib",
        "64",
        "--dirty-rate-mib-s",
        "2",
    ]);
    let child = std::process::Command::new(common::ferry_bin())
        .args(["migrate", "t3", "--to", "b"])
        .env("FERRY_LAB", &t.lab.name)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the destination exists (the migration is under way), then interrupt.
    let dst_qmp = t.lab.dir().join("vms/t3-b.qmp");
    ferry_lab::topology::wait_until(Duration::from_secs(30), || dst_qmp.exists()).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    // SAFETY: kill(2) on the child we started.
    unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("interrupted by the user"), "{stderr}");
    assert!(stderr.contains("the source VM keeps running"), "{stderr}");
    assert_eq!(t.site_of("t3"), Site::A);
    assert!(!dst_qmp.exists(), "the destination was not removed");
    let reply = t.ok(&["guest", "t3", "mem", "verify"]);
    assert!(reply.contains(" errors=0 "), "{reply}");
}
