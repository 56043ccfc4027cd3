//! When the source QEMU may stop the VM. QEMU switches over once its remaining bytes fit in its
//! `downtime-limit` at a bandwidth: by default the rate it measured over the last 100 ms, which
//! through ferry is the rate the agent took its bytes. That rate says little about the last
//! pass: pages the destination already holds (seeded, zero, unchanged) go through the codec
//! far faster than the rewritten pages the last pass carries. So the agent tells QEMU the rate
//! the link drains *resent* pages at (`avail-switchover-bandwidth`: the link's rate over what
//! a resent QEMU byte costs on the wire, measured by the codec). And the pause the guest sees
//! also holds what is still in ferry's send window ahead of QEMU's last bytes, the last half
//! round trip, and the destination's final decode, load and resume: the agent keeps QEMU's
//! limit at the real target minus that flight, recomputed as the window fills and drains, so
//! QEMU's own rule fires only when the real pause fits the target.
//!
//! Pure arithmetic; `source` measures and applies it.

/// Time from the destination receiving the last byte to its RESUME event (the last batch's
/// decode, QEMU loading the device state, `cont`), plus a margin for QEMU overshooting its own
/// limit (its own downtime came out 26-103 ms against a 50 ms limit in the lab) and for the
/// estimate's noise.
pub const RESUME_MS: f64 = 75.0;
/// The lowest limit set: QEMU keeps iterating until its remainder is about this small.
pub const MIN_LIMIT_MS: u64 = 20;

/// The transport's framing and TLS on top of the codec's bytes (measured: about 0.2%), and a
/// margin for the cost estimate's noise.
const WIRE_OVERHEAD: f64 = 1.05;
/// The cheapest a resent byte is assumed to be (a delta of a few bytes per page), so that a
/// lucky stretch of unchanged pages cannot make the last pass look free.
const MIN_RESEND_COST: f64 = 0.02;

/// QEMU bytes per second the link carries in the last pass: the link's rate over what a
/// resent QEMU byte costs on the wire (1 without the codec, or before any page was resent).
pub fn end_game_rate(link_bytes_per_s: f64, resend_cost: Option<f64>) -> u64 {
    let cost = resend_cost.unwrap_or(1.0).max(MIN_RESEND_COST) * WIRE_OVERHEAD;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // positive, far below 2^64
    let rate = (link_bytes_per_s / cost).max(1.0) as u64;
    rate
}

/// Milliseconds from the source QEMU's last byte leaving it until the destination resumes,
/// beyond QEMU's own estimate: the unacknowledged bytes ahead of it (queued, on the wire, or
/// delivered with the acknowledgement still on its way), then half a round trip, then the
/// destination's part.
pub fn flight_ms(unacked_bytes: u64, link_bytes_per_s: f64, rtt_ms: f64) -> f64 {
    let drain_ms = unacked_bytes as f64 / link_bytes_per_s.max(1.0) * 1e3;
    // An acknowledgement comes back half a round trip after its byte arrived, so at least
    // that much of the unacknowledged data has already arrived.
    (drain_ms - rtt_ms / 2.0).max(0.0) + rtt_ms / 2.0 + RESUME_MS
}

/// QEMU's `downtime-limit` for a real pause of at most `target_ms` when `flight_ms` will follow
/// QEMU's last byte.
pub fn qemu_limit_ms(target_ms: u64, flight_ms: f64) -> u64 {
    let left = target_ms as f64 - flight_ms;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // clamped below
    let left = left.max(0.0).round() as u64;
    left.clamp(MIN_LIMIT_MS, target_ms.max(MIN_LIMIT_MS))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINK: f64 = 12.5e6; // 100 Mbit/s

    #[test]
    fn a_full_window_leaves_qemu_the_rest_of_the_target() {
        // 4 x BDP at 100 Mbit/s and 50 ms: 2.5 MB, 200 ms to drain.
        let flight = flight_ms(2_500_000, LINK, 50.0);
        assert!((flight - 275.0).abs() < 1.0, "{flight}");
        assert_eq!(qemu_limit_ms(300, flight), 25);
        assert_eq!(qemu_limit_ms(1000, flight), 725);
    }

    #[test]
    fn the_end_game_rate_follows_what_resent_pages_cost() {
        assert_eq!(end_game_rate(LINK, None), 11_904_761);
        // Resent pages compress 2:1: twice the QEMU bytes per second.
        assert_eq!(end_game_rate(LINK, Some(0.5)), 23_809_523);
        // Nearly free resends are capped.
        assert_eq!(
            end_game_rate(LINK, Some(0.0001)),
            end_game_rate(LINK, Some(MIN_RESEND_COST))
        );
    }

    #[test]
    fn an_empty_window_costs_half_a_round_trip() {
        let flight = flight_ms(0, LINK, 50.0);
        assert!((flight - 100.0).abs() < 1e-9);
        assert_eq!(qemu_limit_ms(300, flight), 200);
    }

    #[test]
    fn a_target_below_the_flight_keeps_qemu_iterating_at_the_minimum() {
        let flight = flight_ms(25_000_000, LINK, 50.0);
        assert_eq!(qemu_limit_ms(300, flight), MIN_LIMIT_MS);
        assert_eq!(qemu_limit_ms(5, 0.0), MIN_LIMIT_MS);
    }
}
