//! What an agent writes down about each migration, so that one killed and restarted finds it
//! and settles it: never a VM paused at both ends ([`crate::engine::recovery`]). One small JSON
//! file per migration and side, replaced whole (a temporary file, fsync, rename, fsync of the
//! directory) at the points that decide what a restart must do:
//!
//! - destination: `receiving` before its QEMU is started or adopted; `committing` once the
//!   stream's digest matched, before `cont` (written while QEMU finishes loading, so that it
//!   costs the pause nothing); then `committed` or `aborted`. So a session without a record,
//!   or whose record never passed `receiving`, never resumed a VM here: that is what lets the
//!   destination answer a source in doubt ([`Verdict`]).
//! - source: `preparing` once the peer is known; `streaming` before QEMU starts its stream
//!   (from then on the stream's end may go out, and only the destination decides); then
//!   `committed` or `failed`.
//!
//! - a libvirt migration's source: a record of the stream when it starts, removed once libvirt
//!   settled the migration at both ends, or once the stream failed before its end went out
//!   ([`crate::libvirt_fence`]).
//!
//! Records of finished migrations are kept (the newest [`KEPT_FINISHED`] of each side), for
//! late questions and for `ferry migrations` after a restart. Older ones are removed, and the
//! destination remembers up to when (its horizon): a question about a session it has no record
//! of is answered "aborted" only if the session started after the horizon.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ferry_wire::SessionId;
use serde::{Deserialize, Serialize};

use crate::engine::monitor_keeper::KeptMonitor;

/// Finished records kept per side; older ones are removed.
pub const KEPT_FINISHED: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IncomingState {
    Receiving,
    Committing,
    Committed,
    Aborted,
    /// Postcopy: the VM ran here past the switch and cannot run on: its QEMU exited, or the
    /// source QEMU holding the pages not yet crossed did (`reason` says which).
    Lost,
}

/// The destination's record of an incoming migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingRecord {
    #[serde(with = "session_hex")]
    pub session: SessionId,
    pub vm: String,
    /// The destination QEMU's monitor.
    pub qmp: PathBuf,
    pub state: IncomingState,
    /// Why it was aborted, or what a restart found.
    #[serde(default)]
    pub reason: Option<String>,
    /// Postcopy, committed at the switch: pages are still due from the source.
    #[serde(default)]
    pub postcopy_pending: bool,
    /// The process keeping the QEMU's monitor connection for a postcopy recovery.
    #[serde(default)]
    pub monitor_keeper: Option<KeptMonitor>,
    /// Disk images this agent made for the migration (it had none at their paths): removed
    /// if the migration never commits, by a restarted agent too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images_made: Vec<PathBuf>,
    pub updated_unix_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutgoingState {
    /// No stream yet: the destination cannot commit.
    Preparing,
    /// QEMU's stream may have ended and its end gone out: the destination decides.
    Streaming,
    Committed,
    Failed,
}

/// The source's record of an outgoing migration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutgoingRecord {
    /// The migration's id in this agent's API.
    pub id: String,
    pub vm: String,
    #[serde(with = "session_hex")]
    pub session: SessionId,
    pub source_qmp: PathBuf,
    /// The source QEMU's process, as the kernel named it when the agent connected: a restart
    /// acts on a QEMU at `source_qmp` only if it is this one (a socket path can be spelt two
    /// ways, and the VM may have come back in another process since).
    #[serde(default)]
    pub source_pid: Option<u32>,
    /// The source QEMU's block nodes being mirrored (empty: memory only), so that a restart
    /// can stop their mirrors.
    #[serde(default)]
    pub disks: Vec<String>,
    /// The destination agent's name.
    pub to: String,
    pub state: OutgoingState,
    /// Committed at the postcopy switch, and not every page has been delivered yet: the VM
    /// runs at the destination and needs what only this source QEMU holds.
    #[serde(default)]
    pub postcopy_pending: bool,
    #[serde(default)]
    pub reason: Option<String>,
    pub started_unix_ms: u64,
    pub updated_unix_ms: u64,
}

/// What the destination says of a session a source asks about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "kebab-case")]
pub enum Verdict {
    /// The VM runs here: the source must quit its own.
    Committed,
    /// The VM was never resumed here, and now never will be: the source may resume its own.
    Aborted { reason: String },
    /// The migration is still going on here.
    Pending,
    /// Postcopy: the VM runs here, but the session carrying its last pages is gone (its agent
    /// restarted) and QEMU waits, paused: the source must resume the migration
    /// (`postcopy_recovery`).
    PostcopyPaused,
    /// The destination cannot tell (its QEMU went while it was being resumed): an operator
    /// decides.
    Unknown { reason: String },
    /// Postcopy: a QEMU exited past the switch, and with it the VM or the pages it still
    /// lacked (`reason`): neither end may resume it on its own; an operator decides.
    Lost { reason: String },
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Committed => write!(f, "the VM runs there"),
            Verdict::Aborted { reason } => write!(f, "aborted: {reason}"),
            Verdict::Pending => write!(f, "the migration still goes on there"),
            Verdict::PostcopyPaused => write!(
                f,
                "the VM runs there, its postcopy migration paused since the session carrying its \
                 pages was lost"
            ),
            Verdict::Lost { reason } => write!(f, "the VM is lost there: {reason}"),
            Verdict::Unknown { reason } => write!(
                f,
                "it cannot tell ({reason}): check the destination before resuming the source \
                 by hand"
            ),
        }
    }
}

/// A session id in JSON: its 32 hex digits, as logs print it (a JSON number cannot hold 128
/// bits: parsers read it as a float).
pub mod session_hex {
    use ferry_wire::SessionId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &SessionId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&id.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SessionId, D::Error> {
        let hex = String::deserialize(d)?;
        u128::from_str_radix(&hex, 16)
            .map(SessionId)
            .map_err(|e| serde::de::Error::custom(format!("session id {hex:?}: {e}")))
    }
}

/// A libvirt migration's stream through this agent, until libvirt settled the migration at
/// both ends ([`crate::libvirt_fence`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LibvirtStreamRecord {
    /// The tunnel session that carried the stream.
    pub id: String,
    pub domain: String,
    /// The destination agent's name.
    pub peer: String,
    pub started_unix_ms: u64,
}

/// An agent's records, under its work directory.
#[derive(Debug, Clone)]
pub struct Journal {
    dir: PathBuf,
}

impl Journal {
    pub fn new(work_dir: &Path) -> Journal {
        Journal {
            dir: work_dir.join("journal"),
        }
    }

    fn incoming_path(&self, session: SessionId) -> PathBuf {
        self.dir.join("incoming").join(format!("{session}.json"))
    }

    fn outgoing_path(&self, id: &str) -> PathBuf {
        self.dir.join("outgoing").join(format!("{id}.json"))
    }

    fn libvirt_stream_path(&self, id: &str) -> PathBuf {
        self.dir.join("libvirt-streams").join(format!("{id}.json"))
    }

    pub fn write_libvirt_stream(&self, record: &LibvirtStreamRecord) -> Result<()> {
        write_durably(&self.libvirt_stream_path(&record.id), record)
    }

    pub fn all_libvirt_streams(&self) -> Result<Vec<LibvirtStreamRecord>> {
        read_all(&self.dir.join("libvirt-streams"))
    }

    /// Forgets a libvirt migration libvirt settled (a record already gone is no error).
    pub fn remove_libvirt_stream(&self, id: &str) -> Result<()> {
        let path = self.libvirt_stream_path(id);
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("remove {}", path.display()))
            }
            _ => Ok(()),
        }
    }

    pub fn write_incoming(&self, record: &IncomingRecord) -> Result<()> {
        write_durably(&self.incoming_path(record.session), record)
    }

    pub fn write_outgoing(&self, record: &OutgoingRecord) -> Result<()> {
        write_durably(&self.outgoing_path(&record.id), record)
    }

    /// Removes the oldest finished records beyond [`KEPT_FINISHED`] per side, moving the
    /// destination's horizon past those it removes. Reads every record: run it off the
    /// migration's path ([`Journal::prune_later`]).
    pub fn prune(&self) -> Result<()> {
        let removed = prune(&self.dir.join("incoming"), |r: &IncomingRecord| {
            matches!(r.state, IncomingState::Committed | IncomingState::Aborted)
                .then_some(r.updated_unix_ms)
        });
        if let Some(newest) = removed.into_iter().max() {
            let horizon = self.horizon()?.unwrap_or(0).max(newest);
            write_durably(&self.horizon_path(), &horizon)?;
        }
        prune(&self.dir.join("outgoing"), |r: &OutgoingRecord| {
            matches!(r.state, OutgoingState::Committed | OutgoingState::Failed)
                .then_some(r.updated_unix_ms)
        });
        Ok(())
    }

    /// [`Journal::prune`] on a blocking thread, its error logged.
    pub fn prune_later(&self) {
        let journal = self.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = journal.prune() {
                tracing::warn!("pruning the migrations' records: {e:#}");
            }
        });
    }

    fn horizon_path(&self) -> PathBuf {
        self.dir.join("incoming-horizon")
    }

    /// The last update of the newest incoming record removed (wall clock, ms), if any was:
    /// what this destination no longer remembers ends there.
    pub fn horizon(&self) -> Result<Option<u64>> {
        read(&self.horizon_path())
    }

    /// The record of incoming session `session`, if there is one.
    pub fn incoming(&self, session: SessionId) -> Result<Option<IncomingRecord>> {
        read(&self.incoming_path(session))
    }

    pub fn all_incoming(&self) -> Result<Vec<IncomingRecord>> {
        read_all(&self.dir.join("incoming"))
    }

    pub fn all_outgoing(&self) -> Result<Vec<OutgoingRecord>> {
        read_all(&self.dir.join("outgoing"))
    }
}

/// Replaces `path` with `value` so that after a crash it holds the old record or the new one,
/// whole, and the new one once this returns.
fn write_durably<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let dir = path.parent().expect("records live in a directory");
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let partial = path.with_extension("partial");
    let mut f =
        fs::File::create(&partial).with_context(|| format!("create {}", partial.display()))?;
    f.write_all(&serde_json::to_vec(value).expect("records serialize"))
        .and_then(|()| f.sync_all())
        .with_context(|| format!("write {}", partial.display()))?;
    fs::rename(&partial, path).with_context(|| format!("rename to {}", path.display()))?;
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("sync {}", dir.display()))
}

fn read<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .with_context(|| format!("the record {} is damaged", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

fn read_all<T: for<'de> Deserialize<'de>>(dir: &Path) -> Result<Vec<T>> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("list {}", dir.display())),
    };
    let mut records = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json") {
            if let Some(record) = read(&path)? {
                records.push(record);
            }
        }
    }
    Ok(records)
}

/// Removes the oldest finished records of `dir` beyond [`KEPT_FINISHED`] (`finished` gives a
/// finished record's last update); returns the last updates of those removed. A record that
/// cannot be read is left alone.
fn prune<T: for<'de> Deserialize<'de>>(
    dir: &Path,
    finished: impl Fn(&T) -> Option<u64>,
) -> Vec<u64> {
    // Reading them is needed only once there are more records than are kept.
    if fs::read_dir(dir).map_or(0, Iterator::count) <= KEPT_FINISHED {
        return Vec::new();
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut done: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter_map(|p| Some((finished(&read::<T>(&p).ok().flatten()?)?, p)))
        .collect();
    if done.len() <= KEPT_FINISHED {
        return Vec::new();
    }
    done.sort();
    let excess = done.len() - KEPT_FINISHED;
    done.truncate(excess);
    done.into_iter()
        .filter(|(_, path)| fs::remove_file(path).is_ok())
        .map(|(updated, _)| updated)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn incoming(session: u128, state: IncomingState) -> IncomingRecord {
        IncomingRecord {
            session: SessionId(session),
            vm: "vm".into(),
            qmp: "/run/vm.qmp".into(),
            state,
            reason: None,
            postcopy_pending: false,
            monitor_keeper: None,
            images_made: Vec::new(),
            updated_unix_ms: 1,
        }
    }

    #[test]
    fn a_record_reads_back_as_written_last_and_a_damaged_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path());
        assert_eq!(journal.incoming(SessionId(7)).unwrap(), None);
        journal
            .write_incoming(&incoming(7, IncomingState::Receiving))
            .unwrap();
        journal
            .write_incoming(&incoming(7, IncomingState::Committing))
            .unwrap();
        let back = journal.incoming(SessionId(7)).unwrap().unwrap();
        assert_eq!(back.state, IncomingState::Committing);
        assert_eq!(journal.all_incoming().unwrap(), vec![back]);
        std::fs::write(journal.incoming_path(SessionId(7)), b"{\"sess").unwrap();
        let err = journal.incoming(SessionId(7)).unwrap_err();
        assert!(format!("{err:#}").contains("is damaged"), "{err:#}");
    }

    #[test]
    fn a_libvirt_streams_record_stays_until_removed_and_removing_it_twice_is_no_error() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path());
        assert_eq!(journal.all_libvirt_streams().unwrap(), vec![]);
        let record = LibvirtStreamRecord {
            id: "0000000000000007".into(),
            domain: "web1".into(),
            peer: "dc2-host3".into(),
            started_unix_ms: 1,
        };
        journal.write_libvirt_stream(&record).unwrap();
        assert_eq!(journal.all_libvirt_streams().unwrap(), vec![record.clone()]);
        journal.remove_libvirt_stream(&record.id).unwrap();
        journal.remove_libvirt_stream(&record.id).unwrap();
        assert_eq!(journal.all_libvirt_streams().unwrap(), vec![]);
    }

    #[test]
    fn finished_records_beyond_the_kept_number_go_oldest_first_unfinished_ones_stay() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path());
        journal
            .write_incoming(&incoming(0, IncomingState::Receiving))
            .unwrap();
        let total = u128::try_from(KEPT_FINISHED).unwrap() + 5;
        for session in 1..=total {
            let mut r = incoming(session, IncomingState::Aborted);
            r.updated_unix_ms = u64::try_from(session).unwrap() * 10;
            journal.write_incoming(&r).unwrap();
        }
        assert_eq!(journal.horizon().unwrap(), None);
        journal.prune().unwrap();
        let kept = journal.all_incoming().unwrap();
        assert_eq!(kept.len(), KEPT_FINISHED + 1);
        assert!(kept.iter().any(|r| r.session == SessionId(0)));
        assert!(kept.iter().any(|r| r.session == SessionId(total)));
        assert!(!kept.iter().any(|r| r.session == SessionId(5)));
        // The destination remembers up to when it forgot: the fifth record's last update.
        assert_eq!(journal.horizon().unwrap(), Some(50));
    }
}
