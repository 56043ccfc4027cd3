//! Backing images (SnapMig): when a disk is a qcow2 overlay whose backing chain already exists
//! at the destination with the same content, only the overlay is copied (`sync=top`). Both
//! agents hash every file of the chain below the overlay, and compare one digest of them all:
//! a layer that matches on a base that does not would otherwise give the guest wrong data. A
//! file's hash is kept per (path, length, modification time), so a template shared by many VMs
//! is read once.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use anyhow::{Context, Result};
use ferry_qemu::commands::{BlockImage, QueryNamedBlockNodes};
use ferry_qemu::Qmp;
use sha2::{Digest, Sha256};

use crate::engine::control::Layer;

type Key = (PathBuf, u64, SystemTime);

static HASHES: Mutex<Option<HashMap<Key, String>>> = Mutex::new(None);

/// The SHA-256 of a file's bytes (cached while the file is unchanged).
pub async fn content_sha256(path: &Path) -> Result<String> {
    let meta = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    let key = (path.to_owned(), meta.len(), meta.modified()?);
    if let Some(h) = HASHES
        .lock()
        .expect("hash cache poisoned")
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(h.clone());
    }
    let p = path.to_owned();
    let hash = tokio::task::spawn_blocking(move || -> Result<String> {
        let mut f = std::fs::File::open(&p).with_context(|| format!("{}", p.display()))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok(format!("{:x}", h.finalize()))
    })
    .await??;
    HASHES
        .lock()
        .expect("hash cache poisoned")
        .get_or_insert_with(HashMap::new)
        .insert(key, hash.clone());
    Ok(hash)
}

/// A disk's backing chain: every file below its overlay, top down.
pub struct Chain {
    /// Where each file is on this host.
    pub files: Vec<PathBuf>,
    /// Each file as its peer needs to know it (name, format, length, hash).
    pub layers: Vec<Layer>,
    /// One digest of them all ([`chain_digest`]).
    pub digest: String,
}

/// The backing chain of block node `node`, if it has one whose every layer QEMU shows.
pub async fn backing_of(qmp: &Qmp, node: &str) -> Result<Option<Chain>> {
    // Not flat: the chain below each image comes with it.
    let nodes = qmp.execute(&QueryNamedBlockNodes { flat: false }).await?;
    let Some(chain) = nodes
        .iter()
        .find(|n| n.node_name == node)
        .and_then(|n| backing_chain(&n.image))
    else {
        return Ok(None);
    };
    let (mut files, mut layers) = (Vec::new(), Vec::new());
    for named in chain {
        let hashing = || {
            format!(
                "hashing {} in the backing chain of disk {node:?}",
                named.file.display()
            )
        };
        let sha256 = content_sha256(&named.file).await.with_context(hashing)?;
        let bytes = std::fs::metadata(&named.file).with_context(hashing)?.len();
        layers.push(Layer {
            name: named.name,
            format: named.format,
            bytes,
            sha256,
        });
        files.push(named.file);
    }
    let hashes: Vec<String> = layers.iter().map(|l| l.sha256.clone()).collect();
    Ok(Some(Chain {
        files,
        layers,
        digest: chain_digest(&hashes),
    }))
}

/// A backing file: where it is, and the name and format the image above gives it.
#[derive(Debug, PartialEq)]
struct Named {
    file: PathBuf,
    name: String,
    format: Option<String>,
}

/// The files of `image`'s backing chain, top down; None when it has none, or when QEMU does
/// not show a layer below one that has a backing file (it cannot be compared then).
fn backing_chain(image: &BlockImage) -> Option<Vec<Named>> {
    let mut files = Vec::new();
    let mut at = image;
    while let Some(file) = &at.full_backing_filename {
        let below = at.backing_image.as_deref()?;
        files.push(Named {
            file: PathBuf::from(file),
            name: at.backing_filename.clone().unwrap_or_else(|| file.clone()),
            format: at
                .backing_filename_format
                .clone()
                .or_else(|| below.format.clone()),
        });
        at = below;
    }
    (!files.is_empty()).then_some(files)
}

/// One digest of the chain's files' hashes, in order.
pub(super) fn chain_digest(hashes: &[String]) -> String {
    let mut h = Sha256::new();
    for hash in hashes {
        h.update(hash.as_bytes());
        h.update(b"\n");
    }
    format!("{:x}", h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(v: serde_json::Value) -> BlockImage {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_chain_is_every_layer_down_to_the_base_or_nothing_when_a_layer_is_not_shown() {
        let three = image(serde_json::json!({
            "virtual-size": 1,
            "full-backing-filename": "/lib/mid.qcow2",
            "backing-filename": "mid.qcow2",
            "backing-filename-format": "qcow2",
            "backing-image": {
                "virtual-size": 1,
                "full-backing-filename": "/lib/base.qcow2",
                "backing-image": {"virtual-size": 1, "format": "raw"},
            },
        }));
        assert_eq!(
            backing_chain(&three),
            Some(vec![
                Named {
                    file: PathBuf::from("/lib/mid.qcow2"),
                    name: "mid.qcow2".into(),
                    format: Some("qcow2".into()),
                },
                // No name recorded: the full one; no format recorded: the layer's own.
                Named {
                    file: PathBuf::from("/lib/base.qcow2"),
                    name: "/lib/base.qcow2".into(),
                    format: Some("raw".into()),
                },
            ])
        );
        assert_eq!(
            backing_chain(&image(serde_json::json!({"virtual-size": 1}))),
            None
        );
        let hidden = image(serde_json::json!({
            "virtual-size": 1,
            "full-backing-filename": "/lib/mid.qcow2",
        }));
        assert_eq!(backing_chain(&hidden), None);
    }

    #[test]
    fn chains_match_only_when_every_layer_does() {
        let (mid, base, other) = ("aa".to_owned(), "bb".to_owned(), "cc".to_owned());
        let chain = chain_digest(&[mid.clone(), base.clone()]);
        assert_eq!(chain, chain_digest(&[mid.clone(), base]));
        assert_ne!(chain, chain_digest(&[mid.clone(), other]));
        assert_ne!(chain, chain_digest(&[mid]));
    }
}
