//! The dictionaries' big buffers (the block cache's ring, the page history's slots), kept by the
//! process when a dictionary goes and taken again by the next one.
//!
//! Why: a buffer fresh from the kernel costs a page fault and the kernel's zeroing for every
//! 4 KiB first written. A migration's first pass writes every page it sends into the history
//! and every new block into the cache, so that was paid for most of the guest's memory, every
//! migration: 16% of a source agent's CPU at 1 Gbit/s (the 2026-11-29 profile), and the codec
//! alone at two thirds of its speed. An agent runs one migration after another; the next one's
//! dictionaries write into the last one's buffers, already mapped.
//!
//! A buffer handed back is marked free to the kernel (`MADV_FREE`): under memory pressure the
//! kernel takes its pages without swapping them (the next write then gets a fresh page, the
//! cost this avoids otherwise); left alone, they stay mapped and are written again without a
//! fault. A dictionary reads only what it wrote since it took the buffer, so whatever the kernel
//! leaves in it does not matter. The pool keeps at most [`KEEP_BYTES`].
//!
//! One pool per process ([`take`], [`give`]), as the allocator is one per process.

use std::sync::Mutex;

/// The most the process keeps for later dictionaries: a guest's full page history (capped at
/// 1 GiB by the agents) and the block caches beside it, with room for a disk's.
pub const KEEP_BYTES: usize = 2 << 30;

/// Buffers handed back, empty, each with its capacity.
#[derive(Debug)]
pub struct Pool {
    kept: Mutex<Vec<Vec<u8>>>,
    limit: usize,
}

impl Pool {
    pub const fn new(limit: usize) -> Pool {
        Pool {
            kept: Mutex::new(Vec::new()),
            limit,
        }
    }

    /// An empty buffer with room for at least `bytes`: the smallest kept one that fits, or a
    /// new one (address space only: the kernel gives its pages as they are first written).
    pub fn take(&self, bytes: usize) -> Vec<u8> {
        let mut kept = self.lock();
        let fitting = kept
            .iter()
            .enumerate()
            .filter(|(_, buffer)| buffer.capacity() >= bytes)
            .min_by_key(|(_, buffer)| buffer.capacity())
            .map(|(i, _)| i);
        match fitting {
            Some(i) => kept.swap_remove(i),
            None => {
                drop(kept);
                Vec::with_capacity(bytes)
            }
        }
    }

    /// Keeps `buffer` for a later [`Pool::take`], or frees it if the pool is full.
    pub fn give(&self, mut buffer: Vec<u8>) {
        if buffer.capacity() == 0 {
            return;
        }
        let mut kept = self.lock();
        let held: usize = kept.iter().map(Vec::capacity).sum();
        if held + buffer.capacity() > self.limit {
            return;
        }
        lazy_free(&buffer);
        buffer.clear();
        kept.push(buffer);
    }

    /// Frees every kept buffer.
    pub fn release(&self) {
        self.lock().clear();
    }

    /// The capacity of the buffers kept now.
    pub fn kept_bytes(&self) -> usize {
        self.lock().iter().map(Vec::capacity).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        // Every change is one push or one removal, never left half-done, so a lock poisoned by
        // a panicking thread still guards a sound list.
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

static POOL: Pool = Pool::new(KEEP_BYTES);

/// [`Pool::take`] on the process's pool.
pub fn take(bytes: usize) -> Vec<u8> {
    POOL.take(bytes)
}

/// [`Pool::give`] on the process's pool.
pub fn give(buffer: Vec<u8>) {
    POOL.give(buffer);
}

/// Frees what the process's pool keeps (the codec's bench measures a first migration so).
pub fn release() {
    POOL.release();
}

/// What the process's pool keeps now.
pub fn kept_bytes() -> usize {
    POOL.kept_bytes()
}

/// Tells the kernel it may take the whole pages of `buffer`'s written bytes.
fn lazy_free(buffer: &[u8]) {
    const PAGE: usize = 4096;
    let start = buffer.as_ptr() as usize;
    let first = start.next_multiple_of(PAGE);
    let end = (start + buffer.len()) / PAGE * PAGE;
    if end <= first {
        return;
    }
    // SAFETY: [first, end) lies inside `buffer`, which this pool owns and which nothing reads
    // before writing it again (the caller empties it next). MADV_FREE changes only what those
    // bytes hold, never the mapping. It fails only on kernels older than 4.5 or ranges that
    // are not mapped; the pages then simply stay, so the error is ignored.
    let _ = unsafe {
        rustix::mm::madvise(
            first as *mut std::ffi::c_void,
            end - first,
            rustix::mm::Advice::LinuxFree,
        )
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_given_back_is_taken_again_empty() {
        let pool = Pool::new(1 << 30);
        let mut a = pool.take(1 << 20);
        a.extend_from_slice(&[7u8; 3 << 18]);
        let at = a.as_ptr();
        pool.give(a);
        assert_eq!(pool.kept_bytes(), 1 << 20);
        let b = pool.take(1 << 19);
        assert_eq!(b.as_ptr(), at, "the kept buffer, not a new one");
        assert!(b.is_empty() && b.capacity() >= 1 << 20);
        assert_eq!(pool.kept_bytes(), 0);
    }

    #[test]
    fn the_smallest_that_fits_is_taken_and_none_too_small() {
        let pool = Pool::new(1 << 30);
        for size in [4 << 20, 1 << 20, 2 << 20] {
            pool.give(Vec::with_capacity(size));
        }
        assert_eq!(pool.take(1_500_000).capacity(), 2 << 20);
        assert_eq!(pool.take(5 << 20).capacity(), 5 << 20, "a new one");
        assert_eq!(pool.kept_bytes(), 5 << 20);
    }

    #[test]
    fn the_pool_never_keeps_past_its_limit() {
        let pool = Pool::new(3 << 20);
        pool.give(Vec::with_capacity(2 << 20));
        pool.give(Vec::with_capacity(2 << 20));
        assert_eq!(pool.kept_bytes(), 2 << 20);
        pool.release();
        assert_eq!(pool.kept_bytes(), 0);
    }
}
