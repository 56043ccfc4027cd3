//! Overdriver's capacity planner (Williams, ch. 6): how much spare memory a pool of peers
//! must hold. With n VMs each overloaded independently with probability p, the number
//! overloaded at once is binomial; the spare memory is sized for the count that is not
//! exceeded with the confidence asked for. A sustained overload needs room for a whole VM
//! (it migrates); a transient one only for what oversubscription withheld from it (its
//! cooperative swap).

use serde::{Deserialize, Serialize};

/// P{at most k of n are overloaded}, each with probability p (summed in log space: n may be
/// a fleet's VMs).
pub fn at_most(n: u64, p: f64, k: u64) -> f64 {
    if p <= 0.0 {
        return 1.0;
    }
    if p >= 1.0 {
        return if k >= n { 1.0 } else { 0.0 };
    }
    let mut log_pmf = n as f64 * (1.0 - p).ln();
    let ratio = (p / (1.0 - p)).ln();
    let mut sum = log_pmf.exp();
    for i in 0..k.min(n) {
        log_pmf += ((n - i) as f64).ln() - ((i + 1) as f64).ln() + ratio;
        sum += log_pmf.exp();
    }
    sum.min(1.0)
}

/// The fewest overloaded at once that is not exceeded with probability `confidence`.
pub fn bound(n: u64, p: f64, confidence: f64) -> u64 {
    // P{at most k} grows with k: a binary search, each step one sum.
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if at_most(n, p, mid) >= confidence {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// What a pool of `vms` VMs, each of `vm_bytes` with `withheld_bytes` of it withheld by
/// oversubscription, overloaded transiently with probability `p_transient` and sustainedly
/// with `p_sustained`, needs spare.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spare {
    /// Overloads of each kind covered at once.
    pub transient: u64,
    pub sustained: u64,
    /// Room for migrations (whole VMs) and for cooperative swap, with both kinds met as
    /// Overdriver meets them.
    pub overdriver_bytes: f64,
    /// Room for migrations when every overload is met by one.
    pub migration_only_bytes: f64,
}

pub fn spare(
    vms: u64,
    vm_bytes: f64,
    withheld_bytes: f64,
    p_transient: f64,
    p_sustained: f64,
    confidence: f64,
) -> Spare {
    let transient = bound(vms, p_transient, confidence);
    let sustained = bound(vms, p_sustained, confidence);
    let any = bound(vms, p_transient + p_sustained, confidence);
    Spare {
        transient,
        sustained,
        overdriver_bytes: sustained as f64 * vm_bytes + transient as f64 * withheld_bytes,
        migration_only_bytes: any as f64 * vm_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn williams_example_of_150_specweb_vms() {
        // 16% of intervals overloaded, 4% of overloads sustained (reference B.6).
        let p_transient = 0.16 * 0.96;
        let p_sustained = 0.16 * 0.04;
        assert!((at_most(150, p_transient, 31) - 0.968).abs() < 0.002);
        assert!((at_most(150, p_sustained, 3) - 0.984).abs() < 0.002);
        assert_eq!(bound(150, p_sustained, 0.97), 3);
        assert_eq!(bound(150, p_transient, 0.96), 31);
        let mib = 1048576.0;
        let s = spare(
            150,
            1024.0 * mib,
            384.0 * mib,
            p_transient,
            p_sustained,
            0.97,
        );
        assert!(s.overdriver_bytes < s.migration_only_bytes / 2.0, "{s:?}");
    }

    #[test]
    fn a_fleet_sized_pool_sums_without_underflow() {
        let p = at_most(100_000, 0.01, 1100);
        assert!(p > 0.99 && p <= 1.0, "{p}");
        assert!(at_most(100_000, 0.01, 900) < 0.001);
        assert_eq!(at_most(10, 0.0, 0), 1.0);
        assert_eq!(at_most(10, 1.0, 9), 0.0);
    }
}
