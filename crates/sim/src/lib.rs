//! A fleet simulator on a simulated clock that runs ferry's own policy code
//! ([`ferry_policy`]: the planner, the schedule, the cost model, Overdriver's detector and
//! capacity planner), not a copy of it (docs/policies.md, "The simulator").
//!
//! - [`trace`]: synthetic demand with a stated daily and bursty shape.
//! - [`consolidation`]: Isci et al.'s energy study: hosts running, energy and migrations
//!   against migration speed.
//! - [`plot`]: the pictures, as SVG.

pub mod consolidation;
pub mod overload;
pub mod plot;
pub mod trace;
