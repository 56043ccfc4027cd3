//! The backing layers a destination lacks, shipped before it starts the VM (SnapMig at any
//! depth, issue 21). The source's plan lists every file below each disk's overlay, top down,
//! by the name the image above gives it, with its length and SHA-256 ([`Layer`]). Where the
//! destination agent starts the VM itself and makes the disk's image ([`super::image`]), it
//! walks that chain from the image's directory: a layer it holds with the same bytes stays, a
//! layer it lacks is asked for (`NeedLayers`), and a layer it holds with other bytes is never
//! overwritten (the disk then crosses whole, as without a chain). The source sends each file
//! asked for whole, zstd piece by piece, lowest layer first, so a cut link leaves complete
//! lower layers behind; the destination writes it as `NAME.<session>.partial`, checks its
//! length and hash, and links it into place (never replacing a file: one that appeared
//! meanwhile is taken only with the same bytes). Then its image is made as an overlay on the
//! completed chain, and only the source's overlay crosses (`Ready.top_only`). Only names
//! that keep every layer below the image's directory are shipped, and only as regular files.
//!
//! A layer that arrived stays after a failed migration: its bytes were checked, and the next
//! attempt, or the next VM on the same template, needs it. A receipt holds a lock on its
//! partial file (`flock`, released by the kernel when its agent dies); the next receipt of the
//! same layer removes the partial files no one holds that are older than a minute.
//!
//! Layers frame, on [`LAYERS`]: one zstd frame of at most [`PIECE`] bytes of the file; the
//! files follow one another in the order asked, each as long as its [`Layer::bytes`].

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use ferry_qemu::blockdev_args::image_file;
use ferry_wire::{Received, Session};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::backing::content_sha256;
use crate::engine::control::{self, Control, DiskPlan, Layer, LayerWanted, LAYERS};

/// The deepest chain a destination walks (a count a peer states, capped like every other).
pub const MAX_LAYERS: usize = 16;
/// The most file bytes one frame carries.
const PIECE: usize = 1 << 20;
/// zstd's level for layers: templates are mostly file systems, which compress well and fast.
const ZSTD_LEVEL: i32 = 3;

/// Where each of `layers` is on this host, resolved from `image` down as QEMU resolves them
/// (a relative name is relative to the directory of the image that names it).
fn layer_paths(image: &Path, layers: &[Layer]) -> Vec<PathBuf> {
    let mut above = image.to_owned();
    layers
        .iter()
        .map(|layer| {
            let name = Path::new(&layer.name);
            let path = if name.is_absolute() {
                name.to_owned()
            } else {
                above.parent().unwrap_or(Path::new("/")).join(name)
            };
            above.clone_from(&path);
            path
        })
        .collect()
}

/// Whether a name keeps a layer below the directory of the image that names it: relative,
/// only plain components (no `..`, no `.`), and no `:` (QEMU reads `proto:` names as
/// protocols, not files).
fn shippable(name: &str) -> bool {
    let path = Path::new(name);
    !name.is_empty()
        && !name.contains(':')
        && path.components().all(|c| matches!(c, Component::Normal(_)))
}

/// What this host holds of one disk's backing chain.
#[derive(Debug, PartialEq)]
enum Found {
    /// Every layer, with the source's bytes.
    All,
    /// These layers (indices, top down) are missing; the others are the source's.
    Lacks(Vec<usize>),
    /// The chain cannot be completed here, for this reason: the disk crosses whole.
    Not(String),
}

async fn walk(image: &Path, layers: &[Layer]) -> Found {
    if layers.len() > MAX_LAYERS {
        return Found::Not(format!(
            "a chain {} layers deep (at most {MAX_LAYERS} are walked)",
            layers.len()
        ));
    }
    let mut lacks = Vec::new();
    // Whether every name so far kept the chain below the image's directory: a missing layer
    // is written only there (a peer never picks where on this host a file goes).
    let mut beneath = true;
    for (i, (layer, path)) in layers.iter().zip(layer_paths(image, layers)).enumerate() {
        beneath &= shippable(&layer.name);
        match std::fs::metadata(&path) {
            Ok(meta) if !meta.is_file() => {
                return Found::Not(format!("{} is not a regular file", path.display()))
            }
            Ok(_) => match content_sha256(&path).await {
                Ok(ours) if ours == layer.sha256 => {}
                Ok(_) => {
                    return Found::Not(format!(
                        "{} holds other bytes than the source's {:?}",
                        path.display(),
                        layer.name
                    ))
                }
                Err(e) => return Found::Not(format!("{e:#}")),
            },
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Found::Not(format!("{}: {e}", path.display()))
            }
            Err(_) if !beneath => {
                return Found::Not(format!(
                    "{} is missing, and the chain names it {:?}: only layers named relative to \
                     the image, below its directory, are shipped",
                    path.display(),
                    layer.name
                ))
            }
            Err(_) if !path.parent().is_some_and(Path::is_dir) => {
                return Found::Not(format!(
                    "{} is missing, and so is its directory",
                    path.display()
                ))
            }
            Err(_) => lacks.push(i),
        }
    }
    if lacks.is_empty() {
        Found::All
    } else {
        Found::Lacks(lacks)
    }
}

/// The layers to ask the source for: of each disk whose image `argv` opens is missing here
/// (it is made here, as an overlay on the chain the source's image names), the layers this
/// host lacks, lowest first, each file once (two disks may share a template). A chain that
/// cannot be completed is said in the log: its disk crosses whole.
pub async fn wanted(argv: &[String], disks: &[DiskPlan]) -> Vec<LayerWanted> {
    let mut wanted = Vec::new();
    let mut asked: HashSet<PathBuf> = HashSet::new();
    let mut room = Room::default();
    for (disk, plan) in disks.iter().enumerate() {
        let Some(image) = image_file(argv, &plan.node) else {
            continue;
        };
        // Only a chain the image made here will name: its backing file as the source's does.
        let names_chain = plan.layers.first().is_some_and(|top| {
            plan.image.as_ref().and_then(|i| i.backing.as_deref()) == Some(top.name.as_str())
        });
        if !names_chain || image.try_exists().unwrap_or(true) {
            continue;
        }
        let paths = layer_paths(&image, &plan.layers);
        let lacks = match walk(&image, &plan.layers).await {
            Found::All => continue,
            Found::Lacks(lacks) => lacks,
            Found::Not(why) => {
                tracing::info!("disk {:?}: {why}: the disk crosses whole", plan.node);
                continue;
            }
        };
        // Lowest first; a file another disk (or this one, twice) asked for goes once.
        let mut seen = asked.clone();
        let new: Vec<usize> = lacks
            .into_iter()
            .rev()
            .filter(|&i| seen.insert(paths[i].clone()))
            .collect();
        let takes: Vec<(PathBuf, u64)> = new
            .iter()
            .map(|&i| {
                let dir = paths[i].parent().unwrap_or(Path::new("/")).to_owned();
                (dir, plan.layers[i].bytes)
            })
            .collect();
        if let Err(why) = room.take(&takes) {
            tracing::info!("disk {:?}: {why}: the disk crosses whole", plan.node);
            continue;
        }
        asked = seen;
        for i in new {
            wanted.push(LayerWanted {
                disk: u32::try_from(disk).expect("at most 255 disks"),
                layer: u32::try_from(i).expect("at most MAX_LAYERS"),
            });
        }
    }
    wanted
}

/// The free space of each file system layers go to, less what the layers asked for so far
/// take there.
#[derive(Default)]
struct Room(HashMap<u64, u64>);

impl Room {
    /// Takes room for each (directory, bytes) if every file system has it; else nothing, and
    /// says where it lacks.
    fn take(&mut self, takes: &[(PathBuf, u64)]) -> std::result::Result<(), String> {
        let mut per_fs: HashMap<u64, (u64, u64, &Path)> = HashMap::new();
        for (dir, bytes) in takes {
            let (fs, free) = free_bytes(dir).map_err(|e| format!("{e:#}"))?;
            let free = self.0.get(&fs).copied().unwrap_or(free);
            let (need, _, _) = per_fs.entry(fs).or_insert((0, free, dir));
            *need = need
                .checked_add(*bytes)
                .ok_or("its layers' stated sizes overflow")?;
        }
        for (need, free, dir) in per_fs.values() {
            if need > free {
                return Err(format!(
                    "its missing layers take {need} bytes in {}, more than the {free} free there",
                    dir.display()
                ));
            }
        }
        for (fs, (need, free, _)) in per_fs {
            self.0.insert(fs, free - need);
        }
        Ok(())
    }
}

/// The file system holding `dir` (its id) and the bytes an unprivileged writer may still put
/// on it.
fn free_bytes(dir: &Path) -> Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: `statvfs` is a plain C struct of integers, for which all zeros is a value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid C string and `st` a valid out-parameter.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).context(format!("statvfs {}", dir.display()));
    }
    Ok((st.f_fsid, st.f_bavail.saturating_mul(st.f_frsize)))
}

/// What was shipped: how many files and their bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Shipped {
    pub layers: u32,
    pub bytes: u64,
}

/// Destination: receives the layers asked for and puts each in place, checked. Layers placed
/// before a failure stay (see the module's doc). The source's `Abort` ends the wait, and so
/// does its silence past `wan_timeout`.
pub async fn receive(
    session: &Session,
    argv: &[String],
    disks: &[DiskPlan],
    wanted: &[LayerWanted],
    wan_timeout: Duration,
) -> Result<Shipped> {
    let mut shipped = Shipped::default();
    for w in wanted {
        let plan = &disks[w.disk as usize];
        let layer = &plan.layers[w.layer as usize];
        let image = image_file(argv, &plan.node).context("the disk's image left the argv")?;
        let path = layer_paths(&image, &plan.layers)[w.layer as usize].clone();
        receive_one(session, layer, &path, wan_timeout)
            .await
            .with_context(|| format!("receiving backing layer {}", path.display()))?;
        tracing::info!(
            "disk {:?}: backing layer {} arrived ({} bytes)",
            plan.node,
            path.display(),
            layer.bytes
        );
        shipped.layers += 1;
        shipped.bytes = shipped.bytes.saturating_add(layer.bytes);
    }
    Ok(shipped)
}

/// The next frame of the layers channel, unless the source gives up or falls silent first.
async fn next_frame(session: &Session, wan_timeout: Duration) -> Result<Bytes> {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            got = session.recv(LAYERS) => return match got? {
                Received::Data(frame) => Ok(frame),
                Received::Barrier => bail!("unexpected barrier on the layers channel"),
            },
            msg = control::recv(session) => match msg? {
                Control::Abort { reason } => bail!("the source gave up: {reason}"),
                other => bail!("unexpected message from the source: {other:?}"),
            },
            _ = tick.tick() => {
                if session.idle_for() > wan_timeout {
                    bail!(
                        "no connection from the source agent for {}s (the WAN timeout)",
                        wan_timeout.as_secs()
                    );
                }
            }
        }
    }
}

async fn receive_one(
    session: &Session,
    layer: &Layer,
    path: &Path,
    wan_timeout: Duration,
) -> Result<()> {
    // The session's own file: another migration receiving the same layer writes its own.
    sweep_stale_partials(path, STALE_PARTIAL_AGE);
    let mut partial = path.as_os_str().to_owned();
    partial.push(format!(".{}.partial", session.id()));
    let partial = PathBuf::from(partial);
    let written = async {
        let mut file = tokio::fs::File::options()
            .write(true)
            .create_new(true)
            .open(&partial)
            .await
            .with_context(|| format!("creating {}", partial.display()))?;
        // Held while the file is open: it tells a live receipt's file from one a dead agent
        // left ([`sweep_stale_partials`]).
        if !try_lock(&file)? {
            bail!("{} is locked by another process", partial.display());
        }
        let mut hash = Sha256::new();
        let mut got = 0u64;
        while got < layer.bytes {
            let frame = next_frame(session, wan_timeout).await?;
            let piece = zstd::bulk::decompress(&frame, PIECE)
                .context("a layer frame that does not decompress to at most 1 MiB")?;
            got += piece.len() as u64;
            if got > layer.bytes {
                bail!(
                    "the source sent more than the {} bytes it stated",
                    layer.bytes
                );
            }
            hash.update(&piece);
            file.write_all(&piece).await?;
        }
        file.sync_all().await?;
        let ours = format!("{:x}", hash.finalize());
        if ours != layer.sha256 {
            bail!(
                "its bytes hash to {ours}, the source stated {}",
                layer.sha256
            );
        }
        place(&partial, path, &layer.sha256).await
    }
    .await;
    let _ = std::fs::remove_file(&partial);
    written
}

/// How old a partial file no receipt holds must be to be removed: a receipt locks its file
/// right after creating it, so a younger one may be a live receipt's not yet locked.
const STALE_PARTIAL_AGE: Duration = Duration::from_secs(60);

/// An exclusive `flock` on `file` if no one else holds one; false if someone does.
fn try_lock(file: &impl std::os::fd::AsRawFd) -> std::io::Result<bool> {
    // SAFETY: flock on a descriptor the caller keeps open; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Removes the partial files of `path` (`NAME.<session>.partial`) that no receipt holds and
/// that are older than `min_age`: an agent that died while receiving left them. Failures
/// only leave them (logged).
fn sweep_stale_partials(path: &Path, min_age: Duration) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!("{}.", name.to_string_lossy());
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        let Some(session) = file_name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".partial"))
        else {
            continue;
        };
        if session.is_empty() || !session.chars().all(|c| c.is_ascii_alphanumeric()) {
            continue;
        }
        let old = entry.metadata().ok().filter(|m| m.is_file()).and_then(|m| {
            m.modified()
                .ok()
                .and_then(|t| t.elapsed().ok())
                .map(|age| age > min_age)
        });
        // Locked: a live receipt's. The lock is kept until the file is removed.
        let unheld = std::fs::File::open(entry.path())
            .ok()
            .filter(|f| try_lock(f).unwrap_or(false));
        if old == Some(true) && unheld.is_some() {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!(
                    "removed {}, a backing layer's partial copy left by an earlier receipt",
                    entry.path().display()
                ),
                Err(e) => tracing::warn!("{}: {e}", entry.path().display()),
            }
        }
    }
}

/// Puts the checked file `partial` at `path` without ever replacing a file there: one that
/// appeared meanwhile (another migration brought the same layer) is taken if it holds the
/// same bytes, and is an error otherwise.
async fn place(partial: &Path, path: &Path, sha256: &str) -> Result<()> {
    match std::fs::hard_link(partial, path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let theirs = content_sha256(path).await?;
            if theirs != sha256 {
                bail!(
                    "{} appeared meanwhile, with other bytes: left as it is",
                    path.display()
                );
            }
        }
        Err(e) => {
            return Err(e).with_context(|| format!("linking {} into place", partial.display()))
        }
    }
    // The new name lasts a crash of the host once its directory is on disk.
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("syncing {}", dir.display()))?;
    }
    Ok(())
}

/// Source: sends the layers the destination asked for, from `files` (each plan's chain here,
/// as [`super::mirror::add_backing`] found it).
pub async fn send(
    session: &Session,
    disks: &[DiskPlan],
    files: &[Vec<PathBuf>],
    wanted: &[LayerWanted],
) -> Result<Shipped> {
    if wanted.len() > MAX_LAYERS * disks.len() {
        bail!(
            "the destination asked for {} layers of {} disk(s)",
            wanted.len(),
            disks.len()
        );
    }
    let mut shipped = Shipped::default();
    for w in wanted {
        let (Some(plan), Some(chain)) = (disks.get(w.disk as usize), files.get(w.disk as usize))
        else {
            bail!(
                "the destination asked for a layer of disk {}, which this migration has not",
                w.disk
            );
        };
        let (Some(layer), Some(path)) = (
            plan.layers.get(w.layer as usize),
            chain.get(w.layer as usize),
        ) else {
            bail!(
                "the destination asked for layer {} of disk {:?}, whose chain has {}",
                w.layer,
                plan.node,
                plan.layers.len()
            );
        };
        send_one(session, layer, path)
            .await
            .with_context(|| format!("sending backing layer {}", path.display()))?;
        shipped.layers += 1;
        shipped.bytes = shipped.bytes.saturating_add(layer.bytes);
    }
    Ok(shipped)
}

async fn send_one(session: &Session, layer: &Layer, path: &Path) -> Result<()> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes>>(4);
    let (path, layer) = (path.to_owned(), layer.clone());
    // Reading and compressing are blocking work; the frames go out as they come.
    let reader = tokio::task::spawn_blocking(move || {
        let read = || -> Result<()> {
            let mut file = std::fs::File::open(&path)?;
            if file.metadata()?.len() != layer.bytes {
                bail!("it changed since it was hashed");
            }
            let mut hash = Sha256::new();
            let mut buf = vec![0u8; PIECE];
            let mut left = layer.bytes;
            while left > 0 {
                let n = usize::try_from(left.min(PIECE as u64)).expect("at most PIECE");
                file.read_exact(&mut buf[..n])?;
                hash.update(&buf[..n]);
                let frame = zstd::bulk::compress(&buf[..n], ZSTD_LEVEL)?;
                if tx.blocking_send(Ok(Bytes::from(frame))).is_err() {
                    return Ok(());
                }
                left -= n as u64;
            }
            if format!("{:x}", hash.finalize()) != layer.sha256 {
                bail!("it changed since it was hashed");
            }
            Ok(())
        };
        if let Err(e) = read() {
            let _ = tx.blocking_send(Err(e));
        }
    });
    while let Some(frame) = rx.recv().await {
        session.send(LAYERS, frame?).await?;
    }
    reader.await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(name: &str, bytes: &[u8]) -> Layer {
        Layer {
            name: name.into(),
            format: Some("raw".into()),
            bytes: bytes.len() as u64,
            sha256: format!("{:x}", Sha256::digest(bytes)),
        }
    }

    #[test]
    fn names_resolve_from_the_image_down_and_only_relative_ones_below_it_are_shipped() {
        let layers = [
            layer("mid.qcow2", b""),
            layer("lib/base.qcow2", b""),
            layer("/abs/root.raw", b""),
        ];
        assert_eq!(
            layer_paths(Path::new("/vms/top.qcow2"), &layers),
            [
                PathBuf::from("/vms/mid.qcow2"),
                PathBuf::from("/vms/lib/base.qcow2"),
                PathBuf::from("/abs/root.raw"),
            ]
        );
        assert!(shippable("mid.qcow2") && shippable("lib/base.qcow2"));
        for name in [
            "/abs/root.raw",
            "../x.qcow2",
            "lib/../../x",
            "./x",
            "",
            "json:{\"driver\":\"file\"}",
            "nbd:host:10809",
        ] {
            assert!(!shippable(name), "{name:?}");
        }
    }

    #[tokio::test]
    async fn a_walk_asks_for_what_is_missing_and_never_for_a_file_held_with_other_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("top.qcow2");
        let (mid, base) = (layer("mid", b"middle"), layer("base", b"bottom"));
        let chain = [mid.clone(), base.clone()];
        assert_eq!(walk(&image, &chain).await, Found::Lacks(vec![0, 1]));
        std::fs::write(dir.path().join("base"), b"bottom").unwrap();
        assert_eq!(walk(&image, &chain).await, Found::Lacks(vec![0]));
        std::fs::write(dir.path().join("mid"), b"middle").unwrap();
        assert_eq!(walk(&image, &chain).await, Found::All);
        std::fs::write(dir.path().join("base"), b"BOTTOM").unwrap();
        let Found::Not(why) = walk(&image, &chain).await else {
            panic!("a layer with other bytes was taken");
        };
        assert!(
            why.contains("holds other bytes than the source's \"base\""),
            "{why}"
        );
        let deep = vec![mid; MAX_LAYERS + 1];
        assert!(matches!(walk(&image, &deep).await, Found::Not(_)));
        let outside = [layer("../elsewhere", b"x")];
        let Found::Not(why) = walk(&image, &outside).await else {
            panic!("a layer outside the image's directory was asked for");
        };
        assert!(
            why.contains("only layers named relative to the image"),
            "{why}"
        );
        // Below a layer held elsewhere (named absolutely), a missing one is not written
        // there either.
        let elsewhere = tempfile::tempdir().unwrap();
        let held = elsewhere.path().join("held");
        std::fs::write(&held, b"held").unwrap();
        let via = [
            layer(&held.to_string_lossy(), b"held"),
            layer("below", b"x"),
        ];
        let Found::Not(why) = walk(&image, &via).await else {
            panic!("a layer below an absolute one was asked for");
        };
        assert!(
            why.contains("only layers named relative to the image"),
            "{why}"
        );
        // A name that is not a regular file here.
        std::fs::create_dir(dir.path().join("adir")).unwrap();
        let Found::Not(why) = walk(&image, &[layer("adir", b"x")]).await else {
            panic!("a directory was taken for a layer");
        };
        assert!(why.ends_with("is not a regular file"), "{why}");
    }

    fn argv(image: &Path) -> Vec<String> {
        vec![
            "qemu".into(),
            "-blockdev".into(),
            format!("driver=file,filename={},node-name=d-file", image.display()),
            "-blockdev".into(),
            "driver=qcow2,file=d-file,node-name=d".into(),
        ]
    }

    /// A disk whose image names the first of `layers` as its backing file.
    fn plan(layers: Vec<Layer>) -> DiskPlan {
        DiskPlan {
            node: "d".into(),
            size: 1 << 20,
            backing_sha256: None,
            tracked_since: Vec::new(),
            image: Some(crate::engine::control::ImageShape {
                format: "qcow2".into(),
                backing: layers.first().map(|l| l.name.clone()),
                backing_format: Some("qcow2".into()),
            }),
            layers,
        }
    }

    #[test]
    fn partial_copies_no_receipt_holds_are_swept_once_a_minute_old_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let layer = dir.path().join("base.qcow2");
        let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
        let make = |name: &str, old: bool| {
            let f = std::fs::File::create(dir.path().join(name)).unwrap();
            if old {
                f.set_modified(hour_ago).unwrap();
            }
        };
        make("base.qcow2.00ff17.partial", true);
        // A live receipt's (locked, however old), a young one, another layer's, and not a
        // partial of ours at all.
        make("base.qcow2.5e55.partial", true);
        let live = std::fs::File::open(dir.path().join("base.qcow2.5e55.partial")).unwrap();
        assert!(try_lock(&live).unwrap());
        make("base.qcow2.77aa01.partial", false);
        make("other.qcow2.00ff17.partial", true);
        make("base.qcow2.x.y.partial", true);
        make("base.qcow2", true);
        sweep_stale_partials(&layer, STALE_PARTIAL_AGE);
        let mut left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "base.qcow2",
                "base.qcow2.5e55.partial",
                "base.qcow2.77aa01.partial",
                "base.qcow2.x.y.partial",
                "other.qcow2.00ff17.partial"
            ]
        );
    }

    fn partials(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .to_string_lossy()
                    .ends_with(".partial")
            })
            .count()
    }

    #[tokio::test]
    async fn missing_layers_cross_lowest_first_checked_and_land_in_place() {
        let (src, dst) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // Over a piece, so that a file takes several frames.
        let base_bytes: Vec<u8> = (0..PIECE * 2 + 5)
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect();
        let mid_bytes = b"the middle layer".to_vec();
        std::fs::write(src.path().join("base"), &base_bytes).unwrap();
        std::fs::write(src.path().join("mid"), &mid_bytes).unwrap();
        let disks = [plan(vec![
            layer("mid", &mid_bytes),
            layer("base", &base_bytes),
        ])];
        let files = [vec![src.path().join("mid"), src.path().join("base")]];
        let argv = argv(&dst.path().join("top.qcow2"));

        let wanted = wanted(&argv, &disks).await;
        assert_eq!(
            wanted,
            [
                LayerWanted { disk: 0, layer: 1 },
                LayerWanted { disk: 0, layer: 0 }
            ]
        );
        let (a, b) = crate::engine::test_session::pair().await;
        let (sent, got) = tokio::join!(
            send(&a, &disks, &files, &wanted),
            receive(&b, &argv, &disks, &wanted, Duration::from_secs(5))
        );
        let expected = Shipped {
            layers: 2,
            bytes: (base_bytes.len() + mid_bytes.len()) as u64,
        };
        assert_eq!((sent.unwrap(), got.unwrap()), (expected, expected));
        assert_eq!(std::fs::read(dst.path().join("base")).unwrap(), base_bytes);
        assert_eq!(std::fs::read(dst.path().join("mid")).unwrap(), mid_bytes);
        assert_eq!(partials(dst.path()), 0);
        // Now held: nothing more is asked for.
        assert!(super::wanted(&argv, &disks).await.is_empty());
    }

    #[tokio::test]
    async fn a_layer_whose_bytes_do_not_hash_as_stated_is_not_put_in_place() {
        let (src, dst) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::write(src.path().join("base"), b"the source's bytes").unwrap();
        let mut stated = layer("base", b"the source's bytes");
        let disks_here = [plan(vec![stated.clone()])];
        // The destination was told another hash (a file changed between hashing and
        // sending would look the same to it).
        stated.sha256 = format!("{:x}", Sha256::digest(b"other"));
        let disks_there = [plan(vec![stated])];
        let argv = argv(&dst.path().join("top.qcow2"));
        let wanted = [LayerWanted { disk: 0, layer: 0 }];
        let (a, b) = crate::engine::test_session::pair().await;
        let files = [vec![src.path().join("base")]];
        let (sent, got) = tokio::join!(
            send(&a, &disks_here, &files, &wanted),
            receive(&b, &argv, &disks_there, &wanted, Duration::from_secs(5))
        );
        sent.unwrap();
        let err = format!("{:#}", got.unwrap_err());
        assert!(
            err.starts_with(&format!(
                "receiving backing layer {}: its bytes hash to",
                dst.path().join("base").display()
            )),
            "{err}"
        );
        assert!(!dst.path().join("base").exists());
        assert_eq!(partials(dst.path()), 0);
    }

    /// A source that gives up (its file changed, the user cancelled) says so on the control
    /// channel: the destination stops waiting for the layer and leaves nothing of it.
    #[tokio::test]
    async fn the_sources_abort_ends_the_wait_for_a_layer() {
        let dst = tempfile::tempdir().unwrap();
        let disks = [plan(vec![layer("base", b"x")])];
        let argv = argv(&dst.path().join("top.qcow2"));
        let (a, b) = crate::engine::test_session::pair().await;
        let abort = Control::Abort {
            reason: "it changed since it was hashed".into(),
        };
        control::send(&a, &abort).await.unwrap();
        let wanted = [LayerWanted { disk: 0, layer: 0 }];
        let err = receive(&b, &argv, &disks, &wanted, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(
            format!("{err:#}"),
            format!(
                "receiving backing layer {}: the source gave up: it changed since it was hashed",
                dst.path().join("base").display()
            )
        );
        assert_eq!(partials(dst.path()), 0);
    }

    #[tokio::test]
    async fn a_layer_that_appeared_meanwhile_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let (partial, path) = (dir.path().join("l.partial"), dir.path().join("l"));
        let ours = format!("{:x}", Sha256::digest(b"ours"));
        std::fs::write(&partial, b"ours").unwrap();
        std::fs::write(&path, b"theirs").unwrap();
        let err = place(&partial, &path, &ours).await.unwrap_err();
        assert!(err
            .to_string()
            .ends_with("appeared meanwhile, with other bytes: left as it is"));
        assert_eq!(std::fs::read(&path).unwrap(), b"theirs");
        // The same bytes: taken as they are.
        std::fs::write(&path, b"ours").unwrap();
        place(&partial, &path, &ours).await.unwrap();
        std::fs::remove_file(&path).unwrap();
        place(&partial, &path, &ours).await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"ours");
    }

    #[tokio::test]
    async fn only_a_chain_the_made_image_names_is_completed() {
        let dir = tempfile::tempdir().unwrap();
        let argv = argv(&dir.path().join("top.qcow2"));
        let mut other = plan(vec![layer("base", b"x")]);
        other.image.as_mut().unwrap().backing = Some("another".into());
        assert!(wanted(&argv, &[other]).await.is_empty());
        let mut none = plan(vec![layer("base", b"x")]);
        none.image = None;
        assert!(wanted(&argv, &[none]).await.is_empty());
        // Stated sizes beyond any file system: the disk crosses whole.
        let mut huge = plan(vec![layer("mid", b"x"), layer("base", b"y")]);
        huge.layers.iter_mut().for_each(|l| l.bytes = u64::MAX);
        assert!(wanted(&argv, &[huge]).await.is_empty());
    }

    #[tokio::test]
    async fn a_request_for_a_layer_the_source_has_not_is_refused() {
        let (a, _b) = crate::engine::test_session::pair().await;
        let disks = [plan(vec![layer("base", b"x")])];
        let files = [vec![PathBuf::from("/nonexistent/base")]];
        for (asked, refusal) in [
            (
                LayerWanted { disk: 0, layer: 3 },
                "the destination asked for layer 3 of disk \"d\", whose chain has 1",
            ),
            (
                LayerWanted { disk: 2, layer: 0 },
                "the destination asked for a layer of disk 2, which this migration has not",
            ),
        ] {
            let err = send(&a, &disks, &files, &[asked]).await.unwrap_err();
            assert_eq!(err.to_string(), refusal);
        }
    }
}
