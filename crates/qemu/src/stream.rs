//! QEMU's migration stream (precopy, QEMU 10): a parser that finds the RAM page records and
//! passes every other byte through, and the writer that turns the parsed items back into the
//! exact bytes QEMU wrote.
//!
//! The format, as QEMU's `migration/savevm.c` and `migration/ram.c` write it (all integers
//! big-endian):
//!
//! ```text
//! stream   := "QEVM" be32(3) item* EOF tail
//! item     := 0x07 be32 len name [subsection*]          configuration (machine type)
//!           | 0x01 be32 id u8 len idstr be32 inst be32 ver body footer   SECTION_START
//!           | 0x02 be32 id body footer                                   SECTION_PART
//!           | 0x03 be32 id body footer                                   SECTION_END
//!           | 0x04 ...                                                   SECTION_FULL (device)
//!           | 0x08 be16 cmd be16 len data                                COMMAND
//! footer   := 0x7e be32 id
//! ram body := record* (ends with a record carrying EOS)
//! record   := be64 (offset | flags) [u8 len block-name unless CONTINUE] payload
//! ```
//!
//! Device state (`SECTION_FULL`) is VMState: its length is known only to the device's own
//! description, so nothing after the first device section can be delimited. In precopy that
//! section comes after every iterable section has ended (only device state, `EOF` and the
//! JSON description follow), so from there on the parser passes the rest through as one
//! opaque tail. A device section before every iterable section has ended, an iterable section
//! other than `ram` and `dirty-bitmap`, a command or a flag this parser does not know stops
//! the parse with an error that names it: the caller aborts the migration rather than guess.
//!
//! `dirty-bitmap` (QEMU's `migration/block-dirty-bitmap.c`, on with the `dirty-bitmaps`
//! capability: libvirt turns it on when a copied disk has a checkpoint) carries the disks'
//! persistent dirty bitmaps; QEMU then also advises postcopy (below), switching or not. Its
//! bodies are chunks, each an opaque item, the last with `EOS`:
//!
//! ```text
//! chunk := u8 flags [u8 n node] [u8 n bitmap]          names when DEVICE_NAME, BITMAP_NAME
//!          ( be32 granularity u8 bitmap-flags          START
//!          | (nothing)                                 COMPLETE
//!          | be64 sector be32 count [be64 n <n bytes>] BITS (the bytes unless ZEROES)
//!          | (nothing) )                               none of the three (EOS alone)
//! ```
//!
//! The section starts before the package (QEMU sets it up with the RAM) and may end after it.
//! A resumed stream knows only the RAM's section: a dirty-bitmap section continued in one is
//! refused (libvirt's path, the only one that turns bitmaps on, does not take postcopy).
//!
//! Postcopy (`postcopy-ram`, QEMU's `postcopy_start`) adds commands to the same stream:
//!
//! ```text
//! 0x08 be16(3) be16(16) be64 be64                     POSTCOPY_ADVISE (page sizes), at the start
//! 0x08 be16(6) be16 len u8(0) u8 n name u8(0) (be64 start be64 length)*   RAM_DISCARD
//! 0x08 be16(7) be16(4) be32 n <n bytes>               PACKAGED: LISTEN, the device state, RUN
//! ```
//!
//! The package is the switch: the source VM stopped before it, the destination runs after it,
//! and the RAM section goes on after it with the pages the destination asks for and the rest,
//! until its END and `EOF`. The package's contents are device state, passed through as opaque
//! pieces; [`StreamParser::ended_package`] says when its last piece went by.
//!
//! A postcopy migration whose connection broke resumes on a new one (`migrate resume=true`,
//! QEMU's postcopy recovery) with a stream that has no header: for each RAM block a
//! `RECV_BITMAP` (the destination answers with the pages it has), then `RESUME`, then the RAM
//! section goes on as after the package. [`StreamParser::resumed`] reads it, given the
//! [`RamLayout`] the first stream announced:
//!
//! ```text
//! 0x08 be16(10) be16 len u8 n name                    RECV_BITMAP, one per RAM block
//! 0x08 be16(9) be16(0)                                RESUME
//! ```

use std::collections::HashMap;

use bytes::{BufMut, Bytes, BytesMut};

/// The stream's first four bytes.
pub const MAGIC: &[u8; 4] = b"QEVM";
/// The stream version QEMU has written since 2.x.
pub const VERSION: u32 = 3;
/// Guest page size of x86 targets; a `PAGE` record carries exactly this many bytes.
pub const PAGE_SIZE: usize = 4096;

/// The largest item the parser waits for or gives: the stream comes from QEMU at the source
/// and from the peer at the destination, and an item is held whole until it is complete.
/// QEMU's largest before the device tail is the RAM section's setup (a block list: 265 bytes a
/// block at most); a page is 4 KiB, an XBZRLE delta or a command at most 64 KiB; the device
/// tail is given in pieces of at most this.
pub const MAX_ITEM_BYTES: usize = 1 << 20;
/// RAM blocks a stream may announce (a VM has tens: RAM, ROMs, video memory).
pub const MAX_RAM_BLOCKS: usize = 1024;
/// Capabilities a configuration section may list (QEMU 10 validates a handful).
pub const MAX_CAPABILITIES: u32 = 256;
/// The most bytes one dirty-bitmap chunk may carry: QEMU writes at most 1 KiB of bitmap per
/// chunk and refuses to read more than ten times that.
pub const MAX_BITMAP_CHUNK_BYTES: u64 = 10 << 10;

mod section {
    pub const EOF: u8 = 0x00;
    pub const START: u8 = 0x01;
    pub const PART: u8 = 0x02;
    pub const END: u8 = 0x03;
    pub const FULL: u8 = 0x04;
    pub const SUBSECTION: u8 = 0x05;
    pub const CONFIGURATION: u8 = 0x07;
    pub const COMMAND: u8 = 0x08;
    pub const FOOTER: u8 = 0x7e;
}

/// RAM record flags (the low bits of the record's address word).
pub mod flag {
    pub const ZERO: u64 = 0x02;
    pub const MEM_SIZE: u64 = 0x04;
    pub const PAGE: u64 = 0x08;
    pub const EOS: u64 = 0x10;
    pub const CONTINUE: u64 = 0x20;
    pub const XBZRLE: u64 = 0x40;
    pub const HOOK: u64 = 0x80;
    pub const COMPRESS_PAGE: u64 = 0x100;
    pub const MULTIFD_FLUSH: u64 = 0x200;
    /// The flags live below the page size.
    pub const MASK: u64 = 0xfff;
    /// Flags this parser understands.
    pub const KNOWN: u64 = ZERO | PAGE | EOS | CONTINUE | XBZRLE | MULTIFD_FLUSH;
}

/// Dirty-bitmap chunk flags (one byte; QEMU reserves the top bit for longer flags it never
/// writes).
mod bitmap_flag {
    pub const EOS: u8 = 0x01;
    pub const ZEROES: u8 = 0x02;
    pub const BITMAP_NAME: u8 = 0x04;
    pub const DEVICE_NAME: u8 = 0x08;
    pub const START: u8 = 0x10;
    pub const COMPLETE: u8 = 0x20;
    pub const BITS: u8 = 0x40;
    pub const EXTRA: u8 = 0x80;
}

/// Migration commands (`QEMU_VM_COMMAND`) that can occur at the stream's top level (LISTEN and
/// RUN only occur inside a package).
mod command {
    pub const OPEN_RETURN_PATH: u16 = 1;
    pub const PING: u16 = 2;
    pub const POSTCOPY_ADVISE: u16 = 3;
    pub const POSTCOPY_RAM_DISCARD: u16 = 6;
    pub const PACKAGED: u16 = 7;
    pub const RESUME: u16 = 9;
    pub const RECV_BITMAP: u16 = 10;
    pub const SWITCHOVER_START: u16 = 11;
}

/// Where a stream is in postcopy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Postcopy {
    /// No postcopy advice: plain precopy.
    Off,
    /// QEMU advised postcopy: it may switch (precopy may also complete as usual).
    Advised,
    /// Inside the package: the source VM has stopped.
    Package,
    /// The package has passed: the destination runs the VM, its missing pages follow.
    Running,
}

/// What a resumed stream needs to know of the stream it continues: the RAM section's id and
/// its blocks (name and size), as the first stream's setup announced them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RamLayout {
    pub section: u32,
    pub blocks: Vec<RamBlock>,
}

/// One RAM block of a [`RamLayout`]. QEMU names blocks with C strings (`RAMBlock::idstr`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RamBlock {
    pub name: String,
    pub size: u64,
}

/// What the parser found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// Bytes ferry does not interpret: the header, section headers and footers, commands,
    /// the RAM block list, device state. Passed through exactly.
    Opaque(Bytes),
    /// One RAM record.
    Ram(RamRecord),
}

/// One RAM record: a page (whole, zero, or XBZRLE-encoded) or a marker (end of section,
/// multifd flush).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamRecord {
    /// Byte offset of the page within its RAM block (page-aligned).
    pub offset: u64,
    /// The `flag` bits as QEMU wrote them.
    pub flags: u64,
    /// The block's name, present when QEMU wrote it (`CONTINUE` clear).
    pub block: Option<Bytes>,
    /// The payload that follows the header.
    pub data: RamData,
}

/// A RAM record's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RamData {
    /// Markers carry nothing.
    None,
    /// `ZERO`: one fill byte (QEMU writes 0).
    Fill(u8),
    /// `PAGE`: the page's bytes.
    Page(Bytes),
    /// `XBZRLE`: the encoded delta (after its one-byte encoding tag and be16 length).
    Xbzrle(Bytes),
}

/// Why a stream cannot be carried. Every message names what was found and where.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StreamError {
    #[error("not a QEMU migration stream: it starts with {0:02x?}, expected \"QEVM\"")]
    BadMagic([u8; 4]),
    #[error("QEMU migration stream version {0} is not supported (ferry reads version 3)")]
    BadVersion(u32),
    #[error("unknown section type 0x{kind:02x} at stream offset {at}")]
    UnknownSection { kind: u8, at: u64 },
    #[error("iterable section \"{0}\" is not supported (ferry carries RAM and dirty bitmaps; disable the capability that adds it)")]
    UnsupportedIterable(String),
    #[error("device section \"{0}\" arrived before the iterable sections ended; its state cannot be delimited (early-setup devices are not supported)")]
    EarlyDevice(String),
    #[error("dirty-bitmap chunk with flags 0x{flags:02x} at stream offset {at}, which QEMU does not write")]
    UnsupportedBitmapFlags { flags: u8, at: u64 },
    #[error("dirty-bitmap chunk of {size} bytes at stream offset {at}, more than the {limit} QEMU reads")]
    BitmapChunkTooLarge { size: u64, limit: u64, at: u64 },
    #[error("migration command {0} is not supported (COLO is not carried by ferry)")]
    UnsupportedCommand(u16),
    #[error("migration command {0} out of place: {1}")]
    MisplacedCommand(u16, &'static str),
    #[error("a resumed stream's layout: {0}")]
    BadLayout(&'static str),
    #[error("a postcopy package command with {0} bytes of data, expected 4")]
    BadPackage(u16),
    #[error("configuration subsection \"{0}\" is not supported")]
    UnsupportedSubsection(String),
    #[error("section {0} continues, but no section with that id was started")]
    UnknownSectionId(u32),
    #[error("section footer for {found} where section {expected} was open, at stream offset {at}")]
    BadFooter { expected: u32, found: u32, at: u64 },
    #[error("RAM record with unsupported flags 0x{flags:x} at stream offset {at}")]
    UnsupportedRamFlags { flags: u64, at: u64 },
    #[error("RAM record for unknown block \"{0}\"")]
    UnknownBlock(String),
    #[error("RAM record continues a block, but none was named before, at stream offset {0}")]
    NoCurrentBlock(u64),
    #[error("RAM record at offset 0x{offset:x} lies outside block \"{block}\" ({size} bytes)")]
    OutsideBlock {
        block: String,
        offset: u64,
        size: u64,
    },
    #[error("XBZRLE record with encoding tag {0}, expected 1")]
    BadXbzrleTag(u8),
    #[error("RAM block list does not add up to the announced {total} bytes")]
    BadBlockList { total: u64 },
    #[error("the stream ended inside {0}")]
    Truncated(&'static str),
    #[error("an item at stream offset {at} is larger than the {limit} bytes ferry holds for one")]
    ItemTooLarge { at: u64, limit: usize },
    #[error("{what} announced at stream offset {at}: {count}, more than the {limit} ferry reads")]
    TooMany {
        what: &'static str,
        count: u64,
        limit: u64,
        at: u64,
    },
}

/// Where the parser is in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before "QEVM" and the version.
    Header,
    /// Between top-level items.
    Top,
    /// Inside the body of the RAM section with this id (records until EOS).
    RamBody { id: u32 },
    /// Inside the body of the dirty-bitmap section with this id (chunks until EOS).
    BitmapBody { id: u32 },
    /// After EOS: the section footer is next.
    Footer { id: u32 },
    /// Inside a postcopy package: this many of its bytes are still to come.
    Package { remaining: u64 },
    /// From the first device section on: everything is opaque.
    Tail,
}

/// An incremental parser. Feed it bytes as they arrive with [`StreamParser::next_item`]; it
/// consumes whole items only, so a partial item stays in the buffer until more arrives.
#[derive(Debug)]
pub struct StreamParser {
    state: State,
    /// Bytes consumed so far (for error messages).
    position: u64,
    /// RAM blocks announced in the setup section: name -> size.
    blocks: HashMap<Bytes, u64>,
    /// The block that `CONTINUE` records refer to.
    current_block: Option<(Bytes, u64)>,
    /// Section id of "ram" once started; whether its END has passed.
    ram_section: Option<u32>,
    ram_ended: bool,
    /// Section id of "dirty-bitmap" once started; whether its END has passed.
    bitmap_section: Option<u32>,
    bitmap_ended: bool,
    /// A multifd flush was seen: QEMU sends the pages on its multifd channels.
    multifd: bool,
    postcopy: Postcopy,
    /// The last item returned was the package's last piece.
    ended_package: bool,
    /// A resumed postcopy stream ([`StreamParser::resumed`]): `RECV_BITMAP` and `RESUME` may
    /// come, a header or a package may not.
    resumed: bool,
}

impl Default for StreamParser {
    fn default() -> Self {
        Self::new()
    }
}

/// A cursor over the bytes buffered so far. Reads past the end return `None`, which the
/// parser turns into "wait for more".
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn u8(&mut self) -> Option<u8> {
        let b = *self.buf.get(self.at)?;
        self.at += 1;
        Some(b)
    }
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.buf.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn be16(&mut self) -> Option<u16> {
        self.bytes(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    fn be32(&mut self) -> Option<u32> {
        self.bytes(4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn be64(&mut self) -> Option<u64> {
        self.bytes(8)
            .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
    }
    /// A length-byte-prefixed name, as QEMU writes idstrs and block names.
    fn name(&mut self) -> Option<&'a [u8]> {
        let len = self.u8()?;
        self.bytes(usize::from(len))
    }
}

/// What one parse step found, before it is taken out of the buffer.
enum Step {
    Opaque,
    /// A RAM record; where its payload (a page, an XBZRLE delta) lies in the item's bytes,
    /// which the record then shares rather than copies.
    Ram(RamRecord, Option<std::ops::Range<usize>>),
}

type StepResult = Result<Option<Step>, StreamError>;

impl StreamParser {
    pub fn new() -> StreamParser {
        StreamParser {
            state: State::Header,
            position: 0,
            blocks: HashMap::new(),
            current_block: None,
            ram_section: None,
            ram_ended: false,
            bitmap_section: None,
            bitmap_ended: false,
            multifd: false,
            postcopy: Postcopy::Off,
            ended_package: false,
            resumed: false,
        }
    }

    /// A parser for a resumed postcopy stream (no header; `RECV_BITMAP`s and `RESUME`, then
    /// the RAM section's parts) continuing a stream whose setup announced `layout`. The layout
    /// may come from the peer, so it is held to the same caps as a stream's own block list.
    pub fn resumed(layout: &RamLayout) -> Result<StreamParser, StreamError> {
        if layout.blocks.is_empty() {
            return Err(StreamError::BadLayout("no RAM blocks"));
        }
        if layout.blocks.len() > MAX_RAM_BLOCKS {
            return Err(StreamError::BadLayout(
                "more RAM blocks than a stream may announce",
            ));
        }
        let mut blocks = HashMap::new();
        for block in &layout.blocks {
            if block.name.is_empty() || block.name.len() > usize::from(u8::MAX) {
                return Err(StreamError::BadLayout(
                    "a RAM block name of 0 or over 255 bytes",
                ));
            }
            if blocks
                .insert(Bytes::copy_from_slice(block.name.as_bytes()), block.size)
                .is_some()
            {
                return Err(StreamError::BadLayout("a RAM block named twice"));
            }
        }
        Ok(StreamParser {
            state: State::Top,
            blocks,
            ram_section: Some(layout.section),
            postcopy: Postcopy::Running,
            resumed: true,
            ..StreamParser::new()
        })
    }

    /// The RAM section's id and blocks, once its setup has passed: what a resumed stream
    /// continues from.
    pub fn ram_layout(&self) -> Option<RamLayout> {
        let section = self.ram_section?;
        let mut blocks: Vec<RamBlock> = self
            .blocks
            .iter()
            .map(|(name, &size)| RamBlock {
                name: String::from_utf8_lossy(name).into_owned(),
                size,
            })
            .collect();
        blocks.sort_by(|a, b| a.name.cmp(&b.name));
        Some(RamLayout { section, blocks })
    }

    /// Where the stream is in postcopy.
    pub fn postcopy(&self) -> Postcopy {
        self.postcopy
    }

    /// Whether the item [`Self::next_item`] returned last was the postcopy package's last
    /// piece: with it the destination QEMU loads the device state and may run the VM.
    pub fn ended_package(&self) -> bool {
        self.ended_package
    }

    /// Whether QEMU sends the pages on multifd channels (a multifd flush has been seen; QEMU
    /// writes one in the RAM setup): this stream then carries little, and the destination
    /// QEMU's channels wait for each of its flushes.
    pub fn multifd(&self) -> bool {
        self.multifd
    }

    /// Bytes consumed so far.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// The RAM block the last record was in (named, or continued), with its size in bytes.
    pub fn current_block(&self) -> Option<(&Bytes, u64)> {
        self.current_block
            .as_ref()
            .map(|(name, size)| (name, *size))
    }

    /// Whether the parser has passed into the opaque tail (device state and after): the
    /// stream may end from here on.
    pub fn in_tail(&self) -> bool {
        self.state == State::Tail
    }

    /// The next whole item in `buf`, taken out of it; `None` when more bytes are needed.
    pub fn next_item(&mut self, buf: &mut BytesMut) -> Result<Option<Item>, StreamError> {
        Ok(self.next_item_with_bytes(buf)?.map(|(item, _)| item))
    }

    /// The next whole item in `buf` and its bytes as QEMU wrote them, taken out of it; `None`
    /// when more bytes are needed. A page's or delta's bytes are a view of the item's, not a
    /// copy: a carrier that passes the item on as it came copies nothing.
    pub fn next_item_with_bytes(
        &mut self,
        buf: &mut BytesMut,
    ) -> Result<Option<(Item, Bytes)>, StreamError> {
        self.ended_package = false;
        if buf.is_empty() {
            return Ok(None);
        }
        if let State::Package { remaining } = self.state {
            // Device state, opaque, in pieces as the tail is.
            let n = usize::try_from(remaining)
                .unwrap_or(usize::MAX)
                .min(buf.len())
                .min(MAX_ITEM_BYTES);
            let piece = buf.split_to(n);
            self.position += n as u64;
            let remaining = remaining - n as u64;
            if remaining == 0 {
                self.state = State::Top;
                self.postcopy = Postcopy::Running;
                self.ended_package = true;
            } else {
                self.state = State::Package { remaining };
            }
            let piece = piece.freeze();
            return Ok(Some((Item::Opaque(piece.clone()), piece)));
        }
        if self.state == State::Tail {
            // In pieces of at most an item's size, so that what a piece becomes downstream
            // (a codec batch, a frame) stays bounded whatever the caller read at once.
            let piece = buf.split_to(buf.len().min(MAX_ITEM_BYTES));
            self.position += piece.len() as u64;
            let piece = piece.freeze();
            return Ok(Some((Item::Opaque(piece.clone()), piece)));
        }
        let mut cur = Cursor { buf, at: 0 };
        let step = match self.state {
            State::Header => self.header(&mut cur)?,
            State::Top => self.top(&mut cur)?,
            State::RamBody { id } => self.ram_record(&mut cur, id)?,
            State::BitmapBody { id } => self.bitmap_chunk(&mut cur, id)?,
            State::Footer { id } => self.footer(&mut cur, id)?,
            State::Tail | State::Package { .. } => unreachable!("handled above"),
        };
        let Some(step) = step else {
            // Only the incomplete item is left in `buf`: refuse to wait for more of it than any
            // QEMU writes, before the caller buffers it.
            if buf.len() > MAX_ITEM_BYTES {
                return Err(StreamError::ItemTooLarge {
                    at: self.position,
                    limit: MAX_ITEM_BYTES,
                });
            }
            return Ok(None);
        };
        let used = cur.at;
        self.position += used as u64;
        let bytes = buf.split_to(used).freeze();
        let item = match step {
            Step::Opaque => Item::Opaque(bytes.clone()),
            Step::Ram(mut record, payload) => {
                if let (RamData::Page(data) | RamData::Xbzrle(data), Some(at)) =
                    (&mut record.data, payload)
                {
                    *data = bytes.slice(at);
                }
                Item::Ram(record)
            }
        };
        Ok(Some((item, bytes)))
    }

    /// Checks that the stream may end here, with `leftover` bytes unparsed.
    pub fn finish(&self, leftover: usize) -> Result<(), StreamError> {
        match self.state {
            State::Tail if leftover == 0 => Ok(()),
            State::Tail => unreachable!("the tail consumes everything"),
            State::Header => Err(StreamError::Truncated("the stream header")),
            State::Top if self.ram_section.is_none() => {
                Err(StreamError::Truncated("the stream before any RAM"))
            }
            State::Top => Err(StreamError::Truncated("the stream before device state")),
            State::Footer { id } if self.bitmap_section == Some(id) => {
                Err(StreamError::Truncated("a dirty-bitmap section"))
            }
            State::RamBody { .. } | State::Footer { .. } => {
                Err(StreamError::Truncated("a RAM section"))
            }
            State::BitmapBody { .. } => Err(StreamError::Truncated("a dirty-bitmap section")),
            State::Package { .. } => Err(StreamError::Truncated("a postcopy package")),
        }
    }

    fn header(&mut self, cur: &mut Cursor) -> StepResult {
        let Some(magic) = cur.bytes(4) else {
            return Ok(None);
        };
        if magic != MAGIC {
            return Err(StreamError::BadMagic(magic.try_into().expect("4 bytes")));
        }
        let Some(version) = cur.be32() else {
            return Ok(None);
        };
        if version != VERSION {
            return Err(StreamError::BadVersion(version));
        }
        self.state = State::Top;
        Ok(Some(Step::Opaque))
    }

    fn top(&mut self, cur: &mut Cursor) -> StepResult {
        let at = self.position;
        let Some(kind) = cur.u8() else {
            return Ok(None);
        };
        match kind {
            section::CONFIGURATION => self.configuration(cur),
            section::START | section::FULL => {
                let (Some(id), Some(idstr), Some(_instance), Some(_version)) =
                    (cur.be32(), cur.name(), cur.be32(), cur.be32())
                else {
                    return Ok(None);
                };
                let idstr = String::from_utf8_lossy(idstr).into_owned();
                if kind == section::FULL {
                    let bitmaps_open = self.bitmap_section.is_some() && !self.bitmap_ended;
                    if self.ram_section.is_none() || !self.ram_ended || bitmaps_open {
                        return Err(StreamError::EarlyDevice(idstr));
                    }
                    // Device state from here on: pass the rest through untouched.
                    self.state = State::Tail;
                    return Ok(Some(Step::Opaque));
                }
                // QEMU sets up its iterable sections at the start, each under its own id.
                let setup = !self.resumed
                    && matches!(self.postcopy, Postcopy::Off | Postcopy::Advised)
                    && self.ram_section != Some(id)
                    && self.bitmap_section != Some(id);
                if idstr == "dirty-bitmap" && self.bitmap_section.is_none() && setup {
                    self.bitmap_section = Some(id);
                    self.state = State::BitmapBody { id };
                    return Ok(Some(Step::Opaque));
                }
                if idstr != "ram" || self.ram_section.is_some() || !setup {
                    return Err(StreamError::UnsupportedIterable(idstr));
                }
                if self.ram_setup(cur)?.is_none() {
                    return Ok(None);
                }
                self.ram_section = Some(id);
                Ok(Some(Step::Opaque))
            }
            section::PART | section::END => {
                let Some(id) = cur.be32() else {
                    return Ok(None);
                };
                let end = kind == section::END;
                if self.ram_section == Some(id) && !self.ram_ended {
                    self.ram_ended = end;
                    self.state = State::RamBody { id };
                } else if self.bitmap_section == Some(id) && !self.bitmap_ended {
                    self.bitmap_ended = end;
                    self.state = State::BitmapBody { id };
                } else {
                    return Err(StreamError::UnknownSectionId(id));
                }
                Ok(Some(Step::Opaque))
            }
            section::COMMAND => {
                let (Some(cmd), Some(len)) = (cur.be16(), cur.be16()) else {
                    return Ok(None);
                };
                let resume_command = matches!(cmd, command::RESUME | command::RECV_BITMAP);
                if resume_command && !self.resumed {
                    return Err(StreamError::MisplacedCommand(
                        cmd,
                        "postcopy recovery's commands come only in a resumed stream",
                    ));
                }
                if cmd == command::PACKAGED && self.resumed {
                    return Err(StreamError::MisplacedCommand(
                        cmd,
                        "a resumed stream has no postcopy package",
                    ));
                }
                if !resume_command
                    && !matches!(
                        cmd,
                        command::OPEN_RETURN_PATH
                            | command::PING
                            | command::SWITCHOVER_START
                            | command::POSTCOPY_ADVISE
                            | command::POSTCOPY_RAM_DISCARD
                            | command::PACKAGED
                    )
                {
                    return Err(StreamError::UnsupportedCommand(cmd));
                }
                if cmd == command::PACKAGED && len != 4 {
                    return Err(StreamError::BadPackage(len));
                }
                let Some(data) = cur.bytes(usize::from(len)) else {
                    return Ok(None);
                };
                match cmd {
                    command::POSTCOPY_ADVISE => self.postcopy = Postcopy::Advised,
                    command::PACKAGED => {
                        let n = u32::from_be_bytes(data.try_into().expect("4 bytes"));
                        self.postcopy = Postcopy::Package;
                        self.state = State::Package {
                            remaining: u64::from(n),
                        };
                        if n == 0 {
                            // Nothing to wait for (QEMU never sends an empty package).
                            self.state = State::Top;
                            self.postcopy = Postcopy::Running;
                            self.ended_package = true;
                        }
                    }
                    _ => {}
                }
                Ok(Some(Step::Opaque))
            }
            section::EOF => {
                // Only reachable without device state; the JSON description may follow.
                self.state = State::Tail;
                Ok(Some(Step::Opaque))
            }
            _ => Err(StreamError::UnknownSection { kind, at }),
        }
    }

    /// The machine type, and the subsections QEMU adds when it validates capabilities or
    /// the VM's UUID.
    fn configuration(&mut self, cur: &mut Cursor) -> StepResult {
        let Some(len) = cur.be32() else {
            return Ok(None);
        };
        if len as usize > MAX_ITEM_BYTES {
            return Err(StreamError::ItemTooLarge {
                at: self.position,
                limit: MAX_ITEM_BYTES,
            });
        }
        if cur.bytes(len as usize).is_none() {
            return Ok(None);
        }
        loop {
            match cur.buf.get(cur.at) {
                None => return Ok(None),
                Some(&section::SUBSECTION) => cur.at += 1,
                Some(_) => return Ok(Some(Step::Opaque)),
            }
            let (Some(name), Some(_version)) = (cur.name(), cur.be32()) else {
                return Ok(None);
            };
            match name {
                b"configuration/capabilities" => {
                    let Some(count) = cur.be32() else {
                        return Ok(None);
                    };
                    if count > MAX_CAPABILITIES {
                        return Err(StreamError::TooMany {
                            what: "capabilities",
                            count: count.into(),
                            limit: MAX_CAPABILITIES.into(),
                            at: self.position,
                        });
                    }
                    for _ in 0..count {
                        if cur.name().is_none() {
                            return Ok(None);
                        }
                    }
                }
                b"configuration/uuid" => {
                    if cur.bytes(16).is_none() {
                        return Ok(None);
                    }
                }
                other => {
                    return Err(StreamError::UnsupportedSubsection(
                        String::from_utf8_lossy(other).into_owned(),
                    ))
                }
            }
        }
    }

    /// The RAM section's setup body: total size with `MEM_SIZE`, the block list, then records
    /// until `EOS` (none but a multifd flush), then the footer. Returns `None` if incomplete.
    fn ram_setup(&mut self, cur: &mut Cursor) -> Result<Option<()>, StreamError> {
        let Some(word) = cur.be64() else {
            return Ok(None);
        };
        if word & flag::MASK != flag::MEM_SIZE {
            return Err(StreamError::UnsupportedRamFlags {
                flags: word & flag::MASK,
                at: self.position + cur.at as u64 - 8,
            });
        }
        let total = word & !flag::MASK;
        let mut sum = 0u64;
        let mut blocks = HashMap::new();
        while sum < total {
            let (Some(name), Some(size)) = (cur.name(), cur.be64()) else {
                return Ok(None);
            };
            sum = sum.saturating_add(size);
            blocks.insert(Bytes::copy_from_slice(name), size);
            if blocks.len() > MAX_RAM_BLOCKS {
                return Err(StreamError::TooMany {
                    what: "RAM blocks",
                    count: blocks.len() as u64,
                    limit: MAX_RAM_BLOCKS as u64,
                    at: self.position,
                });
            }
        }
        if sum != total {
            return Err(StreamError::BadBlockList { total });
        }
        // The setup ends with its own EOS and footer; with multifd, QEMU flushes its channels
        // first (a `MULTIFD_FLUSH` record).
        loop {
            let Some(word) = cur.be64() else {
                return Ok(None);
            };
            match word {
                flag::EOS => break,
                flag::MULTIFD_FLUSH => self.multifd = true,
                _ => {
                    return Err(StreamError::UnsupportedRamFlags {
                        flags: word,
                        at: self.position + cur.at as u64 - 8,
                    })
                }
            }
        }
        let (Some(marker), Some(_id)) = (cur.u8(), cur.be32()) else {
            return Ok(None);
        };
        if marker != section::FOOTER {
            return Err(StreamError::Truncated("the RAM setup footer"));
        }
        self.blocks = blocks;
        Ok(Some(()))
    }

    fn ram_record(&mut self, cur: &mut Cursor, id: u32) -> StepResult {
        let at = self.position;
        let Some(word) = cur.be64() else {
            return Ok(None);
        };
        let flags = word & flag::MASK;
        let offset = word & !flag::MASK;
        if flags & !flag::KNOWN != 0 {
            return Err(StreamError::UnsupportedRamFlags { flags, at });
        }
        let is_page = flags & (flag::ZERO | flag::PAGE | flag::XBZRLE) != 0;
        let mut block = None;
        if is_page {
            if flags & flag::CONTINUE == 0 {
                let Some(name) = cur.name() else {
                    return Ok(None);
                };
                let name = Bytes::copy_from_slice(name);
                let Some(&size) = self.blocks.get(&name) else {
                    return Err(StreamError::UnknownBlock(
                        String::from_utf8_lossy(&name).into_owned(),
                    ));
                };
                block = Some((name, size));
            }
            let Some((name, size)) = block.as_ref().or(self.current_block.as_ref()) else {
                return Err(StreamError::NoCurrentBlock(at));
            };
            if offset.saturating_add(PAGE_SIZE as u64) > *size {
                return Err(StreamError::OutsideBlock {
                    block: String::from_utf8_lossy(name).into_owned(),
                    offset,
                    size: *size,
                });
            }
        }
        // The payload is cut out of the item's bytes once the item is whole.
        let mut payload = None;
        let data = match flags & (flag::ZERO | flag::PAGE | flag::XBZRLE) {
            0 => RamData::None,
            flag::ZERO => {
                let Some(fill) = cur.u8() else {
                    return Ok(None);
                };
                RamData::Fill(fill)
            }
            flag::PAGE => {
                let at = cur.at;
                if cur.bytes(PAGE_SIZE).is_none() {
                    return Ok(None);
                }
                payload = Some(at..cur.at);
                RamData::Page(Bytes::new())
            }
            flag::XBZRLE => {
                let (Some(tag), Some(len)) = (cur.u8(), cur.be16()) else {
                    return Ok(None);
                };
                if tag != 1 {
                    return Err(StreamError::BadXbzrleTag(tag));
                }
                let at = cur.at;
                if cur.bytes(usize::from(len)).is_none() {
                    return Ok(None);
                }
                payload = Some(at..cur.at);
                RamData::Xbzrle(Bytes::new())
            }
            _ => return Err(StreamError::UnsupportedRamFlags { flags, at }),
        };
        // Only now, with the record complete, does the parser's state move.
        if let Some(b) = block.clone() {
            self.current_block = Some(b);
        }
        if flags & flag::EOS != 0 {
            self.state = State::Footer { id };
        }
        self.multifd |= flags & flag::MULTIFD_FLUSH != 0;
        Ok(Some(Step::Ram(
            RamRecord {
                offset,
                flags,
                block: block.map(|(name, _)| name),
                data,
            },
            payload,
        )))
    }

    /// One chunk of a dirty-bitmap section's body, passed through whole; the one with `EOS`
    /// ends the body.
    fn bitmap_chunk(&mut self, cur: &mut Cursor, id: u32) -> StepResult {
        let at = self.position;
        let Some(flags) = cur.u8() else {
            return Ok(None);
        };
        if flags & bitmap_flag::EXTRA != 0 {
            return Err(StreamError::UnsupportedBitmapFlags { flags, at });
        }
        if flags & bitmap_flag::DEVICE_NAME != 0 && cur.name().is_none() {
            return Ok(None);
        }
        if flags & bitmap_flag::BITMAP_NAME != 0 && cur.name().is_none() {
            return Ok(None);
        }
        // QEMU reads a chunk as the first of START, COMPLETE and BITS its flags name; COMPLETE
        // carries nothing after the names.
        if flags & bitmap_flag::START != 0 {
            let (Some(_granularity), Some(_flags)) = (cur.be32(), cur.u8()) else {
                return Ok(None);
            };
        } else if flags & bitmap_flag::COMPLETE == 0 && flags & bitmap_flag::BITS != 0 {
            let (Some(_sector), Some(_count)) = (cur.be64(), cur.be32()) else {
                return Ok(None);
            };
            if flags & bitmap_flag::ZEROES == 0 {
                let Some(size) = cur.be64() else {
                    return Ok(None);
                };
                let len = usize::try_from(size).ok();
                let Some(len) = len.filter(|_| size <= MAX_BITMAP_CHUNK_BYTES) else {
                    return Err(StreamError::BitmapChunkTooLarge {
                        size,
                        limit: MAX_BITMAP_CHUNK_BYTES,
                        at,
                    });
                };
                if cur.bytes(len).is_none() {
                    return Ok(None);
                }
            }
        }
        if flags & bitmap_flag::EOS != 0 {
            self.state = State::Footer { id };
        }
        Ok(Some(Step::Opaque))
    }

    fn footer(&mut self, cur: &mut Cursor, id: u32) -> StepResult {
        let at = self.position;
        let (Some(marker), Some(found)) = (cur.u8(), cur.be32()) else {
            return Ok(None);
        };
        if marker != section::FOOTER || found != id {
            return Err(StreamError::BadFooter {
                expected: id,
                found,
                at,
            });
        }
        self.state = State::Top;
        Ok(Some(Step::Opaque))
    }
}

impl Item {
    /// Appends the item's exact bytes to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            Item::Opaque(bytes) => out.put_slice(bytes),
            Item::Ram(record) => record.encode(out),
        }
    }

    /// How many bytes [`Item::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        match self {
            Item::Opaque(bytes) => bytes.len(),
            Item::Ram(record) => record.encoded_len(),
        }
    }

    /// Whether the item is one guest page for the destination to load: a whole page, a zero
    /// page or an XBZRLE delta (not a marker, not opaque bytes).
    pub fn is_page(&self) -> bool {
        matches!(
            self,
            Item::Ram(RamRecord {
                data: RamData::Fill(_) | RamData::Page(_) | RamData::Xbzrle(_),
                ..
            })
        )
    }
}

impl RamRecord {
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_u64(self.offset | self.flags);
        if let Some(name) = &self.block {
            out.put_u8(u8::try_from(name.len()).expect("block names are at most 255 bytes"));
            out.put_slice(name);
        }
        match &self.data {
            RamData::None => {}
            RamData::Fill(fill) => out.put_u8(*fill),
            RamData::Page(page) => out.put_slice(page),
            RamData::Xbzrle(delta) => {
                out.put_u8(1);
                out.put_u16(u16::try_from(delta.len()).expect("XBZRLE deltas fit in be16"));
                out.put_slice(delta);
            }
        }
    }

    pub fn encoded_len(&self) -> usize {
        8 + self.block.as_ref().map_or(0, |n| 1 + n.len())
            + match &self.data {
                RamData::None => 0,
                RamData::Fill(_) => 1,
                RamData::Page(p) => p.len(),
                RamData::Xbzrle(d) => 3 + d.len(),
            }
    }
}
