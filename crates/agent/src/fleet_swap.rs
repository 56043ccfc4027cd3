//! The controller's swaps: its overload response's desired state (docs/policies.md). Each
//! heartbeat's answer lists the swaps this host's VMs should have; the agent takes those they
//! lack and gives back those the controller asked for and no longer lists, each in the
//! background (a take waits for the guest: seconds). A swap that cannot be taken, or given
//! back, is reported failed with the reason and not tried again for [`RETRY_AFTER`], so that
//! the controller can choose another peer or VM meanwhile.
//!
//! Swaps an operator took (`ferry swap on`) are reported and never given back here.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_api::agent::SwapRequest;
use ferry_api::fleet::{SwapPlan, SwapReport, SwapState};

use crate::libvirt::Libvirt;
use crate::server::Agent;

/// How long a failed take or give-back waits before the agent tries it again.
const RETRY_AFTER: Duration = Duration::from_secs(60);

#[derive(Default)]
pub(crate) struct FleetSwaps {
    /// Domains whose swap the controller asked for (taken, or being taken).
    owned: Mutex<HashSet<String>>,
    /// Takes and give-backs running now, with what they are about.
    running: Mutex<HashMap<String, (String, u64)>>,
    /// What failed, why and when.
    failed: Mutex<HashMap<String, (String, u64, String, Instant)>>,
    /// What each swapping guest has paged out, as its agent last said.
    used: Mutex<HashMap<String, u64>>,
}

impl FleetSwaps {
    fn recently_failed(&self, domain: &str) -> bool {
        let mut failed = self.failed.lock().expect("failed lock");
        failed.retain(|_, (.., at)| at.elapsed() < RETRY_AFTER);
        failed.contains_key(domain)
    }

    fn start(&self, domain: &str, peer: &str, bytes: u64) -> bool {
        let mut running = self.running.lock().expect("running lock");
        if running.contains_key(domain) {
            return false;
        }
        running.insert(domain.to_owned(), (peer.to_owned(), bytes));
        true
    }

    fn end(&self, domain: &str, peer: &str, bytes: u64, error: Option<String>) {
        self.running.lock().expect("running lock").remove(domain);
        if let Some(error) = error {
            self.failed.lock().expect("failed lock").insert(
                domain.to_owned(),
                (peer.to_owned(), bytes, error, Instant::now()),
            );
        }
    }
}

/// Brings this host's swaps to what the controller's answer lists.
pub(crate) fn reconcile(agent: &Arc<Agent>, plans: Vec<SwapPlan>) {
    let state = &agent.fleet_swaps;
    let wanted: HashSet<&str> = plans.iter().map(|p| p.domain.as_str()).collect();
    for plan in &plans {
        if agent.swaps.has(&plan.domain)
            || state.recently_failed(&plan.domain)
            || !state.start(&plan.domain, &plan.peer, plan.bytes)
        {
            continue;
        }
        state
            .owned
            .lock()
            .expect("owned lock")
            .insert(plan.domain.clone());
        let agent = agent.clone();
        let plan = plan.clone();
        tokio::spawn(async move {
            let req = SwapRequest {
                peer: plan.peer.clone(),
                bytes: plan.bytes,
                memory_bytes: plan.memory_bytes,
            };
            let taken = crate::borrow::take(
                &agent.config,
                agent.tunnels.as_deref(),
                &agent.swaps,
                &plan.domain,
                req,
            )
            .await;
            let state = &agent.fleet_swaps;
            let error = taken.err().map(|refusal| {
                tracing::warn!(
                    "the controller's swap for {:?} on {}: {refusal}",
                    plan.domain,
                    plan.peer
                );
                state.owned.lock().expect("owned lock").remove(&plan.domain);
                refusal.to_string()
            });
            state.end(&plan.domain, &plan.peer, plan.bytes, error);
        });
    }
    let owned: Vec<String> = state
        .owned
        .lock()
        .expect("owned lock")
        .iter()
        .cloned()
        .collect();
    for domain in owned {
        if wanted.contains(domain.as_str()) || state.recently_failed(&domain) {
            continue;
        }
        let Some(status) = agent.swaps.list().into_iter().find(|s| s.domain == domain) else {
            continue;
        };
        if !state.start(&domain, &status.peer, status.bytes) {
            continue;
        }
        let agent = agent.clone();
        tokio::spawn(async move {
            let given =
                crate::borrow::give_back(agent.tunnels.as_deref(), &agent.swaps, &domain).await;
            let state = &agent.fleet_swaps;
            let error = match given {
                Ok(_) => {
                    tracing::info!(
                        "gave {domain:?}'s swap back: the controller no longer wants it"
                    );
                    state.owned.lock().expect("owned lock").remove(&domain);
                    state.used.lock().expect("used lock").remove(&domain);
                    None
                }
                Err(refusal) => {
                    tracing::warn!("giving the controller's swap for {domain:?} back: {refusal}");
                    Some(refusal.to_string())
                }
            };
            state.end(&domain, &status.peer, status.bytes, error);
        });
    }
}

/// This host's swaps for the heartbeat.
pub(crate) fn reports(agent: &Agent) -> Vec<SwapReport> {
    let state = &agent.fleet_swaps;
    let owned = state.owned.lock().expect("owned lock").clone();
    let used = state.used.lock().expect("used lock").clone();
    let running = state.running.lock().expect("running lock").clone();
    let mut reports: Vec<SwapReport> = agent
        .swaps
        .list()
        .into_iter()
        .filter(|s| !running.contains_key(&s.domain))
        .map(|s| SwapReport {
            used_bytes: used.get(&s.domain).copied(),
            by_controller: owned.contains(&s.domain),
            domain: s.domain,
            peer: s.peer,
            bytes: s.bytes,
            state: SwapState::Taken,
            error: None,
        })
        .collect();
    reports.extend(
        running
            .into_iter()
            .map(|(domain, (peer, bytes))| SwapReport {
                by_controller: true,
                domain,
                peer,
                bytes,
                state: SwapState::Busy,
                used_bytes: None,
                error: None,
            }),
    );
    state
        .failed
        .lock()
        .expect("failed lock")
        .retain(|_, (.., at)| at.elapsed() < RETRY_AFTER);
    let failed = state.failed.lock().expect("failed lock").clone();
    let reported: HashSet<String> = reports.iter().map(|r| r.domain.clone()).collect();
    reports.extend(
        failed
            .into_iter()
            .filter(|(domain, _)| !reported.contains(domain))
            .map(|(domain, (peer, bytes, error, _))| SwapReport {
                by_controller: true,
                domain,
                peer,
                bytes,
                state: SwapState::Failed,
                used_bytes: None,
                error: Some(error),
            }),
    );
    reports.sort_by(|a, b| a.domain.cmp(&b.domain));
    reports
}

/// Asks each swapping guest how much it has paged out (the controller counts it as the VM's
/// memory in use).
pub(crate) async fn sample_used(agent: &Agent, libvirt: &Libvirt) {
    let swapping = agent.swaps.list();
    let mut used = HashMap::new();
    for s in &swapping {
        match crate::borrow::swap_used(libvirt, &s.domain).await {
            Ok(Some(bytes)) => {
                used.insert(s.domain.clone(), bytes);
            }
            Ok(None) => {}
            Err(e) => tracing::debug!("asking {:?} how much it swaps: {e:#}", s.domain),
        }
    }
    *agent.fleet_swaps.used.lock().expect("used lock") = used;
}
