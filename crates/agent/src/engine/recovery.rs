//! Settling migrations an agent was killed in the middle of, from its [`journal`] records, and
//! the verdicts that settle a source in doubt. The rule: never a VM paused at both ends, and
//! never running at both.
//!
//! At the destination, on restart:
//! - `receiving`: the VM never resumed here and the stream's session is gone with the old
//!   process: its QEMU is quit (if it does not run: then it is not this migration's) and the
//!   record says aborted.
//! - `committing`: the decision to resume was taken (digests matched); QEMU runs, or is resumed
//!   now if it loaded. If its QEMU is gone, nobody can tell whether it ran: the record stays,
//!   and a source asking is told "unknown" (an operator decides).
//!
//! At the source, on restart:
//! - `preparing`: QEMU's stream had not started, so the destination cannot have resumed the
//!   VM: QEMU's migration is cancelled, the disks' mirrors abandoned, and the VM resumed here.
//! - `streaming`: the stream's end may have gone out: only the destination knows. Its verdict
//!   is asked for until it answers, and the source VM is quit (committed) or resumed (aborted).
//! - `committed`: the destination runs the VM; the agent may have gone before it quit the
//!   source QEMU (it saves the VM's memory for its return first). The QEMU is quit if it is
//!   still there: the same process, its migration completed (`postmigrate`).
//!
//! A running source in doubt (the stream's end went out and the session fell silent) asks for
//! the same verdict, for the destination agent may have restarted and lost the session.
//!
//! [`journal`]: crate::engine::journal

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use ferry_api::agent::{MigrationState, MigrationStatus, Phase};
use ferry_api::EventKind;
use ferry_qemu::commands::{Cont, MigrateCancel, QueryMigrate, QueryStatus, Quit};
use ferry_qemu::Qmp;
use ferry_wire::connection_count::ConnectionCount;
use ferry_wire::net::{keep_connected, Peer, Pool};
use ferry_wire::tls::ClientConfig;
use ferry_wire::{Session, SessionConfig, SessionId};

use crate::engine::control::{self, Control, CONTROL_VERSION};
use crate::engine::disk;
use crate::engine::journal::{
    IncomingRecord, IncomingState, Journal, OutgoingRecord, OutgoingState, Verdict,
};
use crate::engine::postcopy_recovery::{self, HeldMonitors};
use crate::engine::status::{now_ms, Events, Registry, Shared};

/// How often a source in doubt asks the destination.
pub const ASK_EVERY: Duration = Duration::from_secs(5);
/// How long one question may take (connecting included).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// How a source agent reaches a peer to ask it.
#[derive(Clone)]
pub struct PeerLink {
    pub name: String,
    pub address: String,
    pub tls: Arc<ClientConfig>,
    pub pool: Arc<Pool>,
}

/// Asks the destination what became of the migration on session `of`, which started at
/// `started_unix_ms`.
pub async fn ask_verdict(peer: &PeerLink, of: SessionId, started_unix_ms: u64) -> Result<Verdict> {
    let (session, _connections) = connect_to(peer).await?;
    let asked = async {
        control::send(
            &session,
            &Control::Verdict {
                version: CONTROL_VERSION,
                of,
                started_unix_ms,
            },
        )
        .await?;
        match control::recv(&session).await? {
            Control::VerdictIs { verdict } => Ok(verdict),
            Control::Abort { reason } => bail!("the destination refused the question: {reason}"),
            other => bail!("unexpected answer to Verdict: {other:?}"),
        }
    };
    let verdict = tokio::time::timeout(ANSWER_TIMEOUT, asked)
        .await
        .map_err(|_| anyhow!("no answer within {}s", ANSWER_TIMEOUT.as_secs()))?;
    control::park_and_end(&session, "verdict given").await;
    verdict
}

/// A new session to `peer` on one connection, kept connected while the returned set lives.
pub async fn connect_to(peer: &PeerLink) -> Result<(Session, tokio::task::JoinSet<()>)> {
    let addr = tokio::net::lookup_host(&peer.address)
        .await
        .with_context(|| format!("peer {:?}: address {:?}", peer.name, peer.address))?
        .next()
        .ok_or_else(|| {
            anyhow!(
                "peer {:?}: {:?} resolves to nothing",
                peer.name,
                peer.address
            )
        })?;
    let session = Session::new(SessionId::random(), SessionConfig::default());
    let (events, _link_events) = tokio::sync::mpsc::unbounded_channel();
    let connections = keep_connected(
        session.clone(),
        Peer {
            addr,
            name: peer.name.clone(),
            tls: peer.tls.clone(),
            connections: ConnectionCount::fixed(1),
            link_rate_mbit: None,
            pool: peer.pool.clone(),
        },
        Duration::from_millis(500),
        events,
    );
    Ok((session, connections))
}

/// The destination's answer about session `of` (started at `started_unix_ms` by the source's
/// clock), `live` when it still runs here; a session that was being resumed here is left to
/// [`settle_committing`] (`Err`). The caller holds the lock under which sessions start, so
/// that "it never ran here" cannot become untrue before the answer makes it final: a session
/// this agent has no record of, or one that ended before its commit, is recorded aborted, and
/// a late replay of it is refused. Records older than the journal's horizon are gone, and so
/// is what they said: such a session's fate is unknown.
pub fn verdict_for(
    journal: &Journal,
    of: SessionId,
    started_unix_ms: u64,
    live: bool,
) -> std::result::Result<Verdict, Box<IncomingRecord>> {
    let unknown = |e: anyhow::Error| Verdict::Unknown {
        reason: format!("{e:#}"),
    };
    let record = match journal.incoming(of) {
        Ok(record) => record,
        Err(e) => return Ok(unknown(e)),
    };
    let state = record.as_ref().map(|r| r.state);
    match state {
        // Postcopy, the VM running here and pages still due: on their session, or, that
        // session gone (this agent restarted, or it failed past the switch), on one the source
        // resumes the migration on. Committed without pages due: every page arrived.
        Some(IncomingState::Committed) if record.as_ref().is_some_and(|r| r.postcopy_pending) => {
            return Ok(if live {
                Verdict::Pending
            } else {
                Verdict::PostcopyPaused
            })
        }
        Some(IncomingState::Committed) => return Ok(Verdict::Committed),
        Some(IncomingState::Aborted) => {
            return Ok(Verdict::Aborted {
                reason: record.and_then(|r| r.reason).unwrap_or_default(),
            })
        }
        Some(IncomingState::Lost) => {
            return Ok(Verdict::Lost {
                reason: record.and_then(|r| r.reason).unwrap_or_default(),
            })
        }
        // Still here, before or at its commit (which may be telling the source now).
        _ if live => return Ok(Verdict::Pending),
        Some(IncomingState::Committing) => {
            return Err(Box::new(record.expect("a committing record")))
        }
        Some(IncomingState::Receiving) | None => {}
    }
    if record.is_none() {
        match journal.horizon() {
            Ok(Some(horizon)) if started_unix_ms <= horizon => {
                return Ok(Verdict::Unknown {
                    reason: "the destination no longer keeps records of migrations that old".into(),
                })
            }
            Ok(_) => {}
            Err(e) => return Ok(unknown(e)),
        }
    }
    let reason = match &record {
        Some(_) => "the destination's part ended before the commit",
        None => "the migration never reached the destination agent",
    };
    let aborted = IncomingRecord {
        session: of,
        vm: record.as_ref().map(|r| r.vm.clone()).unwrap_or_default(),
        qmp: record.map(|r| r.qmp).unwrap_or_default(),
        state: IncomingState::Aborted,
        reason: Some(reason.into()),
        postcopy_pending: false,
        monitor_keeper: None,
        images_made: Vec::new(),
        updated_unix_ms: now_ms(),
    };
    Ok(match journal.write_incoming(&aborted) {
        Ok(()) => Verdict::Aborted {
            reason: reason.into(),
        },
        Err(e) => unknown(e),
    })
}

/// The verdict on a session whose destination was being resumed when its agent went.
pub async fn verdict_after_committing(journal: &Journal, record: IncomingRecord) -> Verdict {
    match settle_committing(journal, record).await {
        IncomingState::Committed => Verdict::Committed,
        IncomingState::Aborted => Verdict::Aborted {
            reason: "the destination QEMU failed to load the stream".into(),
        },
        _ => Verdict::Unknown {
            reason: "the destination QEMU went while it was being resumed; it may have run".into(),
        },
    }
}

/// Settles the incoming migrations a killed destination agent left (see the module's text).
pub async fn recover_incoming(journal: &Journal, held: &HeldMonitors) {
    let records = match journal.all_incoming() {
        Ok(records) => records,
        Err(e) => {
            tracing::error!("the incoming migrations' records: {e:#}");
            return;
        }
    };
    for record in records {
        match record.state {
            IncomingState::Receiving => {
                // Only a QEMU still waiting for (or loading) the stream: one that runs is not
                // this migration's, and neither are the disks it uses.
                let mut theirs = false;
                if let Ok(qmp) = Qmp::connect(&record.qmp).await {
                    match qmp.execute(&QueryStatus).await {
                        Ok(s) if !s.running => {
                            let _ = qmp.execute(&Quit).await;
                        }
                        _ => theirs = true,
                    }
                }
                if !theirs {
                    disk::image::remove(&record.images_made);
                }
                let reason = "the destination agent restarted before the commit";
                tracing::warn!(
                    "session {}: VM {:?}: {reason}; its QEMU here quit, and {} disk image(s) \
                     made for it removed",
                    record.session,
                    record.vm,
                    if theirs { 0 } else { record.images_made.len() }
                );
                let aborted = IncomingRecord {
                    state: IncomingState::Aborted,
                    reason: Some(reason.into()),
                    images_made: Vec::new(),
                    updated_unix_ms: now_ms(),
                    ..record
                };
                if let Err(e) = journal.write_incoming(&aborted) {
                    tracing::error!("session {}: {e:#}", aborted.session);
                }
            }
            IncomingState::Committing => {
                settle_committing(journal, record).await;
            }
            IncomingState::Committed if record.postcopy_pending => {
                postcopy_recovery::adopt_kept_monitor(journal, held, record).await;
            }
            IncomingState::Committed | IncomingState::Aborted | IncomingState::Lost => {}
        }
    }
    journal.prune_later();
}

/// A destination that decided to resume its VM and may not have: resumed now if its QEMU
/// loaded the stream and is there. Returns the state recorded.
async fn settle_committing(journal: &Journal, record: IncomingRecord) -> IncomingState {
    // QEMU had the whole stream: it ends its load (completed or failed) shortly.
    let settled = async {
        let qmp = Qmp::connect(&record.qmp).await?;
        if qmp.execute(&QueryStatus).await?.running {
            return Ok(IncomingState::Committed);
        }
        for _ in 0..100 {
            match qmp.execute(&QueryMigrate).await?.status.as_deref() {
                Some("completed") => {
                    qmp.execute(&Cont).await?;
                    return Ok(IncomingState::Committed);
                }
                // It never ran: the VM stays the source's.
                Some("failed") => {
                    let _ = qmp.execute(&Quit).await;
                    return Ok(IncomingState::Aborted);
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        bail!("its QEMU has not finished loading the stream after 10 s")
    }
    .await;
    match settled {
        Ok(state) => {
            tracing::info!(
                "session {}: VM {:?}: {state:?} (settled from its record)",
                record.session,
                record.vm
            );
            let reason = (state == IncomingState::Aborted)
                .then(|| "the destination QEMU failed to load the stream".to_owned());
            let settled = IncomingRecord {
                state,
                reason,
                updated_unix_ms: now_ms(),
                ..record
            };
            if let Err(e) = journal.write_incoming(&settled) {
                tracing::error!("session {}: {e:#}", settled.session);
            }
            state
        }
        Err(e) => {
            tracing::error!(
                "session {}: VM {:?} was being resumed here and cannot be now ({e:#}); whether \
                 it ran is unknown: check before resuming the source",
                record.session,
                record.vm
            );
            IncomingState::Committing
        }
    }
}

/// Settles the outgoing migrations a killed source agent left (see the module's text): each
/// is listed again under its id, and those whose stream's end went out wait for the
/// destination's verdict in a task of their own.
pub async fn recover_outgoing(
    journal: &Journal,
    registry: &Registry,
    work_dir: &Path,
    peer_of: impl Fn(&str) -> Option<PeerLink>,
) {
    let records = match journal.all_outgoing() {
        Ok(records) => records,
        Err(e) => {
            tracing::error!("the outgoing migrations' records: {e:#}");
            return;
        }
    };
    for record in records {
        let status = Shared::new(MigrationStatus {
            error: record.reason.clone(),
            ..MigrationStatus::starting(
                record.id.clone(),
                record.vm.clone(),
                record.started_unix_ms,
            )
        });
        crate::engine::status::register(registry, record.id.clone(), status.clone());
        match record.state {
            OutgoingState::Committed if postcopy_recovery::source_paused(&record).await => {
                let Some(peer) = peer_of(&record.to) else {
                    status.update(|s| {
                        s.detail = format!(
                            "postcopy, paused: the destination {:?} is no longer in this \
                             agent's config, so its migration cannot be resumed",
                            record.to
                        );
                    });
                    continue;
                };
                tokio::spawn(postcopy_recovery::resume_source(
                    record,
                    peer,
                    work_dir.to_owned(),
                    journal.clone(),
                    status,
                ));
            }
            OutgoingState::Committed => {
                status.update(|s| {
                    s.state = MigrationState::Committed;
                    s.phase = Phase::Committed;
                });
                // In a task of its own: a monitor that does not answer must not hold the
                // agent's start.
                tokio::spawn(quit_if_migrated_away(record.clone()));
            }
            OutgoingState::Failed => status.update(|s| {
                s.state = MigrationState::Failed;
                s.phase = Phase::Failed;
            }),
            OutgoingState::Preparing => {
                let reason = "the source agent restarted before the stream started";
                let outcome = resume_source(&record.source_qmp, &record.disks).await;
                settle_outgoing(journal, &status, record, Err(anyhow!("{reason}")), outcome);
            }
            OutgoingState::Streaming => {
                status.update(|s| {
                    s.phase = Phase::InDoubt;
                    s.detail = "the source agent restarted while the stream flowed or after \
                                its end went out; asking the destination for its verdict"
                        .into();
                });
                let Some(peer) = peer_of(&record.to) else {
                    status.update(|s| {
                        s.detail = format!(
                            "in doubt: the destination {:?} is no longer in this agent's config; \
                             the source stays paused",
                            record.to
                        );
                    });
                    continue;
                };
                let journal = journal.clone();
                tokio::spawn(async move {
                    let verdict = loop {
                        match ask_verdict(&peer, record.session, record.started_unix_ms).await {
                            Ok(Verdict::Committed) => break Ok(()),
                            Ok(Verdict::Aborted { reason }) => {
                                break Err(anyhow!("the destination aborted: {reason}"))
                            }
                            Ok(other) => status.update(|s| {
                                s.detail = format!("in doubt: the destination says {other}")
                            }),
                            Err(e) => status.update(|s| {
                                s.detail = format!("in doubt: asking the destination: {e:#}")
                            }),
                        }
                        tokio::time::sleep(ASK_EVERY).await;
                    };
                    let outcome = match &verdict {
                        Ok(()) => quit_source(&record.source_qmp).await,
                        Err(_) => resume_source(&record.source_qmp, &record.disks).await,
                    };
                    settle_outgoing(&journal, &status, record, verdict, outcome);
                });
            }
        }
    }
}

/// Records the end of an outgoing migration a restart settled: `verdict` says whether it
/// committed (else why not), `outcome` whether the source QEMU then did as told.
fn settle_outgoing(
    journal: &Journal,
    status: &Shared,
    record: OutgoingRecord,
    verdict: Result<()>,
    outcome: Result<()>,
) {
    let (state, reason) = match (&verdict, outcome) {
        (Ok(()), Ok(())) => (OutgoingState::Committed, None),
        (Ok(()), Err(e)) => (
            OutgoingState::Committed,
            Some(format!(
                "the destination runs; quitting the source QEMU: {e:#}"
            )),
        ),
        (Err(why), Ok(())) => (
            OutgoingState::Failed,
            Some(format!("{why:#}; the source VM keeps running")),
        ),
        (Err(why), Err(e)) => (
            OutgoingState::Failed,
            Some(format!("{why:#}; resuming the source VM: {e:#}")),
        ),
    };
    status.update(|s| {
        if state == OutgoingState::Committed {
            s.state = MigrationState::Committed;
            s.phase = Phase::Committed;
            s.detail = "the destination runs (settled after a restart)".into();
            s.event(
                EventKind::Committed,
                "settled after the source agent restarted",
            );
        } else {
            s.state = MigrationState::Failed;
            s.phase = Phase::Failed;
            s.detail = "settled after the source agent restarted".into();
        }
        if let Some(reason) = &reason {
            s.error = Some(reason.clone());
            if state == OutgoingState::Failed {
                s.event(EventKind::Failed, reason.clone());
            }
        }
    });
    tracing::warn!(
        "migration {} of {:?}: {state:?} after a restart ({reason:?})",
        record.id,
        record.vm
    );
    let settled = OutgoingRecord {
        state,
        reason,
        updated_unix_ms: now_ms(),
        ..record
    };
    if let Err(e) = journal.write_outgoing(&settled) {
        tracing::error!("migration {}: {e:#}", settled.id);
    }
}

/// Stops what is left of QEMU's migration (its stream, the mirrors of `disks`) and resumes the
/// source VM.
async fn resume_source(qmp: &Path, disks: &[String]) -> Result<()> {
    let qmp = Qmp::connect(qmp).await?;
    let _ = qmp.execute(&MigrateCancel).await;
    crate::engine::disk::mirror::abandon(&qmp, disks).await;
    crate::engine::source::ensure_running(&qmp).await
}

/// The source QEMU of a committed migration, if it is still there (the same process) with
/// its migration completed (`postmigrate`: it can never rightly run again), is quit. Any other
/// QEMU at its socket is not this migration's and is left alone.
async fn quit_if_migrated_away(record: OutgoingRecord) {
    let Some(pid) = record.source_pid else {
        return;
    };
    // Gone with its process, most often: nothing to do.
    let Ok(qmp) = Qmp::connect(&record.source_qmp).await else {
        return;
    };
    if qmp.peer_pid() != Some(pid) {
        return;
    }
    match qmp.execute(&QueryStatus).await {
        Ok(s) if s.status == "postmigrate" => {
            tracing::warn!(
                "migration {} of {:?}: committed, and its source QEMU (pid {pid}) was still \
                 there: quit now",
                record.id,
                record.vm
            );
            if let Err(e) = qmp.execute(&Quit).await {
                tracing::warn!("migration {}: quitting its source QEMU: {e}", record.id);
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("migration {}: its source QEMU: {e}", record.id),
    }
}

/// The destination runs the VM: the source's QEMU goes.
async fn quit_source(qmp: &Path) -> Result<()> {
    let qmp = Qmp::connect(qmp).await?;
    let _ = qmp.execute(&Quit).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(session: u128, state: IncomingState) -> IncomingRecord {
        IncomingRecord {
            session: SessionId(session),
            vm: "vm".into(),
            qmp: "/nowhere/vm.qmp".into(),
            state,
            reason: Some("why".into()),
            postcopy_pending: false,
            monitor_keeper: None,
            images_made: Vec::new(),
            updated_unix_ms: 100,
        }
    }

    #[tokio::test]
    async fn a_restart_before_the_commit_removes_the_images_made_for_a_qemu_that_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path());
        let made = dir.path().join("disk0.qcow2");
        std::fs::write(&made, b"an image").unwrap();
        // Its QEMU is gone (no monitor at the record's path): the image is no one's.
        let receiving = IncomingRecord {
            images_made: vec![made.clone()],
            ..record(1, IncomingState::Receiving)
        };
        journal.write_incoming(&receiving).unwrap();
        recover_incoming(&journal, &HeldMonitors::default()).await;
        assert!(!made.exists(), "the image made for it is left");
        let settled = journal.incoming(SessionId(1)).unwrap().unwrap();
        assert_eq!(settled.state, IncomingState::Aborted);
        assert!(settled.images_made.is_empty(), "{settled:?}");
    }

    #[test]
    fn a_session_never_seen_is_aborted_for_good_unless_it_is_older_than_the_records() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path());
        let aborted = Verdict::Aborted {
            reason: "the migration never reached the destination agent".into(),
        };
        assert_eq!(
            verdict_for(&journal, SessionId(1), 500, false),
            Ok(aborted.clone())
        );
        // The answer is on record: the session cannot start here any more, and is answered
        // the same way again.
        let tomb = journal.incoming(SessionId(1)).unwrap().unwrap();
        assert_eq!(tomb.state, IncomingState::Aborted);
        assert_eq!(verdict_for(&journal, SessionId(1), 500, false), Ok(aborted));
        // Past the horizon of removed records nothing can be said.
        std::fs::write(dir.path().join("journal/incoming-horizon"), "1000").unwrap();
        assert!(matches!(
            verdict_for(&journal, SessionId(2), 999, false),
            Ok(Verdict::Unknown { .. })
        ));
        assert!(journal.incoming(SessionId(2)).unwrap().is_none());
    }

    #[test]
    fn each_record_answers_for_itself_and_a_live_session_is_pending_until_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::new(dir.path());
        for (session, state) in [
            (1, IncomingState::Receiving),
            (2, IncomingState::Committing),
            (3, IncomingState::Committed),
            (4, IncomingState::Aborted),
        ] {
            journal.write_incoming(&record(session, state)).unwrap();
        }
        let postcopy = IncomingRecord {
            postcopy_pending: true,
            ..record(5, IncomingState::Committed)
        };
        journal.write_incoming(&postcopy).unwrap();
        let verdict = |session, live| verdict_for(&journal, SessionId(session), 0, live);
        // Postcopy, pages due: on their session, or on one the source must resume it on.
        assert_eq!(verdict(5, true), Ok(Verdict::Pending));
        assert_eq!(verdict(5, false), Ok(Verdict::PostcopyPaused));
        assert_eq!(verdict(3, false), Ok(Verdict::Committed));
        assert_eq!(verdict(1, true), Ok(Verdict::Pending));
        assert_eq!(verdict(2, true), Ok(Verdict::Pending));
        // Committed while its session still tells the source.
        assert_eq!(verdict(3, true), Ok(Verdict::Committed));
        assert_eq!(
            verdict(4, false),
            Ok(Verdict::Aborted {
                reason: "why".into()
            })
        );
        // Being resumed when the agent went: for its QEMU to settle.
        assert_eq!(verdict(2, false).unwrap_err().session, SessionId(2));
        // Ended before its commit without a final record: aborted, and recorded so.
        assert!(matches!(verdict(1, false), Ok(Verdict::Aborted { .. })));
        assert_eq!(
            journal.incoming(SessionId(1)).unwrap().unwrap().state,
            IncomingState::Aborted
        );
    }
}
