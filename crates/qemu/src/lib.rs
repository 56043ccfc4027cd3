//! QEMU control for ferry.
//!
//! Layout:
//! - [`qmp`]: a typed QMP client (commands, events with QEMU's timestamps, QEMU errors as errors).
//! - [`commands`]: the QMP commands ferry uses, as types.
//! - [`launch`]: a VM spec and the QEMU command line it becomes.
//!
//! Later issues add the migration-stream reader/writer and the NBD server and client here.

pub mod commands;
pub mod launch;
pub mod qmp;

pub use launch::{
    check_qemu, qemu_program, Accel, Boot, DiskSpec, NicSpec, QemuCheckError, VmSpec,
};
pub use qmp::{Command, Event, EventTime, Qmp, QmpError};
