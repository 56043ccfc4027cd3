//! Unix sockets carried between hosts, for libvirt's migration over UNIX sockets (libvirt's
//! `docs/migration.rst`, "Migration using only UNIX sockets"; KubeVirt's migration proxy does
//! the same): `virsh migrate --live --p2p DOMAIN
//! --desturi 'qemu+unix:///system?socket=<tunnel dir>/<peer>/rpc.sock'
//! --migrateuri 'unix://<tunnel dir>/<peer>/mig.sock'
//! [--copy-storage-all --disks-uri 'unix://<tunnel dir>/<peer>/nbd.sock']`
//! goes through the agents unchanged.
//!
//! ```text
//!  source host                                          destination host (agent <peer>)
//!  libvirtd --connect--> <dir>/<peer>/rpc.sock  ==WAN==> /run/libvirt/libvirt-sock (libvirtd)
//!  QEMU ----connect----> <dir>/<peer>/mig.sock  ==WAN==> <dir>/<peer>/mig.sock (QEMU listens)
//!  QEMU ----connect----> <dir>/<peer>/nbd.sock  ==relay=> <dir>/<peer>/nbd.sock (QEMU's NBD)
//! ```
//!
//! libvirt requires the same paths on both hosts: the source agent listens on them, and at the
//! destination libvirt has QEMU listen on them (the destination agent makes its own directory,
//! `<dir>/<its name>/`, and only connects there). Migrations the agent drives each take a
//! directory of their own, `<dir>/<peer>/<N>/` ([`DRIVEN_SLOTS`]), since QEMU's stream does not
//! say which domain it carries; `<dir>/<peer>/` is for users' own `virsh migrate`. Each accepted connection is one session to
//! the peer (on a warm connection when there is one), opened by a [`Control::Tunnel`]; its
//! bytes go source to destination on the stream channel and back on the return-path channel,
//! and a side's end of input is a barrier there. The session reconnects and replays across
//! WAN drops like a migration's.
//!
//! A connection to the migration socket that starts with QEMU's stream header ("QEVM") is
//! QEMU's main stream: it crosses coded, and the destination QEMU reads only what the source's
//! digests confirm ([`crate::engine::tunnel_stream`]); the source agent lists it among its migrations,
//! named after the QEMU at the other end of the socket. One that starts with the multifd magic
//! is one of QEMU's multifd channels (libvirt's `--parallel`): coded and gated the same way,
//! its figures added to the main stream's migration when it ends. The NBD disk copy is
//! answered at the source and crosses as coded disk snapshots
//! ([`crate::engine::disk::relay`]). Every other connection (libvirt's RPC) crosses as it is.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use ferry_api::agent::MigrationStatus;
use ferry_api::settings::MigrationSettings;
use ferry_api::EventKind;
use ferry_wire::connection_count::ConnectionCount;
use ferry_wire::net::{keep_connected, LinkEvent, Peer, Pool};
use ferry_wire::tls::ClientConfig;
use ferry_wire::{Received, Session, SessionConfig, SessionId};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::config::{LibvirtConfig, PeerConfig};
use crate::disk_memory::DiskMemory;
use crate::engine::control::{
    self, Control, PeerAborted, TunnelKind, CONTROL_VERSION, RETURN_PATH, STREAM,
};
use crate::engine::disk::buffer::TransmitBuffer;
use crate::engine::disk::mirror::memory_phase_buffer;
use crate::engine::disk::pacing::BulkGate;
use crate::engine::disk::relay::{self, DomainDisks, Left, RelaySettings, RelaySource};
use crate::engine::journal::{Journal, LibvirtStreamRecord};
use crate::engine::status::{now_ms, Events, Registry, Shared};
use crate::engine::tunnel_stream;
use crate::group::GroupLink;
use crate::lend::{Lender, Loan};
use crate::libvirt::Libvirt;
use crate::libvirt_disks::DiskSource;
use crate::libvirt_migration::record_completed;
use crate::overlay::Overlay;
use crate::refusal::Refusal;
use crate::relay_pacing::RelayPacing;

/// How long the WAN may be down before a tunnelled connection is given up (libvirt's own
/// keepalive gives up on its RPC connection after 30 s; a migration after its own timeout).
const WAN_TIMEOUT: Duration = Duration::from_secs(120);
/// The link rate the codec's zstd level assumes when the peer's config gives none.
const ASSUMED_LINK_MBIT: f64 = 1000.0;
/// The disk relays' buffers, once QEMU's memory stream starts, hold what the link drains in
/// this fraction of the downtime target: they cross after QEMU's switchover, within the pause
/// ([`crate::libvirt_migration::memory_downtime_ms`] leaves them that share).
pub const RELAY_DRAIN_SHARE: u64 = 6;
/// How long a user's own migration may take to finish at the destination once its stream was
/// delivered (libvirt's Finish step) before its figures are given up.
const COMPLETED_JOB_WAIT: Duration = Duration::from_secs(30);
/// How long a user's own migration may stay unnamed before its record is written without
/// waiting (libvirt's job is looked up in the background).
const NAMING_WAIT: Duration = Duration::from_secs(5);
/// How long a failing end of a tunnel waits for its Abort to reach the other end.
const ABORT_GRACE: Duration = Duration::from_secs(5);
/// How long the destination's socket may take to appear (libvirt has QEMU listen on it in its
/// Prepare step, just before the source connects).
const TARGET_WAIT: Duration = Duration::from_secs(5);

/// Tunnel directories per peer for the migrations this agent drives, each to one migration
/// at a time: QEMU's stream does not say which domain it is, the directory it came to does.
pub const DRIVEN_SLOTS: u32 = 8;

/// The socket of `kind` in tunnel directory `slot` for migrations to `peer` on this host: slot
/// 0 is `<tunnel dir>/<peer>/` (users' own `virsh migrate`), slot N `<tunnel dir>/<peer>/N/`.
pub fn socket_path(config: &LibvirtConfig, peer: &str, slot: u32, kind: TunnelKind) -> PathBuf {
    slot_dir(config, peer, slot).join(kind.socket_name())
}

fn slot_dir(config: &LibvirtConfig, peer: &str, slot: u32) -> PathBuf {
    let dir = config.tunnel_dir.join(peer);
    match slot {
        0 => dir,
        n => dir.join(n.to_string()),
    }
}

/// A peer's name and one of its tunnel directories.
type SlotKey = (String, u32);

/// What every tunnel of this agent shares.
pub struct Tunnels {
    pub config: LibvirtConfig,
    /// This agent's name: at the destination, QEMU listens in `<tunnel dir>/<own name>/`.
    pub own_name: String,
    pub peers: Vec<(String, PeerConfig)>,
    pub tls: Arc<ClientConfig>,
    pub pool: Arc<Pool>,
    /// Where a carried migration stream is listed.
    pub registry: Registry,
    /// Migrations this agent drives through libvirt, by peer and tunnel directory: what comes
    /// to that directory is theirs ([`Tunnels::claim`]).
    pub claims: Mutex<HashMap<SlotKey, Claimed>>,
    /// The disk relays by peer and directory: when QEMU's memory stream starts there, their
    /// buffers' bound tightens to what crosses within the pause, and their pacing ends.
    pub relays: Mutex<HashMap<SlotKey, Vec<RelayLevers>>>,
    /// The migration whose main stream last started in each directory: its multifd channels
    /// add their figures to it as they end.
    pub streams: Mutex<HashMap<SlotKey, Shared>>,
    /// The multifd channels crossing from each directory now: they share one send window.
    pub channels: Mutex<HashMap<SlotKey, Arc<AtomicUsize>>>,
    /// Why the last tunnel to each peer failed (the destination's own words, which libvirt
    /// only sees as a closed connection).
    pub failures: Mutex<HashMap<String, String>>,
    /// This host's pool endpoints, re-pointed at each switchover.
    pub overlay: Option<Arc<Overlay>>,
    /// Where a delivered stream is written down until libvirt settled its migration
    /// ([`crate::libvirt_fence`]).
    pub journal: Journal,
    /// What the disks of domains that left held, for their return.
    pub disk_memory: DiskMemory,
}

/// A driven migration's status and settings (its disk mode and buffer, its downtime target,
/// the test hook that flips a bit of the stream).
#[derive(Clone)]
pub struct Claimed {
    pub status: Shared,
    pub settings: MigrationSettings,
    /// A group member's link to its group.
    pub group: Option<GroupLink>,
    /// Its disk copy is paced by the guest's IO.
    pub pacing: Option<RelayPacing>,
    /// Its relayed disk copies.
    pub copies: Arc<DiskCopies>,
}

/// A driven migration's relayed disk copies: its file disks as read before it left, how many
/// copies run, and what each left at the destination.
pub struct DiskCopies {
    /// None: its disks are not copied; else the disks, or why libvirt did not say.
    pub disks: Option<Result<Vec<DiskSource>, String>>,
    running: tokio::sync::watch::Sender<usize>,
    left: Mutex<Vec<Left>>,
}

impl DiskCopies {
    pub fn new(disks: Option<Result<Vec<DiskSource>, String>>) -> DiskCopies {
        DiskCopies {
            disks,
            running: tokio::sync::watch::Sender::new(0),
            left: Mutex::default(),
        }
    }

    /// Once no copy runs (QEMU may close its last NBD connection just after libvirt's
    /// migration returned), or after `patience`: what the copies left, by export. An export
    /// copied more than once in the migration is left out: which copy's is the image's is
    /// not known.
    pub async fn left(&self, patience: Duration) -> Vec<Left> {
        let mut running = self.running.subscribe();
        if tokio::time::timeout(patience, running.wait_for(|n| *n == 0))
            .await
            .is_err()
        {
            tracing::warn!(
                "disk copies still running {patience:?} after libvirt's migration ended"
            );
        }
        let mut left = std::mem::take(&mut *self.left.lock().expect("left lock"));
        let mut seen = std::collections::HashMap::new();
        for l in &left {
            *seen.entry(l.export.clone()).or_insert(0) += 1;
        }
        left.retain(|l| {
            let once = seen[&l.export] == 1;
            if !once {
                tracing::warn!(
                    "export {} was copied more than once: its index is not kept",
                    l.export
                );
            }
            once
        });
        left
    }

    /// Counts a copy as running until the guard goes.
    fn start(self: &Arc<Self>) -> CopyRunning {
        self.running.send_modify(|n| *n += 1);
        CopyRunning(self.clone())
    }
}

/// A relayed disk copy that runs.
struct CopyRunning(Arc<DiskCopies>);

impl Drop for CopyRunning {
    fn drop(&mut self) {
        self.0.running.send_modify(|n| *n -= 1);
    }
}

/// What the memory phase changes in a disk relay: its buffer's bound, and the end of its bulk
/// copy's pacing.
pub struct RelayLevers {
    buffer: Weak<TransmitBuffer>,
    bulk_gate: Option<Weak<BulkGate>>,
}

/// What a tunnel session carries, as its first control message says.
#[derive(Debug, Clone)]
pub struct Carried {
    pub version: u32,
    pub kind: TunnelKind,
    pub coded: bool,
    /// A coded migration tunnel carries one of QEMU's multifd channels.
    pub multifd: bool,
    /// The source agent's name.
    pub from: Option<String>,
    /// The tunnel directory the connection came to at the source.
    pub slot: u32,
}

/// A migration's own tunnel directory to a peer, given back when dropped.
pub struct Claim {
    tunnels: Arc<Tunnels>,
    peer: String,
    pub slot: u32,
}

impl Claim {
    /// The migration's relayed disk copies.
    pub fn copies(&self) -> Option<Arc<DiskCopies>> {
        let claims = self.tunnels.claims.lock().expect("claims lock");
        let claimed = claims.get(&(self.peer.clone(), self.slot))?;
        Some(claimed.copies.clone())
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.tunnels
            .claims
            .lock()
            .expect("claims lock")
            .remove(&(self.peer.clone(), self.slot));
    }
}

/// Listens on every peer's tunnel sockets and carries each connection to that peer; makes
/// this agent's own directory for the sockets QEMU listens on at the destination. Runs until
/// a listener fails.
pub async fn serve_sources(tunnels: Arc<Tunnels>) -> Result<()> {
    let dir = &tunnels.config.tunnel_dir;
    let config = &tunnels.config;
    let make = |dir: PathBuf| {
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))
    };
    for slot in 0..=DRIVEN_SLOTS {
        make(slot_dir(config, &tunnels.own_name, slot))?;
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (index, (name, _)) in tunnels.peers.iter().enumerate() {
        for slot in 0..=DRIVEN_SLOTS {
            make(slot_dir(config, name, slot))?;
            // Swap is the peer agent's own service, not a migration's: one socket per peer.
            let kinds = TunnelKind::ALL
                .into_iter()
                .filter(|k| slot == 0 || *k != TunnelKind::Swap);
            for kind in kinds {
                let path = socket_path(config, name, slot, kind);
                let _ = std::fs::remove_file(&path);
                let listener = UnixListener::bind(&path)
                    .with_context(|| format!("listen on {}", path.display()))?;
                let tunnels = tunnels.clone();
                tasks.spawn(async move {
                    loop {
                        let (conn, _) = listener
                            .accept()
                            .await
                            .with_context(|| format!("accept on {}", path.display()))?;
                        let tunnels = tunnels.clone();
                        tokio::spawn(async move {
                            let name = &tunnels.peers[index].0;
                            if let Err(e) = tunnels.carry(conn, index, slot, kind).await {
                                tracing::warn!("tunnel to {name} ({kind:?}): {e:#}");
                            }
                        });
                    }
                    #[allow(unreachable_code)]
                    Ok::<(), anyhow::Error>(())
                });
            }
        }
    }
    tracing::info!("libvirt tunnels listening in {}", dir.display());
    match tasks.join_next().await {
        Some(r) => r.map_err(|e| anyhow!("tunnel listener: {e}"))?,
        None => Ok(()),
    }
}

impl Tunnels {
    /// Claims a tunnel directory to `peer` for a migration this agent drives: whatever
    /// connects there is that migration's, since nothing in QEMU's stream says which domain it
    /// belongs to.
    pub fn claim(self: &Arc<Self>, peer: &str, claimed: Claimed) -> Result<Claim, Refusal> {
        let mut claims = self.claims.lock().expect("claims lock");
        let Some(slot) = (1..=DRIVEN_SLOTS).find(|n| !claims.contains_key(&(peer.to_owned(), *n)))
        else {
            return Err(Refusal::PeerBusy {
                peer: peer.to_owned(),
                running: DRIVEN_SLOTS,
            });
        };
        claims.insert((peer.to_owned(), slot), claimed);
        Ok(Claim {
            tunnels: self.clone(),
            peer: peer.to_owned(),
            slot,
        })
    }

    /// One accepted connection to tunnel directory `slot`, carried to the socket of `kind`
    /// at peer number `peer`.
    async fn carry(
        &self,
        mut conn: UnixStream,
        peer: usize,
        slot: u32,
        kind: TunnelKind,
    ) -> Result<()> {
        let (peer_name, peer) = &self.peers[peer];
        // QEMU's main stream starts with its header, a multifd channel with the multifd magic.
        let mut first = Vec::new();
        if kind == TunnelKind::Migration {
            (&mut conn)
                .take(4)
                .read_to_end(&mut first)
                .await
                .context("reading the first bytes of the migration socket")?;
        }
        // QEMU's main stream and its channels cross coded; so do disk writes, through the
        // relay.
        let multifd = kind == TunnelKind::Migration && first == ferry_qemu::multifd::MAGIC;
        let coded = first == ferry_qemu::stream::MAGIC || multifd || kind == TunnelKind::Nbd;
        let addr = tokio::net::lookup_host(&peer.address)
            .await
            .with_context(|| format!("peer {peer_name:?}: address {:?}", peer.address))?
            .next()
            .ok_or_else(|| anyhow!("peer {peer_name:?}: {:?} resolves to nothing", peer.address))?;
        let session = Session::new(SessionId::random(), SessionConfig::default());
        let (events, link_events) = tokio::sync::mpsc::unbounded_channel();
        // QEMU's main stream and a disk relay are one stream each, like the ferry path's:
        // split only where one connection cannot hold the link. QEMU's multifd channels are
        // already several flows, each deciding alone as if it had the link: one connection
        // each.
        let count = if multifd {
            ConnectionCount::fixed(1)
        } else {
            ConnectionCount::auto()
        };
        let _connections = keep_connected(
            session.clone(),
            Peer {
                addr,
                name: peer_name.to_owned(),
                tls: self.tls.clone(),
                connections: count.clone(),
                link_rate_mbit: peer.rate_mbit,
                pool: self.pool.clone(),
            },
            Duration::from_millis(500),
            events,
        );
        control::send(
            &session,
            &Control::Tunnel {
                version: CONTROL_VERSION,
                kind,
                coded,
                multifd,
                from: Some(self.own_name.clone()),
                slot,
            },
        )
        .await?;
        tracing::info!("tunnel {kind:?} to {peer_name}: session {}", session.id());
        let claimed = self
            .claims
            .lock()
            .expect("claims lock")
            .get(&(peer_name.clone(), slot))
            .cloned();
        let link = peer.rate_mbit.unwrap_or(ASSUMED_LINK_MBIT);
        let result = if kind == TunnelKind::Nbd {
            let settings = claimed.as_ref().map(|c| &c.settings);
            let status = match &claimed {
                Some(c) => c.status.clone(),
                // Figures nobody reads: a user's own migration is listed by its memory stream.
                None => Shared::new(MigrationStatus::starting(
                    session.id().to_string(),
                    "(a libvirt disk)".into(),
                    now_ms(),
                )),
            };
            // The round trip it measures is the first the driver of a migration learns.
            size_window(
                &session,
                link_events,
                peer.rate_mbit,
                claimed
                    .as_ref()
                    .map(|c| Recording::Disk(c.status.clone(), count)),
                None,
            );
            let defaults = MigrationSettings::default();
            let settings = settings.unwrap_or(&defaults);
            let pacing = claimed.as_ref().and_then(|c| c.pacing.clone());
            let relay = RelaySource::new(RelaySettings {
                mode: settings.disk_mode,
                buffer_bytes: settings.disk_buffer_mib << 20,
                link_rate_mbit: link,
                paced: pacing.is_some(),
                owner: claimed.as_ref().map(domain_disks),
            });
            let bulk_gate = relay.bulk_gate();
            let buffer = relay.buffer();
            self.relays
                .lock()
                .expect("relays lock")
                .entry((peer_name.clone(), slot))
                .or_default()
                .push(RelayLevers {
                    buffer: buffer.clone(),
                    bulk_gate: bulk_gate.as_ref().map(Arc::downgrade),
                });
            // The pacing runs beside the copy and ends with it.
            let paced = async {
                if let (Some(pacing), Some(gate)) = (pacing, bulk_gate) {
                    crate::relay_pacing::pace(pacing, gate, buffer, status.clone()).await;
                }
                std::future::pending::<Result<()>>().await
            };
            let _running = claimed.as_ref().map(|c| c.copies.start());
            let carried = relay.run(conn, &session, settings.codec, status.clone());
            let left = tokio::select! {
                result = within_wan_timeout(&session, carried) => result,
                never = paced => never.map(|()| None),
            };
            // Kept for the migration to remember once the domain is gone from here.
            left.map(|left| {
                if let (Some(left), Some(c)) = (left, &claimed) {
                    c.copies.left.lock().expect("left lock").push(left);
                }
            })
        } else if multifd {
            // QEMU opens its channels together, before the first connection has measured the
            // round trip: by then each knows how many share the window.
            let live = self
                .channels
                .lock()
                .expect("channels lock")
                .entry((peer_name.clone(), slot))
                .or_default()
                .clone();
            live.fetch_add(1, Ordering::Relaxed);
            let _counted = Decrement(live.clone());
            size_window(&session, link_events, peer.rate_mbit, None, Some(live));
            let (read, write) = conn.into_split();
            // A driven migration's test hook flips a bit of every stream it reaches.
            let corrupt_at = claimed.as_ref().and_then(|c| c.settings.test_corrupt_at);
            let carried =
                tunnel_stream::channel_source(first, read, write, &session, link, corrupt_at);
            let report = within_wan_timeout(&session, carried).await;
            let main = self
                .streams
                .lock()
                .expect("streams lock")
                .get(&(peer_name.clone(), slot))
                .cloned();
            match &report {
                Ok(report) => {
                    tracing::info!(
                        "multifd channel {} to {peer_name}: {} bytes from QEMU, {} on the WAN",
                        report.id,
                        report.stream_bytes,
                        report.wire_bytes
                    );
                    if let Some(main) = main {
                        main.update(|s| s.multifd.push(report.clone()));
                    }
                }
                Err(e) => {
                    tracing::warn!("multifd channel to {peer_name}: {e:#}");
                    // libvirt only sees the connection close: the migration says why.
                    if let Some(main) = main {
                        main.update(|s| {
                            s.event(EventKind::Failed, format!("a multifd channel: {e:#}"));
                        });
                    }
                }
            }
            report.map(|_| ())
        } else if coded {
            let driven = claimed.is_some();
            let (status, corrupt_at, downtime_ms, group) = match claimed {
                Some(c) => (
                    c.status,
                    c.settings.test_corrupt_at,
                    c.settings.downtime_ms,
                    c.group,
                ),
                None => (
                    self.register_unclaimed(peer_name, &session),
                    None,
                    MigrationSettings::default().downtime_ms,
                    None,
                ),
            };
            self.memory_phase(peer_name, slot, link, downtime_ms);
            // Its multifd channels, if any, report here as they end.
            self.streams
                .lock()
                .expect("streams lock")
                .insert((peer_name.clone(), slot), status.clone());
            size_window(
                &session,
                link_events,
                peer.rate_mbit,
                Some(Recording::Stream(status.clone(), count)),
                None,
            );
            let recorded = self.record_stream(peer_name, &session, &status);
            let (read, write) = conn.into_split();
            let carried = tunnel_stream::source(
                tunnel_stream::Source {
                    first,
                    from_qemu: read,
                    to_qemu: write,
                    link_rate_mbit: link,
                    corrupt_at,
                    group,
                },
                &session,
                &status,
            );
            let result = within_wan_timeout(&session, carried).await;
            // Its digest is set when the stream's end goes out.
            let end_sent = result.is_ok() || status.get().digest.is_some();
            self.settle_after_stream(recorded, end_sent, &status);
            // The destination has the whole verified stream: the VM resumes there next.
            if let (Ok(()), Some(overlay)) = (&result, &self.overlay) {
                overlay.departed(peer_name).await;
            }
            tunnel_stream::conclude(&status, &session, &result, !driven);
            if !driven && result.is_ok() {
                let there = Libvirt::through(socket_path(
                    &self.config,
                    peer_name,
                    0,
                    TunnelKind::LibvirtRpc,
                ));
                tokio::spawn(completed_job(there, status));
            }
            result
        } else {
            let mut conn = conn;
            let result = pipe(&mut conn, first, &session, STREAM, RETURN_PATH).await;
            // Kept before the connection closes: whoever sees it close may ask why.
            if let Err(e) = &result {
                self.failures
                    .lock()
                    .expect("failures lock")
                    .insert(peer_name.clone(), format!("{e:#}"));
            }
            result
        };
        finish(&session, &result, "source").await;
        result
    }

    /// Whether `peer`'s libvirt answers through the RPC tunnel; if not, why (the tunnel's
    /// failure when there was one).
    pub async fn check_peer_libvirt(&self, peer: &str) -> Result<(), Refusal> {
        self.failures.lock().expect("failures lock").remove(peer);
        let there = Libvirt::through(socket_path(&self.config, peer, 0, TunnelKind::LibvirtRpc));
        there.answers().await.map_err(|e| {
            let tunnel = self.failures.lock().expect("failures lock").remove(peer);
            Refusal::PeerLibvirtUnavailable {
                peer: peer.to_owned(),
                why: tunnel.unwrap_or_else(|| format!("{e:#}")),
            }
        })
    }
}

impl Tunnels {
    /// QEMU's memory stream to `peer` began in tunnel directory `slot`: what the disk relays
    /// there buffer must now cross within the pause.
    fn memory_phase(&self, peer: &str, slot: u32, link_rate_mbit: f64, downtime_ms: u64) {
        let mut relays = self.relays.lock().expect("relays lock");
        let Some(levers) = relays.get_mut(&(peer.to_owned(), slot)) else {
            return;
        };
        levers.retain(|l| l.buffer.strong_count() > 0);
        // memory_phase_buffer drains in a third of what it is given.
        let limit = memory_phase_buffer(link_rate_mbit, downtime_ms * 3 / RELAY_DRAIN_SHARE);
        for l in levers.iter() {
            if let Some(buffer) = l.buffer.upgrade() {
                buffer.set_limit(limit);
            }
            // libvirt starts the memory only once every mirror is ready: the bulk copy is
            // over, and what is left are the guest's writes.
            if let Some(gate) = l.bulk_gate.as_ref().and_then(Weak::upgrade) {
                gate.lift();
            }
        }
    }

    /// Writes down that `session` carries its domain's stream to `peer`, once the domain is
    /// known (a user's own migration is named meanwhile), for [`crate::libvirt_fence`]. The
    /// record is written while the memory still flows, long before the stream's end goes out
    /// (from which the destination may resume the domain).
    fn record_stream(
        &self,
        peer: &str,
        session: &Session,
        status: &Shared,
    ) -> tokio::task::JoinHandle<Option<LibvirtStreamRecord>> {
        let (journal, socket, status) = (
            self.journal.clone(),
            self.config.socket.clone(),
            status.clone(),
        );
        let (id, peer) = (session.id().to_string(), peer.to_owned());
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + NAMING_WAIT;
            let mut domain = status.get().vm;
            while domain.starts_with('(') && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
                domain = status.get().vm;
            }
            if domain.starts_with('(') {
                domain = outgoing_domain(&socket).await.unwrap_or(domain);
            }
            if domain.starts_with('(') || domain.contains(" or ") {
                tracing::warn!(
                    "libvirt's migration to {peer} in session {id}: the domain is not known \
                     for sure ({domain}); it is not watched until libvirt settles it"
                );
                return None;
            }
            let record = LibvirtStreamRecord {
                id,
                domain,
                peer,
                started_unix_ms: now_ms(),
            };
            let written = record.clone();
            match tokio::task::spawn_blocking(move || journal.write_libvirt_stream(&written)).await
            {
                Ok(Ok(())) => Some(record),
                Ok(Err(e)) => {
                    tracing::warn!("{e:#}");
                    None
                }
                Err(e) => {
                    tracing::warn!("writing the libvirt stream's record: {e}");
                    None
                }
            }
        })
    }

    /// Once the stream is over: if its end went out, watches the domain until libvirt settled
    /// it at both ends; if not (the destination never had the last bytes, so it cannot
    /// resume), forgets the record.
    fn settle_after_stream(
        &self,
        recorded: tokio::task::JoinHandle<Option<LibvirtStreamRecord>>,
        end_sent: bool,
        status: &Shared,
    ) {
        let (journal, registry, status) =
            (self.journal.clone(), self.registry.clone(), status.clone());
        let config = self.config.clone();
        tokio::spawn(async move {
            let Ok(Some(record)) = recorded.await else {
                return;
            };
            if end_sent {
                let ends = fence_ends(&config, &record.peer);
                crate::libvirt_fence::watch(journal, ends, record, Some(status), registry);
            } else if let Err(e) = journal.remove_libvirt_stream(&record.id) {
                tracing::warn!("{e:#}");
            }
        });
    }

    /// This host's libvirt and `peer`'s, through the RPC tunnel to it.
    pub fn fence_ends(&self, peer: &str) -> crate::libvirt_fence::Ends {
        fence_ends(&self.config, peer)
    }

    /// Lists a migration stream nobody here drives (a user's own `virsh migrate`), named
    /// after the domain libvirt says is migrating out.
    fn register_unclaimed(&self, peer_name: &str, session: &Session) -> Shared {
        let status = Shared::new(MigrationStatus::starting(
            session.id().to_string(),
            "(a libvirt domain)".into(),
            now_ms(),
        ));
        // Named meanwhile: QEMU's bytes do not wait for virsh.
        let (naming, socket) = (status.clone(), self.config.socket.clone());
        tokio::spawn(async move {
            if let Some(vm) = outgoing_domain(&socket).await {
                naming.update(|s| s.vm = vm);
            }
        });
        status.update(|s| s.detail = format!("libvirt's migration to {peer_name}"));
        crate::engine::status::register(&self.registry, session.id().to_string(), status.clone());
        status
    }
}

/// What is buffered here still has to cross after QEMU stops the VM: the session's window
/// becomes ferry's own (twice the link's bandwidth-delay product) once the first connection
/// measured the round trip, not the default 4 MiB (a third of a second at 100 Mbit/s).
///
/// `shared_by`: the multifd channels of one migration split one window between them, or what
/// they buffer when QEMU stops the VM (and what QEMU takes for the link's rate) would grow
/// with their number.
fn size_window(
    session: &Session,
    mut link_events: tokio::sync::mpsc::UnboundedReceiver<LinkEvent>,
    rate_mbit: Option<f64>,
    recording: Option<Recording>,
    shared_by: Option<Arc<AtomicUsize>>,
) {
    let sizing = session.clone();
    tokio::spawn(async move {
        while let Some(event) = link_events.recv().await {
            if let LinkEvent::Connected { rtt, .. } = event {
                let rtt_ms = rtt.as_secs_f64() * 1e3;
                let mut window = crate::engine::source::send_window(rate_mbit, rtt_ms);
                if let Some(sharing) = &shared_by {
                    let channels = sharing.load(Ordering::Relaxed).max(1);
                    window = (window / channels).max(MIN_CHANNEL_WINDOW);
                }
                sizing.set_send_limit(window);
                match recording {
                    Some(Recording::Stream(status, count)) => {
                        let decided = count.get();
                        status.update(|s| {
                            s.wire.rtt_ms = Some(rtt_ms);
                            if let Some(d) = decided {
                                s.wire.connections = d.connections;
                                s.event(EventKind::Connected, connected("QEMU's stream", &d));
                                s.wire.connections_why = d.why;
                            }
                        });
                    }
                    Some(Recording::Disk(status, count)) => status.update(|s| {
                        s.wire.rtt_ms = Some(rtt_ms);
                        if let Some(d) = count.get() {
                            s.event(EventKind::Connected, connected("a disk's copy", &d));
                        }
                    }),
                    None => {}
                }
                return;
            }
        }
    });
}

/// The migration whose tunnel [`size_window`] sizes, and what the tunnel carries: QEMU's
/// stream (its connection count is the migration's, as on the ferry path) or a disk's copy
/// (an event only).
enum Recording {
    Stream(Shared, ConnectionCount),
    Disk(Shared, ConnectionCount),
}

/// The event that says how many connections a tunnel keeps, and why.
fn connected(what: &str, decided: &ferry_wire::connection_count::Decided) -> String {
    let n = decided.connections;
    match &decided.why {
        Some(why) => format!("{what}: {n} connection(s): {why}"),
        None => format!("{what}: {n} connection(s)"),
    }
}

/// A user's own migration was delivered: once libvirt finished it at the destination, the
/// whole job's figures (the real pause among them) from there, as for one ferry drives.
async fn completed_job(there: Libvirt, status: Shared) {
    let deadline = tokio::time::Instant::now() + COMPLETED_JOB_WAIT;
    let mut job = Err(anyhow!(
        "libvirt's migration did not finish within {}s",
        COMPLETED_JOB_WAIT.as_secs()
    ));
    while tokio::time::Instant::now() < deadline {
        // Named meanwhile by the source's libvirt; several candidates cannot be told apart.
        let vm = status.get().vm;
        if !vm.contains(" or ") && !vm.starts_with('(') {
            job = there.job(&vm, true).await;
            if job.as_ref().is_ok_and(|j| j.downtime_ms.is_some()) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    record_completed(&status, job);
}

/// The domain migrating out through this tunnel, as the source's libvirt names it (one
/// name, or the candidates when several migrate at once).
async fn outgoing_domain(libvirt_socket: &Path) -> Option<String> {
    match crate::libvirt::outgoing_domains(libvirt_socket).await {
        Ok(names) if !names.is_empty() => Some(names.join(" or ")),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!("naming the migrating domain: {e:#}");
            None
        }
    }
}

/// A driven migration's domain and its disks' images by export, for its disk relays.
fn domain_disks(claimed: &Claimed) -> DomainDisks {
    let disks = claimed.copies.disks.as_ref().and_then(|d| d.as_ref().ok());
    DomainDisks {
        domain: claimed.status.get().vm,
        images: disks
            .into_iter()
            .flatten()
            .map(|d| (d.export(), d.chain.clone()))
            .collect(),
    }
}

fn fence_ends(config: &LibvirtConfig, peer: &str) -> crate::libvirt_fence::Ends {
    crate::libvirt_fence::Ends {
        here: Libvirt::new(&config.socket),
        there: Libvirt::through(socket_path(config, peer, 0, TunnelKind::LibvirtRpc)),
    }
}

/// What the destination of a tunnel session reaches on this host.
pub struct Reachable {
    pub config: Option<LibvirtConfig>,
    /// The indexes kept when domains left this host, for a disk relay's destination.
    pub disk_memory: DiskMemory,
    pub own_name: String,
    pub overlay: Option<Arc<Overlay>>,
    /// Serves swap tunnels.
    pub lender: Arc<Lender>,
}

/// The destination's side of a tunnel session: connects to the socket of `kind` on this host
/// (or serves it, for swap) and carries both ways.
pub async fn serve_destination(session: Session, carried: Carried, here: Reachable) {
    let Reachable {
        config,
        disk_memory,
        own_name,
        overlay,
        lender,
    } = here;
    let Carried {
        version,
        kind,
        coded,
        multifd,
        from,
        slot,
    } = carried;
    let result = async {
        if version != CONTROL_VERSION {
            bail!(
                "the source agent speaks control version {version}, this one {CONTROL_VERSION}: \
                 run the same ferry release on both hosts"
            );
        }
        if kind == TunnelKind::Swap {
            let from = from.ok_or_else(|| anyhow!("a swap tunnel must name its agent"))?;
            return lend_swap(&session, from, lender).await;
        }
        let config = config.ok_or_else(|| {
            anyhow!("this agent carries no libvirt tunnels (no [libvirt] section in its config)")
        })?;
        let target = match kind {
            TunnelKind::LibvirtRpc => config.socket.clone(),
            TunnelKind::Migration | TunnelKind::Nbd | TunnelKind::Swap => {
                socket_path(&config, &own_name, slot, kind)
            }
        };
        if kind == TunnelKind::Nbd && coded {
            let relayed = relay::destination(&session, &target, disk_memory);
            return within_wan_timeout(&session, relayed).await;
        }
        let conn = match kind {
            // The daemon's socket is there or libvirtd is down: no waiting.
            TunnelKind::LibvirtRpc => UnixStream::connect(&target).await.with_context(|| {
                format!(
                    "this host's libvirt does not answer at {} (is libvirtd running?)",
                    target.display()
                )
            })?,
            _ => connect_when_there(&target).await?,
        };
        if coded {
            let (read, write) = conn.into_split();
            let delivered =
                within_wan_timeout(&session, tunnel_stream::destination(&session, read, write))
                    .await;
            // QEMU has the whole verified stream: the VM resumes here next.
            if let (Ok(()), false, Some(overlay), Some(from)) =
                (&delivered, multifd, &overlay, &from)
            {
                overlay.arrived(from).await;
            }
            delivered
        } else {
            let mut conn = conn;
            pipe(&mut conn, Vec::new(), &session, RETURN_PATH, STREAM).await
        }
    }
    .await;
    if let Err(e) = &result {
        tracing::warn!("tunnel {kind:?} session {}: {e:#}", session.id());
    }
    finish(&session, &result, "destination").await;
}

/// Serves swap in this host's memory ([`crate::lend`]) to the peer `from` over `session`,
/// until its QEMU disconnects.
async fn lend_swap(session: &Session, from: String, lender: Arc<Lender>) -> Result<()> {
    let (mut near, far) = tokio::io::duplex(1 << 20);
    let loan = Loan::new(lender, from);
    let served = async {
        // Over, the duplex's end closes: the tunnel sees the end of the local stream.
        let end = ferry_qemu::nbd::serve(far, &*loan, loan.clone()).await;
        if matches!(end, Ok(ferry_qemu::nbd::ServeEnd::Disconnected)) {
            loan.disconnected();
        }
        match loan.refusal() {
            // Said at once, while the borrower still listens (the Abort carries it).
            Some(why) => Err(anyhow!("{why}")),
            None => end.context("swap export"),
        }
    };
    let carried = pipe(&mut near, Vec::new(), session, RETURN_PATH, STREAM);
    tokio::pin!(served, carried);
    let (served, carried) = tokio::select! {
        s = &mut served => match s {
            Err(e) => return Err(e),
            Ok(end) => (Ok(end), carried.await),
        },
        c = &mut carried => match c {
            // The export goes with the tunnel (it would wait for the borrower forever); the
            // loan, not ended cleanly, is kept for the borrower's return.
            Err(e) => return Err(e),
            Ok(()) => (served.await, Ok(())),
        },
    };
    tracing::info!(
        "swap loan ended ({:?}); it held {} MiB",
        served.as_ref().ok(),
        loan.resident() >> 20
    );
    served.map(drop).and(carried)
}

async fn connect_when_there(path: &Path) -> Result<UnixStream> {
    let deadline = tokio::time::Instant::now() + TARGET_WAIT;
    loop {
        match UnixStream::connect(path).await {
            Ok(c) => return Ok(c),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(e).with_context(|| format!("connect to {}", path.display()))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Carries `conn` (of which `first` was read already) over `session`: what it reads goes out
/// on `out`, what arrives on `inn` is written to it; an end of input is a barrier. Returns
/// when both directions have ended, or fails when the session does or the WAN is down for
/// longer than [`WAN_TIMEOUT`].
async fn pipe(
    conn: &mut (impl AsyncRead + AsyncWrite + Unpin),
    first: Vec<u8>,
    session: &Session,
    out: ferry_wire::ChannelId,
    inn: ferry_wire::ChannelId,
) -> Result<()> {
    let (mut read, mut write) = tokio::io::split(conn);
    let upstream = async {
        if !first.is_empty() {
            session.send(out, Bytes::from(first)).await?;
        }
        tunnel_stream::forward(&mut read, session, out).await
    };
    let downstream = async {
        loop {
            match session.recv(inn).await? {
                Received::Data(bytes) => write
                    .write_all(&bytes)
                    .await
                    .context("writing the local socket")?,
                Received::Barrier => {
                    let _ = write.shutdown().await;
                    return Ok::<(), anyhow::Error>(());
                }
            }
        }
    };
    let both = async {
        tokio::select! {
            r = async { tokio::try_join!(upstream, downstream) } => r.map(|_| ()),
            msg = control::recv(session) => match msg {
                Ok(Control::Abort { reason }) => Err(PeerAborted(reason).into()),
                Ok(other) => bail!("unexpected control message in a tunnel: {other:?}"),
                Err(e) => Err(e),
            },
        }
    };
    within_wan_timeout(session, both).await
}

/// The least send window a multifd channel gets, however many share one.
const MIN_CHANNEL_WINDOW: usize = 128 << 10;

/// Takes one off a count when dropped.
struct Decrement(Arc<AtomicUsize>);

impl Drop for Decrement {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs `work`, failing it when `session` has had no connection for [`WAN_TIMEOUT`].
async fn within_wan_timeout<T>(
    session: &Session,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let watchdog = async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if session.idle_for() > WAN_TIMEOUT {
                bail!(
                    "no connection to the peer for {}s (the WAN timeout)",
                    WAN_TIMEOUT.as_secs()
                );
            }
        }
    };
    tokio::select! {
        r = work => r,
        r = watchdog => r,
    }
}

/// Ends a tunnel session: its connections park for the next one when it ended well; when it
/// failed, the other end (`side` names this one) is told why first, unless its own `Abort` is
/// the failure, so that it gives up at once instead of waiting out the WAN timeout for
/// connections that will not come back.
async fn finish(session: &Session, result: &Result<()>, side: &str) {
    match result {
        Ok(()) => {
            let _ = tokio::time::timeout(Duration::from_secs(5), session.flushed(STREAM)).await;
            let _ =
                tokio::time::timeout(Duration::from_secs(5), session.flushed(RETURN_PATH)).await;
            control::park_and_end(session, "tunnel closed").await;
        }
        Err(e) => {
            if !e.chain().any(|cause| cause.is::<PeerAborted>()) {
                let abort = Control::Abort {
                    reason: format!("{side}: {e:#}"),
                };
                // Done once the other end read it. Frames queued before it (a stream's End
                // among them) may still cross meanwhile: the source watches a stream whose End
                // went out whatever became of it (`settle_after_stream`).
                let _ = tokio::time::timeout(ABORT_GRACE, async {
                    control::send(session, &abort).await?;
                    Ok::<_, anyhow::Error>(session.flushed(control::CONTROL).await?)
                })
                .await;
            }
            session.fail(format!("{e:#}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::test_session;

    /// Half of a local socket pair standing in for QEMU's end of a tunnel.
    fn qemu_end() -> (
        tokio::net::unix::OwnedReadHalf,
        tokio::net::unix::OwnedWriteHalf,
        UnixStream,
    ) {
        let (ours, qemu) = UnixStream::pair().unwrap();
        let (read, write) = ours.into_split();
        (read, write, qemu)
    }

    #[tokio::test]
    async fn a_source_that_fails_tells_the_destination_at_once() {
        let (source, destination) = test_session::pair().await;
        let destination_end = destination.clone();
        let (read, write, _qemu) = qemu_end();
        let waiting =
            tokio::spawn(
                async move { tunnel_stream::destination(&destination, read, write).await },
            );
        let failed = Err(anyhow!("QEMU's stream: connection reset"));
        finish(&source, &failed, "source").await;
        // Without the Abort the destination would wait for connections that never come back
        // (the tunnel's WAN timeout, minutes).
        let error = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("the destination gave up at once")
            .unwrap()
            .unwrap_err();
        assert_eq!(
            format!("{error:#}"),
            "source: QEMU's stream: connection reset"
        );
        // Failed by the source's Abort, the destination has nobody to tell and does not wait
        // for an answer that will not come.
        let started = tokio::time::Instant::now();
        finish(&destination_end, &Err(error), "destination").await;
        assert!(
            started.elapsed() < ABORT_GRACE,
            "waited {:?}",
            started.elapsed()
        );
    }
}
