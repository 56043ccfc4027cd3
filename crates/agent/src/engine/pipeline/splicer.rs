//! The destination's serial stage: QEMU's stream rebuilt from the shards' decoded output and
//! the order units.

use anyhow::{bail, ensure, Context, Result};
use bytes::{Buf, BytesMut};
use ferry_codec::shard::MAX_SHARDS;
use ferry_codec::{varint, BatchDecompressor};

use super::{LANE_BITS, ORDER_LANE};
use crate::engine::stream_codec::{MAX_BATCH_DECODED, MAX_BATCH_RECORDS};

/// Holds what each shard decoded in the current round until the round's order unit places
/// it in QEMU's stream.
#[derive(Debug)]
pub struct Splicer {
    /// Per shard, decoded bytes not yet placed.
    lanes: Vec<BytesMut>,
    order: BatchDecompressor,
}

impl Splicer {
    pub fn new(shards: usize) -> Splicer {
        assert!((1..=MAX_SHARDS).contains(&shards), "{shards} shards");
        Splicer {
            lanes: (0..shards).map(|_| BytesMut::new()).collect(),
            order: BatchDecompressor::new(MAX_BATCH_RECORDS),
        }
    }

    /// Where shard `shard`'s decoder appends its output.
    pub fn lane(&mut self, shard: usize) -> &mut BytesMut {
        &mut self.lanes[shard]
    }

    /// Bytes decoded and not yet placed.
    pub fn held(&self) -> usize {
        self.lanes.iter().map(BytesMut::len).sum()
    }

    /// Checks that the decoded bytes held stay within what one round of the encoder makes
    /// (a peer sending shard units without order units cannot make this end hold more).
    pub fn check_held(&self) -> Result<()> {
        ensure!(
            self.held() <= MAX_BATCH_DECODED,
            "the shards decoded {} bytes without an order unit placing them, more than the {MAX_BATCH_DECODED} of a round",
            self.held()
        );
        Ok(())
    }

    /// Appends to `out` the QEMU bytes one order unit's `body` places, and checks that the
    /// round left nothing decoded behind.
    pub fn splice(&mut self, body: &[u8], out: &mut BytesMut) -> Result<()> {
        let mut records = self.order.decompress(body).context("order unit")?;
        let runs = varint::get(&mut records).context("order unit's run count")?;
        // The serial part follows the runs: find where by reading them first.
        let mut serial = records;
        for _ in 0..runs {
            varint::get(&mut serial).context("order unit's runs")?;
        }
        for _ in 0..runs {
            let run = varint::get(&mut records).expect("read above");
            let lane = u8::try_from(run & ((1 << LANE_BITS) - 1)).expect("five bits");
            let n = usize::try_from(run >> LANE_BITS).unwrap_or(usize::MAX);
            if lane == ORDER_LANE {
                ensure!(
                    serial.len() >= n,
                    "an order unit places {n} serial bytes where it holds {}",
                    serial.len()
                );
                let (head, rest) = serial.split_at(n);
                out.extend_from_slice(head);
                serial = rest;
                continue;
            }
            let shard = usize::from(lane - 1);
            let Some(decoded) = self.lanes.get_mut(shard) else {
                bail!(
                    "an order unit names lane {lane}, beyond the stream's {} shards",
                    self.lanes.len()
                );
            };
            ensure!(
                decoded.len() >= n,
                "an order unit places {n} bytes of shard {shard}, which decoded {} in its round",
                decoded.len()
            );
            out.extend_from_slice(&decoded[..n]);
            decoded.advance(n);
        }
        ensure!(
            serial.is_empty(),
            "an order unit holds {} serial bytes it does not place",
            serial.len()
        );
        if let Some((shard, left)) = self.lanes.iter().enumerate().find(|(_, l)| !l.is_empty()) {
            bail!(
                "shard {shard} decoded {} bytes its round's order unit did not place",
                left.len()
            );
        }
        Ok(())
    }
}
