//! Any QEMU, through the agents: a VM its owner started by hand (its own command line, not
//! `ferry vm start`), moved with `ferry migrate --qmp`. Nothing is started at the destination
//! beforehand: the destination agent starts the VM from the source QEMU's own command line.
//! Both the CLI and the QEMUs run as processes of their site's host (their own view of
//! `/run/ferry-host`), so the VM's sockets have the same path at both ends, as on two hosts.
//! The guest's verifiers decide whether its memory and its disk (copied: no shared storage)
//! arrived intact.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use common::TestLab;
use ferry_lab::guest::{GuestLink, Heartbeats};
use ferry_lab::topology::{wait_until, HOST_DIR};
use ferry_lab::Site;
use ferry_qemu::{Accel, Boot, DiskSpec, NicSpec, VmSpec};

const FAST_LINK: &[&str] = &["--rate-mbit", "1000", "--rtt-ms", "10"];

/// The tiny guest as its owner would start it: a command line of their own, a QMP socket, a
/// NIC on a tap of the site's bridge.
fn bare_spec(name: &str) -> VmSpec {
    let img = ferry_lab::vm::ensure_image().expect("guest image (ferry image build)");
    let host = Path::new(HOST_DIR);
    VmSpec {
        name: name.to_owned(),
        mem_mib: 128,
        vcpus: 1,
        accel: if std::env::var("FERRY_ACCEL").as_deref() == Ok("kvm") {
            Accel::Kvm
        } else {
            Accel::Tcg
        },
        boot: Boot::Kernel {
            kernel: img.kernel.clone(),
            initrd: img.initrd.clone(),
            append: "console=ttyS0 quiet loglevel=1 panic=1 ferry_ip=10.77.0.90".into(),
        },
        disks: vec![DiskSpec {
            id: "disk0".into(),
            path: host.join(format!("{name}.qcow2")),
            format: "qcow2".into(),
        }],
        nics: vec![NicSpec {
            id: "net0".into(),
            tap: format!("{name}t"),
            mac: "52:54:00:77:00:5a".into(),
        }],
        qmp_socket: host.join(format!("{name}.qmp")),
        serial_socket: host.join(format!("{name}.serial")),
        serial_log: None,
        mem_file: None,
        incoming: None,
        paused: false,
        extra_args: vec![
            "-no-reboot".into(),
            "-daemonize".into(),
            "-pidfile".into(),
            host.join(format!("{name}.pid")).display().to_string(),
        ],
    }
}

fn qemu_img(args: &[&str]) {
    let out = std::process::Command::new("qemu-img")
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "qemu-img {args:?}: {}", text(&out));
}

/// The tap the VM's NIC needs, at `site` (a host's network setup, done by its owner).
fn make_tap(t: &TestLab, site: Site, tap: &str) {
    let ns = t.lab.site_ns(site);
    ferry_lab::sh::run_in(&ns, "ip", &["tuntap", "add", tap, "mode", "tap"]).unwrap();
    ferry_lab::sh::run_in(
        &ns,
        "ip",
        &["link", "set", "dev", tap, "master", "br0", "up"],
    )
    .unwrap();
}

/// `ferry ARGS` as a process of site a's host.
fn ferry_at_a(t: &TestLab, args: &[&str]) -> Output {
    t.lab
        .host_command(Site::A, common::ferry_bin())
        .args(args)
        .env("FERRY_LAB", &t.lab.name)
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn pid_of(t: &TestLab, site: Site, name: &str) -> u32 {
    let path = t.lab.host_dir(site).join(format!("{name}.pid"));
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The guest's memory and disk verifiers through its serial socket, seen from outside the site.
fn verify(rt: &tokio::runtime::Runtime, serial: PathBuf) -> (GuestLink, u64) {
    rt.block_on(async {
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        let v = ferry_lab::guest::verify(&link, true).await.unwrap();
        (link, v.errors())
    })
}

#[test]
fn a_qemu_started_by_hand_moves_with_migrate_qmp() {
    let t = TestLab::up("anyq", FAST_LINK);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = "bare1";
    let spec = bare_spec(name);
    for site in Site::ALL {
        make_tap(&t, site, &spec.nics[0].tap);
    }
    // The VM's disk: its owner's image at site a; at site b an empty one of the same size at
    // the same path, made after a first attempt without it.
    let img = ferry_lab::vm::ensure_image().unwrap();
    let disk_a = t.lab.host_dir(Site::A).join(format!("{name}.qcow2"));
    let disk_b = t.lab.host_dir(Site::B).join(format!("{name}.qcow2"));
    let data = img.data_disk.to_string_lossy().into_owned();
    qemu_img(&["convert", "-O", "qcow2", &data, &disk_a.to_string_lossy()]);
    let started = t
        .lab
        .host_command(Site::A, ferry_qemu::qemu_program())
        .args(spec.argv())
        .output()
        .unwrap();
    assert!(started.status.success(), "{}", text(&started));
    let source_pid = pid_of(&t, Site::A, name);
    let serial_a = t.lab.host_dir(Site::A).join(format!("{name}.serial"));
    let link = rt.block_on(async {
        let link = GuestLink::connect(&serial_a, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        link.wait_ready(Duration::from_secs(120)).await.unwrap();
        for cmd in [
            "mem start pattern=ws mib=32 rate=1",
            "disk start mib=8 rate=0.5",
        ] {
            link.call(cmd, Duration::from_secs(60)).await.unwrap();
        }
        link
    });
    let agent_a = t.lab.agent_socket(Site::A).display().to_string();
    let qmp = spec.qmp_socket.display().to_string();
    let migrate = |extra: &[&str]| {
        let mut args = vec![
            "migrate", name, "--qmp", &qmp, "--to", "site-b", "--agent", &agent_a, "--disk",
            "disk0",
        ];
        args.extend_from_slice(extra);
        ferry_at_a(&t, &args)
    };

    // A peer the agent does not know: refused before anything happens (bad usage: 2).
    let out = ferry_at_a(
        &t,
        &[
            "migrate", name, "--qmp", &qmp, "--to", "site-c", "--agent", &agent_a,
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "no peer \"site-c\" in this agent's config (known: site-b); add a [peers.site-c] section with its address"
        ),
        "{}",
        text(&out)
    );

    // A destination without the disk's storage: QEMU there names the image it lacks.
    let out = migrate(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("{HOST_DIR}/{name}.qcow2")),
        "{}",
        text(&out)
    );
    let size = std::fs::metadata(&img.data_disk).unwrap().len().to_string();
    qemu_img(&["create", "-f", "qcow2", &disk_b.to_string_lossy(), &size]);

    // A destination that cannot have the VM (its kernel is not on that host): QEMU's own
    // words come back, the source keeps running, nothing is left at the destination.
    let mut argv = vec![ferry_qemu::qemu_program()];
    let kernel = img.kernel.to_string_lossy().into_owned();
    argv.extend(
        spec.argv()
            .into_iter()
            .map(|a| a.replace(&kernel, "/nonexistent/vmlinuz")),
    );
    std::fs::write(t.lab.host_dir(Site::A).join("bad-argv"), argv.join("\n")).unwrap();
    let bad_argv = format!("{HOST_DIR}/bad-argv");
    let out = migrate(&["--destination-argv-file", &bad_argv]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the destination QEMU refused the VM's configuration")
            && err.contains("/nonexistent/vmlinuz"),
        "{}",
        text(&out)
    );
    let agent_b_dir = t.lab.dir().join("agent-b");
    let left: Vec<_> = std::fs::read_dir(&agent_b_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.starts_with("in-"))
        .collect();
    assert!(left.is_empty(), "left at the destination: {left:?}");
    let v = rt.block_on(ferry_lab::guest::verify(&link, true)).unwrap();
    assert_eq!(
        v.errors(),
        0,
        "the source guest's memory and disk after the failures"
    );

    // The move itself: nothing was started at site b; its agent starts the VM from the
    // source QEMU's command line, and the disk is copied into the image there.
    let out = migrate(&["--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let v = common::json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(v["outcome"]["completed"], true, "{v}");
    assert!(v["outcome"]["downtime_ms"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["outcome"]["disk"]["disks"], 1, "{v}");
    let tl = common::timeline(&v);
    let kinds: Vec<_> = tl.events.iter().map(|e| e.kind).collect();
    for kind in [
        ferry_api::EventKind::DiskCopyStarted,
        ferry_api::EventKind::SourceStopped,
        ferry_api::EventKind::DestinationResumed,
    ] {
        assert!(kinds.contains(&kind), "{kind:?} missing: {kinds:?}");
    }
    drop(link);
    // The source QEMU was quit; the VM runs at site b, its memory and disk intact.
    wait_until(Duration::from_secs(10), || {
        !Path::new(&format!("/proc/{source_pid}")).exists()
    })
    .expect("the source QEMU is gone");
    let (_link_b, errors) = verify(&rt, t.lab.host_dir(Site::B).join(format!("{name}.serial")));
    assert_eq!(errors, 0, "the guest's memory and disk at the destination");

    // The agent shows every attempt.
    let out = ferry_at_a(&t, &["migrations", "--agent", &agent_a]);
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.lines().filter(|l| l.contains(name)).count() == 3
            && list.contains(" failed ")
            && list.contains(" committed "),
        "{list}"
    );
}
