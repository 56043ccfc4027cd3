//! NBD, both ways: the [`server`] the source agent runs as the target of QEMU's
//! `blockdev-mirror`, and the [`client`] the destination agent writes into the destination
//! QEMU's export with, and the [`block_status`] reader a source agent asks which parts of a
//! disk changed since the VM arrived (a dirty bitmap), and a destination which parts of its
//! older copy hold data. [`proto`] holds the wire formats they share.

pub mod block_status;
pub mod client;
pub mod proto;
pub mod server;

pub use block_status::BlockStatusReader;
pub use client::{Client, ExportInfo, Pending};
pub use proto::{Command, NbdError};
pub use server::{serve, Blocks, Export, Exports, ServeEnd};
