//! QEMU's multifd channel parser (which also reads the peer's decoded bytes at the
//! destination), fed in pieces whose sizes the input chooses: every item it gives re-encodes
//! to exactly the bytes it consumed, and it never holds more than one packet.
#![no_main]

use bytes::BytesMut;
use ferry_qemu::multifd::{ChannelParser, MAX_DEVICE_PAYLOAD, PACKET_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&step, data)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1) * 61;
    let mut parser = ChannelParser::new();
    let mut buf = BytesMut::new();
    let mut consumed = Vec::new();
    for piece in data.chunks(step) {
        buf.extend_from_slice(piece);
        loop {
            match parser.next_item(&mut buf) {
                Ok(Some(item)) => {
                    let mut out = BytesMut::new();
                    item.encode(&mut out);
                    consumed.extend_from_slice(&out);
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(buf.len() <= PACKET_LEN + MAX_DEVICE_PAYLOAD + step);
    }
    let _ = parser.finish(buf.len());
    assert_eq!(consumed, data[..data.len() - buf.len()]);
});
