//! The block cache's governor (issue 19; docs/plans/parallel-pipeline.md, section 5): the
//! source's pump pauses the shards' block caches while its own work, not the link or QEMU,
//! holds the stream back, and resumes them once it has time to spare again.
//!
//! Why the block cache and not zstd: at 1 Gbit/s on two cores the cache cost each agent a
//! tenth of its CPU or more for 0-4% of the bytes (zstd's window finds most of what it finds),
//! where sending stored doubled the bytes (BENCHMARKS.md, "The block cache when the CPU is the
//! limit"); zstd's level already follows the CPU ([`ferry_codec::LevelChooser`]). On a link the
//! pump keeps up with, it waits for the link most of the time and the cache stays on.
//!
//! The signal is the pump's own time: how much of a window it spent waiting for QEMU's next
//! bytes or for room on the link (the send window, the page window). Waiting less than
//! [`BUSY_IDLE_SHARE`] of [`PAUSE_WINDOW`] means the pump is the limit: pause. Paused, waiting
//! at least [`SPARE_IDLE_SHARE`] of a window means it has time for the cache again: resume.
//! A resume that was wrong shows within the next window; each one doubles how long a paused
//! window lasts ([`RESUME_WINDOW`] up to [`RESUME_WINDOW_MAX`]), so the cache does not flap.

use std::time::{Duration, Instant};

/// How long the pump watches itself before pausing the cache.
pub const PAUSE_WINDOW: Duration = Duration::from_millis(300);
/// How long it watches, paused, before resuming it: the first time, and at most.
pub const RESUME_WINDOW: Duration = Duration::from_secs(1);
pub const RESUME_WINDOW_MAX: Duration = Duration::from_secs(8);
/// Below this share of a window spent waiting, the pump is the limit.
pub const BUSY_IDLE_SHARE: f64 = 0.10;
/// From this share of a window spent waiting, the pump has time for the cache.
pub const SPARE_IDLE_SHARE: f64 = 0.50;

/// What the pump did in one window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Window {
    pub elapsed: Duration,
    /// Time spent waiting for QEMU's next bytes or for room on the link.
    pub idle: Duration,
}

impl Window {
    fn idle_share(&self) -> f64 {
        if self.elapsed.is_zero() {
            return 1.0;
        }
        self.idle.as_secs_f64() / self.elapsed.as_secs_f64()
    }
}

/// Whether the cache should be paused after a finished `window` in which it was `paused`
/// (the same: keep it as it is).
pub fn judge(paused: bool, window: Window) -> bool {
    if paused {
        window.idle_share() < SPARE_IDLE_SHARE
    } else {
        window.idle_share() < BUSY_IDLE_SHARE
    }
}

/// The pump's governor: told when the pump waited, asked each turn.
#[derive(Debug)]
pub struct Governor {
    paused: bool,
    window_start: Instant,
    idle: Duration,
    /// How long a paused window lasts.
    resume_window: Duration,
    /// The cache was resumed at the start of the current window.
    just_resumed: bool,
    /// Time spent paused before the current pause.
    paused_before: Duration,
    paused_since: Option<Instant>,
}

impl Governor {
    pub fn new(now: Instant) -> Governor {
        Governor {
            paused: false,
            window_start: now,
            idle: Duration::ZERO,
            resume_window: RESUME_WINDOW,
            just_resumed: false,
            paused_before: Duration::ZERO,
            paused_since: None,
        }
    }

    /// The pump waited `idle` for QEMU or for the link.
    pub fn waited(&mut self, idle: Duration) {
        self.idle += idle;
    }

    /// Whether the cache should change now: `Some(paused)` when it should, once per
    /// finished window at most.
    pub fn poll(&mut self, now: Instant) -> Option<bool> {
        let elapsed = now.saturating_duration_since(self.window_start);
        let length = if self.paused {
            self.resume_window
        } else {
            PAUSE_WINDOW
        };
        if elapsed < length {
            return None;
        }
        let window = Window {
            elapsed,
            idle: self.idle.min(elapsed),
        };
        let was = self.paused;
        self.paused = judge(was, window);
        let resumed_wrongly = self.just_resumed && self.paused;
        self.just_resumed = was && !self.paused;
        self.window_start = now;
        self.idle = Duration::ZERO;
        if resumed_wrongly {
            self.resume_window = (self.resume_window * 2).min(RESUME_WINDOW_MAX);
        }
        match (was, self.paused) {
            (false, true) => self.paused_since = Some(now),
            (true, false) => {
                self.paused_before += self
                    .paused_since
                    .take()
                    .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
            }
            _ => {}
        }
        (was != self.paused).then_some(self.paused)
    }

    /// Milliseconds the cache was paused so far.
    pub fn paused_ms(&self, now: Instant) -> u64 {
        let current = self
            .paused_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
        u64::try_from((self.paused_before + current).as_millis()).unwrap_or(u64::MAX)
    }
}

/// Who pauses the stream's block caches.
#[derive(Debug)]
pub enum CachePauser {
    /// Nobody: the codec has no block cache.
    Never,
    Governed(Governor),
    /// The test hook: paused and resumed every `bytes` of QEMU's stream.
    Every {
        bytes: u64,
        paused: bool,
    },
}

impl CachePauser {
    /// For a codec with a block cache or without; `test_every`: the test hook's period.
    pub fn new(has_cache: bool, test_every: Option<u64>, now: Instant) -> CachePauser {
        match (has_cache, test_every) {
            (false, _) => CachePauser::Never,
            (true, Some(bytes)) => CachePauser::Every {
                // Refused by the settings' validation; never a division by zero.
                bytes: bytes.max(1),
                paused: false,
            },
            (true, None) => CachePauser::Governed(Governor::new(now)),
        }
    }

    /// The pump waited `idle` for QEMU or for the link.
    pub fn waited(&mut self, idle: Duration) {
        if let CachePauser::Governed(governor) = self {
            governor.waited(idle);
        }
    }

    /// After each item of QEMU's stream (`stream_bytes` read so far): whether the test
    /// hook changes the caches now (`Some(paused)`).
    pub fn after_item(&mut self, stream_bytes: u64) -> Option<bool> {
        let CachePauser::Every { bytes, paused } = self else {
            return None;
        };
        let now_paused = stream_bytes / *bytes % 2 == 1;
        (now_paused != *paused).then(|| {
            *paused = now_paused;
            now_paused
        })
    }

    /// After each turn of the pump: whether the governor changes the caches now
    /// (`Some(paused)`).
    pub fn after_turn(&mut self, now: Instant) -> Option<bool> {
        match self {
            CachePauser::Governed(governor) => governor.poll(now),
            _ => None,
        }
    }

    /// Milliseconds the governor kept the caches paused so far (0 under the test hook).
    pub fn paused_ms(&self, now: Instant) -> u64 {
        match self {
            CachePauser::Governed(governor) => governor.paused_ms(now),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_window_decides_by_the_share_spent_waiting() {
        let window = |elapsed, idle| Window {
            elapsed: ms(elapsed),
            idle: ms(idle),
        };
        // On: paused only when the pump hardly waited.
        assert!(judge(false, window(300, 0)));
        assert!(judge(false, window(300, 29)));
        assert!(!judge(false, window(300, 30)));
        assert!(!judge(false, window(300, 200)));
        // Paused: resumed only with half the window to spare.
        assert!(judge(true, window(1000, 0)));
        assert!(judge(true, window(1000, 499)));
        assert!(!judge(true, window(1000, 500)));
        // Between the two shares nothing changes either way.
        assert!(!judge(false, window(1000, 300)));
        assert!(judge(true, window(1000, 300)));
        // An empty window is all waiting.
        assert!(!judge(true, window(0, 0)));
    }

    /// Drives a governor with turns of `turn` in which the pump waited `idle`; returns the
    /// changes it asked for, with their times.
    fn drive(
        governor: &mut Governor,
        start: Instant,
        from: u64,
        to: u64,
        idle_per_10ms: u64,
    ) -> Vec<(u64, bool)> {
        let mut changes = Vec::new();
        for t in (from..to).step_by(10) {
            governor.waited(ms(idle_per_10ms));
            if let Some(paused) = governor.poll(start + ms(t + 10)) {
                changes.push((t + 10, paused));
            }
        }
        changes
    }

    #[test]
    fn a_busy_pump_pauses_the_cache_and_a_waiting_one_resumes_it() {
        let start = Instant::now();
        let mut g = Governor::new(start);
        // Link-bound: the pump waits 6 ms of every 10; nothing changes.
        assert_eq!(drive(&mut g, start, 0, 2000, 6), []);
        // CPU-bound from 2 s: paused at the end of the first whole window of it.
        // Windows end every 300 ms; the one from 1.8 s still waited 40% of its time.
        assert_eq!(drive(&mut g, start, 2000, 4000, 0), [(2400, true)]);
        assert_eq!(g.paused_ms(start + ms(4000)), 1600);
        // The link the limit again from 4 s: the paused window from 3.4 s waited 28% of its
        // time, the next one 70%.
        assert_eq!(drive(&mut g, start, 4000, 6000, 7), [(5400, false)]);
        assert_eq!(g.paused_ms(start + ms(6000)), 3000);
    }

    #[test]
    fn a_resume_that_was_wrong_makes_the_next_pause_longer() {
        let start = Instant::now();
        let mut g = Governor::new(start);
        // Paused, the pump waits 6 ms of 10 (the cache's cost away); with the cache it is
        // busy again: every resume is followed by a pause in the next window.
        let mut changes = Vec::new();
        let mut t = 0;
        while t < 30_000 {
            let idle = if g.paused { 6 } else { 0 };
            g.waited(ms(idle));
            t += 10;
            if let Some(paused) = g.poll(start + ms(t)) {
                changes.push((t, paused));
            }
        }
        let resumes: Vec<u64> = changes.iter().filter(|c| !c.1).map(|c| c.0).collect();
        let pauses: Vec<u64> = changes.iter().filter(|c| c.1).map(|c| c.0).collect();
        // Paused at 300 ms; paused windows of 1, 2, 4, then 8 s.
        assert_eq!(pauses[..3], [300, 1600, 3900]);
        assert_eq!(resumes[..3], [1300, 3600, 7900]);
        let gaps: Vec<u64> = resumes
            .iter()
            .zip(&pauses)
            .map(|(resumed, paused)| resumed - paused)
            .collect();
        assert_eq!(gaps, [1000, 2000, 4000, 8000, 8000][..gaps.len()]);
        // Most of the time paused.
        assert!(g.paused_ms(start + ms(30_000)) > 25_000);
    }
}
