//! libvirt at the lab's sites: one libvirtd (and its virtlogd) per site, as on two hosts.
//!
//! Each site's host processes ([`Lab::host_command`]) see libvirt's directories (`/run/libvirt`,
//! `/var/lib/libvirt`, `/etc/libvirt`, `/var/log/libvirt`, `/var/cache/libvirt`) as the site's
//! own copies under `<lab dir>/host-<site>/libvirt/`, so a daemon started there, `virsh`
//! there and ferry's agent there all meet at `qemu:///system`, and the QEMUs libvirt starts
//! live in the site's network namespace beside its bridge. From outside the site the daemon
//! is `qemu:///system?socket=<lab dir>/host-<site>/libvirt/run/libvirt-sock` ([`uri`]).
//!
//! The site's `/etc/libvirt` is a copy of the host's with QEMU run as root and no security
//! driver: the lab's images live in root's cache and there is no AppArmor profile for them.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::topology::{wait_until, Lab, Site};

/// libvirt's directories on a host, and the name of each one's copy per site.
pub const DIRS: [(&str, &str); 5] = [
    ("run", "/run/libvirt"),
    ("lib", "/var/lib/libvirt"),
    ("etc", "/etc/libvirt"),
    ("log", "/var/log/libvirt"),
    ("cache", "/var/cache/libvirt"),
];

/// The daemon; `scripts/setup.sh` installs it from the backports suite.
const LIBVIRTD: &str = "/usr/sbin/libvirtd";

/// Whether libvirt is installed on this machine.
pub fn installed() -> bool {
    Path::new(LIBVIRTD).exists() && Path::new("/etc/libvirt").is_dir()
}

/// Where `site`'s copies of libvirt's directories are, outside the site.
pub fn site_dir(lab: &Lab, site: Site) -> PathBuf {
    lab.host_dir(site).join("libvirt")
}

/// The bind mounts a process of `site`'s host gets for libvirt: (the site's copy, the path
/// inside). Empty when the site has no libvirt.
pub fn binds(lab: &Lab, site: Site) -> Vec<(PathBuf, PathBuf)> {
    let root = site_dir(lab, site);
    if !root.is_dir() {
        return Vec::new();
    }
    DIRS.iter()
        .map(|(name, path)| (root.join(name), PathBuf::from(path)))
        .collect()
}

/// `site`'s libvirtd as seen from outside the site.
pub fn uri(lab: &Lab, site: Site) -> String {
    format!(
        "qemu:///system?socket={}",
        site_dir(lab, site).join("run/libvirt-sock").display()
    )
}

/// Gives `site` its own libvirt directories (before any of its host's processes start, so
/// that they all see them).
pub fn prepare(lab: &Lab, site: Site) -> Result<()> {
    if !installed() {
        bail!("libvirt is not installed ({LIBVIRTD} missing); scripts/setup.sh installs it");
    }
    let root = site_dir(lab, site);
    for (name, path) in DIRS {
        // The paths inside must exist on this machine to be mounted over.
        fs::create_dir_all(path).with_context(|| format!("create {path}"))?;
        fs::create_dir_all(root.join(name))?;
    }
    let copied = Command::new("cp")
        .args(["-a", "/etc/libvirt/."])
        .arg(root.join("etc"))
        .status()
        .context("copy /etc/libvirt")?;
    if !copied.success() {
        bail!("copying /etc/libvirt for site {} failed", site.name());
    }
    let qemu_conf = root.join("etc/qemu.conf");
    let mut conf = fs::read_to_string(&qemu_conf).unwrap_or_default();
    conf.push_str(
        "\n# ferry lab: QEMU as root, images in root's cache, no security driver\n\
         user = \"root\"\ngroup = \"root\"\ndynamic_ownership = 0\nremember_owner = 0\n\
         security_driver = \"none\"\n",
    );
    fs::write(&qemu_conf, conf)?;
    Ok(())
}

/// Starts `site`'s daemons ([`prepare`]d); returns once `virsh` reaches them.
pub fn start(lab: &Lab, site: Site) -> Result<()> {
    let log = fs::File::create(lab.dir().join(format!("libvirtd-{}.log", site.name())))?;
    let status = lab
        .host_command(site, "sh")
        .args(["-c", "virtlogd -d -p /run/libvirt/virtlogd.pid && exec libvirtd -d -p /run/libvirt/libvirtd.pid"])
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .context("start libvirtd")?;
    if !status.success() {
        bail!(
            "libvirtd did not start at site {} ({status}); see {}",
            site.name(),
            lab.dir()
                .join(format!("libvirtd-{}.log", site.name()))
                .display()
        );
    }
    let uri = uri(lab, site);
    wait_until(Duration::from_secs(20), || {
        Command::new("virsh")
            .args(["-c", &uri, "version"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
    .with_context(|| format!("libvirtd at site {} does not answer ({uri})", site.name()))
}
