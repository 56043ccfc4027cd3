//! Overload, as Overdriver tells it apart (Williams, ch. 6; docs/policies.md): a VM's memory
//! pressure is sampled every interval (10 s there: overloaded when it pages more than 200
//! times a second), and an overload counts as sustained once `needed` of the last `window`
//! intervals were overloaded (8 of 12 there: sustained overload oscillates). Until then it is
//! transient, and met by cooperative swap; sustained, it is met by a migration.
//!
//! The window adapts to the VM: the durations of its transient overloads are kept, and once
//! there are `profile_min` of them, their mean plus three standard deviations becomes the
//! window when that is shorter (the window only tightens: a VM whose bursts are short is
//! migrated sooner when one does not end). After a migration the profile no longer holds (the
//! VM's allocation changed) and learning starts again ([`Detector::forget`]).

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
    /// The window never shrinks below this many intervals.
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

#[derive(Debug, Clone)]
pub struct Detector {
    settings: DetectorSettings,
    window: usize,
    recent: VecDeque<bool>,
    /// Intervals the current overload has lasted (0 when there is none).
    run: usize,
    /// The current overload already counted as sustained.
    sustained: bool,
    transients: Vec<usize>,
}

impl Detector {
    pub fn new(settings: DetectorSettings) -> Detector {
        Detector {
            window: settings.window,
            settings,
            recent: VecDeque::new(),
            run: 0,
            sustained: false,
            transients: Vec::new(),
        }
    }

    /// The window now, in intervals.
    pub fn window(&self) -> usize {
        self.window
    }

    fn needed(&self) -> usize {
        let needed = (self.window as f64 * self.settings.needed_share).ceil();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let needed = needed as usize;
        needed.clamp(1, self.window)
    }

    /// One interval's sample.
    pub fn observe(&mut self, overloaded: bool) -> Pressure {
        self.recent.push_back(overloaded);
        while self.recent.len() > self.window {
            self.recent.pop_front();
        }
        if !overloaded {
            if self.run > 0 && !self.sustained {
                self.learn(self.run);
            }
            self.run = 0;
            self.sustained = false;
            return Pressure::Normal;
        }
        self.run += 1;
        let count = self.recent.iter().filter(|&&o| o).count();
        if self.sustained || count >= self.needed() {
            self.sustained = true;
            Pressure::Sustained
        } else {
            Pressure::Transient
        }
    }

    /// A migration changed the VM's allocation: what was learned no longer holds.
    pub fn forget(&mut self) {
        *self = Detector::new(self.settings.clone());
    }

    fn learn(&mut self, duration: usize) {
        self.transients.push(duration);
        let n = self.transients.len();
        if n < self.settings.profile_min {
            return;
        }
        let mean = self.transients.iter().sum::<usize>() as f64 / n as f64;
        let var = self
            .transients
            .iter()
            .map(|&d| (d as f64 - mean).powi(2))
            .sum::<f64>()
            / n as f64;
        let bound = (mean + 3.0 * var.sqrt()).ceil();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let bound = (bound as usize).max(self.settings.min_window);
        if bound < self.window {
            self.window = bound;
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
        assert_eq!(feed(&mut d, "........#"), "........t");
    }

    #[test]
    fn short_transients_tighten_the_window_and_it_never_widens() {
        let mut d = Detector::new(DetectorSettings::default());
        for _ in 0..9 {
            feed(&mut d, "##....");
        }
        assert_eq!(d.window(), 12, "not before the profile has 10 overloads");
        feed(&mut d, "###....");
        // Nine of 2 and one of 3: mean 2.1, sd 0.3, so mean + 3 sd = 3.
        assert_eq!(d.window(), 3);
        // Now 2 of 3 intervals make it sustained.
        assert_eq!(feed(&mut d, "##"), "tS");
        feed(&mut d, "..");
        for _ in 0..20 {
            feed(&mut d, "#######.");
        }
        assert_eq!(d.window(), 3);
        d.forget();
        assert_eq!(d.window(), 12);
    }
}
