//! The NBD protocol's wire formats, as far as ferry speaks it: the fixed-newstyle handshake,
//! compact (28-byte) requests and simple replies. Every number is big-endian. The spec is
//! `doc/proto.md` in the NetworkBlockDevice/nbd repository; this module is its subset.
//!
//! ```text
//! server                                   client
//!   "NBDMAGIC" "IHAVEOPT" u16 hflags  ──▶
//!                                     ◀──  u32 client flags (FIXED_NEWSTYLE [| NO_ZEROES])
//!                                     ◀──  option: "IHAVEOPT" u32 opt, u32 len, data
//!   reply: REPLY_MAGIC u64, u32 opt,  ──▶  (repeated; GO/EXPORT_NAME end the handshake)
//!          u32 type, u32 len, data
//! transmission:
//!                                     ◀──  request: u32 0x25609513, u16 flags, u16 type,
//!                                          u64 cookie, u64 offset, u32 length [, data]
//!   reply: u32 0x67446698, u32 errno, ──▶
//!          u64 cookie [, data]
//! ```
//!
//! Options ferry does not implement (structured replies, extended headers, meta contexts,
//! TLS) are answered with `NBD_REP_ERR_UNSUP`, which every client must accept and fall back
//! from: QEMU's client then uses simple replies and compact headers.

use thiserror::Error;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) | 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) | 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) | 9;

/// Info types inside `REP_INFO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// errno values a reply may carry (the spec's list; these are Linux's numbers).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const ESHUTDOWN: u32 = 108;

/// The largest option a peer may send (QEMU's are a few hundred bytes; names are ≤ 4 KiB by
/// the spec).
pub const MAX_OPTION_BYTES: u32 = 64 * 1024;
/// The largest payload of one request: 32 MiB is what ferry advertises as the maximum block
/// size, and what QEMU's own server allows.
pub const MAX_PAYLOAD_BYTES: u32 = 32 * 1024 * 1024;
/// Structured replies (a client that asked for them: [`super::dirty`]).
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Error chunks have bit 15 set (NBD_REPLY_TYPE_ERROR, _ERROR_OFFSET).
pub const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
/// NBD_CMD_BLOCK_STATUS.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Request and simple-reply header sizes.
pub const REQUEST_BYTES: usize = 28;
pub const REPLY_BYTES: usize = 16;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum NbdError {
    #[error("nbd: peer closed the connection {during}")]
    Closed { during: &'static str },
    #[error("nbd: {0}")]
    Io(String),
    #[error("nbd: bad magic {found:#x} in {what} (expected {expected:#x})")]
    BadMagic {
        what: &'static str,
        found: u64,
        expected: u64,
    },
    #[error("nbd: client flags {0:#x}: only fixed newstyle (flag 1, optionally no-zeroes 2) is spoken here")]
    ClientFlags(u32),
    #[error("nbd: option {option} carries {len} bytes, more than the {MAX_OPTION_BYTES} allowed")]
    OptionTooLong { option: u32, len: u32 },
    #[error("nbd: request of {len} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte maximum")]
    PayloadTooLarge { len: u32 },
    #[error("nbd: server refused option {option} with {reply:#x}: {message}")]
    Refused {
        option: u32,
        reply: u32,
        message: String,
    },
    #[error("nbd: unexpected reply to option {option}: {detail}")]
    UnexpectedReply { option: u32, detail: String },
    #[error("nbd: no export {name:?}: {message}")]
    NoSuchExport { name: String, message: String },
    #[error("nbd: {command} at {offset}+{len} failed: {}", errno_text(*errno))]
    Command {
        command: &'static str,
        offset: u64,
        len: u64,
        errno: u32,
    },
}

/// An NBD reply's error in words ("No space left on device (os error 28)"): the spec's values
/// are Linux's errno numbers.
fn errno_text(errno: u32) -> String {
    i32::try_from(errno).map_or_else(
        |_| format!("error {errno}"),
        |e| std::io::Error::from_raw_os_error(e).to_string(),
    )
}

impl From<std::io::Error> for NbdError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            NbdError::Closed {
                during: "mid-message",
            }
        } else {
            NbdError::Io(e.to_string())
        }
    }
}

/// A transmission-phase command. `Invalid` stands for any number this side does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disconnect,
    Flush,
    Trim,
    WriteZeroes,
    Other(u16),
}

impl Command {
    pub fn from_wire(v: u16) -> Command {
        match v {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disconnect,
            3 => Command::Flush,
            4 => Command::Trim,
            6 => Command::WriteZeroes,
            other => Command::Other(other),
        }
    }

    pub fn to_wire(self) -> u16 {
        match self {
            Command::Read => 0,
            Command::Write => 1,
            Command::Disconnect => 2,
            Command::Flush => 3,
            Command::Trim => 4,
            Command::WriteZeroes => 6,
            Command::Other(v) => v,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Command::Read => "READ",
            Command::Write => "WRITE",
            Command::Disconnect => "DISC",
            Command::Flush => "FLUSH",
            Command::Trim => "TRIM",
            Command::WriteZeroes => "WRITE_ZEROES",
            Command::Other(_) => "unknown command",
        }
    }
}

/// A request header (compact form). A WRITE's `length` payload bytes follow it on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    pub fn decode(b: &[u8; REQUEST_BYTES]) -> Result<RequestHeader, NbdError> {
        let magic = u32::from_be_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != REQUEST_MAGIC {
            return Err(NbdError::BadMagic {
                what: "request",
                found: magic.into(),
                expected: REQUEST_MAGIC.into(),
            });
        }
        Ok(RequestHeader {
            flags: u16::from_be_bytes([b[4], b[5]]),
            command: Command::from_wire(u16::from_be_bytes([b[6], b[7]])),
            cookie: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
            offset: u64::from_be_bytes(b[16..24].try_into().expect("8 bytes")),
            length: u32::from_be_bytes(b[24..28].try_into().expect("4 bytes")),
        })
    }

    pub fn encode(&self) -> [u8; REQUEST_BYTES] {
        let mut b = [0u8; REQUEST_BYTES];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_wire().to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }

    /// Whether a payload of `length` bytes follows this header.
    pub fn has_payload(&self) -> bool {
        self.command == Command::Write
    }
}

/// A simple reply's header; a successful READ's data follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub errno: u32,
    pub cookie: u64,
}

impl SimpleReply {
    pub fn encode(&self) -> [u8; REPLY_BYTES] {
        let mut b = [0u8; REPLY_BYTES];
        b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&self.errno.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; REPLY_BYTES]) -> Result<SimpleReply, NbdError> {
        let magic = u32::from_be_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(NbdError::BadMagic {
                what: "reply (only simple replies are negotiated)",
                found: magic.into(),
                expected: SIMPLE_REPLY_MAGIC.into(),
            });
        }
        Ok(SimpleReply {
            errno: u32::from_be_bytes(b[4..8].try_into().expect("4 bytes")),
            cookie: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
        })
    }
}

/// An option reply's header bytes (magic, option, type, length).
pub fn option_reply_header(option: u32, reply: u32, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..8].copy_from_slice(&REPLY_MAGIC.to_be_bytes());
    b[8..12].copy_from_slice(&option.to_be_bytes());
    b[12..16].copy_from_slice(&reply.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// The body of `NBD_OPT_GO` / `NBD_OPT_INFO`: an export name and the info types wanted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoRequest {
    pub name: String,
    pub infos: Vec<u16>,
}

impl GoRequest {
    pub fn decode(data: &[u8]) -> Option<GoRequest> {
        let name_len =
            usize::try_from(u32::from_be_bytes(data.get(0..4)?.try_into().ok()?)).ok()?;
        let name = data.get(4..4usize.checked_add(name_len)?)?;
        let rest = &data[4 + name_len..];
        let count = usize::from(u16::from_be_bytes(rest.get(0..2)?.try_into().ok()?));
        let list = rest.get(2..)?;
        if list.len() != count * 2 {
            return None;
        }
        Some(GoRequest {
            name: String::from_utf8(name.to_vec()).ok()?,
            infos: list
                .chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]))
                .collect(),
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(8 + self.name.len() + 2 * self.infos.len());
        let name_len = u32::try_from(self.name.len()).expect("export names are short");
        b.extend_from_slice(&name_len.to_be_bytes());
        b.extend_from_slice(self.name.as_bytes());
        let count = u16::try_from(self.infos.len()).expect("a few info types");
        b.extend_from_slice(&count.to_be_bytes());
        for i in &self.infos {
            b.extend_from_slice(&i.to_be_bytes());
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips() {
        let r = RequestHeader {
            flags: CMD_FLAG_FUA,
            command: Command::WriteZeroes,
            cookie: 0x1122_3344_5566_7788,
            offset: 1 << 33,
            length: 65536,
        };
        assert_eq!(RequestHeader::decode(&r.encode()), Ok(r));
    }

    #[test]
    fn request_with_bad_magic_is_rejected_with_both_values() {
        let mut b = RequestHeader {
            flags: 0,
            command: Command::Read,
            cookie: 1,
            offset: 0,
            length: 512,
        }
        .encode();
        b[0] = 0;
        let e = RequestHeader::decode(&b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "nbd: bad magic 0x609513 in request (expected 0x25609513)"
        );
    }

    #[test]
    fn unknown_commands_keep_their_number() {
        assert_eq!(Command::from_wire(42), Command::Other(42));
        assert_eq!(Command::Other(42).to_wire(), 42);
    }

    #[test]
    fn go_request_round_trips_and_rejects_truncation() {
        let g = GoRequest {
            name: "disk0".into(),
            infos: vec![INFO_BLOCK_SIZE],
        };
        let b = g.encode();
        assert_eq!(GoRequest::decode(&b), Some(g));
        for cut in 0..b.len() {
            assert_eq!(GoRequest::decode(&b[..cut]), None, "cut at {cut}");
        }
        // A name length pointing past the end.
        assert_eq!(GoRequest::decode(&[0xff, 0xff, 0xff, 0xff, 0, 0]), None);
    }
}
