//! Overload, as Overdriver tells it apart (Williams, ch. 6; docs/policies.md): a VM's memory
//! pressure is sampled every interval (10 s there: overloaded when it pages more than 200
//! times a second), and an overload counts as sustained once `needed` of the last `window`
//! intervals were overloaded (8 of 12 there: sustained overload oscillates). Until then it is
//! transient, and met by cooperative swap; sustained, it is met by a migration.
//!
//! An overload is one episode while it pauses for at most two quiet intervals. Where
//! transients end adapts to the VM: the lengths of its transient episodes are kept, and once
//! there are `profile_min` of them, their mean plus three standard deviations becomes its
//! threshold when that is shorter than the window (it only tightens): an episode longer than
//! that is sustained, so a VM whose bursts are short is migrated sooner when one does not
//! end, and one as long as its usual bursts is not. After a migration the profile no longer
//! holds (the VM's allocation changed) and learning starts again ([`Detector::forget`]).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetectorSettings {
    /// The window, in intervals, to start with.
    pub window: usize,
    /// Overloaded intervals in the window that make an overload sustained, as a share of the
    /// window (8 of 12).
    pub needed_share: f64,
    /// Transient overloads seen before the window adapts.
    pub profile_min: usize,
    /// The learned threshold never goes below this many intervals.
    pub min_window: usize,
}

impl Default for DetectorSettings {
    fn default() -> DetectorSettings {
        DetectorSettings {
            window: 12,
            needed_share: 8.0 / 12.0,
            profile_min: 10,
            min_window: 3,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pressure {
    Normal,
    /// Overloaded, not (yet) for long: cooperative swap.
    Transient,
    /// Overloaded for most of the window: migrate.
    Sustained,
}

/// Quiet intervals an overload may pause for and still be the same overload (sustained
/// overload oscillates).
const MAX_GAP: usize = 2;

#[derive(Debug, Clone)]
pub struct Detector {
    settings: DetectorSettings,
    /// Where transients end, as learned (intervals); `settings.window` until learned.
    threshold: usize,
    recent: VecDeque<bool>,
    /// The overload under way: intervals since it began (gaps included), the quiet ones at
    /// its end, and whether it already counts as sustained.
    episode: Option<Episode>,
    /// The transients seen: how many, and the sum of their lengths and of their squares.
    transients: (usize, f64, f64),
}

#[derive(Debug, Clone, Copy)]
struct Episode {
    length: usize,
    quiet: usize,
    sustained: bool,
}

impl Detector {
    pub fn new(settings: DetectorSettings) -> Detector {
        Detector {
            threshold: settings.window,
            settings,
            recent: VecDeque::new(),
            episode: None,
            transients: (0, 0.0, 0.0),
        }
    }

    /// Whether an overload is under way (its quiet intervals included).
    pub fn in_episode(&self) -> bool {
        self.episode.is_some()
    }

    /// Overloaded samples among the last `window`: an overload is sustained once they reach
    /// the needed share, whichever episodes they belong to (Overdriver's rule, for overloads
    /// that oscillate).
    pub fn overloaded_in_window(&self) -> usize {
        self.recent.iter().filter(|&&o| o).count()
    }

    /// Where transients end now, in intervals.
    pub fn threshold(&self) -> usize {
        self.threshold
    }

    fn needed(&self) -> usize {
        let window = self.settings.window;
        let needed = (window as f64 * self.settings.needed_share).ceil();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let needed = needed as usize;
        needed.clamp(1, window)
    }

    /// One interval's sample.
    pub fn observe(&mut self, overloaded: bool) -> Pressure {
        self.recent.push_back(overloaded);
        while self.recent.len() > self.settings.window {
            self.recent.pop_front();
        }
        let mut e = match self.episode {
            Some(e) => e,
            None if overloaded => Episode {
                length: 0,
                quiet: 0,
                sustained: false,
            },
            None => return Pressure::Normal,
        };
        e.length += 1;
        if overloaded {
            e.quiet = 0;
        } else {
            e.quiet += 1;
            if e.quiet > MAX_GAP {
                // It ended: a transient is learned (without its quiet tail).
                if !e.sustained {
                    self.learn(e.length - e.quiet);
                }
                self.episode = None;
                return Pressure::Normal;
            }
        }
        let in_window = self.recent.iter().filter(|&&o| o).count();
        e.sustained |= in_window >= self.needed()
            || (self.threshold < self.settings.window && e.length > self.threshold);
        self.episode = Some(e);
        match (overloaded, e.sustained) {
            (false, _) => Pressure::Normal,
            (true, true) => Pressure::Sustained,
            (true, false) => Pressure::Transient,
        }
    }

    /// A migration changed the VM's allocation: what was learned no longer holds.
    pub fn forget(&mut self) {
        *self = Detector::new(self.settings.clone());
    }

    fn learn(&mut self, length: usize) {
        let (n, sum, squares) = &mut self.transients;
        *n += 1;
        *sum += length as f64;
        *squares += (length as f64).powi(2);
        if *n < self.settings.profile_min {
            return;
        }
        let mean = *sum / *n as f64;
        let var = (*squares / *n as f64 - mean * mean).max(0.0);
        let bound = (mean + 3.0 * var.sqrt() - 1e-9).ceil();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let bound = (bound as usize).max(self.settings.min_window);
        if bound < self.threshold {
            self.threshold = bound;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(d: &mut Detector, samples: &str) -> String {
        samples
            .chars()
            .map(|c| match d.observe(c == '#') {
                Pressure::Normal => '.',
                Pressure::Transient => 't',
                Pressure::Sustained => 'S',
            })
            .collect()
    }

    #[test]
    fn eight_of_twelve_make_an_overload_sustained() {
        let mut d = Detector::new(DetectorSettings::default());
        // Short bursts stay transient.
        assert_eq!(feed(&mut d, "###.##.."), "ttt.tt..");
        // Oscillating overload is sustained at its 8th overloaded interval of 12.
        assert_eq!(feed(&mut d, "....##.###.###"), "....tt.ttt.ttS");
        // One quiet interval does not end it: the window still holds eight.
        assert_eq!(feed(&mut d, "#.#"), "S.S");
        assert!(
            d.in_episode(),
            "quiet for one interval: the overload goes on"
        );
        assert_eq!(feed(&mut d, "........#"), "........t");
    }

    #[test]
    fn short_transients_tighten_the_threshold_and_it_never_widens() {
        let mut d = Detector::new(DetectorSettings::default());
        for _ in 0..9 {
            feed(&mut d, "##....");
        }
        assert_eq!(d.threshold(), 12, "not before the profile has 10 overloads");
        feed(&mut d, "###....");
        // Nine of 2 and one of 3: mean 2.1, sd 0.3, so mean + 3 sd = 3.
        assert_eq!(d.threshold(), 3);
        // As long as its usual bursts: transient. Longer (quiet intervals count): sustained.
        assert_eq!(feed(&mut d, "###...."), "ttt....");
        assert_eq!(feed(&mut d, "#.##...."), "t.tS....");
        // Sustained overloads are not learned: the threshold stays.
        for _ in 0..20 {
            feed(&mut d, "#######....");
        }
        assert_eq!(d.threshold(), 3);
        d.forget();
        assert_eq!(d.threshold(), 12);
    }
}
