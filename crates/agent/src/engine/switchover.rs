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
//! Smart stop (CloudNet) is the other way to end: when the guest rewrites its pages faster
//! than they travel, the remaining pages stop shrinking and QEMU's rule may never fire. Past
//! that crossover (a pass began with at least as many pages as the one before it), the first
//! pass that begins with fewer pages than every pass in a short window before it is where the
//! pause is smallest for a while: the agent then makes QEMU switch over at once (a threshold
//! it cannot miss), accepting a pause over the target instead of slowing the guest.
//!
//! Pure arithmetic; `source` measures and applies it.

use std::collections::VecDeque;

/// Time from the destination receiving the last byte to its RESUME event (the last batch's
/// decode, QEMU loading the device state, `cont`), plus a margin for QEMU overshooting its own
/// limit (its own downtime came out 26-103 ms against a 50 ms limit in the lab) and for the
/// estimate's noise.
pub const RESUME_MS: f64 = 75.0;
/// The lowest limit set: QEMU keeps iterating until its remainder is about this small.
pub const MIN_LIMIT_MS: u64 = 20;

/// The transport's framing and TLS on top of the codec's bytes (measured: about 0.2%), and a
/// margin for the cost estimate's noise, which grows with the last pass and leaves a guest with
/// a small last pass (delta) as it was. Chosen when the estimate averaged every resent page,
/// unchanged ones too, and fell well below what the last pass cost (at 1.05 the ws guest's
/// real pauses came out 279-303 ms against 300). With unchanged pages left out of the estimate
/// the ws pauses came out 135-179 ms (5 runs) and the margin was kept: it costs the ws guest
/// one more short pass but no measurable time (16.0 s either way), and the target is the
/// promise.
const WIRE_OVERHEAD: f64 = 1.2;
/// The cheapest a resent byte is assumed to be (a delta of a few bytes per page), so that a
/// lucky stretch of unchanged pages cannot make the last pass look free.
const MIN_RESEND_COST: f64 = 0.02;

/// QEMU bytes per second the link carries in the last pass: the link's rate over what a
/// resent QEMU byte costs on the wire (1 without the codec, or before any page was resent),
/// and never more than the rate QEMU itself measured last, when it measured one. Each is
/// wrong one way: QEMU's measure is far too high just after a pass of pages the destination
/// already held (a seeded return paused 822 ms against a 300 ms target on it alone), and the
/// cost of resent pages measured so far can be lower than that of the last pass's pages (ws
/// paused 323 ms on it alone, where QEMU's measure gave 202-230 ms; see `stream_codec`'s
/// `ResendCost` for why only pages resent with new content count).
pub fn end_game_rate(
    link_bytes_per_s: f64,
    resend_cost: Option<f64>,
    qemu_bytes_per_s: Option<f64>,
) -> u64 {
    let cost = resend_cost.unwrap_or(1.0).max(MIN_RESEND_COST) * WIRE_OVERHEAD;
    let rate = (link_bytes_per_s / cost).min(qemu_bytes_per_s.unwrap_or(f64::INFINITY));
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // positive, far below 2^64
    let rate = rate.max(1.0) as u64;
    rate
}

/// What smart stop sets to make QEMU switch over at its next check: a threshold of
/// 60 s x 100 GB/s, more than any guest's memory.
pub const FORCE_LIMIT_MS: u64 = 60_000;
pub const FORCE_BYTES_PER_S: u64 = 100_000_000_000;

/// Passes smart stop compares a pass's remaining pages with (CloudNet left it unspecified).
pub const SMART_STOP_WINDOW: usize = 4;

/// CloudNet's smart stop, fed the remaining bytes at the start of each pass.
#[derive(Debug, Default)]
pub struct SmartStop {
    /// The pass last seen, and the remaining bytes at the start of recent passes.
    pass: u64,
    recent: VecDeque<u64>,
    crossed: bool,
}

impl SmartStop {
    /// Takes QEMU's pass count and remaining bytes (sampled); returns true when the VM should
    /// stop now. Only the first sample of each pass counts (its start).
    pub fn observe(&mut self, pass: u64, remaining: u64) -> bool {
        if pass <= self.pass {
            return false;
        }
        self.pass = pass;
        if self
            .recent
            .back()
            .is_some_and(|&before| remaining >= before)
        {
            self.crossed = true;
        }
        let stop = self.crossed
            && self
                .recent
                .iter()
                .min()
                .is_some_and(|&lowest| remaining < lowest);
        if self.recent.len() == SMART_STOP_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(remaining);
        stop
    }

    /// Whether the crossover happened.
    pub fn crossed(&self) -> bool {
        self.crossed
    }
}

/// With a throttled guest, the share of the last pass's drain rate it may still dirty: half,
/// so each pass is at most half the one before (the same share QEMU's auto-converge uses to
/// decide that a guest dirties too fast).
const CONVERGE_SHARE: f64 = 0.5;

/// The vCPU throttle (percent of its time taken) at which a guest dirtying
/// `dirty_bytes_per_s` dirties at most half of what the link drains in the last pass
/// (`end_game_bytes_per_s`): auto-converge's first step, so that it lands where it is needed
/// at once instead of climbing 10 points per pass (55 s to reach 95% in the lab).
pub fn needed_throttle_pct(dirty_bytes_per_s: f64, end_game_bytes_per_s: f64) -> u8 {
    let keep = CONVERGE_SHARE * end_game_bytes_per_s / dirty_bytes_per_s.max(1.0);
    let pct = (100.0 * (1.0 - keep)).ceil();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // clamped to 10..=99
    let pct = pct.clamp(10.0, 99.0) as u8;
    pct
}

/// QEMU's `downtime-limit` and `avail-switchover-bandwidth` while the first pass's lookahead
/// (`source::send_limit`) is still queued: a threshold of one byte, so QEMU keeps iterating
/// (it switches over only with no dirty page left at all). Not zero: QEMU 10 syncs its dirty
/// bitmap only when its estimate falls below the threshold, and completes whenever the
/// estimate is zero, so with a zero threshold it stops the VM at the end of the pass without
/// looking at what the guest dirtied meanwhile (a ws guest paused 2.2 s that way). Without the
/// hold, a guest that converges at once (the zero-heavy one) stopped at the end of its first
/// pass with a second of backlog still to cross: 943-958 ms pauses against a 300 ms target.
pub const HOLD_LIMIT_MS: u64 = 1;
pub const HOLD_BYTES_PER_S: u64 = 1000;

/// Whether the first pass's lookahead has crossed: QEMU is past its first pass, what its
/// stream has queued fits the plain send window again, and the destination has at most
/// [`HOLD_MAX_PAGES`] of the pages read so far still to load (see `page_ledger`: a window of
/// zero-page records is hundreds of milliseconds of the destination QEMU's time).
pub fn lookahead_drained(
    pass: u64,
    stream_unacked_bytes: u64,
    window_bytes: u64,
    pages_outstanding: u64,
) -> bool {
    pass > 1 && stream_unacked_bytes <= window_bytes && pages_outstanding <= HOLD_MAX_PAGES
}

/// The destination's work left when the hold ends, in pages: 32 MiB of guest memory, some
/// 30 ms of the destination QEMU's time at the rate it checked zero pages here (~1 GB/s of
/// guest memory), and what the destination's feeder budget holds.
pub const HOLD_MAX_PAGES: u64 = 8192;

/// What QEMU's own part of the pause is left at least when the end-game window is sized: its
/// last pass and the device state.
pub const QEMU_SHARE_MS: f64 = 50.0;
/// The smallest end-game window.
const MIN_END_GAME_WINDOW: usize = 128 << 10;

/// The send window near the switchover: no more than drains within the target after half a
/// round trip, the destination's resume and QEMU's own share. At 100 Mbit/s and 50 ms the
/// usual 2 x BDP window (100 ms to drain) fits a 300 ms target as it is; at 50 Mbit/s and
/// 150 ms it takes 300 ms to drain, so a VM that stopped with it full paused 318-388 ms.
pub fn end_game_window(target_ms: u64, rtt_ms: f64, link_bytes_per_s: f64) -> usize {
    let ms = target_ms as f64 - rtt_ms / 2.0 - RESUME_MS - QEMU_SHARE_MS;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // clamped below
    let bytes = (ms.max(0.0) / 1e3 * link_bytes_per_s) as usize;
    bytes.max(MIN_END_GAME_WINDOW)
}

/// Whether QEMU's remaining bytes, at `cost` wire bytes each, would fit in two windows: the
/// pass may end, and QEMU may stop the VM, before the window refills twice.
pub fn near_switchover(remaining_bytes: u64, cost: f64, window_bytes: usize) -> bool {
    remaining_bytes as f64 * cost.max(MIN_RESEND_COST) <= 2.0 * window_bytes as f64
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
        assert_eq!(end_game_rate(LINK, None, None), 10_416_666);
        // Resent pages compress 2:1: twice the QEMU bytes per second.
        assert_eq!(end_game_rate(LINK, Some(0.5), None), 20_833_333);
        // Nearly free resends are capped.
        assert_eq!(
            end_game_rate(LINK, Some(0.0001), None),
            end_game_rate(LINK, Some(MIN_RESEND_COST), None)
        );
        // QEMU measured less: its figure.
        assert_eq!(end_game_rate(LINK, Some(0.5), Some(15e6)), 15_000_000);
        assert_eq!(end_game_rate(LINK, Some(0.5), Some(1e9)), 20_833_333);
    }

    #[test]
    fn smart_stop_waits_for_the_crossover_then_a_windowed_minimum() {
        let mut s = SmartStop::default();
        // Shrinking passes: phase 1, never a stop however small.
        for (pass, remaining) in [(1, 1000), (2, 300), (3, 120)] {
            assert!(!s.observe(pass, remaining));
        }
        assert!(!s.crossed());
        // More samples of the same pass do not count.
        assert!(!s.observe(3, 10));
        // The crossover: a pass starts with more than the one before.
        assert!(!s.observe(4, 130));
        assert!(s.crossed());
        // Not below every pass in the window (120 is in it).
        assert!(!s.observe(5, 125));
        // Below all of 300, 120, 130, 125: stop.
        assert!(s.observe(6, 110));
    }

    #[test]
    fn smart_stop_forgets_passes_beyond_its_window() {
        let mut s = SmartStop::default();
        for (pass, remaining) in [(1, 100), (2, 200), (3, 210), (4, 220), (5, 230)] {
            assert!(!s.observe(pass, remaining));
        }
        // 100 left the window: 150 is below 200, 210, 220, 230.
        assert!(s.observe(6, 150));
    }

    #[test]
    fn the_throttle_leaves_the_guest_half_the_drain_rate() {
        // Dirtying 4x what the link drains: keep 1/8 of the vCPU.
        assert_eq!(needed_throttle_pct(4.0 * LINK, LINK), 88);
        // Barely faster than half the drain: the smallest step.
        assert_eq!(needed_throttle_pct(0.5 * LINK, LINK), 10);
        // Absurd rates stay within QEMU's range.
        assert_eq!(needed_throttle_pct(1e15, 1.0), 99);
        assert_eq!(needed_throttle_pct(0.0, LINK), 10);
    }

    #[test]
    fn the_hold_lasts_through_the_first_pass_and_its_backlog() {
        let window = 1_250_000;
        // The first pass: held however little is queued.
        assert!(!lookahead_drained(1, 0, window, 0));
        // Later passes: held while the lookahead's backlog is still queued.
        assert!(!lookahead_drained(2, 12_000_000, window, 0));
        assert!(lookahead_drained(2, window, window, HOLD_MAX_PAGES));
        assert!(lookahead_drained(5, 0, window, 0));
        assert!(
            !lookahead_drained(5, 0, window, 60_000),
            "a window of zero-page records is still ahead of the destination"
        );
    }

    #[test]
    fn the_end_game_window_fits_the_target_on_long_links_only() {
        // 100 Mbit/s, 50 ms: 1.875 MB fits, more than the usual 2 x BDP (1.25 MB).
        assert_eq!(end_game_window(300, 50.0, LINK), 1_875_000);
        // 50 Mbit/s, 150 ms: 100 ms of the link, two thirds of a BDP.
        assert_eq!(end_game_window(300, 150.0, LINK / 2.0), 625_000);
        // A target below the fixed costs: the smallest window, not none.
        assert_eq!(end_game_window(100, 150.0, LINK), MIN_END_GAME_WINDOW);
        // Near the switchover when what is left fits in two windows on the wire.
        assert!(near_switchover(4_000_000, 0.25, 1_000_000));
        assert!(!near_switchover(4_000_000, 1.0, 1_000_000));
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
