//! How one migration runs: every setting a user can give, its default and its bounds, in one
//! place. The CLI's flags, the agent's JSON API (`MigrationRequest` flattens it) and the lab's
//! bench all fill this struct; [`MigrationSettings::validate`] is the one check, run before
//! anything is touched.

use serde::{Deserialize, Serialize};

use crate::agent::{CodecSettings, DiskMode};

/// The settings of one migration. Serialized names are the agent API's field names; a field a
/// request leaves out takes its default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct MigrationSettings {
    /// TCP connections across the WAN; 0: as many as the link needs on this host (one
    /// unless one connection's send buffer cannot hold the link), decided at the first.
    pub connections: u32,
    /// The real downtime target (source STOP to destination RESUME): the agent keeps QEMU's
    /// downtime-limit at this minus what follows QEMU's last byte (ferry's window, half a round
    /// trip, the destination's resume). With `qemu_switchover_rule`, QEMU's limit as is.
    #[serde(rename = "downtime_limit_ms")]
    pub downtime_ms: u64,
    /// When the guest dirties memory faster than the link carries it, let QEMU throttle its
    /// vCPUs (auto-converge, raised only as far as needed) so that the migration converges.
    pub converge: bool,
    /// Leave the switchover to QEMU's own rule with `downtime_ms` as its limit (for
    /// comparison).
    pub qemu_switchover_rule: bool,
    /// CloudNet's smart stop: once the guest rewrites pages faster than they travel, switch
    /// over at the first pass that starts with fewer pages than each of the 4 before it,
    /// even if the pause then exceeds `downtime_ms` (instead of iterating on).
    pub smart_stop: bool,
    /// How long the WAN may be down before the migration fails (the source keeps running).
    pub wan_timeout_s: u64,
    /// The whole migration's deadline.
    pub timeout_s: u64,
    /// QEMU's return path on: the destination QEMU confirms it loaded the stream before the
    /// source QEMU calls the migration complete, and the agents carry it back. Plain precopy
    /// does not need it, and the confirmation adds a round trip to the downtime.
    pub return_path: bool,
    /// Postcopy: once QEMU's first pass has copied the memory, switch (QEMU's postcopy-ram):
    /// the VM stops, its device state crosses, and it runs at the destination while the pages
    /// still at the source follow, those the guest touches first. The pause no longer depends
    /// on how fast the guest writes, but from the switch on the VM needs both hosts and the
    /// link; ferry commits at the switch, once the digest of everything before it matched.
    /// Not with disks.
    pub postcopy: bool,
    /// Postcopy only when precopy would throttle the guest hard: switch once auto-converge
    /// has throttled its vCPUs to this percentage (precopy otherwise, to the end). Needs
    /// `converge`; not with disks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy_at_throttle_pct: Option<u8>,
    /// Which of the codec's techniques the agents apply to the stream on the WAN.
    pub codec: CodecSettings,
    /// With seeding on: the VM whose earlier image the destination should index (a sibling
    /// made from the same template); by default the migrating VM's own, if it ran there before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed_from: Option<String>,
    /// How the disk writes the guest makes during the migration reach the destination.
    pub disk_mode: DiskMode,
    /// The source's disk transmit buffer, MiB (asynchronous mirroring's bound).
    pub disk_buffer_mib: u64,
    /// On a return to a host that still holds the copy the VM left there, send what QEMU's
    /// dirty bitmaps say changed since (off: the destination reads and indexes its copy).
    pub disk_bitmaps: bool,
    /// Async and cloudnet modes: QEMU's mirror copies the disk in the background, where no
    /// guest write waits for the copy, and turns write-blocking once the copy is done (off:
    /// write-blocking from the start, for comparison).
    pub disk_background_copy: bool,
    /// A background copy paced by the guest's IO: while the guest's disk operations run
    /// slower than before the copy, the copy slows down to this share (percent) of its
    /// unpaced rate at the least. None: never paced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_pacing_floor_pct: Option<u32>,
    /// Test hook: flip one bit of the stream at this byte offset after the source hashed it,
    /// so the destination's digest differs (in a libvirt migration, of each of QEMU's streams
    /// that reaches it: the main one and each multifd channel).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_corrupt_at: Option<u64>,
    /// Test hook: flip one bit of the disks' written data at this byte offset (counted over
    /// the data the source sends, in order) after the source hashed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_corrupt_disk_at: Option<u64>,
    /// Test hook: a background disk copy counts as stalled after this many milliseconds
    /// without progress (instead of 10 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_disk_stall_ms: Option<u64>,
    /// Test hook: code the stream channel in this many shards (1 to [`MAX_TEST_SHARDS`])
    /// instead of the number the agent chooses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_shards: Option<u32>,
    /// Test hook: pause and resume the stream's block caches every this many bytes of QEMU's
    /// stream, instead of when the agent's CPU is the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_cache_pause_bytes: Option<u64>,
}

impl Default for MigrationSettings {
    fn default() -> Self {
        MigrationSettings {
            // Automatic: one wherever one connection's send buffer holds the link (on the
            // lab's 100 Mbit/s, 50 ms link one matched QEMU's own throughput with the least
            // overhead, and more made the stream wait on the slowest one: BENCHMARKS.md,
            // "How many connections"), more where this host caps the buffer short of it.
            connections: 0,
            // QEMU's own default downtime-limit.
            downtime_ms: 300,
            // A migration that never ends helps nobody; the throttle is raised only as far as
            // the link needs.
            converge: true,
            qemu_switchover_rule: false,
            // Off: it trades the downtime target for not slowing the guest.
            smart_stop: false,
            // Two minutes of outage: longer than a routing flap or a middlebox restart, short
            // enough that a dead peer does not hold the source's migration state for long.
            wan_timeout_s: 120,
            // 15 minutes: a 512 MiB guest crosses a 10 Mbit/s link in under 10.
            timeout_s: 900,
            return_path: false,
            postcopy: false,
            postcopy_at_throttle_pct: None,
            codec: CodecSettings::ALL,
            seed_from: None,
            disk_mode: DiskMode::Async,
            // 16 MiB: XvMotion's per-disk cap on the transmit queue (1.3 s of a 100 Mbit/s
            // link).
            disk_buffer_mib: 16,
            disk_bitmaps: true,
            // On: in write-blocking mode a guest write to a region the bulk copy holds waits
            // for that copy's room on the WAN (BENCHMARKS.md, "Disks").
            disk_background_copy: true,
            disk_pacing_floor_pct: None,
            test_corrupt_at: None,
            test_corrupt_disk_at: None,
            test_disk_stall_ms: None,
            test_shards: None,
            test_cache_pause_bytes: None,
        }
    }
}

/// A setting out of its bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingsError {
    #[error("connections {0} is out of range; use 1 to {MAX_CONNECTIONS}, or 0 for as many as the link needs")]
    Connections(u32),
    #[error("downtime {0} ms is out of range; use 1 to {MAX_DOWNTIME_MS}")]
    Downtime(u64),
    #[error("timeout 0 s: the migration needs at least 1 s")]
    Timeout,
    #[error("WAN timeout 0 s: the link needs at least 1 s to come back")]
    WanTimeout,
    #[error("disk buffer {0} MiB is out of range; use 1 to {MAX_DISK_BUFFER_MIB}")]
    DiskBuffer(u64),
    #[error("disk pacing floor {0}% is out of range; use 5 to 100")]
    DiskPacingFloor(u32),
    #[error("postcopy at a throttle of {0}% is out of range; use 1 to 99")]
    PostcopyAtThrottle(u8),
    #[error("postcopy at a throttle needs the throttle (auto-converge): drop --no-converge")]
    PostcopyAtThrottleWithoutConverge,
    #[error("test shards {0} is out of range; use 1 to {MAX_TEST_SHARDS}")]
    TestShards(u32),
    #[error("test cache pause bytes 0: the block caches need at least 1 byte between changes")]
    TestCachePauseBytes,
}

/// The most TCP connections one migration opens (each has its own socket buffers and state).
pub const MAX_CONNECTIONS: u32 = 64;
/// A minute: a pause longer than that is not a live migration.
pub const MAX_DOWNTIME_MS: u64 = 60_000;
/// 4 GiB of the source's memory for guest writes in flight.
pub const MAX_DISK_BUFFER_MIB: u64 = 4096;
/// The most shards the stream channel's codec is cut into (`ferry_codec::shard::MAX_SHARDS`).
pub const MAX_TEST_SHARDS: u32 = 16;

impl MigrationSettings {
    /// Checks every bound; called before any side effect.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.connections > MAX_CONNECTIONS {
            return Err(SettingsError::Connections(self.connections));
        }
        if !(1..=MAX_DOWNTIME_MS).contains(&self.downtime_ms) {
            return Err(SettingsError::Downtime(self.downtime_ms));
        }
        if self.timeout_s == 0 {
            return Err(SettingsError::Timeout);
        }
        if self.wan_timeout_s == 0 {
            return Err(SettingsError::WanTimeout);
        }
        if !(1..=MAX_DISK_BUFFER_MIB).contains(&self.disk_buffer_mib) {
            return Err(SettingsError::DiskBuffer(self.disk_buffer_mib));
        }
        if let Some(pct) = self
            .disk_pacing_floor_pct
            .filter(|p| !(5..=100).contains(p))
        {
            return Err(SettingsError::DiskPacingFloor(pct));
        }
        if let Some(pct) = self.postcopy_at_throttle_pct {
            if !(1..=99).contains(&pct) {
                return Err(SettingsError::PostcopyAtThrottle(pct));
            }
            if !self.converge {
                return Err(SettingsError::PostcopyAtThrottleWithoutConverge);
            }
        }
        if let Some(shards) = self
            .test_shards
            .filter(|s| !(1..=MAX_TEST_SHARDS).contains(s))
        {
            return Err(SettingsError::TestShards(shards));
        }
        if self.test_cache_pause_bytes == Some(0) {
            return Err(SettingsError::TestCachePauseBytes);
        }
        Ok(())
    }

    /// Whether the migration may switch to postcopy (both QEMUs then need its capability).
    pub fn postcopy_possible(&self) -> bool {
        self.postcopy || self.postcopy_at_throttle_pct.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_object_is_the_defaults() {
        let s: MigrationSettings = serde_json::from_str("{}").unwrap();
        assert_eq!(s, MigrationSettings::default());
        assert_eq!(s.validate(), Ok(()));
    }

    #[test]
    fn settings_round_trip_through_json() {
        let s = MigrationSettings {
            connections: 4,
            downtime_ms: 120,
            codec: "zero,zstd".parse().unwrap(),
            seed_from: Some("sib".into()),
            disk_mode: DiskMode::Cloudnet,
            ..MigrationSettings::default()
        };
        let back: MigrationSettings =
            serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(s, back);
    }

    #[test]
    fn each_bound_is_refused_with_its_name() {
        let bad = |f: fn(&mut MigrationSettings)| {
            let mut s = MigrationSettings::default();
            f(&mut s);
            s.validate().unwrap_err().to_string()
        };
        assert_eq!(
            bad(|s| s.connections = 65),
            "connections 65 is out of range; use 1 to 64, or 0 for as many as the link needs"
        );
        assert_eq!(
            bad(|s| s.downtime_ms = 60_001),
            "downtime 60001 ms is out of range; use 1 to 60000"
        );
        assert_eq!(
            bad(|s| s.timeout_s = 0),
            "timeout 0 s: the migration needs at least 1 s"
        );
        assert!(bad(|s| s.wan_timeout_s = 0).starts_with("WAN timeout 0 s"));
        assert_eq!(
            bad(|s| s.disk_buffer_mib = 5000),
            "disk buffer 5000 MiB is out of range; use 1 to 4096"
        );
        assert_eq!(
            bad(|s| s.disk_pacing_floor_pct = Some(0)),
            "disk pacing floor 0% is out of range; use 5 to 100"
        );
        assert_eq!(
            bad(|s| s.postcopy_at_throttle_pct = Some(100)),
            "postcopy at a throttle of 100% is out of range; use 1 to 99"
        );
        assert_eq!(
            bad(|s| {
                s.postcopy_at_throttle_pct = Some(40);
                s.converge = false;
            }),
            "postcopy at a throttle needs the throttle (auto-converge): drop --no-converge"
        );
        assert!(bad(|s| s.test_shards = Some(17)).starts_with("test shards 17 is out of range"));
        assert!(bad(|s| s.test_cache_pause_bytes = Some(0)).starts_with("test cache pause bytes 0"));
    }
}
