//! ferry's codec: what turns the pages of a migration into fewer bytes on the WAN. No I/O, no
//! threads of its own; its one piece of process-wide state is the pool of buffers in
//! [`region`]. The agents call it on each side of the wire.
//!
//! - [`page`]: one record per 4 KiB page, the cheapest of zero, unchanged, an XOR run-length
//!   delta against the version the other side has ([`rle`]), 1 KiB blocks the other side
//!   already holds (CloudNet's redundancy elimination, [`dictionary`]), or raw bytes.
//! - [`batch`]: zstd over a batch of records, at a level chosen for the link and the CPU.
//! - [`disk`]: disk writes as records, their whole blocks through the page codec.
//! - [`disk_base`]: what the receiver's disks already hold, so unchanged blocks go as SAME.
//! - [`disk_since`]: what changed on the sender's disks since the receiver's copy was made,
//!   by QEMU's dirty bitmaps, so the rest goes as SAME without the receiver reading its copy.
//! - [`seed`]: pages the other side already holds in an earlier image, indexed by content
//!   there, sent as references to that image.
//! - [`shard`]: which shard of a parallel codec a page belongs to.
//! - [`region`]: the dictionaries' big buffers, kept by the process from one migration to the
//!   next so that their pages are mapped once, not once per migration.
//!
//! Every technique can be switched off on its own ([`Options`]) for ablations. Both ends must
//! use the same options; the decoder checks everything it is given and fails with a
//! [`CodecError`] rather than produce a wrong page.

pub mod batch;
pub mod dictionary;
pub mod disk;
pub mod disk_base;
pub mod disk_since;
pub mod page;
pub mod region;
pub mod rle;
pub mod seed;
pub mod shard;
pub mod varint;

pub use batch::{
    compress_batch, decompress_batch, AdaptiveCompressor, BatchCompressor, BatchDecompressor,
    Compressed, LevelChooser,
};
pub use disk::{DiskDecoder, DiskEncoder, DiskOp};
pub use disk_base::{BaseBuilder, DiskBase};
pub use disk_since::ChangedSince;
pub use page::{Decoder, Encoder, PageKind, PageStats};
pub use seed::{index_image, SeedImage, SeedIndex};

/// Pages are 4 KiB (x86 guests; QEMU's target page size).
pub const PAGE_SIZE: usize = 4096;
/// CloudNet's sub-page block: four per page.
pub const BLOCK_SIZE: usize = 1024;

/// Which techniques run, and their memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub zero: bool,
    /// Redundancy elimination with the block cache.
    pub dedup: bool,
    /// Deltas against the page history.
    pub delta: bool,
    /// The block cache's size at each end (CloudNet used 100 MB).
    pub cache_bytes: usize,
    /// The page history's size at each end.
    pub history_bytes: usize,
    /// A delta longer than this is not sent; the page goes as blocks or raw.
    pub delta_limit: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            zero: true,
            dedup: true,
            delta: true,
            cache_bytes: 100 << 20,
            history_bytes: 256 << 20,
            // Half a page: beyond it a delta saves little and zstd does better on the page.
            delta_limit: PAGE_SIZE / 2,
        }
    }
}

impl Options {
    /// Nothing but raw pages (the baseline of an ablation).
    pub fn none() -> Options {
        Options {
            zero: false,
            dedup: false,
            delta: false,
            ..Options::default()
        }
    }
}

/// Input the decoder refuses. Any of these means the two ends disagree or the bytes were
/// damaged; the migration must stop (the digest check would catch it too, later).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("codec input ends inside a {0}")]
    Truncated(&'static str),
    #[error("unknown page record tag {0}")]
    UnknownTag(u8),
    #[error("block mask {0:#04x} names blocks beyond the page")]
    BadMask(u8),
    #[error("reference to block cache slot {0}, which was never filled")]
    UnknownSlot(u32),
    #[error("delta for page {0:#x}, which the decoder has no earlier version of")]
    NoBase(u64),
    #[error("malformed page delta")]
    BadDelta,
    #[error("reference to seed page {0}, which the receiver's image does not hold")]
    NoSeedPage(u64),
    #[error("malformed seed index: {0}")]
    BadSeedIndex(&'static str),
    #[error("malformed batch: {0}")]
    BadBatch(String),
}
