//! The serial stage of the sharded codec: which lane each of QEMU's items goes to, and the
//! order units that say how the lanes' outputs make up QEMU's stream.

use bytes::BytesMut;
use ferry_api::agent::ZstdLevelReport;
use ferry_codec::shard::{shard_of, MAX_SHARDS};
use ferry_codec::{varint, AdaptiveCompressor};
use ferry_qemu::stream::{Item, RamData, PAGE_SIZE};

use super::{put_unit, LANE_BITS, ORDER_LANE, UNIT_HEADER};
use crate::engine::stream_codec::{count_level, BlockNumbers, BATCH_BYTES, BATCH_QEMU_BYTES};

/// Where one item of QEMU's stream goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Route<'a> {
    /// Into the order unit's serial part (the dispatcher took it).
    Serial,
    /// A whole page to shard `shard`: QEMU's record header, then the page.
    Page {
        shard: usize,
        key: u64,
        header: &'a [u8],
        page: &'a [u8],
    },
    /// QEMU's bytes of a record naming a page of shard `shard` (a zero or XBZRLE page).
    Opaque { shard: usize, bytes: &'a [u8] },
}

/// Reads QEMU's items in order, routes each to a lane and writes the order unit of each
/// round.
#[derive(Debug)]
pub struct Dispatcher {
    shards: usize,
    blocks: BlockNumbers,
    /// The round's runs, closed ones encoded, and how many.
    runs: Vec<u8>,
    run_count: u64,
    /// The open run: its lane and QEMU bytes.
    open: Option<(u8, u64)>,
    /// The round's serial bytes.
    serial: Vec<u8>,
    /// QEMU's bytes routed in this round.
    round_qemu: usize,
    /// The order unit's records, then compressed.
    records: Vec<u8>,
    body: Vec<u8>,
    /// zstd at level 1 for order units, or off (stored).
    compressor: AdaptiveCompressor,
    /// The order units' zstd batches, per level (the shards report their own).
    levels: Vec<ZstdLevelReport>,
    /// Bytes of order units written, headers included.
    order_bytes: u64,
    /// QEMU's bytes routed, to any lane.
    bytes_in: u64,
}

impl Dispatcher {
    /// `zstd`: whether order units are compressed (at level 1: they are small, and mostly
    /// device state or varints).
    pub fn new(shards: usize, zstd: bool) -> Dispatcher {
        assert!((1..=MAX_SHARDS).contains(&shards), "{shards} shards");
        Dispatcher {
            shards,
            blocks: BlockNumbers::default(),
            runs: Vec::new(),
            run_count: 0,
            open: None,
            serial: Vec::new(),
            round_qemu: 0,
            records: Vec::new(),
            body: Vec::new(),
            compressor: if zstd {
                AdaptiveCompressor::fixed(1)
            } else {
                AdaptiveCompressor::off()
            },
            levels: Vec::new(),
            order_bytes: 0,
            bytes_in: 0,
        }
    }

    pub fn shards(&self) -> usize {
        self.shards
    }

    /// Routes one parsed item; `qemu` is the item's bytes as QEMU wrote them.
    pub fn route<'a>(&mut self, item: &Item, qemu: &'a [u8]) -> Route<'a> {
        let route = match item {
            Item::Ram(record) => {
                // Every record naming a block says which block later `CONTINUE` records mean,
                // whatever it carries.
                let key = self.blocks.key(record.block.as_ref(), record.offset);
                match (&record.data, key) {
                    (RamData::Page(_), Some(key)) => {
                        let (header, page) = qemu.split_at(qemu.len() - PAGE_SIZE);
                        Route::Page {
                            shard: shard_of(key, self.shards),
                            key,
                            header,
                            page,
                        }
                    }
                    (RamData::Fill(_) | RamData::Xbzrle(_), Some(key)) => Route::Opaque {
                        shard: shard_of(key, self.shards),
                        bytes: qemu,
                    },
                    _ => Route::Serial,
                }
            }
            Item::Opaque(_) => Route::Serial,
        };
        let lane = match route {
            Route::Serial => {
                self.serial.extend_from_slice(qemu);
                ORDER_LANE
            }
            Route::Page { shard, .. } | Route::Opaque { shard, .. } => {
                u8::try_from(shard + 1).expect("at most 16 shards")
            }
        };
        self.extend_run(lane, qemu.len());
        self.round_qemu += qemu.len();
        self.bytes_in += qemu.len() as u64;
        route
    }

    fn extend_run(&mut self, lane: u8, bytes: usize) {
        match &mut self.open {
            Some((open, n)) if *open == lane => *n += bytes as u64,
            open => {
                if let Some((lane, n)) = open.replace((lane, bytes as u64)) {
                    self.close_run(lane, n);
                }
            }
        }
    }

    fn close_run(&mut self, lane: u8, bytes: u64) {
        varint::put(&mut self.runs, bytes << LANE_BITS | u64::from(lane));
        self.run_count += 1;
    }

    /// Whether the round should be closed now: it carries a batch's worth of QEMU's bytes,
    /// whatever the number of shards (what the destination holds until the order unit comes
    /// is what one batch of the single encoder decodes to), or its order unit holds a batch's
    /// worth of records (so that it fits a batch).
    pub fn round_is_full(&self) -> bool {
        self.round_qemu >= BATCH_QEMU_BYTES || self.runs.len() + self.serial.len() >= BATCH_BYTES
    }

    /// QEMU's bytes routed since the round began.
    pub fn round_bytes(&self) -> usize {
        self.round_qemu
    }

    /// Closes the round: appends its order unit to `out` (nothing if the round is empty).
    /// Every shard unit of the round must be in `out` (or sent) before it.
    pub fn close_round(&mut self, out: &mut BytesMut) {
        let Some((lane, n)) = self.open.take() else {
            return;
        };
        self.close_run(lane, n);
        self.records.clear();
        varint::put(&mut self.records, self.run_count);
        self.records.extend_from_slice(&self.runs);
        self.records.extend_from_slice(&self.serial);
        self.body.clear();
        let compressed = self.compressor.compress(&self.records, &mut self.body);
        count_level(
            &mut self.levels,
            &self.compressor,
            compressed,
            self.records.len(),
        );
        put_unit(out, ORDER_LANE, 0, &self.body);
        self.order_bytes += (UNIT_HEADER + self.body.len()) as u64;
        self.runs.clear();
        self.run_count = 0;
        self.serial.clear();
        self.round_qemu = 0;
    }

    /// QEMU's bytes routed so far.
    pub fn bytes_in(&self) -> u64 {
        self.bytes_in
    }

    /// Bytes of order units written so far, headers included: the cost of the sharding.
    pub fn order_bytes(&self) -> u64 {
        self.order_bytes
    }

    /// The order units' zstd batches so far, per level.
    pub fn zstd_levels(&self) -> &[ZstdLevelReport] {
        &self.levels
    }
}

/// Appends to `out` the order unit of a round made of `runs` (lane, QEMU bytes) and
/// `serial`, stored: for tests of damaged input.
#[cfg(test)]
pub(super) fn order_unit(runs: &[(u8, u64)], serial: &[u8], out: &mut BytesMut) {
    let mut records = Vec::new();
    varint::put(&mut records, runs.len() as u64);
    for &(lane, bytes) in runs {
        varint::put(&mut records, bytes << LANE_BITS | u64::from(lane));
    }
    records.extend_from_slice(serial);
    let mut body = Vec::new();
    ferry_codec::compress_batch(&records, None, &mut body);
    put_unit(out, ORDER_LANE, 0, &body);
}
