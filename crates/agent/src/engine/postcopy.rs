//! Postcopy ([`ferry_api::settings::MigrationSettings::postcopy`]): once QEMU's first pass has
//! copied the memory, the source asks QEMU to switch; the VM stops, its device state crosses
//! in one package, and the VM runs at the destination while the pages still at the source
//! follow (those the destination QEMU asks for on the return path first).
//!
//! The commit moves to the switch. The destination QEMU gets the package's last piece only
//! once everything before it (every page of the precopy passes, the discards, the device
//! state) hashes to the source's digest of it:
//!
//! ```text
//!  source                                       destination
//!  first pass done: migrate-start-postcopy
//!  QEMU stops; the package's end ==>             held, until the first n bytes match
//!  Checkpoint{n, digest}         ==>             match: record committing; QEMU gets the
//!                                                package, loads it (paused: -S); cont;
//!                                <==  Committed  record committed
//!  pages, asked for and the rest ==>
//!  End{bytes, digest}            ==>             the whole stream matches, QEMU completed
//!                                <==  Delivered
//!  quit
//! ```
//!
//! A mismatch at the checkpoint (or any failure before it) leaves the destination QEMU
//! without the device state: it never ran, the destination quits it and aborts, and the
//! source QEMU, whose destination never acknowledged the package, fails its migration and
//! resumes the VM, as a failed precopy does. After the switch nothing can be undone: the VM
//! runs at the destination and only the source holds the pages that have not crossed, so a
//! failure then leaves both QEMUs as they are and says so.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use ferry_api::settings::MigrationSettings;
use ferry_qemu::commands::{MigrateStartPostcopy, MigrationInfo, QueryMigrate, QueryStatus};
use ferry_qemu::Qmp;

/// How often QEMU's progress is asked while waiting for a pass or the package's load.
const POLL: Duration = Duration::from_millis(20);

/// How long the switch waits for the stream's queue to drain after the first pass, at most.
const DRAIN_AT_MOST: Duration = Duration::from_secs(5);

/// How long both agents hold on to a postcopy migration whose link is down, once the VM may
/// run at the destination: failing it would help nobody (the VM there needs the pages only the
/// source has, and the source VM cannot resume), while the session reconnects and replays
/// whenever the link returns. So the WAN timeout no longer applies; this bounds the wait, as
/// for a source in doubt.
pub const HOLD_AFTER_SWITCH: Duration = Duration::from_secs(3600);

/// When the source asks QEMU to switch to postcopy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwitchWhen {
    /// Once its first pass has copied the memory (`postcopy`).
    FirstPass,
    /// Once auto-converge throttles the guest this hard, percent (`postcopy_at_throttle_pct`).
    Throttled(u8),
}

impl SwitchWhen {
    /// What the settings ask for, if they allow postcopy at all.
    pub fn of(settings: &MigrationSettings) -> Option<SwitchWhen> {
        match settings.postcopy_at_throttle_pct {
            Some(pct) => Some(SwitchWhen::Throttled(pct)),
            None => settings.postcopy.then_some(SwitchWhen::FirstPass),
        }
    }

    fn reached(self, info: &MigrationInfo) -> bool {
        let first_pass_done = info.ram.as_ref().is_some_and(|r| r.dirty_sync_count >= 2);
        match self {
            SwitchWhen::FirstPass => first_pass_done,
            SwitchWhen::Throttled(pct) => {
                first_pass_done && info.cpu_throttle_percentage >= Some(u64::from(pct))
            }
        }
    }
}

/// Source: waits until `when` holds (QEMU's first pass has copied the memory, its second
/// dirty-bitmap sync; with a throttle, that too) and `drained` says the stream's queue is short
/// enough (what is queued when QEMU stops the VM crosses before the device state: the first
/// pass reads up to a second of the link ahead), then asks QEMU to switch to postcopy. Returns
/// without switching if the migration ended first (a throttle never reached).
pub async fn switch_when(qmp: &Qmp, when: SwitchWhen, drained: impl Fn() -> bool) -> Result<()> {
    let mut reached_at: Option<Instant> = None;
    loop {
        let info = qmp.execute(&QueryMigrate).await?;
        if matches!(
            info.status.as_deref(),
            Some("failed" | "cancelled" | "completed")
        ) {
            return Ok(());
        }
        if when.reached(&info) {
            let since = *reached_at.get_or_insert_with(Instant::now);
            if drained() || since.elapsed() > DRAIN_AT_MOST {
                break;
            }
        }
        tokio::time::sleep(POLL).await;
    }
    qmp.execute(&MigrateStartPostcopy).await?;
    Ok(())
}

/// Source: whether QEMU has switched to postcopy (from then on QEMU 10.0 and 10.1 refuse to
/// cancel the migration, and with it to resume the VM; 10.2's `postcopy-device` state resumes
/// it when the destination never loaded the device state).
pub async fn source_switched(qmp: &Qmp) -> bool {
    qmp.execute(&QueryMigrate)
        .await
        .is_ok_and(|info| info.status.is_some_and(|s| s.starts_with("postcopy")))
}

/// Destination: waits until QEMU has loaded the package (it runs the package's RUN, and,
/// started with `-S`, stays paused).
pub async fn package_loaded(qmp: &Qmp) -> Result<()> {
    loop {
        let st = qmp.execute(&QueryStatus).await?;
        if st.status != "inmigrate" {
            return Ok(());
        }
        let info = qmp.execute(&QueryMigrate).await?;
        if info.status.as_deref() == Some("failed") {
            bail!(
                "destination QEMU failed to load the postcopy package: {}",
                info.error_desc.unwrap_or_default()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Destination: the package's gate. It opens once the stream's bytes up to the package's
/// end and the source's checkpoint agree, at most once.
#[derive(Debug, Default)]
pub struct PackageGate {
    /// Where the package ended in QEMU's stream here, and the digest of the bytes up to it.
    ours: Option<(u64, String)>,
    /// The source's checkpoint.
    theirs: Option<(u64, String)>,
    opened: bool,
}

impl PackageGate {
    /// The package's last piece arrived: it ends at stream offset `end`, and the bytes up to
    /// there hash to `digest`.
    pub fn arrived(&mut self, end: u64, digest: String) -> Result<()> {
        if self.ours.is_some() {
            bail!("a second postcopy package in the stream (at byte {end})");
        }
        self.ours = Some((end, digest));
        Ok(())
    }

    /// Whether the package's end has arrived.
    pub fn has_arrived(&self) -> bool {
        self.ours.is_some()
    }

    /// The source's checkpoint at the package's end.
    pub fn checkpoint(&mut self, bytes: u64, digest: String) -> Result<()> {
        if self.theirs.is_some() {
            bail!("a second postcopy checkpoint from the source (at byte {bytes})");
        }
        self.theirs = Some((bytes, digest));
        Ok(())
    }

    /// Whether the package may go to QEMU now: true once, when both sides are known and
    /// agree; an error when they differ.
    pub fn open(&mut self) -> Result<bool> {
        let (Some((end, ours)), Some((bytes, theirs))) = (&self.ours, &self.theirs) else {
            return Ok(false);
        };
        if self.opened {
            return Ok(false);
        }
        if end != bytes {
            bail!("the postcopy package ends at stream byte {end} here, at byte {bytes} at the source");
        }
        if ours != theirs {
            bail!(
                "stream digest mismatch at the postcopy package: source {} {theirs}, destination {ours}",
                crate::engine::digest::ALGORITHM
            );
        }
        self.opened = true;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_waits_for_the_first_pass_and_any_throttle_asked_for() {
        let info = |syncs: u64, throttle: Option<u64>| MigrationInfo {
            ram: Some(ferry_qemu::commands::RamStats {
                dirty_sync_count: syncs,
                ..Default::default()
            }),
            cpu_throttle_percentage: throttle,
            ..Default::default()
        };
        let first = SwitchWhen::FirstPass;
        assert!(!first.reached(&info(1, None)));
        assert!(first.reached(&info(2, None)));
        let hard = SwitchWhen::Throttled(40);
        assert!(!hard.reached(&info(5, None)));
        assert!(!hard.reached(&info(5, Some(30))));
        assert!(hard.reached(&info(5, Some(40))));
        assert!(!hard.reached(&info(1, Some(40))));
        let settings = |postcopy, pct| MigrationSettings {
            postcopy,
            postcopy_at_throttle_pct: pct,
            ..MigrationSettings::default()
        };
        assert_eq!(SwitchWhen::of(&settings(false, None)), None);
        assert_eq!(SwitchWhen::of(&settings(true, None)), Some(first));
        assert_eq!(SwitchWhen::of(&settings(false, Some(40))), Some(hard));
    }

    #[test]
    fn the_gate_opens_once_when_both_ends_agree_in_either_order() {
        let mut gate = PackageGate::default();
        assert!(!gate.open().unwrap());
        gate.checkpoint(100, "d".into()).unwrap();
        assert!(!gate.open().unwrap());
        assert!(!gate.has_arrived());
        gate.arrived(100, "d".into()).unwrap();
        assert!(gate.open().unwrap());
        assert!(!gate.open().unwrap(), "opens once");

        let mut gate = PackageGate::default();
        gate.arrived(7, "x".into()).unwrap();
        gate.checkpoint(7, "x".into()).unwrap();
        assert!(gate.open().unwrap());
    }

    #[test]
    fn a_different_digest_or_end_keeps_it_shut_with_the_reason() {
        let mut gate = PackageGate::default();
        gate.arrived(100, "aa".into()).unwrap();
        gate.checkpoint(100, "bb".into()).unwrap();
        let e = gate.open().unwrap_err().to_string();
        assert!(
            e.contains("stream digest mismatch at the postcopy package"),
            "{e}"
        );
        assert!(e.contains("source blake3 bb, destination aa"), "{e}");

        let mut gate = PackageGate::default();
        gate.arrived(100, "aa".into()).unwrap();
        gate.checkpoint(101, "aa".into()).unwrap();
        let e = gate.open().unwrap_err().to_string();
        assert!(
            e.contains("byte 100 here, at byte 101 at the source"),
            "{e}"
        );
    }

    #[test]
    fn a_second_package_or_checkpoint_is_refused() {
        let mut gate = PackageGate::default();
        gate.arrived(1, "a".into()).unwrap();
        assert!(gate.arrived(2, "a".into()).is_err());
        gate.checkpoint(1, "a".into()).unwrap();
        assert!(gate.checkpoint(1, "a".into()).is_err());
    }
}
