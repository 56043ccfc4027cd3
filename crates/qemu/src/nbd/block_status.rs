//! Which parts of an export hold something, read through NBD block status: where a QEMU dirty
//! bitmap has recorded writes, or where the disk holds data at all.
//!
//! QEMU's NBD server offers a bitmap exported with a node as the metadata context
//! `qemu:dirty-bitmap:NAME`, and every export's allocation as `base:allocation`.
//! NBD_CMD_BLOCK_STATUS on a range answers with extents (length, flags) from the range's
//! start: for a bitmap, bit 0 set where it is dirty; for the allocation, bit 1
//! (NBD_STATE_ZERO) set where the disk reads as zeros. Block status needs structured replies,
//! which [`super::client::Client`] does not speak, so this is a connection of its own: one
//! request at a time, as the source agent asks about each snapshot before it is sent.
//!
//! ```text
//! options:      STRUCTURED_REPLY; SET_META_CONTEXT(export, [context])
//!               -> META_CONTEXT(id, name) ACK; GO(export)
//! request:      BLOCK_STATUS offset, length
//! reply chunks: u32 0x668e33ef, u16 flags (DONE = 1), u16 type, u64 cookie, u32 length, data
//!               BLOCK_STATUS data: u32 context id, (u32 length, u32 flags)*
//!               ERROR data: u32 errno, u16 message length, message
//! ```

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::client::{go, greet, option_reply, send_option};
use super::proto::*;

/// The most one request asks about (the spec's length is a u32; QEMU answers in pieces).
const MAX_ASK: u64 = 1 << 30;
/// The most data one reply chunk may carry: QEMU sends at most 131,072 extents of 8 bytes
/// after the 4-byte context id; this allows twice that.
const MAX_CHUNK_BYTES: u32 = 4 + 8 * (1 << 18);
/// Flag bit 0 of a `qemu:dirty-bitmap:` extent: the bitmap is dirty there.
const DIRTY: u32 = 1;
/// Flag bit 1 of a `base:allocation` extent (NBD_STATE_ZERO): the disk reads as zeros there.
const STATE_ZERO: u32 = 2;

/// Which extents a reader reports.
#[derive(Debug, Clone, Copy)]
enum Wanted {
    /// Dirty in a `qemu:dirty-bitmap:` context.
    Dirty,
    /// Not known to read as zeros, in `base:allocation`.
    Data,
}

impl Wanted {
    fn matches(self, flags: u32) -> bool {
        match self {
            Wanted::Dirty => flags & DIRTY != 0,
            Wanted::Data => flags & STATE_ZERO == 0,
        }
    }
}

/// A connection that reads one metadata context of one export.
pub struct BlockStatusReader<S> {
    stream: S,
    context: u32,
    wanted: Wanted,
    size: u64,
    next_cookie: u64,
}

impl<S: AsyncRead + AsyncWrite + Unpin> BlockStatusReader<S> {
    /// Handshakes on `stream` for `export` and the bitmap `bitmap` exported with it; the
    /// ranges read are the bitmap's dirty ones.
    pub async fn dirty_bitmap(
        stream: S,
        export: &str,
        bitmap: &str,
    ) -> Result<BlockStatusReader<S>, NbdError> {
        let query = format!("qemu:dirty-bitmap:{bitmap}");
        Self::connect(stream, export, query, Wanted::Dirty).await
    }

    /// Handshakes on `stream` for `export`'s allocation; the ranges read are those that may
    /// hold data (everything else reads as zeros).
    pub async fn data(stream: S, export: &str) -> Result<BlockStatusReader<S>, NbdError> {
        Self::connect(stream, export, "base:allocation".into(), Wanted::Data).await
    }

    async fn connect(
        mut stream: S,
        export: &str,
        query: String,
        wanted: Wanted,
    ) -> Result<BlockStatusReader<S>, NbdError> {
        greet(&mut stream).await?;
        send_option(&mut stream, OPT_STRUCTURED_REPLY, &[]).await?;
        match option_reply(&mut stream, OPT_STRUCTURED_REPLY, export).await? {
            (REP_ACK, _) => {}
            (other, _) => {
                return Err(NbdError::UnexpectedReply {
                    option: OPT_STRUCTURED_REPLY,
                    detail: format!("reply type {other}"),
                })
            }
        }
        send_option(
            &mut stream,
            OPT_SET_META_CONTEXT,
            &meta_context_request(export, &query),
        )
        .await?;
        let mut context = None;
        loop {
            match option_reply(&mut stream, OPT_SET_META_CONTEXT, export).await? {
                (REP_META_CONTEXT, data) if data.len() >= 4 => {
                    if data[4..] == *query.as_bytes() {
                        context = Some(u32::from_be_bytes(data[..4].try_into().expect("4")));
                    }
                }
                (REP_ACK, _) => break,
                (other, _) => {
                    return Err(NbdError::UnexpectedReply {
                        option: OPT_SET_META_CONTEXT,
                        detail: format!("reply type {other}"),
                    })
                }
            }
        }
        let context = context.ok_or_else(|| NbdError::UnexpectedReply {
            option: OPT_SET_META_CONTEXT,
            detail: format!("export {export:?} has no context {query:?}"),
        })?;
        let info = go(&mut stream, export).await?;
        Ok(BlockStatusReader {
            stream,
            context,
            wanted,
            size: info.size,
            next_cookie: 1,
        })
    }

    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The ranges `(offset, length)` within `offset..offset + len` the reader reports (dirty,
    /// or holding data), in order, adjacent ones merged.
    pub async fn ranges(&mut self, offset: u64, len: u64) -> Result<Vec<(u64, u64)>, NbdError> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.size)
            .ok_or_else(|| {
                NbdError::Io(format!(
                    "block status of {offset}+{len} asked beyond the export's {} bytes",
                    self.size
                ))
            })?;
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut at = offset;
        while at < end {
            let ask = u32::try_from((end - at).min(MAX_ASK)).expect("capped");
            let covered = self.ask(at, ask, &mut out).await?;
            at += covered;
        }
        Ok(out)
    }

    /// One BLOCK_STATUS request; appends its wanted extents and returns how many bytes its
    /// answer covered (at least one, at most `ask`).
    async fn ask(&mut self, at: u64, ask: u32, out: &mut Vec<(u64, u64)>) -> Result<u64, NbdError> {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let header = RequestHeader {
            flags: 0,
            command: Command::Other(CMD_BLOCK_STATUS),
            cookie,
            offset: at,
            length: ask,
        };
        self.stream.write_all(&header.encode()).await?;
        self.stream.flush().await?;
        let failed = |errno| NbdError::Command {
            command: "BLOCK_STATUS",
            offset: at,
            len: u64::from(ask),
            errno,
        };
        let mut covered = 0u64;
        loop {
            let magic = self.stream.read_u32().await?;
            if magic == SIMPLE_REPLY_MAGIC {
                // Allowed for an error only: a block status answer is structured.
                let errno = self.stream.read_u32().await?;
                let _cookie = self.stream.read_u64().await?;
                return Err(failed(if errno == 0 { EIO } else { errno }));
            }
            if magic != STRUCTURED_REPLY_MAGIC {
                return Err(NbdError::BadMagic {
                    what: "structured reply",
                    found: u64::from(magic),
                    expected: u64::from(STRUCTURED_REPLY_MAGIC),
                });
            }
            let flags = self.stream.read_u16().await?;
            let kind = self.stream.read_u16().await?;
            let got = self.stream.read_u64().await?;
            let len = self.stream.read_u32().await?;
            if got != cookie {
                return Err(NbdError::UnexpectedReply {
                    option: 0,
                    detail: format!("a reply for cookie {got} while {cookie} was asked"),
                });
            }
            if len > MAX_CHUNK_BYTES {
                return Err(NbdError::PayloadTooLarge { len });
            }
            let mut data = vec![0u8; usize::try_from(len).expect("capped")];
            self.stream.read_exact(&mut data).await?;
            match kind {
                REPLY_TYPE_NONE => {}
                REPLY_TYPE_BLOCK_STATUS => {
                    covered += self.extents(&data, at + covered, u64::from(ask) - covered, out)?;
                }
                k if k & REPLY_TYPE_ERROR_BIT != 0 => {
                    let errno = data
                        .get(..4)
                        .map_or(EIO, |b| u32::from_be_bytes(b.try_into().expect("4")));
                    return Err(failed(errno));
                }
                other => {
                    return Err(NbdError::UnexpectedReply {
                        option: 0,
                        detail: format!("structured reply type {other} to BLOCK_STATUS"),
                    })
                }
            }
            if flags & REPLY_FLAG_DONE != 0 {
                break;
            }
        }
        if covered == 0 {
            return Err(NbdError::UnexpectedReply {
                option: 0,
                detail: format!("BLOCK_STATUS at {at} answered no extent"),
            });
        }
        Ok(covered)
    }

    /// Parses one BLOCK_STATUS chunk whose extents start at `from`; the last may reach past
    /// the `left` bytes asked and is cut there. Returns the bytes covered.
    fn extents(
        &self,
        data: &[u8],
        from: u64,
        left: u64,
        out: &mut Vec<(u64, u64)>,
    ) -> Result<u64, NbdError> {
        let bad = |detail: String| NbdError::UnexpectedReply { option: 0, detail };
        if data.len() < 4 || !(data.len() - 4).is_multiple_of(8) {
            return Err(bad(format!("a block status chunk of {} bytes", data.len())));
        }
        let context = u32::from_be_bytes(data[..4].try_into().expect("4"));
        if context != self.context {
            return Err(bad(format!(
                "block status for context {context}, not {}",
                self.context
            )));
        }
        let mut covered = 0u64;
        for d in data[4..].chunks_exact(8) {
            let len = u64::from(u32::from_be_bytes(d[..4].try_into().expect("4")));
            let flags = u32::from_be_bytes(d[4..].try_into().expect("4"));
            if len == 0 {
                return Err(bad("an extent of length 0".into()));
            }
            let len = len.min(left - covered);
            if self.wanted.matches(flags) {
                let start = from + covered;
                match out.last_mut() {
                    Some((o, l)) if *o + *l == start => *l += len,
                    _ => out.push((start, len)),
                }
            }
            covered += len;
            if covered == left {
                break;
            }
        }
        Ok(covered)
    }
}

fn meta_context_request(export: &str, query: &str) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&u32::try_from(export.len()).expect("short").to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&1u32.to_be_bytes());
    data.extend_from_slice(&u32::try_from(query.len()).expect("short").to_be_bytes());
    data.extend_from_slice(query.as_bytes());
    data
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // small test values
mod tests {
    use super::*;
    use tokio::io::DuplexStream;

    async fn reply(s: &mut DuplexStream, option: u32, kind: u32, data: &[u8]) {
        s.write_u64(REPLY_MAGIC).await.unwrap();
        s.write_u32(option).await.unwrap();
        s.write_u32(kind).await.unwrap();
        s.write_u32(data.len() as u32).await.unwrap();
        s.write_all(data).await.unwrap();
    }

    async fn read_option(s: &mut DuplexStream) -> (u32, Vec<u8>) {
        assert_eq!(s.read_u64().await.unwrap(), IHAVEOPT);
        let option = s.read_u32().await.unwrap();
        let mut data = vec![0; s.read_u32().await.unwrap() as usize];
        s.read_exact(&mut data).await.unwrap();
        (option, data)
    }

    async fn chunk(s: &mut DuplexStream, flags: u16, kind: u16, cookie: u64, data: &[u8]) {
        s.write_u32(STRUCTURED_REPLY_MAGIC).await.unwrap();
        s.write_u16(flags).await.unwrap();
        s.write_u16(kind).await.unwrap();
        s.write_u64(cookie).await.unwrap();
        s.write_u32(data.len() as u32).await.unwrap();
        s.write_all(data).await.unwrap();
    }

    fn extents(context: u32, list: &[(u32, u32)]) -> Vec<u8> {
        let mut d = context.to_be_bytes().to_vec();
        for (len, flags) in list {
            d.extend_from_slice(&len.to_be_bytes());
            d.extend_from_slice(&flags.to_be_bytes());
        }
        d
    }

    /// A scripted server: the handshake QEMU gives, then `answer` for each request.
    async fn server(
        mut s: DuplexStream,
        query: &'static str,
        has_context: bool,
        answers: Vec<Vec<(u16, u16, Vec<u8>)>>,
    ) {
        s.write_u64(NBDMAGIC).await.unwrap();
        s.write_u64(IHAVEOPT).await.unwrap();
        s.write_u16(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES)
            .await
            .unwrap();
        assert_eq!(s.read_u32().await.unwrap() & FLAG_C_FIXED_NEWSTYLE, 1);
        assert_eq!(read_option(&mut s).await.0, OPT_STRUCTURED_REPLY);
        reply(&mut s, OPT_STRUCTURED_REPLY, REP_ACK, &[]).await;
        let (option, data) = read_option(&mut s).await;
        assert_eq!(option, OPT_SET_META_CONTEXT);
        assert!(data.ends_with(query.as_bytes()), "{data:?}");
        if has_context {
            let mut ctx = 7u32.to_be_bytes().to_vec();
            ctx.extend_from_slice(query.as_bytes());
            reply(&mut s, OPT_SET_META_CONTEXT, REP_META_CONTEXT, &ctx).await;
        }
        reply(&mut s, OPT_SET_META_CONTEXT, REP_ACK, &[]).await;
        if !has_context {
            return;
        }
        assert_eq!(read_option(&mut s).await.0, OPT_GO);
        let mut info = INFO_EXPORT.to_be_bytes().to_vec();
        info.extend_from_slice(&(1u64 << 20).to_be_bytes());
        info.extend_from_slice(&(TFLAG_HAS_FLAGS | TFLAG_READ_ONLY).to_be_bytes());
        reply(&mut s, OPT_GO, REP_INFO, &info).await;
        reply(&mut s, OPT_GO, REP_ACK, &[]).await;
        for answer in answers {
            let mut h = [0u8; REQUEST_BYTES];
            s.read_exact(&mut h).await.unwrap();
            let req = RequestHeader::decode(&h).unwrap();
            assert_eq!(req.command, Command::Other(CMD_BLOCK_STATUS));
            for (flags, kind, data) in answer {
                chunk(&mut s, flags, kind, req.cookie, &data).await;
            }
        }
    }

    const BITMAP: &str = "qemu:dirty-bitmap:b0";

    #[tokio::test]
    async fn an_exports_data_is_where_it_does_not_read_as_zeros() {
        let (c, s) = tokio::io::duplex(1 << 16);
        // A hole reading as zeros, data, allocated zeros, a hole over a backing file's data.
        let answers = vec![vec![(
            REPLY_FLAG_DONE,
            REPLY_TYPE_BLOCK_STATUS,
            extents(7, &[(65536, 3), (65536, 0), (65536, 2), (65536, 1)]),
        )]];
        tokio::spawn(server(s, "base:allocation", true, answers));
        let mut r = BlockStatusReader::data(c, "disk0").await.unwrap();
        let data = r.ranges(0, 256 << 10).await.unwrap();
        assert_eq!(data, vec![(65536, 65536), (196_608, 65536)]);
    }

    #[tokio::test]
    async fn dirty_extents_are_merged_cut_to_the_range_and_asked_again_where_an_answer_stops() {
        let (c, s) = tokio::io::duplex(1 << 16);
        let answers = vec![
            // 0..64K clean, 64K..192K dirty in two extents (merged), then the answer stops.
            vec![(
                REPLY_FLAG_DONE,
                REPLY_TYPE_BLOCK_STATUS,
                extents(7, &[(65536, 0), (65536, 1), (65536, 1)]),
            )],
            // From 192K: clean 64K, then dirty far past the end of the range (cut).
            vec![
                (0, REPLY_TYPE_BLOCK_STATUS, extents(7, &[(65536, 0)])),
                (
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_BLOCK_STATUS,
                    extents(7, &[(1 << 19, 1)]),
                ),
            ],
        ];
        tokio::spawn(server(s, BITMAP, true, answers));
        let mut r = BlockStatusReader::dirty_bitmap(c, "disk0", "b0")
            .await
            .unwrap();
        assert_eq!(r.size(), 1 << 20);
        let dirty = r.ranges(0, 320 << 10).await.unwrap();
        assert_eq!(dirty, vec![(65536, 131072), (256 << 10, 64 << 10)]);
    }

    #[tokio::test]
    async fn a_missing_bitmap_an_error_chunk_and_a_range_past_the_end_are_errors() {
        let (c, s) = tokio::io::duplex(1 << 16);
        tokio::spawn(server(s, BITMAP, false, vec![]));
        let err = BlockStatusReader::dirty_bitmap(c, "disk0", "b0")
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("has no context"), "{err}");

        let (c, s) = tokio::io::duplex(1 << 16);
        let mut error = 22u32.to_be_bytes().to_vec();
        error.extend_from_slice(&0u16.to_be_bytes());
        tokio::spawn(server(
            s,
            BITMAP,
            true,
            vec![vec![(REPLY_FLAG_DONE, REPLY_TYPE_ERROR_BIT | 1, error)]],
        ));
        let mut r = BlockStatusReader::dirty_bitmap(c, "disk0", "b0")
            .await
            .unwrap();
        assert!(r.ranges(0, 1 << 21).await.is_err(), "past the end");
        let err = r.ranges(0, 4096).await.unwrap_err();
        assert!(
            err.to_string().contains("BLOCK_STATUS at 0+4096 failed"),
            "{err}"
        );
    }
}
