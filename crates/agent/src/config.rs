//! The agent's configuration: one TOML file (`ferry agent --config /etc/ferry/agent.toml`),
//! read into [`AgentConfig`] and checked whole before the agent binds anything.
//!
//! ```toml
//! name = "site-a"                        # the name this host's certificate carries
//! listen = "0.0.0.0:7070"                # where peer agents connect
//! api_socket = "/run/ferry/agent.sock"   # the local API (the CLI, libvirt's hooks)
//! work_dir = "/var/lib/ferry/work"       # sockets to and from QEMU
//! site = "dc1"                           # its data center, for the fleet (default: name)
//!
//! [tls]                                  # `ferry pki init` / `ferry pki issue site-a`
//! ca = "/etc/ferry/pki/ca.pem"
//! cert = "/etc/ferry/pki/site-a.pem"
//! key = "/etc/ferry/pki/site-a.key"
//!
//! [seeds]                                # memory images of VMs that left, for their return
//! dir = "/var/lib/ferry/seeds"
//! budget_mib = 8192                      # oldest images go first beyond this
//!
//! [limits]
//! outgoing = 4                           # migrations this agent sends at once
//!
//! [libvirt]                              # optional: `virsh migrate` over UNIX sockets
//! socket = "/run/libvirt/libvirt-sock"
//! tunnel_dir = "/run/ferry/libvirt"      # <dir>/<peer>/{rpc,mig,nbd,swap}.sock
//!
//! [qemu]                                 # optional: QEMU VMs its owner's tooling runs
//! qmp_dir = "/run/ferry/vms"             # <dir>/<name>.qmp is VM <name>'s monitor
//!                                        # (default: <work_dir>/vms)
//!
//! [host]                                 # optional: what this host offers VMs, for the
//! cpus = 32                              # fleet's planner (default: the machine's CPUs
//! mem_mib = 262144                       # and memory)
//! lend_mib = 4096                        # spare memory peers' VMs may swap to (default 0)
//!
//! [overlay]                              # optional: this host's part in virtual cloud pools
//! address = "192.0.2.11"                 # its VXLAN endpoint, reached by the other hosts
//! device = "eth1"                        # optional: the interface to send tunnels out of
//! port = 4789                            # optional: VXLAN's UDP port, the same fleet-wide
//!
//! [[controllers]]                        # optional: the fleet's controllers, tried in order
//! address = "192.0.2.5:7443"
//! name = "ctl1"
//!
//! [peers.site-b]                         # `ferry migrate ... --to site-b`
//! address = "192.0.2.10:7070"
//! rate_mbit = 1000                       # optional: the link's rate, for pacing and windows
//! ```
//!
//! Unknown keys are errors (a typo must not silently become a default), and every error names
//! the file, the line and the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferry_api::names::{check_address, valid_name};
use ferry_wire::tls::Identity;
use serde::Deserialize;

/// Where `ferry agent` and the CLI look when nothing else is said.
pub const DEFAULT_CONFIG: &str = "/etc/ferry/agent.toml";
/// The local API's socket when the file does not name one.
pub const DEFAULT_API_SOCKET: &str = "/run/ferry/agent.sock";

/// How an agent is set up.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// The name peers know this agent by (its certificate carries it).
    pub name: String,
    /// Where other agents connect (TCP, `host:port`).
    pub listen: String,
    /// The local API's unix socket.
    pub api_socket: PathBuf,
    /// Sockets to and from QEMU live here.
    pub work_dir: PathBuf,
    /// Memory images of VMs that left this host, for their return ([`crate::engine::seed_store`]).
    pub seed_dir: PathBuf,
    /// The most bytes of seed images kept; the oldest go first beyond it.
    pub seed_budget_bytes: u64,
    pub identity: Identity,
    /// Migrations this agent sends at once; more are refused (each holds a QEMU's migration
    /// and its codec's dictionaries, some hundreds of MB).
    pub max_outgoing: usize,
    /// The agents this one may migrate to, by name.
    pub peers: BTreeMap<String, PeerConfig>,
    /// libvirt on this host, for `virsh migrate` over UNIX sockets ([`crate::tunnel`]).
    pub libvirt: Option<LibvirtConfig>,
    /// The site (data center) this host is in, as the fleet controller groups hosts.
    pub site: String,
    /// Where Prometheus scrapes `/metrics` over plain HTTP (read-only; none: only on the API
    /// socket).
    pub metrics_listen: Option<String>,
    /// The fleet's controllers this agent heartbeats to, in the order it tries them (none:
    /// no fleet; [`crate::fleet`]).
    pub controllers: Vec<ControllerLink>,
    /// This host's tunnel endpoint for the fleet's pools (none: it takes no part in them).
    pub overlay: Option<OverlayConfig>,
    /// The bare QEMU VMs' monitors: `<dir>/<name>.qmp` is VM `<name>`, reported to the
    /// controller and movable by it; VMs this agent receives and starts get theirs here
    /// ([`crate::engine::monitor_dir`]).
    pub qmp_dir: PathBuf,
    /// What this host offers VMs, when the config says (else the machine's, [`crate::fleet`]).
    pub capacity: Option<ferry_api::fleet::HostCapacity>,
    /// The memory this host lends peers' VMs as swap ([`crate::lend`]), in bytes.
    pub lend_bytes: u64,
}

/// `[host]`: what this host offers VMs.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct HostSection {
    cpus: Option<u32>,
    mem_mib: Option<u64>,
    #[serde(default)]
    lend_mib: u64,
}

/// `[qemu]`: the host's QEMU VMs that libvirt does not run.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct QemuSection {
    qmp_dir: Option<PathBuf>,
}

/// This host's VXLAN tunnel endpoint ([`crate::overlay`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverlayConfig {
    /// The address other hosts send the pools' frames to (one of this host's).
    pub address: std::net::IpAddr,
    /// The interface tunnels leave by (none: the route to each peer decides).
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default = "default_vxlan_port")]
    pub port: u16,
}

fn default_vxlan_port() -> u16 {
    4789
}

/// A fleet controller this agent reports to and takes migrations from.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerLink {
    /// `host:port` of its mutual-TLS listener.
    pub address: String,
    /// The name its certificate carries (checked, like a peer's).
    pub name: String,
}

/// libvirt on this host.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LibvirtConfig {
    /// Its daemon's socket (libvirtd's, or virtqemud's on modular installs).
    #[serde(default = "default_libvirt_socket")]
    pub socket: PathBuf,
    /// Where the tunnels' sockets are: `<dir>/<peer>/{rpc,mig,nbd,swap}.sock`, the paths `virsh
    /// migrate` names; the same on every host of the fleet.
    #[serde(default = "default_tunnel_dir")]
    pub tunnel_dir: PathBuf,
}

fn default_libvirt_socket() -> PathBuf {
    PathBuf::from("/run/libvirt/libvirt-sock")
}

fn default_tunnel_dir() -> PathBuf {
    PathBuf::from("/run/ferry/libvirt")
}

/// Another agent this one knows.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// `host:port` of its peer endpoint.
    pub address: String,
    /// The link's rate, if known: sizes the send window and paces the connections.
    #[serde(default)]
    pub rate_mbit: Option<f64>,
}

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the agent's config {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("{path}: {key}: {problem}")]
    Invalid {
        path: PathBuf,
        key: String,
        problem: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    name: String,
    listen: String,
    #[serde(default)]
    api_socket: Option<PathBuf>,
    work_dir: PathBuf,
    tls: Identity,
    #[serde(default)]
    seeds: Seeds,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    peers: BTreeMap<String, PeerConfig>,
    #[serde(default)]
    libvirt: Option<LibvirtConfig>,
    #[serde(default)]
    site: Option<String>,
    #[serde(default)]
    controllers: Vec<ControllerLink>,
    #[serde(default)]
    metrics_listen: Option<String>,
    #[serde(default)]
    overlay: Option<OverlayConfig>,
    #[serde(default)]
    qemu: QemuSection,
    #[serde(default)]
    host: HostSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Seeds {
    dir: Option<PathBuf>,
    budget_mib: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limits {
    outgoing: Option<usize>,
}

/// 8 GiB of seed images: sixteen 512 MiB guests' worth.
const DEFAULT_SEED_BUDGET_MIB: u64 = 8192;
/// Four migrations out at once: each holds its codec's dictionaries (~360 MB at most).
const DEFAULT_MAX_OUTGOING: usize = 4;

impl AgentConfig {
    /// Reads and checks the file at `path`.
    pub fn load(path: &Path) -> Result<AgentConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        AgentConfig::parse(&text, path)
    }

    /// Parses `text` (read from `path`, which errors name) and checks every value.
    pub fn parse(text: &str, path: &Path) -> Result<AgentConfig, ConfigError> {
        let file: File = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            path: path.to_owned(),
            // toml's message names the line, the column and the key; one line of it is enough.
            message: e.to_string().trim().replace('\n', " ").replace("  ", " "),
        })?;
        let invalid = |key: &str, problem: String| ConfigError::Invalid {
            path: path.to_owned(),
            key: key.to_owned(),
            problem,
        };
        if !valid_name(&file.name) {
            return Err(invalid(
                "name",
                format!(
                    "{:?} is not a host name (letters, digits, '-', '.')",
                    file.name
                ),
            ));
        }
        check_address(&file.listen).map_err(|p| invalid("listen", p))?;
        if let Some(site) = &file.site {
            if !valid_name(site) {
                return Err(invalid(
                    "site",
                    format!("{site:?} is not a site's name (letters, digits, '-', '.')"),
                ));
            }
        }
        if let Some(address) = &file.metrics_listen {
            check_address(address).map_err(|p| invalid("metrics_listen", p))?;
        }
        for link in &file.controllers {
            check_address(&link.address).map_err(|p| invalid("controllers.address", p))?;
            if !valid_name(&link.name) {
                return Err(invalid(
                    "controllers.name",
                    format!("{:?} is not a certificate's name", link.name),
                ));
            }
        }
        if let Some(overlay) = &file.overlay {
            if overlay.port == 0 {
                return Err(invalid("overlay.port", "0 is not a UDP port".into()));
            }
            if let Some(device) = &overlay.device {
                if device.is_empty() || device.len() > 15 || device.contains(['/', ' ']) {
                    return Err(invalid(
                        "overlay.device",
                        format!("{device:?} is not a network interface's name"),
                    ));
                }
            }
        }
        for (name, peer) in &file.peers {
            if !valid_name(name) {
                return Err(invalid(
                    &format!("peers.{name}"),
                    "a peer's name is the name its certificate carries (letters, digits, '-', '.')"
                        .into(),
                ));
            }
            if name == &file.name {
                return Err(invalid(
                    &format!("peers.{name}"),
                    "this agent itself is not a peer".into(),
                ));
            }
            check_address(&peer.address)
                .map_err(|p| invalid(&format!("peers.{name}.address"), p))?;
            if let Some(rate) = peer.rate_mbit {
                if !(0.1..=1_000_000.0).contains(&rate) {
                    return Err(invalid(
                        &format!("peers.{name}.rate_mbit"),
                        format!("{rate} is out of range; use 0.1 to 1000000"),
                    ));
                }
            }
        }
        let qmp_dir = file
            .qemu
            .qmp_dir
            .unwrap_or_else(|| file.work_dir.join("vms"));
        // QEMU's `-qmp unix:PATH,server=on` would split a path at its commas.
        if qmp_dir.to_string_lossy().contains(',') {
            return Err(invalid(
                "qemu.qmp_dir",
                format!(
                    "{} has a comma, which QEMU's options cannot take",
                    qmp_dir.display()
                ),
            ));
        }
        for (key, p) in [
            ("work_dir", &file.work_dir),
            ("qemu.qmp_dir", &qmp_dir),
            ("tls.ca", &file.tls.ca),
            ("tls.cert", &file.tls.cert),
            ("tls.key", &file.tls.key),
        ] {
            if !p.is_absolute() {
                return Err(invalid(
                    key,
                    format!("{} is not an absolute path", p.display()),
                ));
            }
        }
        let outgoing = file.limits.outgoing.unwrap_or(DEFAULT_MAX_OUTGOING);
        if !(1..=64).contains(&outgoing) {
            return Err(invalid(
                "limits.outgoing",
                format!("{outgoing} is out of range; use 1 to 64"),
            ));
        }
        let budget_mib = file.seeds.budget_mib.unwrap_or(DEFAULT_SEED_BUDGET_MIB);
        let capacity = match (file.host.cpus, file.host.mem_mib) {
            (None, None) => None,
            (Some(cpus), Some(mem_mib)) if cpus > 0 && mem_mib > 0 => {
                Some(ferry_api::fleet::HostCapacity {
                    cpus,
                    mem_bytes: mem_mib.saturating_mul(1 << 20),
                    lend_bytes: 0,
                })
            }
            _ => {
                return Err(invalid(
                    "host",
                    "give both cpus and mem_mib, above zero (or neither: the machine's)".into(),
                ))
            }
        };
        Ok(AgentConfig {
            listen: file.listen,
            api_socket: file
                .api_socket
                .unwrap_or_else(|| PathBuf::from(DEFAULT_API_SOCKET)),
            seed_dir: file
                .seeds
                .dir
                .unwrap_or_else(|| file.work_dir.join("seeds")),
            work_dir: file.work_dir,
            seed_budget_bytes: budget_mib.saturating_mul(1 << 20),
            identity: file.tls,
            max_outgoing: outgoing,
            peers: file.peers,
            libvirt: file.libvirt,
            // A host alone in its data center needs no site name: its own will do.
            site: file.site.unwrap_or_else(|| file.name.clone()),
            controllers: file.controllers,
            metrics_listen: file.metrics_listen,
            overlay: file.overlay,
            qmp_dir,
            capacity,
            lend_bytes: file.host.lend_mib.saturating_mul(1 << 20),
            name: file.name,
        })
    }

    /// The peer named `name`, or an error that lists the known ones.
    pub fn peer(&self, name: &str) -> Result<&PeerConfig, UnknownPeer> {
        self.peers.get(name).ok_or_else(|| UnknownPeer {
            name: name.to_owned(),
            known: self.peers.keys().cloned().collect(),
        })
    }
}

/// A migration names a peer the agent's config does not list.
#[derive(Debug, Clone, thiserror::Error)]
#[error("no peer {name:?} in this agent's config (known: {}); add a [peers.{name}] section with its address", if known.is_empty() { "none".to_owned() } else { known.join(", ") })]
pub struct UnknownPeer {
    pub name: String,
    pub known: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "site-a"
listen = "0.0.0.0:7070"
work_dir = "/var/lib/ferry/work"

[tls]
ca = "/etc/ferry/pki/ca.pem"
cert = "/etc/ferry/pki/site-a.pem"
key = "/etc/ferry/pki/site-a.key"

[peers.site-b]
address = "192.0.2.10:7070"
rate_mbit = 100
"#;

    fn parse(text: &str) -> Result<AgentConfig, String> {
        AgentConfig::parse(text, Path::new("/etc/ferry/agent.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn a_minimal_file_gets_the_defaults() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.name, "site-a");
        assert_eq!(c.api_socket, Path::new(DEFAULT_API_SOCKET));
        assert_eq!(c.seed_dir, Path::new("/var/lib/ferry/work/seeds"));
        assert_eq!(c.qmp_dir, Path::new("/var/lib/ferry/work/vms"));
        assert_eq!(c.seed_budget_bytes, 8 << 30);
        assert_eq!(c.max_outgoing, 4);
        assert_eq!(c.peer("site-b").unwrap().rate_mbit, Some(100.0));
        // Alone in its data center, a host is its own site; without controllers, no fleet.
        assert_eq!(c.site, "site-a");
        assert!(c.controllers.is_empty());
    }

    #[test]
    fn a_typo_is_named_with_its_line() {
        let err = parse(&GOOD.replace("listen =", "lisen =")).unwrap_err();
        assert!(err.starts_with("/etc/ferry/agent.toml: "), "{err}");
        assert!(err.contains("unknown field `lisen`"), "{err}");
        assert!(err.contains("line 3"), "{err}");
    }

    #[test]
    fn bad_values_name_their_key() {
        assert_eq!(
            parse(&GOOD.replace("192.0.2.10:7070", "192.0.2.10")).unwrap_err(),
            "/etc/ferry/agent.toml: peers.site-b.address: \"192.0.2.10\" is not host:port (e.g. 192.0.2.10:7070)"
        );
        assert_eq!(
            parse(&GOOD.replace("\"/var/lib/ferry/work\"", "\"work\"")).unwrap_err(),
            "/etc/ferry/agent.toml: work_dir: work is not an absolute path"
        );
        assert_eq!(
            parse(&format!("{GOOD}\n[limits]\noutgoing = 0\n")).unwrap_err(),
            "/etc/ferry/agent.toml: limits.outgoing: 0 is out of range; use 1 to 64"
        );
        assert!(parse(&GOOD.replace("[peers.site-b]", "[peers.site-a]"))
            .unwrap_err()
            .contains("this agent itself is not a peer"));
        assert_eq!(
            parse(&format!("{GOOD}\n[[controllers]]\naddress = \"ctl\"\nname = \"ctl1\"\n"))
                .unwrap_err(),
            "/etc/ferry/agent.toml: controllers.address: \"ctl\" is not host:port (e.g. 192.0.2.10:7070)"
        );
        assert_eq!(
            parse(&format!("{GOOD}\n[qemu]\nqmp_dir = \"vms\"\n")).unwrap_err(),
            "/etc/ferry/agent.toml: qemu.qmp_dir: vms is not an absolute path"
        );
        assert_eq!(
            parse(&format!("{GOOD}\n[host]\ncpus = 4\n")).unwrap_err().to_string(),
            "/etc/ferry/agent.toml: host: give both cpus and mem_mib, above zero (or neither: the machine's)"
        );
        let c = parse(&format!("{GOOD}\n[host]\ncpus = 4\nmem_mib = 2048\n")).unwrap();
        assert_eq!(
            c.capacity.map(|c| (c.cpus, c.mem_bytes)),
            Some((4, 2048 << 20))
        );
        assert!(parse(&format!("{GOOD}\n[qemu]\nqmp_dir = \"/run/a,b\"\n"))
            .unwrap_err()
            .contains("qemu.qmp_dir: /run/a,b has a comma"));
        let missing = parse(&GOOD.replace("name = \"site-a\"\n", "")).unwrap_err();
        assert!(missing.contains("missing field `name`"), "{missing}");
    }

    #[test]
    fn the_example_in_the_repository_is_valid() {
        let text = include_str!("../../../contrib/agent.toml");
        let c = parse(text).unwrap();
        assert_eq!(c.name, "dc1-host7");
        assert_eq!(c.site, "dc1");
        assert_eq!(c.metrics_listen.as_deref(), Some("127.0.0.1:9477"));
        assert_eq!(c.peer("dc2-host3").unwrap().rate_mbit, Some(1000.0));
        assert_eq!(c.controllers.len(), 1);
        assert_eq!(c.controllers[0].name, "ctl1");
        assert_eq!(c.qmp_dir, Path::new("/run/ferry/vms"));
        let overlay = c.overlay.unwrap();
        assert_eq!(overlay.address.to_string(), "198.51.100.17");
        assert_eq!(
            (overlay.device.as_deref(), overlay.port),
            (Some("eth1"), 4789)
        );
    }

    #[test]
    fn a_bad_overlay_names_its_key() {
        let err = parse(&format!("{GOOD}\n[overlay]\naddress = \"not-an-ip\"\n")).unwrap_err();
        assert!(
            err.to_string().contains("address = \"not-an-ip\"")
                && err.to_string().contains("invalid IP address"),
            "{err}"
        );
        let err = parse(&format!(
            "{GOOD}\n[overlay]\naddress = \"10.0.0.1\"\nport = 0\n"
        ))
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "/etc/ferry/agent.toml: overlay.port: 0 is not a UDP port"
        );
        let err = parse(&format!(
            "{GOOD}\n[overlay]\naddress = \"10.0.0.1\"\ndevice = \"a-device-name-too-long\"\n"
        ))
        .unwrap_err();
        assert!(err.to_string().contains("overlay.device"), "{err}");
    }

    #[test]
    fn an_unknown_peer_lists_the_known_ones() {
        let c = parse(GOOD).unwrap();
        assert_eq!(
            c.peer("site-c").unwrap_err().to_string(),
            "no peer \"site-c\" in this agent's config (known: site-b); add a [peers.site-c] section with its address"
        );
    }
}
