//! `ferry migrate --libvirt DOMAIN --to PEER` (`POST /v1/libvirt/migrations`): ferry drives
//! libvirt's own migration and steers it through libvirt, not through a second QMP client.
//!
//! libvirt migrates peer to peer over the agent's tunnels ([`crate::tunnel`]): its RPC to the
//! destination's libvirtd, QEMU's stream (coded and gated by digests), the NBD disk copy. The
//! steering is libvirt's: the downtime target (`migrate-setmaxdowntime`), the link's rate as
//! QEMU's switchover bandwidth, auto-converge, the mirror's write-blocking mode (into the
//! source agent's disk relay, [`crate::engine::disk::relay`]). libvirt defines the
//! domain at the destination and undefines it at the source; when anything fails it cancels
//! its job, resumes the source and removes the destination's copy, and this agent reports
//! libvirt's own words.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use ferry_api::agent::{DiskMode, LibvirtMigrationRequest, MigrationState, Phase};
use ferry_api::EventKind;
use tokio::io::AsyncReadExt;

use crate::disk_memory::{DiskMemory, NotKept};
use crate::engine::control::TunnelKind;
use crate::engine::status::{now_ms, Events, Shared};
use crate::group::GroupLink;
use crate::libvirt::{virsh_error, JobStats, Libvirt};
use crate::refusal::Refusal;
use crate::tunnel::{self, Claim, DiskCopies, Tunnels};

/// How often libvirt's job figures are read into the status.
const POLL: Duration = Duration::from_millis(500);

/// What of a request libvirt's migration cannot honour, refused before anything starts.
pub fn check_settings(req: &LibvirtMigrationRequest) -> Result<(), Refusal> {
    let s = &req.settings;
    let unsupported = [
        (s.seed_from.is_some(), "seed_from"),
        (s.smart_stop, "smart_stop"),
        // The tunnels gate a stream's end, not a postcopy package (engine::postcopy).
        (s.postcopy, "postcopy"),
        (
            s.postcopy_at_throttle_pct.is_some(),
            "postcopy_at_throttle_pct",
        ),
        (s.disk_mode == DiskMode::Cloudnet, "disk_mode cloudnet"),
        // The relay's tunnels choose theirs (one unless the host caps the send buffer).
        (s.connections != 0, "a number of connections"),
        // libvirt's disk copy has no hook of ferry's inside it.
        (s.test_corrupt_disk_at.is_some(), "test_corrupt_disk_at"),
        (s.test_disk_stall_ms.is_some(), "test_disk_stall_ms"),
        // The tunnels' streams keep the single encoder's batches (engine::tunnel_stream).
        (s.test_shards.is_some(), "test_shards"),
        (s.test_cache_pause_bytes.is_some(), "test_cache_pause_bytes"),
    ];
    if let Some((_, what)) = unsupported.iter().find(|(set, _)| *set) {
        return Err(Refusal::NotWithLibvirt(what.to_string()));
    }
    if s.disk_pacing_floor_pct.is_some() && !req.copy_storage {
        return Err(Refusal::Malformed(
            "disk_pacing_floor_pct paces a disk copy: it needs copy_storage".into(),
        ));
    }
    match req.parallel {
        // QEMU's multifd-channels is a u8 and needs one at least.
        Some(n) if !(1..=255).contains(&n) => Err(Refusal::Malformed(format!(
            "parallel: {n} channels; QEMU takes 1 to 255"
        ))),
        _ => Ok(()),
    }
}

/// Whether `domain` can be migrated now: it exists, it runs, libvirt answers.
pub async fn check_domain(libvirt: &Libvirt, domain: &str) -> Result<(), Refusal> {
    let state = libvirt.state(domain).await.map_err(|e| {
        let why = format!("{e:#}");
        if why.contains("failed to get domain") || why.contains("Domain not found") {
            Refusal::UnknownDomain(domain.to_owned(), why)
        } else {
            Refusal::LibvirtUnavailable(libvirt.uri().to_owned(), why)
        }
    })?;
    if state != "running" {
        return Err(Refusal::DomainNotRunning {
            domain: domain.to_owned(),
            state,
        });
    }
    Ok(())
}

/// Runs an admitted migration to its end; its status says how it went.
pub async fn run(
    libvirt: Libvirt,
    tunnels: Arc<Tunnels>,
    claim: Claim,
    req: LibvirtMigrationRequest,
    link_rate_mbit: Option<f64>,
    group: Option<GroupLink>,
    status: Shared,
) {
    let result = drive(
        &libvirt,
        &tunnels,
        claim.slot,
        &req,
        link_rate_mbit,
        group,
        &status,
    )
    .await;
    let copies = claim.copies();
    drop(claim);
    match result {
        Ok(()) => {
            if let Some(copies) = copies {
                remember_disks(&tunnels.disk_memory, &req.domain, &copies, &status).await;
            }
            let there = Libvirt::through(tunnel::socket_path(
                &tunnels.config,
                &req.to,
                0,
                TunnelKind::LibvirtRpc,
            ));
            let job = there.job(&req.domain, true).await;
            status.update(|s| {
                s.state = MigrationState::Committed;
                s.phase = Phase::Committed;
                s.detail = format!("{} runs at {}, defined there", req.domain, req.to);
                s.event(EventKind::Committed, "libvirt finished the migration");
            });
            record_completed(&status, job);
        }
        Err(e) => {
            // libvirt resumes the source when a migration fails; say where the domain is.
            let here = match libvirt.state(&req.domain).await {
                Ok(state) => format!("{} is {state} at the source", req.domain),
                Err(e) => format!("the source's libvirt does not say where it is: {e:#}"),
            };
            status.update(|s| {
                s.state = MigrationState::Failed;
                s.phase = Phase::Failed;
                s.error = Some(format!("{e:#}"));
                s.detail = here;
                s.event(EventKind::Failed, format!("{e:#}"));
            });
        }
    }
}

async fn drive(
    libvirt: &Libvirt,
    tunnels: &Tunnels,
    slot: u32,
    req: &LibvirtMigrationRequest,
    link_rate_mbit: Option<f64>,
    mut group: Option<GroupLink>,
    status: &Shared,
) -> Result<()> {
    let settings = &req.settings;
    // QEMU's downtime target: the one asked for, less the disks' share once the round trip
    // is known; a group member's stays tiny until its group says go. A go, once heard, holds
    // (the controller works it out afresh from every report).
    let mut went = false;
    let mut downtime = |group: &Option<GroupLink>| {
        went |= group.as_ref().is_some_and(|g| g.now().go);
        if group.is_some() && !went {
            return crate::group::HOLD_DOWNTIME_MS;
        }
        match (req.copy_storage, status.get().wire.rtt_ms) {
            (true, Some(rtt_ms)) => memory_downtime_ms(settings.downtime_ms, rtt_ms),
            _ => settings.downtime_ms,
        }
    };
    let mut applied = downtime(&group);
    libvirt.set_max_downtime(&req.domain, applied).await?;
    let persistent = libvirt.is_persistent(&req.domain).await?;
    let args = migrate_args(tunnels, slot, req, link_rate_mbit, persistent);
    status.enter(
        Phase::PreparingDestination,
        format!("libvirt prepares {} at {}", req.domain, req.to),
    );
    let mut child = libvirt.start_migrate(&req.domain, &args)?;
    let mut stderr = child.stderr.take().expect("piped stderr");
    let errors = tokio::spawn(async move {
        let mut text = Vec::new();
        let _ = stderr.read_to_end(&mut text).await;
        text
    });
    let deadline = tokio::time::sleep(Duration::from_secs(settings.timeout_s.max(1)));
    tokio::pin!(deadline);
    let mut poll = tokio::time::interval(POLL);
    let mut stopped_by: Option<String> = None;
    let mut aborted = false;
    let held = || status.get().phase == Phase::Held;
    let exit = loop {
        tokio::select! {
            exit = child.wait() => break exit?,
            _ = status.cancelled(), if stopped_by.is_none() => {
                stopped_by = Some("cancelled by the user".into());
            }
            // A held member's fate is its group's.
            _ = &mut deadline, if stopped_by.is_none() && settings.timeout_s > 0 && !held() => {
                stopped_by = Some("the migration's deadline passed".into());
            }
            _ = group_changed(&mut group) => {
                if let (Some(reason), None) = (group.as_ref().and_then(|g| g.now().abort), &stopped_by) {
                    stopped_by = Some(format!("the group was aborted: {reason}"));
                }
            }
            _ = poll.tick() => {
                if let Ok(job) = libvirt.job(&req.domain, false).await {
                    record_job(status, &job);
                    record_throttle(status, &job);
                    status.update(|s| s.qemu.expected_downtime_ms = job.downtime_ms);
                }
            }
        }
        // libvirt's job is aborted until it takes (it may not have begun yet), and steered
        // while it copies; once the stream ended, the tunnel tells the destination instead,
        // and libvirt alone finishes it.
        let stoppable = matches!(
            status.get().phase,
            Phase::Starting | Phase::PreparingDestination | Phase::DiskCopy | Phase::Memory
        );
        if let (Some(why), false, true) = (&stopped_by, aborted, stoppable) {
            match libvirt.abort_job(&req.domain).await {
                Ok(()) => aborted = true,
                Err(e) => tracing::debug!("aborting {}'s job ({why}): {e:#}", req.domain),
            }
        }
        let wanted = downtime(&group);
        if wanted != applied && stoppable {
            match libvirt.set_max_downtime(&req.domain, wanted).await {
                Ok(()) => {
                    tracing::debug!("{}: downtime target {wanted} ms", req.domain);
                    applied = wanted;
                    let go = group.is_some() && wanted != crate::group::HOLD_DOWNTIME_MS;
                    if req.copy_storage || group.is_some() {
                        status.update(|s| {
                            s.qemu_downtime_limit_ms = Some(wanted);
                            if go && !s.events.iter().any(|e| e.kind == EventKind::GroupGo) {
                                let detail = format!(
                                    "downtime target {wanted} ms; {} bytes left, a stop now would take {} ms",
                                    s.qemu.remaining,
                                    s.qemu.expected_downtime_ms.map_or("?".into(), |ms| ms.to_string())
                                );
                                s.event(EventKind::GroupGo, detail);
                            }
                        });
                    }
                }
                // The job may be between steps; the next round tries again.
                Err(e) => tracing::debug!("{}: downtime target {wanted} ms: {e:#}", req.domain),
            }
        }
    };
    let stderr = errors.await.unwrap_or_default();
    if exit.success() {
        return Ok(());
    }
    let mut why = virsh_error(&stderr);
    if req.copy_storage && why.contains("storage") {
        // libvirt tried to create a missing image at the destination and could not.
        let files = libvirt.disk_files(&req.domain).await.unwrap_or_default();
        why = format!(
            "{why} (the destination needs an image at each disk's path, {}: create it there with the same size)",
            files.join(", ")
        );
    }
    // What the tunnels saw fail (a digest that did not match, the destination's abort) is
    // why, where libvirt only saw its connection close.
    let tunnels_saw: Vec<String> = status
        .get()
        .events
        .iter()
        .filter(|e| e.kind == EventKind::Failed)
        .map(|e| e.detail.clone())
        .collect();
    if !tunnels_saw.is_empty() {
        why = format!("{why}; the agents: {}", tunnels_saw.join("; "));
    }
    match stopped_by {
        Some(reason) => anyhow::bail!("{reason} (libvirt: {why})"),
        None => anyhow::bail!("libvirt: {why}"),
    }
}

/// Returns when a group member's signal changed; never without a group.
async fn group_changed(group: &mut Option<GroupLink>) {
    match group {
        Some(g) => g.changed().await,
        None => std::future::pending().await,
    }
}

/// QEMU's share of a pause of `downtime_ms` when disks are copied: after QEMU's switchover
/// libvirt completes the mirrors, whose last flush waits for the disk relay's buffer to cross
/// (a sixth of the target, [`crate::tunnel::RELAY_DRAIN_SHARE`]) and for the destination's
/// answer (a round trip). At least a third of the target is left to QEMU.
pub fn memory_downtime_ms(downtime_ms: u64, rtt_ms: f64) -> u64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let disk_ms = downtime_ms / crate::tunnel::RELAY_DRAIN_SHARE + rtt_ms.ceil() as u64;
    downtime_ms.saturating_sub(disk_ms).max(downtime_ms / 3)
}

/// `virsh migrate`'s options for this request: peer to peer through the tunnels of directory
/// `slot` to `to`.
fn migrate_args(
    tunnels: &Tunnels,
    slot: u32,
    req: &LibvirtMigrationRequest,
    link_rate_mbit: Option<f64>,
    persistent: bool,
) -> Vec<String> {
    let socket = |kind| tunnel::socket_path(&tunnels.config, &req.to, slot, kind);
    let mut args: Vec<String> = vec![
        "--live".into(),
        "--p2p".into(),
        "--persistent".into(),
        "--desturi".into(),
        format!(
            "qemu+unix:///system?socket={}",
            socket(TunnelKind::LibvirtRpc).display()
        ),
        "--migrateuri".into(),
        format!("unix://{}", socket(TunnelKind::Migration).display()),
    ];
    if persistent {
        args.push("--undefinesource".into());
    }
    if req.copy_storage {
        args.extend([
            "--copy-storage-all".into(),
            "--disks-uri".into(),
            format!("unix://{}", socket(TunnelKind::Nbd).display()),
        ]);
        // QEMU's mirror in write-blocking mode: the guest's writes reach the source agent's
        // disk relay as it makes them, and complete once buffered there (or, in the sync disk
        // mode, once applied at the destination), so a guest that writes faster than the link
        // is slowed to it instead of never converging.
        args.push("--copy-storage-synchronous-writes".into());
    }
    if req.settings.converge {
        args.push("--auto-converge".into());
    }
    if let Some(channels) = req.parallel {
        // Each channel connects to the same migration socket; the tunnel tells them from the
        // main stream by their first bytes.
        args.extend([
            "--parallel".into(),
            "--parallel-connections".into(),
            channels.to_string(),
        ]);
    }
    if let Some(mbit) = link_rate_mbit {
        // libvirt takes MiB/s; at least 1.
        let mib_s = (mbit * 1e6 / 8.0 / 1048576.0).round().max(1.0);
        args.extend([
            "--available-switchover-bandwidth".into(),
            format!("{mib_s}"),
        ]);
    }
    args
}

/// Keeps what each relayed disk copy left at the destination, which is what the domain's
/// images here hold now that it is gone, for its return ([`crate::disk_memory`]). Each disk
/// kept or not is an event.
async fn remember_disks(memory: &DiskMemory, domain: &str, copies: &DiskCopies, status: &Shared) {
    let left = copies.left(COPIES_PATIENCE).await;
    let disks = match &copies.disks {
        Some(Ok(disks)) => disks.clone(),
        Some(Err(e)) => {
            let why = format!("no disk index kept for the return: the domain's disks: {e}");
            status.update(|s| s.event(EventKind::Committed, why));
            return;
        }
        None => return,
    };
    let (memory, domain_name) = (memory.clone(), domain.to_owned());
    // Files: a blocking thread.
    let said = tokio::task::spawn_blocking(move || {
        left.iter()
            .map(|left| {
                let kept = match disks.iter().find(|d| d.export() == left.export) {
                    Some(disk) => memory.remember(&domain_name, left, &disk.chain),
                    None => Err(NotKept::Io(format!(
                        "export {:?} is none of the domain's file disks",
                        left.export
                    ))),
                };
                match kept {
                    Ok(bytes) => format!(
                        "{}: its index ({bytes} bytes, {} block(s) unknown) is kept here for the domain's return",
                        left.export, left.unknown_blocks
                    ),
                    Err(e) => format!("{}: no index kept for the return: {e}", left.export),
                }
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_else(|e| vec![format!("no disk index kept for the return: {e}")]);
    for said in said {
        tracing::info!("{domain}: {said}");
        status.update(|s| s.event(EventKind::Committed, said));
    }
}

/// How long a migration's disk copies may go on after libvirt's migration returned (QEMU
/// closes its NBD connections as libvirt ends the mirrors) before what they left is taken.
const COPIES_PATIENCE: Duration = Duration::from_secs(10);

/// A completed job's figures, read from the destination's libvirt (the source's go with the
/// domain), into the status. libvirt's downtime is the real pause, from the stop at the
/// source to the resume at the destination; its end is taken as now, a little after the
/// resume.
pub(crate) fn record_completed(status: &Shared, job: Result<JobStats>) {
    let now_us = i64::try_from(now_ms()).unwrap_or(i64::MAX) * 1000;
    match job {
        Ok(job) => {
            record_job(status, &job);
            status.update(|s| match job.downtime_ms {
                Some(ms) => {
                    s.destination_resume_unix_us = Some(now_us);
                    s.source_stop_unix_us = Some(now_us - i64::try_from(ms).unwrap_or(0) * 1000);
                }
                None => s.event(EventKind::Committed, "libvirt gave no downtime"),
            });
        }
        Err(e) => status.update(|s| {
            s.event(
                EventKind::Committed,
                format!("the destination's job figures: {e:#}"),
            );
        }),
    }
}

/// Auto-converge's throttle in a running job's figures, read every [`POLL`], as on ferry's own
/// path: its highest percent, and the vCPU time it took (the percent over the poll).
fn record_throttle(status: &Shared, job: &JobStats) {
    if let Some(pct) = job.cpu_throttle_pct {
        status.update(|s| {
            s.max_cpu_throttle_pct = Some(s.max_cpu_throttle_pct.unwrap_or(0).max(pct));
            #[allow(clippy::cast_precision_loss)]
            {
                s.throttle_vcpu_s += pct as f64 / 100.0 * POLL.as_secs_f64();
            }
        });
    }
}

/// libvirt's job figures into the status: QEMU's progress as the CLI shows it.
fn record_job(status: &Shared, job: &JobStats) {
    status.update(|s| {
        s.qemu.transferred = job.memory_processed + job.disk_processed;
        s.qemu.remaining = job.memory_remaining;
        s.qemu.total = job.memory_total + job.disk_total;
        s.qemu.iteration = job.memory_iteration;
        if s.phase == Phase::PreparingDestination && job.disk_total > 0 {
            s.phase = Phase::DiskCopy;
            s.detail = "libvirt copies the disks".into();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::agent::ErrorKind;

    #[tokio::test]
    async fn a_libvirt_that_does_not_answer_is_unavailable_and_named() {
        let libvirt = Libvirt::new("/nonexistent/libvirt-sock");
        let refusal = check_domain(&libvirt, "vm1").await.unwrap_err();
        assert_eq!(refusal.kind(), ErrorKind::Unavailable, "{refusal}");
        assert!(
            refusal.to_string().contains("/nonexistent/libvirt-sock"),
            "{refusal}"
        );
    }

    #[test]
    fn with_disks_qemu_gets_the_pause_less_the_relays_drain_and_a_round_trip() {
        assert_eq!(memory_downtime_ms(300, 50.0), 200);
        assert_eq!(memory_downtime_ms(300, 10.2), 239);
        // A long round trip leaves QEMU a third.
        assert_eq!(memory_downtime_ms(300, 250.0), 100);
    }

    #[test]
    fn settings_libvirt_cannot_honour_are_refused_by_name() {
        let mut req: LibvirtMigrationRequest =
            serde_json::from_str(r#"{"domain":"d","to":"p","smart_stop":true}"#).unwrap();
        let refusal = check_settings(&req).unwrap_err();
        assert!(refusal.to_string().contains("smart_stop"), "{refusal}");
        req.settings.smart_stop = false;
        assert!(check_settings(&req).is_ok());
        req.settings.postcopy = true;
        let refusal = check_settings(&req).unwrap_err();
        assert!(refusal.to_string().contains("postcopy"), "{refusal}");
        req.settings.postcopy = false;
        req.settings.postcopy_at_throttle_pct = Some(40);
        let refusal = check_settings(&req).unwrap_err();
        assert!(
            refusal.to_string().contains("postcopy_at_throttle_pct"),
            "{refusal}"
        );
        req.settings.postcopy_at_throttle_pct = None;
        req.settings.test_corrupt_disk_at = Some(0);
        let refusal = check_settings(&req).unwrap_err();
        assert!(
            refusal.to_string().contains("test_corrupt_disk_at"),
            "{refusal}"
        );
        req.settings.test_corrupt_disk_at = None;
        // Pacing paces the disk copy the relay answers: there must be one.
        req.settings.disk_pacing_floor_pct = Some(50);
        let refusal = check_settings(&req).unwrap_err();
        assert!(
            refusal.to_string().contains("needs copy_storage"),
            "{refusal}"
        );
        req.copy_storage = true;
        assert!(check_settings(&req).is_ok());
        for (channels, ok) in [(0, false), (1, true), (4, true), (255, true), (256, false)] {
            req.parallel = Some(channels);
            assert_eq!(check_settings(&req).is_ok(), ok, "{channels}");
        }
        let refusal = check_settings(&LibvirtMigrationRequest {
            parallel: Some(0),
            ..req.clone()
        })
        .unwrap_err();
        assert!(
            refusal.to_string().contains("parallel: 0 channels"),
            "{refusal}"
        );
    }
}
