//! The destination side of a migration: feeds the stream to the waiting QEMU (started paused,
//! `-incoming defer`) through a local unix socket, sends its return path back, and decides the
//! commit: QEMU is resumed only when the stream's digest matches the source's and QEMU says it
//! loaded. Any failure before that quits the destination QEMU; the source resumes its VM.
//! In postcopy the commit comes at the switch instead ([`crate::engine::postcopy`]).

use std::future::Future;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::BytesMut;
use ferry_api::agent::DestinationSwitchover;
use ferry_qemu::commands::{Cont, MigrateIncoming, QueryMigrate, QueryStatus, Quit};
use ferry_qemu::Qmp;
use ferry_wire::{Received, Session};
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;
use tokio_util::task::AbortOnDropHandle;

use crate::engine::control::{self, Carried, Control, Incoming, RETURN_PATH, SEED, STREAM};
use crate::engine::digest::{TreeDigest, ALGORITHM};
use crate::engine::disk;
use crate::engine::disk::apply::DestinationDisks;
use crate::engine::disk::backing::backing_of;
use crate::engine::disk::since;
use crate::engine::feeder::{self, Feeder};
use crate::engine::journal::{IncomingRecord, IncomingState, Journal};
use crate::engine::known_zero::{self, ZeroPages};
use crate::engine::launcher;
use crate::engine::load_sieve::{LoadSieve, Sieved};
use crate::engine::monitor_dir::{Arrival, MonitorDir};
use crate::engine::monitor_keeper;
use crate::engine::pipeline::budget::{ThreadBudget, Threads};
use crate::engine::pipeline::{DestinationPipeline, ShardedDecoder};
use crate::engine::postcopy::{self, PackageGate};
use crate::engine::postcopy_recovery::{self, HeldMonitors};
use crate::engine::preempt;
use crate::engine::seed_store;
use crate::engine::source::RemoveOnDrop;
use crate::engine::status::now_ms;
use crate::engine::stream_codec;
use ferry_codec::shard::MAX_SHARDS;

/// The source's word, past the postcopy switch, that its QEMU exited with the pages the VM
/// here still lacked.
#[derive(Debug, thiserror::Error)]
#[error("the source QEMU exited after the postcopy switch, and with it the pages this VM still lacked ({0})")]
struct SourceLost(String);

/// The seed index goes to the source in pieces of this size.
const SEED_PIECE: usize = 256 << 10;

/// Serves one incoming migration (its session's first message was `prepare`) to its end.
pub async fn run(session: Session, dirs: Dirs, prepare: Control) {
    let (mut qmp, mut launched, mut record) = (None, None, None);
    let result = serve(
        &session,
        prepare,
        &dirs,
        &mut qmp,
        &mut launched,
        &mut record,
    )
    .await;
    if let Err(e) = result {
        tracing::warn!("session {}: {e:#}", session.id());
        if let Some(record) = record
            .as_ref()
            .filter(|r| r.state == IncomingState::Committed)
        {
            // Past the postcopy switch: the VM runs here and must stay, unless a QEMU took it
            // or the pages it lacks away.
            let lost = match e.downcast_ref::<SourceLost>() {
                Some(lost) => Some((lost.to_string(), false)),
                None => match &qmp {
                    Some(q) if postcopy_recovery::qemu_exited(q).await => Some((
                        "the destination QEMU exited after the postcopy switch, and the VM with it"
                            .to_owned(),
                        true,
                    )),
                    _ => None,
                },
            };
            if let Some((reason, here)) = lost {
                tracing::error!(
                    "session {}: VM {:?}: {reason}; nothing can recover it: an operator decides",
                    session.id(),
                    record.vm
                );
                postcopy_recovery::lost(&dirs.journal, record.clone(), reason.clone());
                if here {
                    let lost = Control::Lost {
                        reason: reason.clone(),
                    };
                    control::tell(&session, &lost, Duration::from_secs(5)).await;
                }
                session.fail(reason);
                return;
            }
            tracing::error!(
                "session {}: VM {:?} runs here since the postcopy switch; its migration failed after it",
                session.id(),
                record.vm
            );
            // Its monitor stays open for a recovery (`postcopy_recovery`): the QEMU, waiting
            // for pages, would answer no new connection.
            if let Some(qmp) = qmp.take() {
                dirs.held.keep(session.id(), qmp);
            }
            control::tell_abort(&session, format!("{e:#}"), Duration::from_secs(5)).await;
            session.fail(format!("{e:#}"));
            return;
        }
        if let Some(record) = record
            .as_ref()
            .filter(|r| r.state == IncomingState::Committing)
        {
            // The decision to resume was taken; whether QEMU took it is not known. Nothing is
            // undone: the source, in doubt, asks, and the answer settles it then.
            tracing::error!(
                "session {}: VM {:?} was being resumed here: left for the source's question or \
                 a restart to settle",
                session.id(),
                record.vm
            );
            session.fail(format!("{e:#}"));
            return;
        }
        if let Some(record) = record {
            let aborted = IncomingRecord {
                state: IncomingState::Aborted,
                reason: Some(format!("{e:#}")),
                updated_unix_ms: now_ms(),
                ..record
            };
            if let Err(e) = dirs.journal.write_incoming(&aborted) {
                tracing::error!("session {}: {e:#}", session.id());
            }
        }
        // Not committed: the destination VM goes; one this agent started, whether or not its
        // monitor answers.
        if let Some(qmp) = &qmp {
            let _ = qmp.execute(&Quit).await;
        }
        if let Some((arrival, pid, made)) = launched {
            if let Some(pid) = pid {
                launcher::kill(pid);
            }
            launcher::clean_up(&arrival.socket, &arrival.pidfile);
            disk::image::remove(&made);
        }
        // The source says "the destination refused/aborted: " before it.
        control::tell_abort(&session, format!("{e:#}"), Duration::from_secs(5)).await;
        session.fail(format!("{e:#}"));
    }
}

/// Where a destination keeps its files.
#[derive(Debug, Clone)]
pub struct Dirs {
    /// Sockets to QEMU, the disks' exports.
    pub work: PathBuf,
    /// Memory images of VMs that left, for seeding.
    pub seeds: PathBuf,
    /// The VMs' monitors: where a QEMU this agent starts gets its own.
    pub monitors: Arc<MonitorDir>,
    /// Where the migration's record goes.
    pub journal: Journal,
    /// Where a postcopy migration that failed past the switch leaves its monitor.
    pub held: Arc<HeldMonitors>,
}

/// A QEMU this agent started for the VM arriving (its monitor's place, its pid).
/// And the disk images it made for it.
type Launched = Option<(Arrival, Option<u32>, Vec<PathBuf>)>;

async fn serve(
    session: &Session,
    prepare: Control,
    dirs: &Dirs,
    qmp_slot: &mut Option<Qmp>,
    launched: &mut Launched,
    record_slot: &mut Option<IncomingRecord>,
) -> Result<()> {
    let (work_dir, seed_dir) = (dirs.work.as_path(), dirs.seeds.as_path());
    let Control::Prepare {
        version: _,
        vm,
        destination,
        wan_timeout_s,
        return_path,
        postcopy,
        codec,
        history_bytes,
        shards,
        test_decode_threads,
        seed_from,
        disks,
    } = prepare
    else {
        bail!("expected Prepare first, got {prepare:?}");
    };
    let wan_timeout = Duration::from_secs(wan_timeout_s);
    if postcopy && !disks.is_empty() {
        bail!("postcopy with disks is not supported");
    }
    let shards = usize::try_from(shards).unwrap_or(usize::MAX);
    if codec.any() && !(1..=MAX_SHARDS).contains(&shards) {
        bail!("the source codes the stream in {shards} shards; this agent takes 1 to {MAX_SHARDS}");
    }
    if history_bytes > stream_codec::HISTORY_CAP {
        bail!(
            "the source asks for a {history_bytes}-byte page history; this agent keeps at most {}",
            stream_codec::HISTORY_CAP
        );
    }
    tracing::info!("session {}: receiving VM {vm:?}", session.id());
    // The seed image is read and indexed while QEMU gets ready.
    let seed = codec.seed.then(|| {
        let (dir, name) = (seed_dir.to_owned(), seed_from.unwrap_or_else(|| vm.clone()));
        tokio::task::spawn_blocking(move || seed_store::load(&dir, &name))
    });
    // The record goes down before the QEMU is touched: a session without one never resumed a
    // VM here (see `journal`).
    let mut record = |qmp: &Path| -> Result<IncomingRecord> {
        let record = record_slot.insert(IncomingRecord {
            session: session.id(),
            vm: vm.clone(),
            qmp: qmp.to_owned(),
            state: IncomingState::Receiving,
            reason: None,
            postcopy_pending: false,
            monitor_keeper: None,
            images_made: Vec::new(),
            updated_unix_ms: now_ms(),
        });
        dirs.journal
            .write_incoming(record)
            .context("recording the incoming migration")?;
        Ok(record.clone())
    };
    let (destination_qmp, record) = match destination {
        Incoming::Qmp(path) => {
            let record = record(&path)?;
            (path, record)
        }
        Incoming::Launch(argv) => {
            // The VM gets its monitor where the host's VMs have theirs, named after it; until
            // the commit it is not listed as this host's.
            let arrival = dirs.monitors.claim(&vm).await?;
            let socket = arrival.socket.clone();
            let record = record(&socket)?;
            let (arrival, pid, made) = launched.insert((arrival, None, Vec::new()));
            // The backing layers this host lacks come first: the images are made on them.
            let wanted = disk::layers::wanted(&argv, &disks).await;
            if !wanted.is_empty() {
                control::send(
                    session,
                    &Control::NeedLayers {
                        layers: wanted.clone(),
                    },
                )
                .await?;
                disk::layers::receive(session, &argv, &disks, &wanted, wan_timeout).await?;
            }
            *made = disk::image::make_missing(&argv, &disks).await?;
            // Said in the record, for a restart to remove them if this never commits.
            if !made.is_empty() {
                let record = record_slot.as_mut().expect("recorded above");
                record.images_made.clone_from(made);
                dirs.journal
                    .write_incoming(record)
                    .context("recording the disk images made")?;
            }
            *pid = launcher::start(&argv, &arrival.socket, &arrival.pidfile)
                .await?
                .pid;
            (socket, record)
        }
    };
    // Postcopy: with out-of-band execution, which a recovery needs (see `HeldMonitors`).
    let qmp = if postcopy {
        Qmp::connect_oob(&destination_qmp).await
    } else {
        Qmp::connect(&destination_qmp).await
    }
    .context("destination QEMU")?;
    let qmp = &*qmp_slot.insert(qmp);
    let st = qmp.execute(&QueryStatus).await?;
    if st.status != "inmigrate" {
        bail!("the destination QEMU is not waiting for a migration (status {:?}; start it with -incoming defer)", st.status);
    }
    // Before QEMU loads anything: which of its pages are zero already (holes of its memory
    // file). Not knowing only costs the destination time. (In postcopy every page goes to
    // QEMU: see `load_sieve`.)
    let zero = match known_zero::discover(qmp).await {
        _ if postcopy => ZeroPages::none(),
        Ok(zero) => {
            tracing::info!(
                "session {}: {} destination pages known zero before loading",
                session.id(),
                zero.count()
            );
            zero
        }
        Err(e) => {
            tracing::warn!(
                "session {}: every zero page goes to QEMU (its memory's holes: {e:#})",
                session.id()
            );
            ZeroPages::none()
        }
    };
    qmp.execute(&control::stream_capabilities(return_path, postcopy))
        .await?;
    let sock = work_dir.join(format!("{}.dst.sock", session.id()));
    let _ = std::fs::remove_file(&sock);
    qmp.execute(&MigrateIncoming {
        uri: format!("unix:{}", sock.display()),
    })
    .await
    .context("destination QEMU refused migrate-incoming")?;
    let conn = connect_retry(&sock).await?;
    // In postcopy the QEMU's preempt channel connects to the same socket once the source's
    // QEMU opened its own (which removes the file); whatever happens, it goes with this.
    let _socket_file = RemoveOnDrop(sock.clone());
    let mut preempt = if postcopy {
        Some(AbortOnDropHandle::new(tokio::spawn(preempt::deliver(
            session.clone(),
            sock.clone(),
        ))))
    } else {
        let _ = std::fs::remove_file(&sock);
        None
    };
    // The disks are exported before Ready: the source starts its mirrors once it has it.
    let dst_disks = if disks.is_empty() {
        None
    } else {
        Some(DestinationDisks::start(qmp, work_dir, session.id(), &disks).await?)
    };
    let (from_qemu, to_qemu) = conn.into_split();
    // A seed only saves bytes: one that cannot be read means a migration without it.
    let seed = match seed {
        Some(task) => match task.await.context("indexing the seed image")? {
            Ok(seed) => seed,
            Err(e) => {
                tracing::warn!("session {}: no seed offered: {e:#}", session.id());
                None
            }
        },
        None => None,
    };
    // An older copy of the disks here (the VM was here before): untouched since the VM left,
    // the source's dirty bitmaps say what changed; otherwise index it for the source.
    let (mut disk_since, mut disk_base_note, mut disk_index_ms) = (None, None, None);
    // Each disk's backing chain here (SHA-256 of its files in order), and where it starts.
    let mut backing = Vec::new();
    if dst_disks.is_some() {
        for plan in &disks {
            backing.push(backing_of(qmp, &plan.node).await?);
        }
    }
    let disk_base = match &dst_disks {
        Some(d) => {
            let digests: Vec<Option<String>> = backing
                .iter()
                .map(|b| b.as_ref().map(|chain| chain.digest.clone()))
                .collect();
            let found = since::untouched(qmp, &disks, &digests).await;
            since::forget_markers(qmp, &disks).await;
            match found {
                Ok(sessions) => {
                    tracing::info!(
                        "session {}: the disks' older copy here is untouched since sessions {sessions:?}: no index",
                        session.id()
                    );
                    disk_since = Some(sessions);
                    None
                }
                Err(why) => {
                    let key = super::disk::index_key(session);
                    let t0 = std::time::Instant::now();
                    let index = d.index(qmp, key).await?;
                    if let Some(index) = &index {
                        let ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
                        tracing::info!(
                            "session {}: offering the index of the disks' older copy ({} bytes, {ms} ms): {why}",
                            session.id(),
                            index.len(),
                        );
                        (disk_base_note, disk_index_ms) = (Some(why), Some(ms));
                    }
                    index
                }
            }
        }
        None => None,
    };
    // SnapMig: a fresh overlay here on the same backing image as the source's needs only the
    // source's overlay. (With an older copy here, everything is compared block by block.)
    let mut top_only = Vec::new();
    if disk_base.is_none() && disk_since.is_none() {
        for (plan, ours) in disks.iter().zip(&backing) {
            let same = match (&plan.backing_sha256, ours) {
                (Some(theirs), Some(ours)) => {
                    let same = *theirs == ours.digest;
                    tracing::info!(
                        "session {}: disk {:?}: backing image {} {} the source's",
                        session.id(),
                        plan.node,
                        ours.files[0].display(),
                        if same { "matches" } else { "differs from" }
                    );
                    same
                }
                _ => false,
            };
            top_only.push(same);
        }
    }
    control::send(
        session,
        &Control::Ready {
            seed: seed.as_ref().map(|s| s.report.clone()),
            disk_base_bytes: disk_base.as_ref().map(|b| b.len() as u64),
            top_only,
            disk_since: disk_since.take(),
            disk_base_note: disk_base_note.take(),
            disk_index_ms: disk_index_ms.take(),
            zeroed_blocks: zero.all_zero_blocks(),
            images_made: launched.as_ref().map_or(0, |(_, _, made)| {
                u32::try_from(made.len()).unwrap_or(u32::MAX)
            }),
        },
    )
    .await?;
    if let Some(index) = &disk_base {
        control::send_blob(session, control::DISK_BASE, index).await?;
    }
    let mut decoder = codec
        .any()
        .then(|| ShardedDecoder::new(codec, history_bytes, shards));
    if let Some(seed) = seed {
        tracing::info!(
            "session {}: offering seed image {:?} ({} pages, a {}-byte index, {} ms to index)",
            session.id(),
            seed.report.image,
            seed.report.pages,
            seed.report.index_bytes,
            seed.report.index_ms
        );
        for piece in seed.index.chunks(SEED_PIECE) {
            session
                .send(SEED, bytes::Bytes::copy_from_slice(piece))
                .await?;
        }
        if let Some(decoder) = &mut decoder {
            decoder.set_seed(seed.image);
        }
    }

    let threads = DestinationPipeline::threads_for(
        shards,
        std::thread::available_parallelism().map_or(1, usize::from),
        test_decode_threads,
    );
    // As at the source: within what the agent's other migrations left, but for the test hook.
    // Declared before the pipeline, so given back after its threads are joined.
    let budgeted =
        (decoder.is_some() && !test_decode_threads).then(|| ThreadBudget::of_agent().take(threads));
    let threads = budgeted.as_ref().map_or(threads, Threads::count);
    let mut decoder = decoder
        .map(|d| DestinationPipeline::new(d, threads, "ferry-decode"))
        .transpose()?;

    // The return path, destination QEMU to source QEMU.
    let return_path = spawn_return_path(from_qemu, session.clone());

    // The disks' writes, applied while the stream flows.
    let disk_apply = async {
        match &dst_disks {
            Some(d) => d.apply(session, codec).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(disk_apply);
    let mut disk_applied: Option<(u64, String)> = None;
    let mut disk_end: Option<(u64, String)> = None;

    // The stream, until the source's End and every byte it announces have arrived.
    let mut hash = TreeDigest::new();
    // QEMU's bytes rebuilt so far (the codec's records decoded, or the channel's bytes).
    let mut received = 0u64;
    let mut decoded = BytesMut::with_capacity(128 << 10);
    let mut feeder = Feeder::spawn(to_qemu, feeder::BUDGET_BYTES);
    let mut sieve = if postcopy {
        LoadSieve::postcopy()
    } else {
        LoadSieve::new(zero)
    };
    let mut end: Option<(u64, String)> = None;
    // What the source says crossed on QEMU's postcopy preempt channel.
    let mut preempt_end: Option<Carried> = None;
    // Postcopy: the package's gate, and once it opened, the switch (QEMU loads the package,
    // the VM resumes here); it gives the record that says the VM is this host's.
    let mut gate = PackageGate::default();
    type SwitchFuture<'a> = Pin<Box<dyn Future<Output = Result<IncomingRecord>> + Send + 'a>>;
    let mut switch: Option<SwitchFuture> = None;
    let mut switched = false;
    // Once the VM may run here (postcopy, the gate opened) only an outage longer than
    // `HOLD_AFTER_SWITCH` ends the migration: its remaining pages are only at the source.
    let idle_check = |switched: bool| -> Result<()> {
        let idle = session.idle_for();
        if switched && idle > postcopy::HOLD_AFTER_SWITCH {
            bail!(
                "no connection from the source agent for {}s after the postcopy switch",
                idle.as_secs()
            );
        }
        if !switched && idle > wan_timeout {
            bail!(
                "no connection from the source agent for {}s (the WAN timeout)",
                wan_timeout.as_secs()
            );
        }
        Ok(())
    };
    while end.as_ref().is_none_or(|(bytes, _)| received < *bytes) {
        tokio::select! {
            r = session.recv(STREAM) => match r? {
                Received::Data(chunk) => {
                    let sieved = match &mut decoder {
                        // Decoded straight into the sieve's input, hashed there: QEMU's bytes
                        // are copied once less on their way to QEMU. Without postcopy no
                        // package cuts the digest.
                        Some(DestinationPipeline::Inline(decoder)) if !postcopy => {
                            let input = sieve.input();
                            let start = input.len();
                            decoder.feed(&chunk, input).context("decoding the stream")?;
                            hash.update(&input[start..]);
                            received += (input.len() - start) as u64;
                            sieve.sieve_input()?
                        }
                        _ => {
                            let qemu_bytes = match &mut decoder {
                                Some(decoder) => {
                                    decoder.feed(&chunk, &mut decoded).await.context("decoding the stream")?;
                                    decoded.split().freeze()
                                }
                                None => chunk,
                            };
                            take_in(&qemu_bytes, &mut received, &mut sieve, &mut hash, &mut gate)?
                        }
                    };
                    if let Err(e) = feeder.push(sieved.bytes, sieved.weight).await {
                        return Err(load_failure(qmp, e).await);
                    }
                }
                Received::Barrier => {}
            },
            // The shards' threads decoded a unit: the rounds it completed go on to QEMU.
            r = async {
                match &mut decoder {
                    Some(decoder) => decoder.next_answer(&mut decoded).await,
                    None => std::future::pending().await,
                }
            } => {
                r.context("decoding the stream")?;
                let qemu_bytes = decoded.split().freeze();
                let sieved = take_in(&qemu_bytes, &mut received, &mut sieve, &mut hash, &mut gate)?;
                if let Err(e) = feeder.push(sieved.bytes, sieved.weight).await {
                    return Err(load_failure(qmp, e).await);
                }
            },
            r = async { switch.as_mut().expect("only when switching").await }, if switch.is_some() => {
                *record_slot = Some(r?);
                switch = None;
            }
            r = &mut disk_apply, if dst_disks.is_some() && disk_applied.is_none() => {
                disk_applied = Some(r.context("applying the disk writes")?);
            }
            msg = control::recv(session) => match msg? {
                Control::End { bytes, digest, preempt } => {
                    end = Some((bytes, digest));
                    preempt_end = preempt;
                }
                Control::DiskEnd { snapshots, digest } => disk_end = Some((snapshots, digest)),
                Control::Checkpoint { bytes, digest } if postcopy => gate.checkpoint(bytes, digest)?,
                Control::Abort { reason } => bail!("the source aborted: {reason}"),
                Control::Lost { reason } if switched => return Err(SourceLost(reason).into()),
                other => bail!("unexpected control message during the stream: {other:?}"),
            },
            _ = tokio::time::sleep(Duration::from_millis(500)) => idle_check(switched)?,
        }
        if gate.open()? {
            switched = true;
            // Postcopy's commit point: everything before the package matched. From here the
            // VM is this host's.
            let committing = record_committing(&dirs.journal, &record)
                .await
                .context("recording the commit")??;
            *record_slot = Some(committing.clone());
            let held = sieve.release()?;
            if let Err(e) = feeder.push(held.bytes, held.weight).await {
                return Err(load_failure(qmp, e).await);
            }
            switch = Some(Box::pin(run_after_switch(
                qmp,
                session,
                &dirs.journal,
                committing,
            )));
        }
        if let Some((bytes, _)) = &end {
            if received > *bytes {
                bail!("received {received} stream bytes, the source announced {bytes}");
            }
        }
    }
    let arrived_unix_us = unix_us();
    if decoder.as_ref().is_some_and(|d| !d.is_idle()) {
        bail!("codec bytes left over after the stream's last byte");
    }
    if let Some(switching) = switch.take() {
        *record_slot = Some(switching.await?);
    }
    drop(switch);
    if gate.has_arrived()
        && !record_slot
            .as_ref()
            .is_some_and(|r| r.state == IncomingState::Committed)
    {
        bail!("the stream ended before the postcopy package was checked");
    }
    if let Err(e) = feeder.finish().await {
        return Err(load_failure(qmp, e).await);
    }
    let (_, source_digest) = end.expect("loop ends with End");
    let digest = hash.hex();
    if digest != source_digest {
        bail!("stream digest mismatch: source {ALGORITHM} {source_digest}, destination {digest}");
    }
    let fed_unix_us = unix_us();
    if gate.has_arrived() {
        // Postcopy: the VM runs here since the switch; now its last page is here too.
        let blocktime = loop {
            let info = qmp.execute(&QueryMigrate).await?;
            match info.status.as_deref() {
                Some("completed") => break info.postcopy_blocktime,
                Some("failed") => bail!(
                    "destination QEMU failed in postcopy: {}",
                    info.error_desc.unwrap_or_default()
                ),
                _ => {}
            }
            idle_check(true)?;
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        if let Some(announced) = &preempt_end {
            let Some(task) = &mut preempt else {
                bail!(
                    "the source carried a postcopy preempt channel this destination did not open"
                );
            };
            let arrived = loop {
                tokio::select! {
                    r = &mut *task => break r.context("the preempt channel's task")??,
                    _ = tokio::time::sleep(Duration::from_millis(500)) => idle_check(true)?,
                }
            };
            preempt::check(announced, &arrived)?;
        }
        tracing::info!(
            "session {}: postcopy: every page has arrived; the vCPUs waited {blocktime:?} ms for pages",
            session.id()
        );
        if let Some(record) = record_slot.take() {
            postcopy_recovery::delivered(&dirs.journal, record);
        }
        return_path.abort();
        drop(qmp_slot.take());
        drop(launched.take());
        let delivered = Control::Delivered {
            fed_unix_us,
            postcopy_blocktime_ms: blocktime,
        };
        if let Err(e) = control::send(session, &delivered).await {
            tracing::warn!("session {}: telling the source failed: {e:#}", session.id());
        }
        let _ =
            tokio::time::timeout(Duration::from_secs(600), session.flushed(control::CONTROL)).await;
        control::park_and_end(session, "postcopy migration complete").await;
        return Ok(());
    }
    tracing::info!(
        "session {}: {} zero-page records left out (the pages were zero here)",
        session.id(),
        sieve.skipped()
    );

    // The commit is recorded before `cont`: a restarted agent resumes a `committing` VM whose
    // QEMU loaded. Without disks it is written while QEMU finishes loading, so that it costs
    // the pause nothing; with disks, once their digests matched too.
    let early = dst_disks
        .is_none()
        .then(|| record_committing(&dirs.journal, &record));
    let checked = async {
    // QEMU must say it loaded the whole stream.
    let loaded_unix_us = loop {
        let info = qmp.execute(&QueryMigrate).await?;
        match info.status.as_deref() {
            Some("completed") => break unix_us(),
            Some("failed") => bail!(
                "destination QEMU failed to load the stream: {}",
                info.error_desc.unwrap_or_default()
            ),
            _ => {}
        }
        idle_check(false)?;
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    // Every disk write the guest saw complete must be here, flushed, and be the source's.
    if let Some(d) = &dst_disks {
        let t0 = std::time::Instant::now();
        let (snapshots, digest) = match disk_applied {
            Some(done) => done,
            None => loop {
                tokio::select! {
                    r = &mut disk_apply => break r.context("applying the disk writes")?,
                    _ = tokio::time::sleep(Duration::from_millis(500)) => idle_check(false)?,
                }
            },
        };
        let Some((source_snapshots, source_digest)) = disk_end else {
            bail!("the stream ended without the source's disk summary (DiskEnd)");
        };
        if (snapshots, &digest) != (source_snapshots, &source_digest) {
            bail!(
                "disk digest mismatch: source {source_snapshots} snapshots, {ALGORITHM} {source_digest}; \
                 destination {snapshots} snapshots, {digest}"
            );
        }
        let applied_ms = t0.elapsed().as_secs_f64() * 1e3;
        d.stop(qmp).await?;
        // The disks hold what the source's held at its pause: from here a bitmap records
        // what changes, for the VM's way back.
        since::mark_arrival(qmp, &d.nodes(), &session.id().to_string()).await;
        tracing::info!(
            applied_ms,
            stopped_ms = t0.elapsed().as_secs_f64() * 1e3,
            "session {}: disks applied, flushed and checked",
            session.id()
        );
    }
    Ok::<_, anyhow::Error>(loaded_unix_us)
    }
    .await;
    // The early record is on disk (or failed) before anything else is written: an abort's
    // record lands after it.
    let early = match early {
        Some(task) => Some(task.await),
        None => None,
    };
    let loaded_unix_us = checked?;
    let mut record = match early {
        Some(written) => written,
        None => record_committing(&dirs.journal, &record).await,
    }
    .context("recording the commit")??;
    // The commit point: digests match and QEMU loaded. From here the source never runs again.
    *record_slot = Some(record.clone());
    if let Err(e) = qmp.execute(&Cont).await {
        // QEMU may have resumed and its answer been lost; if it did not, the VM stays as it
        // is, `committing`, for a restart or the source's question to settle.
        if !qmp.execute(&QueryStatus).await.is_ok_and(|s| s.running) {
            return Err(anyhow::Error::new(e).context("resuming the destination"));
        }
        tracing::warn!("session {}: cont: {e}; the destination runs", session.id());
    }
    record.state = IncomingState::Committed;
    record.updated_unix_ms = now_ms();
    *record_slot = None;
    if let Err(e) = dirs.journal.write_incoming(&record) {
        tracing::error!("session {}: committed; {e:#}", session.id());
    }
    let resume = qmp
        .wait_event("RESUME", |_| true, Duration::from_secs(10))
        .await
        .map_or(0, |e| e.timestamp.as_micros());
    return_path.abort();
    // The VM is this host's now: its monitor is free for others (QEMU serves one client at a
    // time), and one this agent started is listed from here on.
    drop(qmp_slot.take());
    drop(launched.take());
    // Nothing after the commit point may fail the migration: errors only get logged.
    if let Err(e) = control::send(
        session,
        &Control::Committed {
            resume_unix_us: resume,
            switchover: Some(DestinationSwitchover {
                arrived_unix_us,
                fed_unix_us,
                loaded_unix_us,
                zero_pages_skipped: sieve.skipped(),
            }),
        },
    )
    .await
    {
        tracing::warn!(
            "session {}: committed, but telling the source failed: {e:#}",
            session.id()
        );
    }
    // Make sure the source learns it (it waits, paused, until it does).
    let _ = tokio::time::timeout(Duration::from_secs(600), session.flushed(control::CONTROL)).await;
    control::park_and_end(session, "migration committed").await;
    Ok(())
}

/// Postcopy: a keeper for the monitor past this agent's death ([`monitor_keeper`]), when the
/// connection has out-of-band execution (without, it could not recover QEMU anyway).
async fn keep_monitor(qmp: &Qmp) -> Option<monitor_keeper::KeptMonitor> {
    if !qmp.has_oob() {
        return None;
    }
    let kept = async {
        let socket = qmp.duplicate_socket().await?;
        monitor_keeper::keep(socket.as_fd(), qmp.peer_pid())
    }
    .await;
    kept.map_err(|e| {
        tracing::warn!(
            "postcopy: no keeper for the destination QEMU's monitor ({e}): a restart of this \
             agent before the last page arrives would leave the VM paused"
        )
    })
    .ok()
}

/// Postcopy, once QEMU has the package: it loads it (paused, as it was started), the VM resumes
/// here, the record says committed and the source learns it. Returns the record.
async fn run_after_switch(
    qmp: &Qmp,
    session: &Session,
    journal: &Journal,
    mut record: IncomingRecord,
) -> Result<IncomingRecord> {
    postcopy::package_loaded(qmp).await?;
    if let Err(e) = qmp.execute(&Cont).await {
        if !qmp.execute(&QueryStatus).await.is_ok_and(|s| s.running) {
            return Err(
                anyhow::Error::new(e).context("resuming the destination after the postcopy switch")
            );
        }
    }
    record.state = IncomingState::Committed;
    record.postcopy_pending = true;
    record.monitor_keeper = keep_monitor(qmp).await;
    record.updated_unix_ms = now_ms();
    if let Err(e) = journal.write_incoming(&record) {
        tracing::error!("session {}: committed (postcopy); {e:#}", session.id());
    }
    let resume = qmp
        .wait_event("RESUME", |_| true, Duration::from_secs(10))
        .await
        .map_or(0, |e| e.timestamp.as_micros());
    tracing::info!("session {}: postcopy: the VM runs here", session.id());
    control::send(
        session,
        &Control::Committed {
            resume_unix_us: resume,
            switchover: None,
        },
    )
    .await?;
    Ok(record)
}

/// Carries what the destination QEMU says on its migration connection (the return path) to
/// the source QEMU, until either end goes.
pub(crate) fn spawn_return_path(
    mut from_qemu: tokio::net::unix::OwnedReadHalf,
    session: Session,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut buf = BytesMut::with_capacity(64 << 10);
        loop {
            buf.clear();
            match from_qemu.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if session
                        .send(RETURN_PATH, buf.split().freeze())
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
    })
}

/// Writes `record` as `committing`, on a blocking thread; returns it as written.
fn record_committing(
    journal: &Journal,
    record: &IncomingRecord,
) -> tokio::task::JoinHandle<Result<IncomingRecord>> {
    let (journal, mut record) = (journal.clone(), record.clone());
    record.state = IncomingState::Committing;
    record.updated_unix_ms = now_ms();
    tokio::task::spawn_blocking(move || journal.write_incoming(&record).map(|()| record))
}

/// QEMU's bytes rebuilt from the stream channel, on their way to QEMU: counted, sieved, and
/// hashed (cut at the postcopy package's end, whose digest the source's checkpoint carries).
fn take_in(
    qemu_bytes: &[u8],
    received: &mut u64,
    sieve: &mut LoadSieve,
    hash: &mut TreeDigest,
    gate: &mut PackageGate,
) -> Result<Sieved> {
    let before = *received;
    *received += qemu_bytes.len() as u64;
    let sieved = sieve.pass(qemu_bytes)?;
    match sieve.package_end() {
        Some(end) if !gate.has_arrived() => {
            let cut = usize::try_from(end - before).expect("inside these bytes");
            hash.update(&qemu_bytes[..cut]);
            gate.arrived(end, hash.hex())?;
            hash.update(&qemu_bytes[cut..]);
        }
        _ => hash.update(qemu_bytes),
    }
    Ok(sieved)
}

/// Why feeding the destination QEMU failed: QEMU closes its socket on a stream it cannot load,
/// so a write error usually hides QEMU's own reason, which it gives once its migration state
/// reads failed (asked for up to a second); otherwise the write's error.
async fn load_failure(qmp: &Qmp, write_error: anyhow::Error) -> anyhow::Error {
    for _ in 0..20 {
        match qmp.execute(&QueryMigrate).await {
            Ok(info) if info.status.as_deref() == Some("failed") => {
                return anyhow::anyhow!(
                    "destination QEMU failed to load the stream: {}",
                    info.error_desc.unwrap_or_default()
                );
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(_) => break,
        }
    }
    write_error
}

/// Wall-clock microseconds, as QMP's event timestamps.
fn unix_us() -> i64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX)
}

async fn connect_retry(sock: &Path) -> Result<UnixStream> {
    for _ in 0..100 {
        if let Ok(s) = UnixStream::connect(sock).await {
            return Ok(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("destination QEMU does not listen on {}", sock.display())
}
