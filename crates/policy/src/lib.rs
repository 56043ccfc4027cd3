//! The fleet's policies, as pure logic with no I/O and no clock of their own: what the
//! controller decides and the simulator replays, from the same code.
//!
//! - [`cost`]: what moving a VM over a link costs (total time, WAN bytes, the pause), by a
//!   pre-copy model whose parameters come from ferry's own migrations.
//! - [`calibrate`]: fitting those parameters to observed migrations, and the model's error on
//!   the migrations it was not fitted to.
//! - [`fleet`]: hosts and VMs as the policies see them.
//! - [`placement`]: each host's room, and the best fit for a VM.
//! - [`consolidate`]: the planner: spread VMs off hosts over capacity, empty hosts the fleet
//!   does not need, by the cost model, without thrashing.
//! - [`schedule`]: which planned moves may start, within per-host and per-link limits.
//! - [`overload`]: Overdriver's transient-or-sustained detector, with its adaptive window.
//! - [`capacity`]: Overdriver's binomial bound on the spare memory a pool needs.

pub mod calibrate;
pub mod capacity;
pub mod consolidate;
pub mod cost;
pub mod fleet;
pub mod overload;
pub mod placement;
pub mod schedule;
