//! Disk operations through the disk codec come back exactly, in order, whatever their
//! alignment, with blocks rewritten (deltas), repeated (cache hits) and zero.

use ferry_codec::{DiskDecoder, DiskEncoder, DiskOp, Options};
use proptest::prelude::*;

fn op() -> impl Strategy<Value = DiskOp> {
    // Offsets in 512-byte sectors over a small disk, so that blocks are rewritten often.
    let write = (0u8..2, 0u64..64, 1usize..20, any::<u8>(), 0u8..3).prop_map(
        |(disk, sector, sectors, byte, shape)| {
            let len = sectors * 512;
            let data = match shape {
                0 => vec![0u8; len],
                1 => vec![byte; len],
                _ => (0..len)
                    .map(|i| byte.wrapping_add((i / 7).to_le_bytes()[0]))
                    .collect(),
            };
            DiskOp::Write {
                disk,
                offset: sector * 512,
                data,
            }
        },
    );
    prop_oneof![
        6 => write,
        1 => (0u8..2, 0u64..64, 1u64..64, any::<bool>()).prop_map(|(disk, s, n, may_trim)| {
            DiskOp::Zeroes { disk, offset: s * 512, len: n * 512, may_trim }
        }),
        1 => (0u8..2, 0u64..64, 1u64..64)
            .prop_map(|(disk, s, n)| DiskOp::Trim { disk, offset: s * 512, len: n * 512 }),
        1 => (0u8..2).prop_map(|disk| DiskOp::Flush { disk }),
        1 => (0u8..2, 0u64..64, 1u64..64)
            .prop_map(|(disk, s, n)| DiskOp::Same { disk, offset: s * 512, len: n * 512 }),
    ]
}

proptest! {
    #[test]
    fn disk_ops_come_back_exactly(ops in proptest::collection::vec(op(), 1..80), all in any::<bool>()) {
        let options = if all { Options::default() } else { Options::none() };
        let mut enc = DiskEncoder::new(options);
        let mut dec = DiskDecoder::new(options);
        let mut records = Vec::new();
        for op in &ops {
            enc.encode(op, &mut records);
        }
        let mut input = &records[..];
        for op in &ops {
            prop_assert_eq!(&dec.decode(&mut input).unwrap(), op);
        }
        prop_assert!(input.is_empty());
    }
}
