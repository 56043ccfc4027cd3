//! The lab's network: two sites and a WAN between them, all in network namespaces.
//!
//! ```text
//!  ns <lab>-a                       ns <lab>-wan                      ns <lab>-b
//!  br0 10.77.0.1/24 ─ vx0 ─ wan0 ══ to-a ══ WAN relay ══ to-b ══ wan0 ─ vx0 ─ br0 10.77.0.2/24
//!  (taps of VMs)      VXLAN 172.31.0.1/24                          172.31.0.2/24 VXLAN  (taps of VMs)
//! ```
//!
//! The underlay (`wan0`, 172.31.0.0/24) carries migration traffic; the bridges joined by VXLAN
//! over it make one layer-2 segment (10.77.0.0/24) that a guest keeps across sites. Every byte
//! between the sites crosses the relay and is counted there.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::link::LinkConfig;
use crate::{sh, wan};

/// The underlay MTU: room for VXLAN's 50 bytes around a 1500-byte guest frame.
const UNDERLAY_MTU: u32 = 1600;
/// The port agents listen on for their peers.
pub const AGENT_PORT: u16 = 7700;
/// The VXLAN network identifier of the lab's shared segment.
const VXLAN_ID: u32 = 77;

/// One site of the lab.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Site {
    A,
    B,
}

impl Site {
    /// Every site, in order.
    pub const ALL: [Site; 2] = [Site::A, Site::B];

    /// Parses a site name (`a` or `b`, any case).
    pub fn parse(s: &str) -> Result<Site> {
        match s.to_ascii_lowercase().as_str() {
            "a" => Ok(Site::A),
            "b" => Ok(Site::B),
            _ => bail!("unknown site {s:?} (known: a, b)"),
        }
    }

    /// `a` or `b`.
    pub fn name(self) -> &'static str {
        match self {
            Site::A => "a",
            Site::B => "b",
        }
    }

    /// The other site.
    pub fn other(self) -> Site {
        match self {
            Site::A => Site::B,
            Site::B => Site::A,
        }
    }

    /// The site's address on the underlay (where migration traffic arrives).
    pub fn underlay_ip(self) -> &'static str {
        match self {
            Site::A => "172.31.0.1",
            Site::B => "172.31.0.2",
        }
    }

    /// The site bridge's own MAC (locally administered).
    pub fn bridge_mac(self) -> &'static str {
        match self {
            Site::A => "02:77:00:00:00:01",
            Site::B => "02:77:00:00:00:02",
        }
    }

    /// The site bridge's own address on the shared guest segment.
    pub fn bridge_ip(self) -> &'static str {
        match self {
            Site::A => "10.77.0.1",
            Site::B => "10.77.0.2",
        }
    }
}

/// Lets a namespace default to `congestion`: outside the host's own namespace Linux accepts
/// only a congestion control on the host-wide allowed list as a default (stock: reno and the
/// host's default). Widening that list only lets unprivileged sockets choose it too; it is said
/// and left so.
fn allow_congestion_control(congestion: crate::link::Congestion) -> Result<()> {
    const ALLOWED: &str = "/proc/sys/net/ipv4/tcp_allowed_congestion_control";
    let allowed = std::fs::read_to_string(ALLOWED).with_context(|| format!("read {ALLOWED}"))?;
    if allowed.split_whitespace().any(|cc| cc == congestion.name()) {
        return Ok(());
    }
    let widened = format!("{} {}", allowed.trim(), congestion.name());
    eprintln!(
        "lab: adding {} to {ALLOWED} (host-wide), so the sites may default to it",
        congestion.name()
    );
    std::fs::write(ALLOWED, &widened).with_context(|| format!("write {widened:?} to {ALLOWED}"))
}

/// What runs in the lab besides the sites, the WAN and the agents.
#[derive(Debug, Clone, Copy, Default)]
pub struct Services {
    /// A libvirtd per site ([`crate::libvirt`]).
    pub libvirt: bool,
    /// The fleet controller at site a, the agents heartbeating to it ([`crate::controller`]).
    pub controller: bool,
    /// With `controller`: PostgreSQL at site a and a controller at each site sharing it
    /// ([`crate::postgres`]).
    pub postgres: bool,
    /// With `controller`: each host offers VMs this much memory (MiB; else 1 GiB) and the
    /// controller meets memory overload (`[policy] overload`, sampled every 3 s).
    pub overload_mib: Option<u32>,
    /// With `overload_mib`: every overload migrates at once (`[policy] overload_swap = false`).
    pub overload_migrate_only: bool,
}

impl Services {
    /// The sites with a controller, in the order agents try them.
    pub fn controller_sites(self) -> Vec<Site> {
        match (self.controller, self.postgres) {
            (false, _) => vec![],
            (true, false) => vec![Site::A],
            (true, true) => Site::ALL.to_vec(),
        }
    }
}

/// What `lab up` recorded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LabState {
    pub name: String,
    pub link: LinkConfig,
    pub relay_pid: u32,
}

/// A lab by name: its namespaces and state directory. Several labs can coexist (tests use their
/// own name so they never touch the demo's).
#[derive(Debug, Clone)]
pub struct Lab {
    pub name: String,
}

/// The default lab's name.
pub const DEFAULT_LAB: &str = "ferry";

/// A directory every site sees as its own (its host's `/run`-like place): processes started
/// with [`Lab::host_command`] find `<lab dir>/host-<site>` mounted there, in a mount namespace
/// of their own. Two hosts have separate file systems; this gives the lab's sites that much,
/// so a VM's sockets can have the same path at both ends, as on real hosts.
pub const HOST_DIR: &str = "/run/ferry-host";

impl Lab {
    /// The lab named by `FERRY_LAB`, or the default one.
    pub fn from_env() -> Lab {
        Lab {
            name: std::env::var("FERRY_LAB").unwrap_or_else(|_| DEFAULT_LAB.to_owned()),
        }
    }

    /// The lab's runtime directory (sockets, logs, VM records).
    pub fn dir(&self) -> PathBuf {
        let base = std::env::var_os("FERRY_RUN_DIR")
            .map_or_else(|| PathBuf::from("/run/ferry"), PathBuf::from);
        base.join(&self.name)
    }

    /// The network namespace of `site`.
    pub fn site_ns(&self, site: Site) -> String {
        format!("{}-{}", self.name, site.name())
    }

    /// The namespace of a port on a pool's bridge ([`crate::pools`]).
    pub fn pool_port_ns(&self, name: &str) -> String {
        format!("{}-p-{name}", self.name)
    }

    /// What `site`'s processes see at [`HOST_DIR`], as a path outside the site.
    pub fn host_dir(&self, site: Site) -> PathBuf {
        self.dir().join(format!("host-{}", site.name()))
    }

    /// `program` to run as a process of `site`'s host: in its network namespace, and in a
    /// mount namespace of its own where [`HOST_DIR`] is the site's [`Lab::host_dir`] (and,
    /// at a site with libvirt, libvirt's directories are the site's: [`crate::libvirt`]).
    pub fn host_command(&self, site: Site, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut binds = vec![(self.host_dir(site), PathBuf::from(HOST_DIR))];
        binds.extend(crate::libvirt::binds(self, site));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.site_ns(site)])
            .args(["unshare", "--mount", "--propagation", "private", "--"])
            .args([
                "sh",
                "-c",
                "set -e; while [ \"$1\" != -- ]; do mount --bind \"$1\" \"$2\"; shift 2; done; shift; exec \"$@\"",
                "sh",
            ]);
        for (outside, inside) in binds {
            cmd.arg(outside).arg(inside);
        }
        cmd.arg("--").arg(program);
        cmd
    }

    /// The middle namespace holding the WAN emulator.
    pub fn wan_ns(&self) -> String {
        format!("{}-wan", self.name)
    }

    /// The API socket of `site`'s agent.
    pub fn agent_socket(&self, site: Site) -> PathBuf {
        self.dir().join(format!("agent-{}.sock", site.name()))
    }

    /// Where `site`'s agent listens for peers (its underlay address).
    pub fn agent_peer_addr(&self, site: Site) -> String {
        format!("{}:{}", site.underlay_ip(), AGENT_PORT)
    }

    /// The lab's certificates.
    pub fn pki_dir(&self) -> PathBuf {
        self.dir().join("pki")
    }

    /// The WAN emulator's control socket.
    pub fn wan_socket(&self) -> PathBuf {
        self.dir().join("wan.sock")
    }

    fn state_path(&self) -> PathBuf {
        self.dir().join("lab.json")
    }

    /// The recorded state, if the lab is up.
    pub fn state(&self) -> Result<LabState> {
        let p = self.state_path();
        let text = fs::read_to_string(&p)
            .map_err(|_| anyhow::anyhow!("lab {:?} is not up (run `ferry lab up`)", self.name))?;
        serde_json::from_str(&text).with_context(|| format!("corrupt {}", p.display()))
    }

    /// Records a link change made through the emulator's control socket. The hosts' congestion
    /// control and GRO stay as the lab came up with them: only `lab up` sets those.
    pub fn record_link(&self, link: LinkConfig) -> Result<()> {
        let mut state = self.state()?;
        state.link = LinkConfig {
            host_congestion: state.link.host_congestion,
            receive_gro: state.link.receive_gro,
            host_tcp_rmem_max_mib: state.link.host_tcp_rmem_max_mib,
            agents_without_net_admin: state.link.agents_without_net_admin,
            ..link
        };
        fs::write(self.state_path(), serde_json::to_string_pretty(&state)?)?;
        Ok(())
    }

    fn namespaces(&self) -> Vec<String> {
        vec![self.site_ns(Site::A), self.site_ns(Site::B), self.wan_ns()]
    }

    fn existing_namespaces(&self) -> Result<Vec<String>> {
        let out = sh::run("ip", &["netns", "list"])?;
        let mine = self.namespaces();
        Ok(out
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| mine.iter().any(|m| m == n) || n.starts_with(&self.pool_port_ns("")))
            .map(str::to_owned)
            .collect())
    }

    /// Creates the namespaces, links, bridges and the WAN emulator. `ferry_exe` is the binary
    /// that runs the relay (`ferry lab relay`). On failure, whatever was created is removed.
    /// Brings the lab up: sites, WAN emulator, bridges, an agent per site and, with
    /// `libvirt`, a libvirtd per site ([`crate::libvirt`]).
    pub fn up(&self, link: LinkConfig, ferry_exe: &Path, services: Services) -> Result<LabState> {
        require_root()?;
        link.validate()?;
        if self.state_path().exists() || !self.existing_namespaces()?.is_empty() {
            bail!(
                "lab {:?} is already up (run `ferry lab down` first)",
                self.name
            );
        }
        for dir in [self.dir(), PathBuf::from(HOST_DIR)]
            .into_iter()
            .chain(Site::ALL.map(|s| self.host_dir(s)))
        {
            fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        }
        match self.create(link, ferry_exe, services) {
            Ok(state) => Ok(state),
            Err(e) => {
                let _ = self.down(true);
                Err(e)
            }
        }
    }

    fn create(&self, link: LinkConfig, ferry_exe: &Path, services: Services) -> Result<LabState> {
        let libvirt = services.libvirt;
        if libvirt {
            for site in Site::ALL {
                crate::libvirt::prepare(self, site)?;
            }
        }
        let wan = self.wan_ns();
        for ns in self.namespaces() {
            sh::run("ip", &["netns", "add", &ns])?;
            sh::ip_in(&ns, "link set lo up")?;
            // No IPv6 chatter (router solicitations, DAD) in the byte counts.
            sh::run_in(
                &ns,
                "sysctl",
                &[
                    "-qw",
                    "net.ipv6.conf.all.disable_ipv6=1",
                    "net.ipv6.conf.default.disable_ipv6=1",
                ],
            )?;
        }
        if let Some(congestion) = link.host_congestion {
            allow_congestion_control(congestion)?;
            for site in Site::ALL {
                sh::run_in(
                    &self.site_ns(site),
                    "sysctl",
                    &[
                        "-qw",
                        &format!("net.ipv4.tcp_congestion_control={}", congestion.name()),
                    ],
                )?;
            }
        }
        if let Some(mib) = link.host_tcp_rmem_max_mib {
            for site in Site::ALL {
                let rmem = format!("net.ipv4.tcp_rmem=4096 131072 {}", u64::from(mib) << 20);
                sh::run_in(&self.site_ns(site), "sysctl", &["-qw", &rmem])?;
            }
        }
        for site in Site::ALL {
            let ns = self.site_ns(site);
            let peer = format!("to-{}", site.name());
            sh::ip_in(
                "",
                &format!("link add wan0 netns {ns} type veth peer name {peer} netns {wan}"),
            )?;
            for (n, dev) in [(&ns, "wan0"), (&wan, peer.as_str())] {
                sh::ip_in(n, &format!("link set dev {dev} mtu {UNDERLAY_MTU} up"))?;
                // MTU-sized frames with complete checksums: the relay forwards what it sees.
                // GRO at the site's end only merges what the site receives from the relay.
                let gro = if link.receive_gro && dev == "wan0" {
                    "on"
                } else {
                    "off"
                };
                sh::run_in(
                    n,
                    "ethtool",
                    &[
                        "-K", dev, "tso", "off", "gso", "off", "gro", gro, "tx", "off", "rx", "off",
                    ],
                )?;
            }
            sh::ip_in(&ns, &format!("addr add {}/24 dev wan0", site.underlay_ip()))?;
            // A fixed MAC: a bridge without one takes its lowest port's, so adding or removing a
            // VM's tap would change it and black-hole guests that cached the old one in ARP.
            sh::ip_in(
                &ns,
                &format!("link add br0 address {} type bridge", site.bridge_mac()),
            )?;
            sh::ip_in(&ns, &format!("addr add {}/24 dev br0", site.bridge_ip()))?;
            sh::ip_in(&ns, "link set br0 up")?;
            let (local, remote) = (site.underlay_ip(), site.other().underlay_ip());
            sh::ip_in(&ns, &format!("link add vx0 type vxlan id {VXLAN_ID} local {local} remote {remote} dstport 4789 dev wan0"))?;
            sh::ip_in(&ns, "link set vx0 master br0 up")?;
        }

        let log = fs::File::create(self.dir().join("wan.log"))?;
        let sock = self.wan_socket();
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &wan])
            .arg(ferry_exe)
            .args(["lab", "relay", "--if-a", "to-a", "--if-b", "to-b"])
            .args([
                "--rate-mbit",
                &link.rate_mbit.to_string(),
                "--rtt-ms",
                &link.rtt_ms.to_string(),
            ])
            .args([
                "--jitter-ms",
                &link.jitter_ms.to_string(),
                "--loss-pct",
                &link.loss_pct.to_string(),
            ])
            .arg("--control")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        detach(&mut cmd);
        let child = cmd.spawn().context("start the WAN relay")?;
        let relay_pid = child.id();
        reap(child);
        wait_until(Duration::from_secs(10), || wan::stats(&sock).is_ok()).with_context(|| {
            format!(
                "the WAN relay did not come up; see {}",
                self.dir().join("wan.log").display()
            )
        })?;
        // A new link passes nothing until the kernel activates its queue (link-watch runs up to
        // a second later): wait until site a reaches site b through the relay, which also
        // resolves ARP so the first measurement is not a second late.
        wait_until(Duration::from_secs(10), || {
            sh::run_in(
                &self.site_ns(Site::A),
                "busybox",
                &["ping", "-c", "1", "-W", "1", Site::B.underlay_ip()],
            )
            .is_ok()
        })
        .context("site a cannot reach site b through the WAN relay")?;
        crate::pki::create(&self.pki_dir())?;
        let controllers = services.controller_sites();
        let database = if services.postgres {
            crate::postgres::start(self)?;
            crate::postgres::url()
        } else {
            crate::controller::sqlite_database(self)
                .display()
                .to_string()
        };
        for &site in &controllers {
            crate::controller::start(
                self,
                ferry_exe,
                site,
                &database,
                &link,
                services
                    .overload_mib
                    .map(|_| !services.overload_migrate_only),
            )?;
        }
        for site in Site::ALL {
            let mem_mib = services.overload_mib.unwrap_or(1024);
            crate::agents::start(
                self,
                site,
                ferry_exe,
                Some(link.rate_mbit),
                link.agents_without_net_admin,
                &controllers,
                mem_mib,
            )?;
            if libvirt {
                crate::libvirt::start(self, site)?;
            }
        }
        let state = LabState {
            name: self.name.clone(),
            link,
            relay_pid,
        };
        fs::write(self.state_path(), serde_json::to_string_pretty(&state)?)?;
        Ok(state)
    }

    /// What a stateful middlebox on the WAN path does when it loses its state (a firewall or
    /// NAT restarting, a route moving): every TCP connection between the sites is torn down,
    /// at both ends, and their owners see the connection aborted. The guests' own traffic
    /// (inside the VXLAN) is not touched. Returns how many sockets were aborted.
    pub fn reset_wan_connections(&self) -> Result<usize> {
        self.state()?;
        let mut aborted = 0;
        for site in [Site::A, Site::B] {
            let out = sh::run_in(
                &self.site_ns(site),
                "ss",
                &["-K", "-t", "dst", site.other().underlay_ip()],
            )?;
            // ss lists what it killed under a header line.
            aborted += out.lines().skip(1).filter(|l| !l.trim().is_empty()).count();
        }
        Ok(aborted)
    }

    /// Kills every process in the lab's namespaces (VMs, relay, clients), removes the namespaces
    /// and the runtime directory. Without `force`, a lab that is not up is an error.
    pub fn down(&self, force: bool) -> Result<()> {
        require_root()?;
        let existing = self.existing_namespaces()?;
        if !force && existing.is_empty() && !self.state_path().exists() {
            bail!("lab {:?} is not up; nothing to take down", self.name);
        }
        for ns in &existing {
            kill_namespace_processes(ns);
        }
        for ns in &existing {
            sh::run("ip", &["netns", "del", ns])?;
        }
        let dir = self.dir();
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
        }
        crate::vm::remove_lab_files(self);
        Ok(())
    }
}

/// Kills the processes in `ns` and waits (bounded) until they are gone.
fn kill_namespace_processes(ns: &str) {
    let pids = || -> Vec<i32> {
        sh::run("ip", &["netns", "pids", ns])
            .map(|o| {
                o.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    // Listed and killed until none is left: one started meanwhile (a QEMU being launched as
    // the lab comes down) is found at the next look.
    let _ = wait_until(Duration::from_secs(5), || {
        let left = pids();
        for &pid in &left {
            // SAFETY: kill(2) with a pid read from `ip netns pids`; a stale pid only fails.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        left.is_empty()
    });
}

/// Fails unless running as root.
pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the lab needs root (network namespaces, taps); run as root");
    }
    Ok(())
}

/// Puts the child in its own session so it outlives the CLI and is not hit by its signals.
pub fn detach(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setsid is async-signal-safe and touches nothing shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
}

/// Waits for a detached child on a thread of its own, so that a long-lived process (bench,
/// demo) that outlives it does not collect zombies. A CLI that exits first leaves the child to
/// init, as before.
pub fn reap(mut child: std::process::Child) {
    let _ = std::thread::Builder::new()
        .name("reaper".into())
        .spawn(move || child.wait());
}

/// Polls `cond` every 20 ms until it holds or `deadline` passes.
pub fn wait_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> Result<()> {
    let start = Instant::now();
    loop {
        if cond() {
            return Ok(());
        }
        if start.elapsed() > deadline {
            bail!("timed out after {:.1}s", deadline.as_secs_f64());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
