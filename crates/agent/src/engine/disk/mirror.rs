//! The source side of disk migration: one NBD server per disk on a unix socket in the agent's
//! work directory, the target of a `blockdev-mirror` (sync=full) in the source QEMU; the
//! transmit buffer they fill; the task that sends its snapshots; the task that takes the
//! destination's acknowledgements.
//!
//! QEMU's mirror copies the allocated part of each disk once (the bulk copy), in the
//! background where the mode allows (a guest write only marks the mirror's bitmap, so none
//! waits for the copy), and in write-blocking mode hands every guest write to the target before
//! completing it. Once it is ready and write-blocking with nothing left (`actively-synced`)
//! the destination has (or will have, once the buffer drains) the whole disk. At the
//! switchover (source paused at `pre-switchover`) `block-job-cancel` completes
//! the mirrors without pivoting, the buffer closes, and its last snapshots go out.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::digest::StreamDigest;
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use ferry_api::agent::{CodecSettings, DiskMode, DiskReport};
use ferry_codec::{AdaptiveCompressor, DiskBase, DiskEncoder, DiskOp};
use ferry_qemu::commands::{
    BlockJobCancel, BlockJobChangeCopyMode, BlockdevAdd, BlockdevDel, BlockdevMirror,
    QueryBlockJobs, QueryCommands, QueryNamedBlockNodes,
};
use ferry_qemu::nbd::{self, proto, Blocks, Export};
use ferry_qemu::Qmp;
use ferry_wire::{Received, Session};
use tokio::net::UnixListener;
use tokio::task::JoinHandle;

use super::backing::backing_of;
use super::buffer::{Extent, TransmitBuffer};
use super::pacing::{pacing_baseline, BulkGate, GuestIo, Pacer, Pacing, MIRROR_CHUNK};
use super::since::{self, BitmapExports, BitmapView};
use super::SentDigests;
use super::{
    codec_options, digest_so_far, disk_frame_zstd, hash_op, parse_ack, split_write, Frame,
    FRAME_RECORDS,
};
use super::{LAST_OF_ALL, LAST_OF_SNAPSHOT};
use crate::engine::control::{DiskPlan, ImageShape, DISK, DISK_ACK};
use crate::engine::status::Shared;
use crate::engine::stream_codec::count_level;

/// The smallest buffer in the memory phase: a few of QEMU's 64 KiB mirror chunks.
const MIN_MEMORY_PHASE_BUFFER: u64 = 256 << 10;

/// The transmit buffer's bound in the memory phase: what a link of `rate_mbit` drains in a
/// third of the downtime target (what is buffered at the pause crosses within the pause).
pub fn memory_phase_buffer(rate_mbit: f64, downtime_ms: u64) -> u64 {
    let drain = rate_mbit * 1e6 / 8.0 * downtime_ms as f64 / 3000.0;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    (drain as u64).max(MIN_MEMORY_PHASE_BUFFER)
}

/// What QEMU's mirror writes into: one disk's view of the shared transmit buffer.
pub(super) struct MirrorTarget {
    pub buffer: Arc<TransmitBuffer>,
    pub disk: u8,
    /// A flush is the disks' commit point (libvirt's relay): it always waits until the
    /// destination applied everything before it and fails when that did not happen. Otherwise
    /// (ferry's own mirror, which commits at `DiskEnd`) waits happen in synchronous mode only
    /// and are released when the migration ends: the source's own disk holds the write and
    /// the source keeps running on it.
    pub flush_commits: bool,
    /// libvirt's path: the bulk copy's writes (whole [`MIRROR_CHUNK`]s) pass this gate first
    /// (pacing by the guest's IO, where the mirror's job speed is libvirt's).
    pub bulk_gate: Option<Arc<BulkGate>>,
}

impl MirrorTarget {
    /// Buffers `what`; in synchronous mode also waits until the destination applied it.
    async fn put(&self, offset: u64, len: u64, what: Extent) -> Result<(), u32> {
        let seq = self.buffer.put(self.disk, offset, len, what).await;
        let Ok(seq) = seq else {
            return self.refused();
        };
        if self.buffer.is_synchronous() {
            self.applied(seq).await?;
        }
        Ok(())
    }

    /// A write or flush the closed buffer refused. After a failure it is answered as done, as
    /// a released synchronous write is: the target is being discarded, and an error would send
    /// QEMU's mirror down its target-error path while it is being force-cancelled. Closed at
    /// the switchover (no write may come once the mirror completed), or where a flush commits,
    /// it is an error.
    fn refused(&self) -> Result<(), u32> {
        if self.buffer.is_abandoned() && !self.flush_commits {
            return Ok(());
        }
        Err(proto::ESHUTDOWN)
    }

    /// Waits until snapshot `seq` was applied at the destination, or the migration ended
    /// (an error only where a flush commits).
    async fn applied(&self, seq: u64) -> Result<(), u32> {
        if self.buffer.wait_applied(seq).await.is_none() {
            if self.flush_commits {
                return Err(proto::EIO);
            }
            tracing::debug!(seq, "a synchronous write released: the migration ended");
        }
        Ok(())
    }
}

impl Blocks for MirrorTarget {
    async fn write(&self, offset: u64, data: Bytes) -> Result<(), u32> {
        let len = data.len() as u64;
        if let Some(gate) = self.bulk_gate.as_ref().filter(|_| len >= MIRROR_CHUNK) {
            gate.admit(len).await;
        }
        self.put(offset, len, Extent::Data(data)).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> Result<(), u32> {
        self.put(offset, len, Extent::Zeroes { may_trim }).await
    }

    async fn trim(&self, offset: u64, len: u64) -> Result<(), u32> {
        self.put(offset, len, Extent::Trim).await
    }

    /// Asynchronous: the source's own disk holds the data (QEMU flushes it); the destination's
    /// copy is made durable before it resumes. Synchronous, or where the flush commits: the
    /// destination applied and flushed everything before it, digests matching.
    async fn flush(&self) -> Result<(), u32> {
        let Ok(seq) = self.buffer.flush(self.disk) else {
            return self.refused();
        };
        if self.flush_commits || self.buffer.is_synchronous() {
            self.applied(seq).await?;
        }
        Ok(())
    }
}

/// How the disks of one migration are carried.
#[derive(Debug, Clone, Copy)]
pub struct DiskSettings {
    pub mode: DiskMode,
    /// The transmit buffer's bound during the bulk copy.
    pub buffer_bytes: u64,
    pub codec: CodecSettings,
    /// The link's rate, for the frames' zstd level.
    pub link_rate_mbit: f64,
    /// Test hook: see `MigrationSettings::test_corrupt_disk_at`.
    pub corrupt_at: Option<u64>,
    /// Async and cloudnet: the bulk copy in the background, write-blocking once it is done.
    pub background_copy: bool,
    /// How long a background copy may come no closer to done ([`BACKGROUND_STALL`]).
    pub stall_after: Duration,
    /// Pace a background copy by the guest's IO, down to this share of its unpaced rate.
    pub pacing_floor: Option<f64>,
    /// The guest's disk counters some time before the copy (pacing's baseline).
    pub io_before: Option<(Instant, GuestIo)>,
}

/// An older copy of the disks at the destination, and how the source knows what it holds.
pub enum OlderCopy {
    /// Indexed by content there (CloudNet's follow the sun).
    Index(DiskBase),
    /// Its index as it was kept when the VM left there, its image untouched since
    /// ([`crate::disk_memory`]).
    Remembered(DiskBase),
    /// Untouched since the VM left it: what changed since is in the source's dirty bitmaps.
    Since(BitmapView),
}

/// What the sender knows of the destination's older copy when it starts sending: on ferry's
/// own path before the copy starts, on libvirt's ([`super::relay`]) once the destination has
/// indexed the export QEMU's mirror chose.
#[derive(Default)]
pub struct Known {
    pub base: Option<OlderCopy>,
    /// Why it was indexed rather than matched by bitmap.
    pub note: Option<String>,
    pub index_ms: Option<u64>,
    /// With no older copy: a view of the destination's disk as it starts (all zeros), which
    /// the sender follows as the copy writes it. A relay keeps its final state for the
    /// domain's return ([`Sent::view`]).
    pub follow: Option<DiskBase>,
}

/// What the disk sender sent, once the buffer closed and everything went.
pub struct Sent {
    pub snapshots: u64,
    /// The operations' digest.
    pub digest: String,
    /// What the destination's disk now holds, block by block, as the sender saw it write
    /// there: the index it had, or the view it followed. None: neither.
    pub view: Option<DiskBase>,
}

/// What the destination said it already holds.
#[derive(Default)]
pub struct AtDestination {
    pub base: Option<OlderCopy>,
    /// Why an older copy there was indexed rather than matched by bitmap, and the index's time.
    pub base_note: Option<String>,
    pub index_ms: Option<u64>,
    /// The source QEMU's exports of its bitmaps (closed in the pause or on failure).
    pub exports: Option<BitmapExports>,
    /// Per disk: the same backing image, under a fresh overlay (copy the overlay only).
    pub top_only: Vec<bool>,
    /// Images the destination made (it had none).
    pub images_made: u32,
    /// The backing layers it lacked, sent before it made them.
    pub layers: super::layers::Shipped,
}

/// How the bulk copy went, once it is done.
pub struct Ready {
    /// What to say of it (empty: nothing unusual).
    pub note: String,
    /// How long pacing held it below its unpaced rate; None: not paced.
    pub paced: Option<Duration>,
}

/// The disks of one migration, source side.
pub struct SourceDisks {
    pub buffer: Arc<TransmitBuffer>,
    nodes: Vec<String>,
    mode: DiskMode,
    /// The mirrors copy in the background until they are ready.
    background: bool,
    stall_after: Duration,
    pacing_floor: Option<f64>,
    /// The guest's disk counters before the copy and at its start (pacing's baseline).
    baseline: Option<[(Instant, GuestIo); 2]>,
    sockets: Vec<PathBuf>,
    servers: Vec<JoinHandle<()>>,
    acks: JoinHandle<()>,
    sender: Option<JoinHandle<Result<Sent>>>,
    exports: Option<BitmapExports>,
    /// The session's id: the name of the bitmap that marks the copy left here.
    session: String,
}

/// A background copy's mirror marks what the guest rewrites by 4 KiB (QEMU's 64 KiB default
/// would copy a guest's 4 KiB write 16 times over).
const BACKGROUND_GRANULARITY: u64 = 4096;
// The mirror's window (`buf-size`: what a pass claims and holds in flight) stays QEMU's 16 MiB:
// with a smaller one (2 MiB was tried) QEMU 10.0.2 crashed on a cancelled copy, 2 times in 10.
// A copy op that waits for buffer room is not yet counted in flight (`mirror_co_read`), so a
// cancelled job can free its buffer under it; at 16 MiB its 16 ops of 1 MiB all fit and none
// waits.
/// A background copy that comes no closer to done for this long does not converge (the guest
/// rewrites blocks faster than the link carries them): the mirror turns write-blocking, which
/// slows the guest's writes to the link.
pub const BACKGROUND_STALL: Duration = Duration::from_secs(10);

/// Whether a background copy's progress has stopped: no new low of the bytes left for
/// `after`.
struct Stall {
    after: Duration,
    low: Option<(u64, Instant)>,
    sent: Option<u64>,
}

impl Stall {
    fn new(after: Duration) -> Stall {
        Stall {
            after,
            low: None,
            sent: None,
        }
    }

    /// `sent`: the bytes the disk sender has handed to the WAN so far. While it sends nothing
    /// (the WAN is down, or slower than ever) the copy cannot progress whatever the guest
    /// does: that is not the guest's doing, and the wait starts again.
    fn stalled(&mut self, left: u64, sent: u64, now: Instant) -> bool {
        // No wait at all (a test's hook): any copy is taken for stalled at once.
        if self.after.is_zero() {
            return true;
        }
        let link_idle = self.sent == Some(sent);
        self.sent = Some(sent);
        if link_idle {
            if let Some((low, _)) = self.low {
                self.low = Some((low.min(left), now));
            }
            return false;
        }
        match self.low {
            Some((low, _)) if left >= low => {}
            // Before QEMU has counted the blocks to copy (while it zeroes the target) there is
            // no progress to judge.
            _ if left == 0 => return false,
            _ => self.low = Some((left, now)),
        }
        self.low
            .is_some_and(|(_, since)| now.duration_since(since) >= self.after)
    }
}

/// The bytes a mirror job has left to copy now.
async fn job_left(qmp: &Qmp, job: &str) -> Result<u64> {
    let jobs = qmp.execute(&QueryBlockJobs).await?;
    Ok(jobs
        .iter()
        .find(|j| j.device == job)
        .map_or(0, |j| j.len.saturating_sub(j.offset)))
}

/// Whether this QEMU can turn a background mirror write-blocking (`block-job-change`, 8.2+).
async fn can_change_copy_mode(qmp: &Qmp) -> bool {
    match qmp.execute(&QueryCommands).await {
        Ok(commands) => commands.iter().any(|c| c.name == "block-job-change"),
        Err(e) => {
            tracing::warn!("query-commands failed ({e}); the disks are copied write-blocking");
            false
        }
    }
}

/// Whichever QMP command of the disk copy first finds QEMU's socket closed (starting a mirror,
/// polling a job), the reason is the same.
fn name_a_lost_qemu(qmp: &Qmp, e: anyhow::Error) -> anyhow::Error {
    if qmp.is_closed() {
        e.context("the source QEMU went away during the disk copy")
    } else {
        e
    }
}

pub(super) fn job_id(node: &str) -> String {
    format!("ferry-mirror-{node}")
}

fn target_node(node: &str) -> String {
    format!("ferry-target-{node}")
}

/// The size of each node, from the source QEMU, in the order given.
pub async fn plan(qmp: &Qmp, nodes: &[String]) -> Result<Vec<DiskPlan>> {
    if nodes.len() > 255 {
        bail!("{} disks: at most 255 can move with one VM", nodes.len());
    }
    let known = qmp.execute(&QueryNamedBlockNodes { flat: true }).await?;
    nodes
        .iter()
        .map(|node| {
            let found = known
                .iter()
                .find(|n| &n.node_name == node)
                .with_context(|| {
                    let names: Vec<&str> = known.iter().map(|n| n.node_name.as_str()).collect();
                    format!("the source QEMU has no block node {node:?} (it has {names:?})")
                })?;
            Ok(DiskPlan {
                node: node.clone(),
                size: found.image.virtual_size,
                backing_sha256: None,
                tracked_since: Vec::new(),
                layers: Vec::new(),
                image: found.image.format.clone().map(|format| ImageShape {
                    format,
                    backing: found.image.backing_filename.clone(),
                    backing_format: found.image.backing_filename_format.clone(),
                }),
            })
        })
        .collect()
}

/// Adds the backing chains to the plans (SnapMig: the destination may hold them, or some of
/// their files). Returns each plan's files, for a destination that asks for some of them.
pub async fn add_backing(qmp: &Qmp, plans: &mut [DiskPlan]) -> Result<Vec<Vec<PathBuf>>> {
    let mut files = Vec::with_capacity(plans.len());
    for plan in plans {
        let chain = backing_of(qmp, &plan.node).await?;
        plan.backing_sha256 = chain.as_ref().map(|c| c.digest.clone());
        let (layers, here) = chain.map(|c| (c.layers, c.files)).unwrap_or_default();
        plan.layers = layers;
        files.push(here);
    }
    Ok(files)
}

impl SourceDisks {
    /// Starts the NBD targets, the sender and the mirrors. On error, whatever was started is
    /// stopped again ([`SourceDisks::abort`] is not needed).
    pub async fn start(
        qmp: &Qmp,
        session: &Session,
        work_dir: &Path,
        plans: &[DiskPlan],
        settings: DiskSettings,
        there: AtDestination,
        status: Shared,
    ) -> Result<SourceDisks> {
        let AtDestination {
            base,
            base_note,
            index_ms,
            exports,
            top_only,
            images_made,
            layers,
        } = there;
        let top_only = &top_only[..];
        let DiskSettings {
            mode,
            buffer_bytes,
            codec,
            link_rate_mbit,
            corrupt_at,
            background_copy,
            stall_after,
            pacing_floor,
            io_before,
        } = settings;
        // Synchronous mode's promise (a write completes once the destination has it) holds
        // from the start, so only the other modes copy in the background.
        let background =
            background_copy && mode != DiskMode::Sync && can_change_copy_mode(qmp).await;
        let buffer = Arc::new(TransmitBuffer::new(buffer_bytes, mode == DiskMode::Sync));
        let mut servers = Vec::new();
        let mut sockets = Vec::new();
        for (i, plan) in plans.iter().enumerate() {
            let sock = work_dir.join(format!("{}.disk{i}.sock", session.id()));
            let _ = std::fs::remove_file(&sock);
            let listener = match UnixListener::bind(&sock) {
                Ok(l) => l,
                Err(e) => {
                    servers.iter().for_each(JoinHandle::abort);
                    if let Some(x) = &exports {
                        x.close(qmp).await;
                    }
                    return Err(e).with_context(|| format!("bind {}", sock.display()));
                }
            };
            let target = Arc::new(MirrorTarget {
                buffer: buffer.clone(),
                disk: u8::try_from(i).expect("at most 255 disks"),
                flush_commits: false,
                bulk_gate: None,
            });
            let export = Export {
                name: plan.node.clone(),
                size: plan.size,
                write_zeroes: true,
            };
            servers.push(tokio::spawn(serve_mirror(listener, export, target)));
            sockets.push(sock);
        }
        let report = DiskReport {
            mode,
            disks: u32::try_from(plans.len()).expect("at most 255 disks"),
            overlay_only: u32::try_from(top_only.iter().filter(|t| **t).count())
                .expect("at most 255 disks"),
            images_made,
            layers_shipped: layers.layers,
            layer_bytes: layers.bytes,
            copy: Some(
                if background {
                    "background"
                } else {
                    "write-blocking"
                }
                .to_owned(),
            ),
            ..DiskReport::default()
        };
        // With an older copy at the destination, the mirror must not zero the target first
        // (it does when the target can zero cheaply, `discard=unmap`): it copies every block,
        // and the ones the destination holds go as SAME.
        let zero_first = base.is_none();
        let known = Known {
            base,
            note: base_note,
            index_ms,
            follow: None,
        };
        let (acks, sender) = start_channel(
            Sending {
                buffer: buffer.clone(),
                session: session.clone(),
                codec,
                link_rate_mbit,
                report,
                status,
                corrupt_at,
            },
            std::future::ready(known),
        );
        let baseline = match (pacing_floor.filter(|_| background), io_before) {
            (Some(_), Some(before)) => pacing_baseline(qmp, before).await,
            _ => None,
        };
        let mut disks = SourceDisks {
            buffer,
            nodes: plans.iter().map(|p| p.node.clone()).collect(),
            mode,
            background,
            stall_after,
            pacing_floor,
            baseline,
            sockets,
            servers,
            acks,
            sender: Some(sender),
            exports,
            session: session.id().to_string(),
        };
        if let Err(e) = disks.start_mirrors(qmp, zero_first, top_only).await {
            disks.abort(qmp).await;
            return Err(name_a_lost_qemu(qmp, e));
        }
        Ok(disks)
    }

    async fn start_mirrors(&self, qmp: &Qmp, zero_first: bool, top_only: &[bool]) -> Result<()> {
        for (i, (node, sock)) in self.nodes.iter().zip(&self.sockets).enumerate() {
            // SnapMig: the destination holds the backing image; copy the overlay only.
            let top = top_only.get(i).copied().unwrap_or(false);
            // A target node an earlier attempt left (its agent killed, its record lost) would
            // take the name; QEMU refuses to remove one a job still uses.
            let _ = qmp
                .execute(&BlockdevDel {
                    node_name: target_node(node),
                })
                .await;
            qmp.execute(&BlockdevAdd(serde_json::json!({
                "driver": "nbd",
                "node-name": target_node(node),
                "export": node,
                "server": {"type": "unix", "path": sock},
                // Zeroing through the target is cheap (a record on the WAN), so let the
                // mirror zero it all first and then copy only the allocated parts.
                "discard": if zero_first { "unmap" } else { "ignore" },
            })))
            .await
            .with_context(|| {
                format!("connecting the source QEMU to ferry's NBD target for {node}")
            })?;
            let mut mirror = BlockdevMirror {
                job_id: job_id(node),
                device: node.clone(),
                target: target_node(node),
                sync: if top { "top" } else { "full" }.into(),
                copy_mode: Some("write-blocking".into()),
                granularity: None,
            };
            if self.background {
                mirror.copy_mode = Some("background".into());
                mirror.granularity = Some(BACKGROUND_GRANULARITY);
            }
            qmp.execute(&mirror)
                .await
                .with_context(|| format!("starting the mirror of {node}"))?;
        }
        Ok(())
    }

    /// Waits until every mirror is ready (its bulk copy is in the buffer) and write-blocking
    /// (every guest write reaches the buffer), and then until the buffer holds at most
    /// `memory_bound` (the memory phase's bound: a cut below what it holds would stall the
    /// guest's writes until the difference crossed). Cancel-safe.
    /// Returns what to say of the copy (a background copy that stalled or was paced).
    pub async fn wait_ready(&self, qmp: &Qmp, memory_bound: Option<u64>) -> Result<Ready> {
        self.wait_ready_or_fail(qmp, memory_bound)
            .await
            .map_err(|e| name_a_lost_qemu(qmp, e))
    }

    async fn wait_ready_or_fail(&self, qmp: &Qmp, memory_bound: Option<u64>) -> Result<Ready> {
        let mut notes = Vec::new();
        let mut paced = None;
        let mut blocking = !self.background;
        let mut pacing = self.pacing();
        for node in &self.nodes {
            let job = job_id(node);
            let mut stall = Stall::new(self.stall_after);
            loop {
                if !blocking {
                    if let Some(p) = &mut pacing {
                        p.look(qmp, &self.nodes, self.buffer.sent_total()).await?;
                    }
                    let left = job_left(qmp, &job).await?;
                    if stall.stalled(left, self.buffer.sent_total(), Instant::now()) {
                        tracing::warn!(
                            node,
                            left_bytes = left,
                            "the background disk copy came no closer to done in {:?} (the \
                             guest writes faster than the link carries): its writes now wait \
                             for the copy",
                            self.stall_after
                        );
                        self.write_blocking(qmp).await?;
                        if let Some(p) = &mut pacing {
                            p.end(qmp, &self.nodes).await?;
                        }
                        blocking = true;
                        notes.push(format!(
                            "the background copy stalled with {left} bytes left: write-blocking \
                             from then on"
                        ));
                    }
                }
                if qmp
                    .wait_event(
                        "BLOCK_JOB_READY",
                        |v| v["device"] == job.as_str(),
                        Duration::from_millis(200),
                    )
                    .await
                    .is_some()
                {
                    break;
                }
                if let Some(e) =
                    qmp.find_event("BLOCK_JOB_COMPLETED", |v| v["device"] == job.as_str())
                {
                    bail!("the mirror of {node} ended before it was ready: {}", e.data);
                }
                if qmp.is_closed() {
                    bail!("its QMP socket closed");
                }
            }
        }
        if !blocking {
            self.write_blocking(qmp).await?;
        }
        if let Some(mut p) = pacing {
            // Nothing is paced once the bulk copy is done: what is left is the guest's own.
            p.end(qmp, &self.nodes).await?;
            notes.extend(p.pacer.summary());
            paced = Some(p.pacer.paced());
        }
        if self.background {
            self.wait_actively_synced(qmp).await?;
        }
        if let Some(bound) = memory_bound {
            self.buffer.drain_to(bound).await;
        }
        Ok(Ready {
            note: notes.join("; "),
            paced,
        })
    }

    /// The pacing of a background copy, if asked for and the guest uses its disks enough to
    /// judge.
    fn pacing(&self) -> Option<Pacing> {
        let floor = self.pacing_floor?;
        let [before, at_start] = self.baseline?;
        let pacer = Pacer::new(before, at_start, floor);
        if !pacer.active() {
            tracing::info!("the guest barely uses its disks: the disk copy is not paced");
            return None;
        }
        Some(Pacing::new(pacer))
    }

    /// Turns every mirror write-blocking.
    async fn write_blocking(&self, qmp: &Qmp) -> Result<()> {
        for node in &self.nodes {
            qmp.execute(&BlockJobChangeCopyMode {
                id: job_id(node),
                job_type: "mirror",
                copy_mode: "write-blocking".into(),
            })
            .await
            .with_context(|| format!("turning the mirror of {node} write-blocking"))?;
        }
        Ok(())
    }

    /// Waits until every mirror is write-blocking with nothing left to copy: from then on
    /// each guest write reaches the buffer before it completes (QEMU has no event for it).
    async fn wait_actively_synced(&self, qmp: &Qmp) -> Result<()> {
        let t0 = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            tick.tick().await;
            let jobs = qmp.execute(&QueryBlockJobs).await?;
            let mut synced = 0;
            for node in &self.nodes {
                let job = job_id(node);
                let Some(info) = jobs.iter().find(|j| j.device == job) else {
                    let why = qmp
                        .find_event("BLOCK_JOB_COMPLETED", |v| v["device"] == job.as_str())
                        .map_or_else(|| "no reason given".to_owned(), |e| e.data.to_string());
                    bail!("the mirror of {node} ended before it was in step with the guest: {why}");
                };
                synced += usize::from(info.actively_synced);
            }
            if synced == self.nodes.len() {
                tracing::info!(
                    took_ms = t0.elapsed().as_millis(),
                    "the disk mirrors are write-blocking and in step with the guest"
                );
                return Ok(());
            }
        }
    }

    /// The memory phase begins. CloudNet's schedule turns synchronous here. Asynchronous
    /// mirroring keeps going, with the buffer cut to what the link drains in a third of the
    /// downtime target: what is buffered at the pause must cross before the destination
    /// resumes, so a guest that writes faster than the link is slowed to it from now on.
    pub fn memory_phase(&self, link_rate_mbit: Option<f64>, downtime_ms: u64) {
        match self.mode {
            DiskMode::Cloudnet => self.buffer.set_synchronous(true),
            DiskMode::Async => {
                if let Some(rate) = link_rate_mbit {
                    self.buffer
                        .set_limit(memory_phase_buffer(rate, downtime_ms));
                }
            }
            DiskMode::Sync => {}
        }
    }

    /// At the switchover (the VM is paused): completes the mirrors without pivoting, closes
    /// the buffer, and waits until every snapshot went to the session. Returns the number of
    /// snapshots and the operations' digest for [`crate::engine::control::Control::DiskEnd`].
    pub async fn finish(&mut self, qmp: &Qmp) -> Result<(u64, String)> {
        let t0 = std::time::Instant::now();
        for node in &self.nodes {
            let job = job_id(node);
            qmp.execute(&BlockJobCancel {
                device: job.clone(),
                force: false,
            })
            .await
            .with_context(|| format!("completing the mirror of {node}"))?;
            let done = qmp
                .wait_event(
                    "BLOCK_JOB_COMPLETED",
                    |v| v["device"] == job.as_str(),
                    Duration::from_secs(60),
                )
                .await
                .with_context(|| format!("the mirror of {node} did not complete within 60s"))?;
            if let Some(err) = done.data.get("error").and_then(|e| e.as_str()) {
                bail!("the mirror of {node} failed: {err}");
            }
        }
        let completed_ms = t0.elapsed().as_secs_f64() * 1e3;
        let held = self.buffer.stats().held;
        self.buffer.close();
        let sender = self.sender.take().expect("finish runs once");
        let sent = sender.await.context("the disk sender task")??;
        let result = (sent.snapshots, sent.digest);
        tracing::info!(
            completed_ms,
            held_bytes = held,
            sent_ms = t0.elapsed().as_secs_f64() * 1e3,
            "disk mirrors completed at the switchover; the buffer went out"
        );
        remove_targets(qmp, &self.nodes).await;
        if let Some(e) = self.exports.take() {
            e.close(qmp).await;
        }
        // Nothing may hold a persistent bitmap busy when QEMU completes the migration.
        since::none_busy(qmp, &self.nodes).await?;
        // The copy left here is the VM's until this migration fails: marked, a return finds
        // it untouched.
        since::mark_departure(qmp, &self.nodes, &self.session).await;
        tracing::info!(
            pause_work_ms = t0.elapsed().as_secs_f64() * 1e3,
            "the bitmap exports closed and the copy left here marked"
        );
        Ok(result)
    }

    /// Stops everything (the migration failed): the mirrors are abandoned, the source QEMU's
    /// disks are untouched, the guest's writes that wait on the destination are released.
    pub async fn abort(&mut self, qmp: &Qmp) {
        // The buffer first: a mirror cannot end while its writes wait for room in it.
        self.buffer.abandon();
        self.buffer.stop_acknowledging();
        if let Some(s) = self.sender.take() {
            s.abort();
        }
        cancel_mirrors(qmp, &self.nodes).await;
        remove_targets(qmp, &self.nodes).await;
        if let Some(e) = self.exports.take() {
            e.close(qmp).await;
        }
        // Also what a close cut short left (a failure in the middle of `finish`).
        since::abandon_exports(qmp, &self.nodes).await;
        since::unmark_departure(qmp, &self.nodes, &self.session).await;
    }
}

/// Abandons what a migration of `nodes` left in the source QEMU (its agent went in the middle):
/// the mirrors, which fail once their NBD target is gone, and the target nodes, whose names a
/// later migration of the same disks needs. The guest's disks are untouched.
pub async fn abandon(qmp: &Qmp, nodes: &[String]) {
    cancel_mirrors(qmp, nodes).await;
    remove_targets(qmp, nodes).await;
    since::abandon_exports(qmp, nodes).await;
}

/// Cancels the mirrors of `nodes` and waits (up to 10 s) until QEMU has none of them: their
/// target nodes can go only then.
async fn cancel_mirrors(qmp: &Qmp, nodes: &[String]) {
    let jobs: Vec<String> = nodes.iter().map(|n| job_id(n)).collect();
    for job in &jobs {
        // A job already gone (failed once its target went) is refused: nothing to do.
        let _ = qmp
            .execute(&BlockJobCancel {
                device: job.clone(),
                force: true,
            })
            .await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        let Ok(running) = qmp.execute(&QueryBlockJobs).await else {
            return;
        };
        if !running.iter().any(|j| jobs.contains(&j.device)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::warn!("the mirrors {jobs:?} did not end within 10 s of their cancel");
}

async fn remove_targets(qmp: &Qmp, nodes: &[String]) {
    for node in nodes {
        let _ = qmp
            .execute(&BlockdevDel {
                node_name: target_node(node),
            })
            .await;
    }
}

impl Drop for SourceDisks {
    fn drop(&mut self) {
        for s in &self.servers {
            s.abort();
        }
        self.acks.abort();
        if let Some(s) = &self.sender {
            s.abort();
        }
        for sock in &self.sockets {
            let _ = std::fs::remove_file(sock);
        }
    }
}

/// Serves QEMU's NBD client, again if it reconnects.
async fn serve_mirror(listener: UnixListener, export: Export, target: Arc<MirrorTarget>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        match nbd::serve(stream, &export, target.clone()).await {
            Ok(end) => tracing::debug!(export = export.name, ?end, "mirror connection ended"),
            Err(e) => tracing::warn!(export = export.name, "mirror connection failed: {e}"),
        }
    }
}

/// The disk channel's source end: the task that sends the buffer's snapshots and the task
/// that takes the destination's acknowledgements, sharing the digests sent.
pub(super) fn start_channel(
    sending: Sending,
    known: impl Future<Output = Known> + Send + 'static,
) -> (JoinHandle<()>, JoinHandle<Result<Sent>>) {
    let digests = Arc::new(SentDigests::default());
    let acks = tokio::spawn(take_acks(
        sending.session.clone(),
        sending.buffer.clone(),
        digests.clone(),
    ));
    let session = sending.session.clone();
    let sender = tokio::spawn(async move {
        let sent = send_snapshots(sending, digests, known.await).await;
        // Nothing would empty the buffer any more: the mirror would wait for room, and the
        // migration for the mirror, until its deadline. The session's failure ends it now.
        if let Err(e) = &sent {
            session.fail(format!("the disk sender stopped: {e:#}"));
        }
        sent
    });
    (acks, sender)
}

/// Takes the destination's acknowledgements: a snapshot counts as applied once the digest
/// through it matches what was sent.
async fn take_acks(session: Session, buffer: Arc<TransmitBuffer>, digests: Arc<SentDigests>) {
    while let Ok(Received::Data(b)) = session.recv(DISK_ACK).await {
        match parse_ack(&b).and_then(|(applied, digest)| {
            digests.check(applied, &digest)?;
            Ok(applied)
        }) {
            Ok(applied) => buffer.applied(applied),
            Err(e) => {
                session.fail(format!("from the destination: {e}"));
                break;
            }
        }
    }
    buffer.stop_acknowledging();
}

/// Test hook: flips one bit of `data`, which starts at `start` of the data sent, if `at`
/// falls inside it.
fn flip_for_test(data: &mut [u8], start: u64, at: Option<u64>) {
    if let Some(at) = at.filter(|&at| at >= start && at < start + data.len() as u64) {
        data[usize::try_from(at - start).expect("inside the write")] ^= 0x01;
        tracing::warn!("test hook: flipped a bit of the disk data at byte {at}");
    }
}

/// What the disk sender needs: the buffer it empties, the session it sends on, how it codes
/// and where it reports.
pub(super) struct Sending {
    pub buffer: Arc<TransmitBuffer>,
    pub session: Session,
    pub codec: CodecSettings,
    /// The link's rate, for the frames' zstd level.
    pub link_rate_mbit: f64,
    pub report: DiskReport,
    pub status: Shared,
    /// Test hook: flip a bit of the written data at this offset (after it was hashed).
    pub corrupt_at: Option<u64>,
}

/// Sends snapshots until the buffer closes, keeping each one's digest in `digests`.
async fn send_snapshots(sending: Sending, digests: Arc<SentDigests>, known: Known) -> Result<Sent> {
    let Sending {
        buffer,
        session,
        codec,
        link_rate_mbit,
        mut report,
        status,
        corrupt_at,
    } = sending;
    let Known {
        mut base,
        note,
        index_ms,
        mut follow,
    } = known;
    report.older_copy = base.as_ref().map(|b| {
        match b {
            OlderCopy::Index(_) => "index",
            OlderCopy::Remembered(_) => "remembered",
            OlderCopy::Since(_) => "bitmap",
        }
        .to_owned()
    });
    report.older_copy_note = note;
    report.index_ms = index_ms;
    let mut data_sent = 0u64;
    let mut encoder = DiskEncoder::new(codec_options(codec));
    let mut zstd = disk_frame_zstd(codec, link_rate_mbit);
    let mut hash = StreamDigest::new();
    let mut count = 0u64;
    let mut records = Vec::with_capacity(FRAME_RECORDS + (1 << 20));
    while let Some(snap) = buffer.take().await {
        let (seq, bytes) = (snap.seq, snap.bytes());
        let ops: Vec<DiskOp> = match &mut base {
            Some(OlderCopy::Index(base) | OlderCopy::Remembered(base)) => {
                let mut out = Vec::new();
                for op in snap.into_ops() {
                    base.filter(op, &mut out);
                }
                report.same_bytes = base.same_bytes;
                out
            }
            Some(OlderCopy::Since(view)) => {
                let out = view.filter(snap.into_ops().collect()).await?;
                report.same_bytes = view.same_bytes();
                out
            }
            None => {
                let ops: Vec<DiskOp> = snap.into_ops().collect();
                if let Some(view) = &mut follow {
                    ops.iter().for_each(|op| view.track(op));
                }
                ops
            }
        };
        // The snapshot's room in the buffer frees frame by frame, in proportion to what went:
        // a mirror write waiting for room waits for about one frame, not for a whole snapshot
        // (about half a second of a 100 Mbit/s link during the bulk copy).
        let mut release = Release::new(bytes, ops.iter().map(buffer_weight).sum());
        let mut ops = ops.into_iter().flat_map(split_write).peekable();
        while let Some(mut op) = ops.next() {
            release.done(buffer_weight(&op));
            hash_op(&mut hash, &op);
            if let DiskOp::Write { data, .. } = &mut op {
                flip_for_test(data, data_sent, corrupt_at);
                data_sent += data.len() as u64;
            }
            if let DiskOp::Zeroes { len, .. } | DiskOp::Trim { len, .. } = op {
                report.zero_bytes += len;
            }
            encoder.encode(&op, &mut records);
            let last = ops.peek().is_none();
            if last {
                // Before the frame goes: its acknowledgement may come back at once.
                digests.record(seq, digest_so_far(&hash));
            }
            if records.len() >= FRAME_RECORDS || last {
                let flags = if last { LAST_OF_SNAPSHOT } else { 0 };
                let (frame, compressed) = Frame::encode_counted(seq, flags, &records, &mut zstd);
                count_level(&mut report.zstd_levels, &zstd, compressed, records.len());
                report.frame_bytes += frame.len() as u64;
                session.send(DISK, frame).await?;
                records.clear();
                buffer.sent(release.due());
            }
        }
        buffer.sent(release.rest());
        count += 1;
        let b = buffer.stats();
        report.written_bytes = b.written;
        report.coalesced_bytes = b.coalesced;
        report.held_bytes = b.held;
        report.snapshots = count;
        status.update(|s| {
            // The copy's control loop, not this sender, knows how it was paced.
            let paced_ms = s.disk.as_ref().and_then(|d| d.paced_ms);
            s.disk = Some(DiskReport {
                paced_ms,
                ..report.clone()
            });
        });
    }
    session
        .send(
            DISK,
            Frame::encode(count, LAST_OF_ALL, &[], &mut AdaptiveCompressor::off()),
        )
        .await?;
    let view = match base {
        Some(OlderCopy::Index(index) | OlderCopy::Remembered(index)) => Some(index),
        Some(OlderCopy::Since(_)) | None => follow,
    };
    Ok(Sent {
        snapshots: count,
        digest: hash.hex(),
        view,
    })
}

/// How much of a snapshot's room an operation stands for: its data, or a range's bookkeeping.
fn buffer_weight(op: &DiskOp) -> u64 {
    match op {
        DiskOp::Write { data, .. } => data.len() as u64,
        DiskOp::Same { len, .. } => *len,
        DiskOp::Zeroes { .. } | DiskOp::Trim { .. } => 32,
        DiskOp::Flush { .. } => 0,
    }
}

/// A snapshot's room in the buffer, given back in proportion to the operations sent.
struct Release {
    bytes: u64,
    weight: u64,
    done: u64,
    released: u64,
}

impl Release {
    fn new(bytes: u64, weight: u64) -> Release {
        Release {
            bytes,
            weight: weight.max(1),
            done: 0,
            released: 0,
        }
    }

    /// An operation of `weight` is on its way.
    fn done(&mut self, weight: u64) {
        self.done = (self.done + weight).min(self.weight);
    }

    /// The room the operations so far stand for, not given back yet.
    fn due(&mut self) -> u64 {
        let total = u128::from(self.bytes) * u128::from(self.done) / u128::from(self.weight);
        let total = u64::try_from(total).expect("at most the snapshot's bytes");
        let due = total - self.released;
        self.released = total;
        due
    }

    /// All the room not given back yet (the snapshot went).
    fn rest(&mut self) -> u64 {
        let rest = self.bytes - self.released;
        self.released = self.bytes;
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_background_copy_stalls_only_when_it_comes_no_closer_to_done() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut s = Stall::new(BACKGROUND_STALL);
        // Zeroing the target: nothing counted yet, however long it takes.
        assert!(!s.stalled(0, 1, at(0)));
        assert!(!s.stalled(0, 2, at(30)));
        // Progress, then the guest dirtying as fast as the copy goes (the link busy).
        assert!(!s.stalled(100 << 20, 3, at(30)));
        assert!(!s.stalled(60 << 20, 4, at(35)));
        assert!(!s.stalled(70 << 20, 5, at(40)));
        assert!(!s.stalled(60 << 20, 6, at(44)));
        assert!(s.stalled(65 << 20, 7, at(45)));
        // A new low starts the wait again.
        let mut s = Stall::new(BACKGROUND_STALL);
        assert!(!s.stalled(10 << 20, 1, at(0)));
        assert!(!s.stalled(9 << 20, 2, at(9)));
        assert!(!s.stalled(12 << 20, 3, at(18)));
        assert!(s.stalled(12 << 20, 4, at(19)));
        // A WAN outage: nothing sent for 30 s is not the guest outwriting the link, and the
        // wait starts again when the link carries data.
        let mut s = Stall::new(BACKGROUND_STALL);
        assert!(!s.stalled(10 << 20, 1, at(0)));
        assert!(!s.stalled(10 << 20, 1, at(15)));
        assert!(!s.stalled(10 << 20, 1, at(30)));
        assert!(!s.stalled(10 << 20, 2, at(39)));
        assert!(s.stalled(10 << 20, 3, at(40)));
        // The test hook: no wait at all.
        assert!(Stall::new(Duration::ZERO).stalled(0, 0, at(0)));
    }

    #[test]
    fn a_snapshots_room_is_given_back_in_proportion_and_in_full() {
        let mut r = Release::new(1000, 400);
        r.done(100);
        assert_eq!(r.due(), 250);
        assert_eq!(r.due(), 0);
        r.done(300);
        r.done(50); // more than the weight counted: never more than the snapshot
        assert_eq!(r.due(), 750);
        assert_eq!(r.rest(), 0);
        let mut empty = Release::new(64, 0);
        assert_eq!(empty.due(), 0);
        assert_eq!(empty.rest(), 64);
    }

    fn target(flush_commits: bool) -> MirrorTarget {
        MirrorTarget {
            buffer: Arc::new(TransmitBuffer::new(1 << 20, false)),
            disk: 0,
            flush_commits,
            bulk_gate: None,
        }
    }

    #[tokio::test]
    async fn after_a_failure_refused_writes_are_answered_as_done_but_not_after_the_switchover() {
        let data = || Bytes::from(vec![7u8; 4096]);
        // Closed at the switchover: a late write is an error.
        let t = target(false);
        t.buffer.close();
        assert_eq!(t.write(0, data()).await, Err(proto::ESHUTDOWN));
        assert_eq!(t.flush().await, Err(proto::ESHUTDOWN));
        // Abandoned: the target is being discarded, QEMU's mirror is told nothing failed.
        let t = target(false);
        t.buffer.abandon();
        assert_eq!(t.write(0, data()).await, Ok(()));
        assert_eq!(t.write_zeroes(0, 4096, true).await, Ok(()));
        assert_eq!(t.flush().await, Ok(()));
        // Where a flush commits (libvirt's relay), a refused flush never passes for done.
        let t = target(true);
        t.buffer.abandon();
        assert_eq!(t.flush().await, Err(proto::ESHUTDOWN));
    }
}
