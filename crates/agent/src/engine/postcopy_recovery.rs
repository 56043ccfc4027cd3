//! Postcopy recovery: a connection between an agent and its QEMU lost after the postcopy
//! switch (the agent was killed and restarted) is resumed through QEMU's own recovery.
//!
//! Past the switch the VM runs at the destination and the pages that had not crossed are only
//! in the source QEMU. A WAN outage never breaks QEMU's sockets (the agents hold on and
//! replay, [`crate::engine::postcopy::HOLD_AFTER_SWITCH`]), but an agent that goes takes its
//! QEMU's sockets with it: that QEMU goes `postcopy-paused`, and the VM at the destination
//! waits on its faults. The source's record says so (`postcopy_pending`), and the restarted
//! source agent resumes the migration on a session of its own:
//!
//! ```text
//!  source (restarted)                            destination
//!  QEMU postcopy-paused (same process)
//!  ResumePostcopy{of}            ==>             the old session failed (its QEMU sockets
//!                                                close: QEMU pauses); postcopy-paused;
//!                                                migrate-recover on a new socket
//!                                <==  PostcopyRecovering
//!  migrate resume=true to the agent's socket
//!  the resumed stream (raw)      ==>             fed to QEMU; its return path back
//!  the new preempt channel       ==>             QEMU's second connection
//!  QEMU completed: End{bytes, digest, preempt}   the whole resumed stream matches, QEMU
//!                                <==  Delivered  completed
//!  quit
//! ```
//!
//! The resumed stream begins with QEMU's bitmap exchange: the destination QEMU says which
//! pages it has, so what was lost with the old agent's buffers is sent again. It crosses
//! raw, without the codec (whose history went with the old agent), checked end to end by its
//! digest like any stream; recovery is rare and what is left is at most the memory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use ferry_api::agent::{MigrationState, Phase};
use ferry_api::EventKind;
use ferry_qemu::commands::{
    MigratePause, MigrateRecover, MigrateResume, QueryMigrate, QueryStatus, Quit,
};
use ferry_qemu::{Qmp, QmpError};
use ferry_wire::{Received, Session, SessionId};
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio_util::task::AbortOnDropHandle;

use crate::engine::control::{self, Control, CONTROL_VERSION, PREEMPT, RETURN_PATH, STREAM};
use crate::engine::destination;
use crate::engine::digest::{StreamDigest, ALGORITHM};
use crate::engine::journal::{
    IncomingRecord, IncomingState, Journal, OutgoingRecord, OutgoingState,
};
use crate::engine::monitor_keeper;
use crate::engine::postcopy::HOLD_AFTER_SWITCH;
use crate::engine::preempt;
use crate::engine::recovery::{connect_to, PeerLink};
use crate::engine::source::RemoveOnDrop;
use crate::engine::status::{now_ms, Events, Shared};

/// How long a QEMU may take to notice its lost connection and pause.
const PAUSE_WITHIN: Duration = Duration::from_secs(30);
/// How often QEMU's migration state is asked while waiting.
const POLL: Duration = Duration::from_millis(50);
/// The most read from QEMU's resumed stream at once.
const READ: usize = 256 << 10;

/// Destination: the monitors of postcopy migrations that failed past the switch, by session,
/// kept for their recovery for [`HOLD_AFTER_SWITCH`]. A destination QEMU waiting for pages
/// answers no new QMP connection (the handshake needs its main thread, which waits on a page
/// fault), so the connection the migration made, with out-of-band execution, is the one
/// recovery can use.
/// A resume under way has the monitor instead; its session is listed, by the migration's, so
/// that another resume of the same migration (its source agent restarted again) makes it give
/// the monitor back.
#[derive(Default)]
pub struct HeldMonitors {
    held: Mutex<HashMap<SessionId, (Qmp, Instant)>>,
    resuming: Mutex<HashMap<SessionId, Session>>,
}

impl std::fmt::Debug for HeldMonitors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.held.lock().expect("held monitors");
        f.debug_set().entries(held.keys()).finish()
    }
}

impl HeldMonitors {
    pub fn keep(&self, session: SessionId, qmp: Qmp) {
        let mut held = self.held.lock().expect("held monitors");
        held.retain(|_, (_, since)| since.elapsed() < HOLD_AFTER_SWITCH);
        held.insert(session, (qmp, Instant::now()));
    }

    fn take(&self, session: SessionId) -> Option<Qmp> {
        let mut held = self.held.lock().expect("held monitors");
        held.remove(&session)
            .filter(|(_, since)| since.elapsed() < HOLD_AFTER_SWITCH)
            .map(|(qmp, _)| qmp)
    }

    fn holds(&self, session: SessionId) -> bool {
        self.held
            .lock()
            .expect("held monitors")
            .contains_key(&session)
    }

    /// Lists `resume` as the one resuming migration `of`; gives the one listed before.
    fn start_resuming(&self, of: SessionId, resume: Session) -> Option<Session> {
        self.resuming.lock().expect("resuming").insert(of, resume)
    }

    fn end_resuming(&self, of: SessionId, resume: &Session) {
        let mut resuming = self.resuming.lock().expect("resuming");
        if resuming.get(&of).is_some_and(|s| s.id() == resume.id()) {
            resuming.remove(&of);
        }
    }
}

/// Destination: the migration `record` describes has every page: its record says so, and its
/// monitor's keeper goes.
pub fn delivered(journal: &Journal, record: IncomingRecord) {
    settle(journal, record, IncomingState::Committed, None);
}

/// Destination: the migration `record` describes lost its VM or the pages it still lacked
/// with a QEMU that exited (`reason`): no recovery can follow, so its monitor's keeper goes.
pub fn lost(journal: &Journal, record: IncomingRecord, reason: String) {
    settle(journal, record, IncomingState::Lost, Some(reason));
}

/// Whether the QEMU behind `qmp` has exited: its monitor closed, or closes when asked.
pub async fn qemu_exited(qmp: &Qmp) -> bool {
    // Writing may fail before the reader has seen the connection end.
    match tokio::time::timeout(ANSWER_WITHIN, qmp.execute(&QueryStatus)).await {
        Ok(Err(QmpError::Disconnected { .. } | QmpError::Write { .. })) => true,
        _ => qmp.is_closed(),
    }
}

/// Records the end of a postcopy migration's pages (`state`, `reason`), releasing the keeper.
fn settle(journal: &Journal, record: IncomingRecord, state: IncomingState, reason: Option<String>) {
    if let Some(kept) = record.monitor_keeper {
        monitor_keeper::release(kept, &record.qmp);
    }
    let settled = IncomingRecord {
        state,
        reason: reason.or(record.reason.clone()),
        postcopy_pending: false,
        monitor_keeper: None,
        updated_unix_ms: now_ms(),
        ..record
    };
    if let Err(e) = journal.write_incoming(&settled) {
        tracing::error!("session {}: {e:#}", settled.session);
    }
}

/// Destination, restarted: takes back the monitor connection the keeper of postcopy migration
/// `record` holds, for the source's resume (its QEMU has paused, its sockets gone with the old
/// agent), or settles the record when every page had arrived.
pub async fn adopt_kept_monitor(journal: &Journal, held: &HeldMonitors, record: IncomingRecord) {
    let adopted = record
        .monitor_keeper
        .ok_or_else(|| anyhow!("no process kept its monitor"))
        .and_then(|kept| Ok(monitor_keeper::take(kept, &record.qmp)?))
        .and_then(|socket| Ok(Qmp::adopt(&record.qmp, socket, true)?));
    let qmp = match adopted {
        Ok(qmp) => qmp,
        // Nothing kept it: QEMU greets a new connection when it no longer waits for pages.
        Err(e) => match connect_within(&record.qmp, ANSWER_WITHIN).await {
            Some(qmp) => qmp,
            None => {
                tracing::error!(
                    "session {}: VM {:?} runs here in postcopy and its pages' session went \
                     with the agent's restart, but its monitor cannot be taken back \
                     ({e:#}): it cannot be recovered",
                    record.session,
                    record.vm
                );
                return;
            }
        },
    };
    if has_every_page(&qmp).await {
        tracing::info!(
            "session {}: VM {:?}: every page had arrived when the agent went",
            record.session,
            record.vm
        );
        drop(qmp);
        delivered(journal, record);
        return;
    }
    tracing::warn!(
        "session {}: VM {:?} runs here in postcopy and its pages' session went with the \
         agent's restart: its monitor is back, waiting for the source to resume the migration",
        record.session,
        record.vm
    );
    held.keep(record.session, qmp);
}

/// How long a destination QEMU that may wait on a page fault is given to answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(3);

/// Whether the postcopy destination QEMU behind `qmp` completed its migration (its agent went
/// after the last page arrived). One still waiting for pages may not answer (its main thread
/// waits on a fault), which is why the wait is short.
async fn has_every_page(qmp: &Qmp) -> bool {
    let asked = tokio::time::timeout(ANSWER_WITHIN, migration_status(qmp));
    asked.await.ok().flatten().as_deref() == Some("completed")
}

async fn connect_within(path: &Path, within: Duration) -> Option<Qmp> {
    tokio::time::timeout(within, Qmp::connect_oob(path))
        .await
        .ok()?
        .ok()
}

/// Source, restarted: whether `record` is a postcopy migration whose source QEMU (the same
/// process) waits to be resumed.
pub async fn source_paused(record: &OutgoingRecord) -> bool {
    if !(record.state == OutgoingState::Committed && record.postcopy_pending) {
        return false;
    }
    let Ok(qmp) = Qmp::connect(&record.source_qmp).await else {
        return false;
    };
    if record.source_pid.is_none() || qmp.peer_pid() != record.source_pid {
        return false;
    }
    // Active: it has not noticed yet that its socket went with the old agent.
    matches!(
        migration_status(&qmp).await.as_deref(),
        Some("postcopy-paused" | "postcopy-active")
    )
}

/// Source, restarted: resumes the postcopy migration `record` describes, then shows how it
/// ended.
pub async fn resume_source(
    record: OutgoingRecord,
    peer: PeerLink,
    work_dir: PathBuf,
    journal: Journal,
    status: Shared,
) {
    let result = match Qmp::connect(&record.source_qmp)
        .await
        .context("the source QEMU's monitor")
    {
        Ok(qmp) => {
            resume(
                record,
                &qmp,
                &peer,
                &work_dir,
                &journal,
                &status,
                "the source agent restarted",
            )
            .await
        }
        Err(e) => Err(e),
    };
    status.update(|s| match result {
        Ok(()) => {
            s.state = MigrationState::Committed;
            s.phase = Phase::Committed;
            s.detail = "postcopy: every page delivered after QEMU's postcopy recovery".into();
            s.event(
                EventKind::Committed,
                "postcopy: recovered after the source agent restarted; every page delivered",
            );
        }
        Err(e) => {
            let reason = format!("{e:#}");
            s.state = MigrationState::Failed;
            s.phase = Phase::Failed;
            s.detail.clone_from(&reason);
            s.error = Some(reason.clone());
            s.event(EventKind::Failed, reason);
        }
    });
}

/// Source: resumes the postcopy migration `record` describes, its connection to QEMU or to the
/// destination's QEMU lost (`lost` says how), and records how it ended.
pub async fn resume(
    record: OutgoingRecord,
    qmp: &Qmp,
    peer: &PeerLink,
    work_dir: &Path,
    journal: &Journal,
    status: &Shared,
    lost: &str,
) -> Result<()> {
    status.update(|s| {
        s.state = MigrationState::Running;
        s.phase = Phase::Postcopy;
        s.detail =
            format!("postcopy: {lost}; resuming the migration through QEMU's postcopy recovery");
    });
    tracing::warn!(
        "migration {} of {:?}: postcopy, {lost}: resuming it through QEMU's postcopy recovery",
        record.id,
        record.vm
    );
    let result = tokio::time::timeout(
        HOLD_AFTER_SWITCH,
        carry_resumed_source(&record, qmp, peer, work_dir, status),
    )
    .await
    .unwrap_or_else(|_| {
        Err(anyhow!(
            "the resumed postcopy migration did not end within {}s",
            HOLD_AFTER_SWITCH.as_secs()
        ))
    })
    .map_err(|e| {
        anyhow!(
            "{lost}, and resuming the postcopy migration failed: {e:#}; the VM runs at the \
             destination without the pages still in the source QEMU, which stays paused: \
             restart the source agent to try again"
        )
    });
    let settled = OutgoingRecord {
        postcopy_pending: result.is_err(),
        reason: result.as_ref().err().map(|e| format!("{e:#}")),
        updated_unix_ms: now_ms(),
        ..record
    };
    if let Err(e) = journal.write_outgoing(&settled) {
        tracing::error!("migration {}: {e:#}", settled.id);
    }
    result
}

async fn carry_resumed_source(
    record: &OutgoingRecord,
    qmp: &Qmp,
    peer: &PeerLink,
    work_dir: &Path,
    status: &Shared,
) -> Result<()> {
    wait_paused(qmp).await?;
    let (session, _connections) = connect_to(peer).await?;
    control::send(
        &session,
        &Control::ResumePostcopy {
            version: CONTROL_VERSION,
            of: record.session,
        },
    )
    .await?;
    match control::recv(&session).await? {
        Control::PostcopyRecovering => {}
        Control::Abort { reason } => bail!("the destination refused to resume: {reason}"),
        other => bail!("unexpected answer to ResumePostcopy: {other:?}"),
    }
    let sock = work_dir.join(format!("{}.src.sock", session.id()));
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).with_context(|| format!("bind {}", sock.display()))?;
    let _socket_file = RemoveOnDrop(sock.clone());
    qmp.execute(&MigrateResume {
        uri: format!("unix:{}", sock.display()),
        resume: true,
    })
    .await
    .context("resuming the source QEMU's postcopy migration")?;
    let (conn, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .context("QEMU did not connect to the agent's socket within 10s")??;
    let (mut from_qemu, mut to_qemu) = conn.into_split();
    // A resumed migration opens a new preempt channel on the same socket.
    session.make_urgent(PREEMPT);
    let mut preempt_task = AbortOnDropHandle::new(tokio::spawn(preempt::forward(
        listener,
        session.clone(),
        status.clone(),
    )));
    let rp_session = session.clone();
    let _return_path = AbortOnDropHandle::new(tokio::spawn(async move {
        while let Ok(Received::Data(b)) = rp_session.recv(RETURN_PATH).await {
            if to_qemu.write_all(&b).await.is_err() {
                break;
            }
        }
    }));
    let resumed = preempt::carry_raw(
        &mut from_qemu,
        &session,
        STREAM,
        READ,
        "the source QEMU's resumed stream",
        |bytes| status.update(|s| s.stream_bytes = bytes),
    )
    .await?;
    // QEMU closes its connections once its migration completed.
    let preempt_carried = (&mut preempt_task)
        .await
        .context("the preempt channel's task")??;
    match migration_status(qmp).await.as_deref() {
        Some("completed") => {}
        other => bail!(
            "the source QEMU closed its resumed stream in state {}",
            other.unwrap_or("unknown")
        ),
    }
    control::send(
        &session,
        &Control::End {
            bytes: resumed.bytes,
            digest: resumed.digest,
            preempt: Some(preempt_carried),
        },
    )
    .await?;
    match control::recv(&session).await? {
        Control::Delivered { .. } => {}
        Control::Abort { reason } => bail!("the destination aborted: {reason}"),
        other => bail!("unexpected message after the resumed stream: {other:?}"),
    }
    control::park_and_end(&session, "postcopy recovered").await;
    // Every page is at the destination: this QEMU's VM can never rightly run again.
    let _ = qmp.execute(&Quit).await;
    tracing::info!(
        "migration {} of {:?}: postcopy recovered: {} bytes resumed, every page delivered",
        record.id,
        record.vm,
        resumed.bytes
    );
    Ok(())
}

/// Where a destination agent finds what a resumed postcopy migration needs.
pub struct DestinationSide {
    pub journal: Journal,
    pub work_dir: PathBuf,
    pub held: std::sync::Arc<HeldMonitors>,
}

/// Destination: serves `ResumePostcopy` for session `of`. `old` is that session if it is still
/// served here, and `gone` says when its task has ended (it holds the QEMU's sockets).
pub async fn resume_destination(
    session: Session,
    of: SessionId,
    old: Option<Session>,
    gone: impl Fn() -> bool,
    side: DestinationSide,
) {
    let resumed = async {
        let record = match side.journal.incoming(of)? {
            Some(r) if r.state == IncomingState::Committed => r,
            // Its QEMU, or the source's, exited past the switch: the record says which.
            Some(r) if r.state == IncomingState::Lost => {
                bail!("{}", r.reason.unwrap_or_else(|| "the VM is lost".into()))
            }
            _ => bail!("no migration of session {of} runs here"),
        };
        tracing::warn!(
            "session {}: the source resumes the postcopy migration of session {of} (VM {:?})",
            session.id(),
            record.vm
        );
        // The old session's task holds the QEMU's sockets: failing it closes them, and its
        // monitor is kept for this. So does an earlier resume still under way (the source
        // agent restarted again).
        if let Some(old) = old {
            old.fail(format!("the source resumes it on session {}", session.id()));
            wait_until(gone, "the old session to end").await?;
        }
        if let Some(earlier) = side.held.start_resuming(of, session.clone()) {
            earlier.fail(format!(
                "the source resumes it again on session {}",
                session.id()
            ));
            wait_until(|| side.held.holds(of), "the earlier resume to end").await?;
        }
        let qmp = match side.held.take(of) {
            Some(qmp) => qmp,
            None => Qmp::connect_oob(&record.qmp).await.context(
                "the destination QEMU's monitor (a QEMU waiting for pages answers only a \
                 connection made before)",
            )?,
        };
        let result = carry_resumed_destination(&session, of, &qmp, &side.work_dir).await;
        match result {
            Ok(()) => delivered(&side.journal, record),
            // For the next attempt.
            Err(_) => side.held.keep(of, qmp),
        }
        result
    };
    let result = resumed.await;
    side.held.end_resuming(of, &session);
    if let Err(e) = result {
        tracing::error!(
            "session {}: resuming the postcopy migration of session {of}: {e:#}",
            session.id()
        );
        control::tell_abort(&session, format!("{e:#}"), Duration::from_secs(5)).await;
        session.fail(format!("{e:#}"));
    }
}

async fn carry_resumed_destination(
    session: &Session,
    of: SessionId,
    qmp: &Qmp,
    work_dir: &Path,
) -> Result<()> {
    wait_paused(qmp).await?;
    let sock = work_dir.join(format!("{}.dst.sock", session.id()));
    let _ = std::fs::remove_file(&sock);
    qmp.execute_oob(&MigrateRecover {
        uri: format!("unix:{}", sock.display()),
    })
    .await
    .context("recovering the destination QEMU's postcopy migration")?;
    let _socket_file = RemoveOnDrop(sock.clone());
    let conn = connect_listening(&sock).await?;
    // The preempt channel is QEMU's second connection to the same socket.
    let mut preempt_task = AbortOnDropHandle::new(tokio::spawn(preempt::deliver(
        session.clone(),
        sock.clone(),
    )));
    control::send(session, &Control::PostcopyRecovering).await?;
    let (from_qemu, mut to_qemu) = conn.into_split();
    let _return_path =
        AbortOnDropHandle::new(destination::spawn_return_path(from_qemu, session.clone()));
    let mut hash = StreamDigest::new();
    let mut received = 0u64;
    let mut end = None;
    while end.as_ref().is_none_or(|(bytes, _, _)| received < *bytes) {
        tokio::select! {
            r = session.recv(STREAM) => match r? {
                Received::Data(chunk) => {
                    hash.update(&chunk);
                    received += chunk.len() as u64;
                    to_qemu
                        .write_all(&chunk)
                        .await
                        .context("writing the destination QEMU's resumed stream")?;
                }
                Received::Barrier => {}
            },
            msg = control::recv(session) => match msg? {
                Control::End { bytes, digest, preempt } => end = Some((bytes, digest, preempt)),
                Control::Abort { reason } => bail!("the source aborted: {reason}"),
                other => bail!("unexpected control message during the resumed stream: {other:?}"),
            },
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                if session.idle_for() > HOLD_AFTER_SWITCH {
                    bail!("no connection from the source agent for {}s", HOLD_AFTER_SWITCH.as_secs());
                }
            }
        }
        if let Some((bytes, _, _)) = &end {
            if received > *bytes {
                bail!("received {received} resumed stream bytes, the source announced {bytes}");
            }
        }
    }
    let (_, source_digest, announced_preempt) = end.expect("the loop ends with End");
    let digest = hash.hex();
    if digest != source_digest {
        bail!(
            "resumed stream digest mismatch: source {ALGORITHM} {source_digest}, destination {digest}"
        );
    }
    let fed_unix_us = i64::try_from(now_ms().saturating_mul(1000)).unwrap_or(i64::MAX);
    // Its main thread is free again once every page it waited for has arrived.
    if qmp.has_oob() {
        wait_migration_event(qmp, "completed", HOLD_AFTER_SWITCH).await?;
    }
    let blocktime = loop {
        let info = qmp.execute(&QueryMigrate).await?;
        match info.status.as_deref() {
            Some("completed") => break info.postcopy_blocktime,
            Some("failed") => bail!(
                "destination QEMU failed in the resumed postcopy migration: {}",
                info.error_desc.unwrap_or_default()
            ),
            _ => tokio::time::sleep(POLL).await,
        }
    };
    if let Some(announced) = &announced_preempt {
        let arrived = (&mut preempt_task)
            .await
            .context("the preempt channel's task")??;
        preempt::check(announced, &arrived)?;
    }
    tracing::info!(
        "session {}: postcopy recovered: every page of session {of} has arrived",
        session.id()
    );
    control::send(
        session,
        &Control::Delivered {
            fed_unix_us,
            postcopy_blocktime_ms: blocktime,
        },
    )
    .await?;
    let _ = tokio::time::timeout(Duration::from_secs(60), session.flushed(control::CONTROL)).await;
    control::park_and_end(session, "postcopy recovered").await;
    Ok(())
}

/// Waits until a postcopy migration is `postcopy-paused`: it pauses once its old agent's
/// sockets closed, or is paused by `migrate-pause`. A QEMU waiting for pages
/// answers only out-of-band commands, so with those its state is read from its `MIGRATION`
/// events, else asked.
async fn wait_paused(qmp: &Qmp) -> Result<()> {
    let asked_at = Instant::now();
    let mut paused_by_us = false;
    loop {
        let status = if qmp.has_oob() {
            latest_migration_status(qmp)
        } else {
            migration_status(qmp).await
        };
        match status.as_deref() {
            Some("postcopy-paused") => return Ok(()),
            Some(s) if !s.starts_with("postcopy") && s != "active" => {
                bail!("its QEMU's migration is {s}, not a paused postcopy migration")
            }
            _ if !paused_by_us && asked_at.elapsed() > PAUSE_WITHIN / 10 => {
                qmp.execute_oob(&MigratePause)
                    .await
                    .context("pausing QEMU's postcopy migration")?;
                paused_by_us = true;
            }
            _ => {}
        }
        if asked_at.elapsed() > PAUSE_WITHIN {
            bail!(
                "its QEMU did not pause its postcopy migration within {}s (last state {})",
                PAUSE_WITHIN.as_secs(),
                status.as_deref().unwrap_or("unknown")
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The state the latest `MIGRATION` event on `qmp` announced.
fn latest_migration_status(qmp: &Qmp) -> Option<String> {
    let event = qmp.latest_event("MIGRATION")?;
    event.data["status"].as_str().map(str::to_owned)
}

/// Waits until the latest `MIGRATION` event announces `status` (a failure ends the wait).
async fn wait_migration_event(qmp: &Qmp, status: &str, within: Duration) -> Result<()> {
    let since = Instant::now();
    loop {
        match latest_migration_status(qmp).as_deref() {
            Some(s) if s == status => return Ok(()),
            Some("failed") => bail!("the destination QEMU's migration failed"),
            _ if qmp.is_closed() => bail!("the destination QEMU's monitor closed"),
            _ if since.elapsed() > within => {
                bail!(
                    "the destination QEMU's migration was not {status} within {}s",
                    within.as_secs()
                )
            }
            _ => tokio::time::sleep(POLL).await,
        }
    }
}

async fn migration_status(qmp: &Qmp) -> Option<String> {
    qmp.execute(&QueryMigrate).await.ok()?.status
}

async fn wait_until(done: impl Fn() -> bool, what: &str) -> Result<()> {
    for _ in 0..600 {
        if done() {
            return Ok(());
        }
        tokio::time::sleep(POLL).await;
    }
    bail!("waited 30s for {what}")
}

async fn connect_listening(sock: &Path) -> Result<UnixStream> {
    for _ in 0..100 {
        if let Ok(s) = UnixStream::connect(sock).await {
            return Ok(s);
        }
        tokio::time::sleep(POLL).await;
    }
    bail!("the destination QEMU does not listen on {}", sock.display())
}
