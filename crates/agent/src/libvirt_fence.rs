//! A libvirt domain left running at both ends: its copy at the source is paused.
//!
//! libvirt's source drives a peer-to-peer migration and, once QEMU's stream is through, calls
//! the destination's Finish: the destination resumes the domain and answers. When that call
//! fails, libvirt's source takes the migration for failed and resumes its own copy, although
//! the failure may have come after the destination resumed (libvirt's `qemu_migration.c`
//! leaves that case to a lock manager). Through ferry the call crosses the agents' RPC tunnel.
//! A WAN outage does not cut it (the session replays), but an agent killed or restarted
//! between the destination's resume and the answer's arrival does: the source agent killed
//! once the destination QEMU had the whole stream left the VM running at both ends.
//!
//! So the source agent writes each tunnelled stream down when it starts
//! ([`LibvirtStreamRecord`]), and once its end went out (from then on the destination may
//! resume the domain), watches the domain until libvirt settled it ([`decide`]):
//! - gone from the source, or shut off there: the migration completed;
//! - running at the source (libvirt resumed it) and not at the destination: it failed, and the
//!   source runs the VM;
//! - running at both: the copy at the source is paused (`virsh suspend`). The destination's
//!   libvirt finished the migration and holds the domain; the source resumed only because it
//!   never heard so. Paused, not destroyed: what it did since its resume is its own, and an
//!   operator decides;
//! - anything else (paused at the source, or at the destination while the source runs, or the
//!   destination not answering): libvirt has not settled yet. A destination's domain whose
//!   Finish never comes is removed when its RPC connection closes, within the tunnel's WAN
//!   timeout, so the source asks again for up to [`SETTLE_LIMIT`].
//!
//! A restarted agent takes up the records its predecessor left ([`take_up`]).

use std::time::Duration;

use anyhow::Result;
use ferry_api::agent::{MigrationState, MigrationStatus, Phase};
use ferry_api::EventKind;

use crate::engine::journal::{Journal, LibvirtStreamRecord};
use crate::engine::status::{Events, Registry, Shared};
use crate::libvirt::Libvirt;

/// How long the source watches a migration whose stream ended: past the tunnel's WAN timeout, after
/// which a destination whose Finish never came has removed its domain.
pub const SETTLE_LIMIT: Duration = Duration::from_secs(150);
/// How often it asks.
const POLL: Duration = Duration::from_millis(500);

/// A domain at one end, as far as settling goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// Running (the guest executes).
    Running,
    /// Defined and active but not running (paused): held by libvirt or by someone.
    Held,
    /// Not there, or shut off.
    Absent,
}

impl Presence {
    /// From libvirt's state words (`virsh domstate`), `None` for an unknown domain.
    pub fn of(state: Option<&str>) -> Presence {
        match state {
            None | Some("shut off" | "crashed" | "dying") => Presence::Absent,
            Some("running" | "idle" | "blocked") => Presence::Running,
            // Paused, suspended to memory, or on its way out ("in shutdown"): not settled.
            Some(_) => Presence::Held,
        }
    }
}

/// What the watch does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// libvirt settled it; nothing to do.
    Settled,
    /// Running at both ends: pause the source's copy.
    PauseSource,
    /// Not settled yet: ask again.
    Wait,
}

/// The next step, from the domain at the source and, when the source runs it, at the
/// destination (`None`: the destination was not asked or did not answer).
pub fn decide(here: Presence, there: Option<Presence>) -> Step {
    match (here, there) {
        (Presence::Absent, _) | (Presence::Running, Some(Presence::Absent)) => Step::Settled,
        (Presence::Running, Some(Presence::Running)) => Step::PauseSource,
        (Presence::Held, _) | (Presence::Running, None | Some(Presence::Held)) => Step::Wait,
    }
}

/// Both ends' libvirt: this host's, and the peer's through the RPC tunnel.
pub struct Ends {
    pub here: Libvirt,
    pub there: Libvirt,
}

/// Watches `record`'s domain until libvirt settled it, then forgets the record. `status`, the
/// migration's when this agent still lists it, hears what was done; otherwise a pause is
/// listed in `registry` as a failed migration of its own.
pub fn watch(
    journal: Journal,
    ends: Ends,
    record: LibvirtStreamRecord,
    status: Option<Shared>,
    registry: Registry,
) {
    tokio::spawn(async move {
        let outcome = settle(&ends, &record).await;
        report(&record, outcome, status, &registry);
        if let Err(e) = journal.remove_libvirt_stream(&record.id) {
            tracing::warn!("{e:#}");
        }
    });
}

/// Watches the domain of every libvirt stream a predecessor of this agent left (whether its
/// end went out is not known: a stream cut earlier settles the same way, the destination
/// removing its domain).
pub fn take_up(journal: &Journal, ends: impl Fn(&str) -> Option<Ends>, registry: &Registry) {
    let records = match journal.all_libvirt_streams() {
        Ok(records) => records,
        Err(e) => {
            tracing::warn!("the libvirt streams' records: {e:#}");
            return;
        }
    };
    for record in records {
        match ends(&record.peer) {
            Some(ends) => {
                tracing::info!(
                    "libvirt's migration of {} to {} was under way when this agent restarted: \
                     watching it until libvirt settles it",
                    record.domain,
                    record.peer
                );
                watch(journal.clone(), ends, record, None, registry.clone());
            }
            None => tracing::warn!(
                "libvirt's migration of {} went to {}, no longer a peer: not watched",
                record.domain,
                record.peer
            ),
        }
    }
}

/// How the watch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Settled,
    PausedAtSource,
    /// Still not settled at [`SETTLE_LIMIT`]: the last states seen.
    Unsettled(Presence, Option<Presence>),
}

async fn settle(ends: &Ends, record: &LibvirtStreamRecord) -> Outcome {
    let deadline = tokio::time::Instant::now() + SETTLE_LIMIT;
    loop {
        let here = presence_at_source(&ends.here, &record.domain).await.ok();
        // Unknown here (libvirt does not answer): nothing to decide on, ask again.
        let there = match here {
            Some(Presence::Running) => presence(&ends.there, &record.domain).await.ok(),
            _ => None,
        };
        let step = match here {
            Some(here) => decide(here, there),
            None => Step::Wait,
        };
        match step {
            Step::Settled => return Outcome::Settled,
            // Asked again at the next poll: libvirt may have changed it meanwhile.
            Step::PauseSource => match ends.here.suspend(&record.domain).await {
                Ok(()) => return Outcome::PausedAtSource,
                Err(e) => tracing::warn!(
                    "{} seemed to run at both ends; pausing it here failed: {e:#}",
                    record.domain
                ),
            },
            Step::Wait => {}
        }
        if tokio::time::Instant::now() >= deadline {
            return Outcome::Unsettled(here.unwrap_or(Presence::Held), there);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The domain's presence at the source. While libvirt's migration job runs it is held
/// whatever its state says: libvirt reports it running for a while after QEMU stopped it
/// for the switchover (seen right after the stream's end), and only the job's end (its
/// Confirm step, which resumes or removes it) settles it.
async fn presence_at_source(libvirt: &Libvirt, domain: &str) -> Result<Presence> {
    let presence = presence(libvirt, domain).await?;
    if presence == Presence::Running && libvirt.has_job(domain).await? {
        return Ok(Presence::Held);
    }
    Ok(presence)
}

/// The domain's presence in `libvirt`; an error when libvirt does not answer.
async fn presence(libvirt: &Libvirt, domain: &str) -> Result<Presence> {
    match libvirt.state(domain).await {
        Ok(state) => Ok(Presence::of(Some(&state))),
        Err(e) if crate::libvirt::is_unknown_domain(&e) => Ok(Presence::of(None)),
        Err(e) => Err(e),
    }
}

fn report(
    record: &LibvirtStreamRecord,
    outcome: Outcome,
    status: Option<Shared>,
    registry: &Registry,
) {
    let LibvirtStreamRecord { domain, peer, .. } = record;
    match outcome {
        Outcome::Settled => {}
        Outcome::Unsettled(here, there) => tracing::warn!(
            "libvirt had not settled its migration of {domain} to {peer} within {}s: \
             {here:?} here, {there:?} there",
            SETTLE_LIMIT.as_secs()
        ),
        Outcome::PausedAtSource => {
            let error = format!(
                "{domain} ran at both ends: libvirt resumed it here when its Finish call to \
                 {peer} was cut after {peer} had resumed it; its copy here is paused"
            );
            tracing::error!("{error}");
            let status = status.unwrap_or_else(|| {
                let listed = Shared::new(MigrationStatus::starting(
                    record.id.clone(),
                    domain.clone(),
                    record.started_unix_ms,
                ));
                crate::engine::status::register(registry, record.id.clone(), listed.clone());
                listed
            });
            status.update(|s| {
                s.state = MigrationState::Failed;
                s.phase = Phase::Failed;
                s.error = Some(error.clone());
                s.detail = format!("{domain} runs at {peer}; its copy here is paused");
                s.event(EventKind::Failed, error);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libvirts_state_words_are_running_held_or_absent() {
        assert_eq!(Presence::of(Some("running")), Presence::Running);
        assert_eq!(Presence::of(Some("paused")), Presence::Held);
        assert_eq!(Presence::of(Some("pmsuspended")), Presence::Held);
        assert_eq!(Presence::of(Some("in shutdown")), Presence::Held);
        assert_eq!(Presence::of(Some("shut off")), Presence::Absent);
        assert_eq!(Presence::of(None), Presence::Absent);
    }

    #[test]
    fn only_a_domain_running_at_both_ends_is_paused_and_nothing_unsettled_is_decided() {
        use Presence::{Absent, Held, Running};
        // The migration completed: libvirt's Confirm removed or shut off the source's copy.
        assert_eq!(decide(Absent, None), Step::Settled);
        // It failed before the destination resumed: the source runs the VM.
        assert_eq!(decide(Running, Some(Absent)), Step::Settled);
        // The answer to Finish was lost after the destination resumed.
        assert_eq!(decide(Running, Some(Running)), Step::PauseSource);
        // Still settling: the source paused for the switchover, the destination waiting for
        // its Finish (or for its removal), or not answering.
        assert_eq!(decide(Held, None), Step::Wait);
        assert_eq!(decide(Held, Some(Running)), Step::Wait);
        assert_eq!(decide(Running, Some(Held)), Step::Wait);
        assert_eq!(decide(Running, None), Step::Wait);
    }
}
