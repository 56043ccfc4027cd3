//! Page deltas: the XOR of a page with the version the other side already has, run-length
//! encoded. Rewrites of a few fields in a page leave long runs of zero bytes in the XOR.
//!
//! Format: repeated `(zero run, literal length, literal bytes)`, both lengths as LEB128
//! varints; the runs and literals together cover exactly one page. A trailing zero run is
//! implied, so an unchanged tail costs nothing.

use crate::varint;
use crate::{CodecError, PAGE_SIZE};

/// Zero runs shorter than this stay inside a literal: a run/literal pair costs at least two
/// bytes, so splitting on short runs would grow the output.
const MIN_ZERO_RUN: usize = 4;

/// Appends the delta turning `old` into `new` to `out`, unless it would be longer than `limit`
/// bytes; returns whether it did (on `false`, `out` is as it was).
pub fn encode_delta(old: &[u8], new: &[u8], limit: usize, out: &mut Vec<u8>) -> bool {
    debug_assert_eq!(old.len(), PAGE_SIZE);
    debug_assert_eq!(new.len(), PAGE_SIZE);
    let start = out.len();
    let mut pos = 0;
    while pos < PAGE_SIZE {
        let run_end = next_difference(old, new, pos);
        if run_end == PAGE_SIZE {
            break; // the tail is unchanged: implied
        }
        let lit_end = end_of_literal(old, new, run_end);
        varint::put(out, (run_end - pos) as u64);
        varint::put(out, (lit_end - run_end) as u64);
        out.extend(
            old[run_end..lit_end]
                .iter()
                .zip(&new[run_end..lit_end])
                .map(|(a, b)| a ^ b),
        );
        if out.len() - start > limit {
            out.truncate(start);
            return false;
        }
        pos = lit_end;
    }
    true
}

/// Applies a delta made by [`encode_delta`] to `page` in place.
pub fn apply_delta(page: &mut [u8], mut delta: &[u8]) -> Result<(), CodecError> {
    let mut pos = 0usize;
    while !delta.is_empty() {
        let run = varint::get(&mut delta)?;
        let len = varint::get(&mut delta)?;
        let start = pos
            .checked_add(usize::try_from(run).map_err(|_| CodecError::BadDelta)?)
            .ok_or(CodecError::BadDelta)?;
        let len = usize::try_from(len).map_err(|_| CodecError::BadDelta)?;
        let end = start.checked_add(len).ok_or(CodecError::BadDelta)?;
        if end > PAGE_SIZE || len > delta.len() || len == 0 {
            return Err(CodecError::BadDelta);
        }
        for (p, d) in page[start..end].iter_mut().zip(&delta[..len]) {
            *p ^= d;
        }
        delta = &delta[len..];
        pos = end;
    }
    Ok(())
}

/// The first index at or after `from` where the pages differ (or the page's end). Compares
/// eight bytes at a time: most of a page is usually unchanged.
fn next_difference(old: &[u8], new: &[u8], from: usize) -> usize {
    let mut i = from;
    while !i.is_multiple_of(8) && i < PAGE_SIZE {
        if old[i] != new[i] {
            return i;
        }
        i += 1;
    }
    while i + 8 <= PAGE_SIZE {
        let a = u64::from_ne_bytes(old[i..i + 8].try_into().expect("8 bytes"));
        let b = u64::from_ne_bytes(new[i..i + 8].try_into().expect("8 bytes"));
        if a != b {
            break;
        }
        i += 8;
    }
    while i < PAGE_SIZE && old[i] == new[i] {
        i += 1;
    }
    i
}

/// Where the literal starting at `from` (a difference) ends: at the first zero run of at
/// least [`MIN_ZERO_RUN`] bytes, or the page's end.
fn end_of_literal(old: &[u8], new: &[u8], from: usize) -> usize {
    let mut i = from;
    let mut same = 0;
    while i < PAGE_SIZE {
        if old[i] == new[i] {
            same += 1;
            if same == MIN_ZERO_RUN {
                return i + 1 - MIN_ZERO_RUN;
            }
        } else {
            same = 0;
        }
        i += 1;
    }
    PAGE_SIZE - same
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(old: &[u8], new: &[u8]) -> usize {
        let mut out = Vec::new();
        assert!(encode_delta(old, new, PAGE_SIZE * 2, &mut out));
        let mut page = old.to_vec();
        apply_delta(&mut page, &out).unwrap();
        assert_eq!(page, new);
        out.len()
    }

    #[test]
    fn unchanged_page_is_an_empty_delta() {
        let p = vec![7u8; PAGE_SIZE];
        assert_eq!(roundtrip(&p, &p), 0);
    }

    #[test]
    #[allow(clippy::cast_possible_truncation)] // a byte pattern
    fn a_few_changed_bytes_cost_a_few_bytes() {
        let old: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 31 % 251) as u8).collect();
        let mut new = old.clone();
        new[100] ^= 1;
        new[2000..2008].copy_from_slice(b"abcdefgh");
        new[PAGE_SIZE - 1] ^= 0xff;
        assert!(roundtrip(&old, &new) < 30);
    }

    #[test]
    fn over_the_limit_leaves_the_output_alone() {
        let old = vec![0u8; PAGE_SIZE];
        let new = vec![1u8; PAGE_SIZE];
        let mut out = vec![9];
        assert!(!encode_delta(&old, &new, 100, &mut out));
        assert_eq!(out, vec![9]);
    }

    #[test]
    fn malformed_deltas_are_errors() {
        let mut page = vec![0u8; PAGE_SIZE];
        // Past the page's end.
        let mut d = Vec::new();
        varint::put(&mut d, 4090);
        varint::put(&mut d, 10);
        d.extend([1u8; 10]);
        assert_eq!(apply_delta(&mut page, &d), Err(CodecError::BadDelta));
        // Literal longer than what follows.
        assert_eq!(
            apply_delta(&mut page, &[0, 5, 1]),
            Err(CodecError::BadDelta)
        );
        // Truncated varint.
        assert!(apply_delta(&mut page, &[0x80]).is_err());
    }
}
