//! Fitting the cost model to migrations that happened, and its error on the ones it did not
//! see.
//!
//! The fit minimizes the squared log-ratios of predicted to observed total time, WAN bytes and
//! pause (the pause at half weight: it is the noisiest) over a system's migrations, in log
//! space (every figure stays positive; the link share within 0..1): a particle swarm over
//! plausible ranges finds the region (the pass count makes the objective a staircase that
//! traps a local search), Nelder-Mead settles it. The swarm's generator is seeded: the same
//! migrations give the same fit.
//! The error is a k-fold cross-validation: each migration is predicted by a model fitted to
//! the others' folds.

use argmin::core::{CostFunction, Error as ArgminError, Executor};
use argmin::solver::neldermead::NelderMead;
use argmin::solver::particleswarm::ParticleSwarm;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::cost::{Coding, Move, Params};

/// A migration that happened: what was known before it and what it cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Observed {
    /// ferry, or one of QEMU's modes: each is fitted on its own.
    pub system: String,
    pub planned: Move,
    pub total_s: f64,
    pub wan_bytes: f64,
    /// The real pause, if it was measured.
    pub downtime_s: Option<f64>,
}

/// Why a fit cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    #[error("no migrations of {0} to fit to")]
    NoSamples(String),
    #[error("a migration of {system} has a figure that is not a positive number ({what})")]
    BadSample { system: String, what: &'static str },
    #[error("the fit did not run: {0}")]
    Solver(String),
}

/// The swarm: particles and rounds.
const PARTICLES: usize = 60;
const SWARM_ROUNDS: u64 = 300;
/// Nelder-Mead searches after it, each from the last one's best (a restart gets past where
/// one stalls).
const RESTARTS: usize = 4;
const ITERATIONS: u64 = 2000;

/// The figures of `system` fitted to its migrations among `observed`.
pub fn fit(system: &str, observed: &[&Observed]) -> Result<Params, CalibrationError> {
    let samples: Vec<&Observed> = observed
        .iter()
        .copied()
        .filter(|o| o.system == system)
        .collect();
    if samples.is_empty() {
        return Err(CalibrationError::NoSamples(system.to_owned()));
    }
    for o in &samples {
        check(o)?;
    }
    let mut mixes: Vec<String> = samples.iter().map(|o| o.planned.page_mix.clone()).collect();
    mixes.sort();
    mixes.dedup();
    let knows_use = samples.iter().any(|o| o.planned.used_bytes.is_some());
    let objective = Objective {
        samples: &samples,
        mixes: mixes.clone(),
        knows_use,
    };
    let (lower, upper) = bounds(mixes.len());
    let swarm = ParticleSwarm::new((lower, upper), PARTICLES)
        .with_rng_generator(rand::rngs::StdRng::seed_from_u64(0x5eed));
    let result = Executor::new(objective.clone(), swarm)
        .configure(|state| state.max_iters(SWARM_ROUNDS))
        .run()
        .map_err(|e| CalibrationError::Solver(e.to_string()))?;
    let mut best = result
        .state()
        .best_individual
        .as_ref()
        .map_or_else(|| encode(&Params::initial(&mixes)), |p| p.position.clone());
    for restart in 0..RESTARTS {
        let solver = NelderMead::new(simplex(&best, restart))
            .with_sd_tolerance(1e-7)
            .map_err(|e| CalibrationError::Solver(e.to_string()))?;
        let result = Executor::new(objective.clone(), solver)
            .configure(|state| state.max_iters(ITERATIONS))
            .run()
            .map_err(|e| CalibrationError::Solver(e.to_string()))?;
        if let Some(p) = result.state().best_param.clone() {
            best = p;
        }
    }
    Ok(decode(&best, &mixes, knows_use))
}

/// How far predictions are from what happened: medians of |predicted / observed - 1|.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Errors {
    pub system: String,
    pub samples: usize,
    pub total: f64,
    pub wan_bytes: f64,
    /// Over the migrations whose pause was measured.
    pub downtime: Option<f64>,
}

/// The model's error on migrations it did not see: `folds`-fold cross-validation per system
/// (the i-th migration of a system is in fold i mod `folds`).
pub fn cross_validate(
    observed: &[Observed],
    folds: usize,
) -> Result<Vec<Errors>, CalibrationError> {
    let mut systems: Vec<&str> = observed.iter().map(|o| o.system.as_str()).collect();
    systems.sort_unstable();
    systems.dedup();
    let mut all = Vec::new();
    for system in systems {
        let mine: Vec<&Observed> = observed.iter().filter(|o| o.system == system).collect();
        let folds = folds.clamp(2, mine.len().max(2));
        let (mut total, mut bytes, mut pause) = (Vec::new(), Vec::new(), Vec::new());
        for fold in 0..folds {
            let training: Vec<&Observed> = mine
                .iter()
                .enumerate()
                .filter(|(i, _)| i % folds != fold)
                .map(|(_, o)| *o)
                .collect();
            if training.is_empty() {
                continue;
            }
            let params = fit(system, &training)?;
            for o in mine.iter().skip(fold).step_by(folds) {
                let p = params.predict(&o.planned);
                total.push((p.total_s / o.total_s - 1.0).abs());
                bytes.push((p.wan_bytes / o.wan_bytes - 1.0).abs());
                if let Some(d) = o.downtime_s {
                    pause.push((p.downtime_s / d - 1.0).abs());
                }
            }
        }
        all.push(Errors {
            system: system.to_owned(),
            samples: mine.len(),
            total: median(&mut total),
            wan_bytes: median(&mut bytes),
            downtime: (!pause.is_empty()).then(|| median(&mut pause)),
        });
    }
    Ok(all)
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn check(o: &Observed) -> Result<(), CalibrationError> {
    let bad = |what| CalibrationError::BadSample {
        system: o.system.clone(),
        what,
    };
    let positive = |x: f64| x.is_finite() && x > 0.0;
    let non_negative = |x: f64| x.is_finite() && x >= 0.0;
    let m = &o.planned;
    for (ok, what) in [
        (positive(o.total_s), "total time"),
        (positive(o.wan_bytes), "WAN bytes"),
        (o.downtime_s.map_or(true, positive), "pause"),
        (positive(m.mem_bytes), "memory"),
        (positive(m.link_bits_per_s), "link rate"),
        (non_negative(m.rtt_s), "round trip"),
        (non_negative(m.working_set_bytes), "working set"),
        (non_negative(m.dirty_bytes_per_s), "dirty rate"),
        (non_negative(m.disk_bytes), "disk bytes"),
        (positive(m.downtime_target_s), "pause target"),
    ] {
        if !ok {
            return Err(bad(what));
        }
    }
    Ok(())
}

/// The fit's objective over one system's migrations.
#[derive(Clone)]
struct Objective<'a> {
    samples: &'a [&'a Observed],
    mixes: Vec<String>,
    /// Whether any migration knew its guest's use (else free memory's figure is not fitted).
    knows_use: bool,
}

impl CostFunction for Objective<'_> {
    type Param = Vec<f64>;
    type Output = f64;

    fn cost(&self, x: &Vec<f64>) -> Result<f64, ArgminError> {
        let params = decode(x, &self.mixes, self.knows_use);
        let mut sum = 0.0;
        for o in self.samples {
            let p = params.predict(&o.planned);
            sum += (p.total_s / o.total_s).ln().powi(2) + (p.wan_bytes / o.wan_bytes).ln().powi(2);
            if let Some(d) = o.downtime_s {
                sum += 0.5 * (p.downtime_s / d).ln().powi(2);
            }
        }
        #[allow(clippy::cast_precision_loss)] // sample counts are small
        Ok(sum / self.samples.len() as f64)
    }
}

/// The swarm's ranges in the searched vector: wide enough for any link and host seen.
fn bounds(mixes: usize) -> (Vec<f64>, Vec<f64>) {
    let ln = f64::ln;
    let mut lower = vec![
        -3.0,
        ln(0.01),
        ln(0.01),
        ln(0.001),
        ln(0.01),
        ln(0.001),
        ln(1e6),
        ln(1e-4),
    ];
    let mut upper = vec![
        8.0,
        ln(30.0),
        ln(100.0),
        ln(5.0),
        ln(50.0),
        ln(2.0),
        ln(10e9),
        ln(2.0),
    ];
    for _ in 0..mixes {
        lower.extend([ln(0.001), ln(0.001)]);
        upper.extend([ln(3.0), ln(3.0)]);
    }
    (lower, upper)
}

/// Where the page mixes' figures start in the searched vector.
const MIX_AT: usize = 8;

/// The searched vector: the link share's logit, then the logs of every other figure.
fn encode(p: &Params) -> Vec<f64> {
    let mut x = vec![
        (p.link_share / (1.0 - p.link_share)).ln(),
        p.start_s.ln(),
        p.start_rtts.ln(),
        p.pause_s.ln(),
        p.pause_rtts.ln(),
        p.disk_coding.ln(),
        p.pipeline_bytes_per_s.ln(),
        p.free_coding.unwrap_or(0.1).ln(),
    ];
    for (_, c) in &p.coding {
        x.extend([c.first_pass.ln(), c.dirty.ln()]);
    }
    x
}

fn decode(x: &[f64], mixes: &[String], knows_use: bool) -> Params {
    let coding: Vec<(String, Coding)> = mixes
        .iter()
        .enumerate()
        .map(|(i, m)| {
            (
                m.clone(),
                Coding {
                    first_pass: x[MIX_AT + 2 * i].exp(),
                    dirty: x[MIX_AT + 1 + 2 * i].exp(),
                },
            )
        })
        .collect();
    // A mix never seen codes as the seen ones do on (geometric) average.
    #[allow(clippy::cast_precision_loss)]
    let n = coding.len().max(1) as f64;
    let default_coding = Coding {
        first_pass: (coding.iter().map(|(_, c)| c.first_pass.ln()).sum::<f64>() / n).exp(),
        dirty: (coding.iter().map(|(_, c)| c.dirty.ln()).sum::<f64>() / n).exp(),
    };
    Params {
        link_share: 1.0 / (1.0 + (-x[0]).exp()),
        start_s: x[1].exp(),
        start_rtts: x[2].exp(),
        pause_s: x[3].exp(),
        pause_rtts: x[4].exp(),
        disk_coding: x[5].exp(),
        pipeline_bytes_per_s: x[6].exp(),
        coding,
        default_coding,
        free_coding: knows_use.then(|| x[7].exp()),
    }
}

/// A start simplex around `x`: a factor of e along each axis, up on even restarts and down on
/// odd ones (a figure that does not bind where the search starts is found either way).
fn simplex(x: &[f64], restart: usize) -> Vec<Vec<f64>> {
    let step = if restart % 2 == 0 { 1.0 } else { -1.0 };
    let mut s = vec![x.to_vec()];
    for i in 0..x.len() {
        let mut v = x.to_vec();
        v[i] += step;
        s.push(v);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Migrations made by known figures, with a little noise: the fit finds figures that
    /// predict unseen ones closely.
    fn made_by(truth: &Params, n: usize) -> Vec<Observed> {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut noise = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            #[allow(clippy::cast_precision_loss)]
            let u = (x % 1000) as f64 / 1000.0;
            1.0 + 0.04 * (u - 0.5)
        };
        (0..n)
            .map(|i| {
                #[allow(clippy::cast_precision_loss)]
                let k = i as f64;
                let planned = Move {
                    mem_bytes: (256.0 + 128.0 * (k % 4.0)) * 1048576.0,
                    used_bytes: None,
                    working_set_bytes: (32.0 + 32.0 * (k % 5.0)) * 1048576.0,
                    dirty_bytes_per_s: (k % 3.0) * 1048576.0,
                    disk_bytes: 0.0,
                    link_bits_per_s: [50e6, 100e6, 1e9][i % 3],
                    rtt_s: [0.15, 0.05, 0.01][i % 3],
                    downtime_target_s: 0.3,
                    page_mix: ["ws", "zero"][i % 2].into(),
                };
                let c = truth.predict(&planned);
                Observed {
                    system: "ferry".into(),
                    planned,
                    total_s: c.total_s * noise(),
                    wan_bytes: c.wan_bytes * noise(),
                    downtime_s: Some(c.downtime_s * noise()),
                }
            })
            .collect()
    }

    fn truth() -> Params {
        let mut p = Params::initial(&["ws".into(), "zero".into()]);
        p.link_share = 0.8;
        p.start_s = 2.0;
        p.start_rtts = 20.0;
        p.pause_s = 0.05;
        p.pause_rtts = 1.5;
        p.pipeline_bytes_per_s = 60e6;
        p.coding[0].1 = Coding {
            first_pass: 0.6,
            dirty: 0.5,
        };
        p.coding[1].1 = Coding {
            first_pass: 0.05,
            dirty: 0.3,
        };
        p
    }

    #[test]
    fn the_fit_predicts_migrations_it_did_not_see() {
        let observed = made_by(&truth(), 60);
        let errors = cross_validate(&observed, 5).unwrap();
        assert_eq!(errors.len(), 1);
        let e = &errors[0];
        assert_eq!(e.samples, 60);
        assert!(e.total < 0.1, "{e:?}");
        assert!(e.wan_bytes < 0.1, "{e:?}");
        assert!(e.downtime.unwrap() < 0.15, "{e:?}");
    }

    #[test]
    fn nothing_to_fit_or_a_bad_figure_is_an_error() {
        assert_eq!(
            fit("ferry", &[]).unwrap_err().to_string(),
            "no migrations of ferry to fit to"
        );
        let mut o = made_by(&truth(), 1).remove(0);
        o.total_s = 0.0;
        assert_eq!(
            fit("ferry", &[&o]).unwrap_err().to_string(),
            "a migration of ferry has a figure that is not a positive number (total time)"
        );
    }
}
