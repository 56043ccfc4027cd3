//! LEB128 unsigned varints: small numbers (runs, lengths, page keys that repeat) in one byte.

use crate::CodecError;

/// The most bytes a varint takes (a u64's 64 bits, seven a byte).
pub const MAX_BYTES: u64 = 10;

#[allow(clippy::cast_possible_truncation)] // the low seven bits, on purpose
pub fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub fn get(input: &mut &[u8]) -> Result<u64, CodecError> {
    let mut v = 0u64;
    for (i, &b) in input.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            *input = &input[i + 1..];
            return Ok(v);
        }
    }
    Err(CodecError::Truncated("varint"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrips_edges() {
        for v in [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX] {
            let mut out = Vec::new();
            put(&mut out, v);
            let mut s = out.as_slice();
            assert_eq!(get(&mut s).unwrap(), v);
            assert!(s.is_empty());
        }
    }
}
