//! Pacing libvirt's disk copy by the guest's IO. On ferry's own path the source agent sets
//! the speed of QEMU's mirror job (`engine::disk::pacing`); on libvirt's, libvirt owns that
//! job (and holds its state lock for the whole migration), so the lever is the relay that
//! answers the mirror ([`crate::engine::disk::relay`]): its gate takes QEMU's bulk copy writes
//! no faster than the pacer's speed, and QEMU's mirror, with only so many writes in flight,
//! reads the source image no faster than that. The signal is the same as ferry's: QEMU's
//! accounting of the guest's devices, here through libvirt (`virsh domstats --block`).

use std::sync::{Arc, Weak};
use std::time::Instant;

use crate::engine::disk::buffer::TransmitBuffer;
use crate::engine::disk::pacing::{
    BulkGate, GuestIo, Pacer, Speed, PACING_BASELINE, PACING_INTERVAL,
};
use crate::engine::status::Shared;
use crate::libvirt::Libvirt;

/// What a driven migration's relays pace by.
#[derive(Clone)]
pub struct RelayPacing {
    pub libvirt: Libvirt,
    pub domain: String,
    /// The guest's counters when the migration was asked for (the baseline's start).
    pub before: (Instant, GuestIo),
    /// The lowest speed, as a share of the unpaced rate.
    pub floor: f64,
}

/// Lifts the gate however the pacing ends: a gate left shut would hold the copy forever.
struct LiftOnDrop(Arc<BulkGate>);

impl Drop for LiftOnDrop {
    fn drop(&mut self) {
        self.0.lift();
    }
}

/// Paces one relay's bulk copy until its gate is lifted (the memory phase began: the bulk
/// copy is over) or its buffer is gone. How long it held the copy below its unpaced rate goes
/// to `status` (`disk.paced_ms`).
pub async fn pace(
    pacing: RelayPacing,
    gate: Arc<BulkGate>,
    buffer: Weak<TransmitBuffer>,
    status: Shared,
) {
    let gate = LiftOnDrop(gate);
    tokio::time::sleep_until((pacing.before.0 + PACING_BASELINE).into()).await;
    let at_start = match pacing.libvirt.guest_io(&pacing.domain).await {
        Ok(io) => (Instant::now(), io),
        Err(e) => {
            tracing::warn!(
                "{}'s disk IO is unknown ({e:#}): its disk copy is not paced",
                pacing.domain
            );
            return;
        }
    };
    let mut pacer = Pacer::new(pacing.before, at_start, pacing.floor);
    if !pacer.active() {
        tracing::info!(
            "{} barely uses its disks: its disk copy is not paced",
            pacing.domain
        );
        return;
    }
    gate.0.set(Speed::Unlimited);
    let mut looks = tokio::time::interval(PACING_INTERVAL);
    while !gate.0.is_lifted() {
        looks.tick().await;
        let Some(sent) = buffer.upgrade().map(|b| b.sent_total()) else {
            break;
        };
        let io = match pacing.libvirt.guest_io(&pacing.domain).await {
            Ok(io) => io,
            Err(e) => {
                tracing::warn!(
                    "{}'s disk IO is unknown ({e:#}): pacing ends",
                    pacing.domain
                );
                break;
            }
        };
        if let Some(speed) = pacer.tick(Instant::now(), io, sent) {
            tracing::debug!(?speed, "libvirt disk copy pacing");
            gate.0.set(speed);
        }
        let paced_ms = u64::try_from(pacer.paced().as_millis()).unwrap_or(u64::MAX);
        // Each disk's relay paces its own copy: the report keeps the longest.
        status.update(|s| {
            let d = s.disk.get_or_insert_with(Default::default);
            d.paced_ms = Some(d.paced_ms.unwrap_or(0).max(paced_ms));
        });
    }
    if let Some(summary) = pacer.summary() {
        tracing::info!("{}: {summary}", pacing.domain);
    }
}
