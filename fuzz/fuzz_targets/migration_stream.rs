//! QEMU's migration-stream parser (which also reads the peer's decoded bytes at the
//! destination), fed in pieces whose sizes the input chooses: every item it gives re-encodes
//! to exactly the bytes it consumed, and nothing it holds grows past its item limit. The
//! first byte's top bit reads the input as a resumed postcopy stream (QEMU's postcopy
//! recovery) continuing a stream with the captured VM's main RAM blocks.
#![no_main]

use bytes::BytesMut;
use ferry_qemu::stream::{RamBlock, RamLayout, StreamParser, MAX_ITEM_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&step, data)) = data.split_first() else {
        return;
    };
    let resumed = step & 0x80 != 0;
    let step = usize::from(step & 0x7f).max(1) * 61;
    let mut parser = if resumed {
        let block = |name: &str, size| RamBlock {
            name: name.into(),
            size,
        };
        StreamParser::resumed(&RamLayout {
            section: 1,
            blocks: vec![block("pc.ram", 64 << 20), block("pc.bios", 256 << 10)],
        })
        .expect("a valid layout")
    } else {
        StreamParser::new()
    };
    let mut buf = BytesMut::new();
    let mut consumed = Vec::new();
    for piece in data.chunks(step) {
        buf.extend_from_slice(piece);
        loop {
            match parser.next_item(&mut buf) {
                Ok(Some(item)) => {
                    let mut out = BytesMut::new();
                    item.encode(&mut out);
                    assert_eq!(out.len(), item.encoded_len());
                    consumed.extend_from_slice(&out);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(buf.len() <= MAX_ITEM_BYTES + step);
    }
    let _ = parser.finish(buf.len());
    assert_eq!(consumed, data[..data.len() - buf.len()]);
});
