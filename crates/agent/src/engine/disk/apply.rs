//! The destination side of disk migration: the destination QEMU exports each disk writable
//! over NBD on a unix socket in the agent's work directory; the applier decodes the disk
//! channel's snapshots and writes them through one NBD client per disk.
//!
//! Order: the pieces of one snapshot never overlap, so they are written concurrently (up to
//! [`MAX_IN_FLIGHT`]); an operation that overlaps one still in flight (from an earlier
//! snapshot) waits for it, so overlapping writes land in the order they were made. A snapshot
//! is acknowledged once it and every earlier one completed. A flush waits for everything
//! before it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::engine::digest::StreamDigest;
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use ferry_api::agent::CodecSettings;
use ferry_codec::{BaseBuilder, BatchDecompressor, DiskDecoder, DiskOp};
use ferry_qemu::commands::{BlockExportAdd, NbdServerStart, NbdServerStop, QueryNamedBlockNodes};
use ferry_qemu::nbd::{Client, Command, Pending};
use ferry_qemu::Qmp;
use ferry_wire::{Received, Session};
use tokio::net::UnixStream;
use tokio::task::JoinSet;

use super::{ack_frame, codec_options, digest_so_far, hash_op, Digest32, Frame};
use crate::engine::control::{DiskPlan, DISK, DISK_ACK};

/// Adds what `ranges` (offset, length; in order, not overlapping, 4 KiB aligned but for the
/// disk's end) of disk `node` hold to `builder`, read through `client`.
pub(super) async fn index_ranges(
    client: &NbdClient,
    node: &str,
    ranges: &[(u64, u64)],
    builder: &mut BaseBuilder,
) -> Result<()> {
    // Reads pipelined a few deep: the export is local, the hashing cheap.
    let mut reads = std::collections::VecDeque::new();
    for &(start, len) in ranges {
        let mut at = start;
        while at < start + len {
            let n = (start + len - at).min(INDEX_READ_BYTES);
            reads.push_back((at, n));
            at += n;
        }
    }
    let mut pending = std::collections::VecDeque::new();
    while !reads.is_empty() || !pending.is_empty() {
        while pending.len() < INDEX_READS_IN_FLIGHT {
            let Some((at, len)) = reads.pop_front() else {
                break;
            };
            let len = u32::try_from(len).expect("capped");
            pending.push_back((at, client.submit(Command::Read, 0, at, len, None).await?));
        }
        let (at, p) = pending.pop_front().expect("non-empty");
        let data = p
            .wait()
            .await
            .with_context(|| format!("reading disk {node:?} to index it"))?;
        builder.add(at, &data);
    }
    Ok(())
}

/// Requests in flight per migration: XvMotion's 32 outstanding IOs per destination volume.
const MAX_IN_FLIGHT: usize = 32;
/// The largest write or zero request sent in one NBD request (QEMU's server takes 32 MiB).
const MAX_REQUEST: u64 = 32 << 20;
/// A freshly created qcow2 image takes about 200 KiB on the host; more means it holds data.
const FRESH_IMAGE_BYTES: u64 = 1 << 20;
/// Indexing reads 4 MiB at a time, 4 in flight.
const INDEX_READ_BYTES: u64 = 4 << 20;
const INDEX_READS_IN_FLIGHT: usize = 4;
/// How long the destination's QEMU may take to take or answer one request on its export. A
/// local QEMU answers in milliseconds; one whose main loop is stuck (a failed incoming
/// migration can leave it so) would otherwise hold the applier, and with it the source's
/// flush and the whole migration's failure path, forever. (Tests: 2 s.)
const EXPORT_ANSWER: Duration = if cfg!(test) {
    Duration::from_secs(2)
} else {
    Duration::from_secs(120)
};

/// `request` to the destination's export, answered within [`EXPORT_ANSWER`].
async fn answered<T>(
    what: &str,
    request: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(EXPORT_ANSWER, request)
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "the destination's QEMU did not answer {what} on its disk export within {}s",
                EXPORT_ANSWER.as_secs()
            )
        })?
}

type NbdClient = Client<UnixStream>;

/// The disks of one migration, destination side.
pub struct DestinationDisks {
    clients: Vec<Arc<NbdClient>>,
    plans: Vec<DiskPlan>,
    /// The NBD server's socket when this agent started it.
    socket: Option<PathBuf>,
}

impl DestinationDisks {
    /// One disk whose export someone else made (libvirt, for [`super::relay`]).
    pub fn adopt(client: NbdClient, plan: DiskPlan) -> DestinationDisks {
        DestinationDisks {
            clients: vec![Arc::new(client)],
            plans: vec![plan],
            socket: None,
        }
    }

    /// Ends the connections to the exports.
    pub async fn disconnect(&self) {
        for c in &self.clients {
            let _ = c.disconnect().await;
        }
    }

    /// Exports every planned disk of the destination QEMU and connects to each export.
    pub async fn start(
        qmp: &Qmp,
        work_dir: &Path,
        session_id: impl std::fmt::Display,
        plans: &[DiskPlan],
    ) -> Result<DestinationDisks> {
        let socket = work_dir.join(format!("{session_id}.nbd.sock"));
        let _ = std::fs::remove_file(&socket);
        qmp.execute(&NbdServerStart::unix(&socket))
            .await
            .context("starting the destination QEMU's NBD server")?;
        let mut clients = Vec::new();
        for plan in plans {
            qmp.execute(&BlockExportAdd {
                kind: "nbd".into(),
                id: format!("ferry-export-{}", plan.node),
                node_name: plan.node.clone(),
                writable: true,
                name: plan.node.clone(),
                bitmaps: Vec::new(),
            })
            .await
            .with_context(|| {
                format!(
                    "exporting disk {:?} of the destination QEMU (does it have that node?)",
                    plan.node
                )
            })?;
            let stream = UnixStream::connect(&socket)
                .await
                .with_context(|| format!("connecting to {}", socket.display()))?;
            let client = Client::connect(stream, &plan.node)
                .await
                .with_context(|| format!("the destination's export of {:?}", plan.node))?;
            if client.info().size != plan.size {
                bail!(
                    "disk {:?} is {} bytes at the destination and {} at the source",
                    plan.node,
                    client.info().size,
                    plan.size
                );
            }
            clients.push(Arc::new(client));
        }
        Ok(DestinationDisks {
            clients,
            plans: plans.to_vec(),
            socket: Some(socket),
        })
    }

    /// The disks' node names, in the plan's order.
    pub fn nodes(&self) -> Vec<String> {
        self.plans.iter().map(|p| p.node.clone()).collect()
    }

    /// When a disk here already holds data (an older copy of the VM's disk, left by an earlier
    /// stay), the index of what every disk holds, for the source to send only what changed.
    /// None when they are all freshly created (empty).
    pub async fn index(&self, qmp: &Qmp, key: u64) -> Result<Option<Vec<u8>>> {
        let nodes = qmp.execute(&QueryNamedBlockNodes { flat: true }).await?;
        let holds_data = self.plans.iter().any(|p| {
            nodes
                .iter()
                .find(|n| n.node_name == p.node)
                .and_then(|n| n.image.actual_size)
                .is_some_and(|a| a > FRESH_IMAGE_BYTES)
        });
        if !holds_data {
            return Ok(None);
        }
        let mut builder = BaseBuilder::new(key);
        for (client, plan) in self.clients.iter().zip(&self.plans) {
            builder.disk(plan.size);
            index_ranges(client, &plan.node, &[(0, plan.size)], &mut builder).await?;
        }
        Ok(Some(builder.finish()))
    }

    /// Applies the disk channel until the source's last frame; returns the number of
    /// snapshots and the operations' digest. Every disk is flushed before it returns.
    pub async fn apply(&self, session: &Session, codec: CodecSettings) -> Result<(u64, String)> {
        let mut applier = Applier {
            clients: &self.clients,
            plans: &self.plans,
            session,
            in_flight: JoinSet::new(),
            ranges: BTreeMap::new(),
            next_id: 0,
            snapshots: BTreeMap::new(),
            digests: BTreeMap::new(),
            acked: 0,
        };
        let mut decoder = DiskDecoder::new(codec_options(codec));
        let mut zstd = BatchDecompressor::new(super::MAX_FRAME_RECORDS);
        let mut hash = StreamDigest::new();
        // The latest snapshot a frame arrived for, and whether its last frame did.
        let mut last: Option<(u64, bool)> = None;
        loop {
            // Completions are taken as they come, not only when room is needed: a synchronous
            // source sends nothing more until its snapshot is acknowledged.
            let received = tokio::select! {
                r = session.recv(DISK) => r?,
                done = applier.in_flight.join_next(), if !applier.in_flight.is_empty() => {
                    applier.completed(done).await?;
                    continue;
                }
            };
            let frame = match received {
                Received::Data(b) => Frame::decode(b)?,
                Received::Barrier => bail!("unexpected barrier on the disk channel"),
            };
            if frame.last_of_all {
                let t0 = std::time::Instant::now();
                applier.drain().await?;
                let drained_ms = t0.elapsed().as_secs_f64() * 1e3;
                for (client, plan) in self.clients.iter().zip(&self.plans) {
                    answered("a flush", async { Ok(client.flush().await?.wait().await?) })
                        .await
                        .with_context(|| format!("flushing disk {:?}", plan.node))?;
                }
                tracing::info!(
                    drained_ms,
                    flushed_ms = t0.elapsed().as_secs_f64() * 1e3,
                    "disk channel ended; every disk flushed"
                );
                return Ok((frame.seq, hash.hex()));
            }
            // A snapshot's frames come together, snapshots in increasing order: anything else
            // is a confused source, and would leave snapshots open here for good.
            if let Some((seq, done)) = last {
                let in_order = (frame.seq == seq && !done) || (frame.seq > seq && done);
                if !in_order {
                    bail!(
                        "disk frame of snapshot {} after snapshot {seq}, whose last frame {}",
                        frame.seq,
                        if done { "had come" } else { "had not come" }
                    );
                }
            }
            last = Some((frame.seq, frame.last_of_snapshot));
            let mut input = zstd
                .decompress(&frame.batch)
                .context("a disk frame from the source")?;
            applier.snapshots.entry(frame.seq).or_insert((0, false));
            while !input.is_empty() {
                let op = decoder
                    .decode(&mut input)
                    .context("a disk record from the source")?;
                hash_op(&mut hash, &op);
                applier.apply(frame.seq, op).await?;
            }
            if frame.last_of_snapshot {
                applier.digests.insert(frame.seq, digest_so_far(&hash));
                applier
                    .snapshots
                    .get_mut(&frame.seq)
                    .expect("entered above")
                    .1 = true;
                applier.acknowledge().await?;
            }
        }
    }

    /// Ends the exports: the destination QEMU's NBD server stops (before it resumes).
    pub async fn stop(&self, qmp: &Qmp) -> Result<()> {
        self.disconnect().await;
        qmp.execute(&NbdServerStop)
            .await
            .context("stopping the destination QEMU's NBD server")?;
        if let Some(socket) = &self.socket {
            let _ = std::fs::remove_file(socket);
        }
        Ok(())
    }
}

struct Applier<'a> {
    clients: &'a [Arc<NbdClient>],
    plans: &'a [DiskPlan],
    session: &'a Session,
    in_flight: JoinSet<(u64, Result<()>)>,
    /// id -> (snapshot, disk, start, end) of requests in flight.
    ranges: BTreeMap<u64, (u64, u8, u64, u64)>,
    next_id: u64,
    /// snapshot -> (requests outstanding, all its frames seen).
    snapshots: BTreeMap<u64, (usize, bool)>,
    /// snapshot -> the digest of the operations through it, until acknowledged.
    digests: BTreeMap<u64, Digest32>,
    acked: u64,
}

impl Applier<'_> {
    async fn apply(&mut self, seq: u64, op: DiskOp) -> Result<()> {
        let Some((disk, offset, len)) = op.range() else {
            // A flush: everything before it first.
            let DiskOp::Flush { disk } = op else {
                unreachable!("only flushes have no range")
            };
            self.drain().await?;
            let client = self.client(disk)?;
            answered("a flush", async { Ok(client.flush().await?.wait().await?) })
                .await
                .context("flushing a disk")?;
            return Ok(());
        };
        let size = self.plans.get(usize::from(disk)).map_or(0, |p| p.size);
        if offset.saturating_add(len) > size {
            bail!("the source wrote {len} bytes at {offset} of disk {disk}, outside the disk");
        }
        let end = offset + len;
        while self
            .ranges
            .values()
            .any(|&(_, d, s, e)| d == disk && s < end && offset < e)
            || self.in_flight.len() >= MAX_IN_FLIGHT
        {
            self.complete_one().await?;
        }
        let client = self.client(disk)?.clone();
        let pending = answered("a request", submit(&client, op)).await?;
        let id = self.next_id;
        self.next_id += 1;
        self.ranges.insert(id, (seq, disk, offset, end));
        self.snapshots.entry(seq).or_insert((0, false)).0 += 1;
        self.in_flight.spawn(async move {
            let mut result = Ok(());
            for p in pending {
                let written = answered("a write", async { Ok(p.wait().await?) }).await;
                if let Err(e) = written {
                    result = Err(e.context("writing to the destination's disk"));
                }
            }
            (id, result)
        });
        Ok(())
    }

    fn client(&self, disk: u8) -> Result<&Arc<NbdClient>> {
        self.clients
            .get(usize::from(disk))
            .with_context(|| format!("the source names disk {disk}, which is not being moved"))
    }

    async fn complete_one(&mut self) -> Result<()> {
        let done = self.in_flight.join_next().await;
        self.completed(done).await
    }

    /// Books one finished request (from [`JoinSet::join_next`]) and acknowledges what it
    /// completes.
    async fn completed(
        &mut self,
        done: Option<Result<(u64, Result<()>), tokio::task::JoinError>>,
    ) -> Result<()> {
        let Some(done) = done else {
            return Ok(());
        };
        let (id, result) = done.context("a disk write task")?;
        result?;
        let (seq, ..) = self.ranges.remove(&id).expect("tracked");
        if let Some(s) = self.snapshots.get_mut(&seq) {
            s.0 -= 1;
        }
        self.acknowledge().await
    }

    async fn drain(&mut self) -> Result<()> {
        while !self.in_flight.is_empty() {
            self.complete_one().await?;
        }
        Ok(())
    }

    /// Acknowledges every leading snapshot that is complete.
    async fn acknowledge(&mut self) -> Result<()> {
        let mut applied = self.acked;
        while let Some((&seq, &(outstanding, ended))) = self.snapshots.first_key_value() {
            if outstanding > 0 || !ended {
                break;
            }
            self.snapshots.remove(&seq);
            applied = seq + 1;
        }
        if applied > self.acked {
            self.acked = applied;
            let last = applied - 1;
            let digest = self.digests[&last];
            self.digests = self.digests.split_off(&applied);
            self.session
                .send(DISK_ACK, ack_frame(applied, &digest))
                .await?;
        }
        Ok(())
    }
}

/// Sends `op` as one or more NBD requests (a range may exceed one request's maximum).
async fn submit(client: &NbdClient, op: DiskOp) -> Result<Vec<Pending>> {
    let (offset, len, zeroes) = match op {
        DiskOp::Write { offset, data, .. } => {
            return Ok(vec![client.write(offset, Bytes::from(data)).await?]);
        }
        DiskOp::Zeroes {
            offset,
            len,
            may_trim,
            ..
        } => (offset, len, Some(may_trim)),
        DiskOp::Trim { offset, len, .. } => (offset, len, None),
        DiskOp::Flush { .. } => return Ok(vec![client.flush().await?]),
        // Already there: nothing to write.
        DiskOp::Same { .. } => return Ok(Vec::new()),
    };
    let mut pending = Vec::new();
    let mut at = offset;
    while at < offset + len {
        let n = u32::try_from((offset + len - at).min(MAX_REQUEST)).expect("capped");
        pending.push(match zeroes {
            Some(may_trim) => client.write_zeroes(at, n, may_trim).await?,
            None => client.trim(at, n).await?,
        });
        at += u64::from(n);
    }
    Ok(pending)
}
