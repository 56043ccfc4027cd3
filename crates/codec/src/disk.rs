//! Disk writes as records: what the source agent's mirror target sends and the destination
//! applies. The whole 4 KiB blocks of a write go through the page codec ([`crate::page`]),
//! keyed by (disk, block), so zero blocks, blocks the other side has cached, and small
//! rewrites of a block sent before (deltas) cost a few bytes; unaligned heads and tails
//! travel as they are.
//!
//! ```text
//! record   := WRITE  disk:u8 offset:varint len:varint head-bytes page-record* tail-bytes
//!           | ZEROES disk:u8 offset:varint len:varint may_trim:u8
//!           | TRIM   disk:u8 offset:varint len:varint
//!           | FLUSH  disk:u8
//!           | SAME   disk:u8 offset:varint len:varint
//! ```
//!
//! SAME says the receiver's disk already holds these bytes (it was there before, and what it
//! kept was indexed); nothing is written.
//!
//! The head is the bytes before the first 4 KiB boundary inside the write, the tail those after
//! the last; both lengths follow from offset and len, so they are not sent. The encoder and the
//! decoder keep page-codec state, so records must be decoded in the order they were encoded,
//! each exactly once.

use crate::page::{Decoder, Encoder, PageStats};
use crate::{varint, CodecError, Options, PAGE_SIZE};

const TAG_WRITE: u8 = 1;
const TAG_ZEROES: u8 = 2;
const TAG_TRIM: u8 = 3;
const TAG_FLUSH: u8 = 4;
const TAG_SAME: u8 = 5;

/// The largest write a record may carry (the NBD server's maximum request).
pub const MAX_WRITE: u64 = 32 << 20;
/// The largest zero or trim range a record may name (QEMU's requests are far smaller).
pub const MAX_RANGE: u64 = 1 << 40;

/// One operation on one disk of the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskOp {
    Write {
        disk: u8,
        offset: u64,
        data: Vec<u8>,
    },
    Zeroes {
        disk: u8,
        offset: u64,
        len: u64,
        may_trim: bool,
    },
    Trim {
        disk: u8,
        offset: u64,
        len: u64,
    },
    Flush {
        disk: u8,
    },
    /// The receiver already holds these bytes.
    Same {
        disk: u8,
        offset: u64,
        len: u64,
    },
}

impl DiskOp {
    /// The disk and byte range the operation touches (None for a flush).
    pub fn range(&self) -> Option<(u8, u64, u64)> {
        match self {
            DiskOp::Write { disk, offset, data } => Some((*disk, *offset, data.len() as u64)),
            DiskOp::Zeroes {
                disk, offset, len, ..
            }
            | DiskOp::Trim { disk, offset, len }
            | DiskOp::Same { disk, offset, len } => Some((*disk, *offset, *len)),
            DiskOp::Flush { .. } => None,
        }
    }
}

/// The page key of a disk block: the disk in the top byte, the block number below. Disjoint
/// from guest-physical page keys only within one codec instance, which is why disks get their
/// own (CloudNet, too, keeps one cache per memory and per disk stream).
fn block_key(disk: u8, offset: u64) -> u64 {
    (u64::from(disk) << 56) | (offset / PAGE_SIZE as u64)
}

/// The head, whole-page and tail lengths of a write at `offset` of `len` bytes.
#[allow(clippy::cast_possible_truncation)] // all below PAGE_SIZE or MAX_WRITE
fn split(offset: u64, len: u64) -> (usize, usize, usize) {
    let page = PAGE_SIZE as u64;
    let head = ((page - offset % page) % page).min(len);
    let pages = (len - head) / page;
    let tail = len - head - pages * page;
    (head as usize, pages as usize, tail as usize)
}

pub struct DiskEncoder {
    pages: Encoder,
}

impl DiskEncoder {
    pub fn new(options: Options) -> DiskEncoder {
        DiskEncoder {
            pages: Encoder::new(options),
        }
    }

    pub fn stats(&self) -> &PageStats {
        self.pages.stats()
    }

    /// Appends `op`'s record to `out`.
    pub fn encode(&mut self, op: &DiskOp, out: &mut Vec<u8>) {
        match op {
            DiskOp::Write { disk, offset, data } => {
                assert!(
                    data.len() as u64 <= MAX_WRITE,
                    "writes are at most {MAX_WRITE} bytes"
                );
                out.push(TAG_WRITE);
                out.push(*disk);
                varint::put(out, *offset);
                varint::put(out, data.len() as u64);
                let (head, pages, _) = split(*offset, data.len() as u64);
                out.extend_from_slice(&data[..head]);
                let mut at = head;
                for _ in 0..pages {
                    let key = block_key(*disk, *offset + at as u64);
                    self.pages.encode(key, &data[at..at + PAGE_SIZE], out);
                    at += PAGE_SIZE;
                }
                out.extend_from_slice(&data[at..]);
            }
            DiskOp::Zeroes {
                disk,
                offset,
                len,
                may_trim,
            } => {
                out.push(TAG_ZEROES);
                out.push(*disk);
                varint::put(out, *offset);
                varint::put(out, *len);
                out.push(u8::from(*may_trim));
            }
            DiskOp::Trim { disk, offset, len } => {
                out.push(TAG_TRIM);
                out.push(*disk);
                varint::put(out, *offset);
                varint::put(out, *len);
            }
            DiskOp::Flush { disk } => {
                out.push(TAG_FLUSH);
                out.push(*disk);
            }
            DiskOp::Same { disk, offset, len } => {
                out.push(TAG_SAME);
                out.push(*disk);
                varint::put(out, *offset);
                varint::put(out, *len);
            }
        }
    }
}

/// The next `n` bytes of `input`, advancing it.
fn take<'a>(input: &mut &'a [u8], n: usize, what: &'static str) -> Result<&'a [u8], CodecError> {
    if input.len() < n {
        return Err(CodecError::Truncated(what));
    }
    let (a, b) = input.split_at(n);
    *input = b;
    Ok(a)
}

pub struct DiskDecoder {
    pages: Decoder,
}

impl DiskDecoder {
    pub fn new(options: Options) -> DiskDecoder {
        DiskDecoder {
            pages: Decoder::new(options),
        }
    }

    /// Decodes the record at the front of `input`, advancing it.
    pub fn decode(&mut self, input: &mut &[u8]) -> Result<DiskOp, CodecError> {
        let head = take(input, 2, "disk record header")?;
        let (tag, disk) = (head[0], head[1]);
        match tag {
            TAG_WRITE => {
                let offset = varint::get(input)?;
                let len = varint::get(input)?;
                if len > MAX_WRITE || offset.checked_add(len).is_none() {
                    return Err(CodecError::BadBatch(format!(
                        "disk write of {len} bytes at {offset} (at most {MAX_WRITE})"
                    )));
                }
                let (head, pages, tail) = split(offset, len);
                let mut data = Vec::with_capacity(head + pages * PAGE_SIZE + tail);
                data.extend_from_slice(take(input, head, "disk write head")?);
                let mut page = [0u8; PAGE_SIZE];
                for _ in 0..pages {
                    let expected = block_key(disk, offset + data.len() as u64);
                    let (key, _) = self.pages.decode(input, &mut page)?;
                    if key != expected {
                        return Err(CodecError::BadBatch(format!(
                            "disk block key {key:#x} where {expected:#x} was due"
                        )));
                    }
                    data.extend_from_slice(&page);
                }
                data.extend_from_slice(take(input, tail, "disk write tail")?);
                Ok(DiskOp::Write { disk, offset, data })
            }
            TAG_ZEROES | TAG_TRIM | TAG_SAME => {
                let offset = varint::get(input)?;
                let len = varint::get(input)?;
                if len > MAX_RANGE || offset.checked_add(len).is_none() {
                    return Err(CodecError::BadBatch(format!(
                        "disk range of {len} bytes at {offset}"
                    )));
                }
                if tag == TAG_TRIM {
                    return Ok(DiskOp::Trim { disk, offset, len });
                }
                if tag == TAG_SAME {
                    return Ok(DiskOp::Same { disk, offset, len });
                }
                let may_trim = take(input, 1, "zeroes flag")?[0] != 0;
                Ok(DiskOp::Zeroes {
                    disk,
                    offset,
                    len,
                    may_trim,
                })
            }
            TAG_FLUSH => Ok(DiskOp::Flush { disk }),
            other => Err(CodecError::BadBatch(format!(
                "unknown disk record tag {other}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_the_write() {
        assert_eq!(split(0, 8192), (0, 2, 0));
        assert_eq!(split(512, 8192), (3584, 1, 512));
        assert_eq!(split(512, 1024), (1024, 0, 0));
        assert_eq!(split(4096, 100), (0, 0, 100));
    }

    #[test]
    fn unknown_tag_and_truncation_are_errors() {
        let mut d = DiskDecoder::new(Options::default());
        assert_eq!(
            d.decode(&mut &[9u8, 0][..]).unwrap_err().to_string(),
            "malformed batch: unknown disk record tag 9"
        );
        let mut e = DiskEncoder::new(Options::default());
        let mut out = Vec::new();
        e.encode(
            &DiskOp::Write {
                disk: 0,
                offset: 512,
                data: vec![7; 9000],
            },
            &mut out,
        );
        for cut in 0..out.len() {
            let mut d = DiskDecoder::new(Options::default());
            assert!(d.decode(&mut &out[..cut]).is_err(), "cut at {cut}");
        }
    }
}
