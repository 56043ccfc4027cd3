//! Following a migration from the CLI: the source agent's status read every 100 ms becomes
//! the progress bar's samples and the timeline (samples and the agents' events, in ms since
//! the request), until the migration has committed or failed. Ctrl-C ([`crate::interrupt`])
//! asks the agent to cancel; before the stream's end it does, after it the destination
//! decides.
//!
//! Bytes on the WAN come from a [`WanCounter`]: the lab's emulator (the referee of its
//! benchmarks), or the agents' own transport counters on real hosts.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use ferry_api::agent::{ErrorKind, MigrationState, MigrationStatus};
use ferry_api::outcome::{MigrationOutcome, Progress};
use ferry_api::{EventKind, Sample, Timeline};
use tokio::sync::watch;

use crate::client::{AgentClient, AgentRefused};
use crate::interrupt;

/// How often the status is read: the timeline's resolution.
const POLL: Duration = Duration::from_millis(100);
/// How long the agent may not answer (a restart) before following gives up.
const AGENT_AWAY: Duration = Duration::from_secs(30);

/// Bytes on the WAN (both directions) and frames dropped there, since the migration started.
pub trait WanCounter {
    fn read(&mut self, status: &MigrationStatus) -> Result<WanCount>;
}

/// One reading of a [`WanCounter`].
#[derive(Debug, Clone, Copy, Default)]
pub struct WanCount {
    pub bytes: u64,
    /// None where nothing counts drops (the agents' own counters).
    pub drops: Option<u64>,
}

/// The agents' transport counters: the bytes the source agent's connections sent and
/// received, TLS and framing included, TCP/IP headers not.
pub struct AgentWire;

impl WanCounter for AgentWire {
    fn read(&mut self, status: &MigrationStatus) -> Result<WanCount> {
        Ok(WanCount {
            bytes: status.wire.bytes_out + status.wire.bytes_in,
            drops: None,
        })
    }
}

/// Wall-clock µs since the epoch.
pub fn now_micros() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    i64::try_from(since.as_micros()).expect("µs since 1970 fit in i64")
}

/// Where the migration started, in both clocks.
#[derive(Debug, Clone, Copy)]
pub struct Start {
    pub at: Instant,
    pub unix_us: i64,
}

impl Start {
    pub fn now() -> Start {
        Start {
            at: Instant::now(),
            unix_us: now_micros(),
        }
    }

    pub fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.at.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A wall-clock time (µs) as ms since the start (0 if before it).
    pub fn ms_at(&self, unix_us: i64) -> u64 {
        u64::try_from((unix_us - self.unix_us).max(0) / 1000).unwrap_or(0)
    }
}

/// How following ended.
pub struct Followed {
    /// The source agent's last status (committed or failed).
    pub status: MigrationStatus,
    /// The user pressed Ctrl-C while it ran.
    pub interrupted: bool,
}

/// Follows migration `id` on the source agent until it is no longer running.
pub async fn follow(
    agent: &AgentClient,
    id: &str,
    start: Start,
    wan: &mut dyn WanCounter,
    progress: &watch::Sender<Progress>,
    timeline: &Mutex<Timeline>,
) -> Result<Followed> {
    let _active = interrupt::Active::enter();
    let mut last = (Instant::now(), 0u64);
    let mut seen_events = 0;
    let mut interrupted = false;
    let mut unreachable_since: Option<Instant> = None;
    loop {
        tokio::time::sleep(POLL).await;
        let s = match agent.migration(id).await {
            Ok(s) => {
                unreachable_since = None;
                s
            }
            // Restarted: a migration of ferry's own is listed again from its record; libvirt's
            // are not recorded, and libvirt settles them.
            Err(e)
                if e.downcast_ref::<AgentRefused>()
                    .is_some_and(|r| r.kind == ErrorKind::NotFound) =>
            {
                bail!(
                    "the agent no longer knows migration {id}: it restarted without a record of \
                     it (libvirt's migrations are not recorded: libvirt settles the domain, see \
                     `virsh domstate` at both hosts)"
                )
            }
            // Gone for a moment (restarting): followed again once it answers.
            Err(e) => {
                let since = *unreachable_since.get_or_insert_with(Instant::now);
                if since.elapsed() > AGENT_AWAY {
                    return Err(e.context(format!(
                        "the agent has not answered for {}s; migration {id} goes on or ends \
                         without this command (`ferry migrations` shows it)",
                        AGENT_AWAY.as_secs()
                    )));
                }
                continue;
            }
        };
        let now = Instant::now();
        let count = wan.read(&s)?;
        let dt = now.duration_since(last.0).as_secs_f64();
        let mbit = if dt > 0.0 {
            count.bytes.saturating_sub(last.1) as f64 * 8.0 / dt / 1e6
        } else {
            0.0
        };
        last = (now, count.bytes);
        {
            let mut t = timeline.lock().expect("timeline poisoned");
            t.push_sample(Sample {
                t_ms: start.elapsed_ms(),
                wan_bytes: count.bytes,
                wan_mbit: mbit,
                qemu_transferred: Some(s.qemu.transferred),
                qemu_remaining: Some(s.qemu.remaining),
                iteration: Some(s.qemu.iteration),
                qemu_status: Some(s.qemu.status.clone()),
                agent_stream_bytes: Some(s.stream_bytes),
                agent_wire_bytes: Some(s.wire.bytes_out),
                agent_unacked_bytes: Some(s.wire.unacked_bytes),
                wan_drops: count.drops,
                ..Sample::default()
            });
            // A restarted agent lists the migration again with the events its record kept:
            // fewer than were seen.
            for e in s.events.get(seen_events..).unwrap_or_default() {
                t.event(
                    start.ms_at(i64::try_from(e.unix_ms).unwrap_or(i64::MAX) * 1000),
                    e.kind,
                    &e.detail,
                );
            }
            seen_events = s.events.len();
        }
        progress.send_modify(|p| {
            p.phase = if s.detail.is_empty() {
                s.phase.name().to_owned()
            } else {
                format!("{}: {}", s.phase.name(), s.detail)
            };
            p.elapsed_ms = start.elapsed_ms();
            p.wan_bytes = count.bytes;
            p.wan_mbit = 0.7 * p.wan_mbit + 0.3 * mbit;
            p.ram_total = s.qemu.total;
            p.ram_transferred = s.qemu.transferred;
            p.ram_remaining = s.qemu.remaining;
            p.iteration = s.qemu.iteration;
            p.eta_s =
                (p.wan_mbit > 0.1).then(|| s.qemu.remaining as f64 * 8.0 / (p.wan_mbit * 1e6));
        });
        if s.state != MigrationState::Running {
            if s.state == MigrationState::Committed {
                mark_switchover(&s, start, timeline);
            }
            return Ok(Followed {
                status: s,
                interrupted,
            });
        }
        if interrupt::requested() && !interrupted {
            // Before the stream's end the agent cancels and resumes the source; after it, the
            // destination decides and cancel is refused.
            interrupted = true;
            if let Err(e) = agent.cancel(id).await {
                eprintln!("ferry: {e:#}");
            }
        }
    }
}

/// The switchover's moments, from both agents' clocks, as timeline events.
fn mark_switchover(status: &MigrationStatus, start: Start, timeline: &Mutex<Timeline>) {
    let mut t = timeline.lock().expect("timeline poisoned");
    if let Some(stop) = status.source_stop_unix_us {
        t.event(start.ms_at(stop), EventKind::SourceStopped, "");
    }
    if let Some(d) = status.destination_switchover {
        let skipped = format!(
            "{} zero-page records left out (zero there already)",
            d.zero_pages_skipped
        );
        for (at, kind, detail) in [
            (d.arrived_unix_us, EventKind::StreamArrived, ""),
            (d.fed_unix_us, EventKind::StreamFed, skipped.as_str()),
            (d.loaded_unix_us, EventKind::DestinationLoaded, ""),
        ] {
            t.event(start.ms_at(at), kind, detail);
        }
    }
    if let Some(resume) = status.destination_resume_unix_us.filter(|r| *r > 0) {
        t.event(start.ms_at(resume), EventKind::DestinationResumed, "");
    }
}

/// The outcome of a committed migration, from the source agent's last status.
pub fn outcome(status: &MigrationStatus, start: Start, wan: WanCount) -> MigrationOutcome {
    let resume = status.destination_resume_unix_us.filter(|r| *r > 0);
    let stop = status.source_stop_unix_us;
    // In postcopy the migration ends when the last page arrived, after the resume.
    let done = status.postcopy_done_unix_us.or(resume);
    MigrationOutcome {
        completed: status.state == MigrationState::Committed,
        total_ms: start.ms_at(done.unwrap_or_else(now_micros)),
        postcopy_ms: status
            .postcopy_done_unix_us
            .zip(resume)
            .map(|(d, r)| u64::try_from((d - r) / 1000).unwrap_or(0)),
        postcopy_blocktime_ms: status.postcopy_blocktime_ms,
        preempt_bytes: status.postcopy_done_unix_us.map(|_| status.preempt_bytes),
        downtime_ms: resume.zip(stop).map(|(r, s)| (r - s) as f64 / 1000.0),
        qemu_downtime_ms: status.qemu_downtime_ms,
        guest_gap_ms: None,
        wan_bytes: wan.bytes,
        wan_drops: wan.drops.unwrap_or(0),
        iterations: status.qemu.iteration,
        ram_transferred: status.stream_bytes,
        error: status.error.clone(),
        connections: (status.wire.connections > 0).then_some(status.wire.connections),
        connections_why: status.wire.connections_why.clone(),
        codec: status.codec.clone(),
        disk: status.disk.clone(),
        cpu_throttle_pct: status.max_cpu_throttle_pct,
        throttle_vcpu_s: status.max_cpu_throttle_pct.map(|_| status.throttle_vcpu_s),
    }
}
