//! ferry's per-host agent.
//!
//! - [`server`]: the local API for the CLI (HTTP/JSON on a unix socket, docs/agent-api.md) and
//!   the peer endpoint (TCP + mutual TLS) where other agents open sessions.
//! - [`source`]: the sending side of a migration (QEMU -> parser -> session).
//! - [`destination`]: the receiving side and the commit decision (session -> QEMU).
//! - [`feeder`]: the destination QEMU's stream, written from a bounded queue.
//! - [`known_zero`]: the destination's pages that are zero before the stream arrives.
//! - [`load_sieve`]: the stream as the destination QEMU gets it: no-op zero pages left out,
//!   weighed by QEMU's work.
//! - [`page_ledger`]: the pages the destination has yet to consume (QEMU's work ahead of it).
//! - [`stream_codec`]: QEMU's stream as codec records on the WAN, and back.
//! - [`seed_store`]: memory images of VMs that left, kept for their return, and their index.
//! - [`libvirt`]: this host's libvirt, through virsh (domains, job figures, `virsh migrate`).
//! - [`libvirt_migration`]: libvirt's migration driven and steered by ferry (`--libvirt`).
//! - [`tunnel`]: unix sockets carried between hosts (libvirt's migration over UNIX sockets).
//! - [`tunnel_stream`]: QEMU's stream in a tunnel: coded, and fed to QEMU only under matching digests.
//! - [`switchover`]: QEMU's downtime-limit that makes the real pause fit the target.
//! - [`disk`]: disks: the mirror's NBD target, the transmit buffer, the destination's applier.
//! - [`control`]: the messages between the two sides.
//! - [`refusal`]: what the local API refuses, and its HTTP statuses.
//! - [`client`]: the CLI's client for the local API; [`follow`]: watching a migration
//!   through it; [`interrupt`]: Ctrl-C during a migration the CLI watches.
//! - [`config`]: the agent's TOML configuration (name, listen address, identity, peers, limits).
//! - [`pki`]: the fleet's CA and host certificates (`ferry pki`).
//! - [`launcher`]: the destination QEMU, when the agent starts it from a command line.
//! - [`status`]: a migration's shared status.

pub mod client;
pub mod config;
pub mod control;
pub mod destination;
pub mod disk;
pub mod feeder;
pub mod follow;
pub mod interrupt;
pub mod known_zero;
pub mod launcher;
pub mod libvirt;
pub mod libvirt_migration;
pub mod load_sieve;
pub mod page_ledger;
pub mod pki;
pub mod refusal;
pub mod seed_store;
pub mod server;
pub mod source;
pub mod status;
pub mod stream_codec;
pub mod switchover;
pub mod tunnel;
pub mod tunnel_stream;

pub use config::AgentConfig;
pub use server::run;
