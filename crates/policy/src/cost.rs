//! The migration cost model: pre-copy as a sequence of passes (Isci et al.'s reading of
//! QEMU's migration, docs/policies.md). The first pass sends the VM's memory and disk, coded
//! at the VM's page mix; each later pass sends what the guest dirtied during the one before
//! (at most its working set), until what is left can be sent within the pause the migration
//! aims at, or a pass limit forces the stop. Each pass sends its coded bytes at the link's
//! share the migration gets, or at what the sender's pipeline produces, whichever is less (a
//! fast link leaves the CPU the bottleneck; the work follows the coded bytes, since zero and
//! unchanged pages cost the pipeline little); the start and the pause add fixed costs and
//! round trips.
//!
//! When the guest's memory in use is known (its balloon statistics, as the fleet's agents
//! report them), the first pass prices the memory it uses at the mix's coding and the rest at
//! [`Params::free_coding`]: an idle guest's free memory is mostly pages it never touched.
//!
//! Every figure the model cannot derive (the link share, the start and pause costs, how well
//! a page mix codes) is a [`Params`] value fitted to ferry's own migrations ([`crate::calibrate`]).

use serde::{Deserialize, Serialize};

/// What is known of a move before it starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Move {
    /// The guest's memory.
    pub mem_bytes: f64,
    /// What the guest uses of it, when known.
    #[serde(default)]
    pub used_bytes: Option<f64>,
    /// The memory the guest keeps rewriting (its working set).
    pub working_set_bytes: f64,
    /// How fast it rewrites it.
    pub dirty_bytes_per_s: f64,
    /// Disk data to copy (none on shared storage).
    pub disk_bytes: f64,
    /// The link's rate and round trip.
    pub link_bits_per_s: f64,
    pub rtt_s: f64,
    /// The pause the migration aims at.
    pub downtime_target_s: f64,
    /// The VM's page mix, as a name its earlier migrations were recorded under (how well its
    /// pages code is learned per mix).
    pub page_mix: String,
}

/// How well a page mix codes: wire bytes per byte of memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Coding {
    /// On the first pass, over the whole memory (untouched pages cost almost nothing).
    pub first_pass: f64,
    /// On later passes, over the dirtied pages.
    pub dirty: f64,
}

/// The fitted figures of one migration system (ferry, or one of QEMU's modes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    /// The share of the link's rate the stream gets.
    pub link_share: f64,
    /// Coded bytes per second the sender's pipeline (parsing, coding, TLS) produces.
    pub pipeline_bytes_per_s: f64,
    /// Fixed cost of starting (connections, the destination's set-up), seconds ...
    pub start_s: f64,
    /// ... and round trips.
    pub start_rtts: f64,
    /// Fixed cost of the pause (stop, last sync, resume), seconds ...
    pub pause_s: f64,
    /// ... and round trips.
    pub pause_rtts: f64,
    /// Wire bytes per byte of disk data.
    pub disk_coding: f64,
    /// Per page mix; a mix without its own uses [`Params::default_coding`].
    pub coding: Vec<(String, Coding)>,
    pub default_coding: Coding,
    /// Wire bytes per byte of memory the guest does not use, fitted where the migrations knew
    /// the guest's use (none: that memory codes as the rest of the first pass).
    #[serde(default)]
    pub free_coding: Option<f64>,
}

/// Passes after which the model stops as the migration would (QEMU's and ferry's convergence
/// measures then force the end).
pub const MAX_PASSES: u32 = 30;

/// What a move is predicted to cost.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    pub total_s: f64,
    pub wan_bytes: f64,
    pub downtime_s: f64,
    pub passes: u32,
}

impl Params {
    /// Neutral figures to start a fit from: the whole link, nothing fixed, no coding gain.
    pub fn initial(mixes: &[String]) -> Params {
        let plain = Coding {
            first_pass: 1.0,
            dirty: 1.0,
        };
        Params {
            link_share: 0.9,
            pipeline_bytes_per_s: 100e6,
            start_s: 1.0,
            start_rtts: 10.0,
            pause_s: 0.1,
            pause_rtts: 2.0,
            disk_coding: 1.0,
            coding: mixes.iter().map(|m| (m.clone(), plain)).collect(),
            default_coding: plain,
            free_coding: None,
        }
    }

    /// ferry's figures fitted to the lab's migrations since 2026-11-24 (`ferry cost-model
    /// --systems ferry --params`; BENCHMARKS.md, "The cost model"): what a fleet without
    /// records of its own starts from.
    pub fn ferry_fitted() -> Params {
        serde_json::from_str(include_str!("ferry_params.json")).expect("the built-in figures parse")
    }

    pub fn coding_of(&self, mix: &str) -> Coding {
        self.coding
            .iter()
            .find(|(m, _)| m == mix)
            .map_or(self.default_coding, |(_, c)| *c)
    }

    /// The cost of `m` by these figures.
    pub fn predict(&self, m: &Move) -> Cost {
        let coding = self.coding_of(&m.page_mix);
        let bytes_per_s = (m.link_bits_per_s / 8.0 * self.link_share)
            .min(self.pipeline_bytes_per_s)
            .max(1.0);
        let pause_fixed = self.pause_s + self.pause_rtts * m.rtt_s;
        let memory = match (m.used_bytes, self.free_coding) {
            (Some(used), Some(free)) => {
                let used = used.clamp(0.0, m.mem_bytes);
                used * coding.first_pass + (m.mem_bytes - used) * free
            }
            _ => m.mem_bytes * coding.first_pass,
        };
        let first = memory + m.disk_bytes * self.disk_coding;
        let mut pass_s = first / bytes_per_s;
        let mut total_s = self.start_s + self.start_rtts * m.rtt_s + pass_s;
        let mut wan_bytes = first;
        let mut passes = 1;
        loop {
            let dirty = (m.dirty_bytes_per_s * pass_s).min(m.working_set_bytes);
            let send = dirty * coding.dirty;
            let send_s = send / bytes_per_s;
            wan_bytes += send;
            if send_s + pause_fixed <= m.downtime_target_s || passes >= MAX_PASSES {
                // The last bytes go while the VM is stopped.
                return Cost {
                    total_s: total_s + send_s + pause_fixed,
                    wan_bytes,
                    downtime_s: send_s + pause_fixed,
                    passes: passes + 1,
                };
            }
            pass_s = send_s;
            total_s += send_s;
            passes += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a_move() -> Move {
        Move {
            mem_bytes: 512.0 * 1048576.0,
            used_bytes: None,
            working_set_bytes: 256.0 * 1048576.0,
            dirty_bytes_per_s: 2.0 * 1048576.0,
            disk_bytes: 0.0,
            link_bits_per_s: 100e6,
            rtt_s: 0.05,
            downtime_target_s: 0.3,
            page_mix: "ws".into(),
        }
    }

    #[test]
    fn an_idle_vm_costs_one_pass_of_its_memory() {
        let p = Params::initial(&[]);
        let m = Move {
            dirty_bytes_per_s: 0.0,
            ..a_move()
        };
        let c = p.predict(&m);
        assert_eq!(c.passes, 2);
        assert_eq!(c.wan_bytes, m.mem_bytes);
        let pass_s = m.mem_bytes / (100e6 / 8.0 * 0.9);
        assert!((c.total_s - (1.0 + 0.5 + pass_s + 0.1 + 0.1)).abs() < 1e-9);
        assert!((c.downtime_s - 0.2).abs() < 1e-9);
    }

    #[test]
    fn cost_grows_with_the_dirty_rate_and_falls_with_the_link_rate() {
        let p = Params::initial(&[]);
        let slow = p.predict(&a_move());
        let hot = p.predict(&Move {
            dirty_bytes_per_s: 8.0 * 1048576.0,
            ..a_move()
        });
        let fast = p.predict(&Move {
            link_bits_per_s: 1e9,
            ..a_move()
        });
        assert!(hot.total_s > slow.total_s && hot.wan_bytes > slow.wan_bytes);
        assert!(fast.total_s < slow.total_s / 5.0);
        // ... until the pipeline is.
        let cpu_bound = Params {
            pipeline_bytes_per_s: 50e6,
            ..p.clone()
        };
        let fast_cpu_bound = cpu_bound.predict(&Move {
            link_bits_per_s: 1e9,
            ..a_move()
        });
        assert!(fast_cpu_bound.total_s > fast_cpu_bound.wan_bytes / 50e6);
    }

    #[test]
    fn a_guest_that_outruns_the_link_stops_at_the_pass_limit_with_a_long_pause() {
        let p = Params::initial(&[]);
        let c = p.predict(&Move {
            dirty_bytes_per_s: 20.0 * 1048576.0,
            ..a_move()
        });
        assert_eq!(c.passes, MAX_PASSES + 1);
        // The whole working set goes in the pause.
        assert!(c.downtime_s > 256.0 * 1048576.0 / (100e6 / 8.0));
    }

    #[test]
    fn memory_the_guest_does_not_use_is_priced_apart_once_fitted() {
        let mut p = Params::initial(&[]);
        let half_used = Move {
            used_bytes: Some(256.0 * 1048576.0),
            dirty_bytes_per_s: 0.0,
            ..a_move()
        };
        // Without a figure for it, free memory codes as the rest.
        assert_eq!(p.predict(&half_used).wan_bytes, 512.0 * 1048576.0);
        p.free_coding = Some(0.01);
        let c = p.predict(&half_used);
        assert!(
            (c.wan_bytes - 256.0 * 1048576.0 * 1.01).abs() < 1.0,
            "{c:?}"
        );
    }

    #[test]
    fn a_mix_that_codes_well_costs_less() {
        let mut p = Params::initial(&["zero".into()]);
        p.coding[0].1 = Coding {
            first_pass: 0.05,
            dirty: 0.5,
        };
        let zero = p.predict(&Move {
            page_mix: "zero".into(),
            ..a_move()
        });
        let ws = p.predict(&a_move());
        assert!(zero.wan_bytes < ws.wan_bytes / 4.0);
    }
}
