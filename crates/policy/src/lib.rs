//! The fleet's policies, as pure logic with no I/O: what the controller decides and the
//! simulator replays, from the same code.
//!
//! - [`cost`]: what moving a VM over a link costs (total time, WAN bytes, the pause), by a
//!   pre-copy model whose parameters come from ferry's own migrations.
//! - [`calibrate`]: fitting those parameters to observed migrations, and the model's error on
//!   the migrations it was not fitted to.

pub mod calibrate;
pub mod cost;
