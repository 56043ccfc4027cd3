//! The front door: the demo and the bench, end to end on a fast link with a small guest.

mod common;

use common::TestLab;

#[test]
fn demo_migrates_and_reports_an_intact_guest_and_connection() {
    let t = TestLab::named("demo");
    let out = t.ok(&[
        "demo",
        "--lab",
        &t.lab.name,
        "--rate-mbit",
        "1000",
        "--rtt-ms",
        "10",
        "--mem-mib",
        "256",
        "--dirty-mib",
        "32",
        "--warmup-s",
        "1",
    ]);
    for line in [
        "completed            yes",
        "verifier             OK, no lost or stale pages",
        "TCP connection       intact: kept every sequence number",
        "counted by the emulator",
    ] {
        assert!(out.contains(line), "demo report lacks {line:?}:\n{out}");
    }
    assert!(t.namespaces().is_empty(), "the demo left its lab up");
}

#[test]
fn bench_prints_the_contract_fields() {
    let t = TestLab::named("bench");
    let out = t.ok(&[
        "bench",
        "--lab",
        &t.lab.name,
        "--modes",
        "plain",
        "--workloads",
        "delta",
        "--runs",
        "1",
        "--mem-mib",
        "256",
        "--dirty-mib",
        "32",
        "--rate-mbit",
        "1000",
        "--rtt-ms",
        "10",
        "--warmup-s",
        "1",
    ]);
    let v: serde_json::Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    for field in [
        "system",
        "workload",
        "link",
        "mem_mib",
        "disk_mib",
        "completed",
        "total_ms",
        "downtime_ms",
        "qemu_downtime_ms",
        "guest_gap_ms",
        "wan_bytes",
        "verify_errors",
        "iterations",
        "floor_bytes",
        "floor_ms",
    ] {
        assert!(v.get(field).is_some(), "bench JSON lacks {field}: {v}");
    }
    assert_eq!(v["system"], "qemu-plain");
    assert_eq!(v["completed"], true);
    assert_eq!(v["verify_errors"], 0);
    assert_eq!(v["link"]["rate_mbit"], 1000.0);
    // The floor is real: some MB of unique memory, less than what QEMU sent.
    let floor = v["floor_bytes"].as_u64().unwrap();
    assert!(
        floor > 1_000_000 && floor < v["wan_bytes"].as_u64().unwrap(),
        "{v}"
    );
    assert!(t.namespaces().is_empty(), "the bench left its lab up");
}
