//! The lab's agents: one `ferry agent` per site, inside the site's namespace, listening for
//! peers on the site's underlay address and for the CLI on a socket in the lab's directory.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::pki;
use crate::topology::{detach, reap, wait_until, Lab, Site};

/// Where `site`'s agent keeps the memory images of VMs that left it.
pub fn seed_dir(lab: &Lab, site: Site) -> std::path::PathBuf {
    lab.dir()
        .join(format!("agent-{}", site.name()))
        .join("seeds")
}

/// Starts `site`'s agent and waits until its API answers. Returns its pid.
pub fn start(lab: &Lab, site: Site, ferry_exe: &Path, _link_rate_mbit: Option<f64>) -> Result<u32> {
    let name = pki::agent_name(site);
    let id = pki::identity(&lab.pki_dir(), &name);
    let sock = lab.agent_socket(site);
    let _ = fs::remove_file(&sock);
    let log_path = lab.dir().join(format!("agent-{}.log", site.name()));
    let log = fs::File::create(&log_path)?;
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &lab.site_ns(site)])
        .arg(ferry_exe)
        .args([
            "agent",
            "--name",
            &name,
            "--listen",
            &lab.agent_peer_addr(site),
        ])
        .arg("--api")
        .arg(&sock)
        .arg("--work-dir")
        .arg(lab.dir().join(format!("agent-{}", site.name())))
        .arg("--seed-dir")
        .arg(seed_dir(lab, site))
        .arg("--ca")
        .arg(&id.ca)
        .arg("--cert")
        .arg(&id.cert)
        .arg("--key")
        .arg(&id.key)
        .env(
            "FERRY_LOG",
            std::env::var("FERRY_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    detach(&mut cmd);
    let child = cmd.spawn().context("start the agent")?;
    let pid = child.id();
    reap(child);
    wait_until(Duration::from_secs(10), || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    })
    .with_context(|| format!("agent {name} did not come up; see {}", log_path.display()))?;
    Ok(pid)
}
