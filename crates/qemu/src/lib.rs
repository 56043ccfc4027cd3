//! QEMU control for ferry.
//!
//! Layout:
//! - [`qmp`]: a typed QMP client (commands, events with QEMU's timestamps, QEMU errors as errors).
//! - [`commands`]: the QMP commands ferry uses, as types.
//! - [`launch`]: a VM spec and the QEMU command line it becomes.
//! - [`incoming`]: a running QEMU's command line made the destination of its migration.
//! - [`stream`]: QEMU's migration stream: RAM records found, every other byte passed through,
//!   re-emitted byte for byte.
//! - [`multifd`]: QEMU's multifd channels: each packet's pages found, re-emitted byte for
//!   byte.
//! - [`nbd`]: NBD server (the disk mirror's target) and client (the destination's export).

pub mod blockdev_args;
pub mod commands;
pub mod incoming;
pub mod launch;
pub mod multifd;
pub mod nbd;
pub mod qmp;
pub mod stream;

pub use launch::{
    check_qemu, qemu_program, Accel, Boot, DiskSpec, NicSpec, QemuCheckError, VmSpec,
};
pub use qmp::{Command, Event, EventTime, Qmp, QmpError};
