//! How many of the guest pages the source has read from QEMU the destination has not consumed
//! yet: the destination QEMU's work still ahead of it.
//!
//! The send window counts wire bytes, and those say little about that work: the codec squeezes
//! a run of zero pages a hundred to one and QEMU's own record of one is 9 bytes, so a window of
//! 1.25 MB held the destination's next 300-850 ms (it checks every zero page against its own
//! copy). Held at the end of the first pass, that work landed in the pause. The ledger counts
//! pages instead: the pump records how many pages it has read each time its output reaches a
//! known position of the stream channel, and the session's acknowledgements say which position
//! the destination has consumed.

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;
use ferry_qemu::stream::{Item, PAGE_SIZE};

use crate::engine::known_zero::PageBits;

#[derive(Debug, Default)]
pub struct PageLedger {
    /// Pages read from QEMU so far.
    pages_read: u64,
    /// (stream channel bytes, pages read): every page read before the mark is inside the
    /// first that many bytes of the channel.
    marks: VecDeque<(u64, u64)>,
    /// Bytes handed to the stream channel so far.
    bytes_sent: u64,
    /// Pages the destination has consumed, as of the last question.
    pages_consumed: u64,
}

impl PageLedger {
    /// `pages` more were read from QEMU.
    pub fn read(&mut self, pages: u64) {
        self.pages_read += pages;
    }

    /// Everything read so far is within the first `stream_bytes` of the channel.
    pub fn mark(&mut self, stream_bytes: u64) {
        self.mark_at(stream_bytes, self.pages_read);
    }

    /// The first `pages` read are within the first `stream_bytes` of the channel (the codec
    /// may read ahead of what it has written).
    pub fn mark_at(&mut self, stream_bytes: u64, pages: u64) {
        debug_assert!(pages <= self.pages_read, "marked pages not read");
        let marked = self
            .marks
            .back()
            .map_or(self.pages_consumed, |&(_, pages)| pages);
        if pages > marked {
            self.marks.push_back((stream_bytes, pages));
        }
    }

    /// Pages read from QEMU so far.
    pub fn pages_read(&self) -> u64 {
        self.pages_read
    }

    /// `bytes` more went to the stream channel.
    pub fn sent(&mut self, bytes: u64) {
        self.bytes_sent += bytes;
    }

    /// The most the channel may have unacknowledged for at most `pages` of what was read to be
    /// outstanding (none: no more than that is outstanding however much is unacknowledged).
    /// Everything read must be marked and sent first.
    pub fn unacked_allowed(&self, pages: u64) -> Option<u64> {
        let needed = self.pages_read.saturating_sub(pages);
        if needed <= self.pages_consumed {
            return None;
        }
        let &(bytes, _) = self.marks.iter().find(|&&(_, p)| p >= needed)?;
        Some(self.bytes_sent.saturating_sub(bytes))
    }

    /// Pages read but not yet consumed at the destination, when the channel has
    /// `unacked_bytes` unacknowledged.
    pub fn outstanding(&mut self, unacked_bytes: u64) -> u64 {
        let consumed = self.bytes_sent.saturating_sub(unacked_bytes);
        while let Some(&(bytes, pages)) = self.marks.front() {
            if bytes > consumed {
                break;
            }
            self.pages_consumed = pages;
            self.marks.pop_front();
        }
        self.pages_read - self.pages_consumed
    }
}

/// Which of QEMU's page records cost the destination a page of work: all of them, except a
/// zero page for a page the destination holds as zero, which its agent leaves out
/// ([`crate::engine::load_sieve`]). Followed for the blocks the destination said start all zero, with
/// the same marks as the destination's, so the page window and the hold count the work that is
/// really ahead of the destination QEMU: a fresh guest's first pass is mostly such zero pages.
#[derive(Debug, Default)]
pub struct DestinationWork {
    /// Blocks that started all zero at the destination; their marks once the stream reached
    /// them.
    zeroed: HashMap<Bytes, Option<PageBits>>,
}

impl DestinationWork {
    pub fn new(all_zero_blocks: &[String]) -> DestinationWork {
        DestinationWork {
            zeroed: all_zero_blocks
                .iter()
                .map(|name| (Bytes::copy_from_slice(name.as_bytes()), None))
                .collect(),
        }
    }

    /// Pages of the destination's work in `item`, a parsed item of `block` (the parser's
    /// current block and its size in bytes).
    pub fn pages(&mut self, item: &Item, block: Option<(&Bytes, u64)>) -> u64 {
        let Item::Ram(record) = item else { return 0 };
        if !item.is_page() {
            return 0;
        }
        let page_size = PAGE_SIZE as u64;
        let marks = block.and_then(|(name, size)| {
            let marks = self.zeroed.get_mut(name)?;
            Some(marks.get_or_insert_with(|| PageBits::full(size / page_size)))
        });
        let free = marks.is_some_and(|marks| marks.follow(record.offset / page_size, record));
        u64::from(!free)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_qemu::stream::{flag, RamData, RamRecord};

    fn page(flags: u64, offset: u64, data: RamData) -> Item {
        Item::Ram(RamRecord {
            offset,
            flags,
            block: None,
            data,
        })
    }

    /// Zero pages of a block that started zero cost nothing until the page got content;
    /// other blocks' zero pages, whole pages and markers cost what they always did.
    #[test]
    fn zero_pages_of_zeroed_blocks_are_free_until_the_page_has_content() {
        let mut work = DestinationWork::new(&["ram0".to_string()]);
        let (ram0, rom) = (Bytes::from_static(b"ram0"), Bytes::from_static(b"pc.rom"));
        fn at(b: &Bytes) -> Option<(&Bytes, u64)> {
            Some((b, 8 * PAGE_SIZE as u64))
        }
        let zero = |offset| page(flag::ZERO | flag::CONTINUE, offset, RamData::Fill(0));
        let full = Bytes::from(vec![7u8; PAGE_SIZE]);
        assert_eq!(work.pages(&zero(0), at(&ram0)), 0);
        assert_eq!(work.pages(&zero(0), at(&rom)), 1);
        assert_eq!(work.pages(&zero(4096), None), 1);
        let data = page(flag::PAGE, 4096, RamData::Page(full));
        assert_eq!(work.pages(&data, at(&ram0)), 1);
        assert_eq!(work.pages(&zero(4096), at(&ram0)), 1, "QEMU must clear it");
        assert_eq!(work.pages(&zero(4096), at(&ram0)), 0, "cleared already");
        let eos = page(flag::EOS, 0, RamData::None);
        assert_eq!(work.pages(&eos, at(&ram0)), 0);
        assert_eq!(work.pages(&Item::Opaque(Bytes::from_static(b"x")), None), 0);
    }

    #[test]
    fn pages_count_as_consumed_once_every_byte_holding_them_is() {
        let mut l = PageLedger::default();
        l.read(100);
        l.mark(1_000);
        l.read(50);
        l.mark(1_500);
        l.sent(1_500);
        assert_eq!(l.outstanding(1_500), 150, "nothing consumed");
        assert_eq!(
            l.outstanding(600),
            150,
            "the first mark is not wholly consumed"
        );
        assert_eq!(l.outstanding(500), 50, "the first 1000 bytes are");
        l.read(10); // read, not yet in the channel
        assert_eq!(l.outstanding(0), 10);
        l.mark(1_600);
        l.sent(100);
        assert_eq!(l.outstanding(50), 10);
        assert_eq!(l.outstanding(0), 0);
    }

    #[test]
    fn the_allowed_unacknowledged_bytes_leave_at_most_so_many_pages_outstanding() {
        let mut l = PageLedger::default();
        for i in 1..=10 {
            l.read(100);
            l.mark(i * 1_000);
        }
        l.sent(10_000);
        // 1000 pages read; for at most 250 outstanding the first 800 must be consumed,
        // i.e. the first 8000 bytes: 2000 may stay unacknowledged.
        assert_eq!(l.unacked_allowed(250), Some(2_000));
        assert_eq!(l.outstanding(2_000), 200);
        assert_eq!(l.unacked_allowed(1_000), None);
        assert_eq!(l.unacked_allowed(250), None, "only 200 are outstanding now");
        assert_eq!(l.unacked_allowed(100), Some(1_000));
    }

    #[test]
    fn bytes_without_pages_add_no_marks() {
        let mut l = PageLedger::default();
        for i in 1..=1000 {
            l.mark(i * 10);
        }
        assert!(l.marks.is_empty());
        l.read(1);
        l.mark(10_010);
        l.mark(10_020);
        assert_eq!(l.marks.len(), 1);
    }
}
