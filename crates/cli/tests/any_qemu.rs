//! Any QEMU, through the agents: a VM its owner started by hand (its own command line, not
//! `ferry vm start`), moved with `ferry migrate --qmp`. Nothing is started at the destination
//! beforehand: the destination agent starts the VM from the source QEMU's own command line.
//! Both the CLI and the QEMUs run as processes of their site's host (their own view of
//! `/run/ferry-host`), so the VM's sockets have the same path at both ends, as on two hosts.
//! The guest's verifier decides whether the memory arrived intact.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use common::TestLab;
use ferry_lab::guest::{GuestLink, Heartbeats};
use ferry_lab::topology::{wait_until, HOST_DIR};
use ferry_lab::Site;
use ferry_qemu::{Accel, Boot, NicSpec, VmSpec};

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
        disks: Vec::new(),
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

/// The guest's memory verifier through its serial socket, seen from outside the site.
fn verify(rt: &tokio::runtime::Runtime, serial: PathBuf) -> (GuestLink, u64) {
    rt.block_on(async {
        let link = GuestLink::connect(&serial, Arc::new(Heartbeats::default()))
            .await
            .unwrap();
        let v = ferry_lab::guest::verify(&link, false).await.unwrap();
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
        link.call(
            "mem start pattern=ws mib=32 rate=1",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        link
    });
    let agent_a = t.lab.agent_socket(Site::A).display().to_string();
    let qmp = spec.qmp_socket.display().to_string();

    // A peer the agent does not know: refused before anything happens.
    let out = ferry_at_a(
        &t,
        &[
            "migrate", name, "--qmp", &qmp, "--to", "site-c", "--agent", &agent_a,
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "no peer \"site-c\" in this agent's config (known: site-b); add a [peers.site-c] section with its address"
        ),
        "{}",
        text(&out)
    );

    // A destination that cannot have the VM (its kernel is not on that host): QEMU's own
    // words come back, the source keeps running, nothing is left at the destination.
    let mut argv = vec![ferry_qemu::qemu_program()];
    argv.extend(spec.argv().into_iter().map(|a| {
        a.replace(
            &*ferry_lab::vm::ensure_image()
                .unwrap()
                .kernel
                .to_string_lossy(),
            "/nonexistent/vmlinuz",
        )
    }));
    std::fs::write(t.lab.host_dir(Site::A).join("bad-argv"), argv.join("\n")).unwrap();
    let bad_argv = format!("{HOST_DIR}/bad-argv");
    let out = ferry_at_a(
        &t,
        &[
            "migrate",
            name,
            "--qmp",
            &qmp,
            "--to",
            "site-b",
            "--agent",
            &agent_a,
            "--destination-argv-file",
            &bad_argv,
        ],
    );
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
    let v = rt.block_on(ferry_lab::guest::verify(&link, false)).unwrap();
    assert_eq!(v.errors(), 0, "the source guest's memory after the failure");

    // The move itself: nothing was started at site b; its agent starts the VM from the
    // source QEMU's command line.
    let out = ferry_at_a(
        &t,
        &[
            "migrate", name, "--qmp", &qmp, "--to", "site-b", "--agent", &agent_a, "--json",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let v = common::json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(v["outcome"]["completed"], true, "{v}");
    assert!(v["outcome"]["downtime_ms"].as_f64().unwrap() > 0.0, "{v}");
    let tl = common::timeline(&v);
    let kinds: Vec<_> = tl.events.iter().map(|e| e.kind).collect();
    assert!(
        kinds.contains(&ferry_api::EventKind::SourceStopped)
            && kinds.contains(&ferry_api::EventKind::DestinationResumed),
        "{kinds:?}"
    );
    drop(link);
    // The source QEMU was quit; the VM runs at site b, its memory intact.
    wait_until(Duration::from_secs(10), || {
        !Path::new(&format!("/proc/{source_pid}")).exists()
    })
    .expect("the source QEMU is gone");
    let (_link_b, errors) = verify(&rt, t.lab.host_dir(Site::B).join(format!("{name}.serial")));
    assert_eq!(errors, 0, "the guest's memory at the destination");

    // The agent shows both attempts.
    let out = ferry_at_a(&t, &["migrations", "--agent", &agent_a]);
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.lines().filter(|l| l.contains(name)).count() == 2
            && list.contains(" failed ")
            && list.contains(" committed "),
        "{list}"
    );
}
