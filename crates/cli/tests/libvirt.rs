//! libvirt-managed VMs through the agents: each lab site runs its own libvirtd (`lab up
//! --libvirt`). A user's own `virsh migrate --live --p2p` with UNIX-socket URIs pointing at the
//! source agent's tunnels moves a domain across the WAN unchanged, and `ferry migrate
//! --libvirt` drives the same migration itself, disks included. The guest's verifiers decide
//! whether its memory and disk arrived intact; the WAN emulator's counters show the stream
//! crossed it.

mod common;

use std::time::Duration;

use common::domains::{start_domain, verify};
use common::TestLab;
use ferry_lab::Site;

const FAST_LINK: &[&str] = &["--libvirt", "--rate-mbit", "1000", "--rtt-ms", "10"];

/// Site a's agent's latest migration of `name`, which must have committed under a stream
/// digest.
fn committed_at_a(t: &TestLab, name: &str) -> serde_json::Value {
    committed_at(t, Site::A, name)
}

/// The latest migration of `name` at `site`'s agent, which must have committed under a stream
/// digest.
fn committed_at(t: &TestLab, site: Site, name: &str) -> serde_json::Value {
    let all = t.migrations(site);
    let m = all
        .iter()
        .rev()
        .find(|m| m["vm"] == name)
        .unwrap_or_else(|| panic!("{name} not among the agent's migrations: {all:?}"))
        .clone();
    assert_eq!(m["state"], "committed", "{m}");
    assert!(m["digest"].as_str().is_some_and(|d| d.len() == 64), "{m}");
    m
}

/// After a refused or failed migration (`err`, what the user saw): domain `name` still runs
/// at site a and site b's libvirt has no trace of it.
fn stayed_at_a(t: &TestLab, name: &str, err: &str) {
    assert_eq!(
        t.domstate(Site::A, name).as_deref(),
        Some("running"),
        "{err}"
    );
    assert_eq!(t.domstate(Site::B, name), None, "{err}");
}

fn wan_bytes(t: &TestLab) -> u64 {
    ferry_lab::wan::stats(&t.lab.wan_socket())
        .unwrap()
        .total_bytes()
}

#[test]
fn virsh_migrate_with_unix_sockets_goes_through_the_agents() {
    let t = TestLab::up("lvm", FAST_LINK);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = "lv1";
    let link = start_domain(
        &t,
        &rt,
        (name, 92, false, ""),
        &["mem start pattern=ws mib=32 rate=1"],
    );
    let wan_before = wan_bytes(&t);

    // The user's own command: only the URIs name ferry's agent.
    let tunnels = "/run/ferry-host/tunnels/site-b";
    common::succeeded(
        "virsh",
        &t.virsh(
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
        ),
    );
    drop(link);

    // The domain runs at site b and not at site a; its memory arrived intact.
    assert_eq!(t.domstate(Site::B, name).as_deref(), Some("running"));
    assert_ne!(t.domstate(Site::A, name).as_deref(), Some("running"));
    assert_eq!(
        verify(&t, &rt, Site::B, name, false),
        0,
        "the guest's memory at site b"
    );
    // It crossed the WAN: at least the guest's 32 MiB working set.
    let wan = wan_bytes(&t) - wan_before;
    assert!(wan > 32 << 20, "only {wan} bytes crossed the WAN");

    // The source agent lists it, named after the domain: QEMU's stream crossed coded and was
    // fed to the destination QEMU under matching digests.
    let m = committed_at_a(&t, name);
    let codec = &m["codec"];
    assert!(
        codec["pages"].as_u64().unwrap() > 8192,
        "the guest's pages went through the codec: {m}"
    );
    let stream = m["stream_bytes"].as_u64().unwrap();
    assert!(stream > 32 << 20, "QEMU's stream was {stream} bytes: {m}");

    // Once libvirt finished at site b, its own figures for the job, the real pause among
    // them, read from there: as for a migration ferry drives.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let m = loop {
        let m = committed_at_a(&t, name);
        if m["source_stop_unix_us"].is_i64() || std::time::Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let pause_us = m["destination_resume_unix_us"]
        .as_i64()
        .expect("libvirt's figures")
        - m["source_stop_unix_us"]
            .as_i64()
            .expect("libvirt's figures");
    assert!(pause_us > 0 && pause_us < 10_000_000, "{m}");
    assert!(m["qemu"]["transferred"].as_u64().unwrap() > 32 << 20, "{m}");

    // And back with libvirt's `--parallel`: QEMU's pages go on two multifd channels beside the
    // main stream, each coded and digest-gated through the agents.
    let tunnels = "/run/ferry-host/tunnels/site-a";
    common::succeeded(
        "virsh",
        &t.virsh(
            Site::B,
            &[
                "migrate",
                "--live",
                "--p2p",
                "--parallel",
                "--parallel-connections",
                "2",
                name,
                "--desturi",
                &format!("qemu+unix:///system?socket={tunnels}/rpc.sock"),
                "--migrateuri",
                &format!("unix://{tunnels}/mig.sock"),
            ],
        ),
    );
    assert_eq!(t.domstate(Site::A, name).as_deref(), Some("running"));
    assert_eq!(
        verify(&t, &rt, Site::A, name, false),
        0,
        "the guest's memory back at site a"
    );
    assert_channels_coded(&t, Site::B, name, 2);
}

/// The latest migration of `name` at `site` carried QEMU's pages on `channels` multifd
/// channels, each coded (fewer bytes on the WAN than QEMU wrote) and with its own digest, and
/// its main stream carried none. Each channel adds its figures to the main stream's migration
/// once the destination said its QEMU read all of it, so they may come after the commit.
fn assert_channels_coded(t: &TestLab, site: Site, name: &str, channels: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let m = loop {
        let m = committed_at(t, site, name);
        let ended = m["multifd"].as_array().map_or(0, Vec::len);
        if ended == channels || std::time::Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let listed = m["multifd"].as_array().expect("multifd channels");
    assert_eq!(listed.len(), channels, "{m}");
    let mut ids: Vec<u64> = listed.iter().map(|c| c["id"].as_u64().unwrap()).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..channels as u64).collect::<Vec<_>>(), "{m}");
    let pages: u64 = listed
        .iter()
        .map(|c| c["codec"]["pages"].as_u64().unwrap())
        .sum();
    assert!(
        pages > 8192,
        "the guest's pages went through the codec on the channels: {m}"
    );
    for c in listed {
        assert!(c["digest"].as_str().is_some_and(|d| d.len() == 64), "{c}");
        let (qemu, wire) = (
            c["stream_bytes"].as_u64().unwrap(),
            c["wire_bytes"].as_u64().unwrap(),
        );
        assert!(wire < qemu, "a channel crossed uncompressed: {c}");
    }
    // The main stream carried the devices and markers, not the pages.
    assert_eq!(m["codec"]["pages"], 0, "{m}");
}

#[test]
fn ferry_migrate_libvirt_moves_a_domain_and_its_disk() {
    let t = TestLab::up("lvf", FAST_LINK);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = "lv2";
    // The domain's disk at site a; site b's comes after the attempt without it.
    let size = common::domains::make_disk(&t, name, false);
    let link = start_domain(
        &t,
        &rt,
        (name, 93, true, ""),
        // The guest keeps writing its disk in 4 KiB blocks all along: libvirt's mirror writes
        // into the source agent's disk relay, which completes them there, so the copy goes at
        // the link's rate and converges (carried as it is, each write waited a round trip and
        // the copy never caught up with this writer).
        &[
            "mem start pattern=ws mib=32 rate=1",
            "disk start mib=8 rate=0.5",
        ],
    );
    let agent_a = t.lab.agent_socket(Site::A);
    let ferry = |args: &[&str]| {
        t.lab
            .host_command(Site::A, common::ferry_bin())
            .args(args)
            .arg("--agent")
            .arg(&agent_a)
            .output()
            .unwrap()
    };

    // Bad input: each refused with one message naming it, nothing started.
    let out = ferry(&["migrate", "--libvirt", "nope", "--to", "site-b"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no domain \"nope\""),
        "{err}"
    );
    let out = ferry(&["migrate", "--libvirt", name, "--to", "site-x"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("site-x"), "{err}");
    // Settings libvirt's migration cannot take, each refused in the agent's words.
    for (flags, says) in [
        (
            ["--parallel", "0"],
            "parallel: 0 channels; QEMU takes 1 to 255",
        ),
        (
            ["--disk-pacing-floor-pct", "50"],
            "disk_pacing_floor_pct paces a disk copy",
        ),
    ] {
        let mut args = vec!["migrate", "--libvirt", name, "--to", "site-b"];
        args.extend(flags);
        let out = ferry(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{err}");
    }

    // A destination without the disk's storage: libvirt's own words name it, the domain keeps
    // running at site a and nothing is defined at site b.
    let out = ferry(&[
        "migrate",
        "--libvirt",
        name,
        "--to",
        "site-b",
        "--copy-storage",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains(&format!("{name}.qcow2")), "{err}");
    stayed_at_a(&t, name, &err);
    common::domains::empty_disk_at_b(&t, name, size);

    // A destination whose libvirt is down: refused before anything starts, naming it.
    ferry_lab::libvirt::stop_libvirtd(&t.lab, Site::B).unwrap();
    let out = ferry(&[
        "migrate",
        "--libvirt",
        name,
        "--to",
        "site-b",
        "--copy-storage",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("the libvirt of site-b does not answer")
            && err.contains("is libvirtd running?"),
        "{err}"
    );
    ferry_lab::libvirt::start(&t.lab, Site::B).unwrap();
    stayed_at_a(&t, name, &err);

    // A multifd channel corrupted on its way (with two channels the main stream carries no
    // pages and stays short of the byte): the destination's digest check refuses it, libvirt's
    // migration fails, the domain keeps running at site a and nothing is left at site b.
    let out = ferry(&[
        "migrate",
        "--libvirt",
        name,
        "--to",
        "site-b",
        "--copy-storage",
        "--parallel",
        "2",
        "--test-corrupt-at",
        "3000000",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    // libvirt saw its connection close; the agents say why.
    assert!(
        err.contains("a multifd channel") && err.contains("digest mismatch"),
        "{err}"
    );
    stayed_at_a(&t, name, &err);
    // (through the link the test holds: a serial socket takes one client)
    let errors = rt.block_on(async { ferry_lab::guest::verify(&link, true).await.unwrap() });
    assert_eq!(errors.errors(), 0, "the source after the failed attempt");

    // The real move, disk copied, memory on two multifd channels: the domain runs at site b,
    // defined there, gone from site a.
    let wan_before = wan_bytes(&t);
    let out = ferry(&[
        "migrate",
        "--libvirt",
        name,
        "--to",
        "site-b",
        "--copy-storage",
        "--parallel",
        "2",
        "--json",
    ]);
    let v = common::json(&String::from_utf8_lossy(&out.stdout));
    assert!(
        out.status.success(),
        "{v}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(link);
    assert_eq!(v["outcome"]["completed"], true, "{v}");
    // How many connections QEMU's stream kept across the WAN, and why, as on ferry's path.
    assert_eq!(v["outcome"]["connections"], 1, "{v}");
    assert!(
        v["outcome"]["connections_why"]
            .as_str()
            .is_some_and(|why| why.contains("holds a 1000 Mbit/s link")),
        "{v}"
    );
    // libvirt's real pause (its stop at site a to its resume at site b), read at site b.
    let pause = v["outcome"]["downtime_ms"].as_f64().expect("the pause");
    assert!(pause > 0.0 && pause < 10_000.0, "{v}");
    assert_eq!(t.domstate(Site::B, name).as_deref(), Some("running"));
    assert_eq!(t.domstate(Site::A, name), None, "undefined at the source");
    let info = common::succeeded("virsh", &t.virsh(Site::B, &["dominfo", name]));
    assert!(
        info.lines()
            .any(|l| l.starts_with("Persistent:") && l.ends_with("yes")),
        "{info}"
    );
    assert_eq!(
        verify(&t, &rt, Site::B, name, true),
        0,
        "memory and disk at site b"
    );
    let wan = wan_bytes(&t) - wan_before;
    assert!(wan > 32 << 20, "only {wan} bytes crossed the WAN");
    assert_channels_coded(&t, Site::A, name, 2);
    // The disk crossed through the relay, coded: the guest's data and the image's zeroes.
    let disk = &v["outcome"]["disk"];
    assert_eq!(disk["disks"], 1, "{v}");
    let written = disk["written_bytes"].as_u64().unwrap();
    assert!(written >= 8 << 20, "{v}");
    assert!(disk["frame_bytes"].as_u64().unwrap() > 0, "{v}");
    // What the image held as the domain left is kept at site a, for its return.
    let kept_at = |site: Site| {
        ferry_lab::agents::seed_dir(&t.lab, site)
            .join("disks")
            .join(name)
            .join("drive-virtio-disk0.idx")
    };
    assert!(kept_at(Site::A).exists(), "no index kept at site a: {v}");
    let kept_event = common::timeline(&v)
        .events
        .into_iter()
        .find(|e| e.detail.contains("is kept here for the domain's return"));
    eprintln!("kept at site a: {kept_event:?}");
    assert!(kept_event.is_some(), "{v}");

    // Back to site a, driven by site b's agent: libvirt reuses the image the domain left at
    // site a, untouched since, so site a's agent sends the index it kept instead of reading
    // the image. The blocks it still holds cross as SAME; the guest's verifiers (memory, and
    // the disk its writer kept writing) find them intact. The copy is paced by the guest's IO
    // (its writer's 128 writes a second are enough to judge): the relay holds QEMU's bulk
    // copy until it has looked at the guest, then takes it at the pacer's speed.
    let v = moved(
        &t,
        &rt,
        name,
        (Site::B, Site::A),
        &["--copy-storage", "--disk-pacing-floor-pct", "50"],
    );
    let disk = &v["outcome"]["disk"];
    eprintln!("the return's disk report: {disk}");
    assert_eq!(disk["older_copy"], "remembered", "{v}");
    assert!(disk["index_ms"].as_u64().is_some(), "{v}");
    assert!(
        disk["paced_ms"].is_u64(),
        "the pacer never judged the guest: {v}"
    );
    let same = disk["same_bytes"].as_u64().unwrap();
    assert!(
        same >= size / 2,
        "only {same} of {size} bytes went as SAME: {v}"
    );
    assert!(!kept_at(Site::A).exists(), "a kept index is used once");
    assert!(kept_at(Site::B).exists(), "no index kept at site b: {v}");

    // To site b again, whose image was written after the domain left it (its mtime, as any
    // write leaves it): the kept index cannot stand for it, site b's agent indexes the image
    // and the report says why.
    let image_b = t.lab.host_dir(Site::B).join(format!("{name}.qcow2"));
    let file = std::fs::File::options().write(true).open(&image_b).unwrap();
    file.set_modified(std::time::SystemTime::now()).unwrap();
    drop(file);
    let v = moved(&t, &rt, name, (Site::A, Site::B), &["--copy-storage"]);
    let disk = &v["outcome"]["disk"];
    assert_eq!(disk["older_copy"], "index", "{v}");
    let note = disk["older_copy_note"].as_str().unwrap_or_default();
    assert!(
        note.contains("changed after the domain left") && note.contains("was written"),
        "{v}"
    );
    let same = disk["same_bytes"].as_u64().unwrap();
    assert!(
        same >= size / 2,
        "only {same} of {size} bytes went as SAME: {v}"
    );
}

/// `ferry migrate --libvirt NAME --to TO ARGS --json` run at `from` through its agent, which
/// must move the domain: running at `to`, gone from `from`, its memory and disk intact there.
/// Returns the JSON it printed.
fn moved(
    t: &TestLab,
    rt: &tokio::runtime::Runtime,
    name: &str,
    (from, to): (Site, Site),
    args: &[&str],
) -> serde_json::Value {
    let out = t
        .lab
        .host_command(from, common::ferry_bin())
        .args(["migrate", "--libvirt", name, "--to"])
        .arg(format!("site-{}", to.name()))
        .args(args)
        .args(["--json", "--agent"])
        .arg(t.lab.agent_socket(from))
        .output()
        .unwrap();
    let v = common::json(&String::from_utf8_lossy(&out.stdout));
    assert!(
        out.status.success(),
        "{v}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(t.domstate(to, name).as_deref(), Some("running"), "{v}");
    assert_eq!(t.domstate(from, name), None, "undefined at the source");
    assert_eq!(
        verify(t, rt, to, name, true),
        0,
        "memory and disk at {to:?}"
    );
    v
}

/// The persistent dirty bitmaps QEMU holds for domain `name` at `site`, as (node, bitmap name,
/// granularity, recording), read through libvirt's monitor passthrough (a test's look, not
/// what ferry does).
fn dirty_bitmaps(t: &TestLab, site: Site, name: &str) -> Vec<(String, String, u64, bool)> {
    let out = t.virsh(
        site,
        &[
            "qemu-monitor-command",
            name,
            r#"{"execute":"query-named-block-nodes","arguments":{"flat":true}}"#,
        ],
    );
    let v = common::json(&common::succeeded("virsh", &out));
    let mut found = Vec::new();
    for node in v["return"].as_array().expect("a list of nodes") {
        for b in node["dirty-bitmaps"].as_array().into_iter().flatten() {
            if b["persistent"] == true {
                found.push((
                    node["node-name"].as_str().unwrap_or_default().to_owned(),
                    b["name"].as_str().unwrap_or_default().to_owned(),
                    b["granularity"].as_u64().unwrap_or_default(),
                    b["recording"] == true,
                ));
            }
        }
    }
    found
}

/// A disk with a checkpoint (a persistent dirty bitmap in its qcow2, what backup tools keep
/// for incremental backups): libvirt carries the bitmap in QEMU's "dirty-bitmap" section of
/// the migration stream, which ferry passes through; the domain and its bitmap arrive.
#[test]
fn a_domain_whose_disk_has_a_checkpoint_moves_with_its_bitmap() {
    let t = TestLab::up("lvc", FAST_LINK);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = "lv6";
    common::domains::make_disk(&t, name, true);
    let link = start_domain(
        &t,
        &rt,
        (name, 96, true, ""),
        &["disk start mib=8 rate=0.5"],
    );
    common::succeeded(
        "virsh",
        &t.virsh(
            Site::A,
            &[
                "checkpoint-create-as",
                name,
                "c1",
                "--diskspec",
                "vda,checkpoint=bitmap",
            ],
        ),
    );
    let before = dirty_bitmaps(&t, Site::A, name);
    assert!(
        before
            .iter()
            .any(|(_, b, _, recording)| b == "c1" && *recording),
        "{before:?}"
    );
    drop(link);

    moved(&t, &rt, name, (Site::A, Site::B), &["--copy-storage"]);
    let after = dirty_bitmaps(&t, Site::B, name);
    // The same bitmap, still recording the guest's writes for the next backup.
    let c1 = |v: &[(String, String, u64, bool)]| {
        v.iter()
            .find(|(_, b, _, _)| b == "c1")
            .map(|(_, _, g, recording)| (*g, *recording))
    };
    assert!(
        c1(&after).is_some() && c1(&after) == c1(&before),
        "the bitmap at site b: {after:?}, at site a before: {before:?}"
    );
    committed_at_a(&t, name);
}

#[test]
fn a_domain_with_a_device_the_destination_lacks_stays_at_the_source() {
    let t = TestLab::up("lvd", FAST_LINK);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = "lv3";
    // A second NIC on a bridge only site a has.
    let nic = common::domains::nic_only_at_site_a(&t);
    let link = start_domain(&t, &rt, (name, 94, false, nic), &[]);
    let out = t
        .lab
        .host_command(Site::A, common::ferry_bin())
        .args(["migrate", "--libvirt", name, "--to", "site-b", "--agent"])
        .arg(t.lab.agent_socket(Site::A))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // libvirt's own words name the device; the domain runs on at site a, nothing at site b.
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("br-only-a"), "{err}");
    stayed_at_a(&t, name, &err);
    let errors = rt.block_on(async { ferry_lab::guest::verify(&link, false).await.unwrap() });
    assert_eq!(errors.errors(), 0, "the source after the failed attempt");
    let failed = t.migrations(Site::A);
    let m = failed.iter().find(|m| m["vm"] == name).expect("listed");
    assert_eq!(m["state"], "failed", "{m}");
}

/// A lab (`lab_name`) on a 200 Mbit/s, 20 ms link with a running domain `name` whose guest
/// rewrites 32 MiB of its memory: the agents' restart tests' setting.
fn lab_with_a_busy_domain(lab_name: &str, name: &str) -> (TestLab, tokio::runtime::Runtime) {
    let t = TestLab::up(
        lab_name,
        &["--libvirt", "--rate-mbit", "200", "--rtt-ms", "20"],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let link = start_domain(
        &t,
        &rt,
        (name, 95, false, ""),
        &["mem start pattern=ws mib=32 rate=1"],
    );
    drop(link);
    (t, rt)
}

/// `ferry migrate --libvirt name --to site-b` started at site a, its output piped.
fn spawn_migrate_to_b(t: &TestLab, name: &str) -> std::process::Child {
    t.lab
        .host_command(Site::A, common::ferry_bin())
        .args(["migrate", "--libvirt", name, "--to", "site-b", "--agent"])
        .arg(t.lab.agent_socket(Site::A))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Either agent killed while libvirt's migration flows, and started again: libvirt's job
/// fails on the closed tunnel, libvirt resumes the domain at site a and removes what it had
/// at site b (its own job state decides; the agents keep no record of libvirt's migrations),
/// and the next attempt commits.
#[test]
fn agents_restarted_during_a_libvirt_migration_leave_the_domain_at_the_source() {
    let name = "lv4";
    let (t, rt) = lab_with_a_busy_domain("lvr", name);
    let ferry = std::path::Path::new(common::ferry_bin());
    let migrate = || spawn_migrate_to_b(&t, name);
    let until_memory_flows = || {
        let flowing = ferry_lab::topology::wait_until(Duration::from_secs(120), || {
            t.migrations(Site::A)
                .iter()
                .any(|m| m["vm"] == name && m["state"] == "running" && m["phase"] == "memory")
        });
        assert!(flowing.is_ok(), "the memory never flowed");
    };
    let back_at_a = |what: &str| {
        let settled = ferry_lab::topology::wait_until(Duration::from_secs(120), || {
            t.domstate(Site::A, name).as_deref() == Some("running")
                && t.domstate(Site::B, name).is_none()
        });
        assert!(
            settled.is_ok(),
            "{what}: at a {:?}, at b {:?}",
            t.domstate(Site::A, name),
            t.domstate(Site::B, name)
        );
        assert_eq!(verify(&t, &rt, Site::A, name, false), 0, "{what}");
    };
    for site in [Site::A, Site::B] {
        let child = migrate();
        until_memory_flows();
        ferry_lab::agents::kill(&t.lab, site).unwrap();
        ferry_lab::agents::restart(&t.lab, site, ferry).unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{err}");
        // The command follows its agent across the restart and says what became of it.
        let said = match site {
            Site::A => "the agent no longer knows migration",
            Site::B => "libvirt: ",
        };
        assert!(err.contains(said), "{site:?}: {err}");
        back_at_a(&format!("the agent of {site:?} restarted: {err}"));
    }
    let out = migrate().wait_with_output().unwrap();
    assert!(out.status.success(), "{}", common::text(&out));
    assert_eq!(t.domstate(Site::B, name).as_deref(), Some("running"));
    assert_eq!(verify(&t, &rt, Site::B, name, false), 0, "at site b");
}

/// Site a's agent's failed migration of `name`, and its error.
fn failed_at_a(t: &TestLab, name: &str) -> (Option<serde_json::Value>, Option<String>) {
    let failed = t
        .migrations(Site::A)
        .into_iter()
        .find(|m| m["vm"] == name && m["state"] == "failed");
    let error = failed
        .as_ref()
        .and_then(|m| m["error"].as_str().map(str::to_owned));
    (failed, error)
}

/// The source agent killed once QEMU's stream ended, and started again: libvirt's Finish call
/// crosses the RPC tunnel, and once it is cut libvirt's source takes the migration for failed
/// and resumes its copy, although the destination may have resumed the domain already (it
/// had, every time this was tried). The restarted agent finds the stream's record, sees the
/// domain at both ends and pauses the copy at the source: the VM runs once, its memory intact,
/// and the agent lists what it did.
#[test]
fn a_source_agent_restarted_after_the_stream_ended_leaves_the_domain_running_once() {
    let name = "lv5";
    let (t, rt) = lab_with_a_busy_domain("lvf", name);
    let child = spawn_migrate_to_b(&t, name);
    // The stream's end went out: the destination may resume the domain from here on.
    let ended = ferry_lab::topology::wait_until(Duration::from_secs(120), || {
        t.migrations(Site::A)
            .iter()
            .any(|m| m["vm"] == name && m["phase"] == "awaiting-commit")
    });
    assert!(ended.is_ok(), "the stream never ended");
    ferry_lab::agents::kill(&t.lab, Site::A).unwrap();
    let ferry = std::path::Path::new(common::ferry_bin());
    ferry_lab::agents::restart(&t.lab, Site::A, ferry).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", common::text(&out));
    // Settled: running at exactly one end, the other's copy paused or gone.
    let once = |a: Option<&str>, b: Option<&str>| {
        matches!(
            (a, b),
            (Some("running"), None | Some("shut off")) | (Some("paused") | None, Some("running"))
        )
    };
    let settled = ferry_lab::topology::wait_until(Duration::from_secs(180), || {
        once(
            t.domstate(Site::A, name).as_deref(),
            t.domstate(Site::B, name).as_deref(),
        )
    });
    let (a, b) = (t.domstate(Site::A, name), t.domstate(Site::B, name));
    assert!(settled.is_ok(), "at a {a:?}, at b {b:?}");
    if b.as_deref() == Some("running") {
        assert_eq!(verify(&t, &rt, Site::B, name, false), 0, "at site b");
        let (fenced, error) = failed_at_a(&t, name);
        assert!(
            a.is_none() || error.is_some_and(|e| e.contains("ran at both ends")),
            "at a {a:?}: {fenced:?}"
        );
    } else {
        assert_eq!(verify(&t, &rt, Site::A, name, false), 0, "at site a");
    }
}

/// The destination agent lost after libvirt's Finish resumed the domain at site b, before its
/// answer reached site a: on a 1 s round trip the answer is still on its way when the domain
/// runs there, and it is cut (the WAN down, its connections reset) while site b's agent is
/// killed and started again. libvirt's source takes the migration for failed and resumes its
/// copy; the source agent, running all along, watches the domain since the stream's end, finds
/// it at both ends and pauses the copy at site a.
#[test]
fn a_destination_agent_lost_after_libvirt_resumed_the_domain_there_leaves_it_running_once() {
    let name = "lv6";
    let (t, rt) = lab_with_a_busy_domain("lvd", name);
    let mut child = spawn_migrate_to_b(&t, name);
    // Once memory flows (the agents' tunnels and libvirt's connection are up), every answer
    // across the WAN takes 0.5 s to arrive.
    let flowing = ferry_lab::topology::wait_until(Duration::from_secs(120), || {
        t.migrations(Site::A)
            .iter()
            .any(|m| m["vm"] == name && m["phase"] == "memory")
    });
    assert!(flowing.is_ok(), "memory never flowed");
    t.ok(&["lab", "set", "--rate-mbit", "200", "--rtt-ms", "1000"]);
    let resumed = ferry_lab::topology::wait_until(Duration::from_secs(300), || {
        t.domstate(Site::B, name).as_deref() == Some("running")
            || child.try_wait().unwrap().is_some()
    });
    assert!(
        resumed.is_ok() && child.try_wait().unwrap().is_none(),
        "the domain never ran at site b: {:?}, {}",
        t.migrations(Site::A),
        child
            .try_wait()
            .unwrap()
            .map(|_| common::text(&child.wait_with_output().unwrap()))
            .unwrap_or_default()
    );
    t.ok(&["lab", "outage", "down"]);
    t.ok(&["lab", "outage", "reset"]);
    ferry_lab::agents::kill(&t.lab, Site::B).unwrap();
    let ferry = std::path::Path::new(common::ferry_bin());
    ferry_lab::agents::restart(&t.lab, Site::B, ferry).unwrap();
    t.ok(&["lab", "set", "--rate-mbit", "200", "--rtt-ms", "20"]);
    t.ok(&["lab", "outage", "up"]);
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", common::text(&out));
    let fenced = ferry_lab::topology::wait_until(Duration::from_secs(180), || {
        t.domstate(Site::A, name).as_deref() == Some("paused")
    });
    let (a, b) = (t.domstate(Site::A, name), t.domstate(Site::B, name));
    assert!(
        fenced.is_ok(),
        "at a {a:?}, at b {b:?}: {:?}",
        t.migrations(Site::A)
    );
    assert_eq!(b.as_deref(), Some("running"), "at a {a:?}");
    assert_eq!(verify(&t, &rt, Site::B, name, false), 0, "at site b");
    let (failed, error) = failed_at_a(&t, name);
    assert!(
        error.is_some_and(|e| e.contains("ran at both ends")),
        "{failed:?}"
    );
}
