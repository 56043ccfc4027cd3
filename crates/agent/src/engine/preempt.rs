//! QEMU's postcopy preempt channel, carried ahead of the stream.
//!
//! With `postcopy-preempt` on, the source QEMU opens a second connection to its migration URI
//! at the switch and sends on it the pages the destination's vCPUs fault on, so that they do
//! not wait behind the background pages on the main stream. The agents keep that promise on
//! the WAN: the channel crosses raw on [`PREEMPT`], an urgent session channel whose frames
//! overtake the stream's queued ones (`ferry_wire::Session::make_urgent`).
//!
//! The destination QEMU tells its connections apart by their order (the preempt channel sends
//! no magic), so its agent opens the second one only when the source's has been accepted: the
//! source marks that with a barrier before the first byte, and the channel's end with another.
//! Both ends hash what crossed; the source's `End` carries its figures and the destination
//! checks them before it reports the last page delivered.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use bytes::BytesMut;
use ferry_wire::{ChannelId, Received, Session};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use super::control::{Carried, PREEMPT};
use super::digest::StreamDigest;
use super::status::Shared;

/// The most the source reads from QEMU's preempt channel at once: a fault's pages go out as
/// soon as they are read, whatever their number.
const READ: usize = 64 << 10;

/// Source: accepts the preempt channel QEMU opens on the agent's socket at the switch and
/// carries it to the destination until QEMU closes it.
pub async fn forward(listener: UnixListener, session: Session, status: Shared) -> Result<Carried> {
    let (conn, _) = listener
        .accept()
        .await
        .context("accepting QEMU's postcopy preempt channel")?;
    // QEMU only writes on it; its other half stays open until the channel ends.
    let (mut from_qemu, _to_qemu) = conn.into_split();
    session.barrier(PREEMPT)?;
    let carried = carry_raw(
        &mut from_qemu,
        &session,
        PREEMPT,
        READ,
        "QEMU's postcopy preempt channel",
        |bytes| status.update(|s| s.preempt_bytes = bytes),
    )
    .await?;
    session.barrier(PREEMPT)?;
    Ok(carried)
}

/// Source: sends what QEMU writes on `from_qemu` to `channel` as it is, in reads of up to
/// `read` bytes, until QEMU closes it; hashes it, and reports the bytes so far to `progress`.
/// (The preempt channel, and a resumed postcopy stream: `engine::postcopy_recovery`.)
pub(crate) async fn carry_raw(
    from_qemu: &mut (impl AsyncRead + Unpin),
    session: &Session,
    channel: ChannelId,
    read: usize,
    what: &str,
    mut progress: impl FnMut(u64),
) -> Result<Carried> {
    let mut hash = StreamDigest::new();
    let mut bytes = 0u64;
    let mut buf = BytesMut::with_capacity(read);
    loop {
        buf.reserve(read);
        let n = from_qemu
            .read_buf(&mut buf)
            .await
            .with_context(|| format!("reading {what}"))?;
        if n == 0 {
            break;
        }
        let chunk = buf.split().freeze();
        hash.update(&chunk);
        bytes += chunk.len() as u64;
        session.send(channel, chunk).await?;
        progress(bytes);
    }
    Ok(Carried {
        bytes,
        digest: hash.hex(),
    })
}

/// Destination: once the source's QEMU opened its preempt channel, connects the destination
/// QEMU's (its second connection to `socket`, which goes once connected) and feeds it what
/// crosses, until the channel's end.
pub async fn deliver(session: Session, socket: PathBuf) -> Result<Carried> {
    match session.recv(PREEMPT).await? {
        Received::Barrier => {}
        Received::Data(_) => bail!("the source sent preempt-channel bytes before opening it"),
    }
    let conn = connect(&socket).await?;
    let (_from_qemu, mut to_qemu) = conn.into_split();
    let mut hash = StreamDigest::new();
    let mut bytes = 0u64;
    while let Received::Data(chunk) = session.recv(PREEMPT).await? {
        hash.update(&chunk);
        bytes += chunk.len() as u64;
        to_qemu
            .write_all(&chunk)
            .await
            .context("writing the destination QEMU's postcopy preempt channel")?;
    }
    Ok(Carried {
        bytes,
        digest: hash.hex(),
    })
}

async fn connect(socket: &Path) -> Result<UnixStream> {
    let conn = UnixStream::connect(socket).await.with_context(|| {
        format!(
            "connecting the destination QEMU's postcopy preempt channel ({})",
            socket.display()
        )
    })?;
    let _ = std::fs::remove_file(socket);
    Ok(conn)
}

/// Destination: whether the channel that crossed is the one the source announced.
pub fn check(announced: &Carried, arrived: &Carried) -> Result<()> {
    if announced != arrived {
        bail!(
            "postcopy preempt channel mismatch: the source sent {} bytes ({}), {} arrived ({})",
            announced.bytes,
            announced.digest,
            arrived.bytes,
            arrived.digest
        );
    }
    Ok(())
}
