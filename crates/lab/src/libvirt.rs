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
//! Each daemon also listens on TCP at its site's underlay address without authentication
//! ([`tcp_uri`]), for libvirt's own migration across the WAN without ferry (the baseline).

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
         security_driver = \"none\"\n\
         # ferry lab: a dead peer noticed within about 6 s (libvirt's default is 30 s)\n\
         keepalive_interval = 2\nkeepalive_count = 2\n",
    );
    fs::write(&qemu_conf, conf)?;
    let daemon_conf = root.join("etc/libvirtd.conf");
    let mut conf = fs::read_to_string(&daemon_conf).unwrap_or_default();
    conf.push_str(&format!(
        "\n# ferry lab: TCP on the underlay, no authentication (the lab's WAN only)\n\
         listen_tls = 0\nlisten_tcp = 1\nauth_tcp = \"none\"\nlisten_addr = \"{}\"\n",
        site.underlay_ip()
    ));
    fs::write(&daemon_conf, conf)?;
    Ok(())
}

/// `site`'s libvirtd over TCP across the WAN, as another site's libvirt reaches it directly.
pub fn tcp_uri(site: Site) -> String {
    format!("qemu+tcp://{}/system", site.underlay_ip())
}

/// A guest's virtio NIC: the host bridge it plugs into, its MAC, its address (/24).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestNic {
    pub bridge: String,
    pub mac: String,
    pub ip: String,
}

impl GuestNic {
    /// On the sites' shared segment (`br0`): address 10.77.0.`host`.
    pub fn lab(host: u8) -> GuestNic {
        GuestNic {
            bridge: "br0".into(),
            mac: format!("52:54:00:77:00:{host:02x}"),
            ip: format!("10.77.0.{host}"),
        }
    }
}

/// Empty PCIe root ports a tiny guest keeps for hot-plugged devices (q35 only hot-plugs into
/// root ports, and they cannot be added to a running guest).
pub const HOTPLUG_PORTS: usize = 2;

/// The lab's tiny guest as a libvirt domain: direct kernel boot, its serial console a unix
/// socket in the site's host directory (`/run/ferry-host/NAME.serial`), a virtio NIC, and
/// optionally a qcow2 data disk at `/run/ferry-host/NAME.qcow2`. Also the QEMU guest agent's
/// channel (answered by `ferry-guest qga`; libvirt picks the socket), a virtio balloon with
/// stats every second, and [`HOTPLUG_PORTS`] empty PCIe root ports so disks can be hot-plugged.
pub fn tiny_domain_xml(
    img: &crate::image::Image,
    name: &str,
    mem_mib: u32,
    nic: &GuestNic,
    disk: bool,
) -> String {
    let disk = if disk {
        format!(
            "<disk type='file' device='disk'><driver name='qemu' type='qcow2'/>\
             <source file='/run/ferry-host/{name}.qcow2'/><target dev='vda' bus='virtio'/></disk>"
        )
    } else {
        String::new()
    };
    // libvirt puts each device it places itself on the first free root port, listed or not, and
    // adds its own spare port only when no PCI controller is listed. So list one port for each of
    // those devices (the NIC, the disk, the agent channel's virtio-serial controller, the balloon
    // and libvirt's default USB controller) plus the spares; pcie-root must be listed first (it is
    // index 0). Checked with libvirt 11.3: without this, zero ports are left empty. ACPI on, as
    // in any real domain: without it a hot-plug makes the guest drop the root ports' buses, and
    // the devices on them (the guest agent's channel among them).
    let placed = 4 + usize::from(!disk.is_empty());
    let ports = "<controller type='pci' model='pcie-root-port'/>".repeat(placed + HOTPLUG_PORTS);
    format!(
        "<domain type='qemu'><name>{name}</name><memory unit='MiB'>{mem_mib}</memory><vcpu>1</vcpu>\
         <os><type arch='x86_64' machine='q35'>hvm</type><kernel>{}</kernel><initrd>{}</initrd>\
         <cmdline>console=ttyS0 quiet loglevel=1 panic=1 ferry_ip={}</cmdline></os>\
         <features><acpi/></features><on_reboot>destroy</on_reboot><devices>{disk}\
         <serial type='unix'><source mode='bind' path='/run/ferry-host/{name}.serial'/>\
         <target port='0'/></serial>\
         <interface type='bridge'><source bridge='{}'/><mac address='{}'/>\
         <model type='virtio'/></interface>\
         <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>\
         <memballoon model='virtio'><stats period='1'/></memballoon>\
         <controller type='pci' model='pcie-root'/>{ports}</devices></domain>",
        img.kernel.display(),
        img.initrd.display(),
        nic.ip,
        nic.bridge,
        nic.mac,
    )
}

/// Defines and starts the tiny guest as domain `name` at site a ([`tiny_domain_xml`]);
/// returns its serial link once the guest's agent answered and ran `command` (its workload).
pub async fn start_tiny_domain(
    lab: &Lab,
    img: &crate::image::Image,
    (name, mem_mib, nic): (&str, u32, &GuestNic),
    command: &str,
) -> Result<crate::guest::GuestLink> {
    if ferry_agent::interrupt::requested() {
        bail!("stopped by the user before domain {name:?} was started");
    }
    let xml = lab.host_dir(Site::A).join(format!("{name}.xml"));
    fs::write(&xml, tiny_domain_xml(img, name, mem_mib, nic, false))?;
    virsh(
        lab,
        Site::A,
        &[
            "define",
            &format!("{}/{name}.xml", crate::topology::HOST_DIR),
        ],
    )?;
    virsh(lab, Site::A, &["start", name])?;
    let serial = lab.host_dir(Site::A).join(format!("{name}.serial"));
    let heartbeats = std::sync::Arc::new(crate::guest::Heartbeats::default());
    let link = crate::guest::GuestLink::connect(&serial, heartbeats).await?;
    link.wait_ready(Duration::from_secs(120)).await?;
    link.call(command, Duration::from_secs(180)).await?;
    Ok(link)
}

/// Starts `site`'s daemons ([`prepare`]d); returns once `virsh` reaches them.
pub fn start(lab: &Lab, site: Site) -> Result<()> {
    let log = fs::File::create(lab.dir().join(format!("libvirtd-{}.log", site.name())))?;
    let status = lab
        .host_command(site, "sh")
        // virtlogd stays up when libvirtd is restarted ([`stop_libvirtd`]).
        .args([
            "-c",
            "if ! kill -0 \"$(cat /run/libvirt/virtlogd.pid 2>/dev/null)\" 2>/dev/null; then \
                      virtlogd -d -p /run/libvirt/virtlogd.pid || exit 1; fi; \
                      exec libvirtd -d --listen -p /run/libvirt/libvirtd.pid",
        ])
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

/// Stops `site`'s libvirtd (a host whose libvirt is down); [`start`] brings it back. Its
/// domains keep running: QEMU does not depend on the daemon.
pub fn stop_libvirtd(lab: &Lab, site: Site) -> Result<()> {
    let pid_file = site_dir(lab, site).join("run/libvirtd.pid");
    let pid =
        fs::read_to_string(&pid_file).with_context(|| format!("read {}", pid_file.display()))?;
    let pid = pid.trim().to_owned();
    let status = Command::new("kill")
        .arg(&pid)
        .status()
        .context("run kill")?;
    if !status.success() {
        bail!("could not stop libvirtd {pid} at site {}", site.name());
    }
    wait_until(Duration::from_secs(20), || {
        !Path::new("/proc").join(&pid).exists()
    })
    .with_context(|| format!("libvirtd {pid} at site {} did not stop", site.name()))
}

/// `virsh` as a process of `site`'s host, talking to its own daemon.
pub(crate) fn virsh_command(lab: &Lab, site: Site) -> Command {
    let mut c = lab.host_command(site, "virsh");
    c.args(["-q", "-c", "qemu:///system"]);
    c
}

/// `virsh ARGS` at `site`; its stdout, or its error in its words.
pub(crate) fn virsh(lab: &Lab, site: Site, args: &[&str]) -> Result<String> {
    let out = virsh_command(lab, site).args(args).output()?;
    if !out.status.success() {
        bail!(
            "virsh {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
