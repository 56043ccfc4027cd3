//! The messages the two agents of a migration exchange on the session's control channel
//! (JSON, one per frame), and the channel numbers.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use ferry_api::agent::{CodecSettings, DestinationSwitchover, SeedReport};
use ferry_qemu::commands::{Capability, MigrateSetCapabilities};
use ferry_wire::{ChannelId, Received, Session};
use serde::{Deserialize, Serialize};

/// Control messages, both ways.
pub const CONTROL: ChannelId = ChannelId(0);
/// QEMU's migration stream, source to destination.
pub const STREAM: ChannelId = ChannelId(1);
/// QEMU's return path, destination to source.
pub const RETURN_PATH: ChannelId = ChannelId(2);
/// The destination's seed index, destination to source, before the stream starts.
pub const SEED: ChannelId = ChannelId(3);
/// Disk writes (snapshots of the transmit buffer), source to destination.
pub const DISK: ChannelId = ChannelId(4);
/// Disk snapshots applied, destination to source.
pub const DISK_ACK: ChannelId = ChannelId(5);
/// The index of what the destination's disks already hold, destination to source, before the
/// mirrors start.
pub const DISK_BASE: ChannelId = ChannelId(6);
/// QEMU's postcopy preempt channel (the pages the destination's vCPUs fault on), source to
/// destination, raw and urgent: its frames overtake the stream's queued ones.
pub const PREEMPT: ChannelId = ChannelId(7);
/// The backing layers the destination asked for (`NeedLayers`), source to destination, each
/// file whole, in the order asked, zstd frame by frame ([`crate::engine::disk::layers`]).
pub const LAYERS: ChannelId = ChannelId(8);

/// A disk to move: the QEMU node name (the same at both ends) and its size in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskPlan {
    pub node: String,
    pub size: u64,
    /// The digest of the source's backing chain (every file below the overlay, in order:
    /// `disk::backing`), when the disk is an overlay.
    #[serde(default)]
    pub backing_sha256: Option<String>,
    /// Sessions since whose arrival at the source a dirty bitmap on this disk recorded every
    /// write (`disk::since`): a destination still holding the copy the VM left at the end of
    /// one of them need not index it.
    #[serde(default)]
    pub tracked_since: Vec<String>,
    /// What the destination needs to make the disk's image where it has none. None: an
    /// older source.
    #[serde(default)]
    pub image: Option<ImageShape>,
    /// The files of the source's backing chain, top down (the digest above is over their
    /// hashes): what a destination that lacks some of them may ask for (`NeedLayers`).
    #[serde(default)]
    pub layers: Vec<Layer>,
}

/// One file of a disk's backing chain at the source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layer {
    /// The file as the image above names it (a relative name is relative to that image's
    /// directory).
    pub name: String,
    /// Its format, as the image above records it (None: not recorded).
    #[serde(default)]
    pub format: Option<String>,
    /// The file's length and SHA-256.
    pub bytes: u64,
    pub sha256: String,
}

/// A layer the destination asks for: layer `layer` (top down, of `DiskPlan.layers`) of disk
/// `disk` (of `Prepare.disks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerWanted {
    pub disk: u32,
    pub layer: u32,
}

/// A disk image's format and its backing file as the image names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageShape {
    pub format: String,
    #[serde(default)]
    pub backing: Option<String>,
    #[serde(default)]
    pub backing_format: Option<String>,
}

/// The version of these messages this agent speaks; `Prepare` carries it and the destination
/// refuses any other (rule: a change an older peer would misread raises it; fields an older
/// peer may omit carry a serde default and do not).
/// 2: `Prepare.destination` (was `destination_qmp`); `Tunnel`.
/// 3: `Tunnel.coded`, `Checkpoint`, `Delivered` (a version-2 peer would pass a coded stream on
/// as raw bytes).
/// 4: a coded NBD tunnel is a disk relay (`NbdExport`, `NbdExportOpened`); the destination
/// refuses a tunnel of another version.
/// 5: tunnels name their slot (concurrent driven migrations to one peer).
/// 6: swap tunnels (memory lent to a peer's VM, [`crate::lend`]).
/// 7: `Verdict` and `VerdictIs` (a source in doubt asks the destination what became of a
/// session).
/// 8: `Tunnel.multifd`: QEMU's multifd channels cross coded (a version-7 peer would take one
/// for a main stream).
/// 10: `Prepare.postcopy`; with it `Checkpoint` marks the postcopy package's end on the main
/// stream, and `Committed` comes before `End` (a version-9 destination would refuse the
/// postcopy capability's stream).
/// 11: postcopy with QEMU's preempt channel (`PREEMPT`, `End.preempt`): both QEMUs must have
/// the capability, or the faulted pages would go to a channel the destination never opens.
/// 12: `ResumePostcopy` and `PostcopyRecovering` (QEMU's postcopy recovery after an agent was
/// lost past the switch).
/// 13: `Verdict::PostcopyPaused` (the destination's agent restarted past the switch: the
/// running source resumes the migration).
/// 14: `Lost` and `Verdict::Lost` (a QEMU exited past the postcopy switch).
/// 15: `NbdExportOpened.older_copy` and `NbdOlderCopy` (a disk relay's destination indexes the
/// copy it holds; a version-14 source would take the index's announcement for a stray message).
/// 16: `NeedLayers` (a destination asks for the backing layers it lacks; a version-15 source
/// would take it for a wrong answer to `Prepare`).
/// 17: `Prepare.shards`: the stream channel's codec in units of shard lanes and order units
/// ([`crate::engine::pipeline`]; a version-16 destination would read them as batches).
/// 18: a shard unit's flag says its batch was coded with the block cache paused
/// ([`crate::engine::pipeline::governor`]; a version-17 destination refuses unit flags).
/// 19: `NbdExport.domain` and `NbdOlderCopy.remembered`/`note`: a disk relay's destination may
/// send the index it kept when the domain left ([`crate::disk_memory`]) instead of reading its
/// image; a version-18 source would report it as read.
pub const CONTROL_VERSION: u32 = 19;

/// What crossed on a channel of QEMU's: bytes and their digest ([`crate::engine::digest`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Carried {
    pub bytes: u64,
    pub digest: String,
}

/// The QEMU that receives the stream, as the source asks for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Incoming {
    /// Started by its owner with `-S -incoming defer`: its QMP socket on the destination host.
    Qmp(PathBuf),
    /// To be started by the destination agent from this command line (program first; the
    /// source QEMU's own or one the user gave), made a destination by
    /// [`ferry_qemu::incoming::incoming_argv`].
    Launch(Vec<String>),
}

/// The other end's `Abort` in a libvirt tunnel, as an error (its reason names the end that gave
/// up): an end failed by it has nobody left to tell.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PeerAborted(pub String);

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Control {
    /// Source: get the destination QEMU ready to receive.
    Prepare {
        /// [`CONTROL_VERSION`] of the source (1 when absent: agents from before it).
        #[serde(default = "version_one")]
        version: u32,
        vm: String,
        destination: Incoming,
        wan_timeout_s: u64,
        /// QEMU's return path on (both QEMUs must agree).
        #[serde(default)]
        return_path: bool,
        /// QEMU's postcopy-ram on (both QEMUs must agree): the source may switch to postcopy
        /// ([`crate::engine::postcopy`]).
        #[serde(default)]
        postcopy: bool,
        /// The codec's techniques on the stream channel (none: QEMU's bytes as they are).
        #[serde(default = "no_codec")]
        codec: CodecSettings,
        /// The codec's page history at each end (both must be the same size).
        #[serde(default)]
        history_bytes: u64,
        /// With the codec on: how many shards the stream channel is coded in
        /// ([`crate::engine::pipeline`]), 1 to 16.
        #[serde(default)]
        shards: u32,
        /// Test hook (the source's `test_shards`): decode more than one shard on threads
        /// whatever this host's cores, so that the tests meet the threaded decoder.
        #[serde(default)]
        test_decode_threads: bool,
        /// With seeding on: whose earlier image to index (none: the VM's own).
        #[serde(default)]
        seed_from: Option<String>,
        /// The disks whose writes follow on the disk channel; the destination exports them.
        #[serde(default)]
        disks: Vec<DiskPlan>,
    },
    /// Destination, before `Ready`, where it starts the VM itself: it lacks these files of the
    /// disks' backing chains. The source sends them on [`LAYERS`], in this order, before the
    /// destination makes the disks' images on them and goes on.
    NeedLayers { layers: Vec<LayerWanted> },
    /// Destination: QEMU listens and the stream may start. With a seed image, its index
    /// (`seed.index_bytes` bytes) follows on the seed channel.
    Ready {
        #[serde(default)]
        seed: Option<SeedReport>,
        /// With disks that already hold an older copy: the size of their index
        /// ([`ferry_codec::DiskBase`]), which follows on the disk-base channel.
        #[serde(default)]
        disk_base_bytes: Option<u64>,
        /// Per disk of `Prepare`: the destination's image is a fresh overlay on a backing image
        /// with the same content as the source's, so only the source's overlay is to be
        /// copied (SnapMig). Missing entries are false.
        #[serde(default)]
        top_only: Vec<bool>,
        /// Per disk of `Prepare`: the session of `tracked_since` whose end this destination's
        /// copy is untouched since (then no index follows, and the source sends what its
        /// bitmaps say changed). None: not every disk matched.
        #[serde(default)]
        disk_since: Option<Vec<String>>,
        /// Why the destination's older copy is indexed rather than matched by bitmap, and how
        /// long the index took.
        #[serde(default)]
        disk_base_note: Option<String>,
        #[serde(default)]
        disk_index_ms: Option<u64>,
        /// RAM blocks whose every page is zero at the destination before the stream (a fresh
        /// memory file): their zero pages cost the destination nothing until the stream gives
        /// them content ([`crate::engine::load_sieve`]).
        #[serde(default)]
        zeroed_blocks: Vec<String>,
        /// Disk images the destination made for this migration (it had none at their paths).
        #[serde(default)]
        images_made: u32,
    },
    /// Source: the disk mirrors completed (the VM is paused): this many snapshots went on the
    /// disk channel, and their operations have this digest ([`crate::engine::digest`]).
    DiskEnd { snapshots: u64, digest: String },
    /// Source: QEMU wrote its whole stream: this many bytes, with this digest; and in
    /// postcopy, what it wrote on its preempt channel.
    End {
        bytes: u64,
        digest: String,
        #[serde(default)]
        preempt: Option<Carried>,
    },
    /// Source: the stream's first `bytes` have this digest. On a tunnelled stream the
    /// destination QEMU may read them once they match ([`crate::engine::tunnel_stream`]); on
    /// a postcopy migration they end with the package, which the destination QEMU gets once
    /// they match ([`crate::engine::postcopy`]).
    Checkpoint { bytes: u64, digest: String },
    /// Destination: every digest matched and QEMU read the whole stream (wall clock, µs). On a
    /// tunnelled stream libvirt decides the rest; in postcopy the last page has arrived.
    Delivered {
        fed_unix_us: i64,
        /// Postcopy: how long every vCPU at once waited for a page (QEMU's
        /// `postcopy-blocktime`, ms), when the destination QEMU counted it.
        #[serde(default)]
        postcopy_blocktime_ms: Option<u64>,
    },
    /// Destination: digests matched, QEMU loaded and now runs (QMP RESUME time). In postcopy
    /// it comes at the switch, before the stream's `End`.
    Committed {
        resume_unix_us: i64,
        /// When the stream had arrived and when QEMU had loaded it (absent from older agents).
        #[serde(default)]
        switchover: Option<DestinationSwitchover>,
    },
    /// Either side: the migration stops here, for this reason. The source resumes its VM.
    Abort { reason: String },
    /// Either side, past the postcopy switch: this side's QEMU exited, and with it the VM
    /// (destination) or the pages not yet crossed (source). Nothing can recover them; neither
    /// side resumes or quits what is left.
    Lost { reason: String },
    /// Source, on a disk relay ([`crate::engine::disk::relay`]): QEMU's mirror asks for this
    /// export of the destination QEMU's NBD server.
    NbdExport {
        name: String,
        codec: CodecSettings,
        /// The domain whose disk it is, when the source knows (a migration it drives), and
        /// the disk's image then its backing files as the source's libvirt has them (libvirt
        /// opens the same paths at the destination): the destination may have kept its index
        /// when the domain left.
        #[serde(default)]
        domain: Option<String>,
        #[serde(default)]
        chain: Vec<std::path::PathBuf>,
    },
    /// Destination, on a disk relay: the export is open and this large, or why not.
    NbdExportOpened {
        #[serde(default)]
        size: Option<u64>,
        #[serde(default)]
        error: Option<String>,
        /// The export holds data (an older copy of the disk): its index follows
        /// (`NbdOlderCopy`), and the source must not let QEMU zero the export first.
        #[serde(default)]
        older_copy: bool,
    },
    /// Destination, on a disk relay whose export holds data: its index (the export's blocks
    /// that hold data, hashed, `codec::disk_base`) follows on [`DISK_BASE`], this long.
    NbdOlderCopy {
        index_bytes: u64,
        index_ms: u64,
        /// The index was kept when the domain left, not read from the image now.
        #[serde(default)]
        remembered: bool,
        /// Why a kept index could not stand for the image, when there was a reason to look.
        #[serde(default)]
        note: Option<String>,
    },
    /// Source, instead of `Prepare`: this session carries one unix-socket connection to the
    /// destination's socket of this kind ([`crate::tunnel`]).
    Tunnel {
        #[serde(default = "version_one")]
        version: u32,
        kind: TunnelKind,
        /// The connection carries QEMU's main migration stream, coded and digest-gated
        /// ([`crate::engine::tunnel_stream`]), or (on an NBD tunnel) QEMU's mirror, answered
        /// at the source ([`crate::engine::disk::relay`]); otherwise its bytes cross as they
        /// are.
        #[serde(default)]
        coded: bool,
        /// With `coded` on a migration tunnel: the connection is one of QEMU's multifd
        /// channels, not its main stream.
        #[serde(default)]
        multifd: bool,
        /// The source agent's name (its certificate's): at the switchover the destination
        /// re-points the pools' MACs moving from there ([`crate::overlay`]).
        #[serde(default)]
        from: Option<String>,
        /// Which of the peer's tunnel directories the connection came to: 0 is the
        /// directory users' own `virsh migrate` names, 1 and up the ones each migration this
        /// agent drives has to itself ([`crate::tunnel::socket_path`]).
        #[serde(default)]
        slot: u32,
    },
    /// Source, instead of `Prepare`, on a session of its own: what became of the migration
    /// that ran on session `of` (the source is in doubt: it sent the stream's end and heard
    /// nothing since, or it restarted after sending it).
    Verdict {
        #[serde(default = "version_one")]
        version: u32,
        #[serde(with = "crate::engine::journal::session_hex")]
        of: ferry_wire::SessionId,
        /// When the migration started (the source's wall clock, ms): a destination that no
        /// longer keeps records that old cannot say it never committed.
        #[serde(default)]
        started_unix_ms: u64,
    },
    /// Destination: the answer to `Verdict`.
    VerdictIs {
        verdict: crate::engine::journal::Verdict,
    },
    /// Source, instead of `Prepare`, on a session of its own: the postcopy migration of
    /// session `of` lost its connection between an agent and its QEMU past the switch (an
    /// agent restarted); the source QEMU resumes it through QEMU's postcopy recovery, and
    /// this session carries the resumed stream ([`crate::engine::postcopy_recovery`]).
    ResumePostcopy {
        version: u32,
        #[serde(with = "crate::engine::journal::session_hex")]
        of: ferry_wire::SessionId,
    },
    /// Destination: its QEMU listens for the resumed stream (`migrate-recover`).
    PostcopyRecovering,
}

/// What a tunnelled connection reaches at the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TunnelKind {
    /// The destination host's libvirtd (libvirt's RPC, peer to peer).
    LibvirtRpc,
    /// The destination QEMU's incoming migration socket.
    Migration,
    /// The destination QEMU's NBD server (libvirt's disk copy).
    Nbd,
    /// The peer agent's own NBD server: swap space in its spare memory for a VM here
    /// ([`crate::lend`], [`crate::borrow`]).
    Swap,
}

impl TunnelKind {
    pub const ALL: [TunnelKind; 4] = [
        TunnelKind::LibvirtRpc,
        TunnelKind::Migration,
        TunnelKind::Nbd,
        TunnelKind::Swap,
    ];

    /// The socket's file name in a tunnel directory.
    pub fn socket_name(self) -> &'static str {
        match self {
            TunnelKind::LibvirtRpc => "rpc.sock",
            TunnelKind::Migration => "mig.sock",
            TunnelKind::Nbd => "nbd.sock",
            TunnelKind::Swap => "swap.sock",
        }
    }
}

fn version_one() -> u32 {
    1
}

fn no_codec() -> CodecSettings {
    CodecSettings::NONE
}

/// Tells the peer the migration stops, for `reason`, and waits until the peer has the message
/// (a session failed next would drop it unsent), at most `within`: a peer that is gone must not
/// hold up the failure it is told of.
pub async fn tell_abort(session: &Session, reason: String, within: Duration) {
    tell(session, &Control::Abort { reason }, within).await;
}

/// Sends `msg` as [`tell_abort`] does: waiting until the peer has it, at most `within`.
pub async fn tell(session: &Session, msg: &Control, within: Duration) {
    let told = async {
        send(session, msg).await?;
        session.flushed(CONTROL).await?;
        anyhow::Ok(())
    };
    let _ = tokio::time::timeout(within, told).await;
}

pub async fn send(session: &Session, msg: &Control) -> Result<()> {
    let bytes = serde_json::to_vec(msg).expect("control messages serialize");
    session.send(CONTROL, Bytes::from(bytes)).await?;
    Ok(())
}

/// A blob announced as `bytes` long, sent in pieces on `channel`; refused before anything is
/// held when the announced size is beyond `limit` (the most an honest peer's can be).
pub async fn recv_blob(
    session: &Session,
    channel: ChannelId,
    bytes: u64,
    limit: u64,
    what: &str,
) -> Result<Vec<u8>> {
    if bytes > limit {
        anyhow::bail!(
            "the destination announced a {bytes}-byte {what}, more than the {limit} bytes it can \
             take for this VM"
        );
    }
    let mut blob = Vec::new();
    while (blob.len() as u64) < bytes {
        match session.recv(channel).await? {
            Received::Data(piece) => blob.extend_from_slice(&piece),
            Received::Barrier => anyhow::bail!("unexpected barrier on the {what} channel"),
        }
    }
    if blob.len() as u64 != bytes {
        anyhow::bail!(
            "the destination announced a {bytes}-byte {what} and sent {}",
            blob.len()
        );
    }
    Ok(blob)
}

/// Sends `blob` on `channel` in pieces of 256 KiB (so that it shares the connections).
pub async fn send_blob(session: &Session, channel: ChannelId, blob: &[u8]) -> Result<()> {
    for piece in blob.chunks(256 << 10) {
        session.send(channel, Bytes::copy_from_slice(piece)).await?;
    }
    Ok(())
}

pub async fn recv(session: &Session) -> Result<Control> {
    match session.recv(CONTROL).await? {
        Received::Data(b) => decode(&b),
        Received::Barrier => anyhow::bail!("unexpected barrier on the control channel"),
    }
}

/// A control message from its bytes. A `Prepare` of another version is refused by its version,
/// before its fields are read (they may mean something else there).
pub fn decode(bytes: &[u8]) -> Result<Control> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).context("malformed control message from the peer")?;
    if matches!(
        value.get("type").and_then(|t| t.as_str()),
        Some("prepare" | "tunnel" | "verdict")
    ) {
        let version = value.get("version").and_then(|v| v.as_u64()).unwrap_or(1);
        if version != u64::from(CONTROL_VERSION) {
            anyhow::bail!(
                "the source agent speaks control version {version}, this agent {CONTROL_VERSION}: run the same ferry release at both ends"
            );
        }
    }
    serde_json::from_value(value).context("malformed control message from the peer")
}

/// The capabilities both QEMUs get: every one that changes the stream's format (or pauses it)
/// explicitly off, because ferry carries precopy and a VM that arrived by multifd would
/// otherwise still have it on; events on; the return path and postcopy as asked.
/// `dirty-bitmaps` (the disks' bitmaps in the stream, and QEMU's postcopy advice with it) is
/// for libvirt's path, whose tunnels carry it; on this path ferry moves the disks itself.
pub fn stream_capabilities(return_path: bool, postcopy: bool) -> MigrateSetCapabilities {
    let off = [
        "xbzrle",
        "multifd",
        "pause-before-switchover",
        "mapped-ram",
        "dirty-bitmaps",
    ];
    let cap = |name: &str, state: bool| Capability {
        capability: name.into(),
        state,
    };
    MigrateSetCapabilities {
        capabilities: off
            .iter()
            .map(|c| cap(c, false))
            .chain([
                cap("events", true),
                cap("return-path", return_path),
                cap("postcopy-ram", postcopy),
                // The pages the destination faults on come on a channel of their own, which
                // the agents carry ahead of the stream ([`PREEMPT`]).
                cap("postcopy-preempt", postcopy),
                // The destination then counts the time its vCPUs waited for pages.
                cap("postcopy-blocktime", postcopy),
            ])
            .collect(),
    }
}

/// How long a finished session waits for its connections to park (one round trip when the
/// peer is there) before it closes them instead.
const PARK_GRACE: Duration = Duration::from_secs(2);

/// Ends a session that did its work: its connections park (see `ferry_wire::net::Pool`) so the
/// next migration to the same peer starts on a warm one, then the session ends with `reason`.
pub async fn park_and_end(session: &Session, reason: &str) {
    session.park();
    let _ = tokio::time::timeout(PARK_GRACE, session.parked()).await;
    session.fail(reason);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_blob_announced_beyond_its_limit_is_refused_before_any_is_held() {
        let session = Session::new(
            ferry_wire::SessionId(1),
            ferry_wire::SessionConfig::default(),
        );
        let err = recv_blob(&session, SEED, 1 << 40, 1 << 20, "seed index")
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the destination announced a 1099511627776-byte seed index, more than the 1048576 \
             bytes it can take for this VM"
        );
    }

    #[test]
    fn a_verdict_question_names_its_session_whole() {
        let of = ferry_wire::SessionId(u128::MAX - 1);
        let msg = Control::Verdict {
            version: CONTROL_VERSION,
            of,
            started_unix_ms: 1,
        };
        let back = decode(&serde_json::to_vec(&msg).unwrap()).unwrap();
        assert!(
            matches!(back, Control::Verdict { of: o, .. } if o == of),
            "{back:?}"
        );
    }

    #[test]
    fn a_prepare_of_another_version_is_refused_by_its_version() {
        let old = br#"{"type":"prepare","vm":"v","destination_qmp":"/d","wan_timeout_s":1}"#;
        assert_eq!(
            format!("{:#}", decode(old).unwrap_err()),
            format!("the source agent speaks control version 1, this agent {CONTROL_VERSION}: run the same ferry release at both ends")
        );
        let msg = Control::Prepare {
            version: CONTROL_VERSION,
            vm: "v".into(),
            destination: Incoming::Launch(vec!["qemu".into()]),
            wan_timeout_s: 1,
            return_path: false,
            postcopy: false,
            codec: CodecSettings::ALL,
            history_bytes: 0,
            shards: 1,
            test_decode_threads: false,
            seed_from: None,
            disks: Vec::new(),
        };
        let back = decode(&serde_json::to_vec(&msg).unwrap()).unwrap();
        assert!(
            matches!(back, Control::Prepare { destination: Incoming::Launch(a), .. } if a == ["qemu"])
        );
        assert!(format!("{:#}", decode(b"{\"type\":\"nope\"}").unwrap_err())
            .starts_with("malformed control message from the peer"));
    }
}
