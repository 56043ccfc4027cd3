//! What the controller does with the fleet: takes migration requests, answers agents'
//! heartbeats (their VMs, their migrations' progress, the work they are given) and, while it
//! leads, schedules migrations and marks silent hosts down.
//!
//! A migration's life: `requested` (checked against the fleet and stored) -> `scheduled` (the
//! leader found both hosts up and room under the limits) -> `running` (the source agent
//! reported it started, or `failed` with its refusal) -> `committed` or `failed` (as the agent
//! reports). Each step is one conditional write of the store ([`Store::update_migration`]), so
//! whichever controller makes it, it is made once.

use ferry_api::agent::{ErrorKind, MigrationState, Phase};
use ferry_api::fleet::{
    FleetEvent, FleetMigration, FleetMigrationReport, FleetMigrationRequest, FleetMigrationState,
    FleetWork, Heartbeat, HeartbeatAnswer, Host, HostState, Pool, PoolRequest, Vm, VmKind,
};

use crate::config::ControllerConfig;
use crate::pools::Snapshot;
use crate::store::{now_ms, PoolRecord, Store, StoreError};

/// A request the controller refuses, or a failure of its own; `kind` is the HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("{1}")]
    Refused(ErrorKind, String),
    /// The caller may not do this (403).
    #[error("{0}")]
    Forbidden(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl FleetError {
    pub fn bad(message: impl Into<String>) -> FleetError {
        FleetError::Refused(ErrorKind::BadRequest, message.into())
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            FleetError::Refused(kind, _) => *kind,
            FleetError::Forbidden(_) => ErrorKind::BadRequest,
            // A store that does not answer refuses changes; it does not corrupt them.
            FleetError::Store(StoreError::Database(_) | StoreError::Open { .. }) => {
                ErrorKind::Unavailable
            }
            FleetError::Store(_) => ErrorKind::Internal,
        }
    }
}

/// One controller of the fleet.
pub struct Controller {
    pub config: ControllerConfig,
    pub store: Store,
    /// The planner's memory and the hosts being emptied (crate::plan).
    pub plans: crate::plan::PlanState,
    /// Each host's memory pressure (crate::overload).
    pub overload: crate::overload::OverloadState,
    /// The figures moves are priced with (crate::cost_model).
    pub cost_model: crate::cost_model::CostModelState,
}

impl Controller {
    pub fn new(config: ControllerConfig, store: Store) -> Controller {
        Controller {
            plans: crate::plan::PlanState::new(&config.policy),
            overload: crate::overload::OverloadState::default(),
            cost_model: crate::cost_model::CostModelState::default(),
            config,
            store,
        }
    }

    fn event(&self, state: FleetMigrationState, detail: impl Into<String>) -> FleetEvent {
        FleetEvent {
            unix_ms: now_ms(),
            state,
            controller: self.config.name.clone(),
            detail: detail.into(),
        }
    }

    /// Checks a migration request against the fleet and stores it as `requested`.
    pub async fn request(
        &self,
        req: FleetMigrationRequest,
        requested_by: &str,
    ) -> Result<FleetMigration, FleetError> {
        let fleet = self.load().await?;
        let migration = self.check_request(req, &fleet, requested_by, None)?;
        self.store.insert_migration(&migration).await?;
        tracing::info!(
            "migration {} of {} from {} to {} requested by {requested_by}",
            migration.id,
            migration.vm,
            migration.source_host,
            migration.destination_host
        );
        Ok(migration)
    }

    /// A migration request checked against the fleet: the migration to store, or why not.
    pub(crate) fn check_request(
        &self,
        req: FleetMigrationRequest,
        fleet: &Loaded,
        requested_by: &str,
        group: Option<&str>,
    ) -> Result<FleetMigration, FleetError> {
        req.settings
            .validate()
            .map_err(|e| FleetError::bad(e.to_string()))?;
        let view = fleet.view();
        let vm = match view.vm(&req.vm) {
            Ok(Some(vm)) => vm,
            Ok(None) => {
                return Err(FleetError::Refused(
                    ErrorKind::NotFound,
                    format!(
                        "no VM {:?} in the fleet (`ferry fleet vms` lists them)",
                        req.vm
                    ),
                ))
            }
            Err(hosts) => {
                return Err(FleetError::Refused(
                    ErrorKind::Conflict,
                    format!(
                        "VM {:?} is reported by several hosts ({}); move it by hand",
                        req.vm,
                        hosts.join(", ")
                    ),
                ))
            }
        };
        if group.is_some() && vm.kind != VmKind::Libvirt {
            return Err(FleetError::bad(format!(
                "{} is a {} VM: only libvirt domains move in groups",
                vm.name,
                vm.kind.name()
            )));
        }
        let hosts = &fleet.hosts;
        let source = hosts.iter().find(|h| h.name == vm.host).ok_or_else(|| {
            FleetError::Refused(ErrorKind::Internal, "the VM's host is unknown".into())
        })?;
        if source.state == HostState::Down {
            return Err(FleetError::Refused(
                ErrorKind::Unavailable,
                format!("{}'s host {} is down (no heartbeat)", vm.name, source.name),
            ));
        }
        let destination = choose_destination(&req, source, hosts)?;
        let pools = view.pools_of(&vm);
        if !pools.is_empty() {
            let overlay = hosts
                .iter()
                .find(|h| h.name == destination)
                .and_then(|h| h.overlay.as_ref());
            if overlay.is_none() {
                return Err(FleetError::Refused(
                    ErrorKind::Conflict,
                    format!(
                        "{} is in pool {} but host {destination} has no overlay (no [overlay] in its agent's config)",
                        vm.name,
                        pools.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
        }
        let unfinished = fleet
            .migrations
            .iter()
            .find(|m| m.vm == vm.name && !m.state.finished());
        if let Some(m) = unfinished {
            return Err(FleetError::Refused(
                ErrorKind::Conflict,
                format!(
                    "{} is already migrating ({}, {})",
                    vm.name,
                    m.id,
                    m.state.name()
                ),
            ));
        }
        let site_of = |name: &str| hosts.iter().find(|h| h.name == name).map(|h| &h.site);
        let planned = vm.usage.map(|usage| {
            let across = site_of(&destination) != Some(&source.site);
            self.cost_model.predict(
                vm.kind,
                crate::cost_model::planned_move(&usage, across, &self.config.policy, &req.settings),
            )
        });
        let now = now_ms();
        let migration = FleetMigration {
            id: new_id(),
            vm: vm.name.clone(),
            kind: vm.kind,
            source_host: source.name.clone(),
            destination_host: destination.clone(),
            state: FleetMigrationState::Requested,
            error: None,
            requested_by: requested_by.to_owned(),
            copy_storage: req.copy_storage,
            settings: req.settings,
            created_unix_ms: now,
            updated_unix_ms: now,
            finished_unix_ms: None,
            cancel_requested: false,
            nics: vm.nics.clone(),
            group: group.map(str::to_owned),
            held_unix_ms: None,
            planned,
            agent: None,
            timeline: vec![self.event(
                FleetMigrationState::Requested,
                match group {
                    Some(group) => format!(
                        "{} -> {} asked by {requested_by}, with group {group}",
                        source.name, destination
                    ),
                    None => format!("{} -> {} asked by {requested_by}", source.name, destination),
                },
            )],
        };
        Ok(migration)
    }

    /// Cancels a migration: one not started yet fails now; a running one is cancelled by its
    /// source agent at its next heartbeat (too late once its stream ended: the agent says so).
    pub async fn cancel(&self, id: &str, by: &str) -> Result<FleetMigration, FleetError> {
        let mut finished = false;
        let m = self
            .store
            .update_migration(id, |m| {
                finished = m.state.finished();
                match m.state {
                    FleetMigrationState::Requested | FleetMigrationState::Scheduled => {
                        self.finish(m, FleetMigrationState::Failed, format!("cancelled by {by}"));
                        true
                    }
                    FleetMigrationState::Running if !m.cancel_requested => {
                        m.cancel_requested = true;
                        m.timeline
                            .push(self.event(m.state, format!("cancel asked by {by}")));
                        true
                    }
                    _ => false,
                }
            })
            .await?
            .ok_or_else(|| not_found(id))?;
        if finished {
            return Err(FleetError::Refused(
                ErrorKind::Conflict,
                format!("migration {id} already {}", m.state.name()),
            ));
        }
        Ok(m)
    }

    pub(crate) fn fail(&self, m: &mut FleetMigration, detail: String) {
        self.finish(m, FleetMigrationState::Failed, detail);
    }

    fn finish(&self, m: &mut FleetMigration, state: FleetMigrationState, detail: String) {
        m.state = state;
        m.finished_unix_ms = Some(now_ms());
        if state == FleetMigrationState::Failed && m.error.is_none() {
            m.error = Some(detail.clone());
        }
        m.timeline.push(self.event(state, detail));
    }

    /// A host's heartbeat: records it, takes in its migrations' progress, and answers with
    /// the work scheduled for it and the cancels asked for.
    pub async fn heartbeat(
        &self,
        host: &str,
        beat: Heartbeat,
    ) -> Result<HeartbeatAnswer, FleetError> {
        if beat.site.is_empty() || !ferry_api::names::valid_name(&beat.site) {
            return Err(FleetError::bad(format!(
                "{:?} is not a site's name",
                beat.site
            )));
        }
        self.store.record_heartbeat(host, &beat, now_ms()).await?;
        for report in &beat.migrations {
            self.take_report(host, report).await?;
        }
        let reported: Vec<&str> = beat
            .migrations
            .iter()
            .map(|r| r.fleet_id.as_str())
            .collect();
        // A running migration its agent no longer knows: the agent restarted and lost it.
        for m in self
            .store
            .migrations_in(FleetMigrationState::Running, Some(host))
            .await?
        {
            if !reported.contains(&m.id.as_str()) {
                self.store
                    .update_migration(&m.id, |m| {
                        m.state == FleetMigrationState::Running && {
                            self.finish(
                                m,
                                FleetMigrationState::Failed,
                                format!("{host}'s agent no longer knows this migration (it restarted); see where the VM runs with `ferry fleet vms`"),
                            );
                            true
                        }
                    })
                    .await?;
            }
        }
        self.decide_groups().await?;
        let mut start = Vec::new();
        for m in self
            .store
            .migrations_in(FleetMigrationState::Scheduled, Some(host))
            .await?
        {
            if reported.contains(&m.id.as_str()) || self.aborted_group(&m).await? {
                continue;
            }
            start.push(FleetWork {
                fleet_id: m.id,
                vm: m.vm,
                kind: m.kind,
                to: m.destination_host,
                copy_storage: m.copy_storage,
                group: m.group,
                settings: m.settings,
            });
        }
        let running = self
            .store
            .migrations_in(FleetMigrationState::Running, Some(host))
            .await?;
        let cancel = running
            .iter()
            .filter(|m| m.cancel_requested)
            .map(|m| m.id.clone())
            .collect();
        // Handed over or running: the agent reports each until its end is known here, even
        // one that failed before the agent's first report of it.
        let track = running
            .into_iter()
            .map(|m| m.id)
            .chain(start.iter().map(|w| w.fleet_id.clone()))
            .collect();
        let overlay = if beat.overlay.is_some() {
            self.load().await?.view().plan_for(host)
        } else {
            None
        };
        let mut groups = self.group_signals(host).await?;
        if let Some(wait_ms) = beat.wait_ms {
            let held: Vec<String> = beat
                .migrations
                .iter()
                .filter(|r| r.status.as_ref().is_some_and(|s| s.phase == Phase::Held))
                .map(|r| r.fleet_id.clone())
                .collect();
            groups = self.wait_for_groups(host, &held, wait_ms, groups).await?;
        }
        Ok(HeartbeatAnswer {
            start,
            cancel,
            track,
            heartbeat_ms: self.config.timing.heartbeat_ms,
            overlay,
            groups,
            swaps: Some(self.store.swap_plans(Some(host)).await?),
        })
    }

    /// One migration as its source agent reports it.
    async fn take_report(
        &self,
        host: &str,
        report: &FleetMigrationReport,
    ) -> Result<(), FleetError> {
        self.store
            .update_migration(&report.fleet_id, |m| {
                if m.source_host != host || m.state.finished() {
                    return false;
                }
                if let Some(refused) = &report.refused {
                    self.finish(
                        m,
                        FleetMigrationState::Failed,
                        format!("{host}'s agent refused it: {}", refused.error),
                    );
                    return true;
                }
                let Some(status) = &report.status else {
                    return false;
                };
                let mut changed = false;
                if m.state != FleetMigrationState::Running {
                    m.state = FleetMigrationState::Running;
                    m.timeline.push(self.event(
                        FleetMigrationState::Running,
                        format!("{host}'s agent started it as {}", status.id),
                    ));
                    changed = true;
                }
                if status.phase == Phase::Held && m.held_unix_ms.is_none() {
                    m.held_unix_ms = Some(now_ms());
                    m.timeline.push(self.event(
                        FleetMigrationState::Running,
                        format!(
                            "held: {}'s whole stream is verified at {}",
                            m.vm, m.destination_host
                        ),
                    ));
                    changed = true;
                }
                match status.state {
                    MigrationState::Running => {}
                    MigrationState::Committed => {
                        self.finish(
                            m,
                            FleetMigrationState::Committed,
                            format!("{} runs at {}", m.vm, m.destination_host),
                        );
                        changed = true;
                    }
                    MigrationState::Failed => {
                        m.error = status.error.clone();
                        self.finish(
                            m,
                            FleetMigrationState::Failed,
                            status.error.clone().unwrap_or_else(|| "failed".into()),
                        );
                        changed = true;
                    }
                }
                // Progress alone is worth a write only when it moved.
                let moved = m.agent.as_ref().is_none_or(|a| {
                    a.phase != status.phase
                        || a.qemu != status.qemu
                        || a.stream_bytes != status.stream_bytes
                        || a.wire.bytes_out != status.wire.bytes_out
                        || a.events.len() != status.events.len()
                });
                if moved || changed {
                    m.agent = Some(status.clone());
                }
                moved || changed
            })
            .await?;
        Ok(())
    }

    /// The leader's round: hosts not heard from are down; requested migrations whose hosts
    /// are up are scheduled within the limits; ones that waited too long fail; scheduled ones
    /// whose source went down go back to the queue.
    pub async fn lead(&self) -> Result<(), FleetError> {
        let now = now_ms();
        let timing = self.config.timing;
        for host in self
            .store
            .mark_hosts_down(now.saturating_sub(timing.host_timeout_ms))
            .await?
        {
            tracing::warn!(
                "host {host} is down: no heartbeat for {} ms",
                timing.host_timeout_ms
            );
        }
        let hosts = self.store.hosts().await?;
        let up = |name: &str| {
            hosts
                .iter()
                .find(|h| h.name == name)
                .filter(|h| h.state == HostState::Up)
        };
        for m in self
            .store
            .migrations_in(FleetMigrationState::Scheduled, None)
            .await?
        {
            if up(&m.source_host).is_none() {
                self.store
                    .update_migration(&m.id, |m| {
                        m.state == FleetMigrationState::Scheduled && {
                            m.state = FleetMigrationState::Requested;
                            m.timeline.push(self.event(
                                FleetMigrationState::Requested,
                                format!(
                                    "{} went down before starting it; queued again",
                                    m.source_host
                                ),
                            ));
                            true
                        }
                    })
                    .await?;
            }
        }
        let mut busy: Vec<FleetMigration> = self
            .store
            .migrations_in(FleetMigrationState::Scheduled, None)
            .await?;
        busy.extend(
            self.store
                .migrations_in(FleetMigrationState::Running, None)
                .await?,
        );
        // An aborted group's members waiting here fail first.
        self.decide_groups().await?;
        let fleet = self.load().await?;
        let view = fleet.view();
        // A group is scheduled whole or not at all: its members copy side by side.
        let requested = self
            .store
            .migrations_in(FleetMigrationState::Requested, None)
            .await?;
        let mut units: Vec<Vec<FleetMigration>> = Vec::new();
        for m in requested {
            match units
                .iter_mut()
                .find(|u| m.group.is_some() && u[0].group == m.group)
            {
                Some(unit) => unit.push(m),
                None => units.push(vec![m]),
            }
        }
        for unit in units {
            let mut admitted: Vec<FleetMigration> = Vec::new();
            for m in &unit {
                let room: Vec<&FleetMigration> = busy.iter().chain(&admitted).collect();
                if !self.admissible(m, &room, &hosts, &view, now).await? {
                    break;
                }
                admitted.push(m.clone());
            }
            if admitted.len() < unit.len() {
                continue;
            }
            for m in unit {
                if let Some(m) = self
                    .store
                    .update_migration(&m.id, |m| {
                        m.state == FleetMigrationState::Requested && {
                            m.state = FleetMigrationState::Scheduled;
                            m.timeline.push(self.event(
                                FleetMigrationState::Scheduled,
                                format!("for {}'s next heartbeat", m.source_host),
                            ));
                            true
                        }
                    })
                    .await?
                {
                    if m.state == FleetMigrationState::Scheduled {
                        busy.push(m);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether requested migration `m` may be scheduled now beside `busy`: both hosts up
    /// (one down too long fails it), room under the limits, its pools ready at the
    /// destination.
    async fn admissible(
        &self,
        m: &FleetMigration,
        busy: &[&FleetMigration],
        hosts: &[Host],
        view: &Snapshot<'_>,
        now: u64,
    ) -> Result<bool, FleetError> {
        let timing = self.config.timing;
        let up = |name: &str| {
            hosts
                .iter()
                .find(|h| h.name == name)
                .filter(|h| h.state == HostState::Up)
        };
        let site_of = |name: &str| {
            hosts
                .iter()
                .find(|h| h.name == name)
                .map(|h| h.site.clone())
        };
        let (Some(source), Some(_)) = (up(&m.source_host), up(&m.destination_host)) else {
            if now.saturating_sub(m.created_unix_ms) > timing.queue_timeout_ms {
                let down = [&m.source_host, &m.destination_host]
                    .into_iter()
                    .filter(|h| up(h).is_none())
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(" and ");
                self.store
                    .update_migration(&m.id, |m| {
                        m.state == FleetMigrationState::Requested && {
                            self.finish(
                                m,
                                FleetMigrationState::Failed,
                                format!(
                                    "{down} stayed down for {} s",
                                    timing.queue_timeout_ms / 1000
                                ),
                            );
                            true
                        }
                    })
                    .await?;
            }
            return Ok(false);
        };
        let from_host = busy
            .iter()
            .filter(|b| b.source_host == m.source_host)
            .count();
        let pair = |b: &FleetMigration| {
            let (a, z) = (site_of(&b.source_host), site_of(&b.destination_host));
            let (ma, mz) = (site_of(&m.source_host), site_of(&m.destination_host));
            (a == ma && z == mz) || (a == mz && z == ma)
        };
        let on_link = busy.iter().filter(|b| pair(b)).count();
        if from_host >= source.max_outgoing as usize
            || on_link >= self.config.per_site_pair as usize
        {
            return Ok(false);
        }
        // libvirt plugs the arriving VM into its pools' bridges: they must be up there.
        let vm = view
            .vms
            .iter()
            .find(|vm| vm.name == m.vm && vm.host == m.source_host);
        if let Some(why) = vm.and_then(|vm| view.not_ready(&m.destination_host, &view.pools_of(vm)))
        {
            tracing::debug!("migration {} waits: {why}", m.id);
            return Ok(false);
        }
        Ok(true)
    }
}

/// One snapshot of what the pools are computed from.
pub struct Loaded {
    pub pools: Vec<PoolRecord>,
    pub hosts: Vec<Host>,
    pub vms: Vec<Vm>,
    pub migrations: Vec<FleetMigration>,
}

impl Loaded {
    pub fn view(&self) -> Snapshot<'_> {
        Snapshot {
            pools: &self.pools,
            hosts: &self.hosts,
            vms: &self.vms,
            migrations: &self.migrations,
        }
    }
}

impl Controller {
    pub async fn load(&self) -> Result<Loaded, FleetError> {
        Ok(Loaded {
            pools: self.store.pools().await?,
            hosts: self.store.hosts().await?,
            vms: self.store.vms().await?,
            migrations: self.store.migrations().await?,
        })
    }

    /// The VMs and where they run now: each once, at the host whose report still holds or
    /// where its last migration took it; a VM two hosts report is listed at both.
    pub async fn vms(&self) -> Result<Vec<Vm>, FleetError> {
        let fleet = self.load().await?;
        let view = fleet.view();
        let mut names: Vec<&str> = fleet.vms.iter().map(|v| v.name.as_str()).collect();
        names.dedup();
        let mut vms = Vec::new();
        for name in names {
            match view.vm(name) {
                Ok(Some(vm)) => vms.push(vm),
                Ok(None) => {}
                Err(_) => vms.extend(view.reports(name).into_iter().cloned()),
            }
        }
        Ok(vms)
    }

    /// The pools, with where their endpoints are now.
    pub async fn pools(&self) -> Result<Vec<Pool>, FleetError> {
        Ok(self.load().await?.view().pools())
    }

    pub async fn pool(&self, name: &str) -> Result<Pool, FleetError> {
        self.pools()
            .await?
            .into_iter()
            .find(|p| p.name == name)
            .ok_or_else(|| no_pool(name))
    }

    /// Checks a new pool against the fleet's others and stores it.
    pub async fn create_pool(&self, req: PoolRequest) -> Result<Pool, FleetError> {
        if !ferry_api::names::valid_name(&req.name) {
            return Err(FleetError::bad(format!(
                "{:?} is not a pool name",
                req.name
            )));
        }
        if !(1..=MAX_VNI).contains(&req.vni) {
            return Err(FleetError::bad(format!(
                "VNI {} is out of VXLAN's range 1..={MAX_VNI}",
                req.vni
            )));
        }
        let bridge = req.bridge.unwrap_or_else(|| format!("fp{}", req.vni));
        if !valid_interface_name(&bridge) {
            return Err(FleetError::bad(format!(
                "{bridge:?} is not a network interface name (1 to 15 letters, digits, '-', '_' or '.')"
            )));
        }
        let hosts = self.store.hosts().await?;
        for held in &req.hold {
            let host = hosts.iter().find(|h| &h.name == held).ok_or_else(|| {
                FleetError::Refused(
                    ErrorKind::NotFound,
                    format!("no host {held:?} in the fleet"),
                )
            })?;
            if host.overlay.is_none() {
                return Err(no_overlay(held));
            }
        }
        let record = PoolRecord {
            name: req.name.clone(),
            vni: req.vni,
            bridge,
            learning: req.learning,
            repoint: !req.learning && !req.no_repoint,
            held: Vec::new(),
        };
        if !self.store.insert_pool(&record, now_ms()).await? {
            let clash = self
                .store
                .pools()
                .await?
                .into_iter()
                .find(|p| p.name == record.name || p.vni == record.vni || p.bridge == record.bridge)
                .map_or_else(
                    || "a pool just created".into(),
                    |p| format!("pool {} (VNI {}, bridge {})", p.name, p.vni, p.bridge),
                );
            return Err(FleetError::Refused(
                ErrorKind::Conflict,
                format!("the name, VNI or bridge is taken by {clash}"),
            ));
        }
        for held in &req.hold {
            self.store.set_hold(&record.name, held, true).await?;
        }
        tracing::info!("pool {} (VNI {}) created", record.name, record.vni);
        self.pool(&record.name).await
    }

    /// Deletes a pool without VMs.
    pub async fn delete_pool(&self, name: &str) -> Result<(), FleetError> {
        let pool = self.pool(name).await?;
        let vms: Vec<&str> = pool
            .endpoints
            .iter()
            .flat_map(|e| e.vms.iter().map(String::as_str))
            .collect();
        if !vms.is_empty() {
            return Err(FleetError::Refused(
                ErrorKind::Conflict,
                format!("pool {name} still has VMs: {}", vms.join(", ")),
            ));
        }
        self.store.delete_pool(name).await?;
        Ok(())
    }

    /// Keeps (or stops keeping) a pool's endpoint on a host whether or not its VMs run there.
    pub async fn hold(&self, pool: &str, host: &str, hold: bool) -> Result<Pool, FleetError> {
        self.pool(pool).await?;
        let known = self.store.host(host).await?.ok_or_else(|| {
            FleetError::Refused(
                ErrorKind::NotFound,
                format!("no host {host:?} in the fleet"),
            )
        })?;
        if hold && known.overlay.is_none() {
            return Err(no_overlay(host));
        }
        self.store.set_hold(pool, host, hold).await?;
        self.pool(pool).await
    }
}

/// VXLAN's network identifiers are 24 bits.
const MAX_VNI: u32 = (1 << 24) - 1;

/// What Linux takes as an interface name (IFNAMSIZ less its NUL), without the characters
/// that would need quoting anywhere.
fn valid_interface_name(name: &str) -> bool {
    (1..=15).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && name != "."
        && name != ".."
}

fn no_pool(name: &str) -> FleetError {
    FleetError::Refused(ErrorKind::NotFound, format!("no pool {name:?}"))
}

fn no_overlay(host: &str) -> FleetError {
    FleetError::Refused(
        ErrorKind::Conflict,
        format!("host {host} has no overlay (no [overlay] in its agent's config)"),
    )
}

/// The destination host: the one named (it must be up, another host, and one of the source
/// agent's peers), or the least loaded such host of the site named.
fn choose_destination(
    req: &FleetMigrationRequest,
    source: &Host,
    hosts: &[Host],
) -> Result<String, FleetError> {
    let peer = |h: &Host| source.peers.contains(&h.name);
    match (&req.to, &req.to_site) {
        (Some(_), Some(_)) => Err(FleetError::bad(
            "give the destination host or its site, not both",
        )),
        (None, None) => Err(FleetError::bad(
            "no destination: give a host (to) or a site (to_site)",
        )),
        (Some(to), None) => {
            let host = hosts.iter().find(|h| &h.name == to).ok_or_else(|| {
                FleetError::Refused(ErrorKind::NotFound, format!("no host {to:?} in the fleet"))
            })?;
            if host.name == source.name {
                return Err(FleetError::Refused(
                    ErrorKind::Conflict,
                    format!("{} already runs on {to}", req.vm),
                ));
            }
            if !peer(host) {
                return Err(FleetError::bad(format!(
                    "{}'s agent has no peer {to} in its config (its peers: {})",
                    source.name,
                    if source.peers.is_empty() {
                        "none".into()
                    } else {
                        source.peers.join(", ")
                    }
                )));
            }
            if host.state == HostState::Down {
                return Err(FleetError::Refused(
                    ErrorKind::Unavailable,
                    format!("host {to} is down (no heartbeat)"),
                ));
            }
            Ok(host.name.clone())
        }
        (None, Some(site)) => {
            if !hosts.iter().any(|h| &h.site == site) {
                return Err(FleetError::Refused(
                    ErrorKind::NotFound,
                    format!("no site {site:?} in the fleet"),
                ));
            }
            hosts
                .iter()
                .filter(|h| &h.site == site && h.name != source.name && peer(h))
                .filter(|h| h.state == HostState::Up)
                .min_by_key(|h| (h.vms, h.name.clone()))
                .map(|h| h.name.clone())
                .ok_or_else(|| {
                    FleetError::Refused(
                        ErrorKind::Unavailable,
                        format!("no host of site {site} is up and a peer of {}", source.name),
                    )
                })
        }
    }
}

fn not_found(id: &str) -> FleetError {
    FleetError::Refused(ErrorKind::NotFound, format!("no migration {id}"))
}

/// 64 random bits: plenty for a fleet's migrations, short enough to type.
fn new_id() -> String {
    format!("m-{:016x}", ferry_wire::SessionId::random().0 >> 64)
}
