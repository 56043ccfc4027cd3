//! What both ends remember, kept identical: the encoder and the decoder apply the same updates
//! in the same order, so a reference the encoder sends always names, at the decoder, the bytes
//! the encoder meant.
//!
//! - A **block cache** (CloudNet's redundancy elimination): a FIFO ring of 1 KiB sub-page
//!   blocks, indexed by a fast hash of their content. A hit is confirmed by comparing bytes, so
//!   a hash collision costs a miss and can never substitute wrong data.
//! - A **page history**: the last version of each page that crossed, by page key, for deltas.
//!   Bounded; the oldest page first in is forgotten first.
//!
//! Both hold their bytes in one buffer each, taken whole at first use from the process's
//! [`region`](crate::region) pool (a buffer an earlier dictionary left, already mapped, or a
//! new one, address space only) and given back when they go.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::{BLOCK_SIZE, PAGE_SIZE};

/// The content hash of a block. Replaceable so that tests can force collisions.
pub type BlockHasher = fn(&[u8]) -> u64;

pub fn xxh3(block: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(block)
}

/// A slot of the block cache: what a reference on the wire names.
pub type Slot = u32;

#[derive(Debug)]
pub struct BlockCache {
    data: Vec<u8>,
    /// Slots written so far (until the ring is full).
    filled: u32,
    capacity: u32,
    /// The slot the next insertion overwrites.
    next: u32,
    /// Content hash -> the newest slot holding a block with that hash.
    index: FxHashMap<u64, Slot>,
    /// Each slot's hash, to unindex it when it is overwritten.
    slot_hash: Vec<u64>,
    hasher: BlockHasher,
}

impl BlockCache {
    /// A cache of `bytes` (rounded down to whole blocks; zero disables it).
    pub fn new(bytes: usize, hasher: BlockHasher) -> BlockCache {
        let capacity = u32::try_from(bytes / BLOCK_SIZE).unwrap_or(u32::MAX);
        BlockCache {
            data: Vec::new(),
            filled: 0,
            capacity,
            next: 0,
            index: FxHashMap::default(),
            slot_hash: Vec::new(),
            hasher,
        }
    }

    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    pub fn hash(&self, block: &[u8]) -> u64 {
        (self.hasher)(block)
    }

    /// The slot holding exactly `block`, if any.
    pub fn find(&self, hash: u64, block: &[u8]) -> Option<Slot> {
        let slot = *self.index.get(&hash)?;
        (self.block(slot)? == block).then_some(slot)
    }

    /// The block in `slot`, if the slot was ever written.
    pub fn block(&self, slot: Slot) -> Option<&[u8]> {
        if slot >= self.filled {
            return None;
        }
        let start = slot as usize * BLOCK_SIZE;
        Some(&self.data[start..start + BLOCK_SIZE])
    }

    /// Remembers `block`, overwriting the oldest slot once the ring is full.
    pub fn insert(&mut self, hash: u64, block: &[u8]) {
        if self.capacity == 0 {
            return;
        }
        let slot = self.next;
        if slot < self.filled {
            let old = self.slot_hash[slot as usize];
            if self.index.get(&old) == Some(&slot) {
                self.index.remove(&old);
            }
            self.slot_hash[slot as usize] = hash;
            let start = slot as usize * BLOCK_SIZE;
            self.data[start..start + BLOCK_SIZE].copy_from_slice(block);
        } else {
            if self.filled == 0 {
                // The whole ring at once. Grown by doubling, it copied and faulted in some
                // 150 MB more on its way to 100 MB.
                let slots = self.capacity as usize;
                self.data = crate::region::take(slots * BLOCK_SIZE);
                self.slot_hash.reserve_exact(slots);
                self.index.reserve(slots);
            }
            self.data.extend_from_slice(block);
            self.slot_hash.push(hash);
            self.filled += 1;
        }
        self.index.insert(hash, slot);
        self.next = (slot + 1) % self.capacity;
    }
}

impl Drop for BlockCache {
    fn drop(&mut self) {
        crate::region::give(std::mem::take(&mut self.data));
    }
}

/// The last version of each page that crossed, at most `max_pages` of them: when full, the page
/// sent least recently goes (pages the guest keeps rewriting are the ones sent again, so they
/// stay).
#[derive(Debug)]
pub struct PageHistory {
    /// Each page with the tick of its latest record and its slot in `store`.
    pages: FxHashMap<u64, (u64, u32)>,
    /// (key, tick) per record, oldest first; an entry whose tick is no longer the key's is
    /// stale and skipped.
    order: VecDeque<(u64, u64)>,
    tick: u64,
    max_pages: usize,
    /// The pages, one slot of [`PAGE_SIZE`] after another, at most `max_pages` slots
    /// (reserved whole at the first page).
    store: Vec<u8>,
    /// Slots of forgotten pages, taken before new ones.
    free: Vec<u32>,
}

impl PageHistory {
    /// A history of at most `bytes` of pages (zero disables it).
    pub fn new(bytes: usize) -> PageHistory {
        PageHistory {
            pages: FxHashMap::default(),
            order: VecDeque::new(),
            tick: 0,
            max_pages: bytes / PAGE_SIZE,
            store: Vec::new(),
            free: Vec::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.max_pages > 0
    }

    pub fn get(&self, key: u64) -> Option<&[u8; PAGE_SIZE]> {
        self.pages.get(&key).map(|&(_, slot)| self.slot(slot))
    }

    fn slot(&self, slot: u32) -> &[u8; PAGE_SIZE] {
        let start = slot as usize * PAGE_SIZE;
        self.store[start..start + PAGE_SIZE]
            .try_into()
            .expect("a page")
    }

    fn slot_mut(&mut self, slot: u32) -> &mut [u8] {
        let start = slot as usize * PAGE_SIZE;
        &mut self.store[start..start + PAGE_SIZE]
    }

    /// Records `page` as the version of `key` the other side now has.
    pub fn record(&mut self, key: u64, page: &[u8]) {
        if self.max_pages == 0 {
            return;
        }
        self.tick += 1;
        let tick = self.tick;
        self.order.push_back((key, tick));
        if let Some((t, slot)) = self.pages.get_mut(&key) {
            *t = tick;
            let slot = *slot;
            self.slot_mut(slot).copy_from_slice(page);
        } else {
            let reused = if self.pages.len() >= self.max_pages {
                self.evict_oldest()
            } else {
                self.free.pop()
            };
            let slot = match reused {
                Some(slot) => {
                    self.slot_mut(slot).copy_from_slice(page);
                    slot
                }
                None => {
                    if self.store.capacity() == 0 {
                        self.store = crate::region::take(self.max_pages * PAGE_SIZE);
                    }
                    let slot = self.store.len() / PAGE_SIZE;
                    self.store.extend_from_slice(page);
                    u32::try_from(slot).expect("a history holds fewer than 2^32 pages")
                }
            };
            self.pages.insert(key, (tick, slot));
        }
        // Stale entries pile up as pages are re-sent; drop them before they outgrow the pages.
        if self.order.len() > 2 * self.max_pages + 1024 {
            let pages = &self.pages;
            self.order
                .retain(|(k, t)| pages.get(k).is_some_and(|(now, _)| now == t));
        }
    }

    /// Forgets `key` (its page became zero: zero pages are sent as such, never as deltas).
    pub fn forget(&mut self, key: u64) {
        // Its entries stay in `order` and are skipped as stale.
        if let Some((_, slot)) = self.pages.remove(&key) {
            self.free.push(slot);
        }
    }

    /// The slot of the page sent least recently, which it no longer holds.
    fn evict_oldest(&mut self) -> Option<u32> {
        while let Some((key, tick)) = self.order.pop_front() {
            if self.pages.get(&key).is_some_and(|(t, _)| *t == tick) {
                return self.pages.remove(&key).map(|(_, slot)| slot);
            }
        }
        None
    }
}

impl Drop for PageHistory {
    fn drop(&mut self) {
        crate::region::give(std::mem::take(&mut self.store));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(b: u8) -> Vec<u8> {
        vec![b; BLOCK_SIZE]
    }

    #[test]
    fn the_ring_overwrites_the_oldest_and_unindexes_it() {
        let mut c = BlockCache::new(2 * BLOCK_SIZE, xxh3);
        for b in 1..=3u8 {
            let blk = block(b);
            c.insert(c.hash(&blk), &blk);
        }
        let (one, three) = (block(1), block(3));
        assert_eq!(c.find(c.hash(&one), &one), None, "evicted");
        assert_eq!(c.find(c.hash(&three), &three), Some(0), "took slot 0");
    }

    #[test]
    fn a_colliding_hash_is_a_miss_not_a_wrong_hit() {
        let mut c = BlockCache::new(4 * BLOCK_SIZE, |_| 42);
        let a = block(1);
        c.insert(c.hash(&a), &a);
        let b = block(2);
        assert_eq!(c.find(c.hash(&b), &b), None);
        assert_eq!(c.find(c.hash(&a), &a), Some(0));
    }

    #[test]
    fn history_is_bounded_and_forgets_the_least_recently_sent() {
        let mut h = PageHistory::new(2 * PAGE_SIZE);
        let p = [5u8; PAGE_SIZE];
        h.record(1, &p);
        h.record(2, &p);
        h.record(1, &[6u8; PAGE_SIZE]); // sent again: now the most recent
        h.record(3, &p);
        assert!(h.get(2).is_none());
        assert_eq!(h.get(1).unwrap()[0], 6);
        assert!(h.get(3).is_some());
        // Many re-sends of the same pages keep the bookkeeping bounded.
        for i in 0..100_000u64 {
            h.record(i % 2, &p);
        }
        assert!(h.order.len() <= 2 * 2 + 1024 + 1);
        assert!(h.get(0).is_some() && h.get(1).is_some() && h.get(3).is_none());
    }

    /// Against a plain model (a map and the order pages were last sent in): whatever pages are
    /// recorded and forgotten, the history holds the latest version of the most recently sent
    /// ones, and its store never grows past its bound (a forgotten or evicted page's slot is
    /// taken again).
    #[test]
    fn history_slots_are_reused_and_hold_the_latest_versions() {
        const MAX: usize = 8;
        let mut h = PageHistory::new(MAX * PAGE_SIZE);
        let mut model: Vec<(u64, u8)> = Vec::new(); // least recently sent first
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 20;
            let version = step.to_le_bytes()[0];
            if x.is_multiple_of(7) {
                h.forget(key);
                model.retain(|(k, _)| *k != key);
            } else {
                let mut page = [version; PAGE_SIZE];
                page[..8].copy_from_slice(&key.to_le_bytes());
                h.record(key, &page);
                let known = model.iter().any(|(k, _)| *k == key);
                model.retain(|(k, _)| *k != key);
                if !known && model.len() >= MAX {
                    model.remove(0);
                }
                model.push((key, version));
            }
            assert!(h.store.len() <= MAX * PAGE_SIZE, "step {step}");
            for key in 0..20 {
                let want = model.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
                let got = h.get(key).map(|p| {
                    assert_eq!(
                        p[..8],
                        key.to_le_bytes(),
                        "step {step}: another page's slot"
                    );
                    p[PAGE_SIZE - 1]
                });
                assert_eq!(got, want, "step {step}, key {key}");
            }
        }
    }
}
