//! The disk channel at the destination: a frame's header, its batch (at most what a source
//! puts in one) and its records, each record decoded.
#![no_main]

use bytes::Bytes;
use ferry_agent::engine::disk::{self, Frame};
use ferry_api::agent::CodecSettings;
use ferry_codec::batch::BatchDecompressor;
use ferry_codec::DiskDecoder;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut decoder = DiskDecoder::new(disk::codec_options(CodecSettings::ALL));
    let mut zstd = BatchDecompressor::new(disk::MAX_FRAME_RECORDS);
    // Frames: a two-byte length, then the frame.
    let mut rest = data;
    while rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let (frame, tail) = rest[2..].split_at(len);
        rest = tail;
        let _ = disk::parse_ack(frame);
        let Ok(frame) = Frame::decode(Bytes::copy_from_slice(frame)) else {
            continue;
        };
        let Ok(mut records) = zstd.decompress(&frame.batch) else {
            continue;
        };
        while !records.is_empty() {
            if decoder.decode(&mut records).is_err() {
                break;
            }
        }
    }
});
