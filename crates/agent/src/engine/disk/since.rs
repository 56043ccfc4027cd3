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
use ferry_qemu::nbd::BlockStatusReader;
use ferry_qemu::Qmp;
use tokio::net::UnixStream;

use crate::engine::control::DiskPlan;

const ARRIVED: &str = "ferry-arrived-";
const LEFT: &str = "ferry-left-";
/// What one bit of an `arrived` bitmap covers: the codec's block, so a return sends the
/// blocks written and not their neighbours. With QEMU's default, the 64 KiB cluster, the
/// modes test's return (a guest rewriting scattered 4 KiB blocks) sent 4.1 MB of disk frames,
/// over a third of the first move's 9.3 MB, where the content index sends under a third.
/// 32 KiB of bitmap per GiB of disk.
const ARRIVED_GRANULARITY: u64 = 4096;

fn is_ours(name: &str) -> bool {
    name.starts_with(ARRIVED) || name.starts_with(LEFT)
}

/// A marker's name: the session and the disk's node (the same at both ends), so that a disk
/// never matches another disk's marker, whatever image a node name points to later.
fn marker(prefix: &str, session: &str, node: &str) -> String {
    format!("{prefix}{session}-{node}")
}

/// The session of `name` if it is a marker of `prefix` for `node`.
fn session_of<'a>(name: &'a str, prefix: &str, node: &str) -> Option<&'a str> {
    let rest = name.strip_prefix(prefix)?;
    let (session, disk) = rest.split_at_checked(32)?;
    (disk.strip_prefix('-') == Some(node)).then_some(session)
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
            } else if let Some(session) = session_of(&b.name, ARRIVED, &plan.node) {
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
/// loaded): per disk, the offered session whose `left` marker here is clean, or why there is
/// none. A marker says nothing of the images below a disk: the backing chains must be the
/// same at both ends (`backing`: this end's digests, in the plans' order), or both absent.
pub async fn untouched(
    qmp: &Qmp,
    plans: &[DiskPlan],
    backing: &[Option<String>],
) -> std::result::Result<Vec<String>, String> {
    let all = nodes(qmp)
        .await
        .map_err(|e| format!("the disks' bitmaps could not be listed: {e:#}"))?;
    untouched_in(&all, plans, backing)
}

/// [`untouched`], over the block nodes QEMU listed.
fn untouched_in(
    all: &[BlockNode],
    plans: &[DiskPlan],
    backing: &[Option<String>],
) -> std::result::Result<Vec<String>, String> {
    let mut sessions = Vec::new();
    for (plan, ours) in plans.iter().zip(backing) {
        if plan.tracked_since.is_empty() {
            return Err(format!(
                "disk {:?}: the source tracks no writes since an arrival",
                plan.node
            ));
        }
        if plan.backing_sha256 != *ours {
            return Err(format!(
                "disk {:?}: its backing images differ from the source's",
                plan.node
            ));
        }
        let bitmaps = node(all, &plan.node).map_or(&[][..], |n| &n.dirty_bitmaps[..]);
        let mut why = format!(
            "disk {:?}: no bitmap from the VM's departure here",
            plan.node
        );
        let mut matched = None;
        for b in bitmaps {
            let Some(session) = session_of(&b.name, LEFT, &plan.node) else {
                continue;
            };
            if !plan.tracked_since.iter().any(|s| s == session) {
                continue;
            }
            if b.inconsistent || !b.recording {
                why = format!(
                    "disk {:?}: bitmap {} cannot be trusted ({})",
                    plan.node,
                    b.name,
                    if b.inconsistent {
                        "QEMU found it in use when it opened the image"
                    } else {
                        "it does not record"
                    }
                );
                continue;
            }
            if b.count > 0 {
                why = format!(
                    "disk {:?}: the copy here changed after the VM left ({} bytes written)",
                    plan.node, b.count
                );
                continue;
            }
            matched = Some(session.to_owned());
        }
        match matched {
            Some(s) => sessions.push(s),
            None => return Err(why),
        }
    }
    Ok(sessions)
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
    for node in nodes {
        add(
            qmp,
            node,
            &marker(ARRIVED, session, node),
            Some(ARRIVED_GRANULARITY),
        )
        .await;
    }
}

/// Source, in the pause once the mirrors completed: the copy left here is what the VM had.
pub async fn mark_departure(qmp: &Qmp, nodes: &[String], session: &str) {
    for node in nodes {
        add(qmp, node, &marker(LEFT, session, node), None).await;
    }
}

/// Source, when the migration failed after [`mark_departure`]: the VM runs on this copy.
pub async fn unmark_departure(qmp: &Qmp, nodes: &[String], session: &str) {
    for node in nodes {
        remove(qmp, node, &marker(LEFT, session, node)).await;
    }
}

/// A marker only saves bytes later: one QEMU will not keep (a raw image has no room for
/// bitmaps) is a warning, not a failed migration.
async fn add(qmp: &Qmp, node: &str, name: &str, granularity: Option<u64>) {
    if let Err(e) = qmp
        .execute(&BlockDirtyBitmapAdd {
            node: node.to_owned(),
            name: name.to_owned(),
            persistent: true,
            granularity,
        })
        .await
    {
        tracing::warn!("disk {node:?}: no bitmap {name}: {e}");
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
            .map(|s| serde_json::json!({"node": plan.node, "name": marker(ARRIVED, s, &plan.node)}))
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
            let reader = BlockStatusReader::dirty_bitmap(
                stream,
                &plan.node,
                &marker(ARRIVED, session, &plan.node),
            )
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
        if qmp
            .execute(&BlockExportDel::hard(view.clone()))
            .await
            .is_ok()
        {
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

/// What a migration cut short left (its agent gone, a close interrupted): the bitmap exports
/// of `nodes`, and the NBD server started for them. The server is stopped when one of
/// ferry's exports was found or when it has no export left (ferry's start never knows whether
/// an earlier attempt's server is still up; a server without exports serves nobody).
pub async fn abandon_exports(qmp: &Qmp, nodes: &[String]) {
    let found = close_exports(qmp, nodes).await;
    let none_left = qmp
        .execute_raw("query-block-exports", serde_json::json!({}))
        .await
        .is_ok_and(|v| v.as_array().is_some_and(Vec::is_empty));
    if found || none_left {
        let _ = qmp.execute(&NbdServerStop).await;
    }
}

/// Source, in the pause before `migrate-continue`: QEMU 10.0 aborts (an assertion) when it
/// completes a migration while a persistent bitmap of a disk is busy, so a busy one (ferry's
/// export not closed, or anyone else's job) fails the migration, and the source runs on.
pub async fn none_busy(qmp: &Qmp, disks: &[String]) -> Result<()> {
    let all = nodes(qmp).await?;
    for disk in disks {
        if let Some(b) = node(&all, disk)
            .into_iter()
            .flat_map(|n| &n.dirty_bitmaps)
            .find(|b| b.busy && b.persistent)
        {
            bail!(
                "disk {disk:?}: its persistent bitmap {} is in use, and QEMU would abort when the migration completes",
                b.name
            );
        }
    }
    Ok(())
}

/// The source's bitmaps, read as the snapshots go: every part of a snapshot is asked about
/// after its data was read (it is in the buffer), so a part still clean was unchanged then.
pub struct BitmapView {
    changed: ChangedSince,
    readers: Vec<BlockStatusReader<UnixStream>>,
}

impl BitmapView {
    /// What to send for a snapshot's operations.
    pub async fn filter(&mut self, ops: Vec<DiskOp>) -> Result<Vec<DiskOp>> {
        for (disk, offset, len) in ranges_to_ask(&ops) {
            let Some(reader) = self.readers.get_mut(usize::from(disk)) else {
                continue;
            };
            let dirty = reader
                .ranges(offset, len)
                .await
                .context("reading the source's dirty bitmap")?;
            for (offset, len) in dirty {
                self.changed.mark_dirty(disk, offset, len);
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

/// Gaps up to this are asked about with their neighbours: one request instead of two.
const ASK_ACROSS: u64 = 1 << 20;

/// The ranges of a snapshot's writes and zeroes, per disk, sorted and merged across small
/// gaps: what to ask the bitmap about (a whole-disk span would be answered with every dirty
/// extent of the disk).
fn ranges_to_ask(ops: &[DiskOp]) -> Vec<(u8, u64, u64)> {
    let mut ranges: Vec<(u8, u64, u64)> = ops
        .iter()
        .filter(|op| matches!(op, DiskOp::Write { .. } | DiskOp::Zeroes { .. }))
        .filter_map(DiskOp::range)
        .filter(|&(_, _, len)| len > 0)
        .collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u8, u64, u64)> = Vec::with_capacity(ranges.len());
    for (disk, offset, len) in ranges {
        match merged.last_mut() {
            Some((d, o, l)) if *d == disk && offset <= *o + *l + ASK_ACROSS => {
                *l = (*l).max(offset + len - *o);
            }
            _ => merged.push((disk, offset, len)),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(disk: u8, offset: u64, len: usize) -> DiskOp {
        DiskOp::Write {
            disk,
            offset,
            data: vec![1; len],
        }
    }

    #[test]
    fn a_snapshot_is_asked_about_by_range_per_disk_merged_across_small_gaps() {
        let ops = vec![
            write(0, 10 << 20, 4096),
            write(1, 0, 4096),
            write(0, 0, 4096),
            DiskOp::Trim {
                disk: 0,
                offset: 5 << 20,
                len: 4096,
            },
            write(0, 4096, 8192),
            DiskOp::Zeroes {
                disk: 0,
                offset: (10 << 20) + (1 << 20),
                len: 4096,
                may_trim: false,
            },
            DiskOp::Flush { disk: 0 },
        ];
        assert_eq!(
            ranges_to_ask(&ops),
            vec![(0, 0, 12288), (0, 10 << 20, (1 << 20) + 4096), (1, 0, 4096)]
        );
    }

    /// Only a clean, recording `left` marker of a session the source tracks matches; every
    /// other case falls back to the content index, with its reason.
    #[test]
    fn a_copy_matches_by_bitmap_only_when_its_marker_is_clean_consistent_and_recording() {
        let (s1, s2) = (
            "0123456789abcdef0123456789abcdef",
            "fedcba9876543210fedcba9876543210",
        );
        let plans = [DiskPlan {
            node: "disk0".into(),
            size: 1 << 20,
            backing_sha256: None,
            tracked_since: vec![s1.into()],
            image: None,
            layers: Vec::new(),
        }];
        let here = |bitmaps: serde_json::Value| -> Vec<BlockNode> {
            serde_json::from_value(serde_json::json!([{
                "node-name": "disk0",
                "image": {"virtual-size": 1 << 20},
                "dirty-bitmaps": bitmaps,
            }]))
            .unwrap()
        };
        let bitmap = |session: &str, count: u64, recording: bool, inconsistent: bool| {
            serde_json::json!({
                "name": marker(LEFT, session, "disk0"), "count": count, "granularity": 4096,
                "recording": recording, "busy": false, "persistent": true,
                "inconsistent": inconsistent,
            })
        };
        let check = |bitmaps| untouched_in(&here(bitmaps), &plans, &[None]);

        assert_eq!(
            check(serde_json::json!([bitmap(s1, 0, true, false)])),
            Ok(vec![s1.to_owned()])
        );
        let name = marker(LEFT, s1, "disk0");
        assert_eq!(
            check(serde_json::json!([bitmap(s1, 0, true, true)])),
            Err(format!(
                "disk \"disk0\": bitmap {name} cannot be trusted (QEMU found it in use when it \
                 opened the image)"
            ))
        );
        assert_eq!(
            check(serde_json::json!([bitmap(s1, 0, false, false)])),
            Err(format!(
                "disk \"disk0\": bitmap {name} cannot be trusted (it does not record)"
            ))
        );
        assert_eq!(
            check(serde_json::json!([bitmap(s1, 8192, true, false)])),
            Err(
                "disk \"disk0\": the copy here changed after the VM left (8192 bytes written)"
                    .to_owned()
            )
        );
        // A marker of a session the source does not track, or none at all.
        for bitmaps in [
            serde_json::json!([bitmap(s2, 0, true, false)]),
            serde_json::json!([]),
        ] {
            assert_eq!(
                check(bitmaps),
                Err("disk \"disk0\": no bitmap from the VM's departure here".to_owned())
            );
        }
        // Another chain below the disk: its marker says nothing of it.
        assert_eq!(
            untouched_in(
                &here(serde_json::json!([bitmap(s1, 0, true, false)])),
                &plans,
                &[Some("their chain".into())]
            ),
            Err("disk \"disk0\": its backing images differ from the source's".to_owned())
        );
    }

    #[test]
    fn markers_match_their_own_disk_only() {
        let s = "0123456789abcdef0123456789abcdef";
        let name = marker(LEFT, s, "disk0");
        assert_eq!(session_of(&name, LEFT, "disk0"), Some(s));
        assert_eq!(session_of(&name, LEFT, "disk1"), None);
        assert_eq!(session_of(&name, ARRIVED, "disk0"), None);
        assert_eq!(session_of("ferry-left-short-disk0", LEFT, "disk0"), None);
    }
}
