//! Synthetic demand, with its shape stated (docs/policies.md, "The simulator"):
//!
//! - **Daily**: each VM's CPU demand follows a day, from `trough_share` of its peak at night to
//!   its peak at `peak_hour`, as a cosine; each VM's day is shifted by up to an hour either way.
//! - **Noise**: each minute's demand is off by up to `noise` either way (uniform).
//! - **Bursts**: Poisson, `bursts_per_day` per VM, each lasting an exponentially distributed
//!   time (mean `burst_mean_s`) and multiplying the demand by `burst_factor`.
//!
//! Memory does not follow the day (a VM keeps what it was given); the dirty rate follows the
//! CPU (`dirty_bytes_per_cpu_s`).

use rand::rngs::StdRng;
use rand::Rng;
use rand_distr::{Distribution, Exp};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    pub trough_share: f64,
    pub peak_hour: f64,
    pub noise: f64,
    pub bursts_per_day: f64,
    pub burst_mean_s: f64,
    pub burst_factor: f64,
    pub dirty_bytes_per_cpu_s: f64,
}

impl Default for Shape {
    fn default() -> Shape {
        Shape {
            trough_share: 0.2,
            peak_hour: 15.0,
            noise: 0.1,
            bursts_per_day: 2.0,
            burst_mean_s: 600.0,
            burst_factor: 1.6,
            dirty_bytes_per_cpu_s: 4.0 * 1048576.0,
        }
    }
}

const DAY_S: f64 = 86400.0;

/// One VM's demand over time.
#[derive(Debug, Clone)]
pub struct Trace {
    pub peak_cpus: f64,
    shift_s: f64,
    next_burst_s: f64,
    burst_until_s: f64,
}

impl Trace {
    pub fn new(peak_cpus: f64, shape: &Shape, rng: &mut StdRng) -> Trace {
        let mut t = Trace {
            peak_cpus,
            shift_s: rng.random_range(-3600.0..3600.0),
            next_burst_s: 0.0,
            burst_until_s: f64::NEG_INFINITY,
        };
        t.next_burst_s = t.gap(shape, rng);
        t
    }

    fn gap(&self, shape: &Shape, rng: &mut StdRng) -> f64 {
        match Exp::new(shape.bursts_per_day / DAY_S) {
            Ok(exp) => exp.sample(rng),
            Err(_) => f64::INFINITY,
        }
    }

    /// The CPUs it wants at `now_s` (called with a clock that only goes forward).
    pub fn cpus(&mut self, now_s: f64, shape: &Shape, rng: &mut StdRng) -> f64 {
        while self.next_burst_s <= now_s {
            let length = Exp::new(1.0 / shape.burst_mean_s).map_or(0.0, |e| e.sample(rng));
            self.burst_until_s = self.next_burst_s + length;
            self.next_burst_s += length + self.gap(shape, rng);
        }
        let hours = (now_s + self.shift_s) / 3600.0;
        let day = 0.5 + 0.5 * ((hours - shape.peak_hour) / 24.0 * std::f64::consts::TAU).cos();
        let level = shape.trough_share + (1.0 - shape.trough_share) * day;
        let noise = 1.0 + rng.random_range(-shape.noise..=shape.noise);
        let burst = if now_s < self.burst_until_s {
            shape.burst_factor
        } else {
            1.0
        };
        self.peak_cpus * level * noise * burst
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn demand_peaks_in_the_afternoon_and_bursts_at_the_stated_rate() {
        let shape = Shape::default();
        let mut rng = StdRng::seed_from_u64(7);
        let mut traces: Vec<Trace> = (0..200)
            .map(|_| Trace::new(4.0, &shape, &mut rng))
            .collect();
        let mut by_hour = [0.0; 24];
        let mut bursting = 0usize;
        let mut samples = 0usize;
        for minute in 0..(24 * 60) {
            let now = f64::from(minute) * 60.0;
            for t in &mut traces {
                let c = t.cpus(now, &shape, &mut rng);
                by_hour[usize::try_from(minute / 60).unwrap()] += c;
                bursting += usize::from(now < t.burst_until_s);
                samples += 1;
            }
        }
        let peak = by_hour
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0;
        let trough = by_hour
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0;
        assert!((14..=16).contains(&peak), "peak at {peak}");
        assert!((2..=4).contains(&trough), "trough at {trough}");
        assert!(by_hour[peak] / by_hour[trough] > 3.0);
        // Two bursts of 10 minutes a day: about 1.4% of the time.
        let share = bursting as f64 / samples as f64;
        assert!((0.007..0.025).contains(&share), "{share}");
    }
}
