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

/// Where each site's agent finds the QEMU VMs' monitors (`[qemu] qmp_dir`), as the site's
/// processes see it ([`Lab::host_dir`] from outside).
pub fn qmp_dir() -> String {
    format!("{}/vms", crate::topology::HOST_DIR)
}

/// Where `site`'s agent's config file is.
pub fn config_path(lab: &Lab, site: Site) -> std::path::PathBuf {
    lab.dir().join(format!("agent-{}.toml", site.name()))
}

/// `site`'s agent's config, as a fleet would write it: the other sites are its peers.
fn config(
    lab: &Lab,
    site: Site,
    link_rate_mbit: Option<f64>,
    controllers: &[Site],
    mem_mib: u32,
) -> String {
    let name = pki::agent_name(site);
    let id = pki::identity(&lab.pki_dir(), &name);
    let q = |p: &Path| format!("{:?}", p.display().to_string());
    let mut text = format!(
        "# made by `ferry lab up`\nname = {name:?}\nsite = {:?}\nlisten = {:?}\napi_socket = {}\nwork_dir = {}\n\n[tls]\nca = {}\ncert = {}\nkey = {}\n\n[seeds]\ndir = {}\n",
        site.name(),
        lab.agent_peer_addr(site),
        q(&lab.agent_socket(site)),
        q(&lab.dir().join(format!("agent-{}", site.name()))),
        q(&id.ca),
        q(&id.cert),
        q(&id.key),
        q(&seed_dir(lab, site)),
    );
    text.push_str(&crate::controller::agent_sections(controllers));
    // The pools' tunnels cross the WAN between the sites' underlay addresses.
    text.push_str(&format!(
        "\n[overlay]\naddress = {:?}\ndevice = \"wan0\"\n",
        site.underlay_ip()
    ));
    // The lab's hosts share one machine: each offers the planner a stated share of it (two
    // CPUs, 1 GiB unless told: four tiny guests fit on one, two busy ones do not), and lends
    // the other site's guests 256 MiB of swap.
    text.push_str(&format!(
        "\n[host]\ncpus = 2\nmem_mib = {mem_mib}\nlend_mib = 256\n"
    ));
    // QEMU VMs started by hand at a site have their monitors in the site's host directory.
    text.push_str(&format!("\n[qemu]\nqmp_dir = {:?}\n", qmp_dir()));
    // libvirt's UNIX-socket migration goes through the agents: the tunnels' sockets are in
    // the site's own host directory, the same path at every site, as libvirt wants.
    text.push_str(&format!(
        "\n[libvirt]\ntunnel_dir = {:?}\n",
        format!("{}/tunnels", crate::topology::HOST_DIR)
    ));
    for peer in Site::ALL.into_iter().filter(|p| *p != site) {
        text.push_str(&format!(
            "\n[peers.{}]\naddress = {:?}\n",
            pki::agent_name(peer),
            lab.agent_peer_addr(peer)
        ));
        if let Some(rate) = link_rate_mbit {
            text.push_str(&format!("rate_mbit = {rate}\n"));
        }
    }
    text
}

/// Starts `site`'s agent and waits until its API answers. Returns its pid.
/// It heartbeats to the lab's controllers at `controllers` ([`crate::controller`]).
pub fn start(
    lab: &Lab,
    site: Site,
    ferry_exe: &Path,
    link_rate_mbit: Option<f64>,
    without_net_admin: bool,
    controllers: &[Site],
    mem_mib: u32,
) -> Result<u32> {
    let config_path = config_path(lab, site);
    fs::write(
        &config_path,
        config(lab, site, link_rate_mbit, controllers, mem_mib),
    )
    .with_context(|| format!("write {}", config_path.display()))?;
    let _ = fs::remove_file(log_path(lab, site));
    spawn(lab, site, ferry_exe, without_net_admin)
}

/// Where `site`'s agent logs.
pub fn log_path(lab: &Lab, site: Site) -> std::path::PathBuf {
    lab.dir().join(format!("agent-{}.log", site.name()))
}

/// Where the lab records the pid of `site`'s agent: a pattern would also match the processes
/// an agent forks without `exec` (its postcopy monitor keepers), which a crash leaves running.
fn pid_path(lab: &Lab, site: Site) -> std::path::PathBuf {
    lab.dir().join(format!("agent-{}.pid", site.name()))
}

/// Kills `site`'s agent with SIGKILL (as a crash would) and waits until it is gone: `pkill`
/// only sends the signal, and a successor started before the kernel has torn the old process
/// down finds its peer port still taken.
pub fn kill(lab: &Lab, site: Site) -> Result<()> {
    let no_agent = || anyhow::anyhow!("no agent of site {} to kill", site.name());
    let pid: u32 = fs::read_to_string(pid_path(lab, site))
        .ok()
        .and_then(|p| p.trim().parse().ok())
        .ok_or_else(no_agent)?;
    // The recorded process, not another that took its pid after it went.
    let config = config_path(lab, site);
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let is_agent = String::from_utf8_lossy(&cmdline)
        .split('\0')
        .any(|arg| Path::new(arg) == config);
    anyhow::ensure!(is_agent && !exited(pid), no_agent());
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    // Gone, or every thread a zombie: the kernel marks a thread a zombie only once it has
    // exited, and the process's files close with its last thread. (Its command line empties
    // earlier, when its memory goes, and its first thread can be a zombie while others still
    // hold the sockets: a successor then found its peer port taken.)
    wait_until(Duration::from_secs(10), || exited(pid))
        .with_context(|| format!("the agent of site {} did not exit", site.name()))
}

/// Whether process `pid` has exited: gone, or each of its threads a zombie (not yet reaped).
fn exited(pid: u32) -> bool {
    let Ok(threads) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    threads.flatten().all(|thread| {
        match fs::read_to_string(thread.path().join("stat")) {
            // The state is the field after the command's closing parenthesis.
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
            Err(_) => true,
        }
    })
}

/// Starts `site`'s agent again from the config it ran with (as after a crash, or an upgrade:
/// only what it keeps on disk is left) and waits until its API answers. Returns its pid.
pub fn restart(lab: &Lab, site: Site, ferry_exe: &Path) -> Result<u32> {
    let without_net_admin = lab.state()?.link.agents_without_net_admin;
    spawn(lab, site, ferry_exe, without_net_admin)
}

fn spawn(lab: &Lab, site: Site, ferry_exe: &Path, without_net_admin: bool) -> Result<u32> {
    let name = pki::agent_name(site);
    let sock = lab.agent_socket(site);
    let _ = fs::remove_file(&sock);
    let config_path = config_path(lab, site);
    let log_path = log_path(lab, site);
    // Appended: a restarted agent's log follows its predecessor's.
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    // The agent is a process of the site's host: the destination QEMUs it starts see the
    // site's files at HOST_DIR.
    let mut cmd = if without_net_admin {
        // Out of the bounding set, root's permitted and effective sets lose it at exec.
        let mut cmd = lab.host_command(site, "setpriv");
        cmd.args(["--inh-caps=-net_admin", "--bounding-set=-net_admin", "--"])
            .arg(ferry_exe);
        cmd
    } else {
        lab.host_command(site, ferry_exe)
    };
    cmd.args(["agent", "--config"])
        .arg(&config_path)
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
    fs::write(pid_path(lab, site), format!("{pid}\n"))?;
    wait_until(Duration::from_secs(10), || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    })
    .with_context(|| {
        format!(
            "agent {name} did not come up: {}",
            log_tail(&log_path, 3).join(" | ")
        )
    })?;
    Ok(pid)
}

/// The last `n` lines of the log at `path` (none if it cannot be read): what a process that
/// did not come up said, for the error, since a failed `up` removes the lab and its logs.
pub(crate) fn log_tail(path: &Path, n: usize) -> Vec<String> {
    let log = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| (*l).to_owned())
        .collect()
}
