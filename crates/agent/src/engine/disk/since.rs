//! QEMU's persistent dirty bitmaps for the return trip: what changed on a disk since the VM
//! arrived, so that a copy the VM left behind is sent only that (docs/architecture.md,
//! "Disks", 7).
//!
//! Two markers, both persistent bitmaps in the qcow2 images, named after the session that
//! made them:
//! - `ferry-arrived-<session>` on the destination's disks, added in the pause before `cont`:
//!   the disks hold then exactly what the source's held, and the bitmap records every write
//!   from there.
//! - `ferry-left-<session>` on the source's disks, added in the pause once the mirrors
//!   completed: while it stays clean, the copy left behind is untouched (QEMU marks it for
//!   any write, the incoming copy of a later migration included).
//!
//! On the way back the source offers its `arrived` sessions; the destination matches one
//! with a clean `left` bitmap and says so in `Ready`, and then it need not read its copy to
//! index it: the source sends a part of the disk whose `arrived` bitmap is clean as SAME
//! ([`ferry_codec::ChangedSince`]). The source reads its bitmap through its QEMU's NBD server
//! ([`BitmapExports`]). The export is of a read-only null node of the disk's size, with the
//! bitmap named by its node: QEMU refuses a recording bitmap on a read-only export of the
//! disk node itself, and a node above the disk would leave it no root node, which
//! `blockdev-mirror` requires.
//!
//! A bitmap QEMU found in use when it opened the image (`inconsistent`: it was not closed
//! cleanly), one not recording, or a missing one means no match, and the content index as
//! before.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ferry_codec::{ChangedSince, DiskOp};
use ferry_qemu::commands::{
    BlockDirtyBitmapAdd, BlockDirtyBitmapRemove, BlockExportAdd, BlockExportDel, BlockNode,
    BlockdevAdd, BlockdevDel, NbdServerStart, NbdServerStop, QueryNamedBlockNodes,
};
use ferry_qemu::nbd::DirtyBitmapReader;
use ferry_qemu::Qmp;
use tokio::net::UnixStream;

use crate::engine::control::DiskPlan;

const ARRIVED: &str = "ferry-arrived-";
const LEFT: &str = "ferry-left-";
/// What one bit of an `arrived` bitmap covers: the codec's block, so a return sends the
/// blocks written and not their neighbours (QEMU's default, the 64 KiB cluster, sent three
/// times the bytes for a guest rewriting scattered 4 KiB blocks). 32 KiB of bitmap per GiB.
const ARRIVED_GRANULARITY: u64 = 4096;

fn is_ours(name: &str) -> bool {
    name.starts_with(ARRIVED) || name.starts_with(LEFT)
}

async fn nodes(qmp: &Qmp) -> Result<Vec<BlockNode>> {
    Ok(qmp.execute(&QueryNamedBlockNodes { flat: true }).await?)
}

fn node<'a>(all: &'a [BlockNode], name: &str) -> Option<&'a BlockNode> {
    all.iter().find(|n| n.node_name == name)
}

/// Source, before `Prepare`: per disk, the sessions since whose arrival a bitmap has recorded
/// every write, with its granularity. Stale `left` markers (this copy runs the VM again) are
/// removed on the way.
pub async fn tracked(qmp: &Qmp, plans: &[DiskPlan]) -> Result<Vec<Vec<(String, u64)>>> {
    let all = nodes(qmp).await?;
    let mut out = Vec::new();
    for plan in plans {
        let mut found = Vec::new();
        for b in node(&all, &plan.node).map_or(&[][..], |n| &n.dirty_bitmaps[..]) {
            if b.name.starts_with(LEFT) {
                remove(qmp, &plan.node, &b.name).await;
            } else if let Some(session) = b.name.strip_prefix(ARRIVED) {
                if b.recording && !b.inconsistent && !b.busy {
                    found.push((session.to_owned(), b.granularity));
                } else {
                    tracing::warn!(
                        "disk {:?}: bitmap {} is not usable (recording {}, inconsistent {}, busy {})",
                        plan.node,
                        b.name,
                        b.recording,
                        b.inconsistent,
                        b.busy
                    );
                }
            }
        }
        out.push(found);
    }
    Ok(out)
}

/// Destination, before `Ready` (its exports made the images active, so their bitmaps are
/// loaded): per disk, the offered session whose `left` marker here is clean, or why none is.
pub async fn untouched(qmp: &Qmp, plans: &[DiskPlan]) -> Result<std::result::Result<Vec<String>, String>> {
    let all = nodes(qmp).await?;
    let mut sessions = Vec::new();
    for plan in plans {
        let bitmaps = node(&all, &plan.node).map_or(&[][..], |n| &n.dirty_bitmaps[..]);
        let mut why = format!("disk {:?}: no bitmap from the VM's departure here", plan.node);
        let mut matched = None;
        for b in bitmaps {
            let Some(session) = b.name.strip_prefix(LEFT) else {
                continue;
            };
            if !plan.tracked_since.iter().any(|s| s == session) {
                continue;
            }
            if b.count > 0 || b.inconsistent || !b.recording {
                why = format!(
                    "disk {:?}: the copy here changed after the VM left ({} bytes written{})",
                    plan.node,
                    b.count,
                    if b.inconsistent {
                        ", bitmap inconsistent"
                    } else {
                        ""
                    }
                );
                continue;
            }
            matched = Some(session.to_owned());
        }
        match matched {
            Some(s) => sessions.push(s),
            None => {
                if plan.tracked_since.is_empty() {
                    why = format!("disk {:?}: the source tracks no writes since an arrival", plan.node);
                }
                return Ok(Err(why));
            }
        }
    }
    Ok(Ok(sessions))
}

/// Destination, once its disks are exported (before anything is written to them): ferry's
/// bitmaps describe contents the copy is about to replace, so they go.
pub async fn forget_markers(qmp: &Qmp, plans: &[DiskPlan]) {
    let all = match nodes(qmp).await {
        Ok(all) => all,
        Err(e) => return tracing::warn!("ferry's dirty bitmaps not removed: {e:#}"),
    };
    for plan in plans {
        for b in node(&all, &plan.node).map_or(&[][..], |n| &n.dirty_bitmaps[..]) {
            if is_ours(&b.name) {
                remove(qmp, &plan.node, &b.name).await;
            }
        }
    }
}

/// Destination, in the pause before `cont`: the disks hold what the source's held.
pub async fn mark_arrival(qmp: &Qmp, nodes: &[String], session: &str) {
    add(qmp, nodes, &format!("{ARRIVED}{session}"), Some(ARRIVED_GRANULARITY)).await;
}

/// Source, in the pause once the mirrors completed: the copy left here is what the VM had.
pub async fn mark_departure(qmp: &Qmp, nodes: &[String], session: &str) {
    add(qmp, nodes, &format!("{LEFT}{session}"), None).await;
}

/// Source, when the migration failed after [`mark_departure`]: the VM runs on this copy.
pub async fn unmark_departure(qmp: &Qmp, nodes: &[String], session: &str) {
    for node in nodes {
        remove(qmp, node, &format!("{LEFT}{session}")).await;
    }
}

/// A marker only saves bytes later: one QEMU will not keep (a raw image has no room for
/// bitmaps) is a warning, not a failed migration.
async fn add(qmp: &Qmp, nodes: &[String], name: &str, granularity: Option<u64>) {
    for node in nodes {
        if let Err(e) = qmp
            .execute(&BlockDirtyBitmapAdd {
                node: node.clone(),
                name: name.to_owned(),
                persistent: true,
                granularity,
            })
            .await
        {
            tracing::warn!("disk {node:?}: no bitmap {name}: {e}");
        }
    }
}

async fn remove(qmp: &Qmp, node: &str, name: &str) {
    if let Err(e) = qmp
        .execute(&BlockDirtyBitmapRemove {
            node: node.to_owned(),
            name: name.to_owned(),
        })
        .await
    {
        tracing::debug!("disk {node:?}: bitmap {name} not removed: {e}");
    }
}

/// The source QEMU's NBD exports of its disks' `arrived` bitmaps. They must be gone before
/// the migration completes: QEMU 10.0 aborts (an assertion) when it inactivates an image
/// whose persistent bitmap an export holds busy, so [`BitmapExports::close`] runs in the
/// pause, before `migrate-continue`, and on every failure.
pub struct BitmapExports {
    socket: PathBuf,
    nodes: Vec<String>,
    /// Per disk: the sessions offered and their bitmaps' granularity.
    offered: Vec<Vec<(String, u64)>>,
}

fn view_node(node: &str) -> String {
    format!("ferry-view-{node}")
}

/// Source, before `Prepare`: offers every disk's `arrived` sessions (`DiskPlan::tracked_since`)
/// and exports their bitmaps. Only when every disk has one; a failure means no offer, and the
/// destination indexes its copy as before.
pub async fn offer(
    qmp: &Qmp,
    work_dir: &Path,
    session: &str,
    plans: &mut [DiskPlan],
) -> Option<BitmapExports> {
    let offered = match tracked(qmp, plans).await {
        Ok(t) if !t.is_empty() && t.iter().all(|s| !s.is_empty()) => t,
        Ok(_) => return None,
        Err(e) => {
            tracing::warn!("the disks' dirty bitmaps could not be listed: {e:#}");
            return None;
        }
    };
    for (plan, sessions) in plans.iter_mut().zip(&offered) {
        plan.tracked_since = sessions.iter().map(|(s, _)| s.clone()).collect();
    }
    match BitmapExports::open(qmp, work_dir, session, plans, offered).await {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::warn!("the disks' dirty bitmaps are not offered: {e:#}");
            for plan in plans.iter_mut() {
                plan.tracked_since.clear();
            }
            None
        }
    }
}

impl BitmapExports {
    /// Exports each disk's offered bitmaps through a read-only null node. Nothing is left
    /// behind on error.
    async fn open(
        qmp: &Qmp,
        work_dir: &Path,
        session: &str,
        plans: &[DiskPlan],
        offered: Vec<Vec<(String, u64)>>,
    ) -> Result<BitmapExports> {
        let socket = work_dir.join(format!("{session}.bitmaps.sock"));
        let _ = std::fs::remove_file(&socket);
        qmp.execute(&NbdServerStart::unix(&socket))
            .await
            .context("starting the source QEMU's NBD server to read its dirty bitmaps")?;
        let mut exports = BitmapExports {
            socket,
            nodes: Vec::new(),
            offered,
        };
        for plan in plans {
            if let Err(e) = exports.export(qmp, plan).await {
                exports.close(qmp).await;
                return Err(e);
            }
        }
        Ok(exports)
    }

    async fn export(&mut self, qmp: &Qmp, plan: &DiskPlan) -> Result<()> {
        let view = view_node(&plan.node);
        qmp.execute(&BlockdevAdd(serde_json::json!({
            "driver": "null-co",
            "node-name": view,
            "size": plan.size,
            "read-only": true,
        })))
        .await
        .with_context(|| format!("a node to export the bitmaps of disk {:?}", plan.node))?;
        self.nodes.push(plan.node.clone());
        let bitmaps = plan
            .tracked_since
            .iter()
            .map(|s| serde_json::json!({"node": plan.node, "name": format!("{ARRIVED}{s}")}))
            .collect();
        qmp.execute(&BlockExportAdd {
            kind: "nbd".into(),
            id: view.clone(),
            node_name: view,
            writable: false,
            name: plan.node.clone(),
            bitmaps,
        })
        .await
        .with_context(|| format!("exporting the dirty bitmaps of disk {:?}", plan.node))?;
        Ok(())
    }

    /// The view of the disks' bitmaps since the sessions the destination matched, one per
    /// disk in the plans' order.
    pub async fn view(&self, plans: &[DiskPlan], sessions: &[String]) -> Result<BitmapView> {
        if sessions.len() != plans.len() {
            bail!(
                "the destination matched {} dirty bitmaps for {} disks",
                sessions.len(),
                plans.len()
            );
        }
        let mut readers = Vec::new();
        let mut disks = Vec::new();
        for ((plan, session), offered) in plans.iter().zip(sessions).zip(&self.offered) {
            let Some(&(_, granularity)) = offered.iter().find(|(s, _)| s == session) else {
                bail!(
                    "the destination matched session {session} for disk {:?}, which was not offered",
                    plan.node
                );
            };
            let stream = UnixStream::connect(&self.socket)
                .await
                .with_context(|| format!("connecting to {}", self.socket.display()))?;
            let reader = DirtyBitmapReader::connect(stream, &plan.node, &format!("{ARRIVED}{session}"))
                .await
                .with_context(|| format!("reading the dirty bitmap of disk {:?}", plan.node))?;
            if reader.size() != plan.size {
                bail!(
                    "the bitmap export of disk {:?} is {} bytes, the disk {}",
                    plan.node,
                    reader.size(),
                    plan.size
                );
            }
            readers.push(reader);
            disks.push((plan.size, granularity));
        }
        Ok(BitmapView {
            changed: ChangedSince::new(&disks),
            readers,
        })
    }

    /// Removes the exports, the views and the NBD server.
    pub async fn close(&self, qmp: &Qmp) {
        close_exports(qmp, &self.nodes).await;
        let _ = qmp.execute(&NbdServerStop).await;
        let _ = std::fs::remove_file(&self.socket);
    }
}

async fn close_exports(qmp: &Qmp, nodes: &[String]) -> bool {
    let mut found = false;
    for node in nodes {
        let view = view_node(node);
        if qmp.execute(&BlockExportDel::hard(view.clone())).await.is_ok() {
            found = true;
            // The export goes once its clients are gone; its node only after that.
            let _ = qmp
                .wait_event(
                    "BLOCK_EXPORT_DELETED",
                    |v| v["id"] == view.as_str(),
                    std::time::Duration::from_secs(5),
                )
                .await;
        }
        let _ = qmp.execute(&BlockdevDel { node_name: view }).await;
    }
    found
}

/// What an agent that went away mid-migration left: the bitmap exports of `nodes`, and the
/// NBD server it started for them.
pub async fn abandon_exports(qmp: &Qmp, nodes: &[String]) {
    if close_exports(qmp, nodes).await {
        let _ = qmp.execute(&NbdServerStop).await;
    }
}

/// The source's bitmaps, read as the snapshots go: every part of a snapshot is asked about
/// after its data was read (it is in the buffer), so a part still clean was unchanged then.
pub struct BitmapView {
    changed: ChangedSince,
    readers: Vec<DirtyBitmapReader<UnixStream>>,
}

impl BitmapView {
    /// What to send for a snapshot's operations.
    pub async fn filter(&mut self, ops: Vec<DiskOp>) -> Result<Vec<DiskOp>> {
        let mut spans: Vec<Option<(u64, u64)>> = vec![None; self.readers.len()];
        for op in &ops {
            if let DiskOp::Write { .. } | DiskOp::Zeroes { .. } = op {
                let (disk, offset, len) = op.range().expect("a write has a range");
                if let Some(span) = spans.get_mut(usize::from(disk)) {
                    let (a, b) = span.get_or_insert((offset, offset + len));
                    (*a, *b) = ((*a).min(offset), (*b).max(offset + len));
                }
            }
        }
        for (disk, span) in spans.iter().enumerate() {
            if let Some((a, b)) = *span {
                let dirty = self.readers[disk]
                    .dirty(a, b - a)
                    .await
                    .context("reading the source's dirty bitmap")?;
                let disk = u8::try_from(disk).expect("at most 255 disks");
                for (offset, len) in dirty {
                    self.changed.mark_dirty(disk, offset, len);
                }
            }
        }
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            self.changed.filter(op, &mut out);
        }
        Ok(out)
    }

    pub fn same_bytes(&self) -> u64 {
        self.changed.same_bytes
    }
}
