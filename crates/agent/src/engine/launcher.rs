//! The destination QEMU, when the agent starts it: from a command line (the source QEMU's own,
//! or one the user gave), made a destination by [`ferry_qemu::incoming::incoming_argv`] (its
//! QMP socket and pid file in the host's monitor directory, `-S -incoming defer`), daemonized
//! so that the VM outlives the agent and is nobody's child once it runs. QEMU daemonizes only after it has set everything up, so a
//! command line this host cannot honour (a missing image, an unknown device, a tap that is not
//! there) fails here, with QEMU's own words, before the source has sent anything.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use ferry_qemu::incoming::incoming_argv;

/// QEMU sets up a VM in well under a second; a minute covers a slow disk or a busy host.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// The most of QEMU's complaint shown (its last lines say why it stopped).
const STDERR_SHOWN_BYTES: usize = 2000;

/// A destination QEMU the agent started.
#[derive(Debug)]
pub struct Started {
    pub pid: Option<u32>,
}

/// Starts the destination from `argv` (program first), its monitor on `qmp_socket`, its pid in
/// `pidfile`.
pub async fn start(argv: &[String], qmp_socket: &Path, pidfile: &Path) -> Result<Started> {
    let _ = std::fs::remove_file(qmp_socket);
    let argv = incoming_argv(argv, qmp_socket, pidfile)?;
    let (program, args) = argv.split_first().expect("incoming_argv keeps the program");
    check_program(program)?;
    tracing::info!(program, ?args, "starting the destination QEMU");
    let child = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("QEMU {program:?} (the source's) is not on this host; install it, or give the destination's command line")
        }
        Err(e) => return Err(e).with_context(|| format!("cannot run {program:?}")),
    };
    let Ok(out) = tokio::time::timeout(START_TIMEOUT, child.wait_with_output()).await else {
        // The parent goes with the future; the daemon it forked may have written its pid.
        if let Some(pid) = read_pid(pidfile) {
            kill(pid);
        }
        clean_up(qmp_socket, pidfile);
        bail!(
            "the destination QEMU did not finish starting within {}s",
            START_TIMEOUT.as_secs()
        );
    };
    let out = out.context("waiting for the destination QEMU to start")?;
    if !out.status.success() {
        // QEMU may have made its monitor's socket before it gave up.
        clean_up(qmp_socket, pidfile);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stderr = stderr.trim();
        let from = (stderr.len().saturating_sub(STDERR_SHOWN_BYTES)..=stderr.len())
            .find(|i| stderr.is_char_boundary(*i))
            .unwrap_or(0);
        let shown = &stderr[from..];
        bail!(
            "the destination QEMU refused the VM's configuration ({}): {}",
            out.status,
            if shown.is_empty() {
                "no message"
            } else {
                shown
            }
        );
    }
    Ok(Started {
        pid: read_pid(pidfile),
    })
}

fn read_pid(pidfile: &Path) -> Option<u32> {
    std::fs::read_to_string(pidfile)
        .ok()
        .and_then(|p| p.trim().parse().ok())
}

/// The command line comes from a peer (an agent of the fleet, authenticated by the fleet's CA):
/// whatever it names, the agent runs only a QEMU system emulator.
fn check_program(program: &str) -> Result<()> {
    let file = Path::new(program)
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    if file.starts_with("qemu-system-") || file == "qemu-kvm" {
        return Ok(());
    }
    bail!("the destination agent starts only QEMU (qemu-system-*, qemu-kvm), not {program:?}")
}

/// Kills a destination QEMU [`start`] started (after a failure before the commit), if it is
/// still there: its monitor may be the thing that failed.
pub fn kill(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) with a pid QEMU wrote to our pid file and a constant signal; no memory
    // is involved. A pid reused since would be another process of this host's QEMUs at
    // worst, which is why this runs right after the failure, not later.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}

/// Removes the monitor and pid file of a QEMU [`start`] started, once it is gone (killed, it
/// left them).
pub fn clean_up(qmp_socket: &Path, pidfile: &Path) {
    for f in [qmp_socket, pidfile] {
        let _ = std::fs::remove_file(f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_qemu_is_started() {
        for ok in [
            "qemu-system-x86_64",
            "/usr/bin/qemu-system-aarch64",
            "/usr/libexec/qemu-kvm",
        ] {
            check_program(ok).unwrap();
        }
        assert_eq!(
            check_program("/bin/sh").unwrap_err().to_string(),
            "the destination agent starts only QEMU (qemu-system-*, qemu-kvm), not \"/bin/sh\""
        );
    }
}
