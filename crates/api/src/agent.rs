//! The agent's local API (HTTP and JSON on a unix socket; see docs/agent-api.md).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `POST /v1/migrations`: migrate a running VM (given its QMP socket) to the agent at `peer`,
/// where a destination QEMU waits paused with `-incoming defer` (given its QMP socket there).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrationRequest {
    /// A name for logs and reports.
    pub vm: String,
    pub source_qmp: PathBuf,
    /// The peer agent's address (`host:port`) and the name its certificate carries.
    pub peer: String,
    pub peer_name: String,
    /// The destination QEMU's QMP socket, as a path on the peer's host.
    pub destination_qmp: PathBuf,
    /// TCP connections across the WAN.
    #[serde(default = "default_connections")]
    pub connections: u32,
    /// QEMU's downtime-limit.
    #[serde(default = "default_downtime")]
    pub downtime_limit_ms: u64,
    /// How long the WAN may be down before the migration fails (the source keeps running).
    #[serde(default = "default_wan_timeout")]
    pub wan_timeout_s: u64,
    /// The whole migration's deadline.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// The link's rate, if known: socket buffers and the send window are sized from it and the
    /// measured round trip.
    #[serde(default)]
    pub link_rate_mbit: Option<f64>,
    /// QEMU's return path on: the destination QEMU answers on it (it confirms it loaded the
    /// stream before the source QEMU calls the migration complete), and the agents carry it
    /// back. Off by default: plain precopy does not need it, and the confirmation adds a round
    /// trip to the downtime.
    #[serde(default)]
    pub return_path: bool,
    /// Test hook: flip one bit of the stream at this byte offset after the source hashed it,
    /// so the destination's digest differs.
    #[serde(default)]
    pub test_corrupt_at: Option<u64>,
}

/// One: on the lab's 100 Mbit/s, 50 ms link one connection matched QEMU's own throughput
/// with the least overhead, and more connections made the stream wait on the slowest one
/// (BENCHMARKS.md, "How many connections").
pub fn default_connections() -> u32 {
    1
}
fn default_downtime() -> u64 {
    300
}
fn default_wan_timeout() -> u64 {
    120
}
fn default_timeout() -> u64 {
    900
}

/// Where a migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationState {
    Running,
    /// The destination runs; the source was quit.
    Committed,
    /// It did not happen; the source runs.
    Failed,
}

/// `GET /v1/migrations/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrationStatus {
    pub id: String,
    pub vm: String,
    pub state: MigrationState,
    /// What it is doing now, in words.
    pub phase: String,
    pub error: Option<String>,
    pub started_unix_ms: u64,
    /// Stream bytes read from the source QEMU.
    pub stream_bytes: u64,
    /// Bytes of QEMU's return path carried back to the source QEMU.
    #[serde(default)]
    pub return_path_bytes: u64,
    pub wire: WireStats,
    pub qemu: QemuProgress,
    pub events: Vec<AgentEvent>,
    /// QMP timestamps (wall clock, µs) of the source's STOP and the destination's RESUME.
    pub source_stop_unix_us: Option<i64>,
    pub destination_resume_unix_us: Option<i64>,
    /// QEMU's own downtime figure.
    pub qemu_downtime_ms: Option<u64>,
    /// WAN round trips the switchover waited for between the source's STOP and the
    /// destination's RESUME.
    pub switchover_round_trips: Option<f64>,
    /// SHA-256 of the stream, as both ends computed it.
    pub digest: Option<String>,
}

/// The transport's counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WireStats {
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub connections_live: u32,
    pub reconnects: u32,
    pub replayed_frames: u64,
    pub unacked_bytes: u64,
    pub rtt_ms: Option<f64>,
    /// Why the last connection attempt failed (a refused certificate, a dead peer).
    #[serde(default)]
    pub last_dial_error: Option<String>,
}

/// QEMU's view (query-migrate on the source).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct QemuProgress {
    pub status: String,
    pub transferred: u64,
    pub remaining: u64,
    pub total: u64,
    pub iteration: u64,
}

/// Something that happened, with the wall-clock time it happened.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentEvent {
    pub unix_ms: u64,
    pub kind: crate::EventKind,
    pub detail: String,
}

/// `GET /v1/health`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Health {
    pub name: String,
    pub version: String,
    pub peer_listen: String,
}

/// Every error the API returns: `{"error": "..."}` with a 4xx or 5xx status.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiError {
    pub error: String,
}
