//! Swap on a peer's memory for a libvirt domain here: the borrowing side of Overdriver's
//! cooperative swap ([`crate::lend`] is the lending side). While a host's memory is overloaded
//! for a short while, a VM pages out to a peer's spare RAM instead of migrating.
//!
//! Taking swap: the domain gets a virtio disk hot-plugged whose NBD source is the peer's swap
//! tunnel socket (`<tunnel dir>/<peer>/swap.sock`, carried by [`crate::tunnel`]); the guest's
//! agent (qemu-guest-agent, `guest-exec`) makes it swap (`mkswap`, `swapon` on the disk whose
//! serial is `ferry-swap`); then the balloon takes the guest down to the memory it may keep.
//! Giving it back runs the other way: the balloon returns the guest's memory, `swapoff` pages
//! everything back in, the disk is unplugged, and the peer frees the loan with its connection.
//!
//! The guest's agent is required: swap pulled from under a guest loses its pages, so a guest
//! that cannot be asked to swap off never gets swap. Every step that fails undoes the ones
//! before it, and the domain keeps running as it was.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use ferry_api::agent::{SwapRequest, SwapStatus};
use serde_json::json;

use crate::config::AgentConfig;
use crate::engine::control::TunnelKind;
use crate::libvirt::Libvirt;
use crate::refusal::Refusal;
use crate::tunnel::{socket_path, Tunnels};

/// The serial the swap disk carries, by which the guest finds it.
pub const SWAP_SERIAL: &str = "ferry-swap";
/// The smallest swap and the least memory the balloon leaves a guest.
pub const MIN_SWAP_BYTES: u64 = 16 << 20;
pub const MIN_MEMORY_BYTES: u64 = 32 << 20;
/// How long the guest may take to see the hot-plugged disk and swap on it (a PCIe hot-plug
/// under software emulation takes seconds).
const SWAPON_WAIT: Duration = Duration::from_secs(60);
/// How long the guest may take to page everything back in (the swap's size over the WAN).
const SWAPOFF_WAIT: Duration = Duration::from_secs(600);
/// How long the guest may take to let the unplugged disk go.
const UNPLUG_WAIT: Duration = Duration::from_secs(60);
/// How long the guest's balloon may take to return its memory.
const BALLOON_WAIT: Duration = Duration::from_secs(60);
/// How long QEMU holds the guest's swap requests while it reconnects a broken swap connection
/// (this agent restarted, the session gave up on the WAN); the lender keeps the pages longer
/// ([`crate::lend::KEEP_DETACHED`]).
const RECONNECT_DELAY_S: u64 = 60;
/// Exit code of [`SWAPON`] while the disk is not visible in the guest yet.
const NOT_YET: i64 = 100;

/// Finds the swap disk by its serial, then swaps on it (the guest's own `mkswap`).
const SWAPON: &str = "for d in /sys/block/vd*; do \
    if [ \"$(cat $d/serial 2>/dev/null)\" = ferry-swap ]; then \
    n=/dev/${d##*/}; mkswap $n >/dev/null && swapon $n; exit $?; fi; done; exit 100";
/// Swaps off the swap disk, if the guest has it.
const SWAPOFF: &str = "for d in /sys/block/vd*; do \
    if [ \"$(cat $d/serial 2>/dev/null)\" = ferry-swap ]; then \
    n=/dev/${d##*/}; if grep -q \"^$n \" /proc/swaps; then swapoff $n; exit $?; fi; fi; done; exit 0";

/// The domains with swap on a peer, and those whose swap is being set up or given back.
#[derive(Default)]
pub struct Swaps {
    by_domain: Mutex<HashMap<String, Option<SwapStatus>>>,
}

impl Swaps {
    /// Whether `domain` has swap on a peer, or is taking or giving it back.
    pub fn has(&self, domain: &str) -> bool {
        self.by_domain
            .lock()
            .expect("swaps lock")
            .contains_key(domain)
    }

    pub fn list(&self) -> Vec<SwapStatus> {
        let by_domain = self.by_domain.lock().expect("swaps lock");
        let mut all: Vec<SwapStatus> = by_domain.values().flatten().cloned().collect();
        all.sort_by(|a, b| a.domain.cmp(&b.domain));
        all
    }

    /// Marks `domain` busy, or refuses when it has swap or a request for it runs.
    fn claim(&self, domain: &str, taking: bool) -> Result<Option<SwapStatus>, Refusal> {
        let mut by_domain = self.by_domain.lock().expect("swaps lock");
        match (by_domain.get(domain), taking) {
            (Some(None), _) => Err(Refusal::SwapBusy(domain.to_owned())),
            (Some(Some(_)), true) => Err(Refusal::SwapExists(domain.to_owned())),
            (None, false) => Err(Refusal::NoSwap(domain.to_owned())),
            (None, true) => {
                by_domain.insert(domain.to_owned(), None);
                Ok(None)
            }
            (Some(Some(status)), false) => {
                let status = status.clone();
                by_domain.insert(domain.to_owned(), None);
                Ok(Some(status))
            }
        }
    }

    /// Ends a claim: the domain has `status` now, or no swap.
    fn settle(&self, domain: &str, status: Option<SwapStatus>) {
        let mut by_domain = self.by_domain.lock().expect("swaps lock");
        match status {
            Some(s) => by_domain.insert(domain.to_owned(), Some(s)),
            None => by_domain.remove(domain),
        };
    }
}

/// Gives `domain` swap on a peer's memory ([module docs](self)).
pub async fn take(
    config: &AgentConfig,
    tunnels: Option<&Tunnels>,
    swaps: &Swaps,
    domain: &str,
    req: SwapRequest,
) -> Result<SwapStatus, Refusal> {
    let tunnels = tunnels.ok_or(Refusal::NoLibvirt)?;
    config.peer(&req.peer)?;
    if req.bytes < MIN_SWAP_BYTES || req.bytes > crate::lend::MAX_LOAN_BYTES {
        return Err(Refusal::SwapRequest(format!(
            "swap of {} MiB: use {} MiB to {} MiB",
            req.bytes >> 20,
            MIN_SWAP_BYTES >> 20,
            crate::lend::MAX_LOAN_BYTES >> 20
        )));
    }
    if req.bytes & ((1 << 20) - 1) != 0 {
        return Err(Refusal::SwapRequest(
            "give the swap's size in whole MiB".into(),
        ));
    }
    let libvirt = Libvirt::new(&tunnels.config.socket);
    crate::libvirt_migration::check_domain(&libvirt, domain).await?;
    let before_kib = libvirt
        .memory_kib(domain)
        .await
        .map_err(|e| Refusal::Swap(format!("{e:#}")))?;
    if req.memory_bytes < MIN_MEMORY_BYTES || req.memory_bytes >= before_kib << 10 {
        return Err(Refusal::SwapRequest(format!(
            "the balloon may leave domain {domain:?} {} MiB to {} MiB (it has {} MiB), not {} MiB",
            MIN_MEMORY_BYTES >> 20,
            (before_kib >> 10).saturating_sub(1),
            before_kib >> 10,
            req.memory_bytes >> 20
        )));
    }
    swaps.claim(domain, true)?;
    match attach_and_swap(&libvirt, tunnels, config, domain, &req, before_kib).await {
        Ok(status) => {
            swaps.settle(domain, Some(status.clone()));
            Ok(status)
        }
        Err(Failed { error, left }) => {
            // Undone, or (when undoing failed too) listed, so that `swap off` can try again.
            swaps.settle(domain, left);
            Err(Refusal::Swap(format!("{error:#}")))
        }
    }
}

/// Taking swap failed; what it left plugged in, if undoing failed too.
struct Failed {
    error: anyhow::Error,
    left: Option<SwapStatus>,
}

impl From<anyhow::Error> for Failed {
    fn from(error: anyhow::Error) -> Failed {
        Failed { error, left: None }
    }
}

/// Gives `domain`'s swap back ([module docs](self)); what it had.
pub async fn give_back(
    tunnels: Option<&Tunnels>,
    swaps: &Swaps,
    domain: &str,
) -> Result<SwapStatus, Refusal> {
    let tunnels = tunnels.ok_or(Refusal::NoLibvirt)?;
    let status = swaps
        .claim(domain, false)?
        .expect("claimed swap has a status");
    let libvirt = Libvirt::new(&tunnels.config.socket);
    let xml = device_file(&tunnels.config.tunnel_dir, domain);
    match release(&libvirt, &status, &xml).await {
        Ok(()) => {
            swaps.settle(domain, None);
            let _ = std::fs::remove_file(&xml);
            Ok(status)
        }
        Err(e) => {
            // Still swapping, or at least still holding the disk: it stays listed.
            swaps.settle(domain, Some(status));
            Err(Refusal::Swap(format!("{e:#}")))
        }
    }
}

async fn attach_and_swap(
    libvirt: &Libvirt,
    tunnels: &Tunnels,
    config: &AgentConfig,
    domain: &str,
    req: &SwapRequest,
    before_kib: u64,
) -> Result<SwapStatus, Failed> {
    // Without the guest's agent the swap could never be given back: ask before plugging.
    libvirt
        .guest_agent(domain, &json!({"execute": "guest-ping"}))
        .await
        .context("swap needs the guest's agent (qemu-guest-agent) to swap on and off")?;
    let targets = libvirt.disk_targets(domain).await?;
    let target = ('b'..='z')
        .map(|c| format!("vd{c}"))
        .find(|t| !targets.contains(t))
        .ok_or_else(|| anyhow!("domain {domain:?} has no free virtio disk name left"))?;
    let socket = socket_path(&tunnels.config, &req.peer, 0, TunnelKind::Swap);
    let xml = device_file(&tunnels.config.tunnel_dir, domain);
    std::fs::write(
        &xml,
        disk_xml(domain, req.bytes, &socket.to_string_lossy(), &target),
    )
    .with_context(|| format!("write {}", xml.display()))?;
    tunnels
        .failures
        .lock()
        .expect("failures lock")
        .remove(&req.peer);
    if let Err(e) = libvirt.hotplug(domain, &xml, true).await {
        let why = peer_refusal(tunnels, &req.peer).await;
        return Err(e
            .context(format!(
                "plugging swap from {} into {domain:?}{why}",
                req.peer
            ))
            .into());
    }
    let status = SwapStatus {
        domain: domain.to_owned(),
        peer: req.peer.clone(),
        bytes: req.bytes,
        memory_bytes: req.memory_bytes,
        memory_before_bytes: before_kib << 10,
        target,
    };
    let on = async {
        guest_run(libvirt, domain, SWAPON, SWAPON_WAIT).await?;
        libvirt.set_memory_kib(domain, req.memory_bytes >> 10).await
    };
    if let Err(error) = on.await {
        // Undo: its memory back, no swap, no disk.
        return Err(match release(libvirt, &status, &xml).await {
            Ok(()) => Failed { error, left: None },
            Err(undo) => Failed {
                error: anyhow!("{error:#}; undoing it failed too: {undo:#}"),
                left: Some(status),
            },
        });
    }
    tracing::info!(
        "domain {domain:?} swaps to {} ({} MiB), its balloon at {} MiB (agent {})",
        req.peer,
        req.bytes >> 20,
        req.memory_bytes >> 20,
        config.name
    );
    Ok(status)
}

/// Why the peer refused the swap tunnel, as its agent said (QEMU's error does not say); the
/// peer's Abort may still be on its way when QEMU's error is back.
async fn peer_refusal(tunnels: &Tunnels, peer: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    loop {
        if let Some(why) = tunnels.failures.lock().expect("failures lock").remove(peer) {
            return format!(" ({peer}: {why})");
        }
        if tokio::time::Instant::now() > deadline {
            return String::new();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Its memory back, swap off, disk out.
async fn release(libvirt: &Libvirt, status: &SwapStatus, xml: &Path) -> Result<()> {
    let domain = &status.domain;
    let before_kib = status.memory_before_bytes >> 10;
    libvirt
        .set_memory_kib(domain, before_kib)
        .await
        .context("giving the guest its memory back")?;
    // The balloon deflates as the guest gets to it: swapping off needs the room, and "given
    // back" means all of it.
    let deadline = tokio::time::Instant::now() + BALLOON_WAIT;
    loop {
        let now_kib = libvirt.memory_kib(domain).await?;
        if now_kib >= before_kib {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the guest's balloon gave back {} of its {} MiB within {}s",
                now_kib >> 10,
                before_kib >> 10,
                BALLOON_WAIT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    guest_run(libvirt, domain, SWAPOFF, SWAPOFF_WAIT)
        .await
        .context("swapping off in the guest")?;
    libvirt
        .hotplug(domain, xml, false)
        .await
        .context("unplugging the swap disk")?;
    let deadline = tokio::time::Instant::now() + UNPLUG_WAIT;
    while libvirt.disk_targets(domain).await?.contains(&status.target) {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the guest did not let {} go within {}s",
                status.target,
                UNPLUG_WAIT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

/// Runs `script` with `sh -c` in the guest through its agent, until it exits; retries while
/// it exits [`NOT_YET`], within `wait`.
async fn guest_run(libvirt: &Libvirt, domain: &str, script: &str, wait: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        match guest_exec(libvirt, domain, script, remaining).await?.0 {
            0 => return Ok(()),
            NOT_YET if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            NOT_YET => bail!(
                "the guest did not see its swap disk within {}s",
                wait.as_secs()
            ),
            other => bail!("the guest's command exited {other}"),
        }
    }
}

/// Prints how much of the swap disk the guest uses (KiB, `/proc/swaps`' "Used"), nothing
/// when it does not swap on it.
const SWAP_USED: &str = "for d in /sys/block/vd*; do \
    if [ \"$(cat $d/serial 2>/dev/null)\" = ferry-swap ]; then n=/dev/${d##*/}; \
    while read f t s u p; do [ \"$f\" = \"$n\" ] && echo $u; done < /proc/swaps; fi; done; exit 0";

/// What `domain`'s guest has paged out to its swap on a peer, as the guest's agent says.
pub async fn swap_used(libvirt: &Libvirt, domain: &str) -> Result<Option<u64>> {
    let (code, out) = guest_exec(libvirt, domain, SWAP_USED, Duration::from_secs(10)).await?;
    if code != 0 {
        bail!("the guest's command exited {code}");
    }
    match out.trim() {
        "" => Ok(None),
        kib => kib
            .parse::<u64>()
            .map(|kib| Some(kib << 10))
            .map_err(|_| anyhow!("the guest said it uses {kib:?} KiB of swap")),
    }
}

/// Runs `script` with `sh -c` in the guest through its agent and waits (within `wait`) for
/// its exit code and what it printed.
async fn guest_exec(
    libvirt: &Libvirt,
    domain: &str,
    script: &str,
    wait: Duration,
) -> Result<(i64, String)> {
    use base64::Engine as _;
    let deadline = tokio::time::Instant::now() + wait;
    let started = libvirt
        .guest_agent(
            domain,
            &json!({"execute": "guest-exec",
                    "arguments": {"path": "/bin/sh", "arg": ["-c", script],
                                  "capture-output": true}}),
        )
        .await?;
    let pid = started["return"]["pid"]
        .as_i64()
        .ok_or_else(|| anyhow!("guest-exec answered {started}"))?;
    let output = loop {
        let status = libvirt
            .guest_agent(
                domain,
                &json!({"execute": "guest-exec-status", "arguments": {"pid": pid}}),
            )
            .await?;
        let r = &status["return"];
        if r["exited"].as_bool() == Some(true) {
            let code = r["exitcode"].as_i64().ok_or_else(|| {
                anyhow!("the guest's command ended without an exit code: {status}")
            })?;
            let out = match r["out-data"].as_str() {
                Some(data) => base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .map_err(|e| anyhow!("the guest's agent sent bad output: {e}"))?,
                None => Vec::new(),
            };
            break (code, String::from_utf8_lossy(&out).into_owned());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the guest's command did not end within {}s", wait.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    Ok(output)
}

/// Where the swap disk's device XML is kept while the domain has it (detaching names it): one
/// file per domain name, even for names that differ only in characters a file name avoids.
fn device_file(tunnel_dir: &Path, domain: &str) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    domain.hash(&mut hasher);
    let safe: String = domain
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    tunnel_dir.join(format!("swap-{safe}-{:016x}.xml", hasher.finish()))
}

/// The swap disk as libvirt's device XML: a raw NBD disk on the peer's swap tunnel, its export
/// named `<domain>:<MiB>` ([`crate::lend`]).
fn disk_xml(domain: &str, bytes: u64, socket: &str, target: &str) -> String {
    format!(
        "<disk type='network' device='disk'><driver name='qemu' type='raw'/>\
         <source protocol='nbd' name='{}'><host transport='unix' socket='{}'/>\
         <reconnect delay='{RECONNECT_DELAY_S}'/></source>\
         <target dev='{target}' bus='virtio'/><serial>{SWAP_SERIAL}</serial></disk>",
        xml_escape(&format!("{domain}:{}", bytes >> 20)),
        xml_escape(socket),
    )
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('\'', "&apos;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_domain_has_its_own_device_file() {
        let dir = Path::new("/run/t");
        let a = device_file(dir, "web.1");
        assert_ne!(a, device_file(dir, "web_1"));
        assert_eq!(a, device_file(dir, "web.1"));
        assert!(a.starts_with(dir) && a.to_string_lossy().contains("swap-web_1-"));
    }

    #[test]
    fn the_swap_disk_names_its_export_and_escapes_what_xml_would_misread() {
        let xml = disk_xml("a'b&c", 64 << 20, "/run/t/site-b/swap.sock", "vdb");
        assert!(xml.contains("name='a&apos;b&amp;c:64'"), "{xml}");
        assert!(xml.contains("socket='/run/t/site-b/swap.sock'"), "{xml}");
        assert!(xml.contains("<serial>ferry-swap</serial>"), "{xml}");
        assert!(xml.contains("<reconnect delay='60'/>"), "{xml}");
    }
}
