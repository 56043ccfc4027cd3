//! Which accelerator really runs a guest here.
//!
//! `/dev/kvm` existing is not enough: on some hosts it is a software hypervisor that runs a
//! stock guest so slowly that it dies in instruction emulation (PLATFORM.md). So the probe boots
//! the lab's kernel under KVM with `ferry_probe=1` and waits for its marker; if the marker does
//! not arrive, TCG it is. The answer is cached per image and QEMU version.

use std::fs;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_qemu::Accel;
use serde::{Deserialize, Serialize};

use crate::image::{cache_dir, Image};

/// A guest that boots at all boots to the marker within seconds under KVM.
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Serialize, Deserialize)]
struct Cached {
    key: String,
    accel: Accel,
    reason: String,
}

/// The accelerator to use and why. `FERRY_ACCEL=kvm|tcg` overrides the probe.
pub fn detect(img: &Image) -> Result<(Accel, String)> {
    let qemu_version = ferry_qemu::check_qemu()?;
    if let Ok(v) = std::env::var("FERRY_ACCEL") {
        return match v.as_str() {
            "kvm" => Ok((Accel::Kvm, "FERRY_ACCEL=kvm".into())),
            "tcg" => Ok((Accel::Tcg, "FERRY_ACCEL=tcg".into())),
            _ => bail!("FERRY_ACCEL={v:?} is not an accelerator; use kvm or tcg"),
        };
    }
    if fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Ok((Accel::Tcg, "/dev/kvm is not usable".into()));
    }
    let key = format!("{}|{qemu_version}", img.inputs_sha256);
    let cache = cache_dir().join("accel.json");
    if let Ok(c) = fs::read_to_string(&cache)
        .map_err(anyhow::Error::from)
        .and_then(|t| Ok(serde_json::from_str::<Cached>(&t)?))
    {
        if c.key == key {
            return Ok((c.accel, format!("{} (cached)", c.reason)));
        }
    }
    let (accel, reason) = match probe_kvm(img)? {
        None => (Accel::Kvm, "KVM booted the probe guest".to_owned()),
        Some(why) => (
            Accel::Tcg,
            format!("KVM did not boot the probe guest: {why}"),
        ),
    };
    let _ = fs::write(
        &cache,
        serde_json::to_string(&Cached {
            key,
            accel,
            reason: reason.clone(),
        })?,
    );
    Ok((accel, reason))
}

/// `None` when KVM booted the probe, else why not.
fn probe_kvm(img: &Image) -> Result<Option<String>> {
    let mut child = Command::new(ferry_qemu::qemu_program())
        .args([
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-m",
            "128M",
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(&img.kernel)
        .arg("-initrd")
        .arg(&img.initrd)
        .args([
            "-append",
            "console=ttyS0 quiet ferry_probe=1 panic=1",
            "-serial",
            "stdio",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("start qemu-system-x86_64 for the KVM probe")?;
    let mut out = child.stdout.take().expect("stdout is piped");
    let found = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f2 = found.clone();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
            if all.windows(14).any(|w| w == b"FERRY-PROBE-OK") {
                f2.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    let start = Instant::now();
    let mut exited = None;
    while start.elapsed() < PROBE_TIMEOUT && !found.load(std::sync::atomic::Ordering::Relaxed) {
        if let Ok(Some(status)) = child.try_wait() {
            exited = Some(status);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    if found.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(None);
    }
    Ok(Some(match exited {
        Some(status) => format!("QEMU exited before the guest was up ({status})"),
        None => format!("no sign of life within {}s", PROBE_TIMEOUT.as_secs()),
    }))
}
