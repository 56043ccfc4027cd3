//! How fast each libvirt domain rewrites its memory, for the controller's cost model: QEMU's
//! own measurement (`calc-dirty-rate` in dirty-bitmap mode, through libvirt's
//! `domdirtyrate-calc`), one domain at a time, each every [`EVERY`]. Dirty-bitmap mode counts
//! every page written over the period, as a migration's next pass would resend them; the
//! sampling mode hashes 512 pages per GiB, too few to see a small guest's working set.
//!
//! Only domains under KVM are measured: QEMU counts dirty pages from KVM's dirty log, and
//! under TCG both modes read 0, a wrong figure where none is the honest one (the controller
//! then estimates the rate from the CPU the VM uses).
//!
//! A measurement is started in the background (libvirt holds a job on the domain while it
//! starts one, and a domain in another job makes virsh wait) and read from the next
//! `domstats --dirtyrate`. Domains that migrate are left alone.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::libvirt::{DirtyRate, Libvirt};

/// How often each domain is measured, and for how long.
const EVERY: Duration = Duration::from_secs(20);
const PERIOD_S: u32 = 2;
/// A measurement not read back by then is given up.
const GIVE_UP: Duration = Duration::from_secs(15);
/// A rate older than this is not reported.
const FRESH: Duration = Duration::from_secs(120);

#[derive(Default)]
pub struct DirtyRates {
    /// Each domain's last rate (bytes per second), QEMU's start time of the measurement it
    /// came from, and when it was read.
    rates: HashMap<String, (u64, u64, Instant)>,
    /// The domain being measured, since when.
    measuring: Option<(String, Instant)>,
    /// Whether each domain runs under KVM (asked once per domain).
    kvm: HashMap<String, bool>,
}

impl DirtyRates {
    /// Takes in what this listing's `domstats` said, and starts the next measurement if none
    /// runs: the running, non-migrating domain measured longest ago.
    pub async fn update(
        &mut self,
        libvirt: &Libvirt,
        stats: &HashMap<String, Option<DirtyRate>>,
        running: &[&str],
        migrating: &std::collections::HashSet<String>,
    ) {
        let now = Instant::now();
        self.rates.retain(|name, _| stats.contains_key(name));
        self.kvm.retain(|name, _| stats.contains_key(name));
        for name in running {
            if !self.kvm.contains_key(*name) {
                match libvirt.runs_on_kvm(name).await {
                    Ok(kvm) => {
                        self.kvm.insert((*name).to_owned(), kvm);
                    }
                    Err(e) => tracing::debug!("{name}'s domain type: {e:#}"),
                }
            }
        }
        for (name, rate) in stats {
            let Some(rate) = rate else { continue };
            let known = self.rates.get(name).map(|(_, start, _)| *start);
            if known != Some(rate.start_time) {
                self.rates.insert(
                    name.clone(),
                    (rate.mib_per_s.saturating_mul(1 << 20), rate.start_time, now),
                );
                if self.measuring.as_ref().is_some_and(|(m, _)| m == name) {
                    self.measuring = None;
                }
            }
        }
        if self
            .measuring
            .as_ref()
            .is_some_and(|(_, since)| now.duration_since(*since) > GIVE_UP)
        {
            self.measuring = None;
        }
        if self.measuring.is_some() {
            return;
        }
        let next = running
            .iter()
            .filter(|name| !migrating.contains(**name))
            .filter(|name| self.kvm.get(**name).copied().unwrap_or(false))
            .map(|name| (*name, self.rates.get(*name).map(|(_, _, at)| *at)))
            .filter(|(_, at)| at.is_none_or(|at| now.duration_since(at) >= EVERY))
            .min_by_key(|(_, at)| *at);
        if let Some((name, _)) = next {
            self.measuring = Some((name.to_owned(), now));
            let (libvirt, name) = (libvirt.clone(), name.to_owned());
            tokio::spawn(async move {
                if let Err(e) = libvirt.start_dirty_rate(&name, PERIOD_S).await {
                    tracing::debug!("measuring {name}'s dirty rate: {e:#}");
                }
            });
        }
    }

    /// Whether any domain here can be measured (else `domstats` need not ask).
    pub fn any_measurable(&self) -> bool {
        self.kvm.values().any(|k| *k)
    }

    /// `name`'s rate, bytes per second, if measured lately.
    pub fn rate(&self, name: &str) -> Option<u64> {
        self.rates
            .get(name)
            .filter(|(_, _, at)| at.elapsed() < FRESH)
            .map(|(rate, _, _)| *rate)
    }
}
