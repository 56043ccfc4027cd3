//! The QMP commands ferry uses, as types (QEMU's `qapi/*.json` is the reference).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::qmp::Command;

macro_rules! command {
    ($ty:ident, $name:literal, $ret:ty) => {
        impl Command for $ty {
            const NAME: &'static str = $name;
            type Returns = $ret;
        }
    };
}

/// `query-status`.
#[derive(Debug, Serialize)]
pub struct QueryStatus;
/// The VM's run state.
#[derive(Debug, Deserialize)]
pub struct StatusInfo {
    pub running: bool,
    pub status: String,
}
command!(QueryStatus, "query-status", StatusInfo);

/// `cont`: resume a paused VM.
#[derive(Debug, Serialize)]
pub struct Cont;
command!(Cont, "cont", Value);

/// `stop`: pause the VM.
#[derive(Debug, Serialize)]
pub struct Stop;
command!(Stop, "stop", Value);

/// `quit`: end QEMU.
#[derive(Debug, Serialize)]
pub struct Quit;
command!(Quit, "quit", Value);

/// One entry of `migrate-set-capabilities`.
#[derive(Debug, Clone, Serialize)]
pub struct Capability {
    pub capability: String,
    pub state: bool,
}

/// `migrate-set-capabilities`.
#[derive(Debug, Serialize)]
pub struct MigrateSetCapabilities {
    pub capabilities: Vec<Capability>,
}
command!(MigrateSetCapabilities, "migrate-set-capabilities", Value);

/// `migrate-set-parameters`: only the fields set are sent.
#[derive(Debug, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct MigrateSetParameters {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downtime_limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bandwidth: Option<u64>,
    /// Bytes per second QEMU assumes for its last bytes when it decides the switchover
    /// (0: the rate it measured in the last 100 ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub avail_switchover_bandwidth: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multifd_channels: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multifd_compression: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xbzrle_cache_size: Option<u64>,
    /// auto-converge: the first throttle, percent of vCPU time taken.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_initial: Option<u8>,
    /// auto-converge: each further step, percent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_increment: Option<u8>,
    /// auto-converge: after the first step, raise the throttle only as far as the dirty rate
    /// over the link rate requires, instead of by whole increments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_throttle_tailslow: Option<bool>,
}
command!(MigrateSetParameters, "migrate-set-parameters", Value);

/// `migrate` to a URI.
#[derive(Debug, Serialize)]
pub struct Migrate {
    pub uri: String,
}
command!(Migrate, "migrate", Value);

/// `migrate-incoming` on a destination started with `-incoming defer`.
#[derive(Debug, Serialize)]
pub struct MigrateIncoming {
    pub uri: String,
}
command!(MigrateIncoming, "migrate-incoming", Value);

/// `migrate resume=true`: a source whose postcopy migration is `postcopy-paused` goes on on a
/// new connection to `uri` (QEMU's postcopy recovery).
#[derive(Debug, Serialize)]
pub struct MigrateResume {
    pub uri: String,
    pub resume: bool,
}
command!(MigrateResume, "migrate", Value);

/// `migrate-recover`: a destination whose postcopy migration is `postcopy-paused` listens on
/// `uri` for the source's resumed stream.
#[derive(Debug, Serialize)]
pub struct MigrateRecover {
    pub uri: String,
}
command!(MigrateRecover, "migrate-recover", Value);

/// `migrate-pause`: a postcopy migration whose connection has not failed (yet) pauses as if it
/// had, so that it can be recovered on a new one.
#[derive(Debug, Serialize)]
pub struct MigratePause;
command!(MigratePause, "migrate-pause", Value);

/// `migrate_cancel`.
#[derive(Debug, Serialize)]
pub struct MigrateCancel;
command!(MigrateCancel, "migrate_cancel", Value);

/// `migrate-start-postcopy`: switch at QEMU's next iteration (postcopy-ram on at both ends).
#[derive(Debug, Serialize)]
pub struct MigrateStartPostcopy;
command!(MigrateStartPostcopy, "migrate-start-postcopy", Value);

/// `migrate-continue` from a paused state such as `pre-switchover`.
#[derive(Debug, Serialize)]
pub struct MigrateContinue {
    pub state: String,
}
command!(MigrateContinue, "migrate-continue", Value);

/// `query-migrate`.
#[derive(Debug, Serialize)]
pub struct QueryMigrate;

/// Migration progress as QEMU reports it. Fields QEMU omits in a state stay `None`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct MigrationInfo {
    pub status: Option<String>,
    pub ram: Option<RamStats>,
    #[serde(rename = "total-time")]
    pub total_time: Option<u64>,
    pub downtime: Option<u64>,
    #[serde(rename = "expected-downtime")]
    pub expected_downtime: Option<u64>,
    #[serde(rename = "error-desc")]
    pub error_desc: Option<String>,
    #[serde(rename = "xbzrle-cache")]
    pub xbzrle_cache: Option<Value>,
    /// auto-converge's current throttle, percent (present while it throttles).
    #[serde(rename = "cpu-throttle-percentage", default)]
    pub cpu_throttle_percentage: Option<u64>,
    /// A postcopy destination with `postcopy-blocktime` on: how long, in ms, every vCPU at
    /// once waited for pages the source had not sent yet.
    #[serde(rename = "postcopy-blocktime", default)]
    pub postcopy_blocktime: Option<u64>,
}

/// `query-migrate`'s `ram` section.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct RamStats {
    pub transferred: u64,
    pub remaining: u64,
    pub total: u64,
    #[serde(default)]
    pub duplicate: u64,
    #[serde(default)]
    pub normal: u64,
    #[serde(default)]
    pub mbps: f64,
    #[serde(default)]
    pub dirty_sync_count: u64,
    #[serde(default)]
    pub dirty_pages_rate: u64,
}
command!(QueryMigrate, "query-migrate", MigrationInfo);

/// `nbd-server-start` (QEMU 10 takes the legacy SocketAddress form).
#[derive(Debug, Serialize)]
pub struct NbdServerStart {
    pub addr: Value,
}
command!(NbdServerStart, "nbd-server-start", Value);

impl NbdServerStart {
    /// Listen on TCP `host:port`.
    pub fn inet(host: &str, port: u16) -> Self {
        NbdServerStart {
            addr: serde_json::json!({"type": "inet", "data": {"host": host, "port": port.to_string()}}),
        }
    }

    /// Listen on a unix socket.
    pub fn unix(path: &std::path::Path) -> Self {
        NbdServerStart {
            addr: serde_json::json!({"type": "unix", "data": {"path": path}}),
        }
    }
}

/// `nbd-server-stop`.
#[derive(Debug, Serialize)]
pub struct NbdServerStop;
command!(NbdServerStop, "nbd-server-stop", Value);

/// `block-export-add` of an NBD export.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockExportAdd {
    #[serde(rename = "type")]
    pub kind: String,
    pub id: String,
    pub node_name: String,
    pub writable: bool,
    pub name: String,
    /// Dirty bitmaps offered with the export (`{"node": .., "name": ..}`), each as the
    /// metadata context `qemu:dirty-bitmap:NAME`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bitmaps: Vec<Value>,
}
command!(BlockExportAdd, "block-export-add", Value);

/// `block-export-del`, `hard`: connections are dropped (`safe` fails while there are any).
#[derive(Debug, Serialize)]
pub struct BlockExportDel {
    pub id: String,
    pub mode: &'static str,
}

impl BlockExportDel {
    pub fn hard(id: String) -> Self {
        BlockExportDel { id, mode: "hard" }
    }
}
command!(BlockExportDel, "block-export-del", Value);

/// `block-dirty-bitmap-add`: a bitmap on `node` that records every write from now on;
/// a persistent one is kept in the qcow2 image when QEMU closes it.
#[derive(Debug, Serialize)]
pub struct BlockDirtyBitmapAdd {
    pub node: String,
    pub name: String,
    pub persistent: bool,
    /// Bytes per bit (a power of two; QEMU's default is the image's cluster size).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub granularity: Option<u64>,
}
command!(BlockDirtyBitmapAdd, "block-dirty-bitmap-add", Value);

/// `block-dirty-bitmap-remove` (from the image too, when persistent).
#[derive(Debug, Serialize)]
pub struct BlockDirtyBitmapRemove {
    pub node: String,
    pub name: String,
}
command!(BlockDirtyBitmapRemove, "block-dirty-bitmap-remove", Value);

/// `blockdev-add` with free-form options (the driver decides which fields exist).
#[derive(Debug, Serialize)]
#[serde(transparent)]
pub struct BlockdevAdd(pub Value);
command!(BlockdevAdd, "blockdev-add", Value);

/// `blockdev-mirror`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockdevMirror {
    pub job_id: String,
    pub device: String,
    pub target: String,
    pub sync: String,
    /// `background` (QEMU's default) or `write-blocking` (every guest write is also written
    /// to the target before the guest sees it complete).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy_mode: Option<String>,
    /// The bytes one bit of the mirror's dirty bitmap stands for (a power of two, 512 B to
    /// 64 MiB; QEMU's default is the image's cluster size, or 64 KiB).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub granularity: Option<u64>,
}
command!(BlockdevMirror, "blockdev-mirror", Value);

/// `block-job-change` of a mirror (QEMU 8.2+): only background to write-blocking exists.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockJobChangeCopyMode {
    pub id: String,
    /// Always `mirror`: the union's tag.
    #[serde(rename = "type")]
    pub job_type: &'static str,
    pub copy_mode: String,
}
command!(BlockJobChangeCopyMode, "block-job-change", Value);

/// `block-job-set-speed`: a job's rate limit, bytes per second (0: none).
#[derive(Debug, Serialize)]
pub struct BlockJobSetSpeed {
    pub device: String,
    pub speed: u64,
}
command!(BlockJobSetSpeed, "block-job-set-speed", Value);

/// `query-blockstats`: the block layer's accounting of each block backend.
#[derive(Debug, Serialize)]
pub struct QueryBlockstats;
command!(QueryBlockstats, "query-blockstats", Vec<BlockStats>);

#[derive(Debug, Clone, Deserialize)]
pub struct BlockStats {
    /// The guest device the backend is attached to (absent for QEMU's own backends).
    #[serde(default)]
    pub qdev: Option<String>,
    pub stats: BlockDeviceStats,
}

/// Counters since the backend was created.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct BlockDeviceStats {
    pub rd_operations: u64,
    pub wr_operations: u64,
    pub flush_operations: u64,
    pub rd_total_time_ns: u64,
    pub wr_total_time_ns: u64,
    pub flush_total_time_ns: u64,
}

/// `query-commands`: the QMP commands this QEMU knows.
#[derive(Debug, Serialize)]
pub struct QueryCommands;
command!(QueryCommands, "query-commands", Vec<CommandInfo>);

#[derive(Debug, Clone, Deserialize)]
pub struct CommandInfo {
    pub name: String,
}

/// `block-job-cancel`: for a ready mirror this completes it without pivoting; with `force`
/// it abandons the job at once.
#[derive(Debug, Serialize)]
pub struct BlockJobCancel {
    pub device: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}
command!(BlockJobCancel, "block-job-cancel", Value);

/// `query-block-jobs`: the block jobs that exist now.
#[derive(Debug, Serialize)]
pub struct QueryBlockJobs;
command!(QueryBlockJobs, "query-block-jobs", Vec<BlockJobInfo>);

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockJobInfo {
    /// The job's id (`device` for historical reasons).
    pub device: String,
    /// Progress: `offset` of `len` bytes done; a mirror's `len` grows as the guest dirties
    /// what was copied, so `len - offset` is what is left now.
    #[serde(default)]
    pub len: u64,
    #[serde(default)]
    pub offset: u64,
    #[serde(default)]
    pub ready: bool,
    /// A write-blocking mirror whose target holds everything: each guest write now reaches
    /// the target before it completes (mirror jobs, QEMU 8.2+).
    #[serde(default)]
    pub actively_synced: bool,
}

/// `blockdev-del`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockdevDel {
    pub node_name: String,
}
command!(BlockdevDel, "blockdev-del", Value);

/// `query-named-block-nodes` (flat: only the nodes themselves).
#[derive(Debug, Serialize)]
pub struct QueryNamedBlockNodes {
    pub flat: bool,
}
command!(
    QueryNamedBlockNodes,
    "query-named-block-nodes",
    Vec<BlockNode>
);

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockNode {
    #[serde(default)]
    pub node_name: String,
    pub image: BlockImage,
    /// The node's dirty bitmaps (a persistent one is listed once the image is active).
    #[serde(default)]
    pub dirty_bitmaps: Vec<DirtyBitmap>,
}

/// One dirty bitmap, as QEMU reports it.
#[derive(Debug, Clone, Deserialize)]
pub struct DirtyBitmap {
    pub name: String,
    /// Bytes marked dirty.
    pub count: u64,
    pub granularity: u64,
    /// Whether writes are being recorded (false: disabled).
    pub recording: bool,
    /// In use by an operation (an export, a job), which may not change it.
    pub busy: bool,
    #[serde(default)]
    pub persistent: bool,
    /// Found marked in use when the image was opened: QEMU did not close it cleanly, so
    /// writes may be missing from it.
    #[serde(default)]
    pub inconsistent: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct BlockImage {
    pub virtual_size: u64,
    /// The image's format (`qcow2`, `raw`, ...).
    #[serde(default)]
    pub format: Option<String>,
    /// The backing file as the image names it (relative names are relative to the image).
    #[serde(default)]
    pub backing_filename: Option<String>,
    #[serde(default)]
    pub backing_filename_format: Option<String>,
    /// Bytes the image file takes on the host (what is allocated).
    #[serde(default)]
    pub actual_size: Option<u64>,
    /// The backing image's file, when the image is an overlay.
    #[serde(default)]
    pub full_backing_filename: Option<String>,
    /// The backing image itself, down the chain (only without `flat`).
    #[serde(default)]
    pub backing_image: Option<Box<BlockImage>>,
}

/// `query-block`: the VM's block devices and what is inserted in each.
#[derive(Debug, Serialize)]
pub struct QueryBlock;
command!(QueryBlock, "query-block", Vec<BlockDevice>);

#[derive(Debug, Clone, Deserialize)]
pub struct BlockDevice {
    /// The legacy drive name (empty for `-blockdev` devices).
    #[serde(default)]
    pub device: String,
    /// The image it has (none: an empty drive, such as a CD-ROM without a disc).
    #[serde(default)]
    pub inserted: Option<InsertedImage>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct InsertedImage {
    /// The top node the device reads and writes.
    #[serde(default)]
    pub node_name: String,
    /// Read-only: nothing the guest does changes it.
    pub ro: bool,
}

/// `query-kvm`.
#[derive(Debug, Serialize)]
pub struct QueryKvm;
/// Whether KVM is compiled in and in use.
#[derive(Debug, Deserialize)]
pub struct KvmInfo {
    pub enabled: bool,
    pub present: bool,
}
command!(QueryKvm, "query-kvm", KvmInfo);

/// `pmemsave`: write guest-physical memory `[val, val + size)` to a file on QEMU's host.
#[derive(Debug, Serialize)]
pub struct Pmemsave {
    pub val: u64,
    pub size: u64,
    pub filename: String,
}
command!(Pmemsave, "pmemsave", Value);

/// `query-memory-size-summary`: the guest's RAM.
#[derive(Debug, Serialize)]
pub struct QueryMemorySizeSummary;
#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MemorySizeSummary {
    pub base_memory: u64,
    #[serde(default)]
    pub plugged_memory: Option<u64>,
}
command!(
    QueryMemorySizeSummary,
    "query-memory-size-summary",
    MemorySizeSummary
);

/// `qom-list`: the properties (and children) of a QOM object.
#[derive(Debug, Serialize)]
pub struct QomList {
    pub path: String,
}
/// One property of [`QomList`]'s answer; children have type `child<TYPE>`.
#[derive(Debug, Deserialize)]
pub struct QomProperty {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
}
command!(QomList, "qom-list", Vec<QomProperty>);

/// `qom-get`: one property of a QOM object, as QEMU's JSON.
#[derive(Debug, Serialize)]
pub struct QomGet {
    pub path: String,
    pub property: String,
}
command!(QomGet, "qom-get", Value);
