//! The source side of a migration: QEMU migrates into a local unix socket; the agent parses
//! the stream (so a construct it does not understand stops the migration instead of being
//! carried blind), hashes it, and sends it over the session; the return path comes back the
//! other way. The commit is the destination's: the source quits its VM only when the
//! destination says it runs, and resumes it on any failure before the stream's end was sent
//! (in postcopy, before the destination said it runs: [`crate::engine::postcopy`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::{Bytes, BytesMut};
use ferry_api::agent::{CodecReport, Destination, MigrationRequest, MigrationState, Phase};
use ferry_api::EventKind;
use ferry_qemu::commands::{
    Capability, Cont, Migrate, MigrateCancel, MigrateContinue, MigrateSetCapabilities,
    MigrateSetParameters, QueryMemorySizeSummary, QueryMigrate, QueryStatus, Quit, RamStats,
};
use ferry_qemu::stream::{StreamParser, PAGE_SIZE};
use ferry_qemu::Qmp;
use ferry_wire::connection_count::ConnectionCount;
use ferry_wire::net::{keep_connected, LinkEvent, Peer, Pool};
use ferry_wire::tls::ClientConfig;
use ferry_wire::{Received, Session, SessionConfig, SessionId};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

use crate::engine::control::{
    self, Carried, Control, Incoming, PREEMPT, RETURN_PATH, SEED, STREAM,
};
use crate::engine::digest::{TreeDigest, ALGORITHM};
use crate::engine::disk;
use crate::engine::disk::mirror::{
    memory_phase_buffer, AtDestination, DiskSettings, OlderCopy, SourceDisks,
};
use crate::engine::journal::{Journal, OutgoingRecord, OutgoingState, Verdict};
use crate::engine::page_ledger::{DestinationWork, PageLedger};
use crate::engine::pipeline::budget::{ThreadBudget, Threads};
use crate::engine::pipeline::{CachePauser, Shape, ShardedEncoder, SourcePipeline};
use crate::engine::postcopy;
use crate::engine::postcopy_recovery;
use crate::engine::preempt;
use crate::engine::recovery::{self, PeerLink};
use crate::engine::seed_store;
use crate::engine::status::{now_ms, Events, Shared};
use crate::engine::stream_codec;
use crate::engine::switchover;

/// What the pump reads from QEMU's socket at a time, at least.
const CHUNK: usize = 64 << 10;
/// Stream bytes per frame, at least and at most (see [`stream_frame_len`]).
const MIN_FRAME: usize = 64 << 10;
const MAX_FRAME: usize = 1 << 20;
/// The page window: guest pages read from QEMU that the destination has not consumed, at most
/// (see `page_ledger`). 64 MiB of guest memory: some 65 ms of the destination QEMU's time on
/// zero pages (~4 µs each here), which is what QEMU's first pass may leave it when the pass
/// ends, and more than a round trip's worth of pages at the rate it loads them.
const PAGE_WINDOW: u64 = 16 << 10;
/// auto-converge's first throttle and its steps (QEMU's defaults are 20 and 10; with tailslow
/// the steps after the first follow the dirty rate over the link rate instead).
const THROTTLE_INITIAL_PCT: u8 = 20;
const THROTTLE_INCREMENT_PCT: u8 = 10;
/// The link rate the codec's zstd level assumes when the request does not give one.
const ASSUMED_LINK_MBIT: f64 = 1000.0;

/// Runs one migration to its end and records the outcome in `status`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    req: MigrationRequest,
    peer_address: String,
    status: Shared,
    tls: Arc<ClientConfig>,
    pool: Arc<Pool>,
    journal: Journal,
    work_dir: PathBuf,
    seed_dir: PathBuf,
    seed_budget_bytes: u64,
) {
    let result = migrate(
        &req,
        &peer_address,
        &status,
        tls,
        pool,
        &journal,
        &work_dir,
        &seed_dir,
        seed_budget_bytes,
    )
    .await;
    status.update(|s| match result {
        Ok(()) => {
            s.state = MigrationState::Committed;
            s.phase = Phase::Committed;
            s.detail = "the destination runs".into();
        }
        Err(e) => {
            s.state = MigrationState::Failed;
            s.phase = Phase::Failed;
            s.detail = e
                .downcast_ref::<AfterTheSwitch>()
                .map_or("the source runs", |a| a.vm)
                .into();
            s.error = Some(format!("{e:#}"));
            s.event(EventKind::Failed, format!("{e:#}"));
        }
    });
    journal.prune_later();
}

#[allow(clippy::too_many_arguments)]
async fn migrate(
    req: &MigrationRequest,
    peer_address: &str,
    status: &Shared,
    tls: Arc<ClientConfig>,
    pool: Arc<Pool>,
    journal: &Journal,
    work_dir: &Path,
    seed_dir: &Path,
    seed_budget_bytes: u64,
) -> Result<()> {
    if req.settings.postcopy_possible() && !req.disks.is_empty() {
        bail!("postcopy with disks is not supported: migrate the VM with its disks in precopy, or without --postcopy");
    }
    let deadline = Instant::now() + Duration::from_secs(req.settings.timeout_s);
    let wan_timeout = Duration::from_secs(req.settings.wan_timeout_s);
    let qmp = Arc::new(Qmp::connect(&req.source_qmp).await.context("source QEMU")?);
    let st = qmp.execute(&QueryStatus).await?;
    if !st.running {
        bail!("the source VM is not running (QEMU status {:?})", st.status);
    }
    let destination = match &req.destination {
        Destination::Qmp(path) => Incoming::Qmp(path.clone()),
        Destination::Argv(argv) => Incoming::Launch(argv.clone()),
        Destination::SourceConfig => Incoming::Launch(command_line(&qmp, &req.source_qmp)?),
    };
    let ram = qmp.execute(&QueryMemorySizeSummary).await?;
    let ram_bytes = ram.base_memory + ram.plugged_memory.unwrap_or(0);
    let history_bytes = stream_codec::history_bytes(ram_bytes);
    let link_rate_mbit = req.link_rate_mbit.unwrap_or(ASSUMED_LINK_MBIT);
    let shape = Shape::choose(
        req.link_rate_mbit,
        std::thread::available_parallelism().map_or(1, usize::from),
        req.settings.test_shards.map(|s| s as usize),
    );
    let (mut disk_plans, layer_files) = if req.disks.is_empty() {
        (Vec::new(), Vec::new())
    } else {
        let mut plans = disk::mirror::plan(&qmp, &req.disks).await?;
        let files = disk::mirror::add_backing(&qmp, &mut plans).await?;
        (plans, files)
    };
    // Pacing's baseline: the guest's disk IO from here until its copy starts (while the
    // session connects and the destination prepares).
    let disk_io_before = if disk_plans.is_empty() || req.settings.disk_pacing_floor_pct.is_none() {
        None
    } else {
        disk::pacing::guest_io(&qmp)
            .await
            .map_err(|e| tracing::warn!("query-blockstats failed ({e:#}): no disk pacing"))
            .ok()
            .map(|io| (Instant::now(), io))
    };

    // The session and its connections.
    let id = SessionId::random();
    status.enter(
        Phase::Connecting,
        format!("connecting to {} ({peer_address})", req.to),
    );
    let addr = tokio::net::lookup_host(peer_address)
        .await
        .with_context(|| format!("peer {:?}: address {peer_address:?}", req.to))?
        .next()
        .ok_or_else(|| {
            anyhow!(
                "peer {:?}: address {peer_address:?} resolves to nothing",
                req.to
            )
        })?;
    // The migration's record (see `journal`), from here until it settles.
    let started = status.get();
    let mut record = OutgoingRecord {
        id: started.id,
        vm: req.vm.clone(),
        session: id,
        source_qmp: req.source_qmp.clone(),
        source_pid: qmp.peer_pid(),
        disks: req.disks.clone(),
        to: req.to.clone(),
        state: OutgoingState::Preparing,
        postcopy_pending: false,
        reason: None,
        started_unix_ms: started.started_unix_ms,
        updated_unix_ms: now_ms(),
    };
    journal
        .write_outgoing(&record)
        .context("recording the migration")?;
    // The question goes where the session goes: a name resolved again could reach another
    // agent, which would know nothing of the session.
    let asked = PeerLink {
        name: req.to.clone(),
        address: addr.to_string(),
        tls: tls.clone(),
        pool: pool.clone(),
    };
    let session = Session::new(id, SessionConfig::default());
    let connections = ConnectionCount::from_setting(req.settings.connections);
    let peer = Peer {
        addr,
        name: req.to.clone(),
        tls,
        connections: connections.clone(),
        link_rate_mbit: req.link_rate_mbit,
        pool,
    };
    let (link_tx, link_rx) = mpsc::unbounded_channel();
    let _connections = keep_connected(session.clone(), peer, Duration::from_millis(500), link_tx);
    tokio::spawn(watch_links(
        link_rx,
        session.clone(),
        status.clone(),
        req.link_rate_mbit,
        connections,
    ));
    let ledger = Arc::new(Mutex::new(PageLedger::default()));
    let _progress = AbortOnDropHandle::new(tokio::spawn(track_progress(
        qmp.clone(),
        session.clone(),
        status.clone(),
        req.clone(),
        ledger.clone(),
    )));
    let (ctl_tx, mut ctl) = mpsc::unbounded_channel();
    tokio::spawn(read_control(session.clone(), ctl_tx));
    let mut disks: Option<SourceDisks> = None;
    let mut disk_base_len: Option<u64> = None;
    let mut disk_top_only: Vec<bool> = Vec::new();
    let mut disk_images_made = 0;
    let mut layers_shipped = disk::layers::Shipped::default();
    let (mut disk_since, mut disk_base_note, mut disk_index_ms) = (None, None, None);

    // Whether QEMU's package went out (its checkpoint sent): the destination's Committed may
    // then come after QEMU's end, and it is still the switch's, not the end's verdict; and the
    // WAN timeout no longer ends the migration.
    let package_sent = Arc::new(AtomicBool::new(false));
    let mut limits = Limits {
        wan_timeout,
        deadline,
        question: None,
        after_switch: package_sent.clone(),
    };
    let mut bitmap_exports = None;
    // In postcopy: the destination's word that it runs the VM (it comes before the stream's
    // end); from then on the source VM must never run again.
    let mut switched: Option<Control> = None;
    let result = async {
        // Dirty bitmaps since the VM arrived here: a destination that still holds the copy it
        // left need not index it. (Exported from here on: every way out closes them.)
        if !disk_plans.is_empty() {
            // An earlier attempt cut short may have left exports holding a bitmap busy.
            disk::since::abandon_exports(&qmp, &req.disks).await;
        }
        if !disk_plans.is_empty() && req.settings.disk_bitmaps {
            bitmap_exports =
                disk::since::offer(&qmp, work_dir, &id.to_string(), &mut disk_plans).await;
        }
        control::send(
            &session,
            &Control::Prepare {
                version: control::CONTROL_VERSION,
                vm: req.vm.clone(),
                destination: destination.clone(),
                wan_timeout_s: req.settings.wan_timeout_s,
                return_path: req.settings.return_path,
                postcopy: req.settings.postcopy_possible(),
                codec: req.settings.codec,
                history_bytes,
                shards: u32::try_from(shape.shards).expect("at most 16"),
                test_decode_threads: req.settings.test_shards.is_some(),
                seed_from: req.settings.seed_from.clone(),
                disks: disk_plans.clone(),
            },
        )
        .await?;
        status.enter(Phase::PreparingDestination, "");
        // A destination that starts the VM itself may first ask for backing layers it lacks.
        let mut answer = watchdog(&session, status, &limits, ctl.recv()).await?;
        if let Some(Control::NeedLayers { layers }) = &answer {
            let wanted_bytes: u64 = layers
                .iter()
                .filter_map(|w| disk_plans.get(w.disk as usize)?.layers.get(w.layer as usize))
                .map(|l| l.bytes)
                .sum();
            status.update(|s| {
                s.detail = format!(
                    "sending {} backing layer(s) the destination lacks ({} MiB)",
                    layers.len(),
                    wanted_bytes >> 20
                );
            });
            let sending = disk::layers::send(&session, &disk_plans, &layer_files, layers);
            // The destination's word, if it gives up on them, ends the wait.
            layers_shipped = watchdog(&session, status, &limits, async {
                tokio::select! {
                    sent = sending => sent,
                    msg = ctl.recv() => match msg {
                        Some(Control::Abort { reason }) => bail!("the destination refused: {reason}"),
                        Some(other) => bail!("unexpected message while sending backing layers: {other:?}"),
                        None => bail!("{}", control_ended(&session)),
                    },
                }
            })
            .await??;
            answer = watchdog(&session, status, &limits, ctl.recv()).await?;
        }
        let (seed, zeroed_blocks) = match answer {
            Some(Control::Ready {
                seed,
                disk_base_bytes,
                top_only,
                disk_since: since,
                disk_base_note: note,
                disk_index_ms: index_ms,
                zeroed_blocks,
                images_made,
            }) => {
                disk_images_made = images_made;
                disk_base_len = disk_base_bytes;
                disk_top_only = top_only;
                (disk_since, disk_base_note, disk_index_ms) = (since, note, index_ms);
                (seed, zeroed_blocks)
            }
            Some(Control::Abort { reason }) => bail!("the destination refused: {reason}"),
            other => bail!("unexpected answer to Prepare: {other:?}"),
        };
        // The destination holds the session (and its record) from here: when the session
        // falls silent, its word tells a dark link from an agent that restarted and lost it.
        limits.question = Some(Question {
            peer: asked.clone(),
            of: id,
            started_unix_ms: record.started_unix_ms,
        });
        let mut encoder = req.settings.codec.any().then(|| {
            ShardedEncoder::new(
                req.settings.codec,
                history_bytes,
                link_rate_mbit,
                shape.shards,
            )
        });
        if let (Some(offer), Some(encoder)) = (seed, &mut encoder) {
            status.enter(
                Phase::SeedIndex,
                format!(
                    "receiving the destination's seed index ({} pages of {:?})",
                    offer.pages, offer.image
                ),
            );
            let index = watchdog(
                &session,
                status,
                &limits,
                receive_seed_index(&session, offer.index_bytes, ram_bytes),
            )
            .await??;
            encoder.set_seed(index, offer);
        }
        if !disk_plans.is_empty() {
            let base = match (disk_since.take(), disk_base_len) {
                (Some(sessions), _) => {
                    let exports = bitmap_exports
                        .as_ref()
                        .context("the destination matched dirty bitmaps this source did not offer")?;
                    Some(OlderCopy::Since(exports.view(&disk_plans, &sessions).await?))
                }
                (None, Some(bytes)) => {
                    status.enter(
                        Phase::DiskCopy,
                        format!(
                            "receiving the index of the destination's older disk copy ({bytes} bytes)"
                        ),
                    );
                    let sizes: Vec<u64> = disk_plans.iter().map(|p| p.size).collect();
                    let blob = watchdog(
                        &session,
                        status,
                        &limits,
                        control::recv_blob(
                            &session,
                            control::DISK_BASE,
                            bytes,
                            ferry_codec::disk_base::max_index_bytes(&sizes),
                            "disk index",
                        ),
                    )
                    .await??;
                    Some(OlderCopy::Index(
                        tokio::task::spawn_blocking(move || {
                            ferry_codec::DiskBase::parse(&blob, &sizes)
                        })
                        .await?
                        .context("the destination's disk index")?,
                    ))
                }
                (None, None) => None,
            };
            // Bitmaps the destination did not take: their exports go now.
            if !matches!(base, Some(OlderCopy::Since(_))) {
                if let Some(e) = bitmap_exports.take() {
                    e.close(&qmp).await;
                }
            }
            status.update(|s| {
                s.phase = Phase::DiskCopy;
                s.detail = "bulk copy".into();
                s.event(
                    EventKind::DiskCopyStarted,
                    format!(
                        "{} disk(s), {} mode",
                        disk_plans.len(),
                        req.settings.disk_mode.name()
                    ),
                );
            });
            let started = SourceDisks::start(
                &qmp,
                &session,
                work_dir,
                &disk_plans,
                DiskSettings {
                    mode: req.settings.disk_mode,
                    buffer_bytes: req.settings.disk_buffer_mib.max(1) << 20,
                    codec: req.settings.codec,
                    link_rate_mbit,
                    corrupt_at: req.settings.test_corrupt_disk_at,
                    background_copy: req.settings.disk_background_copy,
                    stall_after: req
                        .settings
                        .test_disk_stall_ms
                        .map_or(disk::mirror::BACKGROUND_STALL, Duration::from_millis),
                    pacing_floor: req
                        .settings
                        .disk_pacing_floor_pct
                        .map(|p| f64::from(p) / 100.0),
                    io_before: disk_io_before,
                },
                AtDestination {
                    base,
                    base_note: disk_base_note.take(),
                    index_ms: disk_index_ms.take(),
                    exports: bitmap_exports.take(),
                    top_only: disk_top_only.clone(),
                    images_made: disk_images_made,
                    layers: layers_shipped,
                },
                status.clone(),
            )
            .await?;
            let d = &*disks.insert(started);
            let memory_bound = req
                .link_rate_mbit
                .map(|rate| memory_phase_buffer(rate, req.settings.downtime_ms));
            // The destination may give up during the copy (its disk full, its QEMU gone): its
            // word is the reason, where the copy would otherwise wait for the WAN timeout.
            let ready = tokio::select! {
                r = watchdog(&session, status, &limits, d.wait_ready(&qmp, memory_bound)) => r??,
                msg = ctl.recv() => match msg {
                    Some(Control::Abort { reason }) => bail!("the destination aborted: {reason}"),
                    Some(other) => bail!("unexpected message from the destination during the disk copy: {other:?}"),
                    None => bail!("{}", control_ended(&session)),
                },
            };
            d.memory_phase(req.link_rate_mbit, req.settings.downtime_ms);
            status.update(|s| {
                if let Some(d) = &mut s.disk {
                    d.paced_ms = ready.paced.map(|p| u64::try_from(p.as_millis()).unwrap_or(u64::MAX));
                }
                s.event(EventKind::DiskReady, ready.note.clone());
            });
        }
        // From QEMU's stream on, its end may go out with no other step here: recorded first,
        // so that a restart asks the destination rather than resuming the VM.
        record.state = OutgoingState::Streaming;
        record.updated_unix_ms = now_ms();
        journal
            .write_outgoing(&record)
            .context("recording the stream's start")?;
        // The codec's threads while the stream runs, within what the agent's other migrations
        // left: the shards then share fewer, or run on the pump's task. The test hook's
        // threads are its own.
        let budgeted = (encoder.is_some() && req.settings.test_shards.is_none())
            .then(|| ThreadBudget::of_agent().take(shape.threads));
        let threads = budgeted.as_ref().map_or(shape.threads, Threads::count);
        let (bytes, digest, preempt) = stream(
            req,
            status,
            &qmp,
            &session,
            &mut ctl,
            work_dir,
            encoder
                .map(|e| SourcePipeline::new(e, threads, "ferry-codec"))
                .transpose()?,
            &ledger,
            DestinationWork::new(&zeroed_blocks),
            disks.as_mut(),
            &limits,
            &mut Switch {
                destination_runs: &mut switched,
                package_sent: &package_sent,
                journal,
                record: &record,
            },
        )
        .await?;
        // The pipeline ended with `stream`, its threads joined.
        drop(budgeted);
        control::send(
            &session,
            &Control::End {
                bytes,
                digest: digest.clone(),
                preempt,
            },
        )
        .await?;
        Ok(digest)
    }
    .await;
    let settle = |state: OutgoingState, reason: Option<String>| {
        let settled = OutgoingRecord {
            state,
            reason,
            updated_unix_ms: now_ms(),
            ..record.clone()
        };
        if let Err(e) = journal.write_outgoing(&settled) {
            tracing::error!("migration {}: {e:#}", settled.id);
        }
    };
    // The destination's QEMU exited past the switch, and the VM with it: the source QEMU, which
    // holds the VM as it was at the switch, is neither resumed nor quit.
    let lost_there = |e: anyhow::Error| {
        session.fail(format!("{e:#}"));
        let e = e.context(DESTINATION_QEMU_LOST);
        settle(OutgoingState::Failed, Some(format!("{e:#}")));
        e
    };

    // Postcopy: once the package went out the destination may run the VM before its word
    // arrives; only that word (an Abort) lets the source resume.
    let postcopy_in_doubt = match &result {
        Err(e) if switched.is_none() => {
            package_sent.load(Ordering::Relaxed) && e.downcast_ref::<DestinationAborted>().is_none()
        }
        _ => false,
    };
    let end = match result {
        Ok(end) => Some(end),
        Err(e) if postcopy_in_doubt => {
            // As after the stream's end: the destination decides, asked if need be.
            tracing::warn!(
                "migration {}: after the postcopy package: {e:#}; waiting for the destination's word",
                record.id
            );
            status.update(|s| {
                s.event(
                    EventKind::Failed,
                    format!("{e:#}; the postcopy package went out, the destination decides"),
                )
            });
            None
        }
        Err(e) if switched.is_some() && e.is::<PostcopySessionLost>() => {
            // Its QEMU pauses once its sockets to this session's tasks are closed (they went
            // with the stream), or is paused; then it resumes on a session of its own.
            session.fail(format!("{e:#}"));
            let record = OutgoingRecord {
                state: OutgoingState::Committed,
                postcopy_pending: true,
                ..record.clone()
            };
            return postcopy_recovery::resume(
                record,
                &qmp,
                &asked,
                work_dir,
                journal,
                status,
                "the destination agent restarted",
            )
            .await
            .map_err(|e| {
                e.context(AfterTheSwitch {
                    why: "after the postcopy switch",
                    vm: "the VM runs at the destination",
                })
            });
        }
        Err(e) if switched.is_some() && e.is::<DestinationLost>() => {
            return Err(lost_there(e));
        }
        Err(e) if switched.is_some() && postcopy_recovery::qemu_exited(&qmp).await => {
            // The pages that had not crossed went with it: the destination's VM can never
            // have them, and its agent must not wait for a recovery.
            let e = e.context(SOURCE_QEMU_LOST);
            let lost = Control::Lost {
                reason: format!("{e:#}"),
            };
            control::tell(&session, &lost, Duration::from_secs(2)).await;
            session.fail(format!("{e:#}"));
            settle(OutgoingState::Failed, Some(format!("{e:#}")));
            return Err(e);
        }
        Err(e) if switched.is_some() => {
            // Past the postcopy switch: the VM runs at the destination, and the pages that had
            // not crossed are only here. Nothing is resumed or quit.
            session.fail(format!("{e:#}"));
            let e = e.context(RUNS_AT_DESTINATION);
            settle(OutgoingState::Committed, Some(format!("{e:#}")));
            return Err(e);
        }
        Err(e) if req.settings.postcopy_possible() && postcopy::source_switched(&qmp).await => {
            // Switched, but the destination never ran the VM: QEMU (before 10.2) can neither
            // cancel its postcopy nor resume the VM, so it stays paused here, whole.
            control::tell_abort(&session, format!("{e:#}"), Duration::from_secs(2)).await;
            session.fail(format!("{e:#}"));
            let e = e.context(AfterTheSwitch {
                why: "the source QEMU had switched to postcopy, which QEMU before 10.2 can \
                      neither cancel nor resume: the source VM stays paused (the destination \
                      never ran it)",
                vm: "the source VM stays paused",
            });
            settle(OutgoingState::Failed, Some(format!("{e:#}")));
            return Err(e);
        }
        Err(e) => {
            // Before the stream's end went out the destination cannot commit: stop QEMU's
            // migration, tell the destination, resume the source.
            let _ = qmp.execute(&MigrateCancel).await;
            if let Some(d) = &mut disks {
                d.abort(&qmp).await;
            }
            if let Some(e) = bitmap_exports.take() {
                e.close(&qmp).await;
            }
            control::tell_abort(&session, format!("{e:#}"), Duration::from_secs(2)).await;
            let _ = tokio::time::timeout(Duration::from_secs(2), session.flushed(control::CONTROL))
                .await;
            session.fail(format!("{e:#}"));
            // Resumed before the record says failed: a restart in between resumes it again.
            let e = match ensure_running(&qmp).await {
                Ok(()) => e.context("the source VM keeps running"),
                // Its QEMU gone, say so, and why the migration failed.
                Err(why) => e.context(format!("the source VM could not be resumed ({why:#})")),
            };
            settle(OutgoingState::Failed, Some(format!("{e:#}")));
            return Err(e);
        }
    };

    // The stream's end and digest are on their way: from here only the destination decides.
    status.update(|s| {
        s.phase = Phase::AwaitingCommit;
        s.detail = "waiting for the destination's verdict".into();
        s.digest.clone_from(&end);
    });
    // The verdict comes on the session, or from asking the destination on a new one once this
    // one has been silent for a few seconds (its agent may have restarted and lost it: the
    // stream's end can go out into a session with no connection left, the window having room
    // for it). In doubt only after the WAN timeout.
    let mut last_asked: Option<Instant> = None;
    // The last answer to the question, for the status: an operator may have to act on it.
    let mut heard = String::new();
    // The session's control messages stop when it fails: then only asking tells.
    let mut control_open = true;
    // A question under way, in a task of its own: a word on the session is not held up by it.
    let mut asking: Option<AbortOnDropHandle<Result<Verdict>>> = None;
    let verdict = loop {
        tokio::select! {
            answer = async { asking.as_mut().expect("only when asking").await }, if asking.is_some() => {
                asking = None;
                match answer.map_err(anyhow::Error::from).and_then(|r| r) {
                    // In postcopy the destination has run the VM since the switch; what
                    // is due is its word that the last page arrived (`Delivered`): until
                    // then the stream's frames may still be unacknowledged here.
                    // Its record says every page arrived (its word may have been lost with
                    // a restart of its agent): the last frames have too.
                    Ok(Verdict::Committed) if switched.is_some() => break switched.clone(),
                    // Its agent restarted before the last pages reached its QEMU, which has
                    // paused; this QEMU's migration has completed (its stream ended), so
                    // QEMU's recovery cannot send them again.
                    Ok(Verdict::PostcopyPaused) if switched.is_some() => {
                        session.fail("the destination lost the session");
                        let e = anyhow!(
                            "the destination agent restarted before the last pages reached its \
                             QEMU, which waits for them, paused; the source QEMU had sent them \
                             all (its migration completed), so QEMU's postcopy recovery cannot \
                             send them again"
                        );
                        settle(OutgoingState::Committed, Some(format!("{e:#}")));
                        return Err(e.context(AfterTheSwitch {
                            why: "after the postcopy switch",
                            vm: "the VM stays paused at the destination",
                        }));
                    }
                    Ok(Verdict::Committed) => break Some(Control::Committed {
                        resume_unix_us: 0,
                        switchover: None,
                    }),
                    Ok(Verdict::Aborted { reason }) => break Some(Control::Abort { reason }),
                    Ok(Verdict::Lost { reason }) => break Some(Control::Lost { reason }),
                    Ok(other) => {
                        tracing::info!("in doubt: the destination says {other}");
                        heard = format!("; asked, the destination says {other}");
                    }
                    Err(e) => {
                        tracing::debug!("in doubt: asking the destination: {e:#}");
                        heard = format!("; asking the destination: {e:#}");
                    }
                }
            }
            msg = ctl.recv(), if control_open => match msg {
                // In postcopy the verdict came at the switch; this says the last page arrived.
                Some(runs @ Control::Committed { .. })
                    if package_sent.load(Ordering::Relaxed) && switched.is_none() =>
                {
                    Switch {
                        destination_runs: &mut switched,
                        package_sent: &package_sent,
                        journal,
                        record: &record,
                    }
                    .destination_runs(runs, status);
                }
                Some(Control::Delivered { fed_unix_us, postcopy_blocktime_ms }) if switched.is_some() => {
                    status.update(|s| {
                        s.postcopy_done_unix_us = Some(fed_unix_us);
                        s.postcopy_blocktime_ms = postcopy_blocktime_ms;
                    });
                    break switched.clone();
                }
                Some(Control::Lost { reason }) => break Some(Control::Lost { reason }),
                Some(Control::Abort { reason }) if switched.is_some() => {
                    session.fail(reason.clone());
                    let e = anyhow!("the destination reports: {reason}").context(RUNS_AT_DESTINATION);
                    settle(OutgoingState::Committed, Some(format!("{e:#}")));
                    return Err(e);
                }
                Some(msg) => break Some(msg),
                None => control_open = false,
            },
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                let in_doubt = !control_open || session.idle_for() > wan_timeout;
                if in_doubt {
                    let silent = session.idle_for().as_secs();
                    if switched.is_some() {
                        // The VM runs at the destination: only its last pages' word is due.
                        status.enter(Phase::Postcopy, format!(
                            "postcopy: no connection to the destination for {silent}s; the VM \
                             runs there, and the last of its pages (the stream has ended here) \
                             follow when the link returns{heard}"));
                    } else {
                        status.enter(Phase::InDoubt, format!(
                            "no contact with the destination for {silent}s after the stream ended; \
                             the source stays paused until the destination's verdict arrives{heard}"));
                    }
                }
                if (in_doubt || session.idle_for() > ASK_WHEN_SILENT)
                    && asking.is_none()
                    && last_asked.is_none_or(|t| t.elapsed() >= recovery::ASK_EVERY)
                {
                    last_asked = Some(Instant::now());
                    let (peer, started) = (asked.clone(), record.started_unix_ms);
                    asking = Some(AbortOnDropHandle::new(tokio::spawn(async move {
                        recovery::ask_verdict(&peer, id, started).await
                    })));
                }
                if Instant::now() > deadline + Duration::from_secs(3600) {
                    session.fail("in doubt");
                    bail!("in doubt: the destination's verdict never arrived; the source VM stays paused \
                           (check the destination before resuming it by hand)");
                }
            }
        }
    };
    match verdict {
        Some(Control::Committed {
            resume_unix_us,
            switchover,
        }) => {
            settle(OutgoingState::Committed, None);
            status.update(|s| {
                s.destination_resume_unix_us = (resume_unix_us != 0).then_some(resume_unix_us);
                s.destination_switchover = switchover;
                // In postcopy the commit's event came at the switch.
                if switched.is_none() {
                    s.event(EventKind::Committed, "destination runs");
                }
            });
            // The session's work is done: its connections can park while the seed is saved.
            session.park();
            // The destination runs: the source must never run again. Its memory stays here
            // as the seed for the VM's return.
            if req.settings.codec.seed {
                status.enter(
                    Phase::AwaitingCommit,
                    "the destination runs; saving the VM's image for its return",
                );
                match seed_store::save(&qmp, seed_dir, &req.vm, ram_bytes).await {
                    Ok(bytes) => {
                        tracing::info!(
                            "kept {bytes} bytes of {:?}'s memory for its return",
                            req.vm
                        );
                        match seed_store::evict(seed_dir, seed_budget_bytes, &req.vm) {
                            Ok(gone) if !gone.is_empty() => tracing::info!(
                                "seed budget: removed the images of {gone:?} (oldest first)"
                            ),
                            Ok(_) => {}
                            Err(e) => tracing::warn!("seed budget: {e:#}"),
                        }
                    }
                    Err(e) => {
                        tracing::warn!("could not keep {:?}'s memory for its return: {e:#}", req.vm)
                    }
                }
            }
            let _ = qmp.execute(&Quit).await;
            control::park_and_end(&session, "migration committed").await;
            Ok(())
        }
        Some(Control::Lost { reason }) => Err(lost_there(DestinationLost(reason).into())),
        Some(Control::Abort { reason }) => {
            session.fail(reason.clone());
            let message = match ensure_running(&qmp).await {
                Ok(()) => format!("the destination aborted: {reason}; the source VM keeps running"),
                Err(why) => format!(
                    "the destination aborted: {reason}; the source VM could not be resumed ({why:#})"
                ),
            };
            settle(OutgoingState::Failed, Some(message.clone()));
            bail!("{message}")
        }
        other => {
            session.fail("protocol error");
            bail!(
                "unexpected message after the stream ended: {other:?}; the source VM stays paused"
            )
        }
    }
}

/// The destination's seed index: `bytes` bytes on the seed channel. The image it indexes is
/// the VM's earlier memory or a sibling's; one of up to [`SEED_IMAGE_MAX_RATIO`] times this
/// VM's `ram_bytes` is taken.
async fn receive_seed_index(
    session: &Session,
    bytes: u64,
    ram_bytes: u64,
) -> Result<ferry_codec::SeedIndex> {
    let limit = ferry_codec::seed::max_index_bytes(ram_bytes.saturating_mul(SEED_IMAGE_MAX_RATIO));
    let index = control::recv_blob(session, SEED, bytes, limit, "seed index").await?;
    tokio::task::spawn_blocking(move || ferry_codec::SeedIndex::parse(&index))
        .await?
        .context("the destination's seed index")
}

/// What a source waits on the destination under, before the stream's end went out.
struct Limits {
    /// How long the session may be silent.
    wan_timeout: Duration,
    /// The whole migration's.
    deadline: Instant,
    /// Once the destination holds the session: the question that tells a silent session
    /// from one the destination lost (its agent restarted: it says so at once, where the WAN
    /// timeout would wait).
    question: Option<Question>,
    /// Set once the postcopy package went out: the session then holds on through outages
    /// ([`postcopy::HOLD_AFTER_SWITCH`]).
    after_switch: Arc<AtomicBool>,
}

/// The destination's verdict on session `of`, asked for on a session of its own.
struct Question {
    peer: PeerLink,
    of: SessionId,
    started_unix_ms: u64,
}

/// How long a session must have had no connection before the source asks the destination
/// about it. A connection is given up when reset, or after the wire's 10 s of silence when
/// the link is black-holed, so the first question comes 3 s or 13 s into an outage.
const ASK_WHEN_SILENT: Duration = Duration::from_secs(3);

/// Waits for `fut`, failing when the WAN has been down longer than the WAN timeout, the
/// deadline passes, or the destination, asked while the session is silent, says it ended
/// there. After the postcopy switch only the destination's word or an outage longer than
/// [`postcopy::HOLD_AFTER_SWITCH`] ends it.
async fn watchdog<T>(
    session: &Session,
    status: &Shared,
    limits: &Limits,
    fut: impl std::future::Future<Output = T>,
) -> Result<T> {
    tokio::pin!(fut);
    // Aborted with the wait: a question outliving it would only overlap the next one's.
    let mut asking: Option<AbortOnDropHandle<Result<Verdict>>> = None;
    let mut last_asked: Option<Instant> = None;
    // Whether the status says the session is holding on through an outage.
    let mut holding = false;
    loop {
        tokio::select! {
            v = &mut fut => return Ok(v),
            () = status.cancelled() => bail!("cancelled by the user"),
            answer = async { asking.as_mut().expect("asking").await }, if asking.is_some() => {
                asking = None;
                match answer {
                    Ok(Ok(Verdict::Aborted { reason })) => bail!("the destination aborted: {reason}"),
                    Ok(Ok(Verdict::PostcopyPaused)) => return Err(PostcopySessionLost.into()),
                    Ok(Ok(other)) => tracing::debug!("the session is silent; the destination says {other}"),
                    Ok(Err(e)) => tracing::debug!("the session is silent; asking the destination: {e:#}"),
                    Err(e) => tracing::debug!("asking the destination: {e}"),
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(250)) => {
                let silent = session.idle_for();
                let switched = limits.after_switch.load(Ordering::Relaxed);
                if silent > limits.wan_timeout && !switched {
                    bail!("no connection to the destination agent for {}s (the WAN timeout)", limits.wan_timeout.as_secs());
                }
                if switched {
                    if silent > postcopy::HOLD_AFTER_SWITCH {
                        bail!("no connection to the destination agent for {}s after the postcopy switch", silent.as_secs());
                    }
                    if silent > limits.wan_timeout {
                        holding = true;
                        status.update(|s| s.detail = format!(
                            "postcopy: no connection to the destination for {}s; the VM there waits for its \
                             remaining pages, and they follow when the link returns", silent.as_secs()));
                    } else if std::mem::take(&mut holding) {
                        status.update(|s| s.detail = POSTCOPY_DETAIL.into());
                    }
                } else if Instant::now() > limits.deadline {
                    bail!("the migration's deadline passed");
                }
                if let Some(reason) = session.failure() {
                    bail!("session failed: {reason}");
                }
                if let Some(q) = &limits.question {
                    if silent > ASK_WHEN_SILENT
                        && asking.is_none()
                        && last_asked.is_none_or(|t| t.elapsed() >= recovery::ASK_EVERY)
                    {
                        last_asked = Some(Instant::now());
                        let (peer, of, started) = (q.peer.clone(), q.of, q.started_unix_ms);
                        asking = Some(AbortOnDropHandle::new(tokio::spawn(async move {
                            recovery::ask_verdict(&peer, of, started).await
                        })));
                    }
                }
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn stream(
    req: &MigrationRequest,
    status: &Shared,
    qmp: &Qmp,
    session: &Session,
    ctl: &mut mpsc::UnboundedReceiver<Control>,
    work_dir: &Path,
    mut codec: Option<SourcePipeline>,
    ledger: &Mutex<PageLedger>,
    mut destination_work: DestinationWork,
    disks: Option<&mut SourceDisks>,
    limits: &Limits,
    switch: &mut Switch<'_>,
) -> Result<(u64, String, Option<Carried>)> {
    let sock = work_dir.join(format!("{}.src.sock", session.id()));
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).with_context(|| format!("bind {}", sock.display()))?;
    let _cleanup = RemoveOnDrop(sock.clone());
    set_capabilities(qmp, req, disks.is_some()).await?;
    qmp.execute(&Migrate {
        uri: format!("unix:{}", sock.display()),
    })
    .await
    .context("source QEMU refused to migrate")?;
    status.update(|s| {
        s.phase = Phase::Memory;
        s.detail.clear();
        s.event(EventKind::MemoryStarted, "");
    });
    let (conn, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .context("QEMU did not connect to the agent's socket within 10s")??;
    let (from_qemu, mut to_qemu) = conn.into_split();
    // Postcopy: QEMU opens its preempt channel on the same socket at the switch.
    let preempt = if req.settings.postcopy_possible() {
        session.make_urgent(PREEMPT);
        Some(AbortOnDropHandle::new(tokio::spawn(preempt::forward(
            listener,
            session.clone(),
            status.clone(),
        ))))
    } else {
        drop(listener);
        None
    };

    // The return path: whatever the destination QEMU says goes back to the source QEMU.
    let (rp_session, rp_status) = (session.clone(), status.clone());
    let return_path = tokio::spawn(async move {
        while let Ok(Received::Data(b)) = rp_session.recv(RETURN_PATH).await {
            if to_qemu.write_all(&b).await.is_err() {
                break;
            }
            rp_status.update(|s| s.return_path_bytes += b.len() as u64);
        }
    });
    let _abort_rp = AbortOnDropHandle::new(return_path);

    let pump = async {
        let mut parser = StreamParser::new();
        let mut input = BytesMut::with_capacity(CHUNK * 2);
        // What goes on the stream channel: QEMU's bytes, or the codec's batches.
        let mut out = BytesMut::with_capacity(CHUNK * 2);
        let mut hash = TreeDigest::new();
        let mut total = 0u64;
        // Bytes handed to the stream channel.
        let mut stream_sent = 0u64;
        // After a postcopy switch the pages the guest faults on cross in urgent frames, each
        // waiting behind the bulk frame a connection is writing: keep those small.
        let max_frame = if req.settings.postcopy_possible() {
            MIN_FRAME
        } else {
            MAX_FRAME
        };
        // The block caches paused while the pump, not QEMU or the link, is the limit: told
        // how long the pump waits for either.
        let mut pauser = CachePauser::new(
            codec.is_some() && req.settings.codec.dedup,
            req.settings.test_cache_pause_bytes,
            Instant::now(),
        );
        loop {
            // Take what QEMU has written so far; when it has nothing more right now, send
            // what was parsed even if it is less than a frame: QEMU may be waiting for an
            // answer to it (with the return path on, it sends the device state and then
            // waits for the destination's confirmation before it closes the stream).
            // No reading further ahead of the destination QEMU than the page window.
            let outstanding = ledger
                .lock()
                .expect("ledger lock")
                .outstanding(session.unacked_bytes_on(STREAM));
            if outstanding > PAGE_WINDOW {
                rounds_out(codec.as_mut(), &mut out, ledger, stream_sent, true, true).await?;
                let waiting = Instant::now();
                send_stream(session, ledger, &mut out, &mut stream_sent, true, max_frame).await?;
                let allowed = ledger
                    .lock()
                    .expect("ledger lock")
                    .unacked_allowed(PAGE_WINDOW);
                if let Some(bytes) = allowed {
                    session.unacked_at_most(STREAM, bytes).await?;
                }
                pauser.waited(waiting.elapsed());
            }
            input.reserve(CHUNK);
            let (eof, drained) = match from_qemu.try_read_buf(&mut input) {
                Ok(n) => (n == 0, n == 0),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => (false, true),
                Err(e) => return Err(anyhow::Error::new(e).context("reading QEMU's stream")),
            };
            // Whether a round of the codec went to `out`: it goes out whole, not held back
            // until more fills a frame (the destination decodes a round only once all of it
            // arrived).
            let mut round_out = false;
            // `item_bytes`: the item as QEMU wrote it, what both ends hash.
            while let Some((item, item_bytes)) = parser.next_item_with_bytes(&mut input)? {
                hash.update(&item_bytes);
                let (item_bytes, _) =
                    corrupt_for_test(item_bytes, total, req.settings.test_corrupt_at);
                total += item_bytes.len() as u64;
                let pages = destination_work.pages(&item, parser.current_block());
                match &mut codec {
                    Some(codec) => {
                        ledger.lock().expect("ledger lock").read(pages);
                        codec.push(&item, &item_bytes).await?;
                        if let Some(paused) = pauser.after_item(total) {
                            round_out |=
                                pause_caches(codec, &mut out, ledger, stream_sent, paused).await?;
                        } else if codec.is_full() {
                            round_out |=
                                rounds_out(Some(codec), &mut out, ledger, stream_sent, true, false)
                                    .await?;
                        }
                    }
                    None => {
                        out.extend_from_slice(&item_bytes);
                        let mut book = ledger.lock().expect("ledger lock");
                        book.read(pages);
                        book.mark(stream_sent + out.len() as u64);
                    }
                }
                if parser.ended_package() {
                    // Postcopy's commit point: the destination QEMU gets the package once
                    // everything up to its end matches this digest.
                    rounds_out(codec.as_mut(), &mut out, ledger, stream_sent, true, true).await?;
                    send_stream(session, ledger, &mut out, &mut stream_sent, true, max_frame)
                        .await?;
                    control::send(
                        session,
                        &Control::Checkpoint {
                            bytes: total,
                            digest: hash.hex(),
                        },
                    )
                    .await?;
                    switch.package_sent.store(true, Ordering::Relaxed);
                    status.update(|s| {
                        s.phase = Phase::Switchover;
                        s.detail = "postcopy: the VM stopped, its device state crossed".into();
                    });
                }
            }
            if eof {
                parser.finish(input.len()).context("QEMU's stream")?;
            }
            // Drained, the open round goes (QEMU may be waiting for an answer to it); at the
            // end, every round.
            round_out |=
                rounds_out(codec.as_mut(), &mut out, ledger, stream_sent, drained, eof).await?;
            let change = pauser.after_turn(Instant::now());
            if let (Some(paused), Some(codec)) = (change, codec.as_mut()) {
                round_out |= pause_caches(codec, &mut out, ledger, stream_sent, paused).await?;
            }
            let all = drained || round_out;
            // Sending waits only while the send window is full.
            let waiting = Instant::now();
            let sent =
                send_stream(session, ledger, &mut out, &mut stream_sent, all, max_frame).await?;
            let now = Instant::now();
            pauser.waited(now - waiting);
            // Every turn that sent: the switchover's steering reads the codec's resend cost
            // from the status, so it is kept as fresh as the stream.
            if sent {
                let report = codec.as_ref().map(|codec| CodecReport {
                    cache_paused_ms: pauser.paused_ms(now),
                    ..codec.report()
                });
                status.update(|s| {
                    s.stream_bytes = total;
                    s.codec = report;
                });
            }
            if eof {
                return Ok::<_, anyhow::Error>((total, hash.hex()));
            }
            if drained {
                // Or until the codec's threads finish a round, which then goes out.
                let coded = async {
                    match &mut codec {
                        Some(codec) => codec.round_coded().await,
                        None => std::future::pending().await,
                    }
                };
                let waiting = Instant::now();
                tokio::select! {
                    ready = from_qemu.readable() => {
                        ready.context("waiting for QEMU's stream")?;
                        pauser.waited(waiting.elapsed());
                    }
                    // Waiting for the codec's threads is the pump's work, not idle time.
                    coded = coded => coded?,
                }
            }
        }
    };
    // With disks QEMU pauses the VM before its last pass and waits: the mirrors complete,
    // the disk channel's end goes out, then QEMU goes on.
    let has_disks = disks.is_some();
    let disk_switchover = async {
        let Some(disks) = disks else {
            return std::future::pending().await;
        };
        while qmp
            .wait_event(
                "MIGRATION",
                |v| v["status"] == "pre-switchover",
                Duration::from_secs(3600),
            )
            .await
            .is_none()
        {}
        status.enter(Phase::Switchover, "completing the disk mirrors");
        let (snapshots, digest) = disks.finish(qmp).await?;
        control::send(session, &Control::DiskEnd { snapshots, digest }).await?;
        qmp.execute(&MigrateContinue {
            state: "pre-switchover".into(),
        })
        .await
        .context("continuing the migration after the disk mirrors completed")?;
        Ok::<_, anyhow::Error>(())
    };
    tokio::pin!(disk_switchover);
    // Postcopy: the switch once the first pass is done (or the throttle reached its mark).
    let switch_when = postcopy::SwitchWhen::of(&req.settings);
    let mut to_postcopy = switch_when.is_some();
    let when = switch_when.unwrap_or(postcopy::SwitchWhen::FirstPass);
    let postcopy_switch = postcopy::switch_when(qmp, when, || {
        // No more queued than crosses within the pause's target (see `end_game_window`).
        let rtt_ms = status.get().wire.rtt_ms.unwrap_or(0.0);
        let window = send_window(req.link_rate_mbit, rtt_ms);
        let window = match req.link_rate_mbit {
            Some(rate) => window.min(switchover::end_game_window(
                req.settings.downtime_ms,
                rtt_ms,
                rate * 1e6 / 8.0,
            )),
            None => window,
        };
        session.unacked_bytes_on(STREAM) <= window as u64
    });
    tokio::pin!(postcopy_switch);
    let pump = watchdog(session, status, limits, pump);
    tokio::pin!(pump);
    let mut switched = !has_disks;
    let (bytes, digest) = loop {
        tokio::select! {
            r = &mut pump => break r??,
            r = &mut disk_switchover, if !switched => {
                r?;
                switched = true;
            }
            r = &mut postcopy_switch, if to_postcopy => {
                r.context("switching to postcopy")?;
                to_postcopy = false;
            }
            msg = ctl.recv() => match msg {
                Some(runs @ Control::Committed { .. })
                    if req.settings.postcopy_possible() && switch.destination_runs.is_none() =>
                {
                    switch.destination_runs(runs, status);
                }
                Some(Control::Abort { reason }) => return Err(DestinationAborted(reason).into()),
                Some(Control::Lost { reason }) => return Err(DestinationLost(reason).into()),
                Some(other) => bail!("unexpected message from the destination during the stream: {other:?}"),
                None => bail!("{}", control_ended(session)),
            },
        }
    };

    // QEMU closed the stream: it must say it completed (else the bytes are not a migration).
    let info = loop {
        let info = qmp.execute(&QueryMigrate).await?;
        match info.status.as_deref() {
            Some("completed") => break info,
            Some("failed") | Some("cancelled") => bail!(
                "source QEMU's migration {}: {}",
                info.status.unwrap_or_default(),
                info.error_desc.unwrap_or_default()
            ),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    // Postcopy: QEMU opened its preempt channel before it sent the package, and closes it as
    // it completes.
    let preempt = match preempt {
        Some(mut task) if switch.package_sent.load(Ordering::Relaxed) => Some(
            watchdog(session, status, limits, &mut task)
                .await?
                .context("the preempt channel's task")??,
        ),
        _ => None,
    };
    let stop = qmp
        .find_event("STOP", |_| true)
        .map(|e| e.timestamp.as_micros());
    status.update(|s| {
        s.qemu_downtime_ms = info.downtime;
        s.source_stop_unix_us = stop;
        if let Some(ram) = &info.ram {
            s.qemu.iteration = ram.dirty_sync_count;
            s.qemu.transferred = ram.transferred;
            s.qemu.remaining = 0;
        }
        let rp = s.return_path_bytes;
        let preempt = preempt
            .as_ref()
            .map(|p| format!(", preempt channel {} bytes", p.bytes))
            .unwrap_or_default();
        s.event(
            EventKind::StreamEnded,
            format!("{bytes} bytes, {ALGORITHM} {digest}, return path {rp} bytes{preempt}"),
        );
    });
    if !status.close_cancel() {
        bail!("cancelled by the user");
    }
    Ok((bytes, digest, preempt))
}

/// The destination's word that the migration stops (its `Abort`), as opposed to a failure
/// seen here.
#[derive(Debug, thiserror::Error)]
#[error("the destination aborted: {0}")]
struct DestinationAborted(String);

/// The destination's word, past the postcopy switch, that its QEMU exited with the VM.
#[derive(Debug, thiserror::Error)]
#[error("the destination reports: {0}")]
struct DestinationLost(String);

/// Past the postcopy switch, the destination lost the session carrying the VM's pages (its
/// agent restarted): the migration goes on through QEMU's postcopy recovery.
#[derive(Debug, thiserror::Error)]
#[error("the destination agent lost the postcopy migration's session (it restarted)")]
struct PostcopySessionLost;

/// A migration that failed after QEMU switched to postcopy, where the source VM no longer
/// runs: why, and where the VM is.
#[derive(Debug)]
struct AfterTheSwitch {
    why: &'static str,
    vm: &'static str,
}

/// The status's detail while the VM runs at the destination and its pages follow.
const POSTCOPY_DETAIL: &str = "the VM runs at the destination; the rest of its memory follows";

/// The source QEMU exited past the switch.
const SOURCE_QEMU_LOST: AfterTheSwitch = AfterTheSwitch {
    why: "after the postcopy switch the source QEMU exited, and the pages that had not crossed \
          went with it: the VM at the destination waits for them and can never have them",
    vm: "the VM at the destination lacks pages lost with the source QEMU",
};

/// The destination QEMU exited past the switch.
const DESTINATION_QEMU_LOST: AfterTheSwitch = AfterTheSwitch {
    why: "after the postcopy switch the destination QEMU exited, and the VM with it; the source \
          QEMU stays paused, holding the VM as it was at the switch (resuming it there rolls \
          the guest back to that moment, its disk writes and network since lost: an \
          operator's decision)",
    vm: "the VM was lost with the destination QEMU",
};

/// The destination has run the VM since the switch.
const RUNS_AT_DESTINATION: AfterTheSwitch = AfterTheSwitch {
    why: "after the postcopy switch: the VM runs at the destination, the source QEMU keeps the \
          pages that had not crossed (left paused)",
    vm: "the VM runs at the destination",
};

impl std::fmt::Display for AfterTheSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.why)
    }
}

/// In postcopy: where the destination's word that it runs the VM goes, and the record that
/// must say so before anything else happens.
struct Switch<'a> {
    destination_runs: &'a mut Option<Control>,
    package_sent: &'a AtomicBool,
    journal: &'a Journal,
    record: &'a OutgoingRecord,
}

impl Switch<'_> {
    /// The destination runs the VM: recorded first (a restart must never resume the source),
    /// then kept for the verdict.
    fn destination_runs(&mut self, committed: Control, status: &Shared) {
        let record = OutgoingRecord {
            state: OutgoingState::Committed,
            postcopy_pending: true,
            reason: None,
            updated_unix_ms: now_ms(),
            ..self.record.clone()
        };
        // The destination runs whatever this write does: a failure is only logged.
        if let Err(e) = self.journal.write_outgoing(&record) {
            tracing::error!("migration {}: postcopy switch: {e:#}", record.id);
        }
        if let Control::Committed { resume_unix_us, .. } = &committed {
            let resume = *resume_unix_us;
            status.update(|s| {
                s.phase = Phase::Postcopy;
                s.detail = POSTCOPY_DETAIL.into();
                s.destination_resume_unix_us = (resume != 0).then_some(resume);
                s.event(
                    EventKind::Committed,
                    "postcopy: the destination runs the VM; the rest of its memory follows",
                );
            });
        }
        *self.destination_runs = Some(committed);
    }
}

/// Stream bytes per frame for a send window of `send_limit`: an eighth of it, so that several
/// frames are in flight and N connections share the stream evenly, and at least [`MIN_FRAME`]
/// so that the 20-byte header is noise (the smallest window, 128 KiB near a switchover, still
/// takes two). At most `max_frame`: a frame goes out whole, and an urgent frame waits behind
/// it. Each frame costs a lock, a writer's wake-up and (when the destination has caught up)
/// an acknowledgement at both ends, so a fast link's larger window takes fewer, larger frames.
fn stream_frame_len(send_limit: usize, max_frame: usize) -> usize {
    (send_limit / 8).clamp(MIN_FRAME, max_frame.max(MIN_FRAME))
}

/// Closes the codec's open round (with `close`), appends the rounds it has coded to `out`
/// (every closed round, with `wait`) and marks the ledger at their end; whether a round was
/// appended. With the codec off nothing is held: every item is marked as it is read.
async fn rounds_out(
    codec: Option<&mut SourcePipeline>,
    out: &mut BytesMut,
    ledger: &Mutex<PageLedger>,
    stream_sent: u64,
    close: bool,
    wait: bool,
) -> Result<bool> {
    let Some(codec) = codec else {
        return Ok(false);
    };
    if close {
        let pages = ledger.lock().expect("ledger lock").pages_read();
        codec.close_round(out, pages).await?;
    }
    let Some(pages) = codec.collect(out, wait).await? else {
        return Ok(false);
    };
    ledger
        .lock()
        .expect("ledger lock")
        .mark_at(stream_sent + out.len() as u64, pages);
    Ok(true)
}

/// Pauses or resumes every shard's block cache. The open round closes first, so the change
/// applies from every shard's next batch. Returns whether a round went out.
async fn pause_caches(
    codec: &mut SourcePipeline,
    out: &mut BytesMut,
    ledger: &Mutex<PageLedger>,
    stream_sent: u64,
    paused: bool,
) -> Result<bool> {
    let round_out = rounds_out(Some(codec), out, ledger, stream_sent, true, false).await?;
    codec.set_cache_paused(paused).await?;
    Ok(round_out)
}

/// Sends `out` on the stream channel in frames of [`stream_frame_len`], sized for the window
/// as each frame goes (it shrinks near the switchover): all of it, or only whole frames (the
/// rest waits for more). Returns whether anything was sent.
async fn send_stream(
    session: &Session,
    ledger: &Mutex<PageLedger>,
    out: &mut BytesMut,
    stream_sent: &mut u64,
    all: bool,
    max_frame: usize,
) -> Result<bool> {
    let mut sent = false;
    loop {
        let frame_len = stream_frame_len(session.send_limit(), max_frame);
        if out.is_empty() || (!all && out.len() < frame_len) {
            break;
        }
        let chunk = out.split_to(out.len().min(frame_len)).freeze();
        let len = chunk.len() as u64;
        session.send(STREAM, chunk).await?;
        *stream_sent += len;
        ledger.lock().expect("ledger lock").sent(len);
        sent = true;
    }
    Ok(sent)
}

/// The test hook: QEMU's bytes of this item (which starts at stream offset `start`) with
/// the bit at offset `at` flipped, if it falls in the item, after the source hashed it; and
/// whether it flipped one.
pub(crate) fn corrupt_for_test(item: Bytes, start: u64, at: Option<u64>) -> (Bytes, bool) {
    let Some(at) = at.filter(|&at| at >= start && at < start + item.len() as u64) else {
        return (item, false);
    };
    let mut altered = BytesMut::from(&item[..]);
    altered[usize::try_from(at - start).expect("inside the item")] ^= 0x01;
    tracing::warn!("test hook: flipped a bit of the stream at byte {at}");
    (altered.freeze(), true)
}

/// QEMU's `max-bandwidth` for its stream into this agent: no cap a host reaches (a unix
/// socket's rate is tens of Gbit/s), so the agent's reading is what paces QEMU.
const LOCAL_HOP_BYTES_PER_S: u64 = 1 << 40;

async fn set_capabilities(qmp: &Qmp, req: &MigrationRequest, disks: bool) -> Result<()> {
    let hold = lookahead(req);
    qmp.execute(&control::stream_capabilities(
        req.settings.return_path,
        req.settings.postcopy_possible(),
    ))
    .await?;
    // Throttling changes nothing in the stream: only the source has it. With disks the
    // source stops before its last pass so that the mirrors can complete (libvirt's way).
    qmp.execute(&MigrateSetCapabilities {
        capabilities: vec![
            Capability {
                capability: "auto-converge".into(),
                state: req.settings.converge,
            },
            Capability {
                capability: "pause-before-switchover".into(),
                state: disks,
            },
        ],
    })
    .await?;
    qmp.execute(&MigrateSetParameters {
        // Held from the start with the first pass's lookahead (the steering releases it);
        // else QEMU's own measurement until the agent steers (an earlier attempt may have set
        // it).
        downtime_limit: Some(if hold {
            switchover::HOLD_LIMIT_MS
        } else {
            req.settings.downtime_ms
        }),
        avail_switchover_bandwidth: Some(if hold {
            switchover::HOLD_BYTES_PER_S
        } else {
            0
        }),
        // QEMU's stream goes to this agent, which paces the WAN itself: QEMU's own default
        // (128 MiB/s) would cap the stream before the codec shrinks it.
        max_bandwidth: Some(LOCAL_HOP_BYTES_PER_S),
        cpu_throttle_initial: req.settings.converge.then_some(THROTTLE_INITIAL_PCT),
        cpu_throttle_increment: req.settings.converge.then_some(THROTTLE_INCREMENT_PCT),
        cpu_throttle_tailslow: req.settings.converge.then_some(true),
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Resumes the source VM after a failed attempt (QEMU resumes it itself after most failures;
/// this covers the rest).
pub(crate) async fn ensure_running(qmp: &Qmp) -> Result<()> {
    for _ in 0..100 {
        let st = match qmp.execute(&QueryStatus).await {
            Ok(st) => st,
            Err(e) if qmp.is_closed() => {
                return Err(anyhow::Error::from(e).context(how_qemu_went(qmp)))
            }
            Err(e) => return Err(e.into()),
        };
        if st.running {
            return Ok(());
        }
        if matches!(
            st.status.as_str(),
            "paused" | "postmigrate" | "finish-migrate"
        ) {
            let _ = qmp.execute(&Cont).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the source VM did not resume after the failed migration")
}

/// How a QEMU whose QMP connection closed went, from the last events it sent: a shutdown it
/// reported (a signal, the guest) or none (it crashed or was killed).
fn how_qemu_went(qmp: &Qmp) -> String {
    match qmp.find_event("SHUTDOWN", |_| true) {
        Some(e) => format!(
            "QEMU shut down ({})",
            e.data["reason"].as_str().unwrap_or("no reason given")
        ),
        None => "QEMU exited without reporting a shutdown: it crashed or was killed".into(),
    }
}

/// What the agent steers in the source QEMU while it migrates, and what it set last.
struct Steering {
    /// The real downtime target (none: QEMU's own rule).
    target_ms: Option<u64>,
    converge: bool,
    limit: Option<u64>,
    rate: Option<u64>,
    throttle_initial: Option<u8>,
    smart: Option<switchover::SmartStop>,
    /// Once smart stop fired, QEMU's threshold stays where it cannot be missed.
    stopping: bool,
    /// Until the first pass's lookahead has drained, QEMU may not switch over at all.
    holding: bool,
}

/// What the steering needs to know about the link at one moment.
struct LinkNow {
    bytes_per_s: f64,
    rtt_ms: Option<f64>,
    /// Bytes still to cross after QEMU's last byte: unacknowledged on the session, and held in
    /// the disks' transmit buffer.
    unacked_bytes: u64,
    /// Of the session's, QEMU's stream's, and the send window without the first pass's lookahead.
    stream_unacked_bytes: u64,
    /// Guest pages read from QEMU that the destination has not consumed yet.
    pages_outstanding: u64,
    window_bytes: u64,
    /// Wire bytes per QEMU byte of resent pages (none: no codec, or nothing resent yet).
    resend_cost: Option<f64>,
    /// The rate QEMU measured over its last 100 ms (none before its first measurement).
    qemu_bytes_per_s: Option<f64>,
}

impl Steering {
    async fn apply(&mut self, qmp: &Qmp, status: &Shared, ram: &RamStats, link: &LinkNow) {
        self.smart_stop(qmp, status, ram).await;
        if self.stopping {
            return;
        }
        let end_game =
            switchover::end_game_rate(link.bytes_per_s, link.resend_cost, link.qemu_bytes_per_s);
        let mut set = MigrateSetParameters::default();
        self.holding = self.holding
            && !switchover::lookahead_drained(
                ram.dirty_sync_count,
                link.stream_unacked_bytes,
                link.window_bytes,
                link.pages_outstanding,
            );
        if let (Some(target), Some(rtt_ms)) = (self.target_ms, link.rtt_ms) {
            let flight = switchover::flight_ms(link.unacked_bytes, link.bytes_per_s, rtt_ms);
            let (limit, rate) = if self.holding {
                (switchover::HOLD_LIMIT_MS, switchover::HOLD_BYTES_PER_S)
            } else {
                (switchover::qemu_limit_ms(target, flight), end_game)
            };
            let stale_limit = self.limit.is_none_or(|l| l.abs_diff(limit) >= 5);
            let stale_rate = self.rate.is_none_or(|r| r.abs_diff(rate) * 20 >= r);
            if stale_limit || stale_rate {
                tracing::debug!(
                    pass = ram.dirty_sync_count,
                    remaining = ram.remaining,
                    unacked = link.unacked_bytes,
                    flight_ms = flight,
                    resend_cost = link.resend_cost,
                    limit_ms = limit,
                    bytes_per_s = rate,
                    "switchover threshold"
                );
                set.downtime_limit = Some(limit);
                set.avail_switchover_bandwidth = Some(rate);
            }
        }
        // Until auto-converge first throttles, its first step is what this guest needs.
        if self.converge && ram.dirty_pages_rate > 0 {
            let dirty = ram.dirty_pages_rate as f64 * PAGE_SIZE as f64;
            let pct = switchover::needed_throttle_pct(dirty, end_game as f64);
            if self.throttle_initial.is_none_or(|p| p.abs_diff(pct) >= 5) {
                set.cpu_throttle_initial = Some(pct);
            }
        }
        if set.downtime_limit.is_none() && set.cpu_throttle_initial.is_none() {
            return;
        }
        match qmp.execute(&set).await {
            Ok(_) => {
                if set.downtime_limit.is_some() {
                    (self.limit, self.rate) = (set.downtime_limit, set.avail_switchover_bandwidth);
                }
                self.throttle_initial = set.cpu_throttle_initial.or(self.throttle_initial);
            }
            Err(e) => tracing::warn!("steering QEMU's switchover ({set:?}): {e:#}"),
        }
    }

    async fn smart_stop(&mut self, qmp: &Qmp, status: &Shared, ram: &RamStats) {
        let Some(smart) = &mut self.smart else { return };
        if self.stopping || !smart.observe(ram.dirty_sync_count, ram.remaining) {
            return;
        }
        let set = MigrateSetParameters {
            downtime_limit: Some(switchover::FORCE_LIMIT_MS),
            avail_switchover_bandwidth: Some(switchover::FORCE_BYTES_PER_S),
            ..Default::default()
        };
        match qmp.execute(&set).await {
            Ok(_) => {
                self.stopping = true;
                let (pass, mib) = (
                    ram.dirty_sync_count,
                    ram.remaining as f64 / f64::from(1 << 20),
                );
                status.update(|s| {
                    s.event(
                        EventKind::SmartStop,
                        format!("pass {pass}, {mib:.1} MiB remaining"),
                    );
                });
            }
            Err(e) => tracing::warn!("smart stop: {e:#}"),
        }
    }
}

/// Every 100 ms: QEMU's progress and the session's counters into the status, and the
/// switchover steered (see `switchover`).
async fn track_progress(
    qmp: Arc<Qmp>,
    session: Session,
    status: Shared,
    req: MigrationRequest,
    ledger: Arc<Mutex<PageLedger>>,
) {
    let mut steering = Steering {
        target_ms: (!req.settings.qemu_switchover_rule).then_some(req.settings.downtime_ms),
        converge: req.settings.converge,
        limit: None,
        rate: None,
        throttle_initial: None,
        smart: req.settings.smart_stop.then(switchover::SmartStop::default),
        stopping: false,
        holding: lookahead(&req),
    };
    let mut last = (Instant::now(), 0u64);
    let mut limit = 0usize;
    // Without a given rate, the link's rate is the best recent wire rate, slowly forgotten.
    let mut link_peak = 0.0f64;
    loop {
        let wire = session.stats();
        let info = qmp.execute(&QueryMigrate).await.ok();
        let now = Instant::now();
        let dt = now.duration_since(last.0).as_secs_f64();
        if dt > 0.05 {
            let rate = wire.wire_bytes_out.saturating_sub(last.1) as f64 / dt;
            link_peak = (0.98 * link_peak).max(rate);
            last = (now, wire.wire_bytes_out);
        }
        let active = info
            .as_ref()
            .and_then(|i| i.status.as_deref())
            .is_some_and(|s| s == "active");
        if let (true, Some(ram)) = (active, info.as_ref().and_then(|i| i.ram.as_ref())) {
            let s = status.get();
            // The first pass's lookahead shrinks with it (see `send_limit`); near the
            // switchover the window shrinks to what drains within the target.
            if let Some(rtt_ms) = s.wire.rtt_ms {
                let first_pass = (ram.dirty_sync_count <= 1).then_some(ram.remaining);
                let mut now = send_limit(req.link_rate_mbit, rtt_ms, first_pass, lookahead(&req));
                if let (Some(target), None, Some(rate)) =
                    (steering.target_ms, first_pass, req.link_rate_mbit)
                {
                    let cost = s.codec.as_ref().and_then(|c| c.resend_cost).unwrap_or(1.0);
                    if switchover::near_switchover(ram.remaining, cost, now) {
                        now = now.min(switchover::end_game_window(
                            target,
                            rtt_ms,
                            rate * 1e6 / 8.0,
                        ));
                    }
                }
                if now != limit {
                    limit = now;
                    session.set_send_limit(limit);
                }
            }
            let link = LinkNow {
                bytes_per_s: req.link_rate_mbit.map_or(link_peak, |m| m * 1e6 / 8.0),
                rtt_ms: s.wire.rtt_ms,
                // The disks' transmit buffer crosses in the pause too (it drains at the
                // pre-switchover stop, before QEMU sends its last pass).
                unacked_bytes: wire.unacked_bytes + s.disk.as_ref().map_or(0, |d| d.held_bytes),
                stream_unacked_bytes: session.unacked_bytes_on(STREAM),
                pages_outstanding: ledger
                    .lock()
                    .expect("ledger lock")
                    .outstanding(session.unacked_bytes_on(STREAM)),
                window_bytes: s
                    .wire
                    .rtt_ms
                    .map_or(0, |rtt_ms| send_window(req.link_rate_mbit, rtt_ms) as u64),
                resend_cost: s.codec.and_then(|c| c.resend_cost),
                qemu_bytes_per_s: (ram.mbps > 0.0).then(|| ram.mbps * 1e6 / 8.0),
            };
            steering.apply(&qmp, &status, ram, &link).await;
        }
        status.update(|s| {
            s.wire.bytes_out = wire.wire_bytes_out;
            s.wire.bytes_in = wire.wire_bytes_in;
            s.wire.connections_live = wire.connections_live;
            s.wire.replayed_frames = wire.replayed_frames;
            s.wire.unacked_bytes = wire.unacked_bytes;
            s.qemu_downtime_limit_ms = steering.limit.or(s.qemu_downtime_limit_ms);
            if let Some(info) = info {
                if let Some(pct) = info.cpu_throttle_percentage.filter(|&p| p > 0) {
                    s.max_cpu_throttle_pct = Some(s.max_cpu_throttle_pct.unwrap_or(0).max(pct));
                    // The vCPU time the throttle took over this interval.
                    s.throttle_vcpu_s += pct as f64 / 100.0 * dt;
                }
                s.qemu.status = info.status.unwrap_or_default();
                if let Some(ram) = info.ram {
                    s.qemu.transferred = ram.transferred;
                    s.qemu.remaining = ram.remaining;
                    s.qemu.total = ram.total;
                    s.qemu.iteration = ram.dirty_sync_count;
                }
                s.qemu.expected_downtime_ms = info.expected_downtime;
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The command line of the QEMU serving `qmp` (the kernel names the process behind a unix
/// socket), for the destination to start the same VM.
fn command_line(qmp: &Qmp, socket: &Path) -> Result<Vec<String>> {
    let pid = qmp.peer_pid().ok_or_else(|| {
        anyhow!(
            "cannot tell which process serves {}; give the destination's command line",
            socket.display()
        )
    })?;
    let raw = std::fs::read(format!("/proc/{pid}/cmdline"))
        .with_context(|| format!("reading the source QEMU's command line (pid {pid})"))?;
    // Arguments end with a NUL each; an empty one (`-append ""`) is an empty piece.
    let raw = raw.strip_suffix(&[0]).unwrap_or(&raw);
    Ok(raw
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect())
}

/// Why the queue of control messages ended: the session failed ([`read_control`]).
fn control_ended(session: &Session) -> String {
    session.failure().map_or_else(
        || "the destination's control messages ended".to_owned(),
        |reason| format!("session failed: {reason}"),
    )
}

/// Forwards control messages into a queue the phases take them from.
async fn read_control(session: Session, tx: mpsc::UnboundedSender<Control>) {
    loop {
        match control::recv(&session).await {
            Ok(msg) => {
                if tx.send(msg).is_err() {
                    return;
                }
            }
            // A message that cannot be read ends the session with its reason (the phases
            // report it from there); a failed session already has one.
            Err(e) => {
                if session.failure().is_none() {
                    session.fail(format!("{e:#}"));
                }
                return;
            }
        }
    }
}

/// Records connection events; the first measured round trip sizes the send window, and the
/// first connection says how many the session keeps.
async fn watch_links(
    mut rx: mpsc::UnboundedReceiver<LinkEvent>,
    session: Session,
    status: Shared,
    rate_mbit: Option<f64>,
    connections: ConnectionCount,
) {
    let mut sized = false;
    let mut opened = 0u32;
    while let Some(ev) = rx.recv().await {
        match ev {
            LinkEvent::Connected {
                connection,
                rtt,
                warm,
            } => {
                let rtt_ms = rtt.as_secs_f64() * 1e3;
                if !sized {
                    sized = true;
                    // The first pass's lookahead comes with QEMU's progress (`track_progress`).
                    session.set_send_limit(send_window(rate_mbit, rtt_ms));
                }
                opened += 1;
                // Decided before the first connection's Connected (in its dial).
                let decided = connections.get();
                let count = decided.as_ref().map_or(1, |d| d.connections);
                status.update(|s| {
                    if s.wire.connections == 0 {
                        if let Some(why) = decided.as_ref().and_then(|d| d.why.as_ref()) {
                            s.event(
                                EventKind::Connected,
                                format!("{count} connection(s): {why}"),
                            );
                        }
                    }
                    s.wire.connections = count;
                    s.wire.connections_why = decided.and_then(|d| d.why);
                    s.wire.rtt_ms = Some(rtt_ms);
                    s.wire.reconnects = opened.saturating_sub(count);
                    let how = warm.map_or_else(String::new, |parked| {
                        format!(", warm (parked {:.1} s)", parked.as_secs_f64())
                    });
                    s.event(
                        EventKind::Connected,
                        format!("connection {connection}{how}, rtt {rtt_ms:.1} ms"),
                    );
                });
            }
            LinkEvent::Lost { connection, error } => status.update(|s| {
                s.event(
                    EventKind::ConnectionLost,
                    format!("connection {connection}: {error}"),
                );
            }),
            LinkEvent::DialFailed { connection, error } => {
                tracing::debug!("connection {connection}: {error}");
                status.update(|s| s.wire.last_dial_error = Some(error));
            }
        }
    }
}

/// The send limit while QEMU's first pass has `pass_remaining` bytes to go (`None`: past the
/// first pass): the window, plus in the first pass a lookahead. The first pass carries
/// stretches the codec squeezes to almost nothing (zero-padded pages, pages the destination
/// holds) and stretches where QEMU only scans (memory it finds zero); with the window alone the
/// link idled through them (the zero-heavy guest's WAN rate fell to 30-50 Mbit/s for 0.8 s on a
/// 100 Mbit/s link) because the agent could not read ahead. With a lookahead, QEMU and the codec
/// run ahead while the link carries bulky pages, and the link drains that backlog through the
/// cheap stretches.
///
/// Whatever is queued when QEMU stops the VM crosses during the pause, and QEMU may stop it as
/// soon as its first pass ends (a guest that dirties little converges at once). So the
/// lookahead shrinks with the pass: never more than the link drains while QEMU could race
/// through the rest of the pass (`SCAN_BYTES_PER_S`), and at most `LOOKAHEAD_S` of the link.
/// Only with a known link rate (without one there is no measure of a second) and with the
/// switchover steered (QEMU's own rule knows nothing of the queue).
pub fn send_limit(
    rate_mbit: Option<f64>,
    rtt_ms: f64,
    pass_remaining: Option<u64>,
    lookahead: bool,
) -> usize {
    let window = send_window(rate_mbit, rtt_ms);
    match (rate_mbit, pass_remaining) {
        (Some(rate), Some(remaining)) if lookahead => {
            let link = rate * 1e6 / 8.0;
            let seconds = (remaining as f64 / SCAN_BYTES_PER_S).min(LOOKAHEAD_S);
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // below 2^53
            let lookahead = (link * seconds) as usize;
            window + lookahead
        }
        _ => window,
    }
}

/// Whether this migration's first pass reads ahead of the link (see `send_limit`).
fn lookahead(req: &MigrationRequest) -> bool {
    req.link_rate_mbit.is_some() && !req.settings.qemu_switchover_rule
}

/// The first pass's lookahead: at most this many seconds of the link, and no more than the link
/// drains while QEMU goes through the rest of its pass at this rate (its zero-page scan ran at
/// up to 600 MB/s in the lab, with the guest's TCG vCPU on the other core).
const LOOKAHEAD_S: f64 = 1.0;
const SCAN_BYTES_PER_S: f64 = 1e9;

/// How much larger than the VM a seed image may be (a sibling's template).
const SEED_IMAGE_MAX_RATIO: u64 = 4;

/// Unacknowledged bytes the sender allows, from the bandwidth-delay product measured at connect
/// time. With a known rate the connections are paced, the bottleneck's queue stays empty and the
/// round trip stays the idle one, so twice the BDP keeps the pipe full (measured: 26.2 s against
/// QEMU plain's 25.8 s on the demo guest); unpaced, CUBIC fills the queue and the round trip under
/// load doubles, so four times (with two, unpaced, throughput fell 28%). No more than that,
/// because everything buffered here is still to cross the WAN after QEMU stops the VM: the
/// switchover steering subtracts its drain from the downtime target.
pub fn send_window(rate_mbit: Option<f64>, rtt_ms: f64) -> usize {
    let (rate, factor) = match rate_mbit {
        Some(rate) => (rate, 2.0),
        None => (1000.0, 4.0),
    };
    let bdp = rate * 1e6 / 8.0 * rtt_ms / 1e3;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // clamped to a sane range
    let window =
        (factor * bdp).clamp(512.0 * 1024.0, ferry_wire::MAX_SEND_WINDOW_BYTES as f64) as usize;
    window
}

/// A file removed when this goes (a socket's, whichever way the migration ends).
pub(crate) struct RemoveOnDrop(pub PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_an_eighth_of_the_window_within_their_bounds() {
        // 1 Gbit/s, 10 ms, paced: a 2.5 MB window.
        let window = send_window(Some(1000.0), 10.0);
        assert_eq!(stream_frame_len(window, MAX_FRAME), window / 8);
        // The smallest windows still take two frames; the largest, frames of 1 MiB.
        let end_game = 128 << 10;
        assert_eq!(stream_frame_len(end_game, MAX_FRAME), MIN_FRAME);
        assert!(2 * stream_frame_len(end_game, MAX_FRAME) <= end_game);
        assert_eq!(stream_frame_len(64 << 20, MAX_FRAME), MAX_FRAME);
        // Postcopy keeps them small whatever the window.
        assert_eq!(stream_frame_len(64 << 20, MIN_FRAME), MIN_FRAME);
    }
}
