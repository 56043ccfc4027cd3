//! The agent's local API (HTTP and JSON on a unix socket; see docs/agent-api.md).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use crate::settings::MigrationSettings;

/// `POST /v1/migrations`: migrate a running VM (given its QMP socket on this host) to the agent
/// named `to`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrationRequest {
    /// A name for logs and reports.
    pub vm: String,
    /// The running VM's QMP socket on this host.
    pub source_qmp: PathBuf,
    /// The destination agent: the name its certificate carries, listed in this agent's config
    /// (`[peers.NAME]`) with its address.
    pub to: String,
    /// What receives the VM at the destination.
    #[serde(default)]
    pub destination: Destination,
    /// The link's rate, if known: socket buffers and the send window are sized from it and the
    /// measured round trip. Default: the peer's `rate_mbit` in the agent's config.
    #[serde(default)]
    pub link_rate_mbit: Option<f64>,
    /// The VM's disks to move (QEMU block node names); the destination QEMU must have a node
    /// of the same name and size. Empty: memory only (shared storage, or no disks).
    #[serde(default)]
    pub disks: Vec<String>,
    /// How the migration runs (flattened: its fields are this object's).
    #[serde(flatten)]
    pub settings: MigrationSettings,
}

/// `POST /v1/libvirt/migrations`: migrate a libvirt domain of this host to the agent named
/// `to` by libvirt's own peer-to-peer migration, its connections carried by the agents.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LibvirtMigrationRequest {
    /// The domain's name in this host's libvirt.
    pub domain: String,
    /// The destination agent, as in [`MigrationRequest::to`]; its host's libvirt receives the
    /// domain.
    pub to: String,
    /// Copy the domain's disks to the destination (libvirt's `--copy-storage-all`; the
    /// destination needs the same storage paths, libvirt creates the images). Otherwise the
    /// disks are on storage both hosts share.
    #[serde(default)]
    pub copy_storage: bool,
    /// The link's rate, if known (QEMU's switchover bandwidth). Default: the peer's
    /// `rate_mbit` in the agent's config.
    #[serde(default)]
    pub link_rate_mbit: Option<f64>,
    /// QEMU's multifd channels: libvirt's `--parallel --parallel-connections N` (1 to 255).
    /// The agents carry each channel as its own stream, coded and digest-gated like the main
    /// one. Default: QEMU's single stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<u32>,
    /// How the migration runs (flattened). libvirt's path uses the downtime target, converge
    /// (auto-converge), the timeout and the disk mode (async, or sync: libvirt's synchronous
    /// writes); settings it cannot honour are refused.
    #[serde(flatten)]
    pub settings: MigrationSettings,
}

/// The QEMU that receives a migration at the destination.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Destination {
    /// The destination agent starts it from the source QEMU's own command line (read from the
    /// process serving `source_qmp`), paused, waiting for the stream, with a QMP socket of the
    /// agent's own.
    #[default]
    SourceConfig,
    /// The destination agent starts it from this command line (program first), adding its QMP
    /// socket, `-S` and `-incoming defer`.
    Argv(Vec<String>),
    /// Its owner started it at the destination (`-S -incoming defer`); its QMP socket there.
    Qmp(PathBuf),
}

/// How guest disk writes made during a migration are mirrored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DiskMode {
    /// XvMotion's asynchronous mirroring: a write completes once it is in the source agent's
    /// bounded buffer; the buffer drains over the WAN and pushes back when full.
    #[default]
    Async,
    /// Write-blocking: a write completes once the destination applied it (a WAN round trip).
    Sync,
    /// CloudNet's schedule: asynchronous during the bulk copy, synchronous from the memory
    /// phase on, so nothing is left to drain at the switchover.
    Cloudnet,
}

impl DiskMode {
    pub fn name(self) -> &'static str {
        match self {
            DiskMode::Async => "async",
            DiskMode::Sync => "sync",
            DiskMode::Cloudnet => "cloudnet",
        }
    }

    pub fn parse(s: &str) -> Option<DiskMode> {
        [DiskMode::Async, DiskMode::Sync, DiskMode::Cloudnet]
            .into_iter()
            .find(|m| m.name() == s)
    }
}

/// The codec's techniques, each on or off (for ablations; `ferry_codec::Options`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CodecSettings {
    /// Zero pages as a tag.
    pub zero: bool,
    /// CloudNet's redundancy elimination: 1 KiB blocks the other end already holds.
    pub dedup: bool,
    /// Deltas against the version of the page the other end holds.
    pub delta: bool,
    /// zstd over each batch, at a level chosen for the link and the CPU.
    pub zstd: bool,
    /// Seeding: the destination indexes an earlier image of the VM it holds (or a sibling's)
    /// and pages it already has go as references; the source keeps the departing VM's image
    /// for its return. Off when a request from before it omits it.
    #[serde(default)]
    pub seed: bool,
}

impl Default for CodecSettings {
    fn default() -> Self {
        CodecSettings::ALL
    }
}

impl CodecSettings {
    pub const ALL: CodecSettings = CodecSettings {
        zero: true,
        dedup: true,
        delta: true,
        zstd: true,
        seed: true,
    };
    pub const NONE: CodecSettings = CodecSettings {
        zero: false,
        dedup: false,
        delta: false,
        zstd: false,
        seed: false,
    };

    /// Whether the stream goes through the codec at all (else QEMU's bytes travel as they are).
    pub fn any(&self) -> bool {
        self.zero || self.dedup || self.delta || self.zstd || self.seed
    }
}

impl std::fmt::Display for CodecSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == CodecSettings::ALL {
            return f.write_str("all");
        }
        if *self == CodecSettings::NONE {
            return f.write_str("none");
        }
        let on: Vec<&str> = [
            (self.zero, "zero"),
            (self.dedup, "dedup"),
            (self.delta, "delta"),
            (self.zstd, "zstd"),
            (self.seed, "seed"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        f.write_str(&on.join(","))
    }
}

impl std::str::FromStr for CodecSettings {
    type Err = String;

    /// `all`, `none`, or a comma-separated list of `zero`, `dedup`, `delta`, `zstd`, `seed`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all" => return Ok(CodecSettings::ALL),
            "none" => return Ok(CodecSettings::NONE),
            _ => {}
        }
        let mut c = CodecSettings::NONE;
        for part in s.split(',').map(str::trim) {
            match part {
                "zero" => c.zero = true,
                "dedup" => c.dedup = true,
                "delta" => c.delta = true,
                "zstd" => c.zstd = true,
                "seed" => c.seed = true,
                other => {
                    return Err(format!(
                        "unknown codec technique {other:?}: use all, none, or a list of zero, dedup, delta, zstd, seed"
                    ))
                }
            }
        }
        Ok(c)
    }
}

/// What the codec did with the stream (source side).
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CodecReport {
    /// The techniques that ran.
    pub settings: String,
    /// QEMU's bytes that went in.
    pub bytes_in: u64,
    /// Batches as sent (after zstd), before the transport's framing.
    pub bytes_out: u64,
    /// RAM pages (QEMU's whole-page records) and how each went.
    pub pages: u64,
    pub raw: u64,
    pub zero: u64,
    pub unchanged: u64,
    pub delta: u64,
    pub blocks: u64,
    /// 1 KiB blocks sent as references to the other end's cache.
    pub block_hits: u64,
    /// Pages sent as references to the destination's seed image.
    #[serde(default)]
    pub seeded: u64,
    /// The seed the destination offered: the image's name, its distinct non-zero pages, and
    /// the index's size on the WAN (none: it held no image).
    #[serde(default)]
    pub seed: Option<SeedReport>,
    /// Bytes on the wire per QEMU byte for pages sent again with new content, over recent
    /// batches: what the last pass's pages cost, which the switchover plans with (none: too
    /// few resent yet).
    #[serde(default)]
    pub resend_cost: Option<f64>,
    /// The zstd level of the latest batch (none: stored).
    pub zstd_level: Option<i32>,
    /// Per zstd level used: batches, bytes in and out, seconds spent compressing.
    #[serde(default)]
    pub zstd_levels: Vec<ZstdLevelReport>,
    /// The shards the stream channel was coded in (0: not sharded, as on libvirt's tunnels),
    /// and the threads of their own they ran on (0: the agent's stream task).
    #[serde(default)]
    pub shards: u32,
    #[serde(default)]
    pub threads: u32,
    /// Bytes of the order units that say how the shards' outputs make up QEMU's stream
    /// (counted in `bytes_out`): what sharding costs.
    #[serde(default)]
    pub order_bytes: u64,
    /// Batches coded with the block cache paused, because the agent's CPU, not the link, held
    /// the stream back (the dedup governor), and the time it was paused.
    #[serde(default)]
    pub cache_paused_batches: u64,
    #[serde(default)]
    pub cache_paused_ms: u64,
}

/// The destination's seed image, as offered to the source.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SeedReport {
    /// The VM whose earlier image it is.
    pub image: String,
    pub pages: u64,
    pub index_bytes: u64,
    /// How long the destination took to read and index it.
    pub index_ms: u64,
}

/// What one zstd level did over a migration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ZstdLevelReport {
    pub level: i32,
    pub batches: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub seconds: f64,
    /// The share of bytes this level saved over the fastest level, last measured on one batch
    /// compressed at both (absent for the fastest level).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gain: Option<f64>,
}

/// Where a migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationState {
    Running,
    /// The destination runs; the source was quit.
    Committed,
    /// It did not happen; the source runs.
    Failed,
}

/// Where a migration is, step by step (the source agent's view).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Accepted; nothing touched yet.
    #[default]
    Starting,
    /// Opening the session to the destination agent.
    Connecting,
    /// The destination prepares its QEMU (started, or adopted) and its disks.
    PreparingDestination,
    /// The destination's seed index crosses.
    SeedIndex,
    /// QEMU's mirrors copy the disks' bulk.
    DiskCopy,
    /// QEMU's memory passes.
    Memory,
    /// The VM is paused at the source; the disks' mirrors complete, the stream's last bytes go.
    Switchover,
    /// Postcopy: the VM runs at the destination (the commit point has passed); the pages
    /// still at the source follow.
    Postcopy,
    /// The stream's end went out; the destination decides (the source stays paused).
    AwaitingCommit,
    /// A group member: the destination QEMU loaded the whole verified stream; its word back
    /// waits at the source until the controller releases the group (the source stays paused).
    Held,
    /// The source is paused and no verdict has come within the WAN timeout: the destination
    /// may run. Nobody resumes the source until the verdict is known.
    InDoubt,
    /// The destination runs; the source was quit.
    Committed,
    /// It did not happen; the source runs.
    Failed,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Starting => "starting",
            Phase::Connecting => "connecting",
            Phase::PreparingDestination => "preparing the destination",
            Phase::SeedIndex => "seed index",
            Phase::DiskCopy => "disk copy",
            Phase::Memory => "memory",
            Phase::Switchover => "switchover",
            Phase::Postcopy => "postcopy",
            Phase::AwaitingCommit => "awaiting the commit",
            Phase::Held => "held for its group",
            Phase::InDoubt => "in doubt",
            Phase::Committed => "committed",
            Phase::Failed => "failed",
        }
    }
}

/// The destination's side of the switchover, wall clock (µs since the epoch).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DestinationSwitchover {
    /// The stream's last byte had arrived and was decoded.
    pub arrived_unix_us: i64,
    /// QEMU had read the whole stream from the destination agent (and the digests matched).
    #[serde(default)]
    pub fed_unix_us: i64,
    /// The destination QEMU reported the stream loaded (`completed`).
    pub loaded_unix_us: i64,
    /// QEMU's zero-page records the destination agent left out: the page was zero there
    /// already (a hole of its memory file, or cleared earlier in the migration).
    #[serde(default)]
    pub zero_pages_skipped: u64,
}

/// `GET /v1/migrations/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MigrationStatus {
    pub id: String,
    pub vm: String,
    /// The fleet controller's id for it, when the controller asked for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet_id: Option<String>,
    pub state: MigrationState,
    /// Where it is.
    pub phase: Phase,
    /// What it is doing now, in words.
    #[serde(default)]
    pub detail: String,
    pub error: Option<String>,
    pub started_unix_ms: u64,
    /// Stream bytes read from the source QEMU.
    pub stream_bytes: u64,
    /// Bytes of QEMU's return path carried back to the source QEMU.
    #[serde(default)]
    pub return_path_bytes: u64,
    /// Postcopy: bytes of QEMU's preempt channel carried (the pages the destination faulted
    /// on, sent ahead of the stream).
    #[serde(default)]
    pub preempt_bytes: u64,
    pub wire: WireStats,
    pub qemu: QemuProgress,
    pub events: Vec<AgentEvent>,
    /// QMP timestamps (wall clock, µs) of the source's STOP and the destination's RESUME.
    pub source_stop_unix_us: Option<i64>,
    pub destination_resume_unix_us: Option<i64>,
    /// Postcopy: when the VM's last page had arrived at the destination (wall clock, µs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy_done_unix_us: Option<i64>,
    /// Postcopy: how long every vCPU at once waited for a page, ms (the destination QEMU's
    /// `postcopy-blocktime`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postcopy_blocktime_ms: Option<u64>,
    /// The destination's side of the switchover (wall clock, µs): when the stream's last byte
    /// had arrived and its digest matched, and when its QEMU said it loaded the stream.
    #[serde(default)]
    pub destination_switchover: Option<DestinationSwitchover>,
    /// QEMU's own downtime figure.
    pub qemu_downtime_ms: Option<u64>,
    /// The highest vCPU throttle auto-converge applied, percent (none: never throttled).
    #[serde(default)]
    pub max_cpu_throttle_pct: Option<u64>,
    /// The guest's vCPU time the throttle took, seconds per vCPU (the throttle's percent
    /// summed over time): the slowdown convergence cost the guest.
    #[serde(default)]
    pub throttle_vcpu_s: f64,
    /// The downtime-limit the agent last gave QEMU.
    #[serde(default)]
    pub qemu_downtime_limit_ms: Option<u64>,
    /// WAN round trips the switchover waited for between the source's STOP and the
    /// destination's RESUME.
    pub switchover_round_trips: Option<f64>,
    /// What the codec did (none when it was off).
    #[serde(default)]
    pub codec: Option<CodecReport>,
    /// SHA-256 of the stream, as both ends computed it.
    pub digest: Option<String>,
    /// With disks: what the disk path did.
    #[serde(default)]
    pub disk: Option<DiskReport>,
    /// QEMU's multifd channels beside the main stream (libvirt's `--parallel`), each coded
    /// and digest-gated on its own, as each ended.
    #[serde(default)]
    pub multifd: Vec<MultifdChannelReport>,
}

/// One of QEMU's multifd channels through ferry (source side).
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MultifdChannelReport {
    /// The channel's number, from its first packet.
    pub id: u8,
    /// Bytes read from the source QEMU on it.
    pub stream_bytes: u64,
    /// Bytes its session put on the WAN.
    pub wire_bytes: u64,
    /// SHA-256 of the channel's bytes, as both ends computed it.
    pub digest: String,
    pub codec: CodecReport,
}

impl MigrationStatus {
    /// A migration of `vm` that has just begun: running, nothing measured yet.
    pub fn starting(id: String, vm: String, started_unix_ms: u64) -> MigrationStatus {
        MigrationStatus {
            id,
            vm,
            fleet_id: None,
            state: MigrationState::Running,
            phase: Phase::Starting,
            detail: String::new(),
            error: None,
            started_unix_ms,
            stream_bytes: 0,
            return_path_bytes: 0,
            preempt_bytes: 0,
            wire: WireStats::default(),
            qemu: QemuProgress::default(),
            events: Vec::new(),
            source_stop_unix_us: None,
            destination_resume_unix_us: None,
            postcopy_done_unix_us: None,
            postcopy_blocktime_ms: None,
            destination_switchover: None,
            qemu_downtime_ms: None,
            max_cpu_throttle_pct: None,
            throttle_vcpu_s: 0.0,
            qemu_downtime_limit_ms: None,
            switchover_round_trips: None,
            codec: None,
            digest: None,
            disk: None,
            multifd: Vec::new(),
        }
    }
}

/// What the disk path did (source side).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DiskReport {
    pub mode: DiskMode,
    pub disks: u32,
    /// Disks whose backing image the destination already held: only their overlay was copied.
    #[serde(default)]
    pub overlay_only: u32,
    /// Disk images the destination made for the migration (it had none at their paths).
    #[serde(default)]
    pub images_made: u32,
    /// Backing layers the destination lacked (SnapMig), sent whole before the disks' copy,
    /// and their bytes (before zstd).
    #[serde(default)]
    pub layers_shipped: u32,
    #[serde(default)]
    pub layer_bytes: u64,
    /// How QEMU's mirror copied the disks: `background` (no guest write waited for the bulk
    /// copy; write-blocking once it was done) or `write-blocking` (from the start).
    #[serde(default)]
    pub copy: Option<String>,
    /// Data bytes QEMU's mirror wrote into the transmit buffer (bulk copy and guest writes).
    pub written_bytes: u64,
    /// Data bytes replaced by a later write to the same place before they were sent.
    pub coalesced_bytes: u64,
    /// Zero and trim ranges sent as ranges, bytes they cover.
    pub zero_bytes: u64,
    /// Bytes the destination already held (an older copy of the disk), sent as references.
    #[serde(default)]
    pub same_bytes: u64,
    /// How the source knew what an older copy at the destination holds: `index` (the
    /// destination read and indexed it), `bitmap` (untouched since the VM left it; the
    /// source's dirty bitmaps said what changed) or `remembered` (libvirt's path: untouched
    /// since the domain left it; the index kept then stood for it). None: no older copy there.
    #[serde(default)]
    pub older_copy: Option<String>,
    /// Why an older copy was indexed rather than matched by bitmap or a kept index.
    #[serde(default)]
    pub older_copy_note: Option<String>,
    /// How long the destination took to index its older copy.
    #[serde(default)]
    pub index_ms: Option<u64>,
    /// A background copy paced by the guest's IO: how long it ran below its unpaced rate
    /// (0: never needed). None: not paced.
    #[serde(default)]
    pub paced_ms: Option<u64>,
    /// Bytes of disk frames handed to the WAN (after the codec and zstd).
    pub frame_bytes: u64,
    /// Snapshots sent.
    pub snapshots: u64,
    /// Bytes in the transmit buffer now.
    pub held_bytes: u64,
    /// What each zstd level did to the frames.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub zstd_levels: Vec<ZstdLevelReport>,
}

/// The transport's counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WireStats {
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub connections_live: u32,
    /// Connections the session keeps (decided by its first; 0 before it connected).
    #[serde(default)]
    pub connections: u32,
    /// Why that many, when the agent chose.
    #[serde(default)]
    pub connections_why: Option<String>,
    pub reconnects: u32,
    pub replayed_frames: u64,
    pub unacked_bytes: u64,
    pub rtt_ms: Option<f64>,
    /// Why the last connection attempt failed (a refused certificate, a dead peer).
    #[serde(default)]
    pub last_dial_error: Option<String>,
}

/// QEMU's view (query-migrate on the source).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct QemuProgress {
    pub status: String,
    pub transferred: u64,
    pub remaining: u64,
    pub total: u64,
    pub iteration: u64,
    /// The pause QEMU expects of a stop (its `expected-downtime`: the pages dirty at its last
    /// sync over the rate it sends at; absent until QEMU has measured one).
    #[serde(default)]
    pub expected_downtime_ms: Option<u64>,
}

/// Something that happened, with the wall-clock time it happened.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
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

/// Every error the API returns: `{"error": "...", "kind": "..."}` with the kind's status.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApiError {
    pub error: String,
    /// Absent from agents before it: the client then goes by the HTTP status.
    #[serde(default)]
    pub kind: Option<ErrorKind>,
}

/// What kind of refusal an API error is. Its HTTP status is decided here, once; the CLI
/// decides its exit code from it, once (`ferry` main).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// The request itself is wrong (a bound, an unknown peer, a malformed body): 400.
    BadRequest,
    /// It names something the agent does not have: 404.
    NotFound,
    /// It cannot happen in the state things are in (already migrating, too late): 409.
    Conflict,
    /// The agent is at a limit; the same request may succeed later: 503.
    Busy,
    /// Something the agent needs on its host is not answering (libvirt): 503.
    Unavailable,
    /// The agent failed: 500.
    Internal,
}

impl ErrorKind {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::BadRequest => 400,
            ErrorKind::NotFound => 404,
            ErrorKind::Conflict => 409,
            ErrorKind::Busy | ErrorKind::Unavailable => 503,
            ErrorKind::Internal => 500,
        }
    }

    /// The kind an older agent's bare status meant.
    pub fn from_http_status(status: u16) -> ErrorKind {
        [
            ErrorKind::BadRequest,
            ErrorKind::NotFound,
            ErrorKind::Conflict,
            ErrorKind::Busy,
        ]
        .into_iter()
        .find(|k| k.http_status() == status)
        .unwrap_or(if (400..500).contains(&status) {
            ErrorKind::BadRequest
        } else {
            ErrorKind::Internal
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_settings_parse_and_print_the_same_names() {
        for text in [
            "all",
            "none",
            "zero",
            "dedup,delta",
            "zero,dedup,delta",
            "zstd,seed",
        ] {
            let c: CodecSettings = text.parse().unwrap();
            assert_eq!(c.to_string(), text);
        }
        assert_eq!(
            "zero,dedup,delta,zstd,seed"
                .parse::<CodecSettings>()
                .unwrap(),
            CodecSettings::ALL
        );
        assert!(!CodecSettings::NONE.any());
        let err = "zero,zip".parse::<CodecSettings>().unwrap_err();
        assert!(err.contains("\"zip\""), "{err}");
    }

    #[test]
    fn an_old_request_gets_the_defaults() {
        let req: MigrationRequest =
            serde_json::from_str(r#"{"vm":"v","source_qmp":"/q","to":"b"}"#).unwrap();
        assert_eq!(req.settings, MigrationSettings::default());
        assert_eq!(req.destination, Destination::SourceConfig);
        let adopt: MigrationRequest = serde_json::from_str(
            r#"{"vm":"v","source_qmp":"/q","to":"b","destination":{"qmp":"/d"},"connections":2}"#,
        )
        .unwrap();
        assert_eq!(adopt.destination, Destination::Qmp("/d".into()));
        assert_eq!(adopt.settings.connections, 2);
    }
}

/// `PUT /v1/vms/{domain}/swap`: lend the libvirt domain swap space on a peer's spare memory
/// (Overdriver's cooperative swap): the peer serves `bytes` of its RAM as an NBD export, the
/// domain gets it hot-plugged as a swap disk, and its balloon leaves it `memory_bytes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapRequest {
    /// The agent whose memory holds the swap (one of this agent's peers, `[host] lend_mib`
    /// in its config).
    pub peer: String,
    /// The swap disk's size.
    pub bytes: u64,
    /// What the balloon leaves the guest while it swaps.
    pub memory_bytes: u64,
}

/// A domain's swap on a peer, as `GET /v1/swap` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapStatus {
    pub domain: String,
    pub peer: String,
    pub bytes: u64,
    /// What the balloon leaves the guest.
    pub memory_bytes: u64,
    /// The guest's memory before, which it gets back with the swap.
    pub memory_before_bytes: u64,
    /// The swap disk's target in the domain (`vdX`).
    pub target: String,
}
