//! The destination's codec: length-prefixed zstd batches of page and pass-through records,
//! cut where the input says, decoded against the page history; what one batch may decode to
//! is bounded.
#![no_main]

use bytes::BytesMut;
use ferry_agent::engine::stream_codec::StreamDecoder;
use ferry_api::agent::CodecSettings;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&step, data)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1) * 17;
    let mut decoder = StreamDecoder::new(CodecSettings::ALL, 1 << 20);
    let mut out = BytesMut::new();
    for piece in data.chunks(step) {
        if decoder.feed(piece, &mut out).is_err() {
            return;
        }
        out.clear();
    }
});
