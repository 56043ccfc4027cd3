//! VM launcher: a [`VmSpec`] becomes a QEMU command line.
//!
//! The spec says what the VM is (memory, vCPUs, boot, disks, NICs) and where its control
//! endpoints live (QMP socket, serial socket). The same spec, with other endpoints and
//! `incoming` set, starts the destination of a migration: QEMU requires both ends to have the
//! same devices, so both are always built from one spec.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The QEMU system emulator to run: `FERRY_QEMU` if set, else `qemu-system-x86_64` from `PATH`.
pub fn qemu_program() -> String {
    std::env::var("FERRY_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".to_owned())
}

/// The oldest QEMU major version ferry supports: Debian 12's 7.2 corrupts guests during
/// migration under TCG (PLATFORM.md); 10.0 passed every probe.
pub const MIN_QEMU_MAJOR: u32 = 10;

/// Why QEMU cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum QemuCheckError {
    #[error("QEMU not found: cannot run {program:?} (install it with scripts/setup.sh, or set FERRY_QEMU to its path)")]
    Missing {
        program: String,
        source: std::io::Error,
    },
    #[error("{program:?} is QEMU {found}; ferry needs {MIN_QEMU_MAJOR}.0 or newer (scripts/setup.sh installs it from backports)")]
    TooOld { program: String, found: String },
}

/// Checks that [`qemu_program`] runs and is new enough; returns its version line.
pub fn check_qemu() -> Result<String, QemuCheckError> {
    let program = qemu_program();
    let out = std::process::Command::new(&program)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| QemuCheckError::Missing {
            program: program.clone(),
            source,
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().next().unwrap_or("").to_owned();
    let found = line
        .split("version ")
        .nth(1)
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or("unknown")
        .to_owned();
    let major: u32 = found
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if major < MIN_QEMU_MAJOR {
        return Err(QemuCheckError::TooOld { program, found });
    }
    Ok(line)
}

/// Which accelerator QEMU runs the guest with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    /// Hardware virtualization.
    Kvm,
    /// Software emulation (always available, slow guest CPU).
    Tcg,
}

impl Accel {
    /// The name QEMU's `-accel` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// How the VM boots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Boot {
    /// Direct kernel boot (the lab's tiny guest).
    Kernel {
        kernel: PathBuf,
        initrd: PathBuf,
        append: String,
    },
    /// Firmware boot from the first disk (users' own images).
    Disk,
}

/// One virtio disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskSpec {
    /// Node and device id; also the NBD export name during storage migration.
    pub id: String,
    pub path: PathBuf,
    /// `raw` or `qcow2`.
    pub format: String,
}

/// One virtio NIC on a tap device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicSpec {
    pub id: String,
    pub tap: String,
    pub mac: String,
}

/// Everything needed to start a VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSpec {
    pub name: String,
    pub mem_mib: u32,
    pub vcpus: u32,
    pub accel: Accel,
    pub boot: Boot,
    pub disks: Vec<DiskSpec>,
    pub nics: Vec<NicSpec>,
    pub qmp_socket: PathBuf,
    /// The first serial port, as a unix socket QEMU listens on.
    pub serial_socket: PathBuf,
    /// Also append everything the guest prints on the serial port to this file.
    #[serde(default)]
    pub serial_log: Option<PathBuf>,
    /// Back guest RAM with this shared file (lets the host read guest memory, e.g. for the
    /// bench's floor). `None`: anonymous memory.
    pub mem_file: Option<PathBuf>,
    /// `Some("defer")` starts a migration destination.
    pub incoming: Option<String>,
    /// Start with the CPUs stopped (`-S`).
    pub paused: bool,
    /// Extra QEMU arguments, passed through untouched.
    #[serde(default)]
    pub extra_args: Vec<String>,
}

impl VmSpec {
    /// The QEMU arguments (without the program name).
    pub fn argv(&self) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        let mut push = |items: &[&str]| a.extend(items.iter().map(|s| (*s).to_owned()));
        push(&[
            "-name",
            &self.name,
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
        ]);
        push(&["-machine", "q35", "-accel", self.accel.as_str()]);
        if self.accel == Accel::Kvm {
            push(&["-cpu", "host"]);
        }
        push(&[
            "-smp",
            &self.vcpus.to_string(),
            "-m",
            &format!("{}M", self.mem_mib),
        ]);
        if let Some(file) = &self.mem_file {
            let backend = format!(
                "memory-backend-file,id=ram0,size={}M,mem-path={},share=on",
                self.mem_mib,
                option_value(file)
            );
            push(&["-object", &backend, "-machine", "memory-backend=ram0"]);
        }
        if let Boot::Kernel {
            kernel,
            initrd,
            append,
        } = &self.boot
        {
            push(&[
                "-kernel",
                &kernel.to_string_lossy(),
                "-initrd",
                &initrd.to_string_lossy(),
            ]);
            push(&["-append", append]);
        }
        for d in &self.disks {
            let file = format!(
                "driver=file,filename={},node-name={}-file,cache.direct=off",
                option_value(&d.path),
                d.id
            );
            let fmt = format!("driver={},file={}-file,node-name={}", d.format, d.id, d.id);
            let dev = format!("virtio-blk-pci,drive={},id={}-dev", d.id, d.id);
            push(&["-blockdev", &file, "-blockdev", &fmt, "-device", &dev]);
        }
        for n in &self.nics {
            let netdev = format!("tap,id={},ifname={},script=no,downscript=no", n.id, n.tap);
            let dev = format!("virtio-net-pci,netdev={},mac={},romfile=", n.id, n.mac);
            push(&["-netdev", &netdev, "-device", &dev]);
        }
        let mut chardev = format!(
            "socket,id=ser0,path={},server=on,wait=off",
            option_value(&self.serial_socket)
        );
        if let Some(log) = &self.serial_log {
            chardev.push_str(&format!(",logfile={},logappend=on", option_value(log)));
        }
        push(&["-chardev", &chardev, "-serial", "chardev:ser0"]);
        let qmp = format!("unix:{},server=on,wait=off", option_value(&self.qmp_socket));
        push(&["-qmp", &qmp]);
        if let Some(inc) = &self.incoming {
            push(&["-incoming", inc]);
        }
        if self.paused {
            push(&["-S"]);
        }
        a.extend(self.extra_args.iter().cloned());
        a
    }
}

/// A path as a value in QEMU's key=value options: a comma would end it, so it is doubled.
fn option_value(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_with_a_comma_stays_one_value() {
        let mut spec = spec();
        spec.disks[0].path = "/img/a,b.qcow2".into();
        let argv = spec.argv();
        assert!(
            argv.contains(
                &"driver=file,filename=/img/a,,b.qcow2,node-name=disk0-file,cache.direct=off"
                    .to_owned()
            ),
            "{argv:?}"
        );
        assert_eq!(
            crate::blockdev_args::image_file(&argv, "disk0"),
            Some("/img/a,b.qcow2".into())
        );
    }

    fn spec() -> VmSpec {
        VmSpec {
            name: "vm1".into(),
            mem_mib: 256,
            vcpus: 1,
            accel: Accel::Tcg,
            boot: Boot::Kernel {
                kernel: "/k".into(),
                initrd: "/i".into(),
                append: "console=ttyS0".into(),
            },
            disks: vec![DiskSpec {
                id: "disk0".into(),
                path: "/d.qcow2".into(),
                format: "qcow2".into(),
            }],
            nics: vec![NicSpec {
                id: "net0".into(),
                tap: "tap1".into(),
                mac: "52:54:00:00:00:01".into(),
            }],
            qmp_socket: "/q.sock".into(),
            serial_socket: "/s.sock".into(),
            serial_log: Some("/s.log".into()),
            mem_file: Some("/dev/shm/vm1".into()),
            incoming: Some("defer".into()),
            paused: true,
            extra_args: vec!["-foo".into()],
        }
    }

    #[test]
    fn argv_carries_every_part_of_the_spec() {
        let a = spec().argv().join(" ");
        for want in [
            "-accel tcg",
            "-m 256M",
            "memory-backend-file,id=ram0,size=256M,mem-path=/dev/shm/vm1,share=on",
            "-kernel /k -initrd /i -append console=ttyS0",
            "driver=qcow2,file=disk0-file,node-name=disk0",
            "tap,id=net0,ifname=tap1",
            "mac=52:54:00:00:00:01",
            "socket,id=ser0,path=/s.sock,server=on,wait=off,logfile=/s.log,logappend=on",
            "-qmp unix:/q.sock,server=on,wait=off",
            "-incoming defer",
            " -S",
            "-foo",
        ] {
            assert!(a.contains(want), "missing {want:?} in {a}");
        }
    }

    #[test]
    fn firmware_boot_has_no_kernel() {
        let mut s = spec();
        s.boot = Boot::Disk;
        s.incoming = None;
        s.paused = false;
        let a = s.argv().join(" ");
        assert!(
            !a.contains("-kernel") && !a.contains("-incoming") && !a.contains(" -S"),
            "{a}"
        );
    }

    #[test]
    fn spec_round_trips_through_json() {
        let s = spec();
        let back: VmSpec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(s, back);
    }
}
