//! Any QEMU, through the agents: a VM its owner started by hand (its own command line, not
//! `ferry vm start`), moved with `ferry migrate --qmp`. Nothing is started at the destination
//! beforehand: the destination agent starts the VM from the source QEMU's own command line.
//! Both the CLI and the QEMUs run as processes of their site's host (their own view of
//! `/run/ferry-host`), so the VM's sockets have the same path at both ends, as on two hosts.
//! The guest's verifiers decide whether its memory and its disk (copied: no shared storage)
//! arrived intact. The disk is three images deep, as a template's would be, and the
//! destination holds only the lowest: the middle one crosses first, then only the overlay.

mod common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::{bare, text, TestLab};
use ferry_lab::topology::{wait_until, HOST_DIR};
use ferry_lab::Site;

const FAST_LINK: &[&str] = &["--rate-mbit", "1000", "--rtt-ms", "10"];

/// `ferry ARGS` as a process of site a's host.
fn ferry_at_a(t: &TestLab, args: &[&str]) -> Output {
    t.lab
        .host_command(Site::A, common::ferry_bin())
        .args(args)
        .env("FERRY_LAB", &t.lab.name)
        .output()
        .unwrap()
}

#[test]
fn a_qemu_started_by_hand_moves_with_migrate_qmp() {
    let t = TestLab::up("anyq", FAST_LINK);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = "bare1";
    // Its monitor outside the agent's `[qemu] qmp_dir`: `--qmp` names it.
    let spec = bare::spec(name, Path::new(HOST_DIR).join(format!("{name}.qmp")), 90);
    // The VM's disk: its owner's image at site a; none at site b, where the destination agent
    // makes one at the same path.
    bare::prepare(&t, &spec);
    // Its overlay on a middle layer on a base, each named by file name next to the one above.
    // Site b's library holds the base only.
    let at = |site: Site, layer: &str| t.lab.host_dir(site).join(format!("{name}{layer}.qcow2"));
    std::fs::rename(bare::disk(&t, Site::A, name), at(Site::A, "-base")).unwrap();
    for (image, below) in [("-mid", "-base"), ("", "-mid")] {
        common::qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            &format!("{name}{below}.qcow2"),
            "-F",
            "qcow2",
            &at(Site::A, image).to_string_lossy(),
        ]);
    }
    std::fs::copy(at(Site::A, "-base"), at(Site::B, "-base")).unwrap();
    let mid = std::fs::read(at(Site::A, "-mid")).unwrap();
    let source_pid = bare::start_at_a(&t, &spec);
    let link = common::guest_at(
        &rt,
        &t,
        Site::A,
        name,
        &[
            "mem start pattern=ws mib=32 rate=1",
            "disk start mib=8 rate=0.5",
        ],
    );
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

    // A name the destination cannot name its monitor after: refused before anything happens.
    let out = ferry_at_a(
        &t,
        &[
            "migrate", "../x", "--qmp", &qmp, "--to", "site-b", "--agent", &agent_a,
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("\"../x\" cannot name a VM's monitor"),
        "{}",
        text(&out)
    );

    let mut argv = vec![ferry_qemu::qemu_program()];
    argv.extend(spec.argv());
    let argv_file = |file: &str, argv: Vec<String>| {
        std::fs::write(t.lab.host_dir(Site::A).join(file), argv.join("\n")).unwrap();
        format!("{HOST_DIR}/{file}")
    };

    // A destination without the disk's directory (an unmounted volume, say): its agent makes
    // no image there and names it.
    let elsewhere = argv_file(
        "elsewhere-argv",
        argv.iter()
            .map(|a| a.replace(HOST_DIR, "/run/ferry-nowhere"))
            .collect(),
    );
    let out = migrate(&["--destination-argv-file", &elsewhere]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!(
            "making disk \"disk0\"'s image: /run/ferry-nowhere/{name}.qcow2: its directory \
             /run/ferry-nowhere is not on this host"
        )),
        "{}",
        text(&out)
    );

    // A destination that cannot have the VM (its kernel is not on that host): QEMU's own
    // words come back, the source keeps running, nothing is left at the destination.
    let img = ferry_lab::vm::ensure_image().unwrap();
    let kernel = img.kernel.to_string_lossy().into_owned();
    let bad_argv = argv_file(
        "bad-argv",
        argv.iter()
            .map(|a| a.replace(&kernel, "/nonexistent/vmlinuz"))
            .collect(),
    );
    let out = migrate(&["--destination-argv-file", &bad_argv]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the destination QEMU refused the VM's configuration")
            && err.contains("/nonexistent/vmlinuz"),
        "{}",
        text(&out)
    );
    // The destination QEMUs' monitors and pid files go in site b's monitor directory.
    let monitors_b = t.lab.host_dir(Site::B).join("vms");
    let left: Vec<_> = std::fs::read_dir(&monitors_b)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "left at the destination: {left:?}");
    // The image made for it went with it. The middle layer shipped for it stays: its bytes
    // were checked, and the next attempt needs it. (Removed here, so that the move itself
    // ships it again.)
    assert!(
        !bare::disk(&t, Site::B, name).exists(),
        "the image made for a failed migration is left"
    );
    assert_eq!(std::fs::read(at(Site::B, "-mid")).unwrap(), mid);
    assert!(!t
        .lab
        .host_dir(Site::B)
        .join(format!("{name}-mid.qcow2.partial"))
        .exists());
    std::fs::remove_file(at(Site::B, "-mid")).unwrap();
    let v = rt.block_on(ferry_lab::guest::verify(&link, true)).unwrap();
    assert_eq!(
        v.errors(),
        0,
        "the source guest's memory and disk after the failures"
    );

    // The move itself: nothing was started at site b; its agent makes the disk's image and
    // starts the VM from the source QEMU's command line, and the disk is copied into it.
    let out = migrate(&["--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let v = common::json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(v["outcome"]["completed"], true, "{v}");
    assert!(v["outcome"]["downtime_ms"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["outcome"]["disk"]["disks"], 1, "{v}");
    assert_eq!(v["outcome"]["disk"]["images_made"], 1, "{v}");
    // The middle layer crossed first, whole; then only the overlay.
    assert_eq!(v["outcome"]["disk"]["layers_shipped"], 1, "{v}");
    assert_eq!(v["outcome"]["disk"]["layer_bytes"], mid.len() as u64, "{v}");
    assert_eq!(v["outcome"]["disk"]["overlay_only"], 1, "{v}");
    assert_eq!(std::fs::read(at(Site::B, "-mid")).unwrap(), mid);
    let made: serde_json::Value = serde_json::from_str(&common::qemu_img(&[
        "info",
        "-U",
        "--output=json",
        &bare::disk(&t, Site::B, name).to_string_lossy(),
    ]))
    .unwrap();
    assert_eq!(
        made["backing-filename"],
        format!("{name}-mid.qcow2"),
        "{made}"
    );
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
    let (_link_b, errors) = bare::verify(&rt, &t, Site::B, name);
    assert_eq!(errors, 0, "the guest's memory and disk at the destination");
    // Its monitor there is named after it, in the agent's monitor directory.
    let status = rt.block_on(async {
        let qmp = ferry_qemu::Qmp::connect(&monitors_b.join(format!("{name}.qmp")))
            .await
            .unwrap();
        qmp.execute(&ferry_qemu::commands::QueryStatus)
            .await
            .unwrap()
    });
    assert_eq!(status.status, "running");
    assert!(monitors_b.join(format!("{name}.pid")).exists());

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
