//! libvirt on this host, asked through its own client (`virsh`, which every libvirt install
//! has): which domain is migrating out. libvirt connects QEMU's migration socket itself and
//! hands QEMU the descriptor, so the socket's peer is libvirtd, not the VM's QEMU.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::process::Command;

/// How long one `virsh` call may take.
const VIRSH_TIMEOUT: Duration = Duration::from_secs(10);

/// The domains with an outgoing migration job at the libvirt daemon behind `socket`.
pub async fn outgoing_domains(socket: &Path) -> Result<Vec<String>> {
    let names = virsh(socket, &["list", "--name"]).await?;
    let mut outgoing = Vec::new();
    for name in names.lines().map(str::trim).filter(|n| !n.is_empty()) {
        // A domain that left meanwhile has no job to show: not an error here.
        if let Ok(job) = virsh(socket, &["domjobinfo", name]).await {
            if job.contains("Outgoing migration") {
                outgoing.push(name.to_owned());
            }
        }
    }
    Ok(outgoing)
}

/// `virsh ARGS` on the daemon behind `socket`; its standard output.
async fn virsh(socket: &Path, args: &[&str]) -> Result<String> {
    let uri = format!("qemu:///system?socket={}", socket.display());
    let out = tokio::time::timeout(
        VIRSH_TIMEOUT,
        Command::new("virsh")
            .args(["-q", "-c", &uri])
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .with_context(|| format!("virsh {} did not answer within 10s", args.join(" ")))?
    .context("run virsh (libvirt's client)")?;
    if !out.status.success() {
        bail!(
            "virsh {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
