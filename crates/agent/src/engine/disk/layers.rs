//! The backing layers a destination lacks, shipped before it starts the VM (SnapMig at any
//! depth, issue 21). The source's plan lists every file below each disk's overlay, top down,
//! by the name the image above gives it, with its length and SHA-256 ([`Layer`]). Where the
//! destination agent starts the VM itself and makes the disk's image ([`super::image`]), it
//! walks that chain from the image's directory: a layer it holds with the same bytes stays, a
//! layer it lacks is asked for (`NeedLayers`), and a layer it holds with other bytes is never
//! overwritten (the disk then crosses whole, as without a chain). The source sends each file
//! asked for whole, zstd piece by piece, lowest layer first, so a cut link leaves complete
//! lower layers behind; the destination writes it as `NAME.partial`, checks its length and
//! hash, and renames it into place. Then its image is made as an overlay on the completed
//! chain, and only the source's overlay crosses (`Ready.top_only`).
//!
//! A layer that arrived stays after a failed migration: its bytes were checked, and the next
//! attempt, or the next VM on the same template, needs it.
//!
//! Layers frame, on [`LAYERS`]: one zstd frame of at most [`PIECE`] bytes of the file; the
//! files follow one another in the order asked, each as long as its [`Layer::bytes`].

use std::collections::HashSet;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use ferry_qemu::blockdev_args::image_file;
use ferry_wire::{Received, Session};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::backing::content_sha256;
use crate::engine::control::{DiskPlan, Layer, LayerWanted, LAYERS};

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

/// Whether a layer this host lacks may be written where its name puts it: only a name
/// relative to the image above and below its directory. A peer never chooses an absolute
/// path on this host, nor one outside the image's own tree.
fn shippable(name: &str) -> bool {
    let name = Path::new(name);
    !name.as_os_str().is_empty() && name.components().all(|c| matches!(c, Component::Normal(_)))
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
    for (i, (layer, path)) in layers.iter().zip(layer_paths(image, layers)).enumerate() {
        match path.try_exists() {
            Ok(true) => match content_sha256(&path).await {
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
            Ok(false) if !shippable(&layer.name) => {
                return Found::Not(format!(
                    "{} is missing, and the source names it {:?}: only a name relative to the \
                     image, below its directory, is shipped",
                    path.display(),
                    layer.name
                ))
            }
            Ok(false) if !path.parent().is_some_and(Path::is_dir) => {
                return Found::Not(format!(
                    "{} is missing, and so is its directory",
                    path.display()
                ))
            }
            Ok(false) => lacks.push(i),
            Err(e) => return Found::Not(format!("{}: {e}", path.display())),
        }
    }
    if lacks.is_empty() {
        Found::All
    } else {
        Found::Lacks(lacks)
    }
}

/// The layers to ask the source for: of each disk whose image `argv` opens is missing here
/// (it is made here, and can be an overlay only on a whole chain), the layers this host
/// lacks, lowest first, each file once (two disks may share a template). A chain that cannot
/// be completed is said in the log: its disk crosses whole.
pub async fn wanted(argv: &[String], disks: &[DiskPlan]) -> Vec<LayerWanted> {
    let mut wanted = Vec::new();
    let mut asked: HashSet<PathBuf> = HashSet::new();
    let mut bytes = 0u64;
    let mut room = None;
    for (disk, plan) in disks.iter().enumerate() {
        let Some(image) = image_file(argv, &plan.node) else {
            continue;
        };
        if plan.layers.is_empty() || image.try_exists().unwrap_or(true) {
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
        let dir = image.parent().unwrap_or(Path::new("/")).to_owned();
        let free = *room.get_or_insert_with(|| free_bytes(&dir).unwrap_or(0));
        let new: Vec<usize> = lacks
            .into_iter()
            .rev()
            .filter(|&i| !asked.contains(&paths[i]))
            .collect();
        let need: u64 = new.iter().map(|&i| plan.layers[i].bytes).sum();
        if bytes.saturating_add(need) > free {
            tracing::info!(
                "disk {:?}: its missing layers take {need} bytes, more than the {} free here: \
                 the disk crosses whole",
                plan.node,
                free.saturating_sub(bytes)
            );
            continue;
        }
        bytes += need;
        for i in new {
            asked.insert(paths[i].clone());
            wanted.push(LayerWanted {
                disk: u32::try_from(disk).expect("at most 255 disks"),
                layer: u32::try_from(i).expect("at most MAX_LAYERS"),
            });
        }
    }
    wanted
}

/// Bytes an unprivileged writer may still put on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: `statvfs` is a plain C struct of integers, for which all zeros is a value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid C string and `st` a valid out-parameter.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).context(format!("statvfs {}", dir.display()));
    }
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// What was shipped: how many files and their bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Shipped {
    pub layers: u32,
    pub bytes: u64,
}

/// Destination: receives the layers asked for and puts each in place, checked. Layers placed
/// before a failure stay (see the module's doc).
pub async fn receive(
    session: &Session,
    argv: &[String],
    disks: &[DiskPlan],
    wanted: &[LayerWanted],
) -> Result<Shipped> {
    let mut shipped = Shipped::default();
    for w in wanted {
        let plan = &disks[w.disk as usize];
        let layer = &plan.layers[w.layer as usize];
        let image = image_file(argv, &plan.node).context("the disk's image left the argv")?;
        let path = layer_paths(&image, &plan.layers)[w.layer as usize].clone();
        receive_one(session, layer, &path)
            .await
            .with_context(|| format!("receiving backing layer {}", path.display()))?;
        tracing::info!(
            "disk {:?}: backing layer {} arrived ({} bytes)",
            plan.node,
            path.display(),
            layer.bytes
        );
        shipped.layers += 1;
        shipped.bytes += layer.bytes;
    }
    Ok(shipped)
}

async fn receive_one(session: &Session, layer: &Layer, path: &Path) -> Result<()> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    // What an attempt cut short left: it starts over.
    let _ = std::fs::remove_file(&partial);
    let written = async {
        let mut file = tokio::fs::File::options()
            .write(true)
            .create_new(true)
            .open(&partial)
            .await
            .with_context(|| format!("creating {}", partial.display()))?;
        let mut hash = Sha256::new();
        let mut got = 0u64;
        while got < layer.bytes {
            let frame = match session.recv(LAYERS).await? {
                Received::Data(frame) => frame,
                Received::Barrier => bail!("unexpected barrier on the layers channel"),
            };
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
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    std::fs::rename(&partial, path)
        .with_context(|| format!("renaming {} into place", partial.display()))?;
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
        shipped.bytes += layer.bytes;
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
        for name in ["/abs/root.raw", "../x.qcow2", "lib/../../x", "./x", ""] {
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
        assert!(why.contains("only a name relative to the image"), "{why}");
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

    fn plan(layers: Vec<Layer>) -> DiskPlan {
        DiskPlan {
            node: "d".into(),
            size: 1 << 20,
            backing_sha256: None,
            tracked_since: Vec::new(),
            image: None,
            layers,
        }
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
            receive(&b, &argv, &disks, &wanted)
        );
        let expected = Shipped {
            layers: 2,
            bytes: (base_bytes.len() + mid_bytes.len()) as u64,
        };
        assert_eq!((sent.unwrap(), got.unwrap()), (expected, expected));
        assert_eq!(std::fs::read(dst.path().join("base")).unwrap(), base_bytes);
        assert_eq!(std::fs::read(dst.path().join("mid")).unwrap(), mid_bytes);
        assert!(!dst.path().join("base.partial").exists());
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
            receive(&b, &argv, &disks_there, &wanted)
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
        assert!(!dst.path().join("base.partial").exists());
    }

    #[tokio::test]
    async fn a_request_for_a_layer_the_source_has_not_is_refused() {
        let (a, _b) = crate::engine::test_session::pair().await;
        let disks = [plan(vec![layer("base", b"x")])];
        let files = [vec![PathBuf::from("/nonexistent/base")]];
        let err = send(&a, &disks, &files, &[LayerWanted { disk: 0, layer: 3 }])
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the destination asked for layer 3 of disk \"d\", whose chain has 1"
        );
        let err = send(&a, &disks, &files, &[LayerWanted { disk: 2, layer: 0 }])
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the destination asked for a layer of disk 2, which this migration has not"
        );
    }
}
