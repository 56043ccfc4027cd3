//! ferry's migration across the lab: the destination QEMU is started paused at the target
//! site (as for the baseline), then the source site's agent is asked to migrate the VM to the
//! target site's agent, which feeds that QEMU. The agents own both QMP connections from then
//! on; this side watches the source agent's status and the WAN emulator's counters, and
//! moves the VM's record once the destination runs.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ferry_agent::client::AgentClient;
use ferry_agent::follow::{self, follow, Followed, Start, WanCount, WanCounter};
use ferry_agent::interrupt;
use ferry_api::agent::{Destination, MigrationRequest, MigrationState, MigrationStatus};
use ferry_api::{EventKind, Timeline};
use tokio::sync::watch;

use crate::baseline::{MigrateOptions, MigrationOutcome, Progress};
use crate::guest::GuestLink;
use crate::topology::{Lab, Site};
use crate::{pki, vm, wan};

/// The WAN emulator's counters since the migration started.
struct EmulatorCounter {
    socket: std::path::PathBuf,
    start: (u64, u64),
}

impl WanCounter for EmulatorCounter {
    fn read(&mut self, _: &MigrationStatus) -> Result<WanCount> {
        let stats = wan::stats(&self.socket)?;
        Ok(WanCount {
            bytes: stats.total_bytes() - self.start.0,
            drops: Some(stats.total_drops() - self.start.1),
        })
    }
}

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
    let start = Start::now();
    heartbeats.reset_max_gap();
    let rate = lab.state().map_or(0.0, |s| s.link.rate_mbit);
    *timeline.lock().expect("timeline poisoned") = Timeline::new(
        "ferry",
        name,
        rec.site.name(),
        to.name(),
        u64::try_from(start.unix_us / 1000).unwrap_or(0),
        rate,
    );
    let elapsed_ms = || start.elapsed_ms();

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
        to: pki::agent_name(to),
        destination: Destination::Qmp(dst_spec.qmp_socket.clone()),
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

    let mut wan_counter = EmulatorCounter {
        socket: wan_socket.clone(),
        start: (wan_start, drops_start),
    };
    let Followed {
        status,
        interrupted,
    } = follow(
        &source_agent,
        &started.id,
        start,
        &mut wan_counter,
        progress,
        timeline,
    )
    .await?;

    if status.state == MigrationState::Committed {
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
        let mut outcome = follow::outcome(
            &status,
            start,
            wan_counter.read(&status).unwrap_or_default(),
        );
        outcome.guest_gap_ms =
            (heartbeats.count() > beats).then(|| heartbeats.max_gap().as_secs_f64() * 1000.0);
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
