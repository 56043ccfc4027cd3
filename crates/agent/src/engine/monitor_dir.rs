//! The host's directory of QEMU monitors (`[qemu] qmp_dir`): `<dir>/<name>.qmp` is the QMP
//! socket of VM `<name>`. Its owner's tooling puts its VMs' sockets there (or symlinks to
//! them); a VM this agent receives and starts gets its socket and pid file there from the start
//! ([`MonitorDir::claim`]), so that the VM is found by its name wherever it runs, and QEMU
//! removes both when it ends.
//!
//! The agent never cleans the directory: a socket nobody listens on is a VM that ended, or one
//! whose QEMU is still starting, and is replaced only when a VM of that name arrives here.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_qemu::commands::{QueryStatus, Quit};
use ferry_qemu::{Qmp, QmpError};

/// A monitor that does not answer within this is held by another client (QEMU serves one at
/// a time).
const ASK_TIMEOUT: Duration = Duration::from_secs(1);
/// ... and is not asked again for this long: each unanswered connection waits in QEMU's
/// short listen queue until the other client lets go, ahead of the owner's next one.
const BUSY_QUIET: Duration = Duration::from_secs(30);
/// How long a stale destination QEMU, told to quit, may take to go.
const QUIT_TIMEOUT: Duration = Duration::from_secs(10);
/// The file name's ending that makes a socket a VM's monitor.
const SUFFIX: &str = ".qmp";
/// A unix socket's path is at most this many bytes (`sun_path`, less its terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// What a VM's monitor says of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    /// QEMU's run state (`running`, `paused`, `inmigrate`, ...).
    State(String),
    /// It accepts connections but does not answer: another client has it.
    Busy,
    /// Nothing listens on it: the VM ended.
    Gone,
}

/// Why a VM's name cannot have a monitor in the directory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MonitorError {
    #[error(
        "{0:?} cannot name a VM's monitor (letters, digits, '-', '.', '_'; not starting with '.')"
    )]
    BadName(String),
    #[error("the monitor of VM {name:?} would be {path} ({len} bytes), longer than a unix socket's path may be ({MAX_SOCKET_PATH}); use a shorter [qemu] qmp_dir or name")]
    TooLong {
        name: String,
        path: String,
        len: usize,
    },
    #[error("a VM named {0:?} is already arriving on this host")]
    Arriving(String),
    #[error("a VM named {name:?} already runs on this host (its monitor {path} answers)")]
    Taken { name: String, path: String },
    #[error("{0} is in the way of the arriving VM's monitor (not a socket); remove it")]
    InTheWay(String),
    #[error("cannot clear the old monitor {path}: {why}")]
    Clear { path: String, why: String },
}

/// The directory, and the VMs arriving into it (not listed until they are this host's).
#[derive(Debug)]
pub struct MonitorDir {
    dir: PathBuf,
    arriving: Mutex<HashSet<String>>,
    /// Monitors that did not answer, and when.
    busy_since: Mutex<HashMap<String, Instant>>,
}

impl MonitorDir {
    pub fn new(dir: PathBuf) -> Arc<MonitorDir> {
        Arc::new(MonitorDir {
            dir,
            arriving: Mutex::default(),
            busy_since: Mutex::default(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether `name` can name a VM's monitor (a file name of the directory).
    pub fn check_name(name: &str) -> Result<(), MonitorError> {
        if valid_vm_name(name) {
            Ok(())
        } else {
            Err(MonitorError::BadName(name.to_owned()))
        }
    }

    /// VM `name`'s monitor (whether or not it is there).
    pub fn socket(&self, name: &str) -> Result<PathBuf, MonitorError> {
        MonitorDir::check_name(name)?;
        let path = self.dir.join(format!("{name}{SUFFIX}"));
        let len = path.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            return Err(MonitorError::TooLong {
                name: name.to_owned(),
                path: path.display().to_string(),
                len,
            });
        }
        Ok(path)
    }

    /// The names of the VMs whose monitors are in the directory, less those arriving; sorted.
    pub fn names(&self) -> std::io::Result<Vec<String>> {
        let mut names: Vec<String> = std::fs::read_dir(&self.dir)?
            .filter_map(Result::ok)
            .filter_map(|e| {
                let file = e.file_name().into_string().ok()?;
                let name = file.strip_suffix(SUFFIX)?;
                valid_vm_name(name).then(|| name.to_owned())
            })
            .filter(|name| !self.is_arriving(name))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Whether VM `name` is arriving here (its QEMU started, not committed yet).
    pub fn is_arriving(&self, name: &str) -> bool {
        self.arriving.lock().expect("arriving lock").contains(name)
    }

    /// What VM `name`'s monitor says, for a listing: one that did not answer lately is taken
    /// to be busy still rather than asked again.
    pub async fn state_of(&self, name: &str) -> Asked {
        let socket = match self.socket(name) {
            Ok(socket) => socket,
            Err(e) => {
                tracing::warn!("{e}");
                return Asked::Gone;
            }
        };
        let quiet = self
            .busy_since
            .lock()
            .expect("busy lock")
            .get(name)
            .is_some_and(|since| since.elapsed() < BUSY_QUIET);
        if quiet {
            return Asked::Busy;
        }
        let asked = ask(&socket).await;
        let mut busy = self.busy_since.lock().expect("busy lock");
        if asked == Asked::Busy {
            busy.insert(name.to_owned(), Instant::now());
        } else {
            busy.remove(name);
        }
        asked
    }

    /// Makes room for VM `name` arriving here: refused while a VM of that name runs here or is
    /// arriving; an old socket nobody listens on goes, and so does a QEMU still waiting there
    /// for an arrival that is not coming (one an agent started before it was restarted). The
    /// VM is not listed until the [`Arrival`] is dropped.
    pub async fn claim(self: &Arc<Self>, name: &str) -> Result<Arrival, MonitorError> {
        let socket = self.socket(name)?;
        let pidfile = socket.with_extension("pid");
        if !self
            .arriving
            .lock()
            .expect("arriving lock")
            .insert(name.to_owned())
        {
            return Err(MonitorError::Arriving(name.to_owned()));
        }
        let arrival = Arrival {
            dir: self.clone(),
            name: name.to_owned(),
            socket,
            pidfile,
        };
        let path = arrival.socket.display().to_string();
        if let Ok(meta) = std::fs::symlink_metadata(&arrival.socket) {
            use std::os::unix::fs::FileTypeExt;
            let kind = meta.file_type();
            if !kind.is_socket() && !kind.is_symlink() {
                return Err(MonitorError::InTheWay(path));
            }
            match ask(&arrival.socket).await {
                Asked::Gone => {}
                Asked::State(state) if state == "inmigrate" => {
                    tracing::warn!(
                        "{path}: a QEMU waits there for an arrival that is not coming; quitting it"
                    );
                    quit(&arrival.socket)
                        .await
                        .map_err(|why| MonitorError::Clear {
                            path: path.clone(),
                            why,
                        })?;
                }
                _ => {
                    return Err(MonitorError::Taken {
                        name: name.to_owned(),
                        path,
                    })
                }
            }
            match std::fs::remove_file(&arrival.socket) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(MonitorError::Clear {
                        path,
                        why: e.to_string(),
                    })
                }
            }
        }
        Ok(arrival)
    }
}

/// A VM arriving into the directory: where its QEMU's monitor and pid file go.
#[derive(Debug)]
pub struct Arrival {
    dir: Arc<MonitorDir>,
    name: String,
    pub socket: PathBuf,
    pub pidfile: PathBuf,
}

impl Drop for Arrival {
    fn drop(&mut self) {
        self.dir
            .arriving
            .lock()
            .expect("arriving lock")
            .remove(&self.name);
    }
}

/// A VM's name as a file name: what libvirt and people call VMs, without separators or a
/// leading dot.
fn valid_vm_name(name: &str) -> bool {
    ferry_api::names::valid_name(name) && !name.starts_with('.') && name.len() <= 64
}

/// Quits the QEMU serving `socket` and waits until its process is gone (it removes its
/// socket as it ends: a new QEMU's must not be removed by the old one's exit).
async fn quit(socket: &Path) -> Result<(), String> {
    let qmp = tokio::time::timeout(ASK_TIMEOUT, Qmp::connect(socket))
        .await
        .map_err(|_| "its monitor stopped answering".to_owned())?
        .map_err(|e| e.to_string())?;
    let pid = qmp
        .peer_pid()
        .ok_or("the kernel does not say which process it is")?;
    let _ = qmp.execute(&Quit).await;
    drop(qmp);
    let deadline = Instant::now() + QUIT_TIMEOUT;
    while Path::new(&format!("/proc/{pid}")).exists() {
        if Instant::now() > deadline {
            return Err(format!(
                "its QEMU (pid {pid}) did not quit within {QUIT_TIMEOUT:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Asks the monitor at `socket` for its VM's run state.
pub async fn ask(socket: &Path) -> Asked {
    let asked = tokio::time::timeout(ASK_TIMEOUT, async {
        let qmp = Qmp::connect(socket).await?;
        qmp.execute(&QueryStatus).await
    })
    .await;
    match asked {
        Ok(Ok(status)) => Asked::State(status.status),
        Ok(Err(QmpError::Connect { source, .. }))
            if matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ) =>
        {
            Asked::Gone
        }
        Ok(Err(e)) => {
            tracing::debug!("monitor {}: {e}", socket.display());
            Asked::Busy
        }
        Err(_) => Asked::Busy,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-monitors-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn names_are_the_sockets_that_can_name_a_vm() {
        let dir = temp_dir("names");
        for f in ["web.qmp", "db-1.qmp", ".hidden.qmp", "notes.txt", "app.pid"] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let monitors = MonitorDir::new(dir.clone());
        assert_eq!(monitors.names().unwrap(), ["db-1", "web"]);
        assert_eq!(
            monitors.socket("../etc").unwrap_err(),
            MonitorError::BadName("../etc".into())
        );
        let long = "x".repeat(64);
        let deep = MonitorDir::new(PathBuf::from(format!("/{}", "d".repeat(60))));
        assert!(matches!(
            deep.socket(&long),
            Err(MonitorError::TooLong { len: 130, .. })
        ));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn an_arrival_replaces_a_dead_socket_but_not_a_live_one() {
        let dir = temp_dir("claim");
        let monitors = MonitorDir::new(dir.clone());
        // A VM that ended: its socket is there, nobody listens.
        drop(std::os::unix::net::UnixListener::bind(dir.join("old.qmp")).unwrap());
        let arrival = monitors.claim("old").await.unwrap();
        assert!(!arrival.socket.exists());
        assert_eq!(arrival.pidfile, dir.join("old.pid"));
        assert!(monitors.is_arriving("old"));
        // Not listed, and not claimed twice, while it arrives.
        drop(std::os::unix::net::UnixListener::bind(&arrival.socket).unwrap());
        assert!(monitors.names().unwrap().is_empty());
        assert_eq!(
            monitors.claim("old").await.unwrap_err(),
            MonitorError::Arriving("old".into())
        );
        drop(arrival);
        assert_eq!(monitors.names().unwrap(), ["old"]);
        // A monitor that accepts (another client holds it) is a VM that runs.
        let _live = std::os::unix::net::UnixListener::bind(dir.join("live.qmp")).unwrap();
        assert_eq!(ask(&dir.join("live.qmp")).await, Asked::Busy);
        // ... and is left alone for a while.
        assert_eq!(monitors.state_of("live").await, Asked::Busy);
        let t0 = Instant::now();
        assert_eq!(monitors.state_of("live").await, Asked::Busy);
        assert!(t0.elapsed() < ASK_TIMEOUT);
        assert!(matches!(
            monitors.claim("live").await.unwrap_err(),
            MonitorError::Taken { .. }
        ));
        // A file that is no socket is not removed.
        std::fs::write(dir.join("file.qmp"), b"mine").unwrap();
        assert!(matches!(
            monitors.claim("file").await.unwrap_err(),
            MonitorError::InTheWay(_)
        ));
        assert_eq!(std::fs::read(dir.join("file.qmp")).unwrap(), b"mine");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
