//! `ferry fleet` against the lab's controller at site a, and waiting for what it reports.

use std::time::{Duration, Instant};

use ferry_lab::Site;

use super::TestLab;

/// `lab up` flags of the fleet's tests: libvirt at each site, a controller at site a, a fast
/// link (the slow links' figures are `ferry bench`'s).
pub const LAB: &[&str] = &[
    "--libvirt",
    "--controller",
    "--rate-mbit",
    "1000",
    "--rtt-ms",
    "10",
];

/// `ferry fleet ARGS` against the lab's controller, through its local socket.
pub fn fleet(t: &TestLab, args: &[&str]) -> std::process::Output {
    let socket = ferry_lab::controller::socket(&t.lab, Site::A);
    let mut all = vec!["fleet", "--controller", socket.to_str().unwrap()];
    all.extend_from_slice(args);
    t.run(&all)
}

pub fn fleet_json(t: &TestLab, what: &str) -> Vec<serde_json::Value> {
    let out = super::succeeded("ferry fleet", &fleet(t, &[what, "--json"]));
    super::json(&out).as_array().cloned().unwrap_or_default()
}

/// Polls `ferry fleet WHAT --json` until `ready` holds for it (the agents report every second).
pub fn wait_for(
    t: &TestLab,
    what: &str,
    ready: impl Fn(&[serde_json::Value]) -> bool,
) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = fleet_json(t, what);
        if ready(&now) {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "fleet {what} never got there: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

pub fn host_of(vms: &[serde_json::Value], name: &str) -> Option<String> {
    vms.iter()
        .find(|v| v["name"] == name)
        .and_then(|v| v["host"].as_str().map(str::to_owned))
}

/// Polls `ready` until it holds (within a minute), for what the agents do at their own pace.
pub fn wait_until(what: &str, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        assert!(Instant::now() < deadline, "{what}: not within 60 s");
        std::thread::sleep(Duration::from_millis(250));
    }
}
