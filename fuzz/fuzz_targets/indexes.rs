//! The indexes a destination sends before the copy: the seed index of its older memory image
//! and the index of its older disk copies (for disks of sizes the input chooses).
#![no_main]

use ferry_codec::{DiskBase, SeedIndex};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = SeedIndex::parse(data);
    let Some((&disks, data)) = data.split_first() else {
        return;
    };
    // Disk sizes up to 64 MiB: what the index says must match them.
    let sizes: Vec<u64> = (0..u64::from(disks % 4))
        .map(|i| (i + 1) * 4096 * u64::from(disks))
        .collect();
    let _ = DiskBase::parse(data, &sizes);
});
