//! NBD, both ways: the [`server`] the source agent runs as the target of QEMU's
//! `blockdev-mirror`, and the [`client`] the destination agent writes into the destination
//! QEMU's export with, and the [`dirty`] bitmap reader a source agent asks which parts of a
//! disk changed since the VM arrived. [`proto`] holds the wire formats they share.

pub mod client;
pub mod dirty;
pub mod proto;
pub mod server;

pub use client::{Client, ExportInfo, Pending};
pub use dirty::DirtyBitmapReader;
pub use proto::{Command, NbdError};
pub use server::{serve, Blocks, Export, Exports, ServeEnd};
