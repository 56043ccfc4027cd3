//! Which shard of a parallel codec a page belongs to. Both ends compute it, so it is part of
//! the wire format: a page's history entry and its delta base live in the same shard at both
//! ends, and a shard's dictionary sees the same pages in the same order as its peer.
//!
//! The unit of spreading is a stripe of [`STRIPE_PAGES`] consecutive pages of one RAM block
//! (the key is the block's number above the page index): QEMU walks its dirty bitmap in
//! address order, so a pass over contiguous memory sends long runs of pages to one shard,
//! while a 512 MiB guest still has 2048 stripes to spread.

/// Pages per stripe: 256 KiB of guest memory.
pub const STRIPE_PAGES: u64 = 64;
/// The most shards a stream may be cut into.
pub const MAX_SHARDS: usize = 16;

/// The shard (`0..shards`) of the page named `key`.
pub fn shard_of(key: u64, shards: usize) -> usize {
    assert!(
        (1..=MAX_SHARDS).contains(&shards),
        "{shards} shards, outside 1..={MAX_SHARDS}"
    );
    // The stripe number mixed (splitmix64's finaliser), so neighbouring stripes and the
    // blocks' first stripes spread evenly.
    let mut x = key / STRIPE_PAGES;
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    usize::try_from(x % shards as u64).expect("below MAX_SHARDS")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stripe_stays_in_one_shard_and_stripes_spread_evenly() {
        for shards in 1..=MAX_SHARDS {
            let mut load = vec![0usize; shards];
            for stripe in 0..2048u64 {
                let first = shard_of(stripe * STRIPE_PAGES, shards);
                for page in 1..STRIPE_PAGES {
                    assert_eq!(shard_of(stripe * STRIPE_PAGES + page, shards), first);
                }
                load[first] += 1;
            }
            let even = 2048 / shards;
            for (shard, &n) in load.iter().enumerate() {
                assert!(
                    n > even * 3 / 4 && n < even * 5 / 4 + 2,
                    "{shards} shards: shard {shard} got {n} of 2048 stripes"
                );
            }
        }
    }

    /// The function is part of the wire format: these values must never change.
    #[test]
    fn shards_are_what_both_ends_agreed_on() {
        let keys = [0, 63, 64, 1 << 40, (1 << 40) | 4096, u64::MAX];
        let got: Vec<usize> = keys.iter().map(|&k| shard_of(k, 16)).collect();
        assert_eq!(got, [0, 0, 5, 8, 3, 1], "{got:?}");
    }

    #[test]
    #[should_panic(expected = "17 shards, outside 1..=16")]
    fn more_shards_than_the_format_allows_is_a_bug() {
        shard_of(0, 17);
    }
}
