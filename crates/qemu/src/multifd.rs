//! QEMU's multifd channels (QEMU 10): a parser for one channel's bytes that finds the pages of
//! each packet, and the writer that turns the parsed items back into the exact bytes QEMU
//! wrote.
//!
//! With the `multifd` capability on, QEMU opens the main stream ([`crate::stream`]: devices,
//! the RAM block list, sync markers, no pages) and `multifd-channels` more connections that
//! carry the pages. The format, as QEMU's `migration/multifd.c` and `multifd-nocomp.c` write
//! it (all integers big-endian):
//!
//! ```text
//! channel  := init packet*
//! init     := be32 0x11223344 be32 1 uuid[16] u8 id u8[7] be64[4]            64 bytes
//! packet   := header body
//! header   := be32 0x11223344 be32 1 be32 flags
//! body     := ram | device                    (flags bit 6: device state)
//! ram      := be32 pages_alloc be32 normal be32 next_size be64 packet_num be32 zero
//!             be32 skipped be64[3] name[256] be64 offset[PAGES]     PACKET_LEN bytes in all
//!             payload
//! payload  := page[normal]                    (no compression: next_size = normal x page)
//!           | byte[next_size]                 (zlib, zstd, ...: the pages compressed)
//! device   := idstr[256] be32 instance be32 next_size byte[next_size]
//! ```
//!
//! A RAM packet's fixed part is always as long as the receiver's packet buffer, whatever
//! `pages_alloc` says: `PAGES` is 512 KiB of pages (128 of 4 KiB), and offsets past
//! `normal + zero` are unused. The first `normal` offsets name the pages whose bytes follow,
//! the next `zero` the pages that are zero. A packet with the `SYNC` flag and no pages marks
//! the end of a pass on this channel; the main stream's `MULTIFD_FLUSH` records match them.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::stream::PAGE_SIZE;

/// The first four bytes of a channel and of every packet on it.
pub const MAGIC: [u8; 4] = [0x11, 0x22, 0x33, 0x44];
/// The multifd format version QEMU has written since 4.0.
pub const VERSION: u32 = 1;
/// A channel's init packet.
pub const INIT_LEN: usize = 64;
/// The pages one packet can carry: QEMU's `MULTIFD_PACKET_SIZE` (512 KiB) of 4 KiB pages.
pub const PAGES_PER_PACKET: usize = 512 * 1024 / PAGE_SIZE;
/// A RAM packet's fixed part: the header, the counts, the block's name and every offset slot.
pub const PACKET_LEN: usize = 320 + 8 * PAGES_PER_PACKET;
/// A device-state packet's fixed part.
pub const DEVICE_PACKET_LEN: usize = 12 + 256 + 4 + 4;
/// The largest compressed payload ferry holds for one packet: 512 KiB of pages that did not
/// compress, with room for the compressor's framing (zstd's bound is well under 1%).
pub const MAX_COMPRESSED_PAYLOAD: usize = 2 * PAGES_PER_PACKET * PAGE_SIZE;
/// The largest device-state payload ferry holds for one packet (QEMU sends a device's state
/// in pieces; VFIO's are at most a few MiB).
pub const MAX_DEVICE_PAYLOAD: usize = 64 << 20;

/// Packet flags.
pub mod flag {
    /// The end of a pass on this channel.
    pub const SYNC: u32 = 1 << 0;
    /// The compression method's bits (0: none; 1: zlib, 2: zstd, 4: QPL, 8: UADK, 16: QATzip).
    pub const COMPRESSION_MASK: u32 = 0x1f << 1;
    /// A device's state, not RAM.
    pub const DEVICE_STATE: u32 = 1 << 6;
    /// Flags this parser understands.
    pub const KNOWN: u32 = SYNC | COMPRESSION_MASK | DEVICE_STATE;
}

/// What the parser found on a channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// The channel's first 64 bytes.
    Init(ChannelInit),
    /// A packet of pages (or a sync marker, with none).
    Ram(RamPacket),
    /// A piece of a device's state: its fixed part and payload, passed through exactly.
    Device(Bytes),
}

/// A channel's init packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelInit {
    /// The channel's number (0 to `multifd-channels` - 1).
    pub id: u8,
    /// All 64 bytes as QEMU wrote them (the VM's UUID and reserved fields included).
    pub raw: Bytes,
}

/// One RAM packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamPacket {
    /// The fixed part exactly as QEMU wrote it: [`PACKET_LEN`] bytes.
    pub header: Bytes,
    /// The packet's flags.
    pub flags: u32,
    /// QEMU's global packet number (over every channel).
    pub packet_num: u64,
    /// The RAM block's name (empty in a sync packet).
    pub block: Bytes,
    /// Offsets within the block of the pages whose bytes follow.
    pub normal: Vec<u64>,
    /// Offsets within the block of pages that are zero.
    pub zero: Vec<u64>,
    /// What follows the fixed part.
    pub payload: Payload,
}

/// A RAM packet's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// No compression: one page of [`PAGE_SIZE`] bytes for each normal offset, in order.
    Pages(Vec<Bytes>),
    /// The pages as QEMU's compressor wrote them (the method in the flags).
    Compressed(Bytes),
}

impl RamPacket {
    /// The packet marks the end of a pass and carries no pages.
    pub fn is_sync(&self) -> bool {
        self.flags & flag::SYNC != 0
    }

    /// The compression method's bits (0: none).
    pub fn compression(&self) -> u32 {
        self.flags & flag::COMPRESSION_MASK
    }
}

/// Why a channel cannot be carried. Every message names what was found and where.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MultifdError {
    #[error("not a QEMU multifd channel: {what} starts with {found:02x?} at channel offset {at}, expected {MAGIC:02x?}")]
    BadMagic {
        what: &'static str,
        found: [u8; 4],
        at: u64,
    },
    #[error("QEMU multifd version {found} at channel offset {at} is not supported (ferry reads version {VERSION})")]
    BadVersion { found: u32, at: u64 },
    #[error("multifd packet with unknown flags 0x{flags:x} at channel offset {at}")]
    UnknownFlags { flags: u32, at: u64 },
    #[error("multifd packet at channel offset {at} lists {normal} normal and {zero} zero pages, more than the {PAGES_PER_PACKET} a packet holds")]
    TooManyPages { normal: u32, zero: u32, at: u64 },
    #[error("multifd packet at channel offset {at} says {next_size} payload bytes for {normal} uncompressed pages")]
    BadPayloadSize {
        normal: u32,
        next_size: u32,
        at: u64,
    },
    #[error("multifd packet at channel offset {at} announces a {size}-byte payload, more than the {limit} ferry holds for one")]
    PayloadTooLarge { size: u32, limit: usize, at: u64 },
    #[error("the multifd channel ended inside {0}")]
    Truncated(&'static str),
}

/// Parses one channel's bytes as they arrive. Feed it with [`ChannelParser::next_item`] as
/// bytes come in; it takes an item off the front of the buffer once the item is whole, and
/// never holds more than one packet ([`PACKET_LEN`] plus its payload, each capped).
#[derive(Debug, Default)]
pub struct ChannelParser {
    /// Bytes taken off the channel so far (for errors).
    at: u64,
    /// The init packet has been read.
    started: bool,
}

impl ChannelParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next whole item at the front of `buf`, removed from it; `None` until more bytes
    /// are needed.
    pub fn next_item(&mut self, buf: &mut BytesMut) -> Result<Option<Item>, MultifdError> {
        if !self.started {
            if buf.len() < INIT_LEN {
                return Ok(None);
            }
            self.check_magic_and_version(buf, "the init packet")?;
            let raw = buf.split_to(INIT_LEN).freeze();
            self.started = true;
            self.at += INIT_LEN as u64;
            return Ok(Some(Item::Init(ChannelInit { id: raw[24], raw })));
        }
        if buf.len() < 12 {
            return Ok(None);
        }
        self.check_magic_and_version(buf, "a packet")?;
        let flags = be32(&buf[8..]);
        if flags & !flag::KNOWN != 0 {
            return Err(MultifdError::UnknownFlags { flags, at: self.at });
        }
        if flags & flag::DEVICE_STATE != 0 {
            return self.device_packet(buf);
        }
        self.ram_packet(buf, flags)
    }

    /// Called at the channel's end with what is left unparsed in the buffer.
    pub fn finish(&self, left: usize) -> Result<(), MultifdError> {
        match (self.started, left) {
            (false, _) => Err(MultifdError::Truncated("the init packet")),
            (true, 0) => Ok(()),
            (true, _) => Err(MultifdError::Truncated("a packet")),
        }
    }

    fn check_magic_and_version(&self, buf: &[u8], what: &'static str) -> Result<(), MultifdError> {
        let found: [u8; 4] = buf[..4].try_into().expect("4 bytes");
        if found != MAGIC {
            return Err(MultifdError::BadMagic {
                what,
                found,
                at: self.at,
            });
        }
        let version = be32(&buf[4..]);
        if version != VERSION {
            return Err(MultifdError::BadVersion {
                found: version,
                at: self.at,
            });
        }
        Ok(())
    }

    fn ram_packet(&mut self, buf: &mut BytesMut, flags: u32) -> Result<Option<Item>, MultifdError> {
        if buf.len() < PACKET_LEN {
            return Ok(None);
        }
        let normal = be32(&buf[16..]);
        let next_size = be32(&buf[20..]);
        let zero = be32(&buf[32..]);
        let (at, compressed) = (self.at, flags & flag::COMPRESSION_MASK != 0);
        if normal as usize + zero as usize > PAGES_PER_PACKET {
            return Err(MultifdError::TooManyPages { normal, zero, at });
        }
        if !compressed && next_size as usize != normal as usize * PAGE_SIZE {
            return Err(MultifdError::BadPayloadSize {
                normal,
                next_size,
                at,
            });
        }
        if compressed && next_size as usize > MAX_COMPRESSED_PAYLOAD {
            return Err(MultifdError::PayloadTooLarge {
                size: next_size,
                limit: MAX_COMPRESSED_PAYLOAD,
                at,
            });
        }
        if buf.len() < PACKET_LEN + next_size as usize {
            return Ok(None);
        }
        let header = buf.split_to(PACKET_LEN).freeze();
        let mut payload = buf.split_to(next_size as usize).freeze();
        self.at += (PACKET_LEN + next_size as usize) as u64;
        let mut offsets = header.slice(320..);
        let mut take = |n: u32| (0..n).map(|_| offsets.get_u64()).collect::<Vec<_>>();
        let (normal_offsets, zero_offsets) = (take(normal), take(zero));
        let payload = if compressed {
            Payload::Compressed(payload)
        } else {
            Payload::Pages((0..normal).map(|_| payload.split_to(PAGE_SIZE)).collect())
        };
        let name = &header[64..320];
        let name_len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        Ok(Some(Item::Ram(RamPacket {
            flags,
            packet_num: u64::from_be_bytes(header[24..32].try_into().expect("8 bytes")),
            block: header.slice(64..64 + name_len),
            normal: normal_offsets,
            zero: zero_offsets,
            payload,
            header,
        })))
    }

    fn device_packet(&mut self, buf: &mut BytesMut) -> Result<Option<Item>, MultifdError> {
        if buf.len() < DEVICE_PACKET_LEN {
            return Ok(None);
        }
        let size = be32(&buf[DEVICE_PACKET_LEN - 4..]);
        if size as usize > MAX_DEVICE_PAYLOAD {
            return Err(MultifdError::PayloadTooLarge {
                size,
                limit: MAX_DEVICE_PAYLOAD,
                at: self.at,
            });
        }
        let len = DEVICE_PACKET_LEN + size as usize;
        if buf.len() < len {
            return Ok(None);
        }
        self.at += len as u64;
        Ok(Some(Item::Device(buf.split_to(len).freeze())))
    }
}

impl Item {
    /// Appends the item's exact bytes, as QEMU wrote them, to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            Item::Init(init) => out.put_slice(&init.raw),
            Item::Device(raw) => out.put_slice(raw),
            Item::Ram(packet) => {
                out.put_slice(&packet.header);
                match &packet.payload {
                    Payload::Pages(pages) => pages.iter().for_each(|p| out.put_slice(p)),
                    Payload::Compressed(data) => out.put_slice(data),
                }
            }
        }
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}
