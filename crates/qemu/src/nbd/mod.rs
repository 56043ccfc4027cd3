//! NBD, both ways: the [`server`] the source agent runs as the target of QEMU's
//! `blockdev-mirror`, and the [`client`] the destination agent writes into the destination
//! QEMU's export with. [`proto`] holds the wire formats they share.

pub mod client;
pub mod proto;
pub mod server;

pub use client::{Client, ExportInfo, Pending};
pub use proto::{Command, NbdError};
pub use server::{serve, Blocks, Export, Exports, ServeEnd};
