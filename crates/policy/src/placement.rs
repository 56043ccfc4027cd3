//! Where something fits: each running host's room (its capacity less the headroom kept free,
//! less what it carries), indexed per site by free CPU so that a best fit (the fullest host
//! that still takes it, which packs) is a range search, not a scan of the fleet.
//!
//! The invariant: a host is in its site's index exactly while it is open (running and not
//! being emptied), under its current free CPU.

use std::collections::BTreeSet;

use crate::fleet::{Fleet, Resources};

/// Hosts looked at past the first that has the CPU, for one with the memory too: bounds a
/// search on a fleet whose CPU and memory are out of step (it may then miss a fit).
const SCAN: usize = 512;

pub struct Room {
    sites: Vec<String>,
    site_of: Vec<usize>,
    usable: Vec<Resources>,
    free: Vec<Resources>,
    open: Vec<bool>,
    by_site: Vec<BTreeSet<(u64, usize)>>,
}

/// Free CPUs as an index key, in thousandths (none below zero).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn key(cpus: f64) -> u64 {
    (cpus.max(0.0) * 1000.0).round() as u64
}

impl Room {
    /// Every running host, open, with `headroom` (a share of its capacity) kept free.
    pub fn new(fleet: &Fleet, loads: &[Resources], headroom: f64) -> Room {
        let mut sites: Vec<String> = Vec::new();
        let site_of = fleet
            .hosts
            .iter()
            .map(|h| match sites.iter().position(|s| *s == h.site) {
                Some(i) => i,
                None => {
                    sites.push(h.site.clone());
                    sites.len() - 1
                }
            })
            .collect();
        let usable: Vec<Resources> = fleet
            .hosts
            .iter()
            .map(|h| h.capacity.scaled(1.0 - headroom))
            .collect();
        let free = usable.iter().zip(loads).map(|(u, l)| u.minus(*l)).collect();
        let mut room = Room {
            by_site: vec![BTreeSet::new(); sites.len()],
            sites,
            site_of,
            usable,
            free,
            open: vec![false; fleet.hosts.len()],
        };
        for (h, host) in fleet.hosts.iter().enumerate() {
            if host.powered && !host.draining {
                room.open(h);
            }
        }
        room
    }

    pub fn site_count(&self) -> usize {
        self.sites.len()
    }

    pub fn site_of(&self, host: usize) -> usize {
        self.site_of[host]
    }

    pub fn site_name(&self, site: usize) -> &str {
        &self.sites[site]
    }

    pub fn free(&self, host: usize) -> Resources {
        self.free[host]
    }

    pub fn usable(&self, host: usize) -> Resources {
        self.usable[host]
    }

    pub fn is_open(&self, host: usize) -> bool {
        self.open[host]
    }

    /// Whether `host` is open and takes `need`.
    pub fn fits(&self, host: usize, need: Resources) -> bool {
        self.open[host] && need.fits_in(self.free[host])
    }

    /// The open host of `site` with the least room that still takes `need`, other than
    /// `except`.
    pub fn best_fit(&self, site: usize, need: Resources, except: &[usize]) -> Option<usize> {
        self.by_site[site]
            .range((key(need.cpus), 0)..)
            .take(SCAN)
            .map(|&(_, h)| h)
            .find(|&h| !except.contains(&h) && need.fits_in(self.free[h]))
    }

    pub fn take(&mut self, host: usize, need: Resources) {
        self.reindex(host, |free| free.minus(need));
    }

    pub fn give(&mut self, host: usize, need: Resources) {
        self.reindex(host, |free| free.plus(need));
    }

    /// Takes `host` out of the search (it is being emptied), or puts it back.
    pub fn close(&mut self, host: usize) {
        if self.open[host] {
            self.by_site[self.site_of[host]].remove(&(key(self.free[host].cpus), host));
            self.open[host] = false;
        }
    }

    pub fn open(&mut self, host: usize) {
        if !self.open[host] {
            self.by_site[self.site_of[host]].insert((key(self.free[host].cpus), host));
            self.open[host] = true;
        }
    }

    fn reindex(&mut self, host: usize, change: impl FnOnce(Resources) -> Resources) {
        let was_open = self.open[host];
        self.close(host);
        self.free[host] = change(self.free[host]);
        if was_open {
            self.open(host);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::Host;

    fn host(name: &str, site: &str, cpus: f64) -> Host {
        Host {
            name: name.into(),
            site: site.into(),
            capacity: Resources::new(cpus, 64e9),
            powered: true,
            powered_since_s: 0.0,
            draining: false,
        }
    }

    #[test]
    fn the_best_fit_is_the_fullest_host_that_takes_it() {
        let fleet = Fleet {
            hosts: vec![
                host("a1", "a", 16.0),
                host("a2", "a", 16.0),
                host("b1", "b", 16.0),
            ],
            vms: vec![],
        };
        let loads = [
            Resources::new(4.0, 1e9),
            Resources::new(10.0, 1e9),
            Resources::default(),
        ];
        let mut room = Room::new(&fleet, &loads, 0.25);
        // Usable 12 CPUs: a1 has 8 free, a2 2.
        assert_eq!(room.best_fit(0, Resources::new(1.0, 1e9), &[]), Some(1));
        assert_eq!(room.best_fit(0, Resources::new(3.0, 1e9), &[]), Some(0));
        assert_eq!(room.best_fit(0, Resources::new(9.0, 1e9), &[]), None);
        assert_eq!(room.best_fit(0, Resources::new(1.0, 1e9), &[1]), Some(0));
        // Memory counts too.
        assert_eq!(room.best_fit(0, Resources::new(1.0, 50e9), &[]), None);
        room.take(0, Resources::new(7.0, 1e9));
        assert_eq!(room.best_fit(0, Resources::new(2.0, 1e9), &[]), Some(1));
        room.close(1);
        assert_eq!(room.best_fit(0, Resources::new(1.0, 1e9), &[]), Some(0));
        assert_eq!(room.site_name(room.site_of(2)), "b");
    }
}
