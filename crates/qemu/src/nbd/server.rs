//! An NBD server for one export, meant to be the target of QEMU's `blockdev-mirror`: it takes
//! WRITE, WRITE_ZEROES, TRIM and FLUSH and hands them to a [`Blocks`] implementation, which
//! decides what "done" means (buffered, or applied far away). READ is answered only if the
//! implementation supports it.
//!
//! Requests run concurrently (QEMU keeps many in flight), with one rule that keeps the export's
//! content well defined: a request that overlaps one still in flight waits until that one has
//! been answered, so overlapping requests reach [`Blocks`] in the order they arrived.
//! Memory is bounded: at most [`MAX_IN_FLIGHT_BYTES`] of payload and [`MAX_IN_FLIGHT`]
//! requests are held; beyond that the server stops reading and the client's socket blocks.
//!
//! Peer bytes are untrusted: lengths are capped before anything is allocated, a bad magic or an
//! over-long request ends the connection with a named error, and a well-formed request the
//! server cannot honour (out of range, unknown command, READ on a write-only target) gets an
//! errno reply while the connection goes on.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::task::AbortOnDropHandle;

use super::proto::*;

/// What the export's bytes go to. Errors are NBD errno values ([`EIO`], [`ENOSPC`], ...); the
/// implementation logs why.
pub trait Blocks: Send + Sync + 'static {
    fn write(&self, offset: u64, data: Bytes) -> impl Future<Output = Result<(), u32>> + Send;
    /// `may_trim`: the client allows the range to become a hole (no `NO_HOLE` flag).
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
    ) -> impl Future<Output = Result<(), u32>> + Send;
    fn trim(&self, offset: u64, len: u64) -> impl Future<Output = Result<(), u32>> + Send;
    fn flush(&self) -> impl Future<Output = Result<(), u32>> + Send;
    /// READ; the default refuses it (a mirror target is never read).
    fn read(&self, offset: u64, len: u32) -> impl Future<Output = Result<Bytes, u32>> + Send {
        let _ = (offset, len);
        async { Err(EINVAL) }
    }
}

/// An export a server offers.
#[derive(Debug, Clone)]
pub struct Export {
    pub name: String,
    pub size: u64,
    /// Offer WRITE_ZEROES. QEMU's mirror first zeroes a whole target that takes them (with its
    /// own `discard=unmap`), which must not happen to a target already holding the data.
    pub write_zeroes: bool,
}

/// Where a server finds the export a client names during the handshake: one fixed export, or
/// one only known when asked for (a relay that opens the same export far away).
pub trait Exports: Send + Sync {
    /// The export called `name` (empty: the default one), or why there is none, which the
    /// client is told.
    fn find(&self, name: &str) -> impl Future<Output = Result<Export, String>> + Send;
    /// The names NBD_OPT_LIST shows.
    fn names(&self) -> Vec<String>;
}

impl Exports for Export {
    async fn find(&self, name: &str) -> Result<Export, String> {
        // An empty name means "the default export", which is the only one.
        if name.is_empty() || name == self.name {
            Ok(self.clone())
        } else {
            Err(format!("this server offers {:?}", self.name))
        }
    }

    fn names(&self) -> Vec<String> {
        vec![self.name.clone()]
    }
}

/// How a served connection ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServeEnd {
    /// The client sent NBD_CMD_DISC (after every request it sent was answered).
    Disconnected,
    /// The client closed the connection between requests.
    Closed,
    /// The client gave up during the handshake (NBD_OPT_ABORT or a close).
    HandshakeAborted,
}

/// At most this many requests in flight per connection: QEMU's mirror keeps up to 16 copy
/// operations plus the guest's own writes in flight; 256 leaves room without letting a client
/// make the server hold unbounded state.
pub const MAX_IN_FLIGHT: usize = 256;
/// At most this much payload held per connection (QEMU's mirror buffer is 16 MiB by default).
pub const MAX_IN_FLIGHT_BYTES: u64 = 64 * 1024 * 1024;

/// Block sizes advertised in NBD_INFO_BLOCK_SIZE: 512-byte minimum (QEMU's sector), 4 KiB
/// preferred (the guest's block), 32 MiB maximum per request.
const BLOCK_MIN: u32 = 512;
const BLOCK_PREFERRED: u32 = 4096;

/// Serves the export the client chooses among `exports` (one [`Export`], or an [`Exports`]
/// lookup) until it disconnects. Not cancel-safe in the middle of a request: drop it only to
/// abandon the connection.
pub async fn serve<S, E, B>(stream: S, exports: &E, blocks: Arc<B>) -> Result<ServeEnd, NbdError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    E: Exports,
    B: Blocks,
{
    let mut stream = stream;
    let Some(export) = handshake(&mut stream, exports).await? else {
        return Ok(ServeEnd::HandshakeAborted);
    };
    transmission(stream, &export, blocks).await
}

/// What the server offers on `export`.
fn transmission_flags(export: &Export) -> u16 {
    let zeroes = if export.write_zeroes {
        TFLAG_SEND_WRITE_ZEROES
    } else {
        0
    };
    TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_TRIM | zeroes
}

/// The fixed-newstyle handshake. The export the client chose when transmission begins; None
/// when it aborted.
async fn handshake<S, E>(stream: &mut S, exports: &E) -> Result<Option<Export>, NbdError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    E: Exports,
{
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting).await?;
    stream.flush().await?;

    let client_flags = match stream.read_u32().await {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if client_flags & FLAG_C_FIXED_NEWSTYLE == 0
        || client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0
    {
        return Err(NbdError::ClientFlags(client_flags));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;

    loop {
        let magic = match stream.read_u64().await {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if magic != IHAVEOPT {
            return Err(NbdError::BadMagic {
                what: "option",
                found: magic,
                expected: IHAVEOPT,
            });
        }
        let option = stream.read_u32().await?;
        let len = stream.read_u32().await?;
        if len > MAX_OPTION_BYTES {
            return Err(NbdError::OptionTooLong { option, len });
        }
        let mut data = vec![0u8; usize::try_from(len).expect("capped above")];
        stream.read_exact(&mut data).await?;

        match option {
            OPT_EXPORT_NAME => {
                // No way to refuse here but to close (the reason of NBD_OPT_GO's existence).
                let name = String::from_utf8_lossy(&data).into_owned();
                let export = match exports.find(&name).await {
                    Ok(export) => export,
                    Err(message) => return Err(NbdError::NoSuchExport { name, message }),
                };
                let mut reply = Vec::with_capacity(10 + 124);
                reply.extend_from_slice(&export.size.to_be_bytes());
                reply.extend_from_slice(&transmission_flags(&export).to_be_bytes());
                if !no_zeroes {
                    reply.extend_from_slice(&[0u8; 124]);
                }
                stream.write_all(&reply).await?;
                stream.flush().await?;
                return Ok(Some(export));
            }
            OPT_GO | OPT_INFO => {
                let Some(go) = GoRequest::decode(&data) else {
                    option_error(stream, option, REP_ERR_INVALID, "malformed request").await?;
                    continue;
                };
                let export = match exports.find(&go.name).await {
                    Ok(export) => export,
                    Err(msg) => {
                        option_error(stream, option, REP_ERR_UNKNOWN, &msg).await?;
                        continue;
                    }
                };
                let mut info = Vec::with_capacity(12);
                info.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                info.extend_from_slice(&export.size.to_be_bytes());
                info.extend_from_slice(&transmission_flags(&export).to_be_bytes());
                option_reply(stream, option, REP_INFO, &info).await?;
                if go.infos.contains(&INFO_BLOCK_SIZE) {
                    let mut bs = Vec::with_capacity(14);
                    bs.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                    bs.extend_from_slice(&BLOCK_MIN.to_be_bytes());
                    bs.extend_from_slice(&BLOCK_PREFERRED.to_be_bytes());
                    bs.extend_from_slice(&MAX_PAYLOAD_BYTES.to_be_bytes());
                    option_reply(stream, option, REP_INFO, &bs).await?;
                }
                option_reply(stream, option, REP_ACK, &[]).await?;
                if option == OPT_GO {
                    return Ok(Some(export));
                }
            }
            OPT_LIST => {
                for name in exports.names() {
                    let name_len = u32::try_from(name.len()).expect("short export name");
                    let mut entry = Vec::with_capacity(4 + name.len());
                    entry.extend_from_slice(&name_len.to_be_bytes());
                    entry.extend_from_slice(name.as_bytes());
                    option_reply(stream, option, REP_SERVER, &entry).await?;
                }
                option_reply(stream, option, REP_ACK, &[]).await?;
            }
            OPT_ABORT => {
                // The client may already have closed; a failed courtesy reply is no error.
                let _ = option_reply(stream, option, REP_ACK, &[]).await;
                return Ok(None);
            }
            _ => {
                let msg = format!("option {option} is not supported by ferry's NBD server");
                option_error(stream, option, REP_ERR_UNSUP, &msg).await?;
            }
        }
    }
}

async fn option_reply<S: AsyncWrite + Unpin>(
    stream: &mut S,
    option: u32,
    reply: u32,
    data: &[u8],
) -> Result<(), NbdError> {
    let len = u32::try_from(data.len()).expect("option replies are small");
    stream
        .write_all(&option_reply_header(option, reply, len))
        .await?;
    stream.write_all(data).await?;
    stream.flush().await?;
    Ok(())
}

/// An error reply; the spec lets it carry a human-readable message, which QEMU prints.
async fn option_error<S: AsyncWrite + Unpin>(
    stream: &mut S,
    option: u32,
    reply: u32,
    message: &str,
) -> Result<(), NbdError> {
    tracing::debug!(option, reply, message, "nbd option refused");
    option_reply(stream, option, reply, message.as_bytes()).await
}

/// One request read off the wire, with its payload.
struct Incoming {
    header: RequestHeader,
    payload: Bytes,
}

/// Reads requests and passes them on; ends at a clean EOF (None sent by closing) or the first
/// protocol error.
async fn read_requests<R: AsyncRead + Unpin>(
    mut r: R,
    tx: mpsc::Sender<Result<Incoming, NbdError>>,
) {
    loop {
        let mut h = [0u8; REQUEST_BYTES];
        match r.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return,
            Err(e) => {
                let _ = tx.send(Err(e.into())).await;
                return;
            }
        }
        let header = match RequestHeader::decode(&h) {
            Ok(h) => h,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
        };
        let mut payload = Bytes::new();
        if header.has_payload() {
            if header.length > MAX_PAYLOAD_BYTES {
                let _ = tx
                    .send(Err(NbdError::PayloadTooLarge { len: header.length }))
                    .await;
                return;
            }
            let mut buf = BytesMut::zeroed(usize::try_from(header.length).expect("capped"));
            if let Err(e) = r.read_exact(&mut buf).await {
                let _ = tx.send(Err(e.into())).await;
                return;
            }
            payload = buf.freeze();
        }
        let disconnect = header.command == Command::Disconnect;
        if tx.send(Ok(Incoming { header, payload })).await.is_err() || disconnect {
            return;
        }
    }
}

/// A request being served: its id (arrival order), the byte range it touches and the payload
/// bytes it holds.
struct Running {
    id: u64,
    range: Option<(u64, u64)>,
    held: u64,
}

fn overlaps(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> bool {
    match (a, b) {
        (Some((a0, a1)), Some((b0, b1))) => a0 < b1 && b0 < a1,
        _ => false,
    }
}

/// The byte range a request touches (None: none, as for FLUSH).
fn range_of(h: &RequestHeader) -> Option<(u64, u64)> {
    match h.command {
        Command::Write | Command::WriteZeroes | Command::Trim | Command::Read => {
            Some((h.offset, h.offset.saturating_add(u64::from(h.length))))
        }
        _ => None,
    }
}

/// Why a well-formed request cannot be served (as an errno), before it reaches [`Blocks`].
fn refusal(h: &RequestHeader, export: &Export) -> Option<u32> {
    match h.command {
        Command::Other(_) => Some(EINVAL),
        Command::Read if h.length > MAX_PAYLOAD_BYTES => Some(EINVAL),
        Command::Read | Command::Write | Command::WriteZeroes | Command::Trim => {
            let end = h.offset.checked_add(u64::from(h.length));
            (!matches!(end, Some(e) if e <= export.size) || h.length == 0).then_some(EINVAL)
        }
        Command::Flush | Command::Disconnect => None,
    }
}

type Outcome = (u64, u64, Result<Bytes, u32>);

fn start<B: Blocks>(tasks: &mut JoinSet<Outcome>, blocks: &Arc<B>, id: u64, req: Incoming) {
    let blocks = blocks.clone();
    tasks.spawn(async move {
        let h = req.header;
        let len = u64::from(h.length);
        let result = match h.command {
            Command::Write => blocks
                .write(h.offset, req.payload)
                .await
                .map(|()| Bytes::new()),
            Command::WriteZeroes => blocks
                .write_zeroes(h.offset, len, h.flags & CMD_FLAG_NO_HOLE == 0)
                .await
                .map(|()| Bytes::new()),
            Command::Trim => blocks.trim(h.offset, len).await.map(|()| Bytes::new()),
            Command::Flush => blocks.flush().await.map(|()| Bytes::new()),
            Command::Read => match blocks.read(h.offset, h.length).await {
                Ok(data) if data.len() as u64 == len => Ok(data),
                Ok(_) => Err(EIO),
                Err(e) => Err(e),
            },
            Command::Disconnect | Command::Other(_) => Err(EINVAL),
        };
        (id, h.cookie, result)
    });
}

async fn send_reply<W: AsyncWrite + Unpin>(
    w: &mut W,
    errno: u32,
    cookie: u64,
    data: &[u8],
) -> Result<(), NbdError> {
    w.write_all(&SimpleReply { errno, cookie }.encode()).await?;
    if errno == 0 && !data.is_empty() {
        w.write_all(data).await?;
    }
    w.flush().await?;
    Ok(())
}

async fn transmission<S, B>(
    stream: S,
    export: &Export,
    blocks: Arc<B>,
) -> Result<ServeEnd, NbdError>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    B: Blocks,
{
    let (r, mut w) = tokio::io::split(stream);
    // Capacity 1: the reader is at most one request ahead of what the server has taken in.
    let (tx, mut rx) = mpsc::channel(1);
    // Stopped however this ends, also when the caller drops this future (its peer gave up):
    // the reader holds the connection's read half, and while it lives QEMU's client never sees
    // the connection close and waits for its replies for ever.
    let _reader = AbortOnDropHandle::new(tokio::spawn(read_requests(r, tx)));
    let mut running: Vec<Running> = Vec::new();
    let mut parked: VecDeque<(u64, Incoming)> = VecDeque::new();
    let mut tasks: JoinSet<Outcome> = JoinSet::new();
    let mut held_bytes = 0u64;
    let mut next_id = 0u64;
    let mut reading = true;
    let mut end = ServeEnd::Closed;
    let mut failure = None;

    let result = loop {
        if !reading && tasks.is_empty() {
            break Ok(end);
        }
        let room = running.len() + parked.len() < MAX_IN_FLIGHT && held_bytes < MAX_IN_FLIGHT_BYTES;
        tokio::select! {
            msg = rx.recv(), if reading && room => {
                let incoming = match msg {
                    None => { reading = false; continue; }
                    Some(Err(e)) => { reading = false; failure = Some(e); continue; }
                    Some(Ok(i)) => i,
                };
                let h = incoming.header;
                if h.command == Command::Disconnect {
                    reading = false;
                    end = ServeEnd::Disconnected;
                    continue;
                }
                if let Some(errno) = refusal(&h, export) {
                    tracing::warn!(command = h.command.name(), number = h.command.to_wire(), offset = h.offset, len = h.length, errno, "nbd request refused");
                    if let Err(e) = send_reply(&mut w, errno, h.cookie, &[]).await { break Err(e); }
                    continue;
                }
                let id = next_id;
                next_id += 1;
                held_bytes += incoming.payload.len() as u64;
                let range = range_of(&h);
                let blocked = running.iter().any(|r| overlaps(r.range, range))
                    || parked.iter().any(|(_, p)| overlaps(range_of(&p.header), range));
                if blocked {
                    parked.push_back((id, incoming));
                } else {
                    running.push(Running { id, range, held: incoming.payload.len() as u64 });
                    start(&mut tasks, &blocks, id, incoming);
                }
            }
            done = tasks.join_next(), if !tasks.is_empty() => {
                let (id, cookie, outcome) = match done {
                    Some(Ok(d)) => d,
                    Some(Err(e)) => break Err(NbdError::Io(format!("request task failed: {e}"))),
                    None => continue,
                };
                if let Some(pos) = running.iter().position(|r| r.id == id) {
                    held_bytes -= running.swap_remove(pos).held;
                }
                let (errno, data) = match outcome {
                    Ok(data) => (0, data),
                    Err(errno) => (errno, Bytes::new()),
                };
                if let Err(e) = send_reply(&mut w, errno, cookie, &data).await { break Err(e); }
                // Start parked requests that no longer overlap anything ahead of them.
                let mut still: VecDeque<(u64, Incoming)> = VecDeque::new();
                while let Some((pid, p)) = parked.pop_front() {
                    let range = range_of(&p.header);
                    let blocked = running.iter().any(|r| overlaps(r.range, range))
                        || still.iter().any(|(_, q)| overlaps(range_of(&q.header), range));
                    if blocked {
                        still.push_back((pid, p));
                    } else {
                        running.push(Running { id: pid, range, held: p.payload.len() as u64 });
                        start(&mut tasks, &blocks, pid, p);
                    }
                }
                parked = still;
            }
        }
    };
    match (result, failure) {
        (Err(e), _) | (Ok(_), Some(e)) => Err(e),
        (Ok(end), None) => Ok(end),
    }
}
