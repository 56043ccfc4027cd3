//! Groups that arrive together, with the lab's controller (`lab up --libvirt --controller`):
//! three libvirt domains moved to site b by `ferry fleet migrate --group`. None resumes at
//! site b before every member's destination holds its whole verified stream (libvirt's own
//! lifecycle events at site b say when each resumed); the guests' verifiers decide whether
//! their memory arrived intact. A group with a member that cannot move is aborted: every
//! member runs on at site a, intact.

mod common;

use common::domains::{start_domain, verify};
use common::fleet::{fleet, fleet_json, host_of, wait_for, LAB};
use common::TestLab;
use ferry_lab::libvirt_events::LifecycleEvents;
use ferry_lab::Site;

const MEMBERS: [&str; 3] = ["grp1", "grp2", "grp3"];

#[test]
fn a_group_resumes_at_its_destination_only_once_every_member_is_there() {
    let t = TestLab::up("groups", LAB);
    let rt = tokio::runtime::Runtime::new().unwrap();
    wait_for(&t, "hosts", |h| {
        h.len() == 2 && h.iter().all(|h| h["state"] == "up")
    });
    // Members of different sizes and dirty rates: without the group the smallest would
    // arrive first.
    let workloads = [
        "mem start pattern=ws mib=8 rate=1",
        "mem start pattern=ws mib=16 rate=1",
        "mem start pattern=ws mib=24 rate=1",
    ];
    let mut links: Vec<_> = MEMBERS
        .iter()
        .zip(workloads)
        .zip(31..)
        .map(|((name, workload), host)| start_domain(&t, &rt, (name, host, false, ""), &[workload]))
        .collect();

    // A member whose NIC is on a bridge only site a has: libvirt refuses it at site b, and
    // the whole group stays at site a.
    let nic = common::domains::nic_only_at_site_a(&t);
    links.push(start_domain(&t, &rt, ("grp-odd", 34, false, nic), &[]));
    wait_for(&t, "vms", |v| {
        MEMBERS
            .iter()
            .chain(&["grp-odd"])
            .all(|m| host_of(v, m).as_deref() == Some("site-a"))
    });
    let out = fleet(
        &t,
        &[
            "migrate",
            "grp1",
            "grp2",
            "grp-odd",
            "--group",
            "--to-site",
            "b",
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let last = text.lines().last().unwrap();
    assert!(
        last.contains("aborted") && last.contains("grp-odd failed"),
        "{text}"
    );
    // (Their serial sockets at site a take one client: the links that started them.)
    for (name, link) in ["grp1", "grp2", "grp-odd"]
        .into_iter()
        .zip([&links[0], &links[1], &links[3]])
    {
        assert_eq!(
            t.domstate(Site::A, name).as_deref(),
            Some("running"),
            "{name}"
        );
        assert_eq!(t.domstate(Site::B, name), None, "{name} at site b");
        let errors = rt.block_on(async { ferry_lab::guest::verify(link, false).await.unwrap() });
        assert_eq!(errors.errors(), 0, "{name} after the aborted group");
    }

    // Bad input: several VMs without --group.
    let out = fleet(&t, &["migrate", "grp1", "grp2", "--to-site", "b"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("give --group"),
        "{out:?}"
    );

    // The group of three, with libvirt at site b telling when each resumed.
    let events = LifecycleEvents::watch(&t.lab, Site::B).unwrap();
    let mut args = vec!["migrate"];
    args.extend(MEMBERS);
    args.extend(["--group", "--to-site", "b"]);
    let out = common::succeeded("ferry fleet migrate --group", &fleet(&t, &args));
    let last = out.lines().last().unwrap();
    assert!(last.contains("released"), "{out}");
    let resumed = arrived_together(&t, &rt, &events, &MEMBERS, false);
    let window = resumed.iter().max().unwrap() - resumed.iter().min().unwrap();
    println!("the group's members resumed at site b within {window} ms of each other");
}

#[test]
fn a_group_copies_its_members_disks_and_resumes_them_together() {
    let t = TestLab::up("groupsd", LAB);
    let rt = tokio::runtime::Runtime::new().unwrap();
    wait_for(&t, "hosts", |h| {
        h.len() == 2 && h.iter().all(|h| h["state"] == "up")
    });
    // Two members on storage of their own, each writing its disk all along: libvirt copies
    // the disks through the agents' tunnels, then the memory; neither resumes at site b
    // before both hold.
    let members = ["grpd1", "grpd2"];
    let links: Vec<_> = members
        .iter()
        .zip(41..)
        .map(|(name, host)| {
            common::domains::make_disk(&t, name, true);
            start_domain(
                &t,
                &rt,
                (name, host, true, ""),
                &[
                    "mem start pattern=ws mib=16 rate=1",
                    "disk start mib=8 rate=0.5",
                ],
            )
        })
        .collect();
    wait_for(&t, "vms", |v| {
        members
            .iter()
            .all(|m| host_of(v, m).as_deref() == Some("site-a"))
    });
    // (The serial sockets at site a take one client: the links that started them.)
    drop(links);
    let events = LifecycleEvents::watch(&t.lab, Site::B).unwrap();
    let mut args = vec!["migrate"];
    args.extend(members);
    args.extend(["--group", "--copy-storage", "--to-site", "b"]);
    let out = common::succeeded(
        "ferry fleet migrate --group --copy-storage",
        &fleet(&t, &args),
    );
    assert!(out.lines().last().unwrap().contains("released"), "{out}");
    arrived_together(&t, &rt, &events, &members, true);
    let groups = fleet_json(&t, "groups");
    for member in groups.last().unwrap()["members"].as_array().unwrap() {
        assert_eq!(member["copy_storage"], true, "{member}");
    }
}

/// Checks the last group: released, every member committed after it held, running at site b
/// only, intact by the guest's own verifiers (`disk`: its disk too), and resumed there (by
/// libvirt's `events`) no earlier than the release. Returns the resumes' times.
fn arrived_together(
    t: &TestLab,
    rt: &tokio::runtime::Runtime,
    events: &LifecycleEvents,
    members: &[&str],
    disk: bool,
) -> Vec<u64> {
    let groups = fleet_json(t, "groups");
    let group = groups.last().unwrap();
    assert_eq!(group["state"], "released", "{group}");
    let released = group["decided_unix_ms"].as_u64().unwrap();
    let mut resumed = Vec::new();
    for (name, member) in members.iter().zip(group["members"].as_array().unwrap()) {
        assert_eq!(member["state"], "committed", "{member}");
        assert!(
            member["held_unix_ms"].as_u64().unwrap() <= released,
            "{member}"
        );
        assert_eq!(
            t.domstate(Site::B, name).as_deref(),
            Some("running"),
            "{name}"
        );
        assert_eq!(t.domstate(Site::A, name), None, "{name} left at site a");
        assert_eq!(verify(t, rt, Site::B, name, disk), 0, "{name}");
        let at = events
            .resumed_unix_ms(name)
            .unwrap_or_else(|| panic!("libvirt at site b saw {name} resume: {:?}", events.lines()));
        // The commit point: no member ran at site b before every member held.
        assert!(
            at >= released,
            "{name} resumed at {at}, the group was released at {released}"
        );
        resumed.push(at);
    }
    resumed
}
