//! Pacing a background disk copy by the guest's own IO (IOFollow's scheduling, in QEMU's terms):
//! while the guest's disk operations run slower than before the copy began, the mirror's
//! speed is cut; while they do not, it is raised again, up to unlimited.
//!
//! The signal is QEMU's block accounting (`query-blockstats`) over all of the guest's disk
//! devices: operations per second, and the time they were outstanding per second (their
//! average queue depth, by Little's law). The copy's reference rate is what the disk sender
//! drained while the copy ran unpaced. The lever is the mirror's `speed`, which limits only
//! its bulk copy; the guest's own writes are never paced.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ferry_qemu::commands::{BlockJobSetSpeed, QueryBlockstats};
use ferry_qemu::Qmp;

use super::mirror::job_id;

/// How often the pacer looks.
pub const PACING_INTERVAL: Duration = Duration::from_millis(500);
/// The guest counts as slowed when it completes fewer operations than this share of its rate
/// before the copy.
const SLOWED_OPS: f64 = 0.85;
/// ... or when its operations wait this many times longer on average than before (and at
/// least [`SLOWED_LATENCY_FLOOR_NS`]).
const SLOWED_LATENCY: f64 = 2.0;
const SLOWED_LATENCY_FLOOR_NS: f64 = 5e6;
/// A cut multiplies the speed by this; a calm interval adds this share of the reference.
const CUT: f64 = 0.7;
const RAISE: f64 = 0.1;
/// Fewer operations per second than this before the copy: the guest is not using its disks
/// and its slowdown cannot be told from its own pauses; nothing is paced.
const MIN_BASELINE_OPS: f64 = 20.0;

/// The guest's disk activity so far, summed over its devices (QEMU's counters since boot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GuestIo {
    pub ops: u64,
    /// Nanoseconds the operations were outstanding, summed.
    pub busy_ns: u64,
}

/// The guest's activity over one interval.
#[derive(Debug, Clone, Copy)]
struct Rate {
    ops_per_s: f64,
    /// Average nanoseconds per operation.
    latency_ns: f64,
}

impl Rate {
    fn between(a: GuestIo, b: GuestIo, dt: Duration) -> Option<Rate> {
        let s = dt.as_secs_f64();
        let ops = b.ops.checked_sub(a.ops)?;
        if s <= 0.0 {
            return None;
        }
        #[allow(clippy::cast_precision_loss)]
        let latency_ns = if ops == 0 {
            0.0
        } else {
            b.busy_ns.saturating_sub(a.busy_ns) as f64 / ops as f64
        };
        #[allow(clippy::cast_precision_loss)]
        Some(Rate {
            ops_per_s: ops as f64 / s,
            latency_ns,
        })
    }
}

/// A speed for the mirrors: bytes per second, or unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speed {
    Limited(u64),
    Unlimited,
}

impl Speed {
    /// QEMU's `speed` argument (0: unlimited).
    pub fn qemu(self) -> u64 {
        match self {
            Speed::Limited(b) => b.max(1),
            Speed::Unlimited => 0,
        }
    }
}

/// The pacing loop's state (no IO here: the caller samples and applies).
pub struct Pacer {
    /// The guest before the copy; None: too idle to judge.
    baseline: Option<Rate>,
    /// The lowest speed, as a share of the reference.
    floor: f64,
    last: Option<(Instant, GuestIo, u64)>,
    /// Bytes per second the sender drained while the copy ran unpaced.
    reference: Option<f64>,
    unpaced_since: Option<(Instant, u64)>,
    speed: Option<f64>,
    paced: Duration,
    lowest: f64,
}

impl Pacer {
    /// `before`: the guest's counters some time before the copy and at its start.
    pub fn new(before: (Instant, GuestIo), at_start: (Instant, GuestIo), floor: f64) -> Pacer {
        let baseline = Rate::between(before.1, at_start.1, at_start.0 - before.0)
            .filter(|r| r.ops_per_s >= MIN_BASELINE_OPS);
        Pacer {
            baseline,
            floor: floor.clamp(0.05, 1.0),
            last: None,
            reference: None,
            unpaced_since: None,
            speed: None,
            paced: Duration::ZERO,
            lowest: 1.0,
        }
    }

    /// Whether there is a baseline to pace by.
    pub fn active(&self) -> bool {
        self.baseline.is_some()
    }

    /// One look: the guest's counters and the bytes the disk sender has sent. Returns the new
    /// speed when it changes.
    pub fn tick(&mut self, now: Instant, io: GuestIo, sent: u64) -> Option<Speed> {
        let baseline = self.baseline?;
        let Some((then, last_io, _)) = self.last.replace((now, io, sent)) else {
            self.unpaced_since = Some((now, sent));
            return None;
        };
        let dt = now.duration_since(then);
        if self.speed.is_some() {
            self.paced += dt;
        }
        // While unpaced, the sender's rate so far is the reference, counted from when it
        // first sent (on libvirt's path it may wait for the destination's index first).
        if self.speed.is_none() {
            if let Some((since, sent0)) = self.unpaced_since {
                let s = now.duration_since(since).as_secs_f64();
                if sent == sent0 {
                    self.unpaced_since = Some((now, sent));
                } else if s >= PACING_INTERVAL.as_secs_f64() {
                    #[allow(clippy::cast_precision_loss)]
                    let rate = sent.saturating_sub(sent0) as f64 / s;
                    if rate > 0.0 {
                        self.reference = Some(rate);
                    }
                }
            }
        }
        let reference = self.reference?;
        let now_rate = Rate::between(last_io, io, dt)?;
        let slowed = now_rate.ops_per_s < SLOWED_OPS * baseline.ops_per_s
            || now_rate.latency_ns
                > (SLOWED_LATENCY * baseline.latency_ns).max(SLOWED_LATENCY_FLOOR_NS);
        let floor = self.floor * reference;
        let next = match (slowed, self.speed) {
            (true, None) => Some(reference * CUT),
            (true, Some(s)) => Some(s * CUT),
            (false, Some(s)) if s + RAISE * reference >= reference => None,
            (false, Some(s)) => Some(s + RAISE * reference),
            (false, None) => return None,
        }
        .map(|s| s.max(floor));
        if next == self.speed {
            return None;
        }
        self.speed = next;
        match next {
            Some(s) => {
                self.lowest = self.lowest.min(s / reference);
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                Some(Speed::Limited(s as u64))
            }
            None => {
                self.unpaced_since = Some((now, sent));
                Some(Speed::Unlimited)
            }
        }
    }

    /// How long the copy ran below its unpaced rate.
    pub fn paced(&self) -> Duration {
        self.paced
    }

    /// What to say of the pacing, if it slowed the copy at all.
    pub fn summary(&self) -> Option<String> {
        (self.paced > Duration::ZERO).then(|| {
            format!(
                "paced for {:.1} s by the guest's IO, down to {:.0}% of the unpaced rate",
                self.paced.as_secs_f64(),
                self.lowest * 100.0
            )
        })
    }
}

/// The shortest look at the guest's IO before a paced copy starts.
pub const PACING_BASELINE: Duration = Duration::from_secs(1);

/// The writes the relay's gate takes for QEMU's bulk copy: the mirror copies in chunks of up to
/// 1 MiB (`MAX_IO_BYTES` in QEMU's `block/mirror.c`; its default 16 MiB buffer over 16
/// operations), whole ones wherever the data runs on. In write-blocking mode the guest's own
/// writes reach the relay as the guest made them, nearly always smaller (a guest write of 1
/// MiB or more is taken for the copy's while paced).
pub const MIRROR_CHUNK: u64 = 1 << 20;

/// The lever where libvirt owns the mirror's job ([`super::relay`]): the relay takes QEMU's
/// bulk copy writes no faster than the speed it is given. Until the pacer has looked at the
/// guest before the copy, the gate is shut to them (the copy waits, as ferry's own waits for
/// its baseline). Once lifted (the bulk copy is over, or nothing paces any more) it stays
/// open. A change of speed reaches the writes already waiting.
pub struct BulkGate {
    state: tokio::sync::watch::Sender<Gate>,
    /// When the next bulk byte may be taken at a limited speed.
    next: std::sync::Mutex<tokio::time::Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    Shut,
    Open(Speed),
    Lifted,
}

impl BulkGate {
    /// A gate shut until the pacer opens it.
    pub fn shut() -> BulkGate {
        BulkGate {
            state: tokio::sync::watch::Sender::new(Gate::Shut),
            next: std::sync::Mutex::new(tokio::time::Instant::now()),
        }
    }

    /// Sets the speed (ignored once lifted); the next write starts a new pace.
    pub fn set(&self, speed: Speed) {
        self.state.send_if_modified(|g| {
            let changed = *g != Gate::Lifted && *g != Gate::Open(speed);
            if changed {
                *g = Gate::Open(speed);
                *self.next.lock().expect("gate lock") = tokio::time::Instant::now();
            }
            changed
        });
    }

    /// Opens the gate for good: nothing paces the copy any more.
    pub fn lift(&self) {
        self.state.send_replace(Gate::Lifted);
    }

    pub fn is_lifted(&self) -> bool {
        *self.state.borrow() == Gate::Lifted
    }

    /// Waits until `len` bulk bytes may be taken: while shut, and at a limited speed until
    /// the bytes taken before them have had their time. Whatever it waits for is looked at
    /// again when the speed changes.
    pub async fn admit(&self, len: u64) {
        let mut rx = self.state.subscribe();
        loop {
            let gate = *rx.borrow_and_update();
            let rate = match gate {
                Gate::Shut => None,
                Gate::Open(Speed::Limited(rate)) => Some(rate.max(1)),
                Gate::Open(Speed::Unlimited) | Gate::Lifted => return,
            };
            let turn = rate.map(|rate| {
                let mut next = self.next.lock().expect("gate lock");
                let now = tokio::time::Instant::now();
                if *next <= now {
                    #[allow(clippy::cast_precision_loss)]
                    let takes = Duration::from_secs_f64(len as f64 / rate as f64);
                    *next = now + takes;
                    None
                } else {
                    Some(*next)
                }
            });
            let wait_until = match turn {
                Some(None) => return,
                Some(Some(at)) => Some(at),
                None => None,
            };
            tokio::select! {
                changed = rx.changed() => {
                    // The sender lives in `self`: it never goes.
                    if changed.is_err() {
                        return;
                    }
                }
                () = async {
                    match wait_until {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }
}

/// The guest's IO from `before` to now, at least [`PACING_BASELINE`] of it (the copy waits
/// for the rest): what pacing compares the guest with. None: QEMU did not say.
pub async fn pacing_baseline(
    qmp: &Qmp,
    before: (Instant, GuestIo),
) -> Option<[(Instant, GuestIo); 2]> {
    tokio::time::sleep_until((before.0 + PACING_BASELINE).into()).await;
    match guest_io(qmp).await {
        Ok(io) => Some([before, (Instant::now(), io)]),
        Err(e) => {
            tracing::warn!("query-blockstats failed ({e:#}): the disk copy is not paced");
            None
        }
    }
}

/// The guest's disk activity so far: QEMU's accounting summed over the guest's devices.
pub async fn guest_io(qmp: &Qmp) -> Result<GuestIo> {
    let all = qmp.execute(&QueryBlockstats).await?;
    Ok(all
        .iter()
        .filter(|b| b.qdev.as_deref().is_some_and(|q| !q.is_empty()))
        .fold(GuestIo::default(), |io, b| {
            let s = &b.stats;
            GuestIo {
                ops: io.ops + s.rd_operations + s.wr_operations + s.flush_operations,
                busy_ns: io.busy_ns
                    + s.rd_total_time_ns
                    + s.wr_total_time_ns
                    + s.flush_total_time_ns,
            }
        }))
}

/// A background copy's pacing in progress: the [`Pacer`] and the QEMU it drives.
pub struct Pacing {
    pub pacer: Pacer,
    last_look: Option<Instant>,
    limited: bool,
}

impl Pacing {
    pub fn new(pacer: Pacer) -> Pacing {
        Pacing {
            pacer,
            last_look: None,
            limited: false,
        }
    }

    /// Looks at the guest once per [`PACING_INTERVAL`] and sets the mirrors' speed.
    pub async fn look(&mut self, qmp: &Qmp, nodes: &[String], sent: u64) -> Result<()> {
        let now = Instant::now();
        if self
            .last_look
            .is_some_and(|t| now.duration_since(t) < PACING_INTERVAL)
        {
            return Ok(());
        }
        self.last_look = Some(now);
        let io = guest_io(qmp).await?;
        if let Some(speed) = self.pacer.tick(now, io, sent) {
            tracing::debug!(?speed, "disk copy pacing");
            self.set(qmp, nodes, speed).await?;
        }
        Ok(())
    }

    /// The copy is done: its speed unlimited again.
    pub async fn end(&mut self, qmp: &Qmp, nodes: &[String]) -> Result<()> {
        if self.limited {
            self.set(qmp, nodes, Speed::Unlimited).await?;
        }
        Ok(())
    }

    async fn set(&mut self, qmp: &Qmp, nodes: &[String], speed: Speed) -> Result<()> {
        for node in nodes {
            qmp.execute(&BlockJobSetSpeed {
                device: job_id(node),
                speed: speed.qemu(),
            })
            .await
            .with_context(|| format!("setting the speed of the mirror of {node}"))?;
        }
        self.limited = speed != Speed::Unlimited;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A guest doing `ops_per_s` operations of `latency_ms` each, sampled over `dt`.
    fn io(prev: GuestIo, ops_per_s: u64, latency_ms: u64, dt: Duration) -> GuestIo {
        let ops = ops_per_s * u64::try_from(dt.as_millis()).unwrap() / 1000;
        GuestIo {
            ops: prev.ops + ops,
            busy_ns: prev.busy_ns + ops * latency_ms * 1_000_000,
        }
    }

    struct Run {
        pacer: Pacer,
        t: Instant,
        io: GuestIo,
        sent: u64,
    }

    impl Run {
        /// A guest at 1000 ops/s of 1 ms before the copy; the sender drains 10 MB/s.
        fn new(floor: f64) -> Run {
            let t0 = Instant::now();
            let a = GuestIo::default();
            let b = io(a, 1000, 1, 1000 * MS);
            let t = t0 + 1000 * MS;
            Run {
                pacer: Pacer::new((t0, a), (t, b), floor),
                t,
                io: b,
                sent: 0,
            }
        }

        fn tick(&mut self, ops_per_s: u64, latency_ms: u64) -> Option<Speed> {
            self.t += PACING_INTERVAL;
            self.io = io(self.io, ops_per_s, latency_ms, PACING_INTERVAL);
            self.sent += 5_000_000;
            self.pacer.tick(self.t, self.io, self.sent)
        }
    }

    #[test]
    fn a_guest_unslowed_by_the_copy_leaves_it_unpaced() {
        let mut r = Run::new(0.5);
        for _ in 0..20 {
            assert_eq!(r.tick(990, 1), None);
        }
        assert_eq!(r.pacer.summary(), None);
    }

    #[test]
    fn a_slowed_guest_cuts_the_speed_down_to_the_floor_and_a_calm_one_raises_it_back() {
        let mut r = Run::new(0.5);
        assert_eq!(
            r.tick(1000, 1),
            None,
            "the first look only sets the reference"
        );
        assert_eq!(r.tick(500, 1), Some(Speed::Limited(7_000_000)));
        assert_eq!(r.tick(500, 1), Some(Speed::Limited(5_000_000)));
        assert_eq!(r.tick(500, 1), None, "at the floor");
        assert_eq!(r.tick(1000, 1), Some(Speed::Limited(6_000_000)));
        for _ in 0..3 {
            assert!(matches!(r.tick(1000, 1), Some(Speed::Limited(_))));
        }
        assert_eq!(r.tick(1000, 1), Some(Speed::Unlimited));
        let s = r.pacer.summary().expect("it paced");
        assert!(s.contains("down to 50%"), "{s}");
    }

    #[test]
    fn the_reference_rate_starts_when_the_sender_first_sends() {
        let mut r = Run::new(0.5);
        // The sender waits (for the destination's index) through three looks, then drains
        // 5 MB a look: the reference is 10 MB/s, not the average over the wait.
        for _ in 0..3 {
            r.t += PACING_INTERVAL;
            r.io = io(r.io, 1000, 1, PACING_INTERVAL);
            assert_eq!(r.pacer.tick(r.t, r.io, 0), None);
        }
        r.tick(1000, 1);
        assert_eq!(r.tick(500, 1), Some(Speed::Limited(7_000_000)));
    }

    #[test]
    fn slower_operations_count_as_slowed_even_at_the_same_rate() {
        let mut r = Run::new(0.5);
        r.tick(1000, 1);
        assert_eq!(r.tick(1000, 8), Some(Speed::Limited(7_000_000)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_bulk_gate_holds_bulk_writes_until_opened_and_spaces_them_at_its_speed() {
        let gate = std::sync::Arc::new(BulkGate::shut());
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move { gate.admit(1 << 20).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "a shut gate took a bulk write");
        // 1 MiB/s: the first write goes at once, each next one a second after the last.
        gate.set(Speed::Limited(1 << 20));
        waiting.await.unwrap();
        let t0 = tokio::time::Instant::now();
        gate.admit(1 << 20).await;
        assert_eq!(t0.elapsed(), Duration::from_secs(1));
        gate.admit(1 << 20).await;
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        // At 1 byte a second a write would wait for days; a faster speed reaches it at once.
        gate.set(Speed::Limited(1));
        gate.admit(1 << 20).await;
        let crawling = tokio::spawn({
            let gate = gate.clone();
            async move { gate.admit(1 << 20).await }
        });
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!crawling.is_finished());
        gate.set(Speed::Limited(1 << 20));
        let t1 = tokio::time::Instant::now();
        crawling.await.unwrap();
        assert!(t1.elapsed() <= Duration::from_secs(1), "{:?}", t1.elapsed());
        // Unlimited takes everything at once; lifted, a later speed is ignored.
        gate.set(Speed::Unlimited);
        gate.lift();
        gate.set(Speed::Limited(1));
        let t2 = tokio::time::Instant::now();
        for _ in 0..10 {
            gate.admit(1 << 20).await;
        }
        assert!(gate.is_lifted());
        assert!(t2.elapsed() <= Duration::from_secs(1), "{:?}", t2.elapsed());
    }

    #[test]
    fn an_idle_guest_is_never_paced() {
        let t0 = Instant::now();
        let a = GuestIo::default();
        let b = io(a, 10, 1, 1000 * MS);
        let mut p = Pacer::new((t0, a), (t0 + 1000 * MS, b), 0.5);
        assert!(!p.active());
        assert_eq!(p.tick(t0 + 1500 * MS, io(b, 0, 0, 500 * MS), 1 << 20), None);
        assert_eq!(p.tick(t0 + 2000 * MS, io(b, 0, 0, 500 * MS), 2 << 20), None);
    }
}
