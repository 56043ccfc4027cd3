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

use std::collections::VecDeque;

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
        let marked = self
            .marks
            .back()
            .map_or(self.pages_consumed, |&(_, pages)| pages);
        if self.pages_read > marked {
            self.marks.push_back((stream_bytes, self.pages_read));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
