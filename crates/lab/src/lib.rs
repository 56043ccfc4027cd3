//! ferry's lab: everything needed to try ferry on one machine.
//!
//! Layout:
//! - [`topology`]: sites as network namespaces, the WAN between them, `lab up|down`.
//! - [`link`]: the emulated link's settings and their validation.
//! - [`wan`]: the user-space WAN emulator (rate, delay, jitter, loss, byte counters).
//! - [`image`]: the tiny guest image, built from Debian packages and cached.
//! - [`vm`]: the lab's VMs (start at a site, records, stop).
//! - [`guest`]: the host side of the guest's serial protocol (commands, heartbeats, verifiers).
//! - [`tcpseq`]: a client of the guest's TCP sequence server that checks every number arrives.
//! - [`baseline`]: QEMU's own migration across the lab WAN, the way libvirt drives it.
//! - [`bench`]: one benchmark scenario end to end, as the contract's JSON record.
//! - [`floor`]: the physical floor of a migration (compressed unique guest memory).
//! - [`accel`]: which accelerator really runs a guest here.
//! - [`sh`]: running host commands with useful errors.

pub mod accel;
pub mod agents;
pub mod baseline;
pub mod bench;
pub mod controller;
pub mod cpu;
pub mod ferry_path;
pub mod fleet_cost_bench;
pub mod floor;
pub mod group_bench;
pub mod guest;
pub mod image;
pub mod libvirt;
pub mod libvirt_bench;
pub mod libvirt_events;
pub mod link;
pub mod overload_bench;
pub mod pki;
pub mod pool_bench;
pub mod pools;
pub mod postgres;
pub mod sh;
pub mod tcpseq;
pub mod topology;
pub mod vm;
pub mod wan;

pub use link::LinkConfig;
pub use topology::{Lab, Services, Site};
