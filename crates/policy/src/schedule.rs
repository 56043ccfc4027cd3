//! Carrying a plan out within limits: which planned moves may start now, given the moves
//! under way. A host takes part in at most `per_host` moves at once (sending or receiving:
//! either way its CPU and NIC work), and a link between two sites (or within one) carries at
//! most `per_link`. Moves start in the plan's order (cheapest first); one that would break a
//! limit waits without holding back the ones behind it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub per_host: usize,
    pub per_link: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            per_host: 2,
            per_link: 4,
        }
    }
}

/// A move between two hosts, and the sites they are at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hop {
    pub from: usize,
    pub to: usize,
    pub from_site: usize,
    pub to_site: usize,
}

impl Hop {
    fn link(&self) -> (usize, usize) {
        (
            self.from_site.min(self.to_site),
            self.from_site.max(self.to_site),
        )
    }
}

/// Moves under way per host and per link.
#[derive(Default)]
struct Busy {
    hosts: HashMap<usize, usize>,
    links: HashMap<(usize, usize), usize>,
}

impl Busy {
    fn add(&mut self, hop: &Hop) {
        *self.hosts.entry(hop.from).or_default() += 1;
        *self.hosts.entry(hop.to).or_default() += 1;
        *self.links.entry(hop.link()).or_default() += 1;
    }

    fn admits(&self, hop: &Hop, limits: Limits) -> bool {
        let host = |h| self.hosts.get(&h).copied().unwrap_or(0) < limits.per_host;
        let link = self.links.get(&hop.link()).copied().unwrap_or(0) < limits.per_link;
        host(hop.from) && host(hop.to) && link
    }
}

/// The indices of `pending` that may start now, beside `running`.
pub fn startable(pending: &[Hop], running: &[Hop], limits: Limits) -> Vec<usize> {
    let mut busy = Busy::default();
    running.iter().for_each(|hop| busy.add(hop));
    let mut start = Vec::new();
    for (i, hop) in pending.iter().enumerate() {
        if busy.admits(hop, limits) {
            busy.add(hop);
            start.push(i);
        }
    }
    start
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hop(from: usize, to: usize, from_site: usize, to_site: usize) -> Hop {
        Hop {
            from,
            to,
            from_site,
            to_site,
        }
    }

    #[test]
    fn moves_start_in_order_within_the_host_and_link_limits() {
        let limits = Limits {
            per_host: 1,
            per_link: 2,
        };
        let pending = [
            hop(0, 1, 0, 0),
            hop(0, 2, 0, 0), // host 0 is busy with the first
            hop(3, 4, 0, 1),
            hop(5, 6, 1, 0), // the same link, the other way: the link's second
            hop(7, 8, 0, 1), // the link is full
            hop(9, 10, 0, 0),
        ];
        assert_eq!(startable(&pending, &[], limits), [0, 2, 3, 5]);
        // Under way already: host 9's move and one across.
        let running = [hop(9, 11, 0, 0), hop(12, 13, 1, 0)];
        assert_eq!(startable(&pending, &running, limits), [0, 2]);
    }
}
