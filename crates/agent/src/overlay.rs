//! This host's part in the fleet's virtual cloud pools (docs/fleet.md, "Pools"): for each pool
//! the controller's plan lists, a bridge the pool's VMs plug into and a VXLAN device
//! (`fx<VNI>`) joining it to the pool's other hosts; endpoints the plan no longer lists are
//! removed. The pool's frames never meet another pool's: each has its own bridge and network
//! identifier, so tenants may use the same addresses.
//!
//! Unless a pool learns (a plain VXLAN that finds a moved VM when the VM's own announcement
//! reaches it), the controller's plan also says where the pool's VMs on other hosts are: the
//! tunnel sends their frames straight there (a static entry per MAC) and the bridge sends them
//! to the tunnel. When a VM moves, the agents at both ends re-point its MACs at the switchover
//! (VirtualWire) without waiting for the controller: the source when the destination has the
//! whole verified stream ([`Overlay::departed`]), the destination when it delivered that stream
//! to QEMU ([`Overlay::arrived`]), so that frames for the VM queue at its new tap while it
//! resumes instead of reaching the paused one. Such a re-pointing outranks the plan until the
//! plan stops listing the move (the controller learnt its end).
//!
//! Done with iproute2's `ip` and `bridge`, as an operator would; each change is idempotent, so
//! a plan applied twice or after a restart changes nothing more.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use ferry_api::fleet::{EndpointPlan, OverlayPlan, OverlayReport};
use serde::Deserialize;

use crate::config::OverlayConfig;

/// The MAC of VXLAN's flooding entries: broadcast and unknown frames go to every such `dst`.
const FLOOD: &str = "00:00:00:00:00:00";
/// ferry's VXLAN devices: `fx<VNI>`.
const DEVICE_PREFIX: &str = "fx";

/// This host's pool endpoints.
pub struct Overlay {
    config: OverlayConfig,
    own_name: String,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    plan: OverlayPlan,
    /// Pools whose endpoint is as the plan says.
    ready: BTreeSet<String>,
    /// MACs re-pointed at a switchover, by MAC: where they are now (None: here), and the
    /// move (from, to) that put them there.
    repointed: BTreeMap<String, Repointed>,
}

#[derive(Debug, Clone)]
struct Repointed {
    to_address: Option<String>,
    from: String,
    to: String,
}

/// One row of `bridge -j fdb show dev fx<VNI>`.
#[derive(Debug, Deserialize)]
struct FdbEntry {
    mac: String,
    #[serde(default)]
    dst: Option<String>,
    #[serde(default)]
    master: Option<String>,
    #[serde(default)]
    state: String,
}

fn device(vni: u32) -> String {
    format!("{DEVICE_PREFIX}{vni}")
}

impl Overlay {
    pub fn new(config: OverlayConfig, own_name: String) -> Overlay {
        Overlay {
            config,
            own_name,
            state: Mutex::default(),
        }
    }

    /// What the heartbeat says of it.
    pub fn report(&self) -> OverlayReport {
        OverlayReport {
            address: self.config.address.to_string(),
            ready: self
                .state
                .lock()
                .expect("overlay lock")
                .ready
                .iter()
                .cloned()
                .collect(),
        }
    }

    /// Makes this host's endpoints what `plan` says; an endpoint that cannot be made is
    /// reported not ready (and logged), the others go on.
    pub async fn apply(&self, plan: OverlayPlan) {
        // A re-pointing stands while the plan still lists its move; after that, the plan.
        {
            let mut state = self.state.lock().expect("overlay lock");
            state.repointed.retain(|mac, r| {
                plan.endpoints.iter().any(|e| {
                    e.moving
                        .iter()
                        .any(|m| &m.mac == mac && m.from == r.from && m.to == r.to)
                })
            });
        }
        if let Err(e) = self.remove_unplanned(&plan).await {
            tracing::warn!("removing pool endpoints no longer needed: {e:#}");
        }
        let mut ready = BTreeSet::new();
        for endpoint in &plan.endpoints {
            match self.make(endpoint).await {
                Ok(()) => {
                    ready.insert(endpoint.pool.clone());
                }
                Err(e) => tracing::warn!("pool {}'s endpoint: {e:#}", endpoint.pool),
            }
        }
        let mut state = self.state.lock().expect("overlay lock");
        for pool in ready.difference(&state.ready) {
            tracing::info!("pool {pool}'s endpoint is up");
        }
        state.ready = ready;
        state.plan = plan;
    }

    /// The source's side of a switchover to `peer`: the moving VMs' MACs now go there.
    pub async fn departed(&self, peer: &str) {
        self.repoint(|from, to| from == self.own_name && to == peer)
            .await;
    }

    /// The destination's side of a switchover from `peer`: the moving VMs' MACs are here.
    pub async fn arrived(&self, peer: &str) {
        self.repoint(|from, to| from == peer && to == self.own_name)
            .await;
    }

    async fn repoint(&self, this_move: impl Fn(&str, &str) -> bool) {
        let changes: Vec<(String, String, Repointed)> = {
            let mut state = self.state.lock().expect("overlay lock");
            let mut changes = Vec::new();
            for endpoint in state.plan.endpoints.iter().filter(|e| e.repoint) {
                for m in endpoint.moving.iter().filter(|m| this_move(&m.from, &m.to)) {
                    let to_address = if m.to == self.own_name {
                        None
                    } else {
                        match endpoint.remotes.iter().find(|r| r.host == m.to) {
                            Some(r) => Some(r.address.clone()),
                            None => {
                                tracing::warn!(
                                    "pool {}: {} moves to {}, which has no endpoint in the plan",
                                    endpoint.pool,
                                    m.mac,
                                    m.to
                                );
                                continue;
                            }
                        }
                    };
                    let r = Repointed {
                        to_address,
                        from: m.from.clone(),
                        to: m.to.clone(),
                    };
                    changes.push((device(endpoint.vni), m.mac.clone(), r));
                }
            }
            for (_, mac, r) in &changes {
                state.repointed.insert(mac.clone(), r.clone());
            }
            if changes.is_empty() {
                tracing::debug!(
                    "a switchover with no pool MAC to re-point (plan: {:?})",
                    state.plan
                );
            }
            changes
        };
        for (dev, mac, r) in changes {
            let result = match &r.to_address {
                Some(address) => point_remote(&dev, &mac, address).await,
                None => point_here(&dev, &mac).await,
            };
            match result {
                Ok(()) => tracing::info!(
                    "{mac} re-pointed to {} at the switchover",
                    r.to_address.as_deref().unwrap_or("this host")
                ),
                Err(e) => tracing::warn!("re-pointing {mac}: {e:#}"),
            }
        }
    }

    /// Removes ferry's VXLAN devices whose pool the plan does not list, and their bridges
    /// when nothing else is plugged in.
    async fn remove_unplanned(&self, plan: &OverlayPlan) -> Result<()> {
        let planned: BTreeSet<String> = plan.endpoints.iter().map(|e| device(e.vni)).collect();
        for (dev, bridge) in vxlan_devices().await? {
            if planned.contains(&dev) {
                continue;
            }
            ip(&["link", "del", "dev", &dev]).await?;
            tracing::info!("pool endpoint {dev} removed: no VM of its pool needs it here");
            if let Some(bridge) = bridge {
                let ports = std::fs::read_dir(format!("/sys/class/net/{bridge}/brif"))
                    .map(|d| d.count())
                    .unwrap_or(0);
                if ports == 0 {
                    ip(&["link", "del", "dev", &bridge]).await?;
                } else {
                    tracing::warn!("bridge {bridge} kept: {ports} interface(s) still on it");
                }
            }
        }
        Ok(())
    }

    /// One endpoint as planned: bridge, tunnel, flooding list and directory.
    async fn make(&self, e: &EndpointPlan) -> Result<()> {
        let dev = device(e.vni);
        let bridge_dir = format!("/sys/class/net/{}", e.bridge);
        if !Path::new(&bridge_dir).exists() {
            ip(&["link", "add", "name", &e.bridge, "type", "bridge"]).await?;
        } else if !Path::new(&bridge_dir).join("bridge").exists() {
            bail!("{} exists and is not a bridge", e.bridge);
        }
        ip(&["link", "set", "dev", &e.bridge, "up"]).await?;
        if !Path::new(&format!("/sys/class/net/{dev}")).exists() {
            let (vni, local, port) = (
                e.vni.to_string(),
                self.config.address.to_string(),
                self.config.port.to_string(),
            );
            let mut args = vec![
                "link", "add", "name", &dev, "type", "vxlan", "id", &vni, "local", &local,
                "dstport", &port,
            ];
            if let Some(device) = &self.config.device {
                args.extend(["dev", device.as_str()]);
            }
            if !e.learning {
                args.push("nolearning");
            }
            ip(&args).await?;
        }
        ip(&["link", "set", "dev", &dev, "master", &e.bridge, "up"]).await?;

        let entries = fdb(&dev).await?;
        // Broadcast and unknown frames: to every other endpoint of the pool.
        let want: BTreeSet<&str> = e.remotes.iter().map(|r| r.address.as_str()).collect();
        let have: BTreeSet<&str> = entries
            .iter()
            .filter(|f| f.mac == FLOOD && f.master.is_none())
            .filter_map(|f| f.dst.as_deref())
            .collect();
        for dst in want.difference(&have) {
            bridge(&["fdb", "append", FLOOD, "dev", &dev, "dst", dst]).await?;
        }
        for dst in have.difference(&want) {
            bridge(&["fdb", "del", FLOOD, "dev", &dev, "dst", dst]).await?;
        }
        if e.learning {
            return Ok(());
        }
        // The directory: each remote VM's MAC to its host's endpoint, re-pointings first.
        let repointed = self.state.lock().expect("overlay lock").repointed.clone();
        let mut want: BTreeMap<&str, &str> = BTreeMap::new();
        for m in &e.macs {
            if let Some(r) = e.remotes.iter().find(|r| r.host == m.host) {
                want.insert(&m.mac, &r.address);
            }
        }
        for (mac, r) in &repointed {
            want.remove(mac.as_str());
            if let Some(address) = &r.to_address {
                if e.moving.iter().any(|m| &m.mac == mac) {
                    want.insert(mac, address);
                }
            }
        }
        let tunnel: BTreeMap<&str, &str> = entries
            .iter()
            .filter(|f| f.mac != FLOOD && f.master.is_none())
            .filter_map(|f| Some((f.mac.as_str(), f.dst.as_deref()?)))
            .collect();
        for (mac, address) in &want {
            if tunnel.get(mac) != Some(address) {
                tracing::info!("pool {}: {mac} is at {address}", e.pool);
                point_remote(&dev, mac, address).await?;
            }
        }
        let steered: BTreeSet<&str> = entries
            .iter()
            .filter(|f| f.master.is_some() && f.state == "static")
            .map(|f| f.mac.as_str())
            .collect();
        for mac in steered.iter().filter(|m| !want.contains_key(*m)) {
            bridge(&["fdb", "del", mac, "dev", &dev, "master"]).await?;
        }
        for mac in tunnel.keys().filter(|m| !want.contains_key(*m)) {
            tracing::info!("pool {}: {mac} is no longer remote", e.pool);
            bridge(&["fdb", "del", mac, "dev", &dev, "self"]).await?;
        }
        for mac in want.keys().filter(|m| !steered.contains(*m)) {
            bridge(&["fdb", "replace", mac, "dev", &dev, "master", "static"]).await?;
        }
        Ok(())
    }
}

/// `mac` is on the endpoint at `address`: the tunnel sends its frames there and the bridge
/// sends them to the tunnel (a static entry outranks what it learnt on the VM's old tap).
async fn point_remote(dev: &str, mac: &str, address: &str) -> Result<()> {
    bridge(&[
        "fdb",
        "replace",
        mac,
        "dev",
        dev,
        "dst",
        address,
        "self",
        "permanent",
    ])
    .await?;
    bridge(&["fdb", "replace", mac, "dev", dev, "master", "static"]).await
}

/// `mac` is here now: no directory entries, so the bridge floods its frames to the local
/// ports (the VM's new tap among them) until it learns the VM's port from its first frame.
async fn point_here(dev: &str, mac: &str) -> Result<()> {
    let _ = bridge(&["fdb", "del", mac, "dev", dev, "master"]).await;
    let _ = bridge(&["fdb", "del", mac, "dev", dev, "self"]).await;
    Ok(())
}

/// ferry's VXLAN devices here, with the bridge each is on.
async fn vxlan_devices() -> Result<Vec<(String, Option<String>)>> {
    #[derive(Deserialize)]
    struct Link {
        ifname: String,
        #[serde(default)]
        master: Option<String>,
    }
    let out = run("ip", &["-j", "link", "show", "type", "vxlan"]).await?;
    let links: Vec<Link> = if out.trim().is_empty() {
        Vec::new()
    } else {
        serde_json::from_str(&out).context("ip -j link show: unexpected output")?
    };
    Ok(links
        .into_iter()
        .filter(|l| {
            l.ifname
                .strip_prefix(DEVICE_PREFIX)
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|l| (l.ifname, l.master))
        .collect())
}

async fn fdb(dev: &str) -> Result<Vec<FdbEntry>> {
    let out = run("bridge", &["-j", "fdb", "show", "dev", dev]).await?;
    if out.trim().is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_str(&out)
        .with_context(|| format!("bridge fdb show dev {dev}: unexpected output"))
}

async fn ip(args: &[&str]) -> Result<()> {
    run("ip", args).await.map(drop)
}

async fn bridge(args: &[&str]) -> Result<()> {
    run("bridge", args).await.map(drop)
}

async fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .with_context(|| format!("run {program} (iproute2)"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
