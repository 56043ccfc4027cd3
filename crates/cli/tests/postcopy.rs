//! End to end: ferry's postcopy (`--postcopy`) with a real guest under QEMU (TCG). The switch
//! is the commit point: the destination QEMU gets the device state only once everything
//! before it matched the source's digest, and from then on the VM runs there while its
//! remaining pages cross, through a WAN outage if one comes. The guest's verifier decides
//! whether its memory arrived intact.

mod common;

use std::time::Duration;

use common::{json, TestLab};
use ferry_api::EventKind;
use ferry_lab::Site;

/// Slow enough that the postcopy phase lasts seconds: the hot set rewritten during the first
/// pass crosses after the switch.
const SLOW_LINK: &[&str] = &["--rate-mbit", "20", "--rtt-ms", "20"];

/// A guest rewriting a 48 MiB hot set as fast as it can, at site a.
fn start_hot_vm(t: &TestLab, name: &str) {
    t.ok(&[
        "vm",
        "start",
        name,
        "--mem-mib",
        "192",
        "--workload",
        "hot",
        "--dirty-mib",
        "48",
        "--dirty-rate-mib-s",
        "0",
    ]);
}

/// The phase of the newest migration `site`'s agent sent.
fn newest(t: &TestLab, site: Site, field: &str) -> Option<String> {
    let mut all = t.migrations(site);
    all.sort_by_key(|m| m["started_unix_ms"].as_u64());
    all.last()
        .and_then(|m| m[field].as_str().map(str::to_owned))
}

/// How long the source has held on without a connection after the switch, by its status.
fn held_for_s(t: &TestLab) -> Option<u64> {
    newest(t, Site::A, "detail")?
        .strip_prefix("postcopy: no connection to the destination for ")?
        .split('s')
        .next()?
        .parse()
        .ok()
}

#[test]
fn postcopy_commits_at_the_switch_and_its_pages_cross_a_wan_outage() {
    let t = TestLab::up("post", SLOW_LINK);
    start_hot_vm(&t, "p1");

    // A bit flipped before the switch: the destination never loads the device state. QEMU
    // 10.0 cannot take its postcopy back, so the source VM stays paused (whole) and the error
    // says so; the destination has nothing.
    let corrupted = t.run(&[
        "migrate",
        "p1",
        "--to",
        "b",
        "--postcopy",
        "--test-corrupt-at",
        "1000000",
    ]);
    let err = String::from_utf8_lossy(&corrupted.stderr).into_owned();
    assert_eq!(corrupted.status.code(), Some(1), "{err}");
    assert!(
        err.contains("stream digest mismatch at the postcopy package"),
        "{err}"
    );
    assert!(err.contains("the source VM stays paused"), "{err}");
    assert!(
        !t.lab.dir().join("vms/p1-b.qmp").exists(),
        "the destination QEMU was not removed"
    );
    assert_eq!(t.site_of("p1"), Site::A);
    let source = t.migrations(Site::A);
    assert!(
        source
            .iter()
            .any(|m| m["detail"] == "the source VM stays paused"),
        "{source:?}"
    );
    t.ok(&["vm", "stop", "p1"]);

    // The real move: the outage comes while the VM already runs at b.
    start_hot_vm(&t, "p2");
    // Postcopy only once precopy throttles the guest hard (the switch waits for QEMU's
    // auto-converge to reach 30%; `--postcopy` itself is the corrupted migration's above).
    let child = t.spawn_migrate(
        "p2",
        &["--postcopy-at-throttle", "30", "--wan-timeout-s", "5"],
    );
    ferry_lab::topology::wait_until(Duration::from_secs(240), || {
        newest(&t, Site::A, "phase").as_deref() == Some("postcopy")
    })
    .expect("the migration reached postcopy");
    t.ok(&["lab", "outage", "down"]);
    // Longer than the WAN timeout: the connections are given up after 10 s of silence, and
    // then the source holds on past its 5 s (the destination too) instead of failing.
    ferry_lab::topology::wait_until(Duration::from_secs(120), || {
        held_for_s(&t).is_some_and(|s| s > 6)
    })
    .expect("the source held on past the WAN timeout");
    t.ok(&["lab", "outage", "up"]);
    let out = child.wait_with_output().unwrap();
    let stdout = common::succeeded("ferry migrate --postcopy", &out);
    let v = json(&stdout);
    assert_eq!(v["outcome"]["completed"], true, "{v}");
    assert_eq!(v["verify"]["mem_errors"], 0, "{v}");
    // The guest wrote to pages that had not crossed yet: they came on the preempt channel.
    assert!(
        v["outcome"]["preempt_bytes"].as_u64() > Some(0),
        "{}",
        v["outcome"]
    );
    assert_eq!(t.site_of("p2"), Site::B);
    // Postcopy: the destination ran the VM before the source's stream ended.
    let tl = common::timeline(&v);
    let committed = tl.find(EventKind::Committed).expect("a commit event");
    let ended = tl.find(EventKind::StreamEnded).expect("the stream's end");
    assert!(
        committed
            .detail
            .starts_with("postcopy: the destination runs the VM"),
        "{committed:?}"
    );
    assert!(
        committed.t_ms < ended.t_ms,
        "the commit ({} ms) came after the stream's end ({} ms)",
        committed.t_ms,
        ended.t_ms
    );
    // It keeps running there: its dirtier makes progress.
    let before = t.ok(&["guest", "p2", "mem", "stats"]);
    std::thread::sleep(Duration::from_millis(500));
    assert_ne!(before, t.ok(&["guest", "p2", "mem", "stats"]));
}

/// The source agent killed (SIGKILL) in the postcopy phase: the VM runs at b without the pages
/// still at a, whose QEMU pauses once its socket to the agent is gone. The restarted agent
/// resumes the migration through QEMU's postcopy recovery, and every page arrives.
#[test]
fn a_source_agent_killed_after_the_postcopy_switch_is_restarted_and_recovers_it() {
    let t = killed_after_the_switch_and_restarted("postrs", Site::A, "p3");
    let detail = newest(&t, Site::A, "detail").unwrap_or_default();
    assert!(
        detail.contains("after QEMU's postcopy recovery"),
        "{detail}"
    );
}

/// The destination agent killed (SIGKILL) in the postcopy phase: its QEMU, running the VM,
/// pauses for the pages it lacks, and only the connection a process of its own kept open lets
/// anyone talk to it. The restarted agent takes that connection back; the source, its session
/// silent, hears the migration paused there and resumes it through QEMU's recovery.
#[test]
fn a_destination_agent_killed_after_the_postcopy_switch_is_restarted_and_recovers_it() {
    let t = killed_after_the_switch_and_restarted("postrd", Site::B, "p4");
    let log = std::fs::read_to_string(ferry_lab::agents::log_path(&t.lab, Site::B)).unwrap();
    assert!(log.contains("its monitor is back"), "{log}");
}

/// The destination QEMU killed (SIGKILL) in the postcopy phase: the VM is lost with it, and
/// nothing is undone. The migration fails saying so, and the source QEMU stays, paused, with the
/// VM as it was at the switch, for an operator (resuming it would roll the guest back).
#[test]
fn the_destination_qemu_killed_after_the_postcopy_switch_fails_it_saying_the_vm_is_lost() {
    let t = TestLab::up("postqd", SLOW_LINK);
    start_hot_vm(&t, "p5");
    let child = t.spawn_migrate("p5", &["--postcopy"]);
    ferry_lab::topology::wait_until(Duration::from_secs(240), || {
        newest(&t, Site::A, "phase").as_deref() == Some("postcopy")
    })
    .expect("the migration reached postcopy");
    t.kill_qemu("p5", Site::B);
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{out:?}");
    let error = newest(&t, Site::A, "error").unwrap_or_default();
    assert!(
        error.contains("the destination QEMU exited") && error.contains("rolls the guest back"),
        "{error}"
    );
    assert!(
        !t.guest_running("p5", Site::A),
        "the source QEMU is there, paused"
    );
}

/// Migrates `vm` with `--postcopy` on lab `lab`, kills `site`'s agent in the postcopy phase and
/// restarts it: the migration must end with the VM at b, its memory whole and running there.
fn killed_after_the_switch_and_restarted(lab: &str, site: Site, vm: &str) -> TestLab {
    let t = TestLab::up(lab, SLOW_LINK);
    let ferry = std::path::Path::new(common::ferry_bin());
    start_hot_vm(&t, vm);
    let child = t.spawn_migrate(vm, &["--postcopy"]);
    ferry_lab::topology::wait_until(Duration::from_secs(240), || {
        newest(&t, Site::A, "phase").as_deref() == Some("postcopy")
    })
    .expect("the migration reached postcopy");
    ferry_lab::agents::kill(&t.lab, site).unwrap();
    ferry_lab::agents::restart(&t.lab, site, ferry).unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = common::succeeded(
        &format!("ferry migrate --postcopy, the {site:?} agent restarted"),
        &out,
    );
    let v = json(&stdout);
    assert_eq!(v["verify"]["mem_errors"], 0, "{v}");
    assert_eq!(t.site_of(vm), Site::B);
    // It keeps running there: its dirtier makes progress.
    let before = t.ok(&["guest", vm, "mem", "stats"]);
    std::thread::sleep(Duration::from_millis(500));
    assert_ne!(before, t.ok(&["guest", vm, "mem", "stats"]));
    t
}
