//! What one migration did, as the CLI shows it while it runs ([`Progress`]) and after
//! ([`MigrationOutcome`]), whichever system moved the VM.

use serde::{Deserialize, Serialize};

/// One progress sample.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Progress {
    pub phase: String,
    pub elapsed_ms: u64,
    /// Bytes on the WAN since the migration started (the WAN emulator's counter in the lab,
    /// the agent's transport counters elsewhere).
    pub wan_bytes: u64,
    /// WAN rate over the last sample, Mbit/s.
    pub wan_mbit: f64,
    pub ram_total: u64,
    pub ram_transferred: u64,
    pub ram_remaining: u64,
    pub iteration: u64,
    pub eta_s: Option<f64>,
}

/// What a migration did, measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MigrationOutcome {
    pub completed: bool,
    pub total_ms: u64,
    pub downtime_ms: Option<f64>,
    pub qemu_downtime_ms: Option<u64>,
    pub guest_gap_ms: Option<f64>,
    pub wan_bytes: u64,
    /// Frames the WAN emulator dropped during the migration (random loss and a full queue).
    pub wan_drops: u64,
    pub iterations: u64,
    pub ram_transferred: u64,
    /// Postcopy: how long the VM ran at the destination before its last page arrived (the
    /// total time includes it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy_ms: Option<u64>,
    /// Postcopy: how long every vCPU at once waited for pages not there yet, ms (QEMU's
    /// `postcopy-blocktime` at the destination).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy_blocktime_ms: Option<u64>,
    /// Postcopy: bytes of QEMU's preempt channel the agents carried (the pages the guest
    /// faulted on at the destination, sent ahead of the rest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempt_bytes: Option<u64>,
    pub error: Option<String>,
    /// ferry: the highest vCPU throttle auto-converge applied, percent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_pct: Option<u64>,
    /// ferry: the guest's vCPU time the throttle took, seconds per vCPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throttle_vcpu_s: Option<f64>,
    /// ferry: the TCP connections the migration kept across the WAN, and why that many when
    /// the agent chose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections_why: Option<String>,
    /// ferry: what the codec did with QEMU's stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub codec: Option<crate::agent::CodecReport>,
    /// ferry, with disks: what the disk path did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<crate::agent::DiskReport>,
}
