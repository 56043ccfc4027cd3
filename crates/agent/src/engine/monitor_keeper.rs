//! A destination QEMU's monitor connection, kept past its agent's death for postcopy
//! recovery.
//!
//! A postcopy destination QEMU waiting for pages answers no new monitor connection: the QMP
//! handshake runs on its main thread, which a vCPU's fault holds. Only a connection made
//! before, with out-of-band execution, can still send it `migrate-recover`; when the agent
//! that made it dies, so would the connection. So at the switch the agent forks a keeper, a
//! process of its own session that holds a duplicate of the connection's socket and nothing
//! else, until its QEMU exits or [`HOLD_AFTER_SWITCH`] passes. A restarted agent takes a
//! duplicate back with `pidfd_getfd(2)` (Linux 5.6; the agent runs as root) and goes on where
//! its predecessor stopped: QMP is line-based, and a line half read by the dead agent is
//! skipped as not JSON ([`Qmp::adopt`]).
//!
//! The keeper is forked without `exec`: the child of a threaded process may only make
//! async-signal-safe calls, and it makes only system calls (`setsid`, `dup2`, `close_range`,
//! `poll`, `_exit`). Under systemd the agent's unit must use `KillMode=process`
//! (contrib/systemd does), or a restart would take the keeper with the agent.
//!
//! [`Qmp::adopt`]: ferry_qemu::Qmp::adopt

use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::engine::postcopy::HOLD_AFTER_SWITCH;

/// Where the keeper holds the monitor's socket: its standard input.
const KEPT_AT: RawFd = 0;
/// Where the keeper watches its QEMU: a pidfd, readable once the process has exited.
const QEMU_AT: RawFd = 1;

/// A keeper process, as the incoming migration's record names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptMonitor {
    pub pid: u32,
}

/// Forks a keeper holding a duplicate of `monitor` until the QEMU `qemu_pid` exits (or, when
/// unknown, until [`HOLD_AFTER_SWITCH`] passes; it passes in any case).
pub fn keep(monitor: BorrowedFd<'_>, qemu_pid: Option<u32>) -> io::Result<KeptMonitor> {
    let qemu = qemu_pid.map(pidfd_open).transpose()?;
    let hold_ms = libc::c_int::try_from(HOLD_AFTER_SWITCH.as_millis()).unwrap_or(libc::c_int::MAX);
    // The keeper is ready (holds the socket where `take` looks) once it has closed the
    // pipe's write end, with every descriptor but its two.
    let mut ready = [0; 2];
    // SAFETY: fills `ready` with two new descriptors this process owns, or fails.
    if unsafe { libc::pipe2(ready.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    let (ready_read, ready_write) = unsafe {
        (
            OwnedFd::from_raw_fd(ready[0]),
            OwnedFd::from_raw_fd(ready[1]),
        )
    };
    // SAFETY: the child runs only `hold`, which makes async-signal-safe system calls and
    // never returns.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(io::Error::last_os_error()),
        0 => hold(
            monitor.as_raw_fd(),
            qemu.as_ref().map(AsRawFd::as_raw_fd),
            hold_ms,
        ),
        pid => {
            drop(ready_write);
            // Returns at the end of file: microseconds after the fork.
            let mut byte = [0u8; 1];
            let _ = std::fs::File::from(ready_read).read(&mut byte);
            // Reaped whenever it ends (its QEMU gone, released, or its hold over), so that it
            // is never left a zombie; a restarted agent's predecessor's keepers go to init.
            let _ = std::thread::Builder::new()
                .name("monitor-keeper".into())
                .spawn(move || {
                    // SAFETY: waits for one pid, this process's child.
                    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
                });
            Ok(KeptMonitor {
                pid: u32::try_from(pid).expect("a child's pid is positive"),
            })
        }
    }
}

/// The keeper's life, in the forked child.
fn hold(monitor: RawFd, qemu: Option<RawFd>, hold_ms: libc::c_int) -> ! {
    // SAFETY: system calls on descriptors this process owns; nothing allocates or locks.
    unsafe {
        // Its own session: a signal to the agent's process group leaves it alone.
        libc::setsid();
        // As a fresh process would be: the agent's signal handlers and mask are not its.
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGPIPE] {
            libc::signal(signal, libc::SIG_DFL);
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::dup2(monitor, KEPT_AT);
        let watch = match qemu {
            Some(fd) => {
                libc::dup2(fd, QEMU_AT);
                1
            }
            None => {
                libc::close(QEMU_AT);
                0
            }
        };
        libc::syscall(libc::SYS_close_range, QEMU_AT + 1, libc::c_uint::MAX, 0);
        let mut fds = [libc::pollfd {
            fd: QEMU_AT,
            events: libc::POLLIN,
            revents: 0,
        }];
        let mut start: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut start);
        loop {
            let mut now: libc::timespec = std::mem::zeroed();
            libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now);
            let elapsed_ms = (now.tv_sec - start.tv_sec).saturating_mul(1000);
            let left = i64::from(hold_ms).saturating_sub(elapsed_ms);
            if left <= 0 {
                break;
            }
            let left = libc::c_int::try_from(left).unwrap_or(libc::c_int::MAX);
            let waited = libc::poll(fds.as_mut_ptr(), watch, left);
            // Its QEMU exited (or the pidfd failed): nothing is left to keep.
            if waited > 0 {
                break;
            }
        }
        libc::_exit(0)
    }
}

/// A duplicate of the monitor socket `kept` holds, if it is still there and connected to the
/// monitor at `qmp_path` (a pid may have been reused).
pub fn take(kept: KeptMonitor, qmp_path: &Path) -> io::Result<OwnedFd> {
    let keeper = pidfd_open(kept.pid)?;
    let fd = getfd(&keeper)?;
    let socket = std::os::unix::net::UnixStream::from(fd.try_clone()?);
    let peer = socket.peer_addr()?;
    if peer.as_pathname() != Some(qmp_path) {
        return Err(io::Error::other(format!(
            "process {} holds no connection to {}",
            kept.pid,
            qmp_path.display()
        )));
    }
    Ok(fd)
}

/// Ends the keeper `kept`, if it is still the one holding the monitor at `qmp_path`.
pub fn release(kept: KeptMonitor, qmp_path: &Path) {
    let Ok(keeper) = pidfd_open(kept.pid) else {
        return;
    };
    // Checked through the same pidfd the signal goes to: a reused pid is never signalled.
    let holds_it = getfd(&keeper).is_ok_and(|fd| {
        std::os::unix::net::UnixStream::from(fd)
            .peer_addr()
            .is_ok_and(|a| a.as_pathname() == Some(qmp_path))
    });
    if holds_it {
        // SAFETY: a signal through a pidfd this process owns.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                keeper.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            );
        }
    }
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open returns a new descriptor this process owns, or -1.
    owned(unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) })
}

/// A duplicate of the descriptor the keeper behind `keeper` (a pidfd) holds the socket at.
fn getfd(keeper: &OwnedFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd returns a new descriptor this process owns, or -1.
    owned(unsafe { libc::syscall(libc::SYS_pidfd_getfd, keeper.as_raw_fd(), KEPT_AT, 0) })
}

/// The descriptor a system call returned, or its error.
fn owned(returned: libc::c_long) -> io::Result<OwnedFd> {
    if returned < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(returned).map_err(io::Error::other)?;
    // SAFETY: a descriptor the system call made for this process, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::{UnixListener, UnixStream};

    #[test]
    fn a_kept_connection_outlives_its_maker_and_is_taken_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let made = UnixStream::connect(&path).unwrap();
        let (mut served, _) = listener.accept().unwrap();
        let kept = keep(std::os::fd::AsFd::as_fd(&made), None).unwrap();
        // Its maker's descriptor goes (as with a killed agent): the connection stays.
        drop(made);
        served.write_all(b"{\"event\": \"MIGRATION\"}\n").unwrap();
        let mut taken = UnixStream::from(take(kept, &path).unwrap());
        let mut line = [0u8; 23];
        taken.read_exact(&mut line).unwrap();
        assert_eq!(&line, b"{\"event\": \"MIGRATION\"}\n");
        // Taken by a path it is not connected to: refused.
        let other = take(kept, &dir.path().join("other.sock")).unwrap_err();
        assert!(other.to_string().contains("holds no connection"), "{other}");
        // Released, the keeper's copy goes: with the taken one dropped too, the peer sees the
        // end of the connection.
        release(kept, &path);
        drop(taken);
        served
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut rest = Vec::new();
        assert_eq!(served.read_to_end(&mut rest).unwrap(), 0);
    }

    #[test]
    fn a_keeper_ends_with_its_qemu() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let made = UnixStream::connect(&path).unwrap();
        let (mut served, _) = listener.accept().unwrap();
        let mut qemu = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let kept = keep(std::os::fd::AsFd::as_fd(&made), Some(qemu.id())).unwrap();
        drop(made);
        qemu.kill().unwrap();
        qemu.wait().unwrap();
        served
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut rest = Vec::new();
        assert_eq!(
            served.read_to_end(&mut rest).unwrap(),
            0,
            "the keeper let go"
        );
        // And is reaped: no zombie is left.
        let gone = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            !std::path::Path::new(&format!("/proc/{}", kept.pid)).exists()
        });
        assert!(gone, "keeper {} left behind", kept.pid);
    }
}
