//! The migration's settings as command-line flags. Defaults and bounds are
//! [`MigrationSettings`]'s: the flags only name them.

use anyhow::{bail, Result};
use clap::Args;
use ferry_api::agent::{CodecSettings, DiskMode};
use ferry_api::settings::MigrationSettings;

fn defaults() -> MigrationSettings {
    MigrationSettings::default()
}

/// Flags for every [`MigrationSettings`] field (`migrate`, `bench`, `demo`).
#[derive(Args, Debug, Clone)]
pub struct SettingsFlags {
    /// ferry: TCP connections across the WAN; 0: as many as the link needs on this host (one
    /// unless the host caps a connection's send buffer short of the link).
    #[arg(long, default_value_t = defaults().connections)]
    pub connections: u32,
    /// ferry: how long the WAN may be down before the migration fails (the source keeps running).
    #[arg(long, default_value_t = defaults().wan_timeout_s)]
    pub wan_timeout_s: u64,
    /// Test hook (ferry): flip one bit of the stream at this byte offset, after the source
    /// hashed it, to show that the digest check stops the migration.
    #[arg(long, hide = true)]
    pub test_corrupt_at: Option<u64>,
    /// Test hook (ferry): code the stream channel in this many shards (1 to 16).
    #[arg(long, hide = true)]
    pub test_shards: Option<u32>,
    /// Test hook (ferry): pause and resume the stream's block caches every this many bytes of
    /// QEMU's stream instead of when the agent's CPU is the limit.
    #[arg(long, hide = true)]
    pub test_cache_pause_bytes: Option<u64>,
    /// Test hook (ferry): flip one bit of the disks' data at this byte offset, after the
    /// source hashed it, to show that the destination's acknowledgement stops the migration.
    #[arg(long, hide = true)]
    pub test_corrupt_disk_at: Option<u64>,
    /// Test hook (ferry): take a background disk copy for stalled once it has come no closer
    /// to done for this many milliseconds (10 s otherwise), to show the turn to write-blocking.
    #[arg(long, hide = true)]
    pub test_disk_stall_ms: Option<u64>,
    /// ferry: turn QEMU's return path on (the destination QEMU confirms it loaded the stream
    /// before the source completes; costs a round trip of downtime).
    #[arg(long)]
    pub return_path: bool,
    /// ferry: switch to postcopy once QEMU's first pass has copied the memory: the VM runs at
    /// the destination from then on and its remaining pages follow, those it touches first
    /// (the pause does not grow with the guest's writes; the VM needs both hosts until the
    /// last page arrived). Not with disks.
    #[arg(long)]
    pub postcopy: bool,
    /// ferry: postcopy only for a guest precopy would throttle hard: switch once the
    /// throttle (auto-converge) reaches this percentage, precopy otherwise. Not with disks.
    #[arg(long, value_name = "PCT", conflicts_with = "postcopy")]
    pub postcopy_at_throttle: Option<u8>,
    /// ferry: the codec's techniques on the WAN: all, none (QEMU's bytes as they are), or a
    /// comma-separated list of zero, dedup, delta, zstd, seed (pages the destination still
    /// holds from the VM's earlier stay there go as references).
    #[arg(long, default_value_t = defaults().codec)]
    pub codec: CodecSettings,
    /// ferry, with seeding: index this VM's earlier image at the destination instead of the
    /// migrating VM's own (a sibling made from the same template).
    #[arg(long)]
    pub seed_from: Option<String>,
    /// Downtime target, ms (300 is QEMU's default). ferry: the real pause, source STOP to
    /// destination RESUME, which the agent meets by steering QEMU's downtime-limit; qemu (or
    /// ferry with --qemu-switchover-rule): QEMU's own downtime-limit.
    #[arg(long, default_value_t = defaults().downtime_ms)]
    pub downtime_ms: u64,
    /// ferry: leave the switchover to QEMU's own rule, --downtime-ms as its limit (for
    /// comparison).
    #[arg(long)]
    pub qemu_switchover_rule: bool,
    /// ferry: CloudNet's smart stop: once the guest rewrites memory faster than it travels,
    /// switch over at the first pass with fewer pages left than each of the 4 before it, even
    /// if the pause then exceeds --downtime-ms (use with --no-converge to compare with
    /// throttling).
    #[arg(long)]
    pub smart_stop: bool,
    /// ferry: never throttle the guest (by default QEMU's auto-converge slows its vCPUs, only
    /// as far as needed, when it dirties memory faster than the link carries it).
    #[arg(long)]
    pub no_converge: bool,
    /// ferry, VMs with disks: how the guest's writes during the migration reach the
    /// destination: async (XvMotion: a write completes once in the source agent's bounded
    /// buffer), sync (once the destination applied it), cloudnet (async during the disk's bulk
    /// copy, sync from the memory phase on).
    #[arg(long, default_value = defaults().disk_mode.name())]
    pub disk_mode: String,
    /// ferry, VMs with disks: the source agent's disk transmit buffer, MiB (async mode's bound).
    #[arg(long, default_value_t = defaults().disk_buffer_mib)]
    pub disk_buffer_mib: u64,
    /// ferry, VMs with disks: on a return to a host that still holds the copy the VM left,
    /// do not use the dirty bitmaps that say what changed since; the destination reads and
    /// indexes its copy instead (for comparison).
    #[arg(long)]
    pub no_disk_bitmaps: bool,
    /// ferry, VMs with disks, async and cloudnet modes: have QEMU's mirror block the guest's
    /// writes from the start of the copy, not only once it is done (for comparison).
    #[arg(long)]
    pub no_disk_background_copy: bool,
    /// VMs with disks, background copy (or libvirt's with --copy-storage): pace the copy by
    /// the guest's disk IO; while the guest's operations run slower than before the copy, the
    /// copy slows down to this percentage of its unpaced rate at the least (5 to 100).
    #[arg(long)]
    pub disk_pacing_floor_pct: Option<u32>,
    /// Give up after this many seconds; the source keeps running.
    #[arg(long, default_value_t = defaults().timeout_s)]
    pub timeout_s: u64,
}

impl SettingsFlags {
    /// The settings these flags give, validated.
    pub fn settings(&self) -> Result<MigrationSettings> {
        let Some(disk_mode) = DiskMode::parse(&self.disk_mode) else {
            bail!(
                "unknown --disk-mode {:?} (known: async, sync, cloudnet)",
                self.disk_mode
            );
        };
        let s = MigrationSettings {
            connections: self.connections,
            downtime_ms: self.downtime_ms,
            converge: !self.no_converge,
            qemu_switchover_rule: self.qemu_switchover_rule,
            smart_stop: self.smart_stop,
            wan_timeout_s: self.wan_timeout_s,
            timeout_s: self.timeout_s,
            return_path: self.return_path,
            postcopy: self.postcopy,
            postcopy_at_throttle_pct: self.postcopy_at_throttle,
            codec: self.codec,
            seed_from: self.seed_from.clone(),
            disk_mode,
            disk_buffer_mib: self.disk_buffer_mib,
            disk_bitmaps: !self.no_disk_bitmaps,
            disk_background_copy: !self.no_disk_background_copy,
            disk_pacing_floor_pct: self.disk_pacing_floor_pct,
            test_corrupt_at: self.test_corrupt_at,
            test_corrupt_disk_at: self.test_corrupt_disk_at,
            test_disk_stall_ms: self.test_disk_stall_ms,
            test_shards: self.test_shards,
            test_cache_pause_bytes: self.test_cache_pause_bytes,
        };
        s.validate()?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        flags: SettingsFlags,
    }

    fn from_flags(args: &[&str]) -> Result<MigrationSettings> {
        let cli = Cli::try_parse_from(std::iter::once("ferry").chain(args.iter().copied()))?;
        cli.flags.settings()
    }

    #[test]
    fn no_flags_give_the_defaults() {
        assert_eq!(from_flags(&[]).unwrap(), MigrationSettings::default());
    }

    #[test]
    fn flags_and_json_give_equal_settings() {
        let flags = from_flags(&[
            "--connections",
            "4",
            "--downtime-ms",
            "150",
            "--no-converge",
            "--smart-stop",
            "--codec",
            "zero,delta",
            "--seed-from",
            "sib",
            "--disk-mode",
            "cloudnet",
            "--disk-buffer-mib",
            "32",
            "--wan-timeout-s",
            "30",
            "--timeout-s",
            "60",
            "--return-path",
        ])
        .unwrap();
        let json: MigrationSettings = serde_json::from_str(
            r#"{"connections":4,"downtime_limit_ms":150,"converge":false,"smart_stop":true,
                "codec":{"zero":true,"dedup":false,"delta":true,"zstd":false,"seed":false},
                "seed_from":"sib","disk_mode":"cloudnet","disk_buffer_mib":32,
                "wan_timeout_s":30,"timeout_s":60,"return_path":true}"#,
        )
        .unwrap();
        assert_eq!(flags, json);
    }

    #[test]
    fn bad_flags_are_named() {
        let err = |args: &[&str]| format!("{:#}", from_flags(args).unwrap_err());
        assert_eq!(
            err(&["--connections", "65"]),
            "connections 65 is out of range; use 1 to 64, or 0 for as many as the link needs"
        );
        assert_eq!(
            err(&["--disk-mode", "lazy"]),
            "unknown --disk-mode \"lazy\" (known: async, sync, cloudnet)"
        );
        assert!(err(&["--codec", "zip"]).contains("unknown codec technique \"zip\""));
    }
}
