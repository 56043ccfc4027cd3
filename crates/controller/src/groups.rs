//! Groups that arrive together (CloudNet's synchronized arrival; docs/fleet.md "Groups").
//!
//! A group is migrations stored together, all or none, and scheduled together (whole, within
//! the limits). Each member's source agent keeps QEMU copying (a tiny downtime target) until
//! the controller says *go*: every member is [`ready`] for its last pass. Each member's
//! destination then holds the verified stream's last bytes (the source stays paused) and its
//! source agent reports `held`. When every member is held the group is *released*: one
//! conditional write, made once by whichever controller sees it first; the held agents wait
//! for it in a long-polled heartbeat and let their destinations resume together. A member
//! that fails (or is cancelled, or holds while another does not arrive within
//! [`HOLD_TIMEOUT_MS`]) *aborts* the group instead: members not started fail, running ones
//! stop, held ones abort their destinations; every VM stays at its source.

use std::collections::HashMap;
use std::time::Duration;

use ferry_api::agent::{ErrorKind, Phase};
use ferry_api::fleet::{
    FleetGroup, FleetGroupRequest, FleetMigration, FleetMigrationState, GroupSignal, GroupState,
};

use crate::fleet::{Controller, FleetError};
use crate::store::{now_ms, GroupRecord};

/// Members in one group, at most.
pub const MAX_MEMBERS: usize = 16;
/// How long a held member (paused at its source) waits for the others before the group is
/// aborted.
pub const HOLD_TIMEOUT_MS: u64 = 60_000;
/// How often a long-polled heartbeat looks at the store for its group's decision.
const DECISION_POLL: Duration = Duration::from_millis(20);
/// The longest a heartbeat is held for a decision, whatever the agent asks.
const MAX_WAIT_MS: u64 = 5_000;
/// QEMU's pass counter (1 in the first pass) at which a member that would not stop within
/// its target is ready anyway
/// (it dirties faster than its share of the link carries; QEMU's own rules take it from
/// there).
pub const GO_PASSES: u64 = 10;

impl Controller {
    /// Checks a group request against the fleet and the limits and stores the group and its
    /// members as `requested`.
    pub async fn request_group(
        &self,
        req: FleetGroupRequest,
        requested_by: &str,
    ) -> Result<FleetGroup, FleetError> {
        if !(2..=MAX_MEMBERS).contains(&req.vms.len()) {
            return Err(FleetError::bad(format!(
                "a group has 2 to {MAX_MEMBERS} VMs, not {}",
                req.vms.len()
            )));
        }
        if let Some(twice) = req
            .vms
            .iter()
            .enumerate()
            .find_map(|(i, vm)| req.vms[..i].contains(vm).then_some(vm))
        {
            return Err(FleetError::bad(format!("{twice} is named twice")));
        }
        let fleet = self.load().await?;
        let id = format!("g-{:016x}", ferry_wire::SessionId::random().0 >> 64);
        let members = req
            .vms
            .iter()
            .map(|vm| self.check_request(req.member(vm), &fleet, requested_by, Some(&id)))
            .collect::<Result<Vec<_>, _>>()?;
        // Its members run side by side: they must fit the limits all at once.
        let site = |host: &str| {
            fleet
                .hosts
                .iter()
                .find(|h| h.name == host)
                .map_or_else(String::new, |h| h.site.clone())
        };
        let mut pairs: HashMap<(String, String), usize> = HashMap::new();
        let mut sources: HashMap<&str, usize> = HashMap::new();
        for m in &members {
            let (a, z) = (site(&m.source_host), site(&m.destination_host));
            *pairs
                .entry(if a <= z { (a, z) } else { (z, a) })
                .or_default() += 1;
            *sources.entry(&m.source_host).or_default() += 1;
        }
        let limit = self.config.per_site_pair as usize;
        if let Some(((a, z), n)) = pairs.iter().find(|(_, n)| **n > limit) {
            return Err(FleetError::bad(format!(
                "the group moves {n} VMs between sites {a} and {z} at once; the controller's limit is {limit} (limits.per_site_pair)"
            )));
        }
        for (host, n) in sources {
            let most = fleet
                .hosts
                .iter()
                .find(|h| h.name == host)
                .map_or(0, |h| h.max_outgoing as usize);
            if n > most {
                return Err(FleetError::bad(format!(
                    "the group moves {n} VMs from {host} at once; its agent sends {most} at most (max_outgoing)"
                )));
            }
        }
        let record = GroupRecord {
            id: id.clone(),
            state: GroupState::Open,
            reason: None,
            requested_by: requested_by.to_owned(),
            created_unix_ms: now_ms(),
            decided_unix_ms: None,
            members: members.iter().map(|m| m.id.clone()).collect(),
        };
        self.store.insert_group(&record, &members).await?;
        tracing::info!(
            "group {id} of {} requested by {requested_by}",
            req.vms.join(", ")
        );
        Ok(group_view(record, &members))
    }

    /// Every group with its members, oldest first.
    pub async fn groups(&self) -> Result<Vec<FleetGroup>, FleetError> {
        let migrations = self.store.migrations().await?;
        Ok(self
            .store
            .groups()
            .await?
            .into_iter()
            .map(|g| group_view(g, &migrations))
            .collect())
    }

    pub async fn group(&self, id: &str) -> Result<FleetGroup, FleetError> {
        self.groups()
            .await?
            .into_iter()
            .find(|g| g.id == id)
            .ok_or_else(|| FleetError::Refused(ErrorKind::NotFound, format!("no group {id}")))
    }

    /// Decides the open groups that can be: released when every member holds, aborted when
    /// one failed or the others left a held one waiting too long.
    pub(crate) async fn decide_groups(&self) -> Result<(), FleetError> {
        let open: Vec<GroupRecord> = self
            .store
            .groups()
            .await?
            .into_iter()
            .filter(|g| g.state == GroupState::Open)
            .collect();
        if open.is_empty() {
            return Ok(());
        }
        let migrations = self.store.migrations().await?;
        let now = now_ms();
        for group in open {
            let members = members_of(&group, &migrations);
            let Some((state, reason)) = decision(&members, now) else {
                continue;
            };
            if !self
                .store
                .decide_group(&group.id, state, &reason, now)
                .await?
            {
                continue;
            }
            tracing::info!("group {} {}: {reason}", group.id, state.name());
            if state == GroupState::Aborted {
                // Not handed to an agent yet: nothing to stop. Scheduled ones fail at their
                // source's next heartbeat unless it started them; running ones stop there.
                for m in members
                    .iter()
                    .filter(|m| m.state == FleetMigrationState::Requested)
                {
                    self.store
                        .update_migration(&m.id, |m| {
                            m.state == FleetMigrationState::Requested && {
                                self.fail(
                                    m,
                                    format!("its group {} was aborted: {reason}", group.id),
                                );
                                true
                            }
                        })
                        .await?;
                }
            }
        }
        Ok(())
    }

    /// What the controller says of each group member `host` runs (or was handed).
    pub(crate) async fn group_signals(&self, host: &str) -> Result<Vec<GroupSignal>, FleetError> {
        let migrations = self.store.migrations().await?;
        if !migrations
            .iter()
            .any(|m| m.group.is_some() && m.source_host == host && !m.state.finished())
        {
            return Ok(Vec::new());
        }
        let groups = self.store.groups().await?;
        let mut signals = Vec::new();
        for group in groups {
            let members = members_of(&group, &migrations);
            let go = group.state == GroupState::Released || members.iter().all(ready);
            for m in members
                .iter()
                .filter(|m| m.source_host == host && !m.state.finished())
            {
                signals.push(GroupSignal {
                    fleet_id: m.id.clone(),
                    group: group.id.clone(),
                    go,
                    release: group.state == GroupState::Released,
                    abort: (group.state == GroupState::Aborted)
                        .then(|| group.reason.clone().unwrap_or_default()),
                });
            }
        }
        Ok(signals)
    }

    /// A long-polled heartbeat's signals: as soon as a group of the members `held` here is
    /// decided, or after `wait_ms`.
    pub(crate) async fn wait_for_groups(
        &self,
        host: &str,
        held: &[String],
        wait_ms: u64,
        mut signals: Vec<GroupSignal>,
    ) -> Result<Vec<GroupSignal>, FleetError> {
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(wait_ms.min(MAX_WAIT_MS));
        let undecided = |signals: &[GroupSignal]| {
            signals
                .iter()
                .any(|s| held.contains(&s.fleet_id) && !s.release && s.abort.is_none())
        };
        while undecided(&signals) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(DECISION_POLL).await;
            self.decide_groups().await?;
            signals = self.group_signals(host).await?;
        }
        Ok(signals)
    }

    /// A scheduled member whose group was aborted before its agent started it.
    pub(crate) async fn aborted_group(&self, m: &FleetMigration) -> Result<bool, FleetError> {
        let Some(id) = &m.group else {
            return Ok(false);
        };
        let Some(group) = self.store.groups().await?.into_iter().find(|g| &g.id == id) else {
            return Ok(false);
        };
        if group.state != GroupState::Aborted {
            return Ok(false);
        }
        let reason = group.reason.unwrap_or_default();
        self.store
            .update_migration(&m.id, |m| {
                m.state == FleetMigrationState::Scheduled && {
                    self.fail(m, format!("its group {id} was aborted: {reason}"));
                    true
                }
            })
            .await?;
        Ok(true)
    }
}

/// A group's members as stored, in the order asked.
fn members_of(group: &GroupRecord, migrations: &[FleetMigration]) -> Vec<FleetMigration> {
    group
        .members
        .iter()
        .filter_map(|id| migrations.iter().find(|m| &m.id == id).cloned())
        .collect()
}

/// A member ready for its group's go: QEMU, past its first pass, would now stop it within the
/// downtime target asked for (or it is stopping already). CloudNet's synchronized arrival:
/// no member's last pass starts before every member could take its own. (QEMU may still stop
/// a member early, when a sync finds no dirty page: it then waits paused, docs/fleet.md.)
/// The expected pause is QEMU's (`expected-downtime`: the dirty set at the last sync over the
/// rate), so it does not fall and rise within a pass; a copy-storage member's target for QEMU
/// is somewhat less than the one asked for, which this leaves aside.
fn ready(m: &FleetMigration) -> bool {
    m.state == FleetMigrationState::Running
        && m.agent.as_ref().is_some_and(|a| {
            let converges = a.qemu.iteration >= 2
                && a.qemu
                    .expected_downtime_ms
                    .is_some_and(|ms| ms <= m.settings.downtime_ms);
            converges
                || a.qemu.iteration >= GO_PASSES
                || matches!(a.phase, Phase::Switchover | Phase::Held)
        })
}

fn held(m: &FleetMigration) -> bool {
    m.state == FleetMigrationState::Running
        && m.agent.as_ref().is_some_and(|a| a.phase == Phase::Held)
}

/// An open group's decision, if it can be made now: every member held releases it; a failed
/// member, or a held one left waiting [`HOLD_TIMEOUT_MS`], aborts it.
fn decision(members: &[FleetMigration], now: u64) -> Option<(GroupState, String)> {
    if let Some(failed) = members
        .iter()
        .find(|m| m.state == FleetMigrationState::Failed)
    {
        let why = failed.error.clone().unwrap_or_else(|| "failed".into());
        return Some((GroupState::Aborted, format!("{} failed: {why}", failed.vm)));
    }
    if members.iter().all(held) {
        return Some((GroupState::Released, "every member holds".into()));
    }
    let first_held = members.iter().filter_map(|m| m.held_unix_ms).min()?;
    if now.saturating_sub(first_held) > HOLD_TIMEOUT_MS {
        let late: Vec<&str> = members
            .iter()
            .filter(|m| !held(m))
            .map(|m| m.vm.as_str())
            .collect();
        return Some((
            GroupState::Aborted,
            format!(
                "{} did not reach the switchover within {} s of the first member held",
                late.join(", "),
                HOLD_TIMEOUT_MS / 1000
            ),
        ));
    }
    None
}

/// A group as the API shows it.
fn group_view(group: GroupRecord, migrations: &[FleetMigration]) -> FleetGroup {
    let members = members_of(&group, migrations);
    let resumes: Option<Vec<i64>> = members
        .iter()
        .map(|m| m.agent.as_ref().and_then(|a| a.destination_resume_unix_us))
        .collect();
    let resume_window_ms = resumes.filter(|r| !r.is_empty()).map(|r| {
        let spread = r.iter().max().unwrap_or(&0) - r.iter().min().unwrap_or(&0);
        u64::try_from(spread / 1000).unwrap_or(0)
    });
    FleetGroup {
        id: group.id,
        state: group.state,
        reason: group.reason,
        requested_by: group.requested_by,
        created_unix_ms: group.created_unix_ms,
        decided_unix_ms: group.decided_unix_ms,
        members,
        resume_window_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::agent::MigrationStatus;

    fn member(
        vm: &str,
        state: FleetMigrationState,
        phase: Phase,
        iteration: u64,
    ) -> FleetMigration {
        let mut m = crate::store::tests::migration(&format!("m-{vm}"));
        m.vm = vm.into();
        m.state = state;
        let mut status = MigrationStatus::starting("a".into(), vm.into(), 0);
        status.phase = phase;
        status.qemu.iteration = iteration;
        if phase == Phase::Held {
            m.held_unix_ms = Some(1_000);
        }
        m.agent = Some(status);
        m
    }

    #[test]
    fn a_group_is_released_only_when_every_member_holds() {
        let running = FleetMigrationState::Running;
        let mut members = vec![
            member("web", running, Phase::Held, 3),
            member("db", running, Phase::Memory, 5),
        ];
        assert_eq!(decision(&members, 2_000), None);
        members[1] = member("db", running, Phase::Held, 6);
        assert_eq!(
            decision(&members, 2_000).map(|d| d.0),
            Some(GroupState::Released)
        );
    }

    #[test]
    fn a_failed_member_or_a_long_wait_aborts_the_group() {
        let running = FleetMigrationState::Running;
        let mut failed = member("db", FleetMigrationState::Failed, Phase::Failed, 0);
        failed.error = Some("libvirt: no bridge br9".into());
        let members = vec![member("web", running, Phase::Held, 3), failed];
        let (state, reason) = decision(&members, 2_000).unwrap();
        assert_eq!(state, GroupState::Aborted);
        assert!(
            reason.contains("db failed: libvirt: no bridge br9"),
            "{reason}"
        );
        let members = vec![
            member("web", running, Phase::Held, 3),
            member("db", running, Phase::DiskCopy, 0),
        ];
        assert_eq!(decision(&members, 1_000 + HOLD_TIMEOUT_MS), None);
        let (state, reason) = decision(&members, 1_001 + HOLD_TIMEOUT_MS).unwrap();
        assert_eq!(state, GroupState::Aborted);
        assert!(reason.starts_with("db did not reach"), "{reason}");
    }

    #[test]
    fn go_waits_until_every_member_could_stop_within_its_target() {
        let running = FleetMigrationState::Running;
        let expecting = |iteration, ms: Option<u64>| {
            let mut m = member("a", running, Phase::Memory, iteration);
            m.settings.downtime_ms = 300;
            m.agent.as_mut().unwrap().qemu.expected_downtime_ms = ms;
            m
        };
        // The first pass: what remains is the rest of memory, not what the guest dirties.
        assert!(!ready(&expecting(1, Some(10))));
        assert!(!ready(&expecting(2, None)));
        assert!(!ready(&expecting(3, Some(301))));
        assert!(ready(&expecting(3, Some(300))));
        // One that never would goes after GO_PASSES passes; one stopping already is ready.
        assert!(ready(&expecting(GO_PASSES, Some(5_000))));
        assert!(ready(&member("a", running, Phase::Held, 0)));
        assert!(!ready(&member(
            "a",
            FleetMigrationState::Requested,
            Phase::Starting,
            0
        )));
    }
}
