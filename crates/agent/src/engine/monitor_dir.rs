//! The host's directory of QEMU monitors (`[qemu] qmp_dir`): `<dir>/<name>.qmp` is the QMP
//! socket of VM `<name>`. Its owner's tooling puts its VMs' sockets there (or symlinks to
//! them); a VM this agent receives and starts gets its socket and pid file there from the start
//! ([`MonitorDir::claim`]), so that the VM is found by its name wherever it runs, and QEMU
//! removes both when it ends.
//!
//! The agent never cleans the directory: a socket nobody listens on is a VM that ended, or one
//! whose QEMU is still starting, and is replaced only when a VM of that name arrives here.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_qemu::commands::QueryStatus;
use ferry_qemu::{Qmp, QmpError};

/// A monitor that does not answer within this is held by another client (QEMU serves one at
/// a time).
const ASK_TIMEOUT: Duration = Duration::from_secs(1);
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
}

impl MonitorDir {
    pub fn new(dir: PathBuf) -> Arc<MonitorDir> {
        Arc::new(MonitorDir {
            dir,
            arriving: Mutex::default(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// VM `name`'s monitor (whether or not it is there).
    pub fn socket(&self, name: &str) -> Result<PathBuf, MonitorError> {
        if !valid_vm_name(name) {
            return Err(MonitorError::BadName(name.to_owned()));
        }
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
        let arriving = self.arriving.lock().expect("arriving lock").clone();
        let mut names: Vec<String> = std::fs::read_dir(&self.dir)?
            .filter_map(Result::ok)
            .filter_map(|e| {
                let file = e.file_name().into_string().ok()?;
                let name = file.strip_suffix(SUFFIX)?;
                valid_vm_name(name).then(|| name.to_owned())
            })
            .filter(|name| !arriving.contains(name))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Makes room for VM `name` arriving here: refused while a VM of that name runs here or is
    /// arriving; an old socket nobody listens on goes. The VM is not listed until the
    /// [`Arrival`] is dropped.
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
            if ask(&arrival.socket).await != Asked::Gone {
                return Err(MonitorError::Taken {
                    name: name.to_owned(),
                    path,
                });
            }
            std::fs::remove_file(&arrival.socket).map_err(|e| MonitorError::Clear {
                path,
                why: e.to_string(),
            })?;
            let _ = std::fs::remove_file(&arrival.pidfile);
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
