//! The fleet controller's API (docs/fleet.md) and what agents tell it in their heartbeats.

use serde::{Deserialize, Serialize};

use crate::agent::{ApiError, MigrationStatus};
use crate::settings::MigrationSettings;

/// What an agent reports every heartbeat (`POST /v1/agent/heartbeat`, over mutual TLS: the
/// certificate it presents names the host, so the body does not).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Heartbeat {
    /// The site (data center) the host is in.
    pub site: String,
    /// ferry's version on the host.
    pub version: String,
    /// Where the host's agent listens for peers.
    pub peer_listen: String,
    /// The hosts this agent may migrate to (its config's peers).
    pub peers: Vec<String>,
    /// Migrations the agent sends at once.
    pub max_outgoing: u32,
    /// The VMs running on the host now.
    pub vms: Vec<VmReport>,
    /// What the host offers VMs (its config's `[host]`, else the machine's CPUs and memory).
    #[serde(default)]
    pub capacity: Option<HostCapacity>,
    /// When `vms` was listed (it may be older than the heartbeat: libvirt can be slow).
    #[serde(default)]
    pub vms_listed_unix_ms: Option<u64>,
    /// The controller's migrations this agent runs, those the controller's last answer asked
    /// it to track, and its refusals.
    pub migrations: Vec<FleetMigrationReport>,
    /// The host's part in the virtual cloud pools, when its config has `[overlay]`.
    #[serde(default)]
    pub overlay: Option<OverlayReport>,
    /// The agent holds group members waiting for their group's release or abort: answer as
    /// soon as either is decided, or within this many milliseconds.
    #[serde(default)]
    pub wait_ms: Option<u64>,
    /// The host's VMs' swap on peers' memory (`ferry swap`, or the controller's overload
    /// response), and the controller's swaps it could not take.
    #[serde(default)]
    pub swaps: Vec<SwapReport>,
}

/// A VM's swap on a peer's memory, as its host reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SwapReport {
    pub domain: String,
    pub peer: String,
    pub bytes: u64,
    pub state: SwapState,
    /// What the guest has paged out to it, when the guest's agent last told (taken swaps).
    #[serde(default)]
    pub used_bytes: Option<u64>,
    /// Whether the controller asked for it (it gives back only its own).
    #[serde(default)]
    pub by_controller: bool,
    /// Why taking or giving it back failed (state `failed`).
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SwapState {
    /// Being set up or given back.
    Busy,
    Taken,
    /// The controller's swap could not be taken (it is not tried again for a while).
    Failed,
}

/// A swap the controller wants a host's VM to have: the overload response's desired state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SwapPlan {
    /// The host the VM runs on.
    pub host: String,
    pub domain: String,
    pub peer: String,
    pub bytes: u64,
    /// What the balloon leaves the guest while it swaps.
    pub memory_bytes: u64,
    pub since_unix_ms: u64,
}

/// A host's overlay: where other hosts reach its tunnel endpoint, and which pools' endpoints
/// are up on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OverlayReport {
    /// The host's VXLAN tunnel endpoint (VTEP) address on the network between the sites.
    pub address: String,
    /// Pools whose endpoint (bridge and tunnel) is up here as the last plan asked.
    pub ready: Vec<String>,
}

/// A VM's network interface: its MAC and the host bridge it is plugged into.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmNic {
    pub mac: String,
    pub bridge: String,
}

/// A VM an agent sees on its host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmReport {
    pub name: String,
    pub kind: VmKind,
    /// In the words of whoever runs it (libvirt's domain state: `running`, `paused`, ...).
    pub state: String,
    #[serde(default)]
    pub nics: Vec<VmNic>,
    /// What it uses, when the agent can tell (libvirt domains, from their second listing on).
    #[serde(default)]
    pub usage: Option<VmUsage>,
}

/// What a host offers VMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HostCapacity {
    pub cpus: u32,
    pub mem_bytes: u64,
    /// Memory its agent lends peers' VMs as swap (`[host] lend_mib`).
    #[serde(default)]
    pub lend_bytes: u64,
}

/// What a VM uses: the CPU time it took over the last listing interval (thousandths of a
/// CPU), and its memory (what its balloon leaves it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmUsage {
    pub cpu_millis: u64,
    pub mem_bytes: u64,
    /// What the guest uses of it: its memory less what the guest says it could free
    /// (`MemAvailable`), when its balloon driver reports statistics.
    #[serde(default)]
    pub used_bytes: Option<u64>,
    /// How fast the guest rewrites its memory, bytes per second, as QEMU last sampled it
    /// (`calc-dirty-rate`, through libvirt's `domdirtyrate-calc`), when it was.
    #[serde(default)]
    pub dirty_bytes_per_s: Option<u64>,
}

/// Who runs a VM, and so how it migrates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum VmKind {
    /// A libvirt domain: libvirt's own migration, carried by the agents.
    Libvirt,
    /// A QEMU its owner's tooling runs, found by its QMP socket in the agent's `[qemu]
    /// qmp_dir`: ferry's own migration, the destination started from the source's command line.
    Qemu,
}

impl VmKind {
    pub fn name(self) -> &'static str {
        match self {
            VmKind::Libvirt => "libvirt",
            VmKind::Qemu => "qemu",
        }
    }

    pub fn parse(s: &str) -> Option<VmKind> {
        [VmKind::Libvirt, VmKind::Qemu]
            .into_iter()
            .find(|k| k.name() == s)
    }
}

/// How an agent answered one of the controller's migrations: started (its status), or
/// refused (why).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetMigrationReport {
    pub fleet_id: String,
    #[serde(default)]
    pub status: Option<MigrationStatus>,
    #[serde(default)]
    pub refused: Option<ApiError>,
}

/// The controller's answer to a heartbeat: what to start, what to cancel, when to call again.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HeartbeatAnswer {
    pub start: Vec<FleetWork>,
    /// Fleet ids of running migrations to cancel.
    pub cancel: Vec<String>,
    /// Fleet ids the controller still waits to hear the end of: the agent reports these (and
    /// whatever it runs), not every migration it ever ran.
    #[serde(default)]
    pub track: Vec<String>,
    /// The next heartbeat is due within this.
    pub heartbeat_ms: u64,
    /// The pools' endpoints this host must have now (absent: the host has no overlay).
    #[serde(default)]
    pub overlay: Option<OverlayPlan>,
    /// The groups of the group members this host runs.
    #[serde(default)]
    pub groups: Vec<GroupSignal>,
    /// The swaps the controller wants this host's VMs to have (absent: the controller does
    /// not manage swap). Swaps the controller asked for and no longer lists are given back.
    #[serde(default)]
    pub swaps: Option<Vec<SwapPlan>>,
}

/// What a host's overlay must be: one endpoint per pool that has VMs here, VMs arriving here,
/// or an operator's hold on this host. Endpoints not listed are removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OverlayPlan {
    pub endpoints: Vec<EndpointPlan>,
}

/// One pool's endpoint on a host: a bridge the pool's VMs plug into, joined to the pool's
/// other endpoints by a VXLAN tunnel with the pool's network identifier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointPlan {
    pub pool: String,
    pub vni: u32,
    pub bridge: String,
    /// A plain VXLAN that learns where MACs are from the frames it sees (the guests'
    /// announcements after a move); otherwise the controller's directory (`macs`) says, and
    /// the endpoints re-point a moving VM at its switchover.
    pub learning: bool,
    /// With the directory: the agents re-point a moving VM's MACs at its switchover (else
    /// the directory follows when the controller learns of the commit).
    #[serde(default)]
    pub repoint: bool,
    /// The pool's other endpoints: broadcast and unknown frames go to each.
    pub remotes: Vec<OverlayRemote>,
    /// Where the pool's VMs on other hosts are (empty when learning).
    pub macs: Vec<RemoteMac>,
    /// The pool's VMs moving between hosts now: at the switchover their MACs re-point.
    pub moving: Vec<MovingMac>,
}

/// Another host's endpoint of the same pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OverlayRemote {
    pub host: String,
    pub address: String,
}

/// A VM's MAC on another host of the pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RemoteMac {
    pub mac: String,
    pub host: String,
}

/// A VM's MAC whose VM migrates from one host to another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MovingMac {
    pub mac: String,
    pub from: String,
    pub to: String,
}

/// A migration the controller gives the source host's agent to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetWork {
    pub fleet_id: String,
    pub vm: String,
    pub kind: VmKind,
    /// The destination host (one of the agent's peers).
    pub to: String,
    #[serde(default)]
    pub copy_storage: bool,
    /// The group it arrives with ([`GroupSignal`] in later answers).
    #[serde(default)]
    pub group: Option<String>,
    #[serde(flatten)]
    pub settings: MigrationSettings,
}

/// `POST /v1/migrations` on the controller: move a VM the fleet knows to a host, or to a
/// site (the controller chooses a host there).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetMigrationRequest {
    pub vm: String,
    /// The destination host.
    #[serde(default)]
    pub to: Option<String>,
    /// The destination site, when no host is named.
    #[serde(default)]
    pub to_site: Option<String>,
    /// Copy the VM's disks too (no shared storage).
    #[serde(default)]
    pub copy_storage: bool,
    #[serde(flatten)]
    pub settings: MigrationSettings,
}

impl FleetMigrationRequest {
    /// Parses a request, refusing a field it does not know.
    pub fn parse(body: &[u8]) -> Result<FleetMigrationRequest, String> {
        parse_with_settings(body, &["vm", "to", "to_site", "copy_storage"])
    }
}

/// `POST /v1/groups`: move related VMs (a web tier and its database) to another host or
/// site together: their memory passes end together, and all resume at the destination
/// within a short window, or none does.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetGroupRequest {
    pub vms: Vec<String>,
    /// The destination host of every member.
    #[serde(default)]
    pub to: Option<String>,
    /// The destination site, when no host is named (the controller chooses a host per VM).
    #[serde(default)]
    pub to_site: Option<String>,
    #[serde(default)]
    pub copy_storage: bool,
    #[serde(flatten)]
    pub settings: MigrationSettings,
}

impl FleetGroupRequest {
    /// Parses a request, refusing a field it does not know.
    pub fn parse(body: &[u8]) -> Result<FleetGroupRequest, String> {
        parse_with_settings(body, &["vms", "to", "to_site", "copy_storage"])
    }

    /// One member's migration request.
    pub fn member(&self, vm: &str) -> FleetMigrationRequest {
        FleetMigrationRequest {
            vm: vm.to_owned(),
            to: self.to.clone(),
            to_site: self.to_site.clone(),
            copy_storage: self.copy_storage,
            settings: self.settings.clone(),
        }
    }
}

/// Parses a request of `fields` and migration settings, refusing a field it does not know (a
/// typo must not silently become a default: serde cannot refuse unknown fields of a flattened
/// struct by itself).
fn parse_with_settings<T: serde::de::DeserializeOwned>(
    body: &[u8],
    fields: &[&str],
) -> Result<T, String> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("malformed request: {e}"))?;
    // Every field named, none left to `..Default` (a new setting that is not added here does
    // not compile), each optional one set: an unset one is not serialized, and its name would
    // be refused.
    let d = MigrationSettings::default();
    let every_setting = MigrationSettings {
        connections: d.connections,
        downtime_ms: d.downtime_ms,
        converge: d.converge,
        qemu_switchover_rule: d.qemu_switchover_rule,
        smart_stop: d.smart_stop,
        wan_timeout_s: d.wan_timeout_s,
        timeout_s: d.timeout_s,
        return_path: d.return_path,
        postcopy: d.postcopy,
        postcopy_at_throttle_pct: Some(0),
        codec: d.codec,
        seed_from: Some(String::new()),
        disk_mode: d.disk_mode,
        disk_buffer_mib: d.disk_buffer_mib,
        disk_bitmaps: d.disk_bitmaps,
        disk_background_copy: d.disk_background_copy,
        disk_pacing_floor_pct: Some(0),
        test_corrupt_at: Some(0),
        test_corrupt_disk_at: Some(0),
        test_disk_stall_ms: Some(0),
        test_shards: Some(1),
        test_cache_pause_bytes: Some(1),
    };
    let settings = serde_json::to_value(every_setting).map_err(|e| e.to_string())?;
    let known = |key: &str| fields.contains(&key) || settings.get(key).is_some();
    if let Some(object) = value.as_object() {
        if let Some(unknown) = object.keys().find(|k| !known(k)) {
            return Err(format!("unknown field {unknown:?} in the request"));
        }
    }
    serde_json::from_value(value).map_err(|e| format!("malformed request: {e}"))
}

/// Where a group is: its members copy, then hold; all are released to resume, or all are
/// aborted (each resumes at its source).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum GroupState {
    /// Its members migrate; none has resumed at its destination.
    Open,
    /// Every member's destination had its whole verified stream: all resume there.
    Released,
    /// A member failed or was cancelled before that: every member stays at its source.
    Aborted,
}

impl GroupState {
    pub fn name(self) -> &'static str {
        match self {
            GroupState::Open => "open",
            GroupState::Released => "released",
            GroupState::Aborted => "aborted",
        }
    }

    pub fn parse(s: &str) -> Option<GroupState> {
        [GroupState::Open, GroupState::Released, GroupState::Aborted]
            .into_iter()
            .find(|state| state.name() == s)
    }
}

/// A group of migrations that arrive together.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetGroup {
    pub id: String,
    pub state: GroupState,
    /// Why it was aborted.
    pub reason: Option<String>,
    pub requested_by: String,
    pub created_unix_ms: u64,
    /// When it was released or aborted.
    pub decided_unix_ms: Option<u64>,
    /// Its members' migrations, in the order asked.
    pub members: Vec<FleetMigration>,
    /// From the first member's resume at its destination to the last's, as the source agents
    /// report them (once all have).
    pub resume_window_ms: Option<u64>,
}

/// What the controller tells a source agent about a group member it runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GroupSignal {
    pub fleet_id: String,
    pub group: String,
    /// Every member could now stop within its downtime target (or is in its 10th pass): end
    /// the passes (the target applies from now; until then the member keeps copying).
    pub go: bool,
    /// Every member's destination has its whole verified stream: let it resume.
    pub release: bool,
    /// The group was aborted, for this reason: stop (the VM stays at the source).
    #[serde(default)]
    pub abort: Option<String>,
}

/// Where a fleet migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum FleetMigrationState {
    /// Accepted; waits for the leader to schedule it (hosts up, within the limits).
    Requested,
    /// Given to the source host's agent at its next heartbeat.
    Scheduled,
    /// The source agent runs it.
    Running,
    /// The VM runs at the destination.
    Committed,
    /// It did not happen (refused, failed or cancelled); the VM runs at the source.
    Failed,
}

impl FleetMigrationState {
    pub fn name(self) -> &'static str {
        match self {
            FleetMigrationState::Requested => "requested",
            FleetMigrationState::Scheduled => "scheduled",
            FleetMigrationState::Running => "running",
            FleetMigrationState::Committed => "committed",
            FleetMigrationState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<FleetMigrationState> {
        [
            FleetMigrationState::Requested,
            FleetMigrationState::Scheduled,
            FleetMigrationState::Running,
            FleetMigrationState::Committed,
            FleetMigrationState::Failed,
        ]
        .into_iter()
        .find(|state| state.name() == s)
    }

    pub fn finished(self) -> bool {
        matches!(
            self,
            FleetMigrationState::Committed | FleetMigrationState::Failed
        )
    }
}

/// A migration the controller knows: the request, where it is, the source agent's last
/// status and what happened to it, by whom.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetMigration {
    pub id: String,
    pub vm: String,
    pub kind: VmKind,
    pub source_host: String,
    pub destination_host: String,
    pub state: FleetMigrationState,
    pub error: Option<String>,
    /// Who asked (a certificate's name, or `local` for the controller's socket).
    pub requested_by: String,
    pub copy_storage: bool,
    pub settings: MigrationSettings,
    pub created_unix_ms: u64,
    pub updated_unix_ms: u64,
    pub finished_unix_ms: Option<u64>,
    /// A cancel was asked for and goes to the source agent.
    pub cancel_requested: bool,
    /// The VM's network interfaces when it was requested (its pools follow them).
    #[serde(default)]
    pub nics: Vec<VmNic>,
    /// The group it arrives with, if any.
    #[serde(default)]
    pub group: Option<String>,
    /// When its source agent first reported it held (a group member whose destination has
    /// the whole verified stream).
    #[serde(default)]
    pub held_unix_ms: Option<u64>,
    /// What the controller knew of the move when it was requested: the cost model's inputs
    /// and its prediction (none when the VM's use was not reported).
    #[serde(default)]
    pub planned: Option<PlannedMove>,
    /// The source agent's view, as of its last heartbeat.
    pub agent: Option<MigrationStatus>,
    /// The controller's own events (requested, scheduled, started, ...), oldest first.
    pub timeline: Vec<FleetEvent>,
}

/// A move as the controller knew it before it started (docs/policies.md, "The cost model"):
/// the VM's use as its host last reported it, the link `[policy]` names between the sites, and
/// what the cost model predicted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlannedMove {
    pub mem_bytes: u64,
    pub used_bytes: Option<u64>,
    pub dirty_bytes_per_s: Option<u64>,
    pub cpu_millis: u64,
    pub link_bits_per_s: u64,
    pub rtt_us: u64,
    pub downtime_target_ms: u64,
    pub predicted_ms: u64,
    pub predicted_wan_bytes: u64,
    pub predicted_pause_ms: u64,
}

/// `GET /v1/cost-model`: the figures the planner prices moves with, and how well they
/// predict the fleet's own migrations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetCostModel {
    /// The kind of VM (`libvirt` or `qemu`): each is fitted on its own.
    pub kind: String,
    /// `built-in` (fitted to ferry's lab benchmarks) until the fleet has enough migrations of
    /// its own, then `fleet`.
    pub source: String,
    /// Committed migrations with what the model needs (their prediction inputs and the
    /// source agent's figures), and how many the fit needs.
    pub samples: usize,
    pub samples_needed: usize,
    /// How many the figures in use were fitted to, and when.
    pub fitted_samples: Option<usize>,
    pub fitted_unix_ms: Option<u64>,
    /// Median |predicted / observed - 1| on migrations each fit did not see (k-fold), over
    /// the samples of the last fit.
    pub error: Option<CostModelError>,
    /// The figures (ferry-policy's `cost::Params`).
    #[schema(value_type = Object)]
    pub params: serde_json::Value,
    /// The committed migrations the fit left out, and why (a copied disk, a VM whose use was
    /// not reported, an agent without figures).
    pub left_out: Vec<Unplanned>,
}

/// The cost model's error on migrations it did not see.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CostModelError {
    pub samples: usize,
    pub folds: usize,
    pub total: f64,
    pub wan_bytes: f64,
    pub pause: Option<f64>,
}

/// Something the controller saw happen to a migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetEvent {
    pub unix_ms: u64,
    pub state: FleetMigrationState,
    /// Which controller recorded it.
    pub controller: String,
    pub detail: String,
}

/// A site: a data center, known by its hosts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Site {
    pub name: String,
    pub hosts: u32,
    pub hosts_up: u32,
    pub vms: u32,
}

/// Whether a host's agent is heard from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum HostState {
    Up,
    /// No heartbeat within the controller's `host_timeout_s`: it gets no new migrations.
    Down,
}

/// A host (an agent) of the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Host {
    pub name: String,
    pub site: String,
    pub state: HostState,
    pub version: String,
    pub peer_listen: String,
    pub peers: Vec<String>,
    pub max_outgoing: u32,
    pub vms: u32,
    pub first_seen_unix_ms: u64,
    pub last_seen_unix_ms: u64,
    /// Its tunnel endpoint and the pools up on it (absent: no `[overlay]` in its config).
    #[serde(default)]
    pub overlay: Option<OverlayReport>,
    /// When its last list of VMs was taken (absent: at its last heartbeat).
    #[serde(default)]
    pub vms_listed_unix_ms: Option<u64>,
    /// What it offers VMs, as it reports.
    #[serde(default)]
    pub capacity: Option<HostCapacity>,
    /// Its VMs' swap on peers, as it reports.
    #[serde(default)]
    pub swaps: Vec<SwapReport>,
}

/// A VM of the fleet, where it runs now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Vm {
    pub name: String,
    pub kind: VmKind,
    pub host: String,
    pub site: String,
    pub state: String,
    pub nics: Vec<VmNic>,
    /// What it uses, as its host last reported (absent: not known).
    #[serde(default)]
    pub usage: Option<VmUsage>,
}

/// A virtual cloud pool: one tenant's layer-2 segment across the sites where it has VMs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Pool {
    pub name: String,
    /// The VXLAN network identifier that keeps its frames apart from other pools'.
    pub vni: u32,
    /// The bridge its VMs plug into, the same name on every host.
    pub bridge: String,
    /// ARP-only (a plain learning VXLAN), without the controller's MAC directory.
    pub learning: bool,
    /// With the directory: re-pointed at each switchover by the agents (VirtualWire).
    pub repoint: bool,
    /// Hosts where an operator keeps its endpoint up whether or not VMs run there (to start
    /// VMs in the pool there).
    pub held: Vec<String>,
    /// The hosts with its endpoint now.
    pub endpoints: Vec<PoolEndpoint>,
}

/// A pool's endpoint on a host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolEndpoint {
    pub host: String,
    pub site: String,
    /// The pool's VMs on that host.
    pub vms: Vec<String>,
    /// The host's agent reports the endpoint up.
    pub ready: bool,
}

/// `POST /v1/pools`: a new pool.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolRequest {
    pub name: String,
    pub vni: u32,
    /// Default: `fp<vni>`.
    #[serde(default)]
    pub bridge: Option<String>,
    #[serde(default)]
    pub learning: bool,
    /// Without the re-pointing at switchover (the directory follows the controller): for
    /// comparison. Default: re-pointed.
    #[serde(default)]
    pub no_repoint: bool,
    #[serde(default)]
    pub hold: Vec<String>,
}

/// `GET /v1/health` on the controller.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ControllerHealth {
    pub name: String,
    pub version: String,
    /// The store's kind: `sqlite` or `postgres`.
    pub store: String,
    /// The controller that leads now (schedules migrations, marks hosts down), if any.
    pub leader: Option<String>,
}

/// `GET /v1/plan`: what the planner would do now (docs/policies.md); `POST /v1/plan` carries
/// it out, and the answer names the migrations and groups it requested.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FleetPlan {
    pub computed_unix_ms: u64,
    /// Cheapest first.
    pub moves: Vec<PlanMove>,
    /// Hosts being emptied: they take no VMs from now on.
    pub drain: Vec<String>,
    /// Hosts that are empty and may be stopped.
    pub empty: Vec<String>,
    /// Hosts being emptied that stay on: what is left on them fits nowhere else.
    pub keep: Vec<String>,
    /// Why nothing moves, when nothing does.
    pub quiet: Option<String>,
    /// Hosts and VMs the plan leaves out, and why (a host down or without its capacity, a
    /// VM whose use is not reported, ...).
    pub unplanned: Vec<Unplanned>,
    /// When carried out: the migrations and groups requested, by id.
    #[serde(default)]
    pub requested: Vec<String>,
    /// When carried out: the moves the controller refused, and why.
    #[serde(default)]
    pub refused: Vec<Unplanned>,
    /// Each host's memory pressure, as the overload response sees it (`[policy] overload`).
    #[serde(default)]
    pub pressure: Vec<HostPressure>,
    /// The swaps the overload response keeps.
    #[serde(default)]
    pub swaps: Vec<SwapPlan>,
}

/// A host's memory pressure: what its VMs use (with what they paged out to peers) against what
/// it offers, and how the overload detector reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HostPressure {
    pub host: String,
    /// Its VMs' memory in use, what they paged out to peers included.
    pub used_bytes: u64,
    /// What they paged out to peers.
    pub swapped_bytes: u64,
    pub capacity_bytes: u64,
    /// `normal`, `transient` or `sustained`.
    pub pressure: String,
    /// Intervals after which an overload counts as sustained, as learned.
    pub threshold_intervals: u32,
    /// Overloaded samples among the detector's window (12): at 8 an overload is sustained,
    /// whichever episodes they came from.
    #[serde(default)]
    pub overloaded_in_window: u32,
}

/// VMs that move together from one host to another.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PlanMove {
    pub vms: Vec<String>,
    pub from: String,
    pub to: String,
    /// `relieve` (off a host over its capacity) or `consolidate` (off a host being emptied).
    pub reason: String,
    /// The cost model's prediction.
    pub predicted_s: f64,
    pub predicted_wan_bytes: u64,
    pub predicted_pause_ms: u64,
}

/// A host or VM a plan leaves out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Unplanned {
    pub name: String,
    pub why: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_is_a_known_field_and_a_typo_is_not() {
        for (field, value) in [
            ("downtime_limit_ms", "300"),
            ("postcopy_at_throttle_pct", "40"),
            ("disk_pacing_floor_pct", "50"),
            ("seed_from", "\"web-0\""),
            ("test_cache_pause_bytes", "65536"),
        ] {
            let body = format!("{{\"vm\": \"web-1\", \"{field}\": {value}}}");
            FleetMigrationRequest::parse(body.as_bytes())
                .unwrap_or_else(|e| panic!("{field}: {e}"));
            let body = format!("{{\"vms\": [\"web-1\"], \"{field}\": {value}}}");
            FleetGroupRequest::parse(body.as_bytes()).unwrap_or_else(|e| panic!("{field}: {e}"));
        }
        let err =
            FleetMigrationRequest::parse(br#"{"vm": "web-1", "downtime_ms": 300}"#).unwrap_err();
        assert_eq!(err, "unknown field \"downtime_ms\" in the request");
    }
}
