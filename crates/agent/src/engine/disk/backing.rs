//! Backing images (SnapMig): when a disk is a qcow2 overlay whose backing image already exists
//! at the destination with the same content, only the overlay is copied (`sync=top`). Both
//! agents hash the backing image file; the hash is kept per (path, length, modification time),
//! so a template shared by many VMs is read once.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use anyhow::{Context, Result};
use ferry_qemu::commands::QueryNamedBlockNodes;
use ferry_qemu::Qmp;
use sha2::{Digest, Sha256};

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

/// The backing image of block node `node` and the SHA-256 of its file, if it has one.
pub async fn backing_of(qmp: &Qmp, node: &str) -> Result<Option<(PathBuf, String)>> {
    let nodes = qmp.execute(&QueryNamedBlockNodes { flat: true }).await?;
    let Some(file) = nodes
        .iter()
        .find(|n| n.node_name == node)
        .and_then(|n| n.image.full_backing_filename.clone())
    else {
        return Ok(None);
    };
    let path = PathBuf::from(file);
    let hash = content_sha256(&path)
        .await
        .with_context(|| format!("hashing the backing image of disk {node:?}"))?;
    Ok(Some((path, hash)))
}
