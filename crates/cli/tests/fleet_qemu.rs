//! A QEMU VM its owner runs by hand, not libvirt, in the fleet: its monitor in the agent's
//! `[qemu] qmp_dir` makes it one of the fleet's VMs. `ferry fleet migrate --copy-storage`
//! moves it by ferry's own path: the destination agent starts it from the source QEMU's own
//! command line, its monitor in the same directory there, and the controller then finds it at
//! site b. It comes back the same way. The guest's verifiers decide each time whether its
//! memory and disk arrived intact.

mod common;

use std::path::{Path, PathBuf};

use common::fleet::{fleet, fleet_json, wait_for, wait_until, LAB};
use common::{bare, text, TestLab};
use ferry_lab::Site;

/// The VM as `ferry fleet vms --json` lists it at `host`, running.
fn runs_at(vms: &[serde_json::Value], name: &str, host: &str) -> bool {
    vms.iter().any(|v| {
        v["name"] == name && v["kind"] == "qemu" && v["host"] == host && v["state"] == "running"
    })
}

#[test]
fn the_controller_moves_a_qemu_vm_started_by_hand_there_and_back() {
    let t = TestLab::up("fleetq", LAB);
    let rt = tokio::runtime::Runtime::new().unwrap();
    wait_for(&t, "hosts", |h| {
        h.len() == 2 && h.iter().all(|h| h["state"] == "up")
    });
    let name = "bareq";
    let monitor = PathBuf::from(ferry_lab::agents::qmp_dir()).join(format!("{name}.qmp"));
    let spec = bare::spec(name, monitor, 91);
    bare::prepare(&t, &spec);
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
    wait_for(&t, "vms", |v| runs_at(v, name, "site-a"));

    // Only libvirt domains move in groups.
    let out = fleet(&t, &["migrate", "--group", name, "other", "--to-site", "b"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("bareq is a qemu VM: only libvirt domains move in groups"),
        "{}",
        text(&out)
    );

    // Site b has a file at the disk's path that is no qcow2 image: QEMU there says so, the
    // migration fails, the VM runs on at site a, intact, and the file (not ferry's) stays.
    let at_b = bare::disk(&t, Site::B, name);
    std::fs::write(&at_b, b"").unwrap();
    let out = fleet(&t, &["migrate", name, "--to-site", "b", "--copy-storage"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("failed") && said.contains("qcow2"),
        "{}",
        text(&out)
    );
    let v = rt.block_on(ferry_lab::guest::verify(&link, true)).unwrap();
    assert_eq!(v.errors(), 0, "the guest at site a after the failure");
    assert!(
        std::fs::read_dir(t.lab.host_dir(Site::B).join("vms"))
            .unwrap()
            .next()
            .is_none(),
        "nothing is left in site b's monitor directory"
    );
    assert!(at_b.exists(), "a file ferry did not make was removed");
    wait_for(&t, "vms", |v| runs_at(v, name, "site-a"));

    // Without it, site b's agent makes the image at the same path. The VM moves, the source
    // QEMU quits (its monitor goes with it), and site b's agent lists the VM it started.
    std::fs::remove_file(&at_b).unwrap();
    let out = common::succeeded(
        "ferry fleet migrate",
        &fleet(&t, &["migrate", name, "--to-site", "b", "--copy-storage"]),
    );
    assert!(out.lines().last().unwrap().contains("committed"), "{out}");
    drop(link);
    wait_until("the source QEMU is gone", || {
        !Path::new(&format!("/proc/{source_pid}")).exists()
    });
    let monitors_a = t.lab.host_dir(Site::A).join("vms");
    assert!(!monitors_a.join(format!("{name}.qmp")).exists());
    let (link, errors) = bare::verify(&rt, &t, Site::B, name);
    assert_eq!(errors, 0, "the guest's memory and disk at site b");
    drop(link);
    wait_for(&t, "vms", |v| runs_at(v, name, "site-b"));

    // And back: the VM site b's agent started moves like any other.
    let out = common::succeeded(
        "ferry fleet migrate",
        &fleet(&t, &["migrate", name, "--to-site", "a", "--copy-storage"]),
    );
    assert!(out.lines().last().unwrap().contains("committed"), "{out}");
    let (_link, errors) = bare::verify(&rt, &t, Site::A, name);
    assert_eq!(errors, 0, "the guest's memory and disk back at site a");
    let monitors_b = t.lab.host_dir(Site::B).join("vms");
    wait_until("site b's QEMU is gone with its monitor", || {
        !monitors_b.join(format!("{name}.qmp")).exists()
    });
    wait_for(&t, "vms", |v| runs_at(v, name, "site-a"));
    let states: Vec<String> = fleet_json(&t, "migrations")
        .iter()
        .map(|m| format!("{} {}", m["kind"], m["state"]))
        .collect();
    assert_eq!(
        states
            .iter()
            .filter(|s| *s == "\"qemu\" \"committed\"")
            .count(),
        2,
        "{states:?}"
    );
    assert_eq!(
        states
            .iter()
            .filter(|s| *s == "\"qemu\" \"failed\"")
            .count(),
        1,
        "{states:?}"
    );
}
