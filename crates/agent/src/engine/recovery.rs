//! Settling migrations an agent was killed in the middle of, from its [`journal`] records, and
//! the verdicts that settle a source in doubt. The rule: never a VM paused at both ends, and
//! never running at both.
//!
//! At the destination, on restart:
//! - `receiving`: the VM never resumed here and the stream's session is gone with the old
//!   process: its QEMU is quit and the record says aborted.
//! - `committing`: the decision to resume was taken (digests matched, QEMU loaded); QEMU runs,
//!   or is resumed now if it loaded. If its QEMU is gone, nobody can tell whether it ran: the
//!   record stays, and a source asking is told "unknown" (an operator decides).
//!
//! At the source, on restart:
//! - `streaming`: the stream's end never went out, so the destination cannot have resumed the
//!   VM: QEMU's migration is cancelled and the VM resumed here.
//! - `end-sent`: only the destination knows; its verdict is asked for until it answers, and the
//!   source VM is quit (committed) or resumed (aborted) accordingly.
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
use ferry_wire::net::{keep_connected, Peer, Pool};
use ferry_wire::tls::ClientConfig;
use ferry_wire::{Session, SessionConfig, SessionId};

use crate::engine::control::{self, Control, CONTROL_VERSION};
use crate::engine::journal::{
    IncomingRecord, IncomingState, Journal, OutgoingRecord, OutgoingState, Verdict,
};
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

/// Asks the destination what became of the migration on session `of`.
pub async fn ask_verdict(peer: &PeerLink, of: SessionId) -> Result<Verdict> {
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
    let _connections = keep_connected(
        session.clone(),
        Peer {
            addr,
            name: peer.name.clone(),
            tls: peer.tls.clone(),
            connections: 1,
            link_rate_mbit: None,
            pool: peer.pool.clone(),
        },
        Duration::from_millis(500),
        events,
    );
    let asked = async {
        control::send(
            &session,
            &Control::Verdict {
                version: CONTROL_VERSION,
                of,
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

/// The destination's answer about session `of`, `live` when it still runs here. A session this
/// agent has no record of never resumed a VM here (the record is written before the QEMU is
/// touched); the answer makes that final, so a late replay of it cannot start it now.
pub async fn verdict_for(journal: &Journal, of: SessionId, live: bool) -> Verdict {
    let record = match journal.incoming(of) {
        Ok(record) => record,
        Err(e) => {
            return Verdict::Unknown {
                reason: format!("{e:#}"),
            }
        }
    };
    // A session still here may be past its commit, telling the source (which may not hear).
    let finished = record
        .as_ref()
        .is_some_and(|r| matches!(r.state, IncomingState::Committed | IncomingState::Aborted));
    if live && !finished {
        return Verdict::Pending;
    }
    match record {
        Some(r) if r.state == IncomingState::Committed => Verdict::Committed,
        Some(r) if r.state == IncomingState::Aborted => Verdict::Aborted {
            reason: r.reason.unwrap_or_default(),
        },
        Some(r) if r.state == IncomingState::Committing => {
            match settle_committing(journal, r).await {
                IncomingState::Committed => Verdict::Committed,
                _ => Verdict::Unknown {
                    reason: "the destination QEMU went while it was being resumed; it may have run"
                        .into(),
                },
            }
        }
        other => {
            // Receiving, and no longer running here; or never seen.
            let reason = match other {
                Some(_) => "the destination's part ended before the commit",
                None => "the migration never reached the destination agent",
            };
            let record = IncomingRecord {
                session: of,
                vm: other.as_ref().map(|r| r.vm.clone()).unwrap_or_default(),
                qmp: other.map(|r| r.qmp).unwrap_or_default(),
                state: IncomingState::Aborted,
                reason: Some(reason.into()),
                updated_unix_ms: now_ms(),
            };
            match journal.write_incoming(&record) {
                Ok(()) => Verdict::Aborted {
                    reason: reason.into(),
                },
                Err(e) => Verdict::Unknown {
                    reason: format!("{e:#}"),
                },
            }
        }
    }
}

/// Settles the incoming migrations a killed destination agent left (see the module's text).
pub async fn recover_incoming(journal: &Journal) {
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
                if let Ok(qmp) = Qmp::connect(&record.qmp).await {
                    let _ = qmp.execute(&Quit).await;
                }
                let reason = "the destination agent restarted before the commit";
                tracing::warn!(
                    "session {}: VM {:?}: {reason}; its QEMU here quit",
                    record.session,
                    record.vm
                );
                let aborted = IncomingRecord {
                    state: IncomingState::Aborted,
                    reason: Some(reason.into()),
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
            IncomingState::Committed | IncomingState::Aborted => {}
        }
    }
}

/// A destination that decided to resume its VM and may not have: resumed now if its QEMU
/// loaded the stream and is there. Returns the state recorded.
async fn settle_committing(journal: &Journal, record: IncomingRecord) -> IncomingState {
    let resumed = async {
        let qmp = Qmp::connect(&record.qmp).await?;
        if !qmp.execute(&QueryStatus).await?.running {
            let loaded = qmp.execute(&QueryMigrate).await?.status.as_deref() == Some("completed");
            if !loaded {
                bail!("its QEMU had not loaded the stream");
            }
            qmp.execute(&Cont).await?;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    match resumed {
        Ok(()) => {
            tracing::info!(
                "session {}: VM {:?} runs here (committed)",
                record.session,
                record.vm
            );
            let committed = IncomingRecord {
                state: IncomingState::Committed,
                updated_unix_ms: now_ms(),
                ..record
            };
            if let Err(e) = journal.write_incoming(&committed) {
                tracing::error!("session {}: {e:#}", committed.session);
            }
            IncomingState::Committed
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
            OutgoingState::Committed => status.update(|s| {
                s.state = MigrationState::Committed;
                s.phase = Phase::Committed;
            }),
            OutgoingState::Failed => status.update(|s| {
                s.state = MigrationState::Failed;
                s.phase = Phase::Failed;
            }),
            OutgoingState::Streaming => {
                let reason = "the source agent restarted before the stream's end went out";
                let outcome = resume_source(&record.source_qmp).await;
                settle_outgoing(journal, &status, record, Err(anyhow!("{reason}")), outcome);
            }
            OutgoingState::EndSent => {
                status.update(|s| {
                    s.phase = Phase::InDoubt;
                    s.detail = "the source agent restarted after the stream's end went out; \
                                asking the destination for its verdict"
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
                        match ask_verdict(&peer, record.session).await {
                            Ok(Verdict::Committed) => break Ok(()),
                            Ok(Verdict::Aborted { reason }) => {
                                break Err(anyhow!("the destination aborted: {reason}"))
                            }
                            Ok(other) => status.update(|s| {
                                s.detail = format!("in doubt: the destination says {other:?}")
                            }),
                            Err(e) => status.update(|s| {
                                s.detail = format!("in doubt: asking the destination: {e:#}")
                            }),
                        }
                        tokio::time::sleep(ASK_EVERY).await;
                    };
                    let outcome = match &verdict {
                        Ok(()) => quit_source(&record.source_qmp).await,
                        Err(_) => resume_source(&record.source_qmp).await,
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

/// Stops what is left of QEMU's migration and resumes the source VM.
pub async fn resume_source(qmp: &Path) -> Result<()> {
    let qmp = Qmp::connect(qmp).await?;
    let _ = qmp.execute(&MigrateCancel).await;
    crate::engine::source::ensure_running(&qmp).await
}

/// The destination runs the VM: the source's QEMU goes.
async fn quit_source(qmp: &Path) -> Result<()> {
    let qmp = Qmp::connect(qmp).await?;
    let _ = qmp.execute(&Quit).await;
    Ok(())
}
