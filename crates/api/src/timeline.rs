//! A migration's timeline: a sample every 100 ms and the events that mark its phases.
//!
//! Written as JSON next to every migration (`ferry migrate --timeline FILE`) and drawn by
//! `ferry report`. Times are milliseconds since the migration request (`t_ms`), so timelines of
//! different systems line up. Fields a system cannot measure are `None`.
//!
//! Versioning: `version` is bumped when a field changes meaning; readers reject versions they
//! do not know. Adding an optional field does not bump it.

use serde::{Deserialize, Serialize};

/// The timeline format this build writes and reads.
pub const TIMELINE_VERSION: u32 = 1;

/// One migration, sampled.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    pub version: u32,
    /// `ferry` or `qemu-<mode>`.
    pub system: String,
    pub vm: String,
    pub from_site: String,
    pub to_site: String,
    /// Wall clock of the migration request, ms since the Unix epoch.
    pub started_unix_ms: u64,
    /// The link's bottleneck rate, for scaling plots.
    pub link_rate_mbit: f64,
    pub samples: Vec<Sample>,
    pub events: Vec<Event>,
}

impl Timeline {
    /// Appends a sample, deriving its rates from the one before it.
    pub fn push_sample(&mut self, mut sample: Sample) {
        if let Some(prev) = self.samples.last() {
            let dt_s = sample.t_ms.saturating_sub(prev.t_ms) as f64 / 1e3;
            if let (Some(now), Some(before)) = (sample.qemu_transferred, prev.qemu_transferred) {
                if dt_s > 0.0 {
                    sample.qemu_mbit = Some(now.saturating_sub(before) as f64 * 8.0 / dt_s / 1e6);
                }
            }
        }
        self.samples.push(sample);
    }

    /// The WAN's rate in the bulk of the migration, Mbit/s: from the sample where the WAN had
    /// carried a tenth of the migration's bytes to the one where it had carried nine tenths.
    /// The ends are left out on purpose: the start is slow start and set-up, the end the
    /// switchover, neither of which says whether the pipeline keeps the link full. `None`
    /// without samples enough to tell.
    pub fn bulk_rate_mbit(&self) -> Option<f64> {
        let total = self.samples.last()?.wan_bytes;
        let reached = |share: u64| {
            self.samples
                .iter()
                .find(|s| s.wan_bytes * 10 >= total * share)
        };
        let (from, to) = (reached(1)?, reached(9)?);
        let seconds = to.t_ms.checked_sub(from.t_ms).filter(|ms| *ms > 0)? as f64 / 1e3;
        Some((to.wan_bytes - from.wan_bytes) as f64 * 8.0 / seconds / 1e6)
    }
}

/// The state of the migration at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub t_ms: u64,
    /// Bytes on the WAN since the request (the emulator's counter, both directions).
    pub wan_bytes: u64,
    /// WAN rate over the last interval, Mbit/s.
    pub wan_mbit: f64,
    /// Bytes QEMU handed to its migration channel so far (`ram.transferred`).
    pub qemu_transferred: Option<u64>,
    /// QEMU's estimate of RAM still to send (`ram.remaining`).
    pub qemu_remaining: Option<u64>,
    /// QEMU's precopy pass (`ram.dirty-sync-count`).
    pub iteration: Option<u64>,
    /// QEMU's own migration status (`active`, `pre-switchover`, ...).
    pub qemu_status: Option<String>,
    /// The rate QEMU handed bytes to its channel over the last interval, Mbit/s (filled in by
    /// [`Timeline::push_sample`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu_mbit: Option<f64>,
    /// ferry: bytes the source agent has read from QEMU's stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_stream_bytes: Option<u64>,
    /// ferry: bytes the transport wrote to its connections (frames, replays included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_wire_bytes: Option<u64>,
    /// ferry: stream bytes sent but not yet consumed at the destination (the send window in
    /// use: what would still cross after QEMU stops the guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_unacked_bytes: Option<u64>,
    /// Frames the WAN emulator dropped since the request (random loss and a full queue, both
    /// directions): a loss among a stream's last segments costs a retransmission timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wan_drops: Option<u64>,
}

/// Something that happened at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub t_ms: u64,
    pub kind: EventKind,
    /// Human detail, e.g. the error of a failure.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// What happened. Zero is not a valid kind on any wire: the enum is tagged by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum EventKind {
    /// The destination QEMU was started (paused, waiting for the stream).
    DestinationStarted,
    /// Disk mirroring began.
    DiskCopyStarted,
    /// Every disk mirror caught up.
    DiskReady,
    /// Memory migration began.
    MemoryStarted,
    /// QEMU stopped the source for the final pass (QMP STOP).
    SourceStopped,
    /// ferry: the stream's last byte reached the destination agent (decoded).
    StreamArrived,
    /// ferry: the destination QEMU had read the whole stream from its agent.
    StreamFed,
    /// The destination loaded the whole stream.
    DestinationLoaded,
    /// The destination runs (QMP RESUME): the commit point has passed.
    DestinationResumed,
    /// The migration failed or was cancelled; the source keeps running.
    Failed,
    /// A WAN connection dropped (ferry; the transport reconnects and replays).
    ConnectionLost,
    /// A WAN connection was (re-)established.
    Connected,
    /// The source QEMU finished writing its stream; its digest went to the destination.
    StreamEnded,
    /// Both ends' digests matched and the destination loaded: the commit point.
    Committed,
    /// Smart stop (CloudNet) told QEMU to switch over now: past the crossover, the remaining
    /// pages reached a new minimum of the recent passes.
    SmartStop,
    /// A group member's group said go: every member could stop now, the downtime target
    /// asked for applies.
    GroupGo,
}

impl EventKind {
    /// A short label for plots.
    pub fn label(self) -> &'static str {
        match self {
            EventKind::DestinationStarted => "dst started",
            EventKind::DiskCopyStarted => "disk copy",
            EventKind::DiskReady => "disk ready",
            EventKind::MemoryStarted => "memory",
            EventKind::SourceStopped => "src STOP",
            EventKind::StreamArrived => "dst got stream",
            EventKind::StreamFed => "dst QEMU read it",
            EventKind::DestinationLoaded => "dst loaded",
            EventKind::DestinationResumed => "dst RESUME",
            EventKind::Failed => "failed",
            EventKind::ConnectionLost => "conn lost",
            EventKind::Connected => "connected",
            EventKind::StreamEnded => "stream end",
            EventKind::Committed => "commit",
            EventKind::SmartStop => "smart stop",
            EventKind::GroupGo => "group go",
        }
    }
}

impl Timeline {
    /// An empty timeline for a migration requested now.
    pub fn new(
        system: &str,
        vm: &str,
        from_site: &str,
        to_site: &str,
        started_unix_ms: u64,
        link_rate_mbit: f64,
    ) -> Timeline {
        Timeline {
            version: TIMELINE_VERSION,
            system: system.to_owned(),
            vm: vm.to_owned(),
            from_site: from_site.to_owned(),
            to_site: to_site.to_owned(),
            started_unix_ms,
            link_rate_mbit,
            samples: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Records an event.
    pub fn event(&mut self, t_ms: u64, kind: EventKind, detail: impl Into<String>) {
        self.events.push(Event {
            t_ms,
            kind,
            detail: detail.into(),
        });
    }

    /// The first event of a kind.
    pub fn find(&self, kind: EventKind) -> Option<&Event> {
        self.events.iter().find(|e| e.kind == kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_round_trips_through_json_with_kebab_case_kinds() {
        let mut t = Timeline::new("qemu-plain", "vm1", "a", "b", 1_700_000_000_000, 100.0);
        t.samples.push(Sample {
            t_ms: 100,
            wan_bytes: 1_000,
            wan_mbit: 0.08,
            qemu_remaining: Some(5),
            ..Default::default()
        });
        t.event(120, EventKind::SourceStopped, "");
        t.event(500, EventKind::Failed, "no route");
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.contains("\"kind\":\"source-stopped\""), "{json}");
        assert!(
            !json.contains("\"detail\":\"\""),
            "empty details are omitted: {json}"
        );
        let back: Timeline = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.find(EventKind::Failed).unwrap().detail, "no route");
    }

    #[test]
    fn the_bulk_rate_leaves_out_the_start_and_the_switchover() {
        let mut t = Timeline::new("ferry", "vm1", "a", "b", 0, 1000.0);
        // A slow start, 10 MB a second through the middle, a slow end.
        for (t_ms, wan_bytes) in [
            (0, 0),
            (1_000, 1_000_000),
            (2_000, 10_000_000),
            (3_000, 20_000_000),
            (10_000, 90_000_000),
            (11_000, 99_000_000),
            (20_000, 100_000_000),
        ] {
            t.push_sample(Sample {
                t_ms,
                wan_bytes,
                ..Default::default()
            });
        }
        // From 10 MB at 2 s to 90 MB at 10 s.
        assert_eq!(t.bulk_rate_mbit(), Some(80.0));
        t.samples.truncate(1);
        assert_eq!(t.bulk_rate_mbit(), None);
    }

    #[test]
    fn unknown_event_kinds_are_rejected() {
        let err = serde_json::from_str::<Event>(r#"{"t_ms":1,"kind":"teleported"}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown variant `teleported`"),
            "{err}"
        );
    }
}
