//! The overload response (Overdriver; docs/policies.md "Overload"), with `[policy] overload`
//! on. Every `overload_interval_s` the leader samples each host's memory in use: what its
//! VMs' guests use of the memory they hold (their balloon less what the guest could free)
//! plus what they paged out to peers' memory. Above what the host offers, the host is
//! overloaded, and ferry-policy's detector tells how:
//!
//! - **transient**: one of its VMs gets swap on a peer's memory (a swap plan, the agents'
//!   desired state) and its balloon squeezes it by the excess, so that what the host holds
//!   fits again while the burst lasts;
//! - **sustained**: the swaps are given back, and once they are, a VM moves, chosen by
//!   ferry-policy's planner over the VMs' memory in use and priced by the cost model;
//! - **over** (the episode ended): the swaps are given back.
//!
//! With `overload_swap = false` every overload is met by a migration at its first sample
//! (Overdriver's baseline, for comparison: `ferry bench --overload`).
//!
//! Each interval is judged by its highest reading: the host's use is read at every round of
//! the leader (its VMs' figures as the agents last reported them), and the interval's peak is
//! what the detector observes. One reading per interval missed a burst shorter than the
//! interval whenever the burst fell between two readings.
//!
//! A host is not sampled while a VM leaves it (its use is about to change), nor when a guest's
//! use (its balloon's statistics) or a swap's is not reported: the sample would be a guess.

use std::collections::HashMap;
use std::sync::Mutex;

use ferry_api::fleet::{
    FleetMigrationRequest, Host, HostPressure, HostState, SwapPlan, SwapState, VmKind,
};
use ferry_api::settings::MigrationSettings;
use ferry_policy::consolidate::Planner;
use ferry_policy::overload::{Detector, DetectorSettings, Pressure};

use crate::fleet::{Controller, FleetError, Loaded};
use crate::store::now_ms;

/// Each host's detector and its last sample.
#[derive(Default)]
pub struct OverloadState {
    hosts: Mutex<HashMap<String, Watch>>,
}

struct Watch {
    detector: Detector,
    sampled_ms: u64,
    /// The highest reading since the last observation.
    peak: Option<Sample>,
    pressure: Pressure,
    used_bytes: u64,
    swapped_bytes: u64,
    capacity_bytes: u64,
    /// Sustained: its swaps go back, then a VM moves.
    relieving: bool,
}

/// Swap is given in whole MiB, at least this much.
const MIB: u64 = 1 << 20;
const MIN_SWAP: u64 = 16 * MIB;
/// A squeeze frees a little more than the excess, so that the next small rise still fits.
const SQUEEZE_SLACK: u64 = 8 * MIB;
/// The balloon takes a guest down by a quarter of its memory at most: below that, the guest's
/// own working set pages (a guest squeezed too hard thrashes or dies).
const MAX_SQUEEZE_SHARE: u64 = 4;

/// One host's memory in use, as sampled.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    used_bytes: u64,
    swapped_bytes: u64,
    /// What each of its VMs used then: a swap goes to the VM that used the most at the
    /// interval's highest reading, which a short burst may have left by the time it is planned.
    by_vm: Vec<(String, u64)>,
}

/// The host's memory in use, or None when some of it is not reported.
fn sample(loaded: &Loaded, host: &Host) -> Option<Sample> {
    let mut s = Sample {
        used_bytes: 0,
        swapped_bytes: 0,
        by_vm: Vec::new(),
    };
    for vm in loaded.vms.iter().filter(|v| v.host == host.name) {
        // A guest that does not say what it uses (no balloon statistics, or not yet: a guest
        // booting) is not taken to use all it holds: the host is not sampled.
        let used = vm.usage?.used_bytes?;
        s.used_bytes += used;
        s.by_vm.push((vm.name.clone(), used));
    }
    for swap in &host.swaps {
        match swap.state {
            SwapState::Taken => s.swapped_bytes += swap.used_bytes?,
            SwapState::Busy => return None,
            SwapState::Failed => {}
        }
    }
    s.used_bytes += s.swapped_bytes;
    Some(s)
}

/// Each VM's memory in use (what its guest uses, and what it paged out to peers), for VMs
/// whose use is reported.
pub fn in_use(loaded: &Loaded) -> HashMap<String, f64> {
    let swapped: HashMap<&str, u64> = loaded
        .hosts
        .iter()
        .flat_map(|h| &h.swaps)
        .filter(|s| s.state == SwapState::Taken)
        .map(|s| (s.domain.as_str(), s.used_bytes.unwrap_or(s.bytes)))
        .collect();
    loaded
        .vms
        .iter()
        .filter_map(|vm| {
            let usage = vm.usage?;
            let used = usage.used_bytes.unwrap_or(usage.mem_bytes)
                + swapped.get(vm.name.as_str()).copied().unwrap_or(0);
            Some((vm.name.clone(), used as f64))
        })
        .collect()
}

impl Controller {
    /// The leader's round of the overload response ([module docs](self)).
    pub async fn respond_to_overload(&self, loaded: &Loaded) -> Result<(), FleetError> {
        let plans = self.store.swap_plans(None).await?;
        let Some(interval_ms) = self.config.policy.overload_interval_ms else {
            // Off: whatever it asked for goes back.
            for plan in plans {
                self.store.delete_swap_plan(&plan.domain).await?;
            }
            return Ok(());
        };
        // Plans whose VM or host is gone are dropped, and so are those the host could not
        // carry out (the next sample chooses another VM or peer).
        let mut kept = Vec::new();
        for plan in plans {
            let here = loaded
                .vms
                .iter()
                .any(|v| v.name == plan.domain && v.host == plan.host);
            let failed = loaded
                .hosts
                .iter()
                .filter(|h| h.name == plan.host)
                .flat_map(|h| &h.swaps)
                .find(|s| s.domain == plan.domain && s.state == SwapState::Failed);
            if let Some(failed) = failed {
                tracing::warn!(
                    "{} could not give {:?} swap on {}: {}",
                    plan.host,
                    plan.domain,
                    plan.peer,
                    failed.error.as_deref().unwrap_or("no reason given")
                );
            }
            if here && failed.is_none() {
                kept.push(plan);
            } else {
                self.store.delete_swap_plan(&plan.domain).await?;
            }
        }
        let plans = kept;
        let now = now_ms();
        for host in loaded.hosts.iter().filter(|h| h.state == HostState::Up) {
            let Some(capacity) = host.capacity else {
                continue;
            };
            let leaving = loaded
                .migrations
                .iter()
                .any(|m| m.source_host == host.name && !m.state.finished());
            let (action, at_peak) = {
                let mut hosts = self.overload.hosts.lock().expect("overload lock");
                let watch = hosts
                    .entry(host.name.clone())
                    .or_insert_with(|| Watch::new(capacity.mem_bytes));
                let reading = (!leaving).then(|| sample(loaded, host)).flatten();
                let Some(s) = watch.interval_peak(now, interval_ms, leaving, reading) else {
                    continue;
                };
                watch.used_bytes = s.used_bytes;
                watch.swapped_bytes = s.swapped_bytes;
                watch.capacity_bytes = capacity.mem_bytes;
                watch.pressure = watch.detector.observe(s.used_bytes > capacity.mem_bytes);
                let action;
                (action, watch.relieving) = decide(
                    watch.relieving,
                    watch.pressure,
                    watch.detector.in_episode(),
                    self.config.policy.overload_swap,
                    s.used_bytes.saturating_sub(capacity.mem_bytes),
                );
                (action, s.by_vm)
            };
            let mine: Vec<&SwapPlan> = plans.iter().filter(|p| p.host == host.name).collect();
            match action {
                Action::Nothing => {}
                Action::Swap(excess) => {
                    if mine.is_empty() {
                        self.plan_swap(loaded, &plans, host, excess, &at_peak)
                            .await?;
                    }
                }
                Action::GiveBack => {
                    for plan in mine {
                        tracing::info!(
                            "{}'s overload is over: {:?} gives its swap on {} back",
                            host.name,
                            plan.domain,
                            plan.peer
                        );
                        self.store.delete_swap_plan(&plan.domain).await?;
                    }
                }
                Action::Relieve => self.relieve(loaded, host, &mine).await?,
            }
        }
        Ok(())
    }

    /// Transient overload: the VM that used the most memory at the interval's highest reading
    /// (`at_peak`; its use now for a VM not read then) swaps to the peer with the most memory
    /// to lend (at its own site first), squeezed by the excess.
    async fn plan_swap(
        &self,
        loaded: &Loaded,
        plans: &[SwapPlan],
        host: &Host,
        excess: u64,
        at_peak: &[(String, u64)],
    ) -> Result<(), FleetError> {
        let has_swap = |name: &str| host.swaps.iter().any(|s| s.domain == name);
        let Some((vm, used, held)) = loaded
            .vms
            .iter()
            .filter(|v| v.host == host.name && v.kind == VmKind::Libvirt && !has_swap(&v.name))
            .filter_map(|v| {
                let u = v.usage?;
                let then = at_peak.iter().find(|(name, _)| *name == v.name);
                let used = then.map_or(u.used_bytes.unwrap_or(u.mem_bytes), |(_, b)| *b);
                Some((v, used, u.mem_bytes))
            })
            .max_by_key(|(_, used, _)| *used)
        else {
            tracing::info!("{} is overloaded and has no VM that could swap", host.name);
            return Ok(());
        };
        let squeeze =
            round_up_mib(excess + SQUEEZE_SLACK).min(held / MAX_SQUEEZE_SHARE / MIB * MIB);
        if squeeze == 0 {
            return Ok(());
        }
        let bytes = (2 * squeeze).max(MIN_SWAP);
        let lent = |peer: &str| -> u64 {
            let planned: u64 = plans
                .iter()
                .filter(|p| p.peer == peer)
                .map(|p| p.bytes)
                .sum();
            let operators: u64 = loaded
                .hosts
                .iter()
                .flat_map(|h| &h.swaps)
                .filter(|s| s.peer == peer && !s.by_controller && s.state == SwapState::Taken)
                .map(|s| s.bytes)
                .sum();
            planned + operators
        };
        let Some(peer) = loaded
            .hosts
            .iter()
            .filter(|p| p.state == HostState::Up && host.peers.contains(&p.name))
            .filter_map(|p| {
                let room = p.capacity?.lend_bytes.saturating_sub(lent(&p.name));
                (room >= bytes).then_some((p, room))
            })
            .max_by_key(|(p, room)| (p.site == host.site, *room))
            .map(|(p, _)| p)
        else {
            tracing::info!(
                "{} is overloaded and no peer can lend {} MiB of swap",
                host.name,
                bytes / MIB
            );
            return Ok(());
        };
        let plan = SwapPlan {
            host: host.name.clone(),
            domain: vm.name.clone(),
            peer: peer.name.clone(),
            bytes,
            memory_bytes: held - squeeze,
            since_unix_ms: now_ms(),
        };
        tracing::info!(
            "{} is overloaded ({} MiB over): {:?} (using {} MiB) swaps {} MiB to {}, its \
             balloon at {} MiB",
            host.name,
            excess / MIB,
            plan.domain,
            used / MIB,
            bytes / MIB,
            plan.peer,
            plan.memory_bytes / MIB
        );
        self.store.put_swap_plan(&plan).await?;
        Ok(())
    }

    /// Sustained overload: the host's swaps go back; once none is left, the cheapest move
    /// that brings the host's memory in use within its capacity.
    async fn relieve(
        &self,
        loaded: &Loaded,
        host: &Host,
        mine: &[&SwapPlan],
    ) -> Result<(), FleetError> {
        for plan in mine {
            tracing::info!(
                "{}'s overload lasts: {:?} gives its swap back before a VM moves",
                host.name,
                plan.domain
            );
            self.store.delete_swap_plan(&plan.domain).await?;
        }
        if host
            .swaps
            .iter()
            .any(|s| s.by_controller && s.state != SwapState::Failed)
        {
            return Ok(());
        }
        let in_use = in_use(loaded);
        let mut planner = Planner::new(ferry_policy::consolidate::Settings {
            headroom: 0.0,
            // Only spreading: never emptying hosts.
            margin_hosts: usize::MAX,
            ..self.config.policy.settings.clone()
        });
        let (plan, snap) = self.plan_over(&mut planner, loaded, Some(&in_use))?;
        let Some(m) = plan
            .moves
            .iter()
            .find(|m| snap.fleet.hosts[m.from].name == host.name && m.vms.len() == 1)
        else {
            tracing::warn!(
                "{}'s overload lasts and no host can take one of its VMs",
                host.name
            );
            return Ok(());
        };
        let vm = snap.fleet.vms[m.vms[0]].name.clone();
        let to = snap.fleet.hosts[m.to].name.clone();
        let req = FleetMigrationRequest {
            vm: vm.clone(),
            to: Some(to.clone()),
            to_site: None,
            copy_storage: false,
            settings: MigrationSettings::default(),
        };
        match self.request(req, "overload").await {
            Ok(requested) => tracing::info!(
                "{}'s overload lasts: {vm:?} moves to {to} ({})",
                host.name,
                requested.id
            ),
            Err(e) => {
                tracing::warn!("{}'s overload lasts: moving {vm:?} to {to}: {e}", host.name);
                return Ok(());
            }
        }
        let mut hosts = self.overload.hosts.lock().expect("overload lock");
        if let Some(watch) = hosts.get_mut(&host.name) {
            // Its VMs changed: what the detector learned of them no longer holds.
            watch.detector.forget();
            watch.relieving = false;
            watch.pressure = Pressure::Normal;
        }
        Ok(())
    }

    /// Each host's memory pressure as last sampled.
    pub fn pressure(&self) -> Vec<HostPressure> {
        let hosts = self.overload.hosts.lock().expect("overload lock");
        let mut all: Vec<HostPressure> = hosts
            .iter()
            .filter(|(_, w)| w.sampled_ms > 0)
            .map(|(name, w)| HostPressure {
                host: name.clone(),
                used_bytes: w.used_bytes,
                swapped_bytes: w.swapped_bytes,
                capacity_bytes: w.capacity_bytes,
                pressure: match w.pressure {
                    Pressure::Normal => "normal",
                    Pressure::Transient => "transient",
                    Pressure::Sustained => "sustained",
                }
                .into(),
                threshold_intervals: u32::try_from(w.detector.threshold()).unwrap_or(u32::MAX),
                overloaded_in_window: u32::try_from(w.detector.overloaded_in_window())
                    .unwrap_or(u32::MAX),
            })
            .collect();
        all.sort_by(|a, b| a.host.cmp(&b.host));
        all
    }
}

impl Watch {
    /// A host not yet observed, offering `capacity_bytes`.
    fn new(capacity_bytes: u64) -> Watch {
        Watch {
            detector: Detector::new(DetectorSettings::default()),
            sampled_ms: 0,
            peak: None,
            pressure: Pressure::Normal,
            used_bytes: 0,
            swapped_bytes: 0,
            capacity_bytes,
            relieving: false,
        }
    }

    /// Takes this round's reading (`None`: none could be made); at the interval's end, its
    /// highest reading, to observe. A VM leaving the host voids what was read before.
    fn interval_peak(
        &mut self,
        now_ms: u64,
        interval_ms: u64,
        leaving: bool,
        reading: Option<Sample>,
    ) -> Option<Sample> {
        if leaving {
            self.peak = None;
            return None;
        }
        if let Some(r) = reading {
            if self
                .peak
                .as_ref()
                .is_none_or(|p| r.used_bytes > p.used_bytes)
            {
                self.peak = Some(r);
            }
        }
        if now_ms.saturating_sub(self.sampled_ms) < interval_ms {
            return None;
        }
        let peak = self.peak.take()?;
        self.sampled_ms = now_ms;
        Some(peak)
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Action {
    Nothing,
    /// Transient, this much over.
    Swap(u64),
    GiveBack,
    Relieve,
}

/// What a host's latest sample asks for, given whether a relief was under way, and whether
/// one is after it. A relief starts with a sustained overload (or any, without swap: every
/// overload is then met by a migration) and lasts until a VM moves or the overload is over:
/// one that ended on its own, its swaps given back, leaves nothing to relieve, and the next
/// overload starts as transient.
fn decide(
    relieving: bool,
    pressure: Pressure,
    in_episode: bool,
    swap: bool,
    excess_bytes: u64,
) -> (Action, bool) {
    let relieving = in_episode
        && (relieving
            || pressure == Pressure::Sustained
            || (!swap && pressure == Pressure::Transient));
    let action = match pressure {
        _ if relieving => Action::Relieve,
        Pressure::Transient => Action::Swap(excess_bytes),
        Pressure::Normal if !in_episode => Action::GiveBack,
        _ => Action::Nothing,
    };
    (action, relieving)
}

fn round_up_mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB) * MIB
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds samples (`#` over, `.` not) through a detector and `decide`, as the leader does;
    /// one letter per action: `.` nothing, `s` swap, `g` give back, `R` relieve.
    fn actions(samples: &str, swap: bool) -> String {
        let mut detector = Detector::new(DetectorSettings::default());
        let mut relieving = false;
        samples
            .chars()
            .map(|c| {
                let pressure = detector.observe(c == '#');
                let action;
                (action, relieving) = decide(relieving, pressure, detector.in_episode(), swap, 1);
                match action {
                    Action::Nothing => '.',
                    Action::Swap(_) => 's',
                    Action::GiveBack => 'g',
                    Action::Relieve => 'R',
                }
            })
            .collect()
    }

    #[test]
    fn a_transient_overload_swaps_and_gives_back_when_it_ends() {
        assert_eq!(actions("..####...", true), "ggssss..g");
    }

    #[test]
    fn a_sustained_overload_is_relieved_through_its_quiet_intervals() {
        assert_eq!(actions("########.#", true), "sssssssRRR");
    }

    #[test]
    fn an_overload_that_went_sustained_and_ended_leaves_nothing_to_relieve() {
        // Sustained at its 8th sample, over before a VM could move: the next overload starts
        // as transient again (it once stayed "relieving" and moved a VM at its first sample).
        assert_eq!(actions("########...", true), "sssssssRRRg");
        let mut detector = Detector::new(DetectorSettings::default());
        let mut relieving = false;
        for c in "########....................".chars() {
            let pressure = detector.observe(c == '#');
            (_, relieving) = decide(relieving, pressure, detector.in_episode(), true, 1);
        }
        assert!(!relieving);
        let pressure = detector.observe(true);
        assert_eq!(pressure, Pressure::Transient);
        let (action, _) = decide(relieving, pressure, detector.in_episode(), true, 1);
        assert_eq!(action, Action::Swap(1));
    }

    fn reading(mib: u64) -> Option<Sample> {
        Some(Sample {
            used_bytes: mib * MIB,
            swapped_bytes: 0,
            by_vm: Vec::new(),
        })
    }

    #[test]
    fn an_interval_is_judged_by_its_highest_reading() {
        let mut w = Watch::new(0);
        // The first round observes at once; then one observation every 3 s of 1 s rounds.
        assert_eq!(
            w.interval_peak(10_000, 3000, false, reading(100)),
            reading(100)
        );
        // A burst read only at 11 s, gone by the interval's end: observed at 13 s.
        assert_eq!(w.interval_peak(11_000, 3000, false, reading(250)), None);
        assert_eq!(w.interval_peak(12_000, 3000, false, reading(100)), None);
        assert_eq!(
            w.interval_peak(13_000, 3000, false, reading(100)),
            reading(250)
        );
        // The next interval starts afresh.
        assert_eq!(w.interval_peak(14_000, 3000, false, reading(120)), None);
        assert_eq!(w.interval_peak(16_000, 3000, false, None), reading(120));
    }

    #[test]
    fn an_interval_without_a_reading_is_not_observed_and_a_leaving_vm_voids_it() {
        let mut w = Watch::new(0);
        // Nothing reported: no observation, the next reading is observed at once.
        assert_eq!(w.interval_peak(10_000, 3000, false, None), None);
        assert_eq!(
            w.interval_peak(11_000, 3000, false, reading(90)),
            reading(90)
        );
        // A burst read, then a VM leaves: what was read before does not count.
        assert_eq!(w.interval_peak(12_000, 3000, false, reading(300)), None);
        assert_eq!(w.interval_peak(13_000, 3000, true, reading(300)), None);
        assert_eq!(
            w.interval_peak(14_000, 3000, false, reading(80)),
            reading(80)
        );
    }

    #[test]
    fn without_swap_every_overload_is_relieved_at_once() {
        assert_eq!(actions("..##...", false), "ggRRRRg");
    }
}
