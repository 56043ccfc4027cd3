//! The agent's side of the fleet: it heartbeats to a controller of its config's
//! `[[controllers]]` (mutual TLS; the certificate says which host it is; the first that answers,
//! keeping to it while it does, since any controller of a fleet takes heartbeats), reporting its site, its
//! peers, the VMs it runs and the progress of the migrations the controller asked for, and
//! starts the migrations the answer hands it. The controller never dials the agent.
//!
//! A migration handed over is started at most once per agent: the agent recognizes the fleet
//! id among its own migrations (or its refusals) when the same work comes again before the
//! controller took in the report.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use ferry_api::agent::{
    ApiError, Destination, LibvirtMigrationRequest, MigrationRequest, MigrationState,
    MigrationStatus,
};
use ferry_api::fleet::{
    FleetMigrationReport, FleetWork, Heartbeat, HeartbeatAnswer, HostCapacity, VmKind, VmNic,
    VmReport, VmUsage,
};
use ferry_qemu::commands::QueryBlock;
use ferry_qemu::Qmp;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::config::ControllerLink;
use crate::engine::monitor_dir::{self, Asked};
use crate::libvirt::Libvirt;
use crate::refusal::Refusal;
use crate::server::{self, Agent};

/// Until the controller says otherwise; also how often the VMs are listed.
const FIRST_HEARTBEAT: Duration = Duration::from_secs(2);
/// A heartbeat that takes longer failed (the controller answers from its store at once).
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a refusal is repeated in heartbeats (the controller takes the first).
const REFUSAL_KEPT: Duration = Duration::from_secs(600);
/// While a group member holds, each heartbeat asks the controller to answer as soon as the
/// group is decided, or within this: every held member learns the release within a few
/// milliseconds of the others.
const GROUP_WAIT: Duration = Duration::from_secs(2);
/// ... and the next goes at least this long after the last answer.
const GROUP_PACE: Duration = Duration::from_millis(20);

/// Heartbeats until the agent stops; a controller that does not answer is retried at the
/// same pace (the agent's own migrations go on regardless).
pub(crate) async fn report(agent: Arc<Agent>, links: Vec<ControllerLink>) -> Result<()> {
    let tls = agent.config.identity.client_config()?;
    let mut refused: HashMap<String, (ApiError, tokio::time::Instant)> = HashMap::new();
    // libvirt can take seconds to answer while a migration comes in: the VMs are listed
    // beside the heartbeats, which carry the latest list and never wait for it.
    let vms = Arc::new(std::sync::Mutex::new(Listed::default()));
    tokio::spawn(list_vms(agent.clone(), vms.clone()));
    let mut pace = FIRST_HEARTBEAT;
    let mut failing = false;
    // The controller that answered last: tried first next time.
    let mut current = 0;
    // What the last answer asked to hear about besides what runs.
    let mut track: Vec<String> = Vec::new();
    loop {
        refused.retain(|_, (_, at)| at.elapsed() < REFUSAL_KEPT);
        let listed = vms.lock().expect("vms lock").clone();
        let mut beat = heartbeat(&agent, listed.vms, &refused, &track);
        beat.vms_listed_unix_ms = listed.at_unix_ms;
        let holding = beat.migrations.iter().any(|m| {
            m.status
                .as_ref()
                .is_some_and(|s| s.phase == ferry_api::agent::Phase::Held)
        });
        if holding {
            beat.wait_ms = Some(u64::try_from(GROUP_WAIT.as_millis()).unwrap_or(u64::MAX));
        }
        let mut started = false;
        let sent = if holding {
            // A long poll carries the reports of when it left: a member that starts to hold
            // while it waits is reported at once by a new heartbeat, not after the wait (the
            // group's release waits for that report). An answer dropped this way is given
            // again: the controller's answers are its whole current view.
            tokio::select! {
                answer = send_to_any(&links, &mut current, &tls, &beat) => Some(answer),
                () = agent.groups.wake.notified() => None,
            }
        } else {
            Some(send_to_any(&links, &mut current, &tls, &beat).await)
        };
        let Some(sent) = sent else { continue };
        match sent {
            Ok(answer) => {
                if failing {
                    tracing::info!("the controller {} answers", links[current].name);
                    failing = false;
                }
                pace = Duration::from_millis(answer.heartbeat_ms.clamp(100, 60_000));
                track = answer.track;
                agent.groups.take(answer.groups);
                if let Some(plans) = answer.swaps {
                    crate::fleet_swap::reconcile(&agent, plans);
                }
                if let (Some(overlay), Some(plan)) = (&agent.overlay, answer.overlay) {
                    overlay.apply(plan).await;
                }
                for work in answer.start {
                    if known(&agent, &work.fleet_id) || refused.contains_key(&work.fleet_id) {
                        continue;
                    }
                    started = true;
                    let id = work.fleet_id.clone();
                    if let Err(refusal) = start(&agent, work).await {
                        tracing::warn!("the controller's migration {id}: refused: {refusal}");
                        let error = ApiError {
                            error: refusal.to_string(),
                            kind: Some(refusal.kind()),
                        };
                        refused.insert(id, (error, tokio::time::Instant::now()));
                    }
                }
                for id in answer.cancel {
                    cancel(&agent, &id);
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!("{e:#}; trying again every {pace:?}");
                }
                failing = true;
            }
        }
        // What was just started or refused goes to the controller at once, and so does a
        // member that starts to hold; a holding one waits at the controller.
        if holding {
            tokio::time::sleep(GROUP_PACE).await;
        } else if !started {
            tokio::select! {
                _ = tokio::time::sleep(pace) => {}
                _ = agent.groups.wake.notified() => {}
            }
        }
    }
}

/// Keeps `vms` the host's VMs, listed every [`FIRST_HEARTBEAT`] (a list that fails leaves
/// the last one standing rather than telling the controller they all left).
async fn list_vms(agent: Arc<Agent>, vms: Arc<std::sync::Mutex<Listed>>) {
    let mut cpu = CpuSamples::new();
    let mut dirty = crate::dirty_rate::DirtyRates::default();
    loop {
        // Stamped with when the listing began: whatever changed after may be missing.
        let at = crate::engine::status::now_ms();
        if let Some(mut now) = running_vms(&agent).await {
            if let Some(tunnels) = &agent.tunnels {
                let libvirt = Libvirt::new(&tunnels.config.socket);
                domains_usage(&agent, &libvirt, &mut now, &mut cpu, &mut dirty).await;
                crate::fleet_swap::sample_used(&agent, &libvirt).await;
            }
            *vms.lock().expect("vms lock") = Listed {
                vms: now,
                at_unix_ms: Some(at),
            };
        }
        tokio::time::sleep(FIRST_HEARTBEAT).await;
    }
}

/// Each domain's CPU time at its last listing, to turn the next into a rate.
type CpuSamples = HashMap<String, (u64, std::time::Instant)>;

/// Fills in the libvirt domains' usage: memory from this listing, CPU as the time taken
/// since the last (a domain listed for the first time has none yet), the dirty rate as last
/// measured. Usage that cannot be read leaves the VMs without (the planner then leaves them
/// where they are).
async fn domains_usage(
    agent: &Agent,
    libvirt: &Libvirt,
    vms: &mut [VmReport],
    cpu: &mut CpuSamples,
    dirty: &mut crate::dirty_rate::DirtyRates,
) {
    let stats = match libvirt.usage(dirty.any_measurable()).await {
        Ok(stats) => stats,
        Err(e) => {
            tracing::warn!("reading libvirt's domain statistics for the controller: {e:#}");
            return;
        }
    };
    let now = std::time::Instant::now();
    let running: Vec<&str> = vms
        .iter()
        .filter(|v| v.kind == VmKind::Libvirt && v.state == "running")
        .map(|v| v.name.as_str())
        .collect();
    let migrating = migrating_vms(agent);
    let rates: HashMap<String, Option<crate::libvirt::DirtyRate>> = stats
        .iter()
        .map(|(name, u)| (name.clone(), u.dirty_rate))
        .collect();
    dirty.update(libvirt, &rates, &running, &migrating).await;
    for vm in vms.iter_mut().filter(|v| v.kind == VmKind::Libvirt) {
        let Some(u) = stats.get(&vm.name) else {
            continue;
        };
        if let Some((before_ns, then)) = cpu.get(&vm.name) {
            let wall_ns = now.duration_since(*then).as_nanos().max(1);
            let used_ns = u128::from(u.cpu_time_ns.saturating_sub(*before_ns));
            vm.usage = Some(VmUsage {
                cpu_millis: u64::try_from(used_ns * 1000 / wall_ns).unwrap_or(u64::MAX),
                mem_bytes: u.mem_bytes,
                used_bytes: u.usable_bytes.map(|free| u.mem_bytes.saturating_sub(free)),
                dirty_bytes_per_s: dirty.rate(&vm.name),
            });
        }
    }
    cpu.clear();
    cpu.extend(
        stats
            .into_iter()
            .map(|(name, u)| (name, (u.cpu_time_ns, now))),
    );
}

/// What this host offers VMs: its config's `[host]`, else the machine's CPUs and memory.
fn capacity(agent: &Agent) -> Option<HostCapacity> {
    static MACHINE: std::sync::OnceLock<Option<HostCapacity>> = std::sync::OnceLock::new();
    agent.config.capacity.or_else(|| {
        *MACHINE.get_or_init(|| {
            let cpus = std::thread::available_parallelism().ok()?.get();
            let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
            let kib: u64 = meminfo
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(HostCapacity {
                cpus: u32::try_from(cpus).unwrap_or(u32::MAX),
                mem_bytes: kib.saturating_mul(1024),
                lend_bytes: 0,
            })
        })
    })
}

/// The host's VMs as last listed, and when.
#[derive(Debug, Clone, Default)]
struct Listed {
    vms: Vec<VmReport>,
    at_unix_ms: Option<u64>,
}

/// The VMs this host runs (libvirt's active domains and the QEMU VMs of its monitor
/// directory), or None when they cannot be listed now (the last list stands rather than
/// telling the controller they all left).
async fn running_vms(agent: &Agent) -> Option<Vec<VmReport>> {
    let mut vms = match &agent.tunnels {
        Some(tunnels) => libvirt_domains(&Libvirt::new(&tunnels.config.socket)).await?,
        None => Vec::new(),
    };
    vms.extend(qemu_vms(agent).await?);
    Some(vms)
}

/// The VMs this agent's running migrations move (either way).
fn migrating_vms(agent: &Agent) -> std::collections::HashSet<String> {
    agent
        .statuses()
        .into_iter()
        .filter(|s| s.state == MigrationState::Running)
        .map(|s| s.vm)
        .collect()
}

/// The QEMU VMs whose monitors are in the host's directory, each with the state its monitor
/// gives (one this agent is migrating is not asked: the migration has its monitor).
async fn qemu_vms(agent: &Agent) -> Option<Vec<VmReport>> {
    let names = match agent.monitors.names() {
        Ok(names) => names,
        Err(e) => {
            tracing::warn!(
                "listing the QEMU VMs' monitors in {}: {e}",
                agent.monitors.dir().display()
            );
            return None;
        }
    };
    let migrating = migrating_vms(agent);
    let mut asking = tokio::task::JoinSet::new();
    for name in names {
        let ours = migrating.contains(&name);
        let monitors = agent.monitors.clone();
        asking.spawn(async move {
            let asked = if ours {
                Asked::State("migrating".into())
            } else {
                monitors.state_of(&name).await
            };
            (name, asked)
        });
    }
    let mut vms = Vec::new();
    while let Some(joined) = asking.join_next().await {
        let Ok((name, asked)) = joined else {
            continue;
        };
        let state = match asked {
            // A QEMU waiting for a migration is no VM yet; one that arrived while it was
            // asked is listed next time.
            Asked::State(state) if state == "inmigrate" => continue,
            _ if agent.monitors.is_arriving(&name) => continue,
            Asked::State(state) => state,
            // Another client holds the monitor (its owner's tooling): it runs, state unknown.
            Asked::Busy => "busy".into(),
            Asked::Gone => continue,
        };
        vms.push(VmReport {
            name,
            kind: VmKind::Qemu,
            state,
            // Not known from the monitor: such VMs join no pool yet.
            nics: Vec::new(),
            // Nor their usage: the planner leaves them where they are.
            usage: None,
        });
    }
    vms.sort_by(|a, b| a.name.cmp(&b.name));
    Some(vms)
}

/// libvirt's active domains with their bridged interfaces, or None when libvirt does not
/// answer.
async fn libvirt_domains(libvirt: &Libvirt) -> Option<Vec<VmReport>> {
    let domains = match libvirt.active_domains().await {
        Ok(domains) => domains,
        Err(e) => {
            tracing::warn!("listing libvirt's domains for the controller: {e:#}");
            return None;
        }
    };
    let mut vms = Vec::with_capacity(domains.len());
    for (name, state) in domains {
        // A domain that left meanwhile has no interfaces to list: reported without.
        let nics = libvirt
            .bridged_nics(&name)
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|(mac, bridge)| VmNic { mac, bridge })
            .collect();
        vms.push(VmReport {
            name,
            kind: VmKind::Libvirt,
            state,
            nics,
            usage: None,
        });
    }
    Some(vms)
}

fn heartbeat(
    agent: &Agent,
    vms: Vec<VmReport>,
    refused: &HashMap<String, (ApiError, tokio::time::Instant)>,
    track: &[String],
) -> Heartbeat {
    let mut migrations: Vec<FleetMigrationReport> = fleet_statuses(agent)
        .into_iter()
        .filter(|s| {
            s.state == MigrationState::Running
                || s.fleet_id.as_ref().is_some_and(|id| track.contains(id))
        })
        .filter_map(|status| {
            Some(FleetMigrationReport {
                fleet_id: status.fleet_id.clone()?,
                status: Some(status),
                refused: None,
            })
        })
        .collect();
    migrations.extend(refused.iter().map(|(id, (error, _))| FleetMigrationReport {
        fleet_id: id.clone(),
        status: None,
        refused: Some(error.clone()),
    }));
    Heartbeat {
        site: agent.config.site.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        peer_listen: agent.config.listen.clone(),
        peers: agent.config.peers.keys().cloned().collect(),
        max_outgoing: u32::try_from(agent.config.max_outgoing).unwrap_or(u32::MAX),
        vms,
        capacity: capacity(agent).map(|c| HostCapacity {
            lend_bytes: agent.config.lend_bytes,
            ..c
        }),
        migrations,
        overlay: agent.overlay.as_ref().map(|o| o.report()),
        vms_listed_unix_ms: None,
        wait_ms: None,
        swaps: crate::fleet_swap::reports(agent),
    }
}

/// This agent's migrations that the controller asked for.
fn fleet_statuses(agent: &Agent) -> Vec<MigrationStatus> {
    agent
        .statuses()
        .into_iter()
        .filter(|s| s.fleet_id.is_some())
        .collect()
}

fn known(agent: &Agent, fleet_id: &str) -> bool {
    agent
        .migrations
        .lock()
        .expect("lock")
        .values()
        .any(|m| m.update(|s| s.fleet_id.as_deref() == Some(fleet_id)))
}

async fn start(agent: &Arc<Agent>, work: FleetWork) -> Result<MigrationStatus, Refusal> {
    match work.kind {
        VmKind::Libvirt => {
            let req = LibvirtMigrationRequest {
                domain: work.vm,
                to: work.to,
                copy_storage: work.copy_storage,
                link_rate_mbit: None,
                parallel: None,
                settings: work.settings,
            };
            server::start_libvirt_migration(agent, req, Some(work.fleet_id), work.group).await
        }
        VmKind::Qemu => {
            if work.group.is_some() {
                return Err(Refusal::QemuVmInGroup);
            }
            let source_qmp = agent.monitors.socket(&work.vm)?;
            if monitor_dir::ask(&source_qmp).await == Asked::Gone {
                return Err(Refusal::UnknownQemuVm {
                    name: work.vm,
                    socket: source_qmp.display().to_string(),
                });
            }
            let disks = if work.copy_storage {
                writable_disks(&source_qmp)
                    .await
                    .map_err(|e| Refusal::QemuVmUnavailable {
                        name: work.vm.clone(),
                        why: format!("{e:#}"),
                    })?
            } else {
                Vec::new()
            };
            let req = MigrationRequest {
                vm: work.vm,
                source_qmp,
                to: work.to,
                // On another host, the same command line names the same images and kernel.
                destination: Destination::SourceConfig,
                link_rate_mbit: None,
                disks,
                settings: work.settings,
            };
            server::start_migration(agent, req, Some(work.fleet_id))
        }
    }
}

/// The block nodes a VM writes to (what `--copy-storage` copies): every drive with an image
/// in it that is not read-only.
async fn writable_disks(socket: &std::path::Path) -> Result<Vec<String>> {
    // The heartbeats wait for this.
    let devices = tokio::time::timeout(Duration::from_secs(5), async {
        Qmp::connect(socket).await?.execute(&QueryBlock).await
    })
    .await
    .map_err(|_| anyhow!("no answer within 5 s (another client has it)"))??;
    Ok(devices
        .into_iter()
        .filter_map(|d| d.inserted)
        .filter(|image| !image.ro && !image.node_name.is_empty())
        .map(|image| image.node_name)
        .collect())
}

fn cancel(agent: &Agent, fleet_id: &str) {
    let migrations = agent.migrations.lock().expect("lock");
    if let Some(m) = migrations
        .values()
        .find(|m| m.update(|s| s.fleet_id.as_deref() == Some(fleet_id)))
    {
        // Too late (the stream ended) is the agent's answer too: it shows in the status.
        if !m.request_cancel() {
            tracing::info!("the controller's cancel of {fleet_id} came too late");
        }
    }
}

/// Sends the heartbeat to the controller at `current`, else to the others in turn; `current`
/// becomes the one that answered.
async fn send_to_any(
    links: &[ControllerLink],
    current: &mut usize,
    tls: &Arc<ferry_wire::tls::ClientConfig>,
    beat: &Heartbeat,
) -> Result<HeartbeatAnswer> {
    let mut errors = Vec::new();
    for i in (0..links.len()).map(|k| (*current + k) % links.len()) {
        let link = &links[i];
        match tokio::time::timeout(HEARTBEAT_TIMEOUT, send(link, tls, beat)).await {
            Ok(Ok(answer)) => {
                if i != *current {
                    tracing::info!("heartbeats go to the controller {} now", link.name);
                }
                *current = i;
                return Ok(answer);
            }
            Ok(Err(e)) => errors.push(format!("{} at {}: {e:#}", link.name, link.address)),
            Err(_) => errors.push(format!(
                "{} at {}: no answer within {HEARTBEAT_TIMEOUT:?}",
                link.name, link.address
            )),
        }
    }
    bail!("no controller answers: {}", errors.join("; "))
}

/// The largest heartbeat answer taken (the controller takes requests up to 4 MiB too).
const MAX_ANSWER_BYTES: usize = 4 << 20;

/// One heartbeat: a fresh mutual-TLS connection, one request, the answer.
async fn send(
    link: &ControllerLink,
    tls: &Arc<ferry_wire::tls::ClientConfig>,
    beat: &Heartbeat,
) -> Result<HeartbeatAnswer> {
    let tcp = TcpStream::connect(&link.address)
        .await
        .with_context(|| format!("connect to {}", link.address))?;
    let name = rustls_pki_types::ServerName::try_from(link.name.clone())
        .map_err(|e| anyhow!("controller name {:?}: {e}", link.name))?;
    let stream = tokio_rustls::TlsConnector::from(tls.clone())
        .connect(name, tcp)
        .await
        .context("TLS")?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method("POST")
        .uri("/v1/agent/heartbeat")
        .header("host", link.name.as_str())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(beat)?)))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    // The answer lists this host's work: far below this, unless the controller misbehaves.
    let body = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| anyhow!("the controller's answer: {e}"))?
        .to_bytes();
    if !status.is_success() {
        let message = serde_json::from_slice::<ApiError>(&body)
            .map_or_else(|_| String::from_utf8_lossy(&body).into_owned(), |e| e.error);
        bail!("refused the heartbeat ({status}): {message}");
    }
    serde_json::from_slice(&body).context("malformed answer")
}
