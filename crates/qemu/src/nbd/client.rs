//! An NBD client for one export: how the destination agent writes into the destination QEMU's
//! writable export. Fixed-newstyle handshake with NBD_OPT_GO, compact requests, simple
//! replies. Requests are pipelined: [`Client::submit`] sends one and returns a [`Pending`] to
//! await its reply, so a caller can keep many in flight. The server may run requests that are
//! in flight together in any order, so callers must not have overlapping ones in flight.
//!
//! One reader task matches replies to requests by cookie; when it dies (the server closed or
//! sent garbage), every waiter fails with the reason.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::oneshot;

use super::proto::*;

/// What the server said about its export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
}

type Waiter = (
    &'static str,
    u64,
    u64,
    u32,
    oneshot::Sender<Result<Bytes, NbdError>>,
);

#[derive(Default)]
struct Waiters {
    by_cookie: HashMap<u64, Waiter>,
    /// Set once the reader ends; later submissions fail with it.
    dead: Option<NbdError>,
}

pub struct Client<S> {
    writer: tokio::sync::Mutex<WriteHalf<S>>,
    waiters: Arc<Mutex<Waiters>>,
    next_cookie: AtomicU64,
    info: ExportInfo,
    reader: tokio::task::JoinHandle<()>,
}

/// A request on its way; await [`Pending::wait`] for the server's answer.
pub struct Pending {
    rx: oneshot::Receiver<Result<Bytes, NbdError>>,
}

impl Pending {
    /// Cancel-safe: dropping it forgets the answer, not the request.
    pub async fn wait(self) -> Result<Bytes, NbdError> {
        self.rx.await.unwrap_or(Err(NbdError::Closed {
            during: "a request",
        }))
    }
}

impl<S> Drop for Client<S> {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl<S> Client<S>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    /// Handshakes on `stream` and selects export `name`.
    pub async fn connect(stream: S, name: &str) -> Result<Client<S>, NbdError> {
        let mut stream = stream;
        let info = handshake(&mut stream, name).await?;
        let (r, w) = tokio::io::split(stream);
        let waiters = Arc::new(Mutex::new(Waiters::default()));
        let reader = tokio::spawn(read_replies(r, waiters.clone()));
        Ok(Client {
            writer: tokio::sync::Mutex::new(w),
            waiters,
            next_cookie: AtomicU64::new(1),
            info,
            reader,
        })
    }

    pub fn info(&self) -> ExportInfo {
        self.info
    }

    /// Sends one request (a WRITE's payload with it). Cancel-safe only before it is polled:
    /// dropping it mid-send leaves the connection unusable.
    pub async fn submit(
        &self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: Option<&Bytes>,
    ) -> Result<Pending, NbdError> {
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let expect = if command == Command::Read { length } else { 0 };
        {
            let mut w = self.waiters.lock().expect("waiters poisoned");
            if let Some(e) = &w.dead {
                return Err(e.clone_for_waiter());
            }
            w.by_cookie.insert(
                cookie,
                (command.name(), offset, u64::from(length), expect, tx),
            );
        }
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        let mut w = self.writer.lock().await;
        w.write_all(&header.encode()).await?;
        if let Some(p) = payload {
            w.write_all(p).await?;
        }
        w.flush().await?;
        Ok(Pending { rx })
    }

    pub async fn write(&self, offset: u64, data: Bytes) -> Result<Pending, NbdError> {
        let len =
            u32::try_from(data.len()).map_err(|_| NbdError::PayloadTooLarge { len: u32::MAX })?;
        self.submit(Command::Write, 0, offset, len, Some(&data))
            .await
    }

    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
    ) -> Result<Pending, NbdError> {
        let flags = if may_trim { 0 } else { CMD_FLAG_NO_HOLE };
        self.submit(Command::WriteZeroes, flags, offset, len, None)
            .await
    }

    pub async fn trim(&self, offset: u64, len: u32) -> Result<Pending, NbdError> {
        self.submit(Command::Trim, 0, offset, len, None).await
    }

    pub async fn flush(&self) -> Result<Pending, NbdError> {
        self.submit(Command::Flush, 0, 0, 0, None).await
    }

    pub async fn read(&self, offset: u64, len: u32) -> Result<Bytes, NbdError> {
        self.submit(Command::Read, 0, offset, len, None)
            .await?
            .wait()
            .await
    }

    /// NBD_CMD_DISC: the server finishes what is in flight and closes.
    pub async fn disconnect(&self) -> Result<(), NbdError> {
        let header = RequestHeader {
            flags: 0,
            command: Command::Disconnect,
            cookie: 0,
            offset: 0,
            length: 0,
        };
        let mut w = self.writer.lock().await;
        w.write_all(&header.encode()).await?;
        w.flush().await?;
        Ok(())
    }
}

impl NbdError {
    /// A copy for each waiter failed by the same cause.
    fn clone_for_waiter(&self) -> NbdError {
        match self {
            NbdError::Closed { during } => NbdError::Closed { during },
            other => NbdError::Io(other.to_string()),
        }
    }
}

async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    name: &str,
) -> Result<ExportInfo, NbdError> {
    greet(s).await?;
    go(s, name).await
}

/// The start of the fixed-newstyle handshake: the server's greeting and the client's flags.
pub(super) async fn greet<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> Result<(), NbdError> {
    let magic = s.read_u64().await?;
    if magic != NBDMAGIC {
        return Err(NbdError::BadMagic {
            what: "server greeting",
            found: magic,
            expected: NBDMAGIC,
        });
    }
    let opt_magic = s.read_u64().await?;
    if opt_magic != IHAVEOPT {
        return Err(NbdError::BadMagic {
            what: "server greeting (oldstyle servers are not supported)",
            found: opt_magic,
            expected: IHAVEOPT,
        });
    }
    let hflags = s.read_u16().await?;
    if hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(NbdError::UnexpectedReply {
            option: 0,
            detail: "the server does not speak fixed newstyle".into(),
        });
    }
    let mut cflags = FLAG_C_FIXED_NEWSTYLE;
    if hflags & FLAG_NO_ZEROES != 0 {
        cflags |= FLAG_C_NO_ZEROES;
    }
    s.write_u32(cflags).await?;
    Ok(())
}

/// Sends one option with its data.
pub(super) async fn send_option<S: AsyncWrite + Unpin>(
    s: &mut S,
    option: u32,
    data: &[u8],
) -> Result<(), NbdError> {
    s.write_u64(IHAVEOPT).await?;
    s.write_u32(option).await?;
    s.write_u32(u32::try_from(data.len()).expect("short option"))
        .await?;
    s.write_all(data).await?;
    s.flush().await?;
    Ok(())
}

/// Reads one reply to `option`: its type and data. An error reply is returned as such.
pub(super) async fn option_reply<S: AsyncRead + Unpin>(
    s: &mut S,
    option: u32,
    name: &str,
) -> Result<(u32, Vec<u8>), NbdError> {
    let magic = s.read_u64().await?;
    if magic != REPLY_MAGIC {
        return Err(NbdError::BadMagic {
            what: "option reply",
            found: magic,
            expected: REPLY_MAGIC,
        });
    }
    let answered = s.read_u32().await?;
    let reply = s.read_u32().await?;
    let len = s.read_u32().await?;
    if len > MAX_OPTION_BYTES {
        return Err(NbdError::OptionTooLong {
            option: answered,
            len,
        });
    }
    let mut data = vec![0u8; usize::try_from(len).expect("capped")];
    s.read_exact(&mut data).await?;
    if answered != option {
        return Err(NbdError::UnexpectedReply {
            option: answered,
            detail: format!("a reply to option {answered} when {option} was asked"),
        });
    }
    if reply & (1 << 31) != 0 {
        let message = String::from_utf8_lossy(&data).into_owned();
        if reply == REP_ERR_UNKNOWN {
            return Err(NbdError::NoSuchExport {
                name: name.to_owned(),
                message,
            });
        }
        return Err(NbdError::Refused {
            option,
            reply,
            message,
        });
    }
    Ok((reply, data))
}

/// NBD_OPT_GO for export `name`: the end of the handshake.
pub(super) async fn go<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    name: &str,
) -> Result<ExportInfo, NbdError> {
    let request = GoRequest {
        name: name.to_owned(),
        infos: vec![INFO_BLOCK_SIZE],
    }
    .encode();
    send_option(s, OPT_GO, &request).await?;
    let mut info = None;
    loop {
        let (reply, data) = option_reply(s, OPT_GO, name).await?;
        match reply {
            REP_INFO => {
                if data.len() >= 12 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT {
                    info = Some(ExportInfo {
                        size: u64::from_be_bytes(data[2..10].try_into().expect("8 bytes")),
                        flags: u16::from_be_bytes([data[10], data[11]]),
                    });
                }
            }
            REP_ACK => {
                return info.ok_or(NbdError::UnexpectedReply {
                    option: OPT_GO,
                    detail: "GO acknowledged without NBD_INFO_EXPORT".into(),
                })
            }
            other => {
                return Err(NbdError::UnexpectedReply {
                    option: OPT_GO,
                    detail: format!("reply type {other}"),
                })
            }
        }
    }
}

async fn read_replies<S: AsyncRead>(mut r: ReadHalf<S>, waiters: Arc<Mutex<Waiters>>) {
    let fail = |e: NbdError| {
        let mut w = waiters.lock().expect("waiters poisoned");
        for (_, (.., tx)) in w.by_cookie.drain() {
            let _ = tx.send(Err(e.clone_for_waiter()));
        }
        w.dead = Some(e);
    };
    loop {
        let mut h = [0u8; REPLY_BYTES];
        if let Err(e) = r.read_exact(&mut h).await {
            let e = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                NbdError::Closed {
                    during: "while requests were in flight",
                }
            } else {
                e.into()
            };
            return fail(e);
        }
        let reply = match SimpleReply::decode(&h) {
            Ok(r) => r,
            Err(e) => return fail(e),
        };
        let waiter = waiters
            .lock()
            .expect("waiters poisoned")
            .by_cookie
            .remove(&reply.cookie);
        let Some((command, offset, len, expect, tx)) = waiter else {
            return fail(NbdError::UnexpectedReply {
                option: 0,
                detail: format!("a reply for cookie {} nobody asked for", reply.cookie),
            });
        };
        if reply.errno != 0 {
            let _ = tx.send(Err(NbdError::Command {
                command,
                offset,
                len,
                errno: reply.errno,
            }));
            continue;
        }
        let mut data = BytesMut::zeroed(usize::try_from(expect).expect("u32 fits"));
        if let Err(e) = r.read_exact(&mut data).await {
            return fail(e.into());
        }
        let _ = tx.send(Ok(data.freeze()));
    }
}
