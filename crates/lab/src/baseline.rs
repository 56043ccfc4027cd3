//! QEMU's own migration straight across the lab WAN: the baseline ferry has to beat.
//!
//! Driven the way libvirt drives it: the destination QEMU starts paused with `-incoming defer`,
//! capabilities are set on both ends, disks are mirrored to the destination's NBD export
//! (`blockdev-mirror` to an `nbd` node) before memory moves, and with disks the source pauses at
//! `pre-switchover` so the mirror can be completed before the destination takes over. The
//! destination is resumed with `cont` once its incoming migration completed.
//!
//! Measured the same way for every system (ARCHITECTURE.md, contracts): downtime from the
//! source's STOP event to the destination's RESUME event by QMP timestamps; WAN bytes from the
//! emulator's counters; the guest's own longest heartbeat gap.
//!
//! Any failure before the destination resumes leaves the source running and removes the
//! destination.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use ferry_api::agent::CodecSettings;
use ferry_api::settings::MigrationSettings;
use ferry_api::{EventKind, Sample, Timeline};
use ferry_qemu::commands::{
    BlockExportAdd, BlockJobCancel, BlockdevAdd, BlockdevMirror, Capability, Cont, Migrate,
    MigrateCancel, MigrateContinue, MigrateIncoming, MigrateSetCapabilities, MigrateSetParameters,
    MigrateStartPostcopy, NbdServerStart, NbdServerStop, QueryMigrate, QueryStatus, Quit,
};
use ferry_qemu::Qmp;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::guest::{GuestLink, Heartbeats};
use crate::topology::{Lab, Site};
use crate::{vm, wan};
use ferry_agent::interrupt;

/// The destination QEMU listens for the migration stream on this port plus an offset that
/// differs per attempt: a cancelled attempt's TCP connect into a dead WAN can stay pending in
/// QEMU and, once the WAN is back, would otherwise reach the next attempt's destination (seen
/// here: the stale stream completed into it and left the source paused).
const MIGRATION_PORT_BASE: u16 = 40000;
/// How many distinct ports attempts rotate through.
const MIGRATION_PORT_SPREAD: u32 = 10000;
/// TCP port of the destination's NBD server (storage migration).
const NBD_PORT: u16 = 10809;
/// How often progress is sampled: often enough for a smooth bar, rare enough to cost nothing.
const POLL: Duration = Duration::from_millis(100);

/// QEMU's migration modes compared in the baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QemuMode {
    Plain,
    Xbzrle,
    Multifd,
    MultifdZstd,
    /// Plain, switching to postcopy once the first pass is done (libvirt's
    /// `--postcopy-after-precopy`); the destination resumes at the switch.
    Postcopy,
}

impl QemuMode {
    /// Every mode, in the order benchmarks report them.
    pub const ALL: [QemuMode; 5] = [
        QemuMode::Plain,
        QemuMode::Xbzrle,
        QemuMode::Multifd,
        QemuMode::MultifdZstd,
        QemuMode::Postcopy,
    ];

    /// Parses `plain|xbzrle|multifd|multifd-zstd|postcopy`.
    pub fn parse(s: &str) -> Result<QemuMode> {
        QemuMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .with_context(|| format!("unknown QEMU migration mode {s:?} (known: plain, xbzrle, multifd, multifd-zstd, postcopy)"))
    }

    /// The mode's name, as `system` reports it after `qemu-`.
    pub fn name(self) -> &'static str {
        match self {
            QemuMode::Plain => "plain",
            QemuMode::Xbzrle => "xbzrle",
            QemuMode::Multifd => "multifd",
            QemuMode::MultifdZstd => "multifd-zstd",
            QemuMode::Postcopy => "postcopy",
        }
    }
}

/// Which system migrates: ferry's agents, or QEMU's own migration in one of its modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum System {
    /// ferry, with these codec techniques, switching to postcopy after the first pass, once
    /// the throttle reaches a percentage, or not.
    Ferry {
        codec: CodecSettings,
        postcopy: bool,
        postcopy_at_throttle: Option<u8>,
    },
    Qemu(QemuMode),
}

impl System {
    /// `ferry` (every codec technique), `ferry-none`, `ferry-<technique>+<technique>...`
    /// (`ferry-zero+delta`), any of them ending in `-postcopy` (`ferry-postcopy`) or
    /// `-postcopy-at-<throttle %>` (`ferry-postcopy-at-40`), `qemu-<mode>`, or a bare QEMU mode
    /// (`plain`, `multifd-zstd`, ...).
    pub fn parse(s: &str) -> Result<System> {
        let (ferry, postcopy, postcopy_at_throttle) = match s.rsplit_once("-postcopy-at-") {
            Some((rest, pct)) if rest.starts_with("ferry") => {
                let pct = pct
                    .parse()
                    .map_err(|_| anyhow::anyhow!("system {s:?}: {pct:?} is not a percentage"))?;
                (rest, false, Some(pct))
            }
            _ => match s.strip_suffix("-postcopy") {
                Some(rest) if rest.starts_with("ferry") => (rest, true, None),
                _ => (s, false, None),
            },
        };
        let ferry_with = |codec| System::Ferry {
            codec,
            postcopy,
            postcopy_at_throttle,
        };
        if ferry == "ferry" {
            return Ok(ferry_with(CodecSettings::ALL));
        }
        if let Some(codec) = ferry.strip_prefix("ferry-") {
            return codec
                .replace('+', ",")
                .parse()
                .map(ferry_with)
                .map_err(|e| anyhow::anyhow!("system {s:?}: {e}"));
        }
        QemuMode::parse(s.strip_prefix("qemu-").unwrap_or(s))
            .map(System::Qemu)
            .map_err(|e| {
                anyhow::anyhow!(
                    "{e:#}, or ferry[-none|-zero+dedup+delta+zstd][-postcopy|-postcopy-at-PCT]"
                )
            })
    }

    /// Whether its migrations may switch to postcopy.
    pub fn postcopy(self) -> bool {
        match self {
            System::Ferry {
                postcopy,
                postcopy_at_throttle,
                ..
            } => postcopy || postcopy_at_throttle.is_some(),
            System::Qemu(mode) => mode == QemuMode::Postcopy,
        }
    }

    /// The name in reports and bench records: `ferry`, `ferry-<techniques>` or `qemu-<mode>`.
    pub fn name(self) -> String {
        match self {
            System::Ferry {
                codec,
                postcopy,
                postcopy_at_throttle,
            } => {
                let mut name = match codec {
                    CodecSettings::ALL => "ferry".to_owned(),
                    codec => format!("ferry-{}", codec.to_string().replace(',', "+")),
                };
                if let Some(pct) = postcopy_at_throttle {
                    name.push_str(&format!("-postcopy-at-{pct}"));
                } else if postcopy {
                    name.push_str("-postcopy");
                }
                name
            }
            System::Qemu(m) => format!("qemu-{}", m.name()),
        }
    }
}

/// How to migrate.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrateOptions {
    /// ferry's path, or QEMU's own (then `mode` says how).
    pub ferry: bool,
    pub mode: QemuMode,
    /// multifd channels; 4 is a common choice (QEMU's default is 2).
    pub multifd_channels: u8,
    /// QEMU's own migration with disks: the mirror in write-blocking copy mode (every guest
    /// write waits for the destination; libvirt's --copy-storage-synchronous-writes) instead
    /// of background.
    pub qemu_mirror_write_blocking: bool,
    /// QEMU's own migration with disks: copy only each disk's top image (`sync=top`, libvirt's
    /// `--copy-storage-inc`) into an overlay on the same template in the destination site's
    /// library, which the operator asserts holds the same bytes (QEMU does not check).
    pub qemu_mirror_top: bool,
    /// The migration's settings (ferry's, and for QEMU's own its downtime-limit and deadline).
    pub settings: MigrationSettings,
}

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            ferry: true,
            mode: QemuMode::Plain,
            multifd_channels: 4,
            qemu_mirror_write_blocking: false,
            qemu_mirror_top: false,
            settings: MigrationSettings::default(),
        }
    }
}

impl MigrateOptions {
    /// The system these options select.
    pub fn system(&self) -> System {
        if self.ferry {
            System::Ferry {
                codec: self.settings.codec,
                postcopy: self.settings.postcopy,
                postcopy_at_throttle: self.settings.postcopy_at_throttle_pct,
            }
        } else {
            System::Qemu(self.mode)
        }
    }

    /// Selects `system`.
    pub fn set_system(&mut self, system: System) {
        match system {
            System::Ferry {
                codec,
                postcopy,
                postcopy_at_throttle,
            } => {
                self.ferry = true;
                self.settings.codec = codec;
                self.settings.postcopy = postcopy;
                self.settings.postcopy_at_throttle_pct = postcopy_at_throttle;
            }
            System::Qemu(m) => {
                self.ferry = false;
                self.mode = m;
            }
        }
    }
}

pub use ferry_api::outcome::{MigrationOutcome, Progress};

pub(crate) fn now_micros() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_micros(),
    )
    .expect("fits")
}

fn caps(mode: QemuMode, src: bool, disks: bool) -> MigrateSetCapabilities {
    // Every mode capability is set explicitly: a VM that arrived by multifd still has it on.
    let multifd = matches!(mode, QemuMode::Multifd | QemuMode::MultifdZstd);
    let cap = |name: &str, state: bool| Capability {
        capability: name.into(),
        state,
    };
    let mut c = vec![
        cap("events", true),
        cap("xbzrle", mode == QemuMode::Xbzrle),
        cap("multifd", multifd),
        cap("postcopy-ram", mode == QemuMode::Postcopy),
        // QEMU's best postcopy: faulted pages on a channel of their own, as ferry carries them.
        cap("postcopy-preempt", mode == QemuMode::Postcopy),
        cap("postcopy-blocktime", mode == QemuMode::Postcopy),
    ];
    // libvirt's way with disks: stop at pre-switchover and complete the disk mirror first.
    c.push(cap("pause-before-switchover", src && disks));
    MigrateSetCapabilities { capabilities: c }
}

fn params(opts: &MigrateOptions, src: bool) -> MigrateSetParameters {
    let multifd = matches!(opts.mode, QemuMode::Multifd | QemuMode::MultifdZstd);
    MigrateSetParameters {
        downtime_limit: src.then_some(opts.settings.downtime_ms),
        multifd_channels: multifd.then_some(opts.multifd_channels),
        multifd_compression: (opts.mode == QemuMode::MultifdZstd).then(|| "zstd".to_owned()),
        ..Default::default()
    }
}

/// Migrates VM `name` to site `to` with QEMU's own migration. `src_link` is the caller's serial
/// connection to the source guest (QEMU's serial socket takes one client); its heartbeat
/// tracker also receives the destination's beats. Returns the outcome and a serial link to the
/// guest at its new site (or the old one, if the migration did not complete).
pub async fn migrate(
    lab: &Lab,
    name: &str,
    to: Site,
    opts: &MigrateOptions,
    src_link: GuestLink,
    progress: &watch::Sender<Progress>,
    timeline: &Mutex<Timeline>,
) -> Result<(MigrationOutcome, GuestLink)> {
    if opts.ferry {
        return crate::ferry_path::migrate(lab, name, to, opts, src_link, progress, timeline).await;
    }
    let _active = interrupt::Active::enter();
    let rec = vm::load(lab, name)?;
    if rec.site == to {
        bail!("VM {name:?} already runs at site {}", to.name());
    }
    let heartbeats: Arc<Heartbeats> = src_link.heartbeats().clone();
    let wan_socket = lab.wan_socket();
    let wan0 = wan::stats(&wan_socket)?;
    let (wan_start, drops_start) = (wan0.total_bytes(), wan0.total_drops());
    let t0_micros = now_micros();
    let t0 = Instant::now();
    heartbeats.reset_max_gap();
    *timeline.lock().expect("timeline poisoned") = Timeline::new(
        &format!("qemu-{}", opts.mode.name()),
        name,
        rec.site.name(),
        to.name(),
        u64::try_from(t0_micros / 1000).unwrap_or(0),
        lab.state().map_or(0.0, |s| s.link.rate_mbit),
    );

    let src_qmp = Qmp::connect(&rec.spec.qmp_socket)
        .await
        .context("source QMP")?;
    // A cancelled attempt can linger in QEMU (e.g. a TCP connect into a dead WAN) and blocks
    // the next one ("duplicate yank instance"): wait for it to finish first.
    settle(&src_qmp, Duration::from_secs(60)).await?;
    let mut dst_spec = vm::spec_at(lab, &rec, to);
    dst_spec.incoming = Some("defer".into());
    dst_spec.paused = true;
    if opts.qemu_mirror_top {
        vm::overlay_destination_disks(&rec.spec, &dst_spec, rec.site, to)?;
    } else {
        vm::create_destination_disks(&rec.spec, &dst_spec)?;
    }
    progress.send_modify(|p| p.phase = "starting destination".into());
    let dst_pid = match vm::launch(lab, to, &dst_spec).await {
        Ok(pid) => pid,
        Err(e) => {
            vm::kill_at(lab, &dst_spec, to, 0);
            for d in &dst_spec.disks {
                let _ = std::fs::remove_file(&d.path);
            }
            return Err(e.context("starting the destination; the source VM keeps running"));
        }
    };

    let attempt = async {
        let dst_qmp = Qmp::connect(&dst_spec.qmp_socket)
            .await
            .context("destination QMP")?;
        let dst_link = GuestLink::connect(&dst_spec.serial_socket, heartbeats.clone()).await?;
        let attempt = Attempt {
            lab,
            rec: &rec,
            dst_spec: &dst_spec,
            to,
            opts,
            src: &src_qmp,
            dst: &dst_qmp,
            progress,
            t0,
            t0_micros,
            wan_start,
            drops_start,
            heartbeats: &heartbeats,
            timeline,
        };
        attempt.mark(attempt.elapsed_ms(), EventKind::DestinationStarted);
        let outcome = run(&attempt).await?;
        Ok::<_, anyhow::Error>((outcome, dst_link))
    };
    match attempt.await {
        Ok((outcome, dst_link)) if outcome.completed => {
            // The destination runs: the source must never run again.
            let _ = src_qmp.execute(&Quit).await;
            vm::kill_at(lab, &rec.spec, rec.site, rec.pid);
            let mut moved = rec.clone();
            moved.site = to;
            moved.pid = dst_pid;
            moved.spec = vm::spec_at(lab, &rec, to);
            vm::save(lab, &moved)?;
            for d in &rec.spec.disks {
                let _ = std::fs::remove_file(&d.path);
            }
            Ok((outcome, dst_link))
        }
        other => {
            // Not committed: the destination goes, the source keeps (or resumes) running.
            let _ = src_qmp.execute(&MigrateCancel).await;
            vm::kill_at(lab, &dst_spec, to, dst_pid);
            let _ = settle(&src_qmp, Duration::from_secs(10)).await;
            for d in &dst_spec.disks {
                let _ = std::fs::remove_file(&d.path);
            }
            ensure_running(&src_qmp).await?;
            let detail = match &other {
                Ok((outcome, _)) => outcome.error.clone().unwrap_or_default(),
                Err(e) => format!("{e:#}"),
            };
            let t_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
            timeline
                .lock()
                .expect("timeline poisoned")
                .event(t_ms, EventKind::Failed, detail);
            match other {
                Ok((outcome, _)) => Ok((outcome, src_link)),
                Err(e) => Err(e.context("migration failed; the source VM keeps running")),
            }
        }
    }
}

/// Sends `migrate`. A cancelled attempt whose TCP connect into a dead WAN is still pending keeps
/// QEMU's migration yank instance registered after `query-migrate` already says `cancelled`, and
/// QEMU refuses a new `migrate` with "duplicate yank instance" until the connect gives up
/// (seconds, with SYN retransmissions); when it then connects, QEMU briefly reports "a
/// migration process in progress" while it tears the old attempt down. Both are waited out,
/// for a minute at most.
async fn start_migration(src: &Qmp, uri: &str) -> Result<()> {
    let start = Instant::now();
    loop {
        match src.execute(&Migrate { uri: uri.to_owned() }).await {
            Ok(_) => return Ok(()),
            Err(ferry_qemu::QmpError::Qemu { desc, .. })
                if (desc.contains("duplicate yank instance") || desc.contains("migration process in progress"))
                    && start.elapsed() < Duration::from_secs(60) =>
            {
                if interrupt::requested() {
                    bail!("interrupted by the user before the migration started");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context(
                    "starting the migration (if QEMU reports a duplicate yank instance, a previous attempt is still tearing down)",
                ))
            }
        }
    }
}

/// Waits until the source has no migration in progress (none, completed, failed, cancelled).
async fn settle(qmp: &Qmp, deadline: Duration) -> Result<()> {
    let start = Instant::now();
    loop {
        let status = qmp.execute(&QueryMigrate).await?.status.unwrap_or_default();
        if matches!(
            status.as_str(),
            "" | "none" | "completed" | "failed" | "cancelled"
        ) {
            return Ok(());
        }
        if start.elapsed() > deadline {
            bail!("a previous migration of this VM is still {status:?} in QEMU after {}s; retry later", deadline.as_secs());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Writes a timeline as pretty JSON, creating the directory.
pub fn write_timeline(path: &std::path::Path, timeline: &Mutex<Timeline>) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let json = serde_json::to_string_pretty(&*timeline.lock().expect("timeline poisoned"))?;
    std::fs::write(path, json).with_context(|| format!("write timeline {}", path.display()))
}

/// Postcopy: said in QEMU's progress once the lab resumed the destination, which then runs the
/// VM while its pages still cross.
pub const DESTINATION_RUNS: &str = "running at the destination";

/// Resumes the source if a failed migration left it paused.
async fn ensure_running(qmp: &Qmp) -> Result<()> {
    for _ in 0..50 {
        let st = qmp.execute(&QueryStatus).await?;
        if st.running {
            return Ok(());
        }
        if st.status == "paused" || st.status == "postmigrate" || st.status == "finish-migrate" {
            let _ = qmp.execute(&Cont).await;
        }
        tokio::time::sleep(POLL).await;
    }
    bail!("the source VM did not resume after the failed migration")
}

/// What one attempt works with; built by [`migrate`], used by [`run`].
struct Attempt<'a> {
    lab: &'a Lab,
    rec: &'a vm::VmRecord,
    dst_spec: &'a ferry_qemu::VmSpec,
    to: Site,
    opts: &'a MigrateOptions,
    src: &'a Qmp,
    dst: &'a Qmp,
    progress: &'a watch::Sender<Progress>,
    /// The migration request, as a monotonic instant and as wall-clock microseconds (QMP event
    /// timestamps are wall clock).
    t0: Instant,
    t0_micros: i64,
    wan_start: u64,
    /// The WAN emulator's drop count at the request.
    drops_start: u64,
    heartbeats: &'a Heartbeats,
    timeline: &'a Mutex<Timeline>,
}

impl Attempt<'_> {
    /// Milliseconds since the request.
    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Milliseconds from the request to a QMP event.
    fn event_ms(&self, e: &ferry_qemu::Event) -> u64 {
        u64::try_from((e.timestamp.as_micros() - self.t0_micros).max(0) / 1000).unwrap_or(0)
    }

    fn mark(&self, t_ms: u64, kind: EventKind) {
        self.timeline
            .lock()
            .expect("timeline poisoned")
            .event(t_ms, kind, "");
    }
}

async fn run(a: &Attempt<'_>) -> Result<MigrationOutcome> {
    let Attempt {
        lab,
        rec,
        dst_spec,
        to,
        opts,
        src,
        dst,
        progress,
        t0,
        t0_micros,
        wan_start,
        drops_start,
        heartbeats,
        ..
    } = *a;
    let disks = rec.has_disk();
    let port = MIGRATION_PORT_BASE
        + u16::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.subsec_micros())
                % MIGRATION_PORT_SPREAD,
        )
        .expect("spread fits in u16");
    let wan_socket = lab.wan_socket();
    src.execute(&caps(opts.mode, true, disks)).await?;
    dst.execute(&caps(opts.mode, false, disks)).await?;
    src.execute(&params(opts, true)).await?;
    dst.execute(&params(opts, false)).await?;
    dst.execute(&MigrateIncoming {
        uri: format!("tcp:{}:{port}", to.underlay_ip()),
    })
    .await?;
    let deadline = t0 + Duration::from_secs(opts.settings.timeout_s);
    let mut last_wan = (Instant::now(), wan_start);
    let mut sample =
        |phase: &str, info: Option<&ferry_qemu::commands::MigrationInfo>| -> Result<()> {
            let now = Instant::now();
            let stats = wan::stats(&wan_socket)?;
            let wan_now = stats.total_bytes();
            let dt = now.duration_since(last_wan.0).as_secs_f64();
            let mbit = if dt > 0.0 {
                (wan_now - last_wan.1) as f64 * 8.0 / dt / 1e6
            } else {
                0.0
            };
            last_wan = (now, wan_now);
            let ram = info.and_then(|i| i.ram.as_ref());
            a.timeline
                .lock()
                .expect("timeline poisoned")
                .push_sample(Sample {
                    t_ms: a.elapsed_ms(),
                    wan_bytes: wan_now - wan_start,
                    wan_mbit: mbit,
                    qemu_transferred: ram.map(|r| r.transferred),
                    qemu_remaining: ram.map(|r| r.remaining),
                    iteration: ram.map(|r| r.dirty_sync_count),
                    qemu_status: info.and_then(|i| i.status.clone()),
                    wan_drops: Some(stats.total_drops() - drops_start),
                    ..Sample::default()
                });
            progress.send_modify(|p| {
                p.phase = phase.to_owned();
                p.elapsed_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
                p.wan_bytes = wan_now - wan_start;
                p.wan_mbit = 0.7 * p.wan_mbit + 0.3 * mbit;
                if let Some(ram) = info.and_then(|i| i.ram.as_ref()) {
                    p.ram_total = ram.total;
                    p.ram_transferred = ram.transferred;
                    p.ram_remaining = ram.remaining;
                    p.iteration = ram.dirty_sync_count;
                    p.eta_s =
                        (p.wan_mbit > 0.1).then(|| ram.remaining as f64 * 8.0 / (p.wan_mbit * 1e6));
                }
            });
            Ok(())
        };

    if disks {
        dst.execute(&NbdServerStart::inet(to.underlay_ip(), NBD_PORT))
            .await?;
        for d in &dst_spec.disks {
            dst.execute(&BlockExportAdd {
                kind: "nbd".into(),
                id: format!("exp-{}", d.id),
                node_name: d.id.clone(),
                writable: true,
                name: d.id.clone(),
                bitmaps: Vec::new(),
            })
            .await?;
        }
        for d in &rec.spec.disks {
            src.execute(&BlockdevAdd(serde_json::json!({
                "driver": "nbd", "node-name": format!("tgt-{}", d.id), "export": d.id,
                "server": {"type": "inet", "host": to.underlay_ip(), "port": NBD_PORT.to_string()},
            })))
            .await?;
            src.execute(&BlockdevMirror {
                job_id: format!("mirror-{}", d.id),
                device: d.id.clone(),
                target: format!("tgt-{}", d.id),
                sync: if opts.qemu_mirror_top { "top" } else { "full" }.into(),
                copy_mode: opts
                    .qemu_mirror_write_blocking
                    .then(|| "write-blocking".into()),
                granularity: None,
            })
            .await?;
        }
        a.mark(a.elapsed_ms(), EventKind::DiskCopyStarted);
        for d in &rec.spec.disks {
            let job = format!("mirror-{}", d.id);
            loop {
                if src
                    .find_event("BLOCK_JOB_READY", |v| v["device"] == job.as_str())
                    .is_some()
                {
                    break;
                }
                if let Some(e) =
                    src.find_event("BLOCK_JOB_COMPLETED", |v| v["device"] == job.as_str())
                {
                    bail!("disk mirror {job} ended before it was ready: {}", e.data);
                }
                if Instant::now() > deadline {
                    bail!(
                        "disk mirror {job} not ready within {}s",
                        opts.settings.timeout_s
                    );
                }
                if interrupt::requested() {
                    bail!("interrupted by the user during the disk mirror");
                }
                sample("disk mirror", None)?;
                tokio::time::sleep(POLL).await;
            }
        }
        a.mark(a.elapsed_ms(), EventKind::DiskReady);
    }

    start_migration(src, &format!("tcp:{}:{port}", to.underlay_ip())).await?;
    a.mark(a.elapsed_ms(), EventKind::MemoryStarted);
    let postcopy = opts.mode == QemuMode::Postcopy;
    // Postcopy: asked for after the first pass; the destination resumed once it loaded the
    // device state (paused, as it was started).
    let (mut asked, mut resumed) = (false, false);
    let info = loop {
        let info = src.execute(&QueryMigrate).await?;
        let status = info.status.clone().unwrap_or_default();
        tracing::debug!(elapsed_ms = t0.elapsed().as_secs_f64() * 1000.0, info = %serde_json::to_string(&info).unwrap_or_default(), "query-migrate");
        let at = if resumed {
            format!("memory: {status}, {DESTINATION_RUNS}")
        } else {
            format!("memory: {status}")
        };
        sample(&at, Some(&info))?;
        if postcopy
            && !asked
            && status == "active"
            && info.ram.as_ref().is_some_and(|r| r.dirty_sync_count >= 2)
        {
            src.execute(&MigrateStartPostcopy).await?;
            asked = true;
        }
        if postcopy
            && !resumed
            && status == "postcopy-active"
            && dst.execute(&QueryStatus).await?.status == "paused"
        {
            dst.execute(&Cont).await?;
            resumed = true;
        }
        match status.as_str() {
            "completed" => break info,
            "failed" | "cancelled" => bail!(
                "QEMU migration {status}: {}",
                info.error_desc.unwrap_or_default()
            ),
            "pre-switchover" => {
                for d in &rec.spec.disks {
                    let job = format!("mirror-{}", d.id);
                    src.execute(&BlockJobCancel {
                        device: job.clone(),
                        force: false,
                    })
                    .await?;
                    src.wait_event(
                        "BLOCK_JOB_COMPLETED",
                        |v| v["device"] == job.as_str(),
                        Duration::from_secs(60),
                    )
                    .await
                    .with_context(|| format!("disk mirror {job} did not complete at switchover"))?;
                }
                src.execute(&MigrateContinue {
                    state: "pre-switchover".into(),
                })
                .await?;
            }
            _ => {}
        }
        if interrupt::requested() {
            bail!("interrupted by the user (QEMU status {status})");
        }
        if Instant::now() > deadline {
            let ram = info.ram.clone().unwrap_or_default();
            let wan_end = wan::stats(&wan_socket)?;
            return Ok(MigrationOutcome {
                completed: false,
                total_ms: u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX),
                wan_bytes: wan_end.total_bytes() - wan_start,
                wan_drops: wan_end.total_drops() - drops_start,
                iterations: ram.dirty_sync_count,
                ram_transferred: ram.transferred,
                error: Some(format!(
                    "did not converge within {}s (QEMU's own rule, downtime limit {} ms)",
                    opts.settings.timeout_s, opts.settings.downtime_ms
                )),
                ..Default::default()
            });
        }
        tokio::time::sleep(POLL).await;
    };

    progress.send_modify(|p| p.phase = "switchover".into());
    let loaded = dst
        .wait_event(
            "MIGRATION",
            |v| v["status"] == "completed",
            Duration::from_secs(60),
        )
        .await
        .context("the destination did not finish loading the migration stream")?;
    if let Some(stop) = src.find_event("STOP", |_| true) {
        a.mark(a.event_ms(&stop), EventKind::SourceStopped);
    }
    a.mark(a.event_ms(&loaded), EventKind::DestinationLoaded);
    if disks {
        dst.execute(&NbdServerStop).await?;
    }
    let completed_micros = now_micros();
    // The commit point: once the destination runs, the source must never run again, so
    // nothing after a successful `cont` may fail the migration; measurements that cannot be
    // taken are reported as missing instead. (In postcopy it ran since the switch.)
    if !resumed {
        if let Err(e) = dst.execute(&Cont).await {
            let running = dst.execute(&QueryStatus).await.is_ok_and(|s| s.running);
            if !running {
                return Err(anyhow::Error::new(e).context("the destination did not resume"));
            }
        }
    }

    let resume = match resumed {
        true => dst.find_event("RESUME", |_| true),
        false => {
            dst.wait_event("RESUME", |_| true, Duration::from_secs(30))
                .await
        }
    };
    if let Some(r) = &resume {
        a.mark(a.event_ms(r), EventKind::DestinationResumed);
    }
    let stop = src.find_event("STOP", |_| true);
    let (wan_bytes, wan_drops) = wan::stats(&wan_socket).map_or((0, 0), |s| {
        (s.total_bytes() - wan_start, s.total_drops() - drops_start)
    });
    // The gap ends with the destination's first beats; wait for a few of them.
    let beats = heartbeats.count();
    let waited = Instant::now();
    while heartbeats.count() < beats + 20 && waited.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ram = info.ram.clone().unwrap_or_default();
    let resume_micros = resume
        .as_ref()
        .map_or_else(now_micros, |r| r.timestamp.as_micros());
    let blocktime = match resumed {
        true => dst
            .execute(&QueryMigrate)
            .await
            .ok()
            .and_then(|i| i.postcopy_blocktime),
        false => None,
    };
    let end_micros = if resumed {
        completed_micros
    } else {
        resume_micros
    };
    let outcome = MigrationOutcome {
        completed: true,
        total_ms: u64::try_from((end_micros - t0_micros).max(0) / 1000).unwrap_or(0),
        downtime_ms: resume
            .as_ref()
            .zip(stop.as_ref())
            .map(|(r, s)| (r.timestamp.as_micros() - s.timestamp.as_micros()) as f64 / 1000.0),
        qemu_downtime_ms: info.downtime,
        guest_gap_ms: (heartbeats.count() > beats)
            .then(|| heartbeats.max_gap().as_secs_f64() * 1000.0),
        wan_bytes,
        wan_drops,
        iterations: ram.dirty_sync_count,
        ram_transferred: ram.transferred,
        postcopy_ms: resumed
            .then(|| u64::try_from((completed_micros - resume_micros).max(0) / 1000).unwrap_or(0)),
        postcopy_blocktime_ms: blocktime,
        preempt_bytes: None,
        error: None,
        connections: None,
        connections_why: None,
        codec: None,
        cpu_throttle_pct: None,
        throttle_vcpu_s: None,
        disk: None,
    };
    progress.send_modify(|p| p.phase = "done".into());
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systems_parse_and_name_themselves_back() {
        for name in [
            "ferry",
            "ferry-none",
            "ferry-zero+delta",
            "ferry-postcopy",
            "ferry-zero+zstd-postcopy",
            "ferry-postcopy-at-40",
            "qemu-plain",
            "qemu-multifd-zstd",
        ] {
            assert_eq!(System::parse(name).unwrap().name(), name);
        }
        assert_eq!(
            System::parse("ferry-postcopy").unwrap(),
            System::Ferry {
                codec: CodecSettings::ALL,
                postcopy: true,
                postcopy_at_throttle: None,
            }
        );
        assert!(System::parse("ferry-postcopy-at-x").is_err());
        assert_eq!(System::parse("plain").unwrap().name(), "qemu-plain");
        assert!(System::parse("plain-postcopy").is_err());
        let mut opts = MigrateOptions::default();
        opts.set_system(System::parse("ferry-postcopy").unwrap());
        assert!(opts.settings.postcopy);
        assert_eq!(opts.system().name(), "ferry-postcopy");
    }

    #[test]
    fn the_postcopy_systems_are_known_as_such() {
        let postcopy = |name| System::parse(name).unwrap().postcopy();
        assert!(postcopy("ferry-postcopy"));
        assert!(postcopy("ferry-postcopy-at-40"));
        assert!(postcopy("postcopy"));
        assert!(!postcopy("ferry"));
        assert!(!postcopy("multifd-zstd"));
    }
}
