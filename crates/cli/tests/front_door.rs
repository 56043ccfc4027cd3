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
        "cpu",
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
    // Both QEMUs worked during the migration, and the figure per GB on the WAN adds them up.
    let cpu = &v["cpu"];
    let (src, dst) = (
        cpu["source_qemu_s"].as_f64().unwrap(),
        cpu["destination_qemu_s"].as_f64().unwrap(),
    );
    assert!(src > 0.0 && dst > 0.0, "{cpu}");
    let per_gb = cpu["per_wan_gb_s"].as_f64().unwrap();
    let wan_gb = v["wan_bytes"].as_f64().unwrap() / 1e9;
    assert!(per_gb * wan_gb >= (src + dst) * 0.999, "{cpu}");
    assert!(t.namespaces().is_empty(), "the bench left its lab up");
}

/// `ferry demo` running in the test's lab, its output read line by line as it comes.
struct RunningDemo {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stdout: String,
}

impl RunningDemo {
    fn start(t: &TestLab, link: [&str; 2], dirty_mib: &str) -> RunningDemo {
        use std::io::BufRead;
        let mut child = std::process::Command::new(common::ferry_bin())
            .args(["demo", "--lab", &t.lab.name, "--rate-mbit", link[0]])
            .args(["--rtt-ms", link[1], "--mem-mib", "256", "--warmup-s", "1"])
            .args(["--dirty-mib", dirty_mib])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        RunningDemo {
            child,
            lines,
            stdout: String::new(),
        }
    }

    /// Waits until the demo printed a line holding `text`.
    fn wait_for(&mut self, text: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
        while !self.stdout.lines().any(|l| l.contains(text)) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.stdout += &(line + "\n"),
                Err(e) => panic!("the demo never printed {text:?} ({e}):\n{}", self.stdout),
            }
        }
    }

    fn terminate(&self) {
        // SAFETY: kill(2) on the child we started.
        unsafe { libc::kill(i32::try_from(self.child.id()).unwrap(), libc::SIGTERM) };
    }

    /// Its exit code, all it printed on stdout and its stderr.
    fn finish(mut self) -> (Option<i32>, String, String) {
        use std::io::Read;
        let mut stderr = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        let status = self.child.wait().unwrap();
        self.stdout.extend(self.lines.iter().map(|l| l + "\n"));
        (status.code(), self.stdout, stderr)
    }
}

/// Processes whose command line names the lab's directory (its agents, relay and QEMUs).
fn processes_of(t: &TestLab) -> Vec<String> {
    let dir = t.lab.dir().display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&dir))
        .collect()
}

#[test]
fn sigterm_while_the_demo_boots_takes_its_lab_down() {
    let t = TestLab::named("dterm");
    let mut demo = RunningDemo::start(&t, ["1000", "10"], "32");
    demo.wait_for("[3/5] booting");
    assert!(!t.namespaces().is_empty(), "the demo's lab is not up");
    demo.terminate();
    let (code, stdout, stderr) = demo.finish();
    assert_eq!(code, Some(143), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("terminated; taking down what this command brought up"),
        "{stderr}"
    );
    assert!(t.namespaces().is_empty(), "the demo left its lab up");
    assert_eq!(processes_of(&t), Vec::<String>::new(), "left running");
}

#[test]
fn sigterm_during_the_demo_migration_cancels_it_and_takes_the_lab_down() {
    let t = TestLab::named("dtermm");
    // A slow link so the migration is still copying when the signal arrives.
    let mut demo = RunningDemo::start(&t, ["20", "20"], "64");
    demo.wait_for("[4/5] migrating");
    let dst_qmp = t.lab.dir().join("vms/demo-b.qmp");
    ferry_lab::topology::wait_until(std::time::Duration::from_secs(60), || dst_qmp.exists())
        .unwrap();
    demo.terminate();
    let (code, stdout, stderr) = demo.finish();
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("terminated; cancelling the migration (the source VM keeps running)"),
        "{stderr}"
    );
    // Reported as a cancel, like Ctrl-C's: the source kept running until its lab came down.
    assert!(stderr.contains("interrupted by the user"), "{stderr}");
    assert!(t.namespaces().is_empty(), "the demo left its lab up");
    assert_eq!(processes_of(&t), Vec::<String>::new(), "left running");
}
