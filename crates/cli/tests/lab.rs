//! The lab: its front-door errors, and the WAN emulator measured against its settings.

mod common;

use common::TestLab;

#[test]
fn lab_up_twice_and_down_twice_fail_clearly() {
    let t = TestLab::up("dup", &["--rate-mbit", "1000", "--rtt-ms", "10"]);
    let err = t.fails(&["lab", "up"], 1);
    assert!(
        err.contains(&format!(
            "lab \"{}\" is already up (run `ferry lab down` first)",
            t.lab.name
        )),
        "{err}"
    );
    t.ok(&["lab", "down"]);
    assert!(t.namespaces().is_empty());
    let err = t.fails(&["lab", "down"], 1);
    assert!(err.contains("is not up; nothing to take down"), "{err}");
}

#[test]
fn out_of_range_link_is_refused_before_anything_is_made() {
    let t = TestLab::named("range");
    let err = t.fails(&["lab", "up", "--rate-mbit", "0"], 1);
    assert_eq!(
        err.trim(),
        "ferry: rate 0 Mbit/s is out of range; use 0.1 to 10000"
    );
    let err = t.fails(&["lab", "up", "--loss-pct", "150"], 1);
    assert_eq!(err.trim(), "ferry: loss 150% is out of range; use 0 to 100");
    assert!(
        t.namespaces().is_empty(),
        "a refused lab up left {:?}",
        t.namespaces()
    );
}

#[test]
fn unknown_vm_site_and_missing_qemu_are_named() {
    let t = TestLab::up("names", &["--rate-mbit", "1000", "--rtt-ms", "10"]);
    let err = t.fails(&["migrate", "nosuch", "--to", "b"], 1);
    assert!(
        err.contains(&format!(
            "unknown VM \"nosuch\" in lab \"{}\" (known: none)",
            t.lab.name
        )),
        "{err}"
    );
    let err = t.fails(&["vm", "start", "x", "--site", "c"], 1);
    assert!(err.contains("unknown site \"c\" (known: a, b)"), "{err}");
    let err = t.fails(&["migrate", "x", "--to", "b", "--mode", "turbo"], 1);
    assert!(
        err.contains("unknown QEMU migration mode \"turbo\""),
        "{err}"
    );
    let out = std::process::Command::new(common::ferry_bin())
        .args(["vm", "start", "x"])
        .env("FERRY_LAB", &t.lab.name)
        .env("FERRY_QEMU", "/nonexistent/qemu")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("QEMU not found: cannot run \"/nonexistent/qemu\""),
        "{err}"
    );
    assert!(
        ferry_lab::vm::list(&t.lab).unwrap().is_empty(),
        "a failed start left a VM record"
    );
}

#[test]
fn not_root_is_refused() {
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            common::ferry_bin(),
            "lab",
            "up",
        ])
        .env("FERRY_LAB", "ftnobody")
        .output()
        .expect("setpriv (util-linux)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the lab needs root"), "{err}");
}

/// Reads a process's user+system CPU time in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("relay process");
    let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after_comm.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn wan_emulator_delivers_configured_rtt_and_rate_without_busy_polling() {
    let t = TestLab::up("wan", &["--rate-mbit", "100", "--rtt-ms", "50"]);
    let relay = t.lab.state().unwrap().relay_pid;
    let idle_before = cpu_ticks(relay);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let idle_ticks = cpu_ticks(relay) - idle_before;
    assert!(
        idle_ticks <= 5,
        "an idle relay used {idle_ticks} ticks in 1 s: it is polling"
    );

    let before = cpu_ticks(relay);
    let start = std::time::Instant::now();
    let out = t.ok(&["lab", "check", "--seconds", "5", "--json"]);
    let wall = start.elapsed().as_secs_f64();
    let used = (cpu_ticks(relay) - before) as f64 / 100.0; // USER_HZ is 100 on Linux
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rtt = v["rtt_ms"].as_f64().unwrap();
    let mbit = v["throughput_mbit"].as_f64().unwrap();
    assert!(
        (49.0..=56.0).contains(&rtt),
        "RTT {rtt} ms for a 50 ms link"
    );
    // TCP goodput over a 1514-byte-frame link tops out near 95% of the line rate.
    assert!(
        (80.0..=100.0).contains(&mbit),
        "throughput {mbit} Mbit/s for a 100 Mbit/s link"
    );
    assert!(
        used / wall < 0.5,
        "the relay used {used:.2} s of CPU in {wall:.1} s at 100 Mbit/s"
    );

    // Bytes are counted in both directions, and the counters are what `lab status` shows.
    let status: serde_json::Value =
        serde_json::from_str(&t.ok(&["lab", "status", "--json"])).unwrap();
    let a_to_b = status["wan"]["a_to_b"]["bytes"].as_u64().unwrap();
    assert!(
        a_to_b > 5 * 80_000_000 / 8,
        "counted only {a_to_b} bytes a->b for 5 s of iperf3"
    );
    assert!(status["wan"]["b_to_a"]["bytes"].as_u64().unwrap() > 0);
}

#[test]
fn outage_stops_all_traffic_and_ends() {
    let t = TestLab::up("cut", &["--rate-mbit", "1000", "--rtt-ms", "10"]);
    t.ok(&["lab", "outage", "down"]);
    let ping = |n: &str| {
        std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &format!("{}-a", t.lab.name),
                "busybox",
                "ping",
                "-c",
                n,
                "-W",
                "1",
                "172.31.0.2",
            ])
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(!ping("2"), "ping crossed a WAN that is down");
    t.ok(&["lab", "outage", "up"]);
    assert!(ping("3"), "ping failed after the outage ended");
}

/// `virsh -c URI ARGS`; returns its output.
fn virsh(uri: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new("virsh")
        .arg("-c")
        .arg(uri)
        .args(args)
        .output()
        .expect("run virsh")
}

#[test]
fn lab_up_with_libvirt_runs_a_daemon_per_site_as_on_two_hosts() {
    use ferry_lab::Site;
    let t = TestLab::up(
        "lvd",
        &["--libvirt", "--rate-mbit", "1000", "--rtt-ms", "10"],
    );
    let img = ferry_lab::vm::ensure_image().unwrap();
    let xml = format!(
        "<domain type='qemu'><name>lv</name><memory unit='MiB'>96</memory><vcpu>1</vcpu>\
         <os><type arch='x86_64' machine='q35'>hvm</type><kernel>{}</kernel><initrd>{}</initrd>\
         <cmdline>console=ttyS0 quiet</cmdline></os><on_reboot>destroy</on_reboot>\
         <devices><serial type='unix'><source mode='bind' path='/run/ferry-host/lv.serial'/>\
         <target port='0'/></serial><interface type='bridge'><source bridge='br0'/>\
         <model type='virtio'/></interface></devices></domain>",
        img.kernel.display(),
        img.initrd.display()
    );
    let file = t.lab.dir().join("lv.xml");
    std::fs::write(&file, xml).unwrap();
    let (a, b) = (
        ferry_lab::libvirt::uri(&t.lab, Site::A),
        ferry_lab::libvirt::uri(&t.lab, Site::B),
    );
    for args in [&["define", &*file.to_string_lossy()][..], &["start", "lv"]] {
        let out = virsh(&a, args);
        assert!(out.status.success(), "virsh {args:?}: {out:?}");
    }
    let state = virsh(&a, &["domstate", "lv"]);
    assert_eq!(String::from_utf8_lossy(&state.stdout).trim(), "running");
    // Site b's daemon is another host's: it does not know the domain, and the guest's serial
    // socket is in site a's host directory only.
    let listed = virsh(&b, &["list", "--all", "--name"]);
    assert!(listed.status.success(), "{listed:?}");
    assert!(
        !String::from_utf8_lossy(&listed.stdout).contains("lv"),
        "{listed:?}"
    );
    assert!(t.lab.host_dir(Site::A).join("lv.serial").exists());
    assert!(!t.lab.host_dir(Site::B).join("lv.serial").exists());
}
