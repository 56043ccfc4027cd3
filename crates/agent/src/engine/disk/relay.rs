//! libvirt's disk copy through the agents ([`crate::tunnel`]). With `--copy-storage-all
//! --disks-uri`, libvirt's source QEMU mirrors each disk into an NBD export its destination
//! QEMU serves. Carried as it is, every write waits a WAN round trip and QEMU's mirror keeps
//! only a few in flight (about 9 MB/s over a 10 ms link). Instead the source agent answers
//! the mirror itself with ferry's own mirror target ([`super::mirror`], its flushes made the
//! commit point): writes join the transmit buffer and complete there, cross as coded snapshots, and the destination agent
//! writes them into the destination QEMU's export ([`super::apply`]).
//!
//! The guarantee: a flush completes only once every write before it was applied and flushed
//! at the destination, under matching digests ([`super::SentDigests`]). QEMU's mirror flushes
//! its target before it completes, and libvirt resumes the destination only after the mirror
//! completed, so the destination never runs on a disk short of a write; a failure anywhere
//! fails that flush, the mirror, and libvirt's migration, and the source keeps running.
//!
//! One tunnel session per NBD connection (one per disk): the source asks for the export QEMU
//! names ([`Control::NbdExport`]), the destination opens it on its QEMU's NBD server and
//! answers with its size ([`Control::NbdExportOpened`]); at the end the source sends the
//! operations' digest ([`Control::DiskEnd`]).
//!
//! A return to an older copy (CloudNet's follow the sun, libvirt keeping the image the domain
//! left): libvirt reuses an image that exists at the destination, so the export may hold the
//! disk as it was. The destination asks its QEMU where the export holds data (NBD block
//! status, `base:allocation`); if anywhere, it says so in its answer, indexes those ranges
//! and sends the index ([`Control::NbdOlderCopy`], [`control::DISK_BASE`]). The source then
//! offers QEMU no WRITE_ZEROES, so its mirror copies every block instead of zeroing the export
//! first, and its sender holds the buffered writes until the index came: blocks the export
//! holds go as SAME, as on ferry's own path. libvirt's disks carry no dirty bitmaps of
//! ferry's, so the index is the only way here.

use std::path::Path;
use std::sync::{Arc, Weak};

use anyhow::{bail, Context, Result};
use ferry_api::agent::{CodecSettings, DiskMode, DiskReport};
use ferry_codec::{disk_base, BaseBuilder, DiskBase, DiskOp};
use ferry_qemu::nbd::{self, BlockStatusReader, Client, Export, Exports};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_util::task::AbortOnDropHandle;

use super::apply::{index_ranges, DestinationDisks};
use super::buffer::TransmitBuffer;
use super::mirror::{start_channel, Known, MirrorTarget, OlderCopy, Sending};
use super::pacing::BulkGate;
use crate::engine::control::{self, Control, DiskPlan, PeerAborted};
use crate::engine::status::Shared;
use ferry_wire::Session;

/// How one relayed disk copy is carried.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Synchronous: a write completes once applied at the destination (ferry's `sync` disk
    /// mode); otherwise once buffered here.
    pub mode: DiskMode,
    /// The transmit buffer's bound during the bulk copy.
    pub buffer_bytes: u64,
    /// The link's rate, for the frames' zstd level.
    pub link_rate_mbit: f64,
    /// The bulk copy is paced by the guest's IO: its writes wait at a gate the caller drives
    /// ([`RelaySource::bulk_gate`]), shut until the caller has looked at the guest.
    pub paced: bool,
    /// The domain whose disk this is, when known (a migration ferry drives): the
    /// destination may have kept its index when it left there.
    pub owner: Option<DomainDisks>,
}

/// A domain and the images of its disks, by the export libvirt names for each.
#[derive(Debug, Clone, Default)]
pub struct DomainDisks {
    pub domain: String,
    /// Each export's image and backing files, the image first.
    pub images: std::collections::HashMap<String, Vec<std::path::PathBuf>>,
}

/// The largest disk whose copy a relay follows block by block when the destination holds
/// nothing (16 bytes of memory per 4 KiB block while it runs: 64 MiB here), so that the host
/// the domain leaves can remember what it left ([`Left`]).
pub const FOLLOW_MAX_DISK_BYTES: u64 = 16 << 30;

/// What a relayed copy left at the destination, and so what the source's own image holds
/// once the domain is gone from it: kept for the domain's return
/// ([`crate::disk_memory`]).
pub struct Left {
    /// The export QEMU's mirror wrote (libvirt's `drive-<disk alias>`).
    pub export: String,
    pub size: u64,
    /// Its index (`codec::disk_base`), block by block.
    pub index: Vec<u8>,
    /// Blocks the index does not know (partly written or trimmed during the copy): a return
    /// sends them whole.
    pub unknown_blocks: u64,
    /// When the relay ended: the source's image is not written after the pause, which came
    /// before this.
    pub ended: std::time::SystemTime,
}

impl std::fmt::Debug for Left {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Left")
            .field("export", &self.export)
            .field("size", &self.size)
            .field("index_bytes", &self.index.len())
            .field("unknown_blocks", &self.unknown_blocks)
            .field("ended", &self.ended)
            .finish()
    }
}

/// The source side of one relayed NBD connection.
pub struct RelaySource {
    buffer: Arc<TransmitBuffer>,
    link_rate_mbit: f64,
    bulk_gate: Option<Arc<BulkGate>>,
    owner: Option<DomainDisks>,
}

impl RelaySource {
    pub fn new(settings: RelaySettings) -> RelaySource {
        RelaySource {
            buffer: Arc::new(TransmitBuffer::new(
                settings.buffer_bytes,
                settings.mode == DiskMode::Sync,
            )),
            link_rate_mbit: settings.link_rate_mbit,
            bulk_gate: settings.paced.then(|| Arc::new(BulkGate::shut())),
            owner: settings.owner,
        }
    }

    /// The gate QEMU's bulk copy writes pass, when paced.
    pub fn bulk_gate(&self) -> Option<Arc<BulkGate>> {
        self.bulk_gate.clone()
    }

    /// A handle to the buffer, for the memory phase's tighter bound.
    pub fn buffer(&self) -> Weak<TransmitBuffer> {
        Arc::downgrade(&self.buffer)
    }

    /// Serves QEMU's NBD connection `conn` over `session` until QEMU disconnects and every
    /// write reached the destination. The disk figures go to `status`. Returns what the
    /// copy left at the destination, when the relay followed it.
    pub async fn run(
        self,
        conn: UnixStream,
        session: &Session,
        codec: CodecSettings,
        status: Shared,
    ) -> Result<Option<Left>> {
        let buffer = self.buffer;
        // Only a migration ferry drives can keep what the copy leaves (it knows the domain).
        let follow = self.owner.is_some();
        let report = DiskReport {
            mode: if buffer.is_synchronous() {
                DiskMode::Sync
            } else {
                DiskMode::Async
            },
            disks: 1,
            ..DiskReport::default()
        };
        // The sender starts once the destination said what its export holds; QEMU's writes
        // wait in the buffer meanwhile. (No answer at all: nothing is known, nothing is SAME.)
        let (known_tx, known_rx) = oneshot::channel();
        let known = async move { known_rx.await.unwrap_or_default() };
        let (acks, sender) = start_channel(
            Sending {
                buffer: buffer.clone(),
                session: session.clone(),
                codec,
                link_rate_mbit: self.link_rate_mbit,
                report,
                status,
                corrupt_at: None,
            },
            known,
        );
        let (acks, mut sender) = (AbortOnDropHandle::new(acks), AbortOnDropHandle::new(sender));
        let (opened_tx, opened_rx) = mpsc::channel(1);
        let exports = RemoteExports {
            session: session.clone(),
            codec,
            owner: self.owner,
            opened: Mutex::new(opened_rx),
            chosen: std::sync::Mutex::new(None),
        };
        let target = Arc::new(MirrorTarget {
            buffer: buffer.clone(),
            disk: 0,
            flush_commits: true,
            bulk_gate: self.bulk_gate.clone(),
        });
        let served = tokio::select! {
            end = nbd::serve(conn, &exports, target) => end.context("QEMU's NBD connection"),
            e = control_from_destination(session, opened_tx, known_tx, follow) => Err(e),
        };
        buffer.close();
        if let Err(e) = served {
            buffer.stop_acknowledging();
            return Err(e);
        }
        let sent = (&mut sender).await.context("the disk sender task")??;
        let end = Control::DiskEnd {
            snapshots: sent.snapshots,
            digest: sent.digest,
        };
        control::send(session, &end).await?;
        drop(acks);
        let chosen = exports.chosen.lock().expect("chosen lock").take();
        let (Some((export, size)), Some(view)) = (chosen, sent.view) else {
            return Ok(None);
        };
        let unknown = view.unknown_blocks();
        let index = tokio::task::spawn_blocking(move || view.serialize()).await?;
        tracing::info!(
            "disk relay: export {export:?}: what the copy left is known but for {unknown} block(s) ({}-byte index)",
            index.len()
        );
        Ok(Some(Left {
            export,
            size,
            index,
            unknown_blocks: unknown,
            ended: std::time::SystemTime::now(),
        }))
    }
}

/// The export QEMU chose, as the destination opened it.
#[derive(Debug, Clone, Copy)]
struct Opened {
    size: u64,
    /// It holds data: its index follows.
    older_copy: bool,
}

/// The destination's control messages during a relayed connection: the export's size
/// (handed to the handshake) and what it holds (handed to the sender), or why it stops.
/// Returns only with an error.
async fn control_from_destination(
    session: &Session,
    opened: mpsc::Sender<Result<Opened, String>>,
    known: oneshot::Sender<Known>,
    follow: bool,
) -> anyhow::Error {
    let mut known = Some(known);
    let mut size = None;
    loop {
        match control::recv(session).await {
            Ok(Control::NbdExportOpened {
                size: Some(bytes),
                error: None,
                older_copy,
            }) => {
                size = Some(bytes);
                if !older_copy {
                    if let Some(k) = known.take() {
                        // The export reads as zeros: the view of it starts so.
                        let follow = (follow && bytes <= FOLLOW_MAX_DISK_BYTES)
                            .then(|| DiskBase::zeroed(super::index_key(session), &[bytes]).ok())
                            .flatten();
                        let _ = k.send(Known {
                            follow,
                            ..Known::default()
                        });
                    }
                }
                let answer = Ok(Opened {
                    size: bytes,
                    older_copy,
                });
                if opened.send(answer).await.is_err() {
                    return anyhow::anyhow!("the handshake ended before the destination answered");
                }
            }
            Ok(Control::NbdExportOpened { error, .. }) => {
                let answer = Err(error.unwrap_or_else(|| "no size".into()));
                if opened.send(answer).await.is_err() {
                    return anyhow::anyhow!("the handshake ended before the destination answered");
                }
            }
            Ok(Control::NbdOlderCopy {
                index_bytes,
                index_ms,
                remembered,
                note,
            }) => {
                let (Some(size), Some(k)) = (size, known.take()) else {
                    return anyhow::anyhow!(
                        "the destination sent an index without an export holding data"
                    );
                };
                match receive_index(session, index_bytes, size).await {
                    Ok(base) => {
                        let (base, note) = if remembered {
                            (OlderCopy::Remembered(base), REMEMBERED_NOTE.to_owned())
                        } else {
                            let why = note.as_deref().unwrap_or(NO_BITMAPS);
                            (OlderCopy::Index(base), format!("{INDEXED_NOTE}: {why}"))
                        };
                        let _ = k.send(Known {
                            base: Some(base),
                            note: Some(note),
                            index_ms: Some(index_ms),
                            follow: None,
                        });
                    }
                    Err(e) => return e,
                }
            }
            Ok(Control::Abort { reason }) => return PeerAborted(reason).into(),
            Ok(other) => {
                return anyhow::anyhow!("unexpected control message in a disk relay: {other:?}")
            }
            Err(e) => return e,
        }
    }
}

/// Why a relayed disk's older copy is indexed, for the report.
const INDEXED_NOTE: &str = "libvirt's disk copy: the image at the destination was indexed";
/// Why, when nothing was kept to look at (a migration ferry does not drive).
const NO_BITMAPS: &str = "no dirty bitmaps of ferry's on libvirt's disks";
/// What stood for the image instead of its index, for the report.
const REMEMBERED_NOTE: &str =
    "libvirt's disk copy: the index kept when the domain left stood for the image there, untouched since";

/// The index of the destination's export, `index_bytes` long, for an export of `size` bytes.
async fn receive_index(session: &Session, index_bytes: u64, size: u64) -> Result<DiskBase> {
    let blob = control::recv_blob(
        session,
        control::DISK_BASE,
        index_bytes,
        disk_base::max_index_bytes(&[size]),
        "disk index",
    )
    .await?;
    tokio::task::spawn_blocking(move || DiskBase::parse(&blob, &[size]))
        .await?
        .context("the destination's disk index")
}

/// The export QEMU names, as the destination QEMU serves it.
struct RemoteExports {
    session: Session,
    codec: CodecSettings,
    owner: Option<DomainDisks>,
    opened: Mutex<mpsc::Receiver<Result<Opened, String>>>,
    /// The export QEMU chose and its size, once the destination opened it.
    chosen: std::sync::Mutex<Option<(String, u64)>>,
}

impl Exports for RemoteExports {
    async fn find(&self, name: &str) -> Result<Export, String> {
        let mut opened = self.opened.lock().await;
        let ask = Control::NbdExport {
            name: name.to_owned(),
            codec: self.codec,
            domain: self.owner.as_ref().map(|o| o.domain.clone()),
            chain: self
                .owner
                .as_ref()
                .and_then(|o| o.images.get(name).cloned())
                .unwrap_or_default(),
        };
        control::send(&self.session, &ask)
            .await
            .map_err(|e| format!("asking the destination for export {name:?}: {e:#}"))?;
        let opened = opened
            .recv()
            .await
            .ok_or_else(|| format!("the destination did not answer for export {name:?}"))??;
        *self.chosen.lock().expect("chosen lock") = Some((name.to_owned(), opened.size));
        Ok(Export {
            name: name.to_owned(),
            size: opened.size,
            write_zeroes: !opened.older_copy,
        })
    }

    fn names(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A domain's disk arriving at a relay's destination, as the source names it.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub domain: String,
    pub export: String,
    pub size: u64,
    /// The image the source says the export is, then its backing files, as the source's
    /// libvirt has them (libvirt opens the same paths here).
    pub chain: Vec<std::path::PathBuf>,
    /// The process serving the export (the destination QEMU), which must hold them open.
    pub server_pid: Option<i32>,
}

/// Where a relay's destination finds the index kept when a domain left this host
/// ([`crate::disk_memory`]). It reads files: it runs on a blocking thread.
pub trait KeptIndexes: Clone + Send + Sync + 'static {
    /// The index kept for the arriving disk, if it still stands for its image; else why not.
    fn recall(&self, arrival: &Arrival) -> Result<Vec<u8>, String>;
}

/// A destination that keeps no indexes.
#[derive(Clone)]
pub struct NoKeptIndexes;

impl KeptIndexes for NoKeptIndexes {
    fn recall(&self, _: &Arrival) -> Result<Vec<u8>, String> {
        Err("this host keeps no indexes".into())
    }
}

/// How many blocks of a kept index are read back from the export before it is trusted.
const SPOT_CHECKED_BLOCKS: usize = 16;

/// The most blocks a kept index may leave unknown that the destination reads to know them
/// (16 MiB); beyond, the rest go whole.
const FILLED_BLOCKS_MAX: usize = 4096;

/// `kept`'s index for the arriving export, checked to fit it and spot-checked against what
/// the export holds: a few of the blocks it knows, spread over the disk, must read back as it
/// says (a different file, however it got there, fails this). The blocks it does not know
/// (partly written while the domain left) are read and added: a few, against the whole image.
async fn recall(
    kept: &impl KeptIndexes,
    arrival: Arrival,
    client: &Client<UnixStream>,
) -> Result<Vec<u8>, String> {
    let kept = kept.clone();
    let size = arrival.size;
    let (index, mut base) = tokio::task::spawn_blocking(move || {
        let index = kept.recall(&arrival)?;
        let base = DiskBase::parse(&index, &[size])
            .map_err(|e| format!("the kept index does not fit this export: {e}"))?;
        Ok::<_, String>((index, base))
    })
    .await
    .map_err(|e| e.to_string())??;
    for block in base.known_blocks(0, SPOT_CHECKED_BLOCKS) {
        let data = read_blocks(client, size, block, 1)
            .await
            .map_err(|e| format!("reading the export to check the kept index: {e}"))?;
        if base.holds(0, block, &data) != Some(true) {
            return Err(format!(
                "the export does not hold what the index kept when the domain left says (block {block})"
            ));
        }
    }
    let unknown = base.unknown_block_list(0, FILLED_BLOCKS_MAX);
    if unknown.is_empty() {
        return Ok(index);
    }
    // Runs of neighbouring blocks in one read each (a file system's journal is one place).
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &block in &unknown {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == block && *count < 256 => *count += 1,
            _ => runs.push((block, 1)),
        }
    }
    for (first, count) in runs {
        let data = read_blocks(client, size, first, count)
            .await
            .map_err(|e| format!("reading the blocks the kept index does not know: {e}"))?;
        base.track(&DiskOp::Write {
            disk: 0,
            offset: first * ferry_codec::PAGE_SIZE as u64,
            data,
        });
    }
    tracing::info!(
        "disk relay: read the {} block(s) the kept index did not know",
        unknown.len()
    );
    tokio::task::spawn_blocking(move || base.serialize())
        .await
        .map_err(|e| e.to_string())
}

/// `count` whole blocks of the export (of `size` bytes) from block `first`, a short last block
/// padded with zeros, as the index hashes it.
async fn read_blocks(
    client: &Client<UnixStream>,
    size: u64,
    first: u64,
    count: u64,
) -> Result<Vec<u8>, ferry_qemu::nbd::NbdError> {
    let block_size = ferry_codec::PAGE_SIZE as u64;
    let offset = first * block_size;
    let len = u32::try_from((count * block_size).min(size - offset)).expect("up to 1 MiB");
    let mut data = client.read(offset, len).await?.to_vec();
    data.resize(usize::try_from(count * block_size).expect("up to 1 MiB"), 0);
    Ok(data)
}

/// The destination side: opens the export the source names on the QEMU NBD server at
/// `socket`, applies the source's snapshots to it, and checks the final digest. An export
/// that holds data is described by an index kept in `kept` when it stands for it, else
/// indexed now.
pub async fn destination(session: &Session, socket: &Path, kept: impl KeptIndexes) -> Result<()> {
    let (client, plan, codec) = loop {
        match control::recv(session).await? {
            Control::NbdExport {
                name,
                codec,
                domain,
                chain,
            } => match open(socket, &name).await {
                Ok((client, data, server_pid)) => {
                    let size = client.info().size;
                    let answer = Control::NbdExportOpened {
                        size: Some(size),
                        error: None,
                        older_copy: !data.is_empty(),
                    };
                    control::send(session, &answer).await?;
                    if !data.is_empty() {
                        let t0 = std::time::Instant::now();
                        let recalled = match domain {
                            Some(domain) if chain.is_empty() => Some(Err(format!(
                                "the source named no image for export {name:?} of {domain} \
                                 (not a file disk, or its disks could not be read from libvirt)"
                            ))),
                            Some(domain) => {
                                let arrival = Arrival {
                                    domain,
                                    export: name.clone(),
                                    size,
                                    chain,
                                    server_pid,
                                };
                                Some(recall(&kept, arrival, &client).await)
                            }
                            None => None,
                        };
                        match recalled {
                            Some(Ok(index)) => {
                                tracing::info!(
                                    "disk relay: export {name:?}: the index kept when its domain left stands for it ({} bytes)",
                                    index.len()
                                );
                                send_older_copy(session, &index, t0, true, None).await?;
                            }
                            Some(Err(why)) => {
                                tracing::info!("disk relay: export {name:?}: {why}");
                                send_index(session, &client, &name, &data, Some(why)).await?;
                            }
                            None => send_index(session, &client, &name, &data, None).await?,
                        }
                    }
                    let plan = DiskPlan {
                        node: name,
                        size,
                        backing_sha256: None,
                        tracked_since: Vec::new(),
                        layers: Vec::new(),
                        image: None,
                    };
                    break (client, plan, codec);
                }
                Err(e) => {
                    tracing::warn!("disk relay: {e:#}");
                    let answer = Control::NbdExportOpened {
                        size: None,
                        error: Some(format!("at the destination: {e:#}")),
                        older_copy: false,
                    };
                    control::send(session, &answer).await?;
                }
            },
            // QEMU left before it chose an export.
            Control::DiskEnd { snapshots: 0, .. } => return Ok(()),
            Control::Abort { reason } => return Err(PeerAborted(reason).into()),
            other => bail!("unexpected control message in a disk relay: {other:?}"),
        }
    };
    let disks = DestinationDisks::adopt(client, plan);
    let apply = disks.apply(session, codec);
    tokio::pin!(apply);
    let mut end = None;
    let applied = loop {
        tokio::select! {
            r = &mut apply => break r?,
            msg = control::recv(session), if end.is_none() => match msg? {
                Control::DiskEnd { snapshots, digest } => end = Some((snapshots, digest)),
                Control::Abort { reason } => return Err(PeerAborted(reason).into()),
                other => bail!("unexpected control message in a disk relay: {other:?}"),
            },
        }
    };
    let end = match end {
        Some(end) => end,
        None => match control::recv(session).await? {
            Control::DiskEnd { snapshots, digest } => (snapshots, digest),
            Control::Abort { reason } => return Err(PeerAborted(reason).into()),
            other => bail!("unexpected control message in a disk relay: {other:?}"),
        },
    };
    disks.disconnect().await;
    if end != applied {
        bail!(
            "the disk writes applied here differ from those sent ({} snapshots, {}; the source sent {} with {})",
            applied.0,
            applied.1,
            end.0,
            end.1
        );
    }
    Ok(())
}

/// Opens export `name` of the QEMU NBD server at `socket`; with it, where the export may hold
/// data (4 KiB aligned; none for a fresh image) and the server's process.
async fn open(
    socket: &Path,
    name: &str,
) -> Result<(Client<UnixStream>, Vec<(u64, u64)>, Option<i32>)> {
    // The allocation first, on a connection closed before the export's own opens.
    let data = data_ranges(socket, name).await;
    let conn = connect(socket).await?;
    let server_pid = conn.peer_cred().ok().and_then(|c| c.pid());
    let client = Client::connect(conn, name)
        .await
        .with_context(|| format!("the NBD export {name:?} of the destination QEMU"))?;
    let size = client.info().size;
    let data = match data {
        Ok(data) => block_aligned(&data, size),
        // QEMU always answers; a server that does not is indexed whole, which is always right
        // (only slower: every block is read, and QEMU's mirror writes zeroes as data).
        Err(e) => {
            tracing::warn!(
                "disk relay: export {name:?}: {e:#}; indexing all of it in case it holds data"
            );
            vec![(0, size)]
        }
    };
    Ok((client, data, server_pid))
}

/// Where export `name` of the NBD server at `socket` may hold data.
async fn data_ranges(socket: &Path, name: &str) -> Result<Vec<(u64, u64)>> {
    let mut allocation = BlockStatusReader::data(connect(socket).await?, name)
        .await
        .context("its allocation is unknown")?;
    let size = allocation.size();
    allocation
        .ranges(0, size)
        .await
        .context("its allocation is unknown")
}

async fn connect(socket: &Path) -> Result<UnixStream> {
    UnixStream::connect(socket)
        .await
        .with_context(|| format!("connect to {}", socket.display()))
}

/// `ranges` (in order) widened to whole 4 KiB blocks, those that then touch merged.
fn block_aligned(ranges: &[(u64, u64)], size: u64) -> Vec<(u64, u64)> {
    let block = ferry_codec::PAGE_SIZE as u64;
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(offset, len) in ranges {
        let start = offset / block * block;
        let end = (offset + len)
            .div_ceil(block)
            .saturating_mul(block)
            .min(size);
        match out.last_mut() {
            Some((o, l)) if *o + *l >= start => *l = end.max(*o + *l) - *o,
            _ => out.push((start, end - start)),
        }
    }
    out
}

/// Indexes the `data` ranges of the export (the rest reads as zeros) and sends the index;
/// `note` says why a kept one could not stand for it.
async fn send_index(
    session: &Session,
    client: &Client<UnixStream>,
    name: &str,
    data: &[(u64, u64)],
    note: Option<String>,
) -> Result<()> {
    let t0 = std::time::Instant::now();
    let mut builder = BaseBuilder::new(super::index_key(session));
    builder.disk(client.info().size);
    index_ranges(client, name, data, &mut builder).await?;
    let index = builder.finish();
    tracing::info!(
        "disk relay: export {name:?} holds an older copy: {} bytes of data indexed in {} ms, a {}-byte index",
        data.iter().map(|r| r.1).sum::<u64>(),
        t0.elapsed().as_millis(),
        index.len()
    );
    send_older_copy(session, &index, t0, false, note).await
}

/// Sends the index of the export's older copy, which took since `t0` to have.
async fn send_older_copy(
    session: &Session,
    index: &[u8],
    t0: std::time::Instant,
    remembered: bool,
    note: Option<String>,
) -> Result<()> {
    let announce = Control::NbdOlderCopy {
        index_bytes: index.len() as u64,
        index_ms: u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX),
        remembered,
        note,
    };
    control::send(session, &announce).await?;
    control::send_blob(session, control::DISK_BASE, index).await
}

#[cfg(test)]
mod tests {
    use super::super::pacing::{Speed, MIRROR_CHUNK};
    use super::*;
    use bytes::Bytes;
    use ferry_api::agent::MigrationStatus;
    use ferry_qemu::nbd::{proto, Blocks};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    const SIZE: u64 = 4 << 20;

    /// The destination QEMU's export: memory, failing every write when told to, and holding
    /// every write while `held` is locked for writing. Its server cannot say where it holds
    /// data, so the destination indexes all of it (0xee blocks at first).
    struct MemoryDisk {
        bytes: std::sync::Mutex<Vec<u8>>,
        fail_writes: AtomicBool,
        held: tokio::sync::RwLock<()>,
        /// Bytes read from it.
        read: std::sync::atomic::AtomicU64,
    }

    fn memory_disk(fill: u8) -> Arc<MemoryDisk> {
        Arc::new(MemoryDisk {
            bytes: std::sync::Mutex::new(vec![fill; usize::try_from(SIZE).unwrap()]),
            fail_writes: AtomicBool::new(false),
            held: tokio::sync::RwLock::new(()),
            read: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The index a destination kept when its domain left: what it holds, or why none.
    #[derive(Clone)]
    struct Kept(Result<Vec<u8>, String>);

    impl KeptIndexes for Kept {
        fn recall(&self, a: &Arrival) -> Result<Vec<u8>, String> {
            assert_eq!(
                (a.domain.as_str(), a.export.as_str(), a.size),
                ("vm", "disk0", SIZE)
            );
            assert_eq!(a.chain, [Path::new("/images/vm.qcow2")]);
            // The export's server is this test.
            assert_eq!(a.server_pid, i32::try_from(std::process::id()).ok());
            self.0.clone()
        }
    }

    impl Blocks for MemoryDisk {
        async fn write(&self, offset: u64, data: Bytes) -> Result<(), u32> {
            let _free = self.held.read().await;
            if self.fail_writes.load(Ordering::Relaxed) {
                return Err(proto::EIO);
            }
            let at = usize::try_from(offset).unwrap();
            self.bytes.lock().unwrap()[at..at + data.len()].copy_from_slice(&data);
            Ok(())
        }
        async fn write_zeroes(&self, offset: u64, len: u64, _: bool) -> Result<(), u32> {
            let at = usize::try_from(offset).unwrap();
            let end = at + usize::try_from(len).unwrap();
            self.bytes.lock().unwrap()[at..end].fill(0);
            Ok(())
        }
        async fn trim(&self, offset: u64, len: u64) -> Result<(), u32> {
            self.write_zeroes(offset, len, true).await
        }
        async fn flush(&self) -> Result<(), u32> {
            Ok(())
        }
        async fn read(&self, offset: u64, len: u32) -> Result<Bytes, u32> {
            self.read.fetch_add(u64::from(len), Ordering::Relaxed);
            let at = usize::try_from(offset).unwrap();
            let end = at + usize::try_from(len).unwrap();
            Ok(Bytes::copy_from_slice(&self.bytes.lock().unwrap()[at..end]))
        }
    }

    struct Relayed {
        disk: Arc<MemoryDisk>,
        /// QEMU's mirror, at the source.
        mirror: Result<Client<UnixStream>, ferry_qemu::nbd::NbdError>,
        /// The source agent's end of the session.
        session: Session,
        status: Shared,
        source: tokio::task::JoinHandle<Result<Option<Left>>>,
        destination: tokio::task::JoinHandle<Result<()>>,
        /// A paced relay's gate.
        bulk_gate: Option<Arc<BulkGate>>,
        _dir: TempDir,
    }

    struct TempDir(std::path::PathBuf);

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A relay from a mirror asking for `export` to a destination QEMU serving "disk0".
    async fn relay(export: &str) -> Relayed {
        relay_paced(export, false).await
    }

    async fn relay_paced(export: &str, paced: bool) -> Relayed {
        relay_with(export, paced, None).await
    }

    /// A relay for domain "vm", whose destination kept `kept` when it left.
    async fn relay_kept(kept: Result<Vec<u8>, String>) -> Relayed {
        relay_with("disk0", false, Some(Kept(kept))).await
    }

    async fn relay_with(export: &str, paced: bool, kept: Option<Kept>) -> Relayed {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ferry-relay-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("nbd.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let disk = memory_disk(0xee);
        let served = disk.clone();
        tokio::spawn(async move {
            let export = Export {
                name: "disk0".into(),
                size: SIZE,
                write_zeroes: true,
            };
            while let Ok((conn, _)) = listener.accept().await {
                let _ = nbd::serve(conn, &export, served.clone()).await;
            }
        });
        let (a, b) = crate::engine::test_session::pair().await;
        let owner = kept.is_some().then(|| DomainDisks {
            domain: "vm".into(),
            images: [("disk0".to_owned(), vec!["/images/vm.qcow2".into()])].into(),
        });
        // As the tunnel's destination does: a failure is told to the source.
        let destination = tokio::spawn(async move {
            let result = match kept {
                Some(kept) => super::destination(&b, &socket, kept).await,
                None => super::destination(&b, &socket, NoKeptIndexes).await,
            };
            if let Err(e) = &result {
                let reason = format!("destination: {e:#}");
                control::send(&b, &Control::Abort { reason }).await.unwrap();
            }
            result
        });
        let (qemu_end, agent_end) = UnixStream::pair().unwrap();
        let status = Shared::new(MigrationStatus::starting("t".into(), "vm".into(), 0));
        let relay = RelaySource::new(RelaySettings {
            mode: DiskMode::Async,
            buffer_bytes: 1 << 20,
            link_rate_mbit: 100.0,
            paced,
            owner,
        });
        let bulk_gate = relay.bulk_gate();
        let session = a.clone();
        let reported = status.clone();
        let source =
            tokio::spawn(async move { relay.run(agent_end, &a, CodecSettings::ALL, status).await });
        let mirror = Client::connect(qemu_end, export).await;
        Relayed {
            disk,
            mirror,
            session,
            status: reported,
            source,
            destination,
            bulk_gate,
            _dir: TempDir(dir),
        }
    }

    #[tokio::test]
    async fn disk_frames_out_of_snapshot_order_are_refused() {
        let disk = memory_disk(0);
        let (server_end, client_end) = UnixStream::pair().unwrap();
        tokio::spawn(async move {
            let export = Export {
                name: "disk0".into(),
                size: SIZE,
                write_zeroes: true,
            };
            let _ = nbd::serve(server_end, &export, disk).await;
        });
        let client = Client::connect(client_end, "disk0").await.unwrap();
        let plan = DiskPlan {
            node: "disk0".into(),
            size: SIZE,
            backing_sha256: None,
            tracked_since: Vec::new(),
            layers: Vec::new(),
            image: None,
        };
        let disks = DestinationDisks::adopt(client, plan);
        let (a, b) = crate::engine::test_session::pair().await;
        let applied = tokio::spawn(async move { disks.apply(&b, CodecSettings::NONE).await });
        // Snapshot 0's first frame, then one of snapshot 1 before snapshot 0's last.
        let mut records = Vec::new();
        let write = ferry_codec::DiskOp::Write {
            disk: 0,
            offset: 0,
            data: vec![7; 4096],
        };
        let options = super::super::codec_options(CodecSettings::NONE);
        ferry_codec::DiskEncoder::new(options).encode(&write, &mut records);
        let mut zstd = ferry_codec::AdaptiveCompressor::off();
        for seq in [0, 1] {
            let frame = super::super::Frame::encode(seq, 0, &records, &mut zstd);
            a.send(control::DISK, frame).await.unwrap();
        }
        let err = applied.await.unwrap().unwrap_err();
        assert_eq!(
            format!("{err:#}"),
            "disk frame of snapshot 1 after snapshot 0, whose last frame had not come"
        );
    }

    #[tokio::test]
    async fn a_flush_returns_once_every_write_before_it_is_at_the_destination() {
        let r = relay("disk0").await;
        let mirror = r.mirror.unwrap();
        assert_eq!(mirror.info().size, SIZE);
        let block = |b: u8| Bytes::from(vec![b; 64 << 10]);
        let mut pending = Vec::new();
        // More than the buffer holds, rewrites of the same range, zeroes.
        for i in 0..48u8 {
            pending.push(
                mirror
                    .write(u64::from(i % 40) * (64 << 10), block(i))
                    .await
                    .unwrap(),
            );
        }
        pending.push(
            mirror
                .write_zeroes(SIZE - (64 << 10), 64 << 10, true)
                .await
                .unwrap(),
        );
        for p in pending {
            p.wait().await.unwrap();
        }
        mirror.flush().await.unwrap().wait().await.unwrap();
        {
            let disk = r.disk.bytes.lock().unwrap();
            for i in 0..40u8 {
                let last = if i < 8 { i + 40 } else { i };
                let at = usize::from(i) * (64 << 10);
                assert!(
                    disk[at..at + (64 << 10)].iter().all(|&b| b == last),
                    "block {i}"
                );
            }
            assert!(disk[usize::try_from(SIZE).unwrap() - (64 << 10)..]
                .iter()
                .all(|&b| b == 0));
        }
        mirror.disconnect().await.unwrap();
        r.source.await.unwrap().unwrap();
        r.destination.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_paced_relay_holds_the_bulk_copy_at_its_gate_but_never_the_guests_writes() {
        let r = relay_paced("disk0", true).await;
        let mirror = r.mirror.unwrap();
        let gate = r.bulk_gate.expect("a paced relay has a gate");
        let chunk = usize::try_from(MIRROR_CHUNK).unwrap();
        let bulk = mirror.write(0, Bytes::from(vec![1; chunk])).await.unwrap();
        // The guest's own writes, sent after the bulk one (a small one and a large one, as
        // QEMU's write-blocking mirror passes them on), complete while the gate is shut.
        for (at, len) in [(2 << 20, 4096), (3 << 20, 256 << 10)] {
            let guest = mirror.write(at, Bytes::from(vec![2; len])).await.unwrap();
            guest.wait().await.unwrap();
        }
        let held = tokio::time::timeout(Duration::from_millis(200), bulk.wait()).await;
        assert!(held.is_err(), "a bulk write passed the shut gate");
        gate.set(Speed::Unlimited);
        mirror
            .write(0, Bytes::from(vec![3; chunk]))
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        mirror.flush().await.unwrap().wait().await.unwrap();
        {
            let disk = r.disk.bytes.lock().unwrap();
            assert!(disk[..chunk].iter().all(|&b| b == 3));
            assert!(disk[2 << 20..(2 << 20) + 4096].iter().all(|&b| b == 2));
            assert!(disk[3 << 20..(3 << 20) + (256 << 10)]
                .iter()
                .all(|&b| b == 2));
        }
        mirror.disconnect().await.unwrap();
        r.source.await.unwrap().unwrap();
        r.destination.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn blocks_the_destination_holds_cross_as_same_and_its_export_is_never_zeroed_first() {
        let r = relay("disk0").await;
        let mirror = r.mirror.unwrap();
        // QEMU's mirror zeroes a whole target that takes WRITE_ZEROES before it copies.
        assert_eq!(
            mirror.info().flags & proto::TFLAG_SEND_WRITE_ZEROES,
            0,
            "{:?}",
            mirror.info()
        );
        // A MiB as the destination holds it, a MiB it does not, a block half old half new.
        let mut mixed = vec![0xee; 4096];
        mixed[2048..].fill(5);
        let writes = [
            (0, vec![0xee; 1 << 20]),
            (1 << 20, vec![3; 1 << 20]),
            (2 << 20, mixed.clone()),
        ];
        for (at, data) in writes {
            let p = mirror.write(at, Bytes::from(data)).await.unwrap();
            p.wait().await.unwrap();
        }
        mirror.flush().await.unwrap().wait().await.unwrap();
        {
            let disk = r.disk.bytes.lock().unwrap();
            assert!(disk[..1 << 20].iter().all(|&b| b == 0xee));
            assert!(disk[1 << 20..2 << 20].iter().all(|&b| b == 3));
            assert_eq!(disk[2 << 20..(2 << 20) + 4096], mixed[..]);
            assert!(disk[(2 << 20) + 4096..].iter().all(|&b| b == 0xee));
        }
        mirror.disconnect().await.unwrap();
        r.source.await.unwrap().unwrap();
        r.destination.await.unwrap().unwrap();
        let report = r.status.get().disk.expect("a disk report");
        assert_eq!(report.older_copy.as_deref(), Some("index"), "{report:?}");
        assert_eq!(report.same_bytes, 1 << 20, "{report:?}");
        assert!(report.index_ms.is_some(), "{report:?}");
    }

    /// The index of what `disk` holds, under `key`.
    fn index_of(disk: &[u8], key: u64) -> Vec<u8> {
        let mut builder = BaseBuilder::new(key);
        builder.disk(disk.len() as u64);
        builder.add(0, disk);
        builder.finish()
    }

    /// Writes a MiB the destination holds (0xee), a MiB it does not, then flushes and ends.
    async fn copy_a_mib_old_a_mib_new(r: &mut Relayed) -> Option<Left> {
        let mirror = r.mirror.as_ref().unwrap();
        for (at, fill) in [(0, 0xee), (1 << 20, 3)] {
            let p = mirror.write(at, Bytes::from(vec![fill; 1 << 20])).await;
            p.unwrap().wait().await.unwrap();
        }
        mirror.flush().await.unwrap().wait().await.unwrap();
        mirror.disconnect().await.unwrap();
        (&mut r.destination).await.unwrap().unwrap();
        (&mut r.source).await.unwrap().unwrap()
    }

    #[tokio::test]
    async fn what_a_relay_leaves_is_the_index_of_the_destinations_disk_after_the_copy() {
        let mut r = relay("disk0").await;
        let left = copy_a_mib_old_a_mib_new(&mut r)
            .await
            .expect("a view to leave");
        assert_eq!((left.export.as_str(), left.size), ("disk0", SIZE));
        let disk = r.disk.bytes.lock().unwrap().clone();
        assert_eq!(disk[(1 << 20) + 7], 3);
        let key = super::super::index_key(&r.session);
        assert_eq!(left.index, index_of(&disk, key));
    }

    #[tokio::test]
    async fn a_kept_index_stands_for_the_export_and_only_its_spot_check_is_read() {
        // Kept under the key of the migration that left it, not this one's.
        let kept = index_of(&vec![0xee; usize::try_from(SIZE).unwrap()], 77);
        let mut r = relay_kept(Ok(kept)).await;
        let left = copy_a_mib_old_a_mib_new(&mut r)
            .await
            .expect("a view to leave");
        let spot_check = (SPOT_CHECKED_BLOCKS * ferry_codec::PAGE_SIZE) as u64;
        assert_eq!(
            r.disk.read.load(Ordering::Relaxed),
            spot_check,
            "the export was read beyond the spot check"
        );
        assert_remembered_with_the_old_mib_same(&r);
        let disk = r.disk.bytes.lock().unwrap().clone();
        assert!(disk[1 << 20..2 << 20].iter().all(|&b| b == 3));
        // What it leaves follows on from the kept index, for the next move.
        assert_eq!(left.index, index_of(&disk, 77));
    }

    /// The report of a relay whose destination sent its kept index, after
    /// [`copy_a_mib_old_a_mib_new`]: the old MiB crossed as SAME.
    fn assert_remembered_with_the_old_mib_same(r: &Relayed) {
        let report = r.status.get().disk.expect("a disk report");
        assert_eq!(
            report.older_copy.as_deref(),
            Some("remembered"),
            "{report:?}"
        );
        assert_eq!(report.same_bytes, 1 << 20, "{report:?}");
    }

    #[tokio::test]
    async fn blocks_a_kept_index_does_not_know_are_read_and_then_cross_as_same() {
        let disk = vec![0xee; usize::try_from(SIZE).unwrap()];
        let mut base = DiskBase::parse(&index_of(&disk, 77), &[SIZE]).unwrap();
        // The first 64 blocks partly written as the domain left (a 1 KiB file system's
        // writes): the kept index does not know them.
        for b in 0..64u64 {
            base.track(&DiskOp::Write {
                disk: 0,
                offset: b * 4096 + 1024,
                data: vec![0xee; 1024],
            });
        }
        assert_eq!(base.unknown_blocks(), 64);
        let mut r = relay_kept(Ok(base.serialize())).await;
        copy_a_mib_old_a_mib_new(&mut r).await;
        assert_remembered_with_the_old_mib_same(&r);
        let read = r.disk.read.load(Ordering::Relaxed);
        let expected = ((SPOT_CHECKED_BLOCKS + 64) * ferry_codec::PAGE_SIZE) as u64;
        assert_eq!(
            read, expected,
            "the spot check and the unknown blocks, nothing else"
        );
    }

    #[tokio::test]
    async fn without_a_usable_kept_index_the_export_is_indexed_and_the_report_says_why() {
        let wrong_size = index_of(&[0xee; 8192], 77);
        // Of another disk: the export does not read back as it says.
        let mut other = vec![0xee; usize::try_from(SIZE).unwrap()];
        other[3 << 20..].fill(0x11);
        let cases = [
            (
                Err("no index kept from the domain's departure".to_owned()),
                "no index kept",
            ),
            (Ok(wrong_size), "the kept index does not fit this export"),
            (
                Ok(index_of(&other, 77)),
                "the export does not hold what the index kept when the domain left says",
            ),
        ];
        for (kept, why) in cases {
            let mut r = relay_kept(kept).await;
            copy_a_mib_old_a_mib_new(&mut r).await;
            let read = r.disk.read.load(Ordering::Relaxed);
            assert!(read >= SIZE, "indexed whole: {read} bytes read");
            let report = r.status.get().disk.expect("a disk report");
            assert_eq!(report.older_copy.as_deref(), Some("index"), "{report:?}");
            assert_eq!(report.same_bytes, 1 << 20, "{report:?}");
            let note = report.older_copy_note.unwrap_or_default();
            assert!(note.contains("was indexed") && note.contains(why), "{note}");
        }
    }

    #[test]
    fn allocation_is_widened_to_whole_blocks_and_merged() {
        let ranges = [(512, 100), (4096, 10), (10_000, 5_000), (20_480, 4096)];
        assert_eq!(
            block_aligned(&ranges, 24_000),
            vec![(0, 16_384), (20_480, 3_520)]
        );
    }

    #[tokio::test]
    async fn a_write_the_destination_refuses_fails_the_flush() {
        let r = relay("disk0").await;
        let mirror = r.mirror.unwrap();
        r.disk.fail_writes.store(true, Ordering::Relaxed);
        // Buffered here, so it completes; the destination's refusal shows at the flush.
        mirror
            .write(0, Bytes::from(vec![1u8; 4096]))
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
        let flushed = mirror.flush().await.unwrap().wait().await;
        assert!(flushed.is_err(), "{flushed:?}");
        let err = r.destination.await.unwrap().unwrap_err();
        assert!(
            format!("{err:#}").contains("writing to the destination's disk"),
            "{err:#}"
        );
        let err = r.source.await.unwrap().unwrap_err();
        assert!(
            format!("{err:#}").contains("writing to the destination's disk"),
            "{err:#}"
        );
    }

    #[tokio::test]
    async fn a_session_lost_with_requests_in_flight_fails_them_and_the_flush_and_ends_the_relay() {
        let r = relay("disk0").await;
        let mirror = r.mirror.unwrap();
        // The destination's disk stops taking writes: the buffer fills, and the writes past it
        // wait for room, in flight.
        let held = r.disk.held.write().await;
        let mut in_flight = Vec::new();
        for i in 0..48u64 {
            let data = Bytes::from(vec![9u8; 64 << 10]);
            in_flight.push(mirror.write(i % 60 * (64 << 10), data).await.unwrap());
        }
        let flush = mirror.flush().await.unwrap();
        r.session.fail("the link is gone");
        let within = Duration::from_secs(10);
        let mut failed = 0;
        for request in in_flight {
            let answered = tokio::time::timeout(within, request.wait()).await;
            failed += usize::from(answered.expect("every write is answered").is_err());
        }
        assert!(
            failed > 0,
            "the writes past the buffer cannot have completed"
        );
        let flushed = tokio::time::timeout(within, flush.wait()).await;
        assert!(flushed.expect("the flush is answered").is_err());
        let ended = tokio::time::timeout(within, r.source).await;
        let err = ended.expect("the relay ends").unwrap().unwrap_err();
        assert!(format!("{err:#}").contains("the link is gone"), "{err:#}");
        drop(held);
        r.destination.abort();
    }

    #[tokio::test]
    async fn an_export_that_stops_answering_fails_the_flush_and_ends_the_relay() {
        let r = relay("disk0").await;
        let mirror = r.mirror.unwrap();
        // The destination's QEMU stops answering (its main loop stuck) with the session up:
        // its applier gives up after its bound, and the source's flush fails instead of
        // holding QEMU's mirror, and libvirt's failure path, forever.
        let held = r.disk.held.write().await;
        let write = mirror.write(0, Bytes::from(vec![5u8; 4096])).await.unwrap();
        write.wait().await.unwrap();
        let flush = mirror.flush().await.unwrap();
        let within = Duration::from_secs(30);
        let flushed = tokio::time::timeout(within, flush.wait()).await;
        assert!(flushed.expect("the flush is answered").is_err());
        let ended = tokio::time::timeout(within, r.source).await;
        let err = ended.expect("the relay ends").unwrap().unwrap_err();
        assert!(
            format!("{err:#}").contains("did not answer a write on its disk export"),
            "{err:#}"
        );
        drop(held);
    }

    #[tokio::test]
    async fn an_export_the_destination_lacks_is_refused_with_its_words() {
        let r = relay("nope").await;
        let err = r.mirror.err().expect("refused").to_string();
        assert!(
            err.starts_with("nbd: no export \"nope\": at the destination: ")
                && err.contains("this server offers \"disk0\""),
            "{err}"
        );
        r.source.abort();
        r.destination.abort();
    }
}
