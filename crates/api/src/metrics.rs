//! Prometheus metrics of migrations, from their statuses: one definition for the agent's
//! `/metrics` (its own migrations) and the controller's (the fleet's, as the agents reported
//! them). Built at each scrape from the statuses, so whoever serves them holds no counters of
//! its own that could drift from what it reports elsewhere.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::agent::{MigrationState, MigrationStatus};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VmLabel {
    vm: String,
}

/// Seconds from microseconds, for durations far below 2^52 µs.
#[allow(clippy::cast_precision_loss)]
fn seconds_us(us: i64) -> f64 {
    us as f64 / 1e6
}

#[allow(clippy::cast_precision_loss)]
fn as_f64(v: u64) -> f64 {
    v as f64
}

fn gauge_f64() -> Gauge<f64, std::sync::atomic::AtomicU64> {
    Gauge::default()
}

/// Registers the metrics of `statuses` (migrations sent, as their source agents see them)
/// in `registry`; `now_ms` is the wall clock for rates.
pub fn register_migrations(registry: &mut Registry, statuses: &[MigrationStatus], now_ms: u64) {
    let by_state = Family::<StateLabel, Gauge>::default();
    // Every state is shown, at zero too.
    for state in ["running", "committed", "failed"] {
        drop(by_state.get_or_create(&StateLabel {
            state: state.into(),
        }));
    }
    let (wan, saved, reconnects) = (
        Counter::<u64>::default(),
        Counter::<u64>::default(),
        Counter::<u64>::default(),
    );
    // 12.5 ms to 25.6 s: the real pauses ferry aims at (300 ms) in the middle.
    let downtime = Histogram::new(exponential_buckets(0.0125, 2.0, 12));
    let rtt = Family::<VmLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::new_with_constructor(
        gauge_f64,
    );
    let rate = Family::<VmLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::new_with_constructor(
        gauge_f64,
    );
    let disk_held = Family::<VmLabel, Gauge>::default();
    for s in statuses {
        let state = match s.state {
            MigrationState::Running => "running",
            MigrationState::Committed => "committed",
            MigrationState::Failed => "failed",
        };
        by_state
            .get_or_create(&StateLabel {
                state: state.into(),
            })
            .inc();
        let wire = s.wire.bytes_out + s.wire.bytes_in;
        wan.inc_by(wire);
        if let Some(codec) = &s.codec {
            saved.inc_by(codec.bytes_in.saturating_sub(codec.bytes_out));
        }
        reconnects.inc_by(u64::from(s.wire.reconnects));
        if s.state == MigrationState::Committed {
            if let (Some(stop), Some(resume)) =
                (s.source_stop_unix_us, s.destination_resume_unix_us)
            {
                if resume > stop {
                    downtime.observe(seconds_us(resume - stop));
                }
            }
        }
        if s.state == MigrationState::Running {
            let vm = VmLabel { vm: s.vm.clone() };
            if let Some(ms) = s.wire.rtt_ms {
                rtt.get_or_create(&vm).set(ms / 1000.0);
            }
            let elapsed_s = as_f64(now_ms.saturating_sub(s.started_unix_ms)) / 1000.0;
            if elapsed_s > 0.0 {
                rate.get_or_create(&vm).set(as_f64(wire) / elapsed_s);
            }
            if let Some(disk) = &s.disk {
                disk_held
                    .get_or_create(&vm)
                    .set(i64::try_from(disk.held_bytes).unwrap_or(i64::MAX));
            }
        }
    }
    registry.register("migrations", "Migrations by state", by_state);
    registry.register(
        "wan_bytes",
        "Bytes the migrations put on the WAN, both directions",
        wan,
    );
    registry.register(
        "codec_saved_bytes",
        "Bytes of QEMU's streams the codec kept off the WAN",
        saved,
    );
    registry.register(
        "reconnects",
        "WAN connections re-established during migrations",
        reconnects,
    );
    registry.register(
        "downtime_seconds",
        "Real pauses of committed migrations, source STOP to destination RESUME",
        downtime,
    );
    registry.register(
        "link_rtt_seconds",
        "The WAN round trip a running migration measures",
        rtt,
    );
    registry.register(
        "link_rate_bytes_per_second",
        "A running migration's WAN bytes per second since it started",
        rate,
    );
    registry.register(
        "disk_buffer_bytes",
        "Bytes in a running migration's disk transmit buffer",
        disk_held,
    );
}

/// The text exposition's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The registry's text exposition (Prometheus and OpenMetrics read it).
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String does not fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_become_counts_sums_and_a_downtime_histogram() {
        let mut committed = MigrationStatus::starting("1".into(), "vm1".into(), 0);
        committed.state = MigrationState::Committed;
        committed.wire.bytes_out = 1000;
        committed.wire.bytes_in = 24;
        committed.wire.reconnects = 2;
        committed.source_stop_unix_us = Some(1_000_000);
        committed.destination_resume_unix_us = Some(1_150_000);
        committed.codec = Some(crate::agent::CodecReport {
            bytes_in: 5000,
            bytes_out: 1000,
            ..Default::default()
        });
        let mut running = MigrationStatus::starting("2".into(), "vm2".into(), 1_000);
        running.wire.bytes_out = 4000;
        running.wire.rtt_ms = Some(50.0);
        running.disk = Some(crate::agent::DiskReport {
            held_bytes: 4096,
            ..Default::default()
        });
        let mut registry = Registry::with_prefix("ferry");
        register_migrations(&mut registry, &[committed, running], 3_000);
        let text = encode(&registry);
        for line in [
            "ferry_migrations{state=\"running\"} 1",
            "ferry_migrations{state=\"committed\"} 1",
            "ferry_migrations{state=\"failed\"} 0",
            "ferry_wan_bytes_total 5024",
            "ferry_codec_saved_bytes_total 4000",
            "ferry_reconnects_total 2",
            "ferry_downtime_seconds_sum 0.15",
            "ferry_downtime_seconds_count 1",
            "ferry_downtime_seconds_bucket{le=\"0.2\"} 1",
            "ferry_downtime_seconds_bucket{le=\"0.1\"} 0",
            "ferry_link_rtt_seconds{vm=\"vm2\"} 0.05",
            "ferry_link_rate_bytes_per_second{vm=\"vm2\"} 2000.0",
            "ferry_disk_buffer_bytes{vm=\"vm2\"} 4096",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
    }
}
