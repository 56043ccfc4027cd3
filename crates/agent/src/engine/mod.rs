//! The migration engine: one migration, both ends. It speaks QMP and QEMU's stream, the
//! session and the codec; the host service ([`crate::server`], [`crate::tunnel`],
//! [`crate::libvirt_migration`]) starts it, lists it and maps its errors.
//!
//! - [`source`]: the sending side (QEMU -> parser -> session), its windows and deadlines.
//! - [`destination`]: the receiving side and the commit decision (session -> QEMU).
//! - [`launcher`]: the destination QEMU, when the agent starts it from a command line.
//! - [`monitor_dir`]: the host's directory of VMs' monitors (`[qemu] qmp_dir`): the bare QEMU
//!   VMs it runs, and where one the agent starts gets its monitor.
//! - [`feeder`]: the destination QEMU's stream, written from a bounded queue.
//! - [`known_zero`]: the destination's pages that are zero before the stream arrives.
//! - [`load_sieve`]: the stream as the destination QEMU gets it: no-op zero pages left out,
//!   weighed by QEMU's work.
//! - [`page_ledger`]: the pages the destination has yet to consume (QEMU's work ahead of it).
//! - [`stream_codec`]: QEMU's stream as codec records on the WAN, and back; [`pipeline`]: the
//!   same cut into shards that can run in parallel, and QEMU's order rebuilt from them.
//! - [`seed_store`]: memory images of VMs that left, kept for their return, and their index.
//! - [`switchover`]: QEMU's downtime-limit that makes the real pause fit the target.
//! - [`disk`]: disks: the mirror's NBD target, the transmit buffer, the destination's applier.
//! - [`postcopy`]: the switch to postcopy, and the destination's gate on the package (the
//!   commit point of a postcopy migration); [`preempt`]: QEMU's postcopy preempt channel,
//!   carried ahead of the stream.
//! - [`tunnel_stream`]: QEMU's stream in a libvirt tunnel: coded, and fed to QEMU only under
//!   matching digests.
//! - [`control`]: the messages between the two sides, versioned; [`digest`]: the end-to-end
//!   digest both ends compute of what QEMU wrote.
//! - [`journal`]: each migration's record on disk, at the points that decide what a restart
//!   must do; [`recovery`]: what an agent that restarts does with the records it finds, and
//!   the verdicts a source in doubt asks for.
//! - [`status`]: a migration's shared status: its typed phase, events and cancellation.

pub mod control;
pub mod destination;
pub mod digest;
pub mod disk;
pub mod feeder;
pub mod journal;
pub mod known_zero;
pub mod launcher;
pub mod load_sieve;
pub mod monitor_dir;
pub mod monitor_keeper;
pub mod page_ledger;
pub mod pipeline;
pub mod postcopy;
pub mod postcopy_recovery;
pub mod preempt;
pub mod recovery;
pub mod seed_store;
pub mod source;
pub mod status;
pub mod stream_codec;
pub mod switchover;
#[cfg(test)]
pub(crate) mod test_session;
pub mod tunnel_stream;
