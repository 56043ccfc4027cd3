//! A group member's link to its group (CloudNet's synchronized arrival, docs/fleet.md
//! "Groups"): what the controller says of the group, through the heartbeat answers, where
//! the member's driver and its tunnelled stream wait for it.
//!
//! ```text
//!  member's source agent                       controller
//!  memory passes, downtime target 1 ms  ...... every member could stop within its target: go
//!  downtime target as asked; QEMU stops the VM, its device state goes out
//!  the destination QEMU loaded it all; its word back (return path) kept -> Held
//!                                  ==heartbeat (long poll)==> every member held: released
//!  QEMU gets the word, completes; libvirt resumes the VM at the destination
//!  (a member that fails before: aborted, and every member's source resumes)
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferry_api::fleet::GroupSignal;
use tokio::sync::{watch, Notify};

/// The downtime target a member's QEMU gets until the group says go: QEMU keeps copying
/// instead of stopping the VM ahead of the others, unless a sync of its dirty pages finds
/// none (QEMU then stops it whatever the target).
pub const HOLD_DOWNTIME_MS: u64 = 1;

/// The signals of the group members this agent runs, by fleet id.
#[derive(Default)]
pub struct Groups {
    members: Mutex<HashMap<String, watch::Sender<GroupSignal>>>,
    /// Woken when a member starts to hold: its heartbeat goes at once.
    pub wake: Arc<Notify>,
}

impl Groups {
    /// A link for member `fleet_id` of `group`, before the controller said anything.
    pub fn join(&self, fleet_id: &str, group: &str) -> GroupLink {
        let (tx, rx) = watch::channel(GroupSignal {
            fleet_id: fleet_id.to_owned(),
            group: group.to_owned(),
            ..GroupSignal::default()
        });
        self.members
            .lock()
            .expect("groups lock")
            .insert(fleet_id.to_owned(), tx);
        GroupLink {
            signal: rx,
            wake: self.wake.clone(),
        }
    }

    /// The controller's signals from a heartbeat answer; members whose migration ended (no
    /// one listens any more) are forgotten.
    pub fn take(&self, signals: Vec<GroupSignal>) {
        let mut members = self.members.lock().expect("groups lock");
        members.retain(|_, tx| !tx.is_closed());
        for signal in signals {
            if let Some(tx) = members.get(&signal.fleet_id) {
                tx.send_if_modified(|now| {
                    let changed = *now != signal;
                    *now = signal;
                    changed
                });
            }
        }
    }
}

/// One member's view of its group.
#[derive(Clone)]
pub struct GroupLink {
    signal: watch::Receiver<GroupSignal>,
    wake: Arc<Notify>,
}

impl GroupLink {
    pub fn now(&self) -> GroupSignal {
        self.signal.borrow().clone()
    }

    /// Waits until the signal changes (never returns once nobody can change it).
    pub async fn changed(&mut self) {
        if self.signal.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Tells the heartbeat to go now: this member holds.
    pub fn holding(&self) {
        self.wake.notify_one();
    }

    /// Waits for the group's decision: released (Ok) or aborted (the reason).
    pub async fn decision(&mut self) -> Result<(), String> {
        loop {
            let now = self.now();
            if let Some(reason) = now.abort {
                return Err(reason);
            }
            if now.release {
                return Ok(());
            }
            self.changed().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_member_waits_for_the_controllers_decision() {
        let groups = Groups::default();
        let mut link = groups.join("m-1", "g-1");
        let mut other = groups.join("m-2", "g-1");
        let waiting = tokio::spawn(async move { link.decision().await });
        groups.take(vec![GroupSignal {
            fleet_id: "m-1".into(),
            group: "g-1".into(),
            go: true,
            release: false,
            abort: None,
        }]);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "go alone is not a decision");
        groups.take(vec![GroupSignal {
            fleet_id: "m-1".into(),
            group: "g-1".into(),
            go: true,
            release: true,
            abort: None,
        }]);
        assert_eq!(waiting.await.unwrap(), Ok(()));
        // The other member heard nothing meant for m-1.
        assert!(!other.now().go);
        groups.take(vec![GroupSignal {
            fleet_id: "m-2".into(),
            group: "g-1".into(),
            abort: Some("vm3 failed".into()),
            ..GroupSignal::default()
        }]);
        assert_eq!(other.decision().await, Err("vm3 failed".into()));
    }
}
