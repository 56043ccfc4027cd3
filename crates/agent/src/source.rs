//! The source side of a migration: QEMU migrates into a local unix socket; the agent parses
//! the stream (so a construct it does not understand stops the migration instead of being
//! carried blind), hashes it, and sends it over the session; the return path comes back the
//! other way. The commit is the destination's: the source quits its VM only when the
//! destination says it runs, and resumes it on any failure before the stream's end was sent.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::BytesMut;
use ferry_api::agent::{MigrationRequest, MigrationState};
use ferry_api::EventKind;
use ferry_qemu::commands::{
    Capability, Cont, Migrate, MigrateCancel, MigrateSetCapabilities, MigrateSetParameters,
    QueryMemorySizeSummary, QueryMigrate, QueryStatus, Quit,
};
use ferry_qemu::stream::StreamParser;
use ferry_qemu::Qmp;
use ferry_wire::net::{keep_connected, LinkEvent, Peer};
use ferry_wire::tls::ClientConfig;
use ferry_wire::{Received, Session, SessionConfig, SessionId};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio::sync::mpsc;

use crate::control::{self, Control, RETURN_PATH, SEED, STREAM};
use crate::seed_store;
use crate::status::{Events, Shared};
use crate::stream_codec::{self, StreamEncoder, BATCH_BYTES};
use crate::switchover;

/// Stream bytes per frame: small enough that N connections share the stream evenly, large
/// enough that the 20-byte header is noise.
const CHUNK: usize = 64 << 10;
/// auto-converge's first throttle and its steps (QEMU's defaults are 20 and 10; with tailslow
/// the steps after the first follow the dirty rate over the link rate instead).
const THROTTLE_INITIAL_PCT: u8 = 20;
const THROTTLE_INCREMENT_PCT: u8 = 10;
/// The link rate the codec's zstd level assumes when the request does not give one.
const ASSUMED_LINK_MBIT: f64 = 1000.0;

/// Runs one migration to its end and records the outcome in `status`.
pub async fn run(
    req: MigrationRequest,
    status: Shared,
    tls: Arc<ClientConfig>,
    work_dir: PathBuf,
    seed_dir: PathBuf,
) {
    let result = migrate(&req, &status, tls, &work_dir, &seed_dir).await;
    status.update(|s| match result {
        Ok(()) => {
            s.state = MigrationState::Committed;
            s.phase = "committed: the destination runs".into();
        }
        Err(e) => {
            s.state = MigrationState::Failed;
            s.phase = "failed".into();
            s.error = Some(format!("{e:#}"));
            s.event(EventKind::Failed, format!("{e:#}"));
        }
    });
}

async fn migrate(
    req: &MigrationRequest,
    status: &Shared,
    tls: Arc<ClientConfig>,
    work_dir: &Path,
    seed_dir: &Path,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(req.timeout_s);
    let wan_timeout = Duration::from_secs(req.wan_timeout_s);
    let qmp = Arc::new(
        Qmp::connect(&req.source_qmp)
            .await
            .with_context(|| format!("source QMP {}", req.source_qmp.display()))?,
    );
    let st = qmp.execute(&QueryStatus).await?;
    if !st.running {
        bail!("the source VM is not running (QEMU status {:?})", st.status);
    }
    let ram = qmp.execute(&QueryMemorySizeSummary).await?;
    let ram_bytes = ram.base_memory + ram.plugged_memory.unwrap_or(0);
    let history_bytes = stream_codec::history_bytes(ram_bytes);

    // The session and its connections.
    let id = SessionId::random();
    status.update(|s| s.phase = format!("connecting to {} ({})", req.peer, req.peer_name));
    let addr = tokio::net::lookup_host(&req.peer)
        .await
        .with_context(|| format!("peer address {:?}", req.peer))?
        .next()
        .ok_or_else(|| anyhow!("peer address {:?} resolves to nothing", req.peer))?;
    let session = Session::new(id, SessionConfig::default());
    let peer = Peer {
        addr,
        name: req.peer_name.clone(),
        tls,
        connections: req.connections.max(1),
        link_rate_mbit: req.link_rate_mbit,
    };
    let (link_tx, link_rx) = mpsc::unbounded_channel();
    let _connections = keep_connected(session.clone(), peer, Duration::from_millis(500), link_tx);
    tokio::spawn(watch_links(
        link_rx,
        session.clone(),
        status.clone(),
        req.link_rate_mbit,
        req.connections.max(1),
    ));
    let _progress = AbortOnDrop(tokio::spawn(track_progress(
        qmp.clone(),
        session.clone(),
        status.clone(),
        (!req.qemu_switchover_rule).then_some(req.downtime_limit_ms),
        req.link_rate_mbit,
    )));
    let (ctl_tx, mut ctl) = mpsc::unbounded_channel();
    tokio::spawn(read_control(session.clone(), ctl_tx));

    let result = async {
        control::send(
            &session,
            &Control::Prepare {
                vm: req.vm.clone(),
                destination_qmp: req.destination_qmp.clone(),
                wan_timeout_s: req.wan_timeout_s,
                return_path: req.return_path,
                codec: req.codec,
                history_bytes,
                seed_from: req.seed_from.clone(),
            },
        )
        .await?;
        status.update(|s| s.phase = "preparing the destination".into());
        let seed = match watchdog(&session, status, wan_timeout, deadline, ctl.recv()).await? {
            Some(Control::Ready { seed }) => seed,
            Some(Control::Abort { reason }) => bail!("the destination refused: {reason}"),
            other => bail!("unexpected answer to Prepare: {other:?}"),
        };
        let mut encoder = req.codec.any().then(|| {
            let link = req.link_rate_mbit.unwrap_or(ASSUMED_LINK_MBIT);
            StreamEncoder::new(req.codec, history_bytes, link)
        });
        if let (Some(offer), Some(encoder)) = (seed, &mut encoder) {
            status.update(|s| {
                s.phase = format!(
                    "receiving the destination's seed index ({} pages of {:?})",
                    offer.pages, offer.image
                );
            });
            let index = watchdog(
                &session,
                status,
                wan_timeout,
                deadline,
                receive_seed_index(&session, offer.index_bytes),
            )
            .await??;
            encoder.set_seed(index, offer);
        }
        stream(
            req,
            status,
            &qmp,
            &session,
            &mut ctl,
            work_dir,
            encoder,
            wan_timeout,
            deadline,
        )
        .await
    }
    .await;

    let end = match result {
        Ok(end) => end,
        Err(e) => {
            // Before the stream's end went out the destination cannot commit: stop QEMU's
            // migration, tell the destination, resume the source.
            let _ = qmp.execute(&MigrateCancel).await;
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                control::send(
                    &session,
                    &Control::Abort {
                        reason: format!("{e:#}"),
                    },
                ),
            )
            .await;
            let _ = tokio::time::timeout(Duration::from_secs(2), session.flushed(control::CONTROL))
                .await;
            session.fail(format!("{e:#}"));
            ensure_running(&qmp).await?;
            return Err(e.context("the source VM keeps running"));
        }
    };

    // The stream's end and digest are on their way: from here only the destination decides.
    status.update(|s| {
        s.phase = "waiting for the destination's commit".into();
        s.digest = Some(end.clone());
    });
    let verdict = loop {
        tokio::select! {
            msg = ctl.recv() => break msg,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if session.idle_for() > wan_timeout {
                    status.update(|s| s.phase = format!(
                        "in doubt: no contact with the destination for {}s after the stream ended; \
                         the source stays paused until the destination's verdict arrives",
                        session.idle_for().as_secs()));
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
        Some(Control::Committed { resume_unix_us }) => {
            status.update(|s| {
                s.destination_resume_unix_us = Some(resume_unix_us);
                s.event(EventKind::Committed, "destination runs");
            });
            // The destination runs: the source must never run again. Its memory stays here
            // as the seed for the VM's return.
            if req.codec.seed {
                status
                    .update(|s| s.phase = "committed; saving the VM's image for its return".into());
                match seed_store::save(&qmp, seed_dir, &req.vm, ram_bytes).await {
                    Ok(bytes) => {
                        tracing::info!("kept {bytes} bytes of {:?}'s memory for its return", req.vm)
                    }
                    Err(e) => {
                        tracing::warn!("could not keep {:?}'s memory for its return: {e:#}", req.vm)
                    }
                }
            }
            let _ = qmp.execute(&Quit).await;
            session.fail("migration committed");
            Ok(())
        }
        Some(Control::Abort { reason }) => {
            session.fail(reason.clone());
            ensure_running(&qmp).await?;
            bail!("the destination aborted: {reason}; the source VM keeps running")
        }
        other => {
            session.fail("protocol error");
            bail!(
                "unexpected message after the stream ended: {other:?}; the source VM stays paused"
            )
        }
    }
}

/// The destination's seed index: `bytes` bytes on the seed channel.
async fn receive_seed_index(session: &Session, bytes: u64) -> Result<ferry_codec::SeedIndex> {
    let mut index = Vec::new();
    while (index.len() as u64) < bytes {
        match session.recv(SEED).await? {
            Received::Data(piece) => index.extend_from_slice(&piece),
            Received::Barrier => bail!("unexpected barrier on the seed channel"),
        }
    }
    if index.len() as u64 != bytes {
        bail!(
            "the destination announced a {bytes}-byte seed index and sent {}",
            index.len()
        );
    }
    tokio::task::spawn_blocking(move || ferry_codec::SeedIndex::parse(&index))
        .await?
        .context("the destination's seed index")
}

/// Waits for `fut`, failing when the WAN has been down longer than `wan_timeout` or the
/// deadline passes.
async fn watchdog<T>(
    session: &Session,
    status: &Shared,
    wan_timeout: Duration,
    deadline: Instant,
    fut: impl std::future::Future<Output = T>,
) -> Result<T> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            v = &mut fut => return Ok(v),
            _ = tokio::time::sleep(Duration::from_millis(250)) => {
                if session.idle_for() > wan_timeout {
                    bail!("no connection to the destination agent for {}s (the WAN timeout)", wan_timeout.as_secs());
                }
                if Instant::now() > deadline {
                    bail!("the migration's deadline passed");
                }
                if status.cancel_requested() {
                    bail!("cancelled by the user");
                }
                if let Some(reason) = session.failure() {
                    bail!("session failed: {reason}");
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
    mut encoder: Option<StreamEncoder>,
    wan_timeout: Duration,
    deadline: Instant,
) -> Result<String> {
    let sock = work_dir.join(format!("{}.src.sock", session.id()));
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).with_context(|| format!("bind {}", sock.display()))?;
    let _cleanup = RemoveOnDrop(sock.clone());
    set_capabilities(qmp, req).await?;
    qmp.execute(&Migrate {
        uri: format!("unix:{}", sock.display()),
    })
    .await
    .context("source QEMU refused to migrate")?;
    status.update(|s| {
        s.phase = "memory".into();
        s.event(EventKind::MemoryStarted, "");
    });
    let (conn, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .context("QEMU did not connect to the agent's socket within 10s")??;
    let (from_qemu, mut to_qemu) = conn.into_split();

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
    let _abort_rp = AbortOnDrop(return_path);

    let pump = async {
        let mut parser = StreamParser::new();
        let mut input = BytesMut::with_capacity(CHUNK * 2);
        // QEMU's bytes of one item: what both ends hash.
        let mut item_bytes = BytesMut::with_capacity(CHUNK);
        // What goes on the stream channel: QEMU's bytes, or the codec's batches.
        let mut out = BytesMut::with_capacity(CHUNK * 2);
        let mut hash = Sha256::new();
        let mut total = 0u64;
        loop {
            // Take what QEMU has written so far; when it has nothing more right now, send
            // what was parsed even if it is less than a frame: QEMU may be waiting for an
            // answer to it (with the return path on, it sends the device state and then
            // waits for the destination's confirmation before it closes the stream).
            input.reserve(CHUNK);
            let (eof, drained) = match from_qemu.try_read_buf(&mut input) {
                Ok(n) => (n == 0, n == 0),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => (false, true),
                Err(e) => return Err(anyhow::Error::new(e).context("reading QEMU's stream")),
            };
            while let Some(item) = parser.next_item(&mut input)? {
                item_bytes.clear();
                item.encode(&mut item_bytes);
                hash.update(&item_bytes);
                corrupt_for_test(&mut item_bytes, total, req.test_corrupt_at);
                total += item_bytes.len() as u64;
                match &mut encoder {
                    Some(encoder) => {
                        encoder.push(&item, &item_bytes);
                        if encoder.pending() >= BATCH_BYTES {
                            encoder.flush(&mut out);
                        }
                    }
                    None => out.extend_from_slice(&item_bytes),
                }
            }
            if eof {
                parser.finish(input.len()).context("QEMU's stream")?;
            }
            if let (Some(encoder), true) = (&mut encoder, drained) {
                encoder.flush(&mut out);
            }
            while out.len() >= CHUNK || (drained && !out.is_empty()) {
                let chunk = out.split_to(out.len().min(CHUNK)).freeze();
                session.send(STREAM, chunk).await?;
                let report = encoder.as_ref().map(StreamEncoder::report);
                status.update(|s| {
                    s.stream_bytes = total;
                    s.codec = report;
                });
            }
            if eof {
                return Ok::<_, anyhow::Error>((total, format!("{:x}", hash.finalize())));
            }
            if drained {
                from_qemu
                    .readable()
                    .await
                    .context("waiting for QEMU's stream")?;
            }
        }
    };
    let (bytes, sha256) = tokio::select! {
        r = watchdog(session, status, wan_timeout, deadline, pump) => r??,
        msg = ctl.recv() => match msg {
            Some(Control::Abort { reason }) => bail!("the destination aborted: {reason}"),
            other => bail!("unexpected message from the destination during the stream: {other:?}"),
        },
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
        s.event(
            EventKind::StreamEnded,
            format!("{bytes} bytes, sha256 {sha256}, return path {rp} bytes"),
        );
    });
    if !status.close_cancel() {
        bail!("cancelled by the user");
    }
    control::send(
        session,
        &Control::End {
            bytes,
            sha256: sha256.clone(),
        },
    )
    .await?;
    Ok(sha256)
}

/// The test hook: flips a bit of QEMU's bytes at stream offset `at` if it falls in this item
/// (which starts at `start`), after the source hashed it.
fn corrupt_for_test(item: &mut BytesMut, start: u64, at: Option<u64>) {
    if let Some(at) = at.filter(|&at| at >= start && at < start + item.len() as u64) {
        item[usize::try_from(at - start).expect("inside the item")] ^= 0x01;
        tracing::warn!("test hook: flipped a bit of the stream at byte {at}");
    }
}

async fn set_capabilities(qmp: &Qmp, req: &MigrationRequest) -> Result<()> {
    qmp.execute(&control::plain_precopy(req.return_path))
        .await?;
    // Throttling changes nothing in the stream: only the source has it.
    qmp.execute(&MigrateSetCapabilities {
        capabilities: vec![Capability {
            capability: "auto-converge".into(),
            state: req.converge,
        }],
    })
    .await?;
    qmp.execute(&MigrateSetParameters {
        downtime_limit: Some(req.downtime_limit_ms),
        // QEMU's own measurement until the agent steers (an earlier attempt may have set it).
        avail_switchover_bandwidth: Some(0),
        cpu_throttle_initial: req.converge.then_some(THROTTLE_INITIAL_PCT),
        cpu_throttle_increment: req.converge.then_some(THROTTLE_INCREMENT_PCT),
        cpu_throttle_tailslow: req.converge.then_some(true),
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Resumes the source VM after a failed attempt (QEMU resumes it itself after most failures;
/// this covers the rest).
async fn ensure_running(qmp: &Qmp) -> Result<()> {
    for _ in 0..100 {
        let st = qmp.execute(&QueryStatus).await?;
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

/// Copies the transport's counters and QEMU's progress into the status every 100 ms.
/// Keeps the status up to date from QEMU and the session every 100 ms and, with a real
/// downtime target, QEMU's downtime-limit in step with what is in flight
/// ([`crate::switchover`]).
async fn track_progress(
    qmp: Arc<Qmp>,
    session: Session,
    status: Shared,
    target_ms: Option<u64>,
    link_rate_mbit: Option<f64>,
) {
    // What the agent last set: QEMU's downtime-limit and the switchover bandwidth.
    let mut limit: Option<u64> = None;
    let mut rate: Option<u64> = None;
    let mut last = (Instant::now(), 0u64);
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
        let (rtt_ms, resend_cost) = {
            let s = status.get();
            (s.wire.rtt_ms, s.codec.and_then(|c| c.resend_cost))
        };
        if let (Some(target), true, Some(rtt_ms)) = (target_ms, active, rtt_ms) {
            let link = link_rate_mbit.map_or(link_peak, |m| m * 1e6 / 8.0);
            let flight = switchover::flight_ms(wire.unacked_bytes, link, rtt_ms);
            let want_limit = switchover::qemu_limit_ms(target, flight);
            let want_rate = switchover::end_game_rate(link, resend_cost);
            let stale_limit = limit.is_none_or(|l| l.abs_diff(want_limit) >= 5);
            let stale_rate = rate.is_none_or(|r| r.abs_diff(want_rate) * 20 >= r);
            if stale_limit || stale_rate {
                let set = qmp
                    .execute(&MigrateSetParameters {
                        downtime_limit: Some(want_limit),
                        avail_switchover_bandwidth: Some(want_rate),
                        ..Default::default()
                    })
                    .await;
                match set {
                    Ok(_) => (limit, rate) = (Some(want_limit), Some(want_rate)),
                    Err(e) => tracing::warn!(
                        "setting QEMU's downtime-limit to {want_limit} ms at {want_rate} B/s: {e:#}"
                    ),
                }
            }
        }
        status.update(|s| {
            s.wire.bytes_out = wire.wire_bytes_out;
            s.wire.bytes_in = wire.wire_bytes_in;
            s.wire.connections_live = wire.connections_live;
            s.wire.replayed_frames = wire.replayed_frames;
            s.wire.unacked_bytes = wire.unacked_bytes;
            s.qemu_downtime_limit_ms = limit.or(s.qemu_downtime_limit_ms);
            if let Some(info) = info {
                if let Some(pct) = info.cpu_throttle_percentage.filter(|&p| p > 0) {
                    s.max_cpu_throttle_pct = Some(s.max_cpu_throttle_pct.unwrap_or(0).max(pct));
                }
                s.qemu.status = info.status.unwrap_or_default();
                if let Some(ram) = info.ram {
                    s.qemu.transferred = ram.transferred;
                    s.qemu.remaining = ram.remaining;
                    s.qemu.total = ram.total;
                    s.qemu.iteration = ram.dirty_sync_count;
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Forwards control messages into a queue the phases take them from.
async fn read_control(session: Session, tx: mpsc::UnboundedSender<Control>) {
    while let Ok(msg) = control::recv(&session).await {
        if tx.send(msg).is_err() {
            break;
        }
    }
}

/// Records connection events, and sizes the send window from the measured round trip.
async fn watch_links(
    mut rx: mpsc::UnboundedReceiver<LinkEvent>,
    session: Session,
    status: Shared,
    rate_mbit: Option<f64>,
    connections: u32,
) {
    let mut sized = false;
    let mut opened = 0u32;
    while let Some(ev) = rx.recv().await {
        match ev {
            LinkEvent::Connected { connection, rtt } => {
                let rtt_ms = rtt.as_secs_f64() * 1e3;
                if !sized {
                    sized = true;
                    session.set_send_limit(send_window(rate_mbit, rtt_ms));
                }
                opened += 1;
                status.update(|s| {
                    s.wire.rtt_ms = Some(rtt_ms);
                    s.wire.reconnects = opened.saturating_sub(connections);
                    s.event(
                        EventKind::Connected,
                        format!("connection {connection}, rtt {rtt_ms:.1} ms"),
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
    let window = (factor * bdp).clamp(512.0 * 1024.0, 256.0 * 1024.0 * 1024.0) as usize;
    window
}

struct RemoveOnDrop(PathBuf);
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
