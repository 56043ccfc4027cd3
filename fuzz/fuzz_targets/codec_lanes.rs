//! The destination's sharded codec: units of order and shard lanes, cut where the input says,
//! each shard's batches decoded against its own page history, QEMU's stream spliced from the
//! order units; what a round may hold is bounded.
#![no_main]

use bytes::BytesMut;
use ferry_agent::engine::pipeline::ShardedDecoder;
use ferry_api::agent::CodecSettings;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&head, data)) = data.split_first() else {
        return;
    };
    // Low four bits: the shards (1 to 16); high four: how the input is cut.
    let shards = usize::from(head & 0x0f) + 1;
    let step = (usize::from(head >> 4) + 1) * 17;
    let mut decoder = ShardedDecoder::new(CodecSettings::ALL, 1 << 20, shards);
    let mut out = BytesMut::new();
    for piece in data.chunks(step) {
        if decoder.feed(piece, &mut out).is_err() {
            return;
        }
        out.clear();
    }
});
