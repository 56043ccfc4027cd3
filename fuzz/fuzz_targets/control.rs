//! The agents' control messages (JSON on the control channel).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ferry_agent::engine::control::decode(data);
});
