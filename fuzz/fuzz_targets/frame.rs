//! The wire's frame decoder, fed in two cuts, then a Hello parsed from each frame: any bytes
//! a peer sends end in frames, "more needed" or an error, never a panic.
#![no_main]

use bytes::BytesMut;
use ferry_wire::session::Hello;
use ferry_wire::Frame;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let cut = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let mut buf = BytesMut::from(&data[..cut]);
    let mut rest = &data[cut..];
    loop {
        match Frame::decode(&mut buf) {
            Ok(Some(frame)) => {
                let _ = Hello::parse(&frame);
            }
            Ok(None) if !rest.is_empty() => {
                buf.extend_from_slice(rest);
                rest = &[];
            }
            Ok(None) | Err(_) => break,
        }
    }
});
