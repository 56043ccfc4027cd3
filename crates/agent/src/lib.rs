//! ferry's per-host agent: the migration engine, and the host service around it.
//!
//! - [`engine`]: one migration, both ends (its own module: it knows QEMU, the session and the
//!   codec, not HTTP, configs or libvirt).
//! - [`server`]: the local API for the CLI (HTTP/JSON on a unix socket, docs/agent-api.md) and
//!   the peer endpoint (TCP + mutual TLS) where other agents open sessions.
//! - [`refusal`]: what the local API refuses, and its HTTP statuses.
//! - [`config`]: the agent's TOML configuration (name, listen address, identity, peers, limits).
//! - [`pki`]: the fleet's CA and host certificates (`ferry pki`).
//! - [`libvirt`]: this host's libvirt, through virsh (domains, job figures, `virsh migrate`);
//!   [`libvirt_disks`]: a domain's file disks and their chains, from its XML.
//! - [`disk_memory`]: what a domain's disks held when they left through libvirt, kept for
//!   their return.
//! - [`libvirt_migration`]: libvirt's migration driven and steered by ferry (`--libvirt`);
//!   [`libvirt_fence`]: a domain libvirt left running at both ends, paused at the source.
//! - [`fleet`]: heartbeats to the fleet's controller, and the migrations it hands over;
//!   [`group`]: a group member's link to its group (synchronized arrival).
//! - [`overlay`]: this host's endpoints of the fleet's virtual cloud pools (VXLAN, bridges).
//! - [`tunnel`]: unix sockets carried between hosts (libvirt's migration over UNIX sockets).
//! - [`lend`], [`borrow`]: swap on peers' spare memory (Overdriver's cooperative swap).
//! - [`client`]: the CLI's client for the local API; [`follow`]: watching a migration
//!   through it; [`interrupt`]: Ctrl-C during a migration the CLI watches.

pub mod borrow;
pub mod client;
pub mod config;
mod dirty_rate;
pub mod disk_memory;
pub mod engine;
pub mod fleet;
mod fleet_swap;
pub mod follow;
pub mod group;
pub mod interrupt;
pub mod lend;
pub mod libvirt;
pub mod libvirt_disks;
pub mod libvirt_fence;
pub mod libvirt_migration;
pub mod memory;
pub mod overlay;
pub mod pki;
pub mod refusal;
mod relay_pacing;
pub mod server;
pub mod tunnel;

pub use config::AgentConfig;
pub use server::run;
