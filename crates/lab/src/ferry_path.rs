//! ferry's migration across the lab: the destination QEMU is started paused at the target
//! site (as for the baseline), then the source site's agent is asked to migrate the VM to the
//! target site's agent, which feeds that QEMU. The agents own both QMP connections from then
//! on; this side watches the source agent's status and the WAN emulator's counters, and
//! moves the VM's record once the destination runs.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_agent::client::AgentClient;
use ferry_api::agent::{MigrationRequest, MigrationState, MigrationStatus};
use ferry_api::{EventKind, Sample, Timeline};
use tokio::sync::watch;

use crate::baseline::{now_micros, MigrateOptions, MigrationOutcome, Progress};
use crate::guest::GuestLink;
use crate::topology::{Lab, Site};
use crate::{interrupt, pki, vm, wan};

/// Migrates VM `name` to site `to` through the agents. Same contract as
/// [`crate::baseline::migrate`]: the outcome, and a serial link to wherever the VM runs after.
pub async fn migrate(
    lab: &Lab,
    name: &str,
    to: Site,
    opts: &MigrateOptions,
    src_link: GuestLink,
    progress: &watch::Sender<Progress>,
    timeline: &Mutex<Timeline>,
) -> Result<(MigrationOutcome, GuestLink)> {
    let _active = interrupt::Active::enter();
    let rec = vm::load(lab, name)?;
    if rec.site == to {
        bail!("VM {name:?} already runs at site {}", to.name());
    }
    let source_agent = AgentClient::new(lab.agent_socket(rec.site));
    source_agent.health().await.context(
        "the source site's agent (is the lab up? `ferry lab down && ferry lab up` restarts it)",
    )?;
    let heartbeats = src_link.heartbeats().clone();
    let wan_socket = lab.wan_socket();
    let wan0 = wan::stats(&wan_socket)?;
    let (wan_start, drops_start) = (wan0.total_bytes(), wan0.total_drops());
    let t0_micros = now_micros();
    let t0 = Instant::now();
    heartbeats.reset_max_gap();
    let rate = lab.state().map_or(0.0, |s| s.link.rate_mbit);
    *timeline.lock().expect("timeline poisoned") = Timeline::new(
        "ferry",
        name,
        rec.site.name(),
        to.name(),
        u64::try_from(t0_micros / 1000).unwrap_or(0),
        rate,
    );
    let elapsed_ms = || u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);

    progress.send_modify(|p| p.phase = "starting destination".into());
    let mut dst_spec = vm::spec_at(lab, &rec, to);
    dst_spec.incoming = Some("defer".into());
    dst_spec.paused = true;
    // A copy of the disks the VM left at the destination on an earlier stay is kept: the
    // agents send only what changed since.
    vm::ferry_destination_disks(&rec.spec, &dst_spec, rec.site, to)?;
    let dst_pid = match vm::launch(lab, to, &dst_spec).await {
        Ok(pid) => pid,
        Err(e) => {
            vm::kill_at(lab, &dst_spec, to, 0);
            return Err(e.context("starting the destination; the source VM keeps running"));
        }
    };
    let mark = |t_ms: u64, kind: EventKind, detail: &str| {
        timeline
            .lock()
            .expect("timeline poisoned")
            .event(t_ms, kind, detail);
    };
    mark(elapsed_ms(), EventKind::DestinationStarted, "");
    let dst_link = match GuestLink::connect(&dst_spec.serial_socket, heartbeats.clone()).await {
        Ok(l) => l,
        Err(e) => {
            vm::kill_at(lab, &dst_spec, to, dst_pid);
            return Err(e.context("destination serial; the source VM keeps running"));
        }
    };

    let req = MigrationRequest {
        vm: name.to_owned(),
        source_qmp: rec.spec.qmp_socket.clone(),
        peer: lab.agent_peer_addr(to),
        peer_name: pki::agent_name(to),
        destination_qmp: dst_spec.qmp_socket.clone(),
        link_rate_mbit: (rate > 0.0).then_some(rate),
        disks: rec.spec.disks.iter().map(|d| d.id.clone()).collect(),
        settings: opts.settings.clone(),
    };
    let started = match source_agent.start_migration(&req).await {
        Ok(s) => s,
        Err(e) => {
            vm::kill_at(lab, &dst_spec, to, dst_pid);
            return Err(
                e.context("the source agent refused the migration; the source VM keeps running")
            );
        }
    };

    // Watch until the agent says committed or failed.
    let mut last_wan = (Instant::now(), wan_start);
    let mut seen_events = 0;
    let mut interrupted = false;
    let status: MigrationStatus = loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let s = source_agent.migration(&started.id).await?;
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
        {
            let mut t = timeline.lock().expect("timeline poisoned");
            t.push_sample(Sample {
                t_ms: elapsed_ms(),
                wan_bytes: wan_now - wan_start,
                wan_mbit: mbit,
                qemu_transferred: Some(s.qemu.transferred),
                qemu_remaining: Some(s.qemu.remaining),
                iteration: Some(s.qemu.iteration),
                qemu_status: Some(s.qemu.status.clone()),
                agent_stream_bytes: Some(s.stream_bytes),
                agent_wire_bytes: Some(s.wire.bytes_out),
                agent_unacked_bytes: Some(s.wire.unacked_bytes),
                wan_drops: Some(stats.total_drops() - drops_start),
                ..Sample::default()
            });
            for e in &s.events[seen_events..] {
                let t_ms = e
                    .unix_ms
                    .saturating_sub(u64::try_from(t0_micros / 1000).unwrap_or(0));
                t.event(t_ms, e.kind, &e.detail);
            }
            seen_events = s.events.len();
        }
        progress.send_modify(|p| {
            p.phase = s.phase.clone();
            p.elapsed_ms = elapsed_ms();
            p.wan_bytes = wan_now - wan_start;
            p.wan_mbit = 0.7 * p.wan_mbit + 0.3 * mbit;
            p.ram_total = s.qemu.total;
            p.ram_transferred = s.qemu.transferred;
            p.ram_remaining = s.qemu.remaining;
            p.iteration = s.qemu.iteration;
            p.eta_s =
                (p.wan_mbit > 0.1).then(|| s.qemu.remaining as f64 * 8.0 / (p.wan_mbit * 1e6));
        });
        if s.state != MigrationState::Running {
            break s;
        }
        if interrupt::requested() && !interrupted {
            // Before the stream's end the agent cancels and resumes the source; after it, the
            // destination decides and cancel is refused.
            interrupted = true;
            if let Err(e) = source_agent.cancel(&started.id).await {
                eprintln!("ferry: {e:#}");
            }
        }
    };

    if status.state == MigrationState::Committed {
        let stop = status.source_stop_unix_us;
        let resume = status.destination_resume_unix_us.filter(|r| *r > 0);
        if let Some(s) = stop {
            mark(
                u64::try_from((s - t0_micros).max(0) / 1000).unwrap_or(0),
                EventKind::SourceStopped,
                "",
            );
        }
        if let Some(d) = status.destination_switchover {
            let skipped = format!(
                "{} zero-page records left out (zero there already)",
                d.zero_pages_skipped
            );
            for (at, kind, detail) in [
                (d.arrived_unix_us, EventKind::StreamArrived, ""),
                (d.fed_unix_us, EventKind::StreamFed, skipped.as_str()),
                (d.loaded_unix_us, EventKind::DestinationLoaded, ""),
            ] {
                mark(
                    u64::try_from((at - t0_micros).max(0) / 1000).unwrap_or(0),
                    kind,
                    detail,
                );
            }
        }
        if let Some(r) = resume {
            mark(
                u64::try_from((r - t0_micros).max(0) / 1000).unwrap_or(0),
                EventKind::DestinationResumed,
                "",
            );
        }
        let beats = heartbeats.count();
        let waited = Instant::now();
        while heartbeats.count() < beats + 20 && waited.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The source agent quit the source QEMU; make sure it is gone, then move the record.
        vm::kill_at(lab, &rec.spec, rec.site, rec.pid);
        let mut moved = rec.clone();
        moved.site = to;
        moved.pid = dst_pid;
        moved.spec = vm::spec_at(lab, &rec, to);
        vm::save(lab, &moved)?;
        // The source's disks stay as the older copy for the VM's return (`vm stop` removes
        // them).
        let resume_micros = resume.unwrap_or_else(now_micros);
        let wan_end = wan::stats(&wan_socket).ok();
        let outcome = MigrationOutcome {
            completed: true,
            total_ms: u64::try_from((resume_micros - t0_micros).max(0) / 1000).unwrap_or(0),
            downtime_ms: resume.zip(stop).map(|(r, s)| (r - s) as f64 / 1000.0),
            qemu_downtime_ms: status.qemu_downtime_ms,
            guest_gap_ms: (heartbeats.count() > beats)
                .then(|| heartbeats.max_gap().as_secs_f64() * 1000.0),
            wan_bytes: wan_end.as_ref().map_or(0, |s| s.total_bytes() - wan_start),
            wan_drops: wan_end
                .as_ref()
                .map_or(0, |s| s.total_drops() - drops_start),
            iterations: status.qemu.iteration,
            ram_transferred: status.stream_bytes,
            error: None,
            codec: status.codec.clone(),
            disk: status.disk.clone(),
            cpu_throttle_pct: status.max_cpu_throttle_pct,
            throttle_vcpu_s: status.max_cpu_throttle_pct.map(|_| status.throttle_vcpu_s),
        };
        progress.send_modify(|p| p.phase = "done".into());
        drop(src_link);
        return Ok((outcome, dst_link));
    }

    // Not committed: the agents quit the destination QEMU and resumed the source; make sure
    // the destination process is gone. Its disk images stay: whatever they hold is indexed by
    // content on the next attempt, so they only save bytes.
    vm::kill_at(lab, &dst_spec, to, dst_pid);
    let detail = status.error.clone().unwrap_or_else(|| "failed".into());
    mark(elapsed_ms(), EventKind::Failed, &detail);
    if interrupted {
        bail!("interrupted by the user ({detail})");
    }
    bail!("{detail}")
}
