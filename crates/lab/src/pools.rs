//! Ports on a site's pool bridges for the tests and benchmarks: a network namespace of its
//! own (`<lab>-p-<name>`, removed with the lab) with one interface on the pool's bridge at a
//! site, where a client of a pool's VMs runs ([`crate::tcpseq`]).

use anyhow::{Context, Result};

use crate::sh;
use crate::topology::{Lab, Site};

/// A port on a pool's bridge; dropping it removes it.
pub struct PoolPort {
    /// The namespace the client runs in.
    pub ns: String,
    /// Its MAC, as the pool's bridges learn it.
    pub mac: String,
}

impl PoolPort {
    /// A port named `name` on `bridge` at `site` with address `ip_cidr` and MAC `mac`. The
    /// bridge must exist (the pool's endpoint is up at the site).
    pub fn attach(
        lab: &Lab,
        site: Site,
        bridge: &str,
        name: &str,
        mac: &str,
        ip_cidr: &str,
    ) -> Result<PoolPort> {
        let ns = lab.pool_port_ns(name);
        let site_ns = lab.site_ns(site);
        // The site's end of the pair: at most 15 characters.
        let outer: String = format!("pp-{name}").chars().take(15).collect();
        let _ = sh::run("ip", &["netns", "del", &ns]);
        sh::run("ip", &["netns", "add", &ns])?;
        let port = PoolPort {
            ns: ns.clone(),
            mac: mac.to_owned(),
        };
        sh::ip_in(
            &site_ns,
            &format!("link add {outer} type veth peer name eth0 netns {ns}"),
        )
        .with_context(|| format!("a port on {bridge} at site {}", site.name()))?;
        sh::ip_in(&site_ns, &format!("link set {outer} master {bridge} up"))?;
        sh::ip_in(&ns, "link set lo up")?;
        sh::ip_in(&ns, &format!("link set eth0 address {mac}"))?;
        sh::ip_in(&ns, &format!("addr add {ip_cidr} dev eth0"))?;
        sh::ip_in(&ns, "link set eth0 up")?;
        Ok(port)
    }

    /// The MAC the port's namespace resolved `ip` to (its ARP cache), if any.
    pub fn neighbour(&self, ip: &str) -> Option<String> {
        let out = sh::run_in(&self.ns, "ip", &["neigh", "show", ip]).ok()?;
        let words: Vec<&str> = out.split_whitespace().collect();
        let at = words.iter().position(|w| *w == "lladdr")?;
        words.get(at + 1).map(|m| (*m).to_owned())
    }
}

impl Drop for PoolPort {
    fn drop(&mut self) {
        // The pair's other end goes with the namespace.
        let _ = sh::run("ip", &["netns", "del", &self.ns]);
    }
}

/// The MACs `bridge` at `site` has learnt or been given: every source MAC of a frame that
/// ever reached it (within the bridge's ageing time, 300 s) is among them.
pub fn bridge_macs(lab: &Lab, site: Site, bridge: &str) -> Result<Vec<String>> {
    let out = sh::run_in(&lab.site_ns(site), "bridge", &["fdb", "show", "br", bridge])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// Whether interface `name` exists at `site`.
pub fn has_interface(lab: &Lab, site: Site, name: &str) -> bool {
    sh::run_in(&lab.site_ns(site), "ip", &["link", "show", "dev", name]).is_ok()
}
