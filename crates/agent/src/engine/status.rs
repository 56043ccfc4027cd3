//! A migration's status, shared between the task running it and the API reading it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use ferry_api::agent::{AgentEvent, MigrationStatus, Phase};
use ferry_api::EventKind;
use tokio_util::sync::CancellationToken;

pub fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
}

/// Every migration this agent knows, by id (the API lists them).
pub type Registry = Arc<Mutex<HashMap<String, Shared>>>;

/// The status behind a lock, and the cancellation; clones share them.
#[derive(Debug, Clone)]
pub struct Shared(Arc<Mutex<MigrationStatus>>, Arc<Cancel>);

/// The user's cancel, and whether it is still possible. The token wakes whatever waits on
/// [`Shared::cancelled`]; the lock makes "cancel" and "too late" exclusive.
#[derive(Debug, Default)]
struct Cancel {
    token: CancellationToken,
    /// Set when the stream's end went to the destination: from then on it decides.
    too_late: Mutex<bool>,
}

impl Shared {
    pub fn new(status: MigrationStatus) -> Shared {
        Shared(Arc::new(Mutex::new(status)), Arc::default())
    }

    /// Asks the migration to stop; false once it is too late.
    pub fn request_cancel(&self) -> bool {
        let too_late = self.1.too_late.lock().expect("cancel lock");
        if !*too_late {
            self.1.token.cancel();
        }
        !*too_late
    }

    /// Completes when the user cancelled (cancel safe).
    pub async fn cancelled(&self) {
        self.1.token.cancelled().await;
    }

    /// Closes the window for cancelling; false if a cancel came first.
    pub fn close_cancel(&self) -> bool {
        let mut too_late = self.1.too_late.lock().expect("cancel lock");
        *too_late = !self.1.token.is_cancelled();
        *too_late
    }

    /// Enters `phase`, described by `detail`.
    pub fn enter(&self, phase: Phase, detail: impl Into<String>) {
        self.update(|s| {
            s.phase = phase;
            s.detail = detail.into();
        });
    }

    pub fn update<R>(&self, f: impl FnOnce(&mut MigrationStatus) -> R) -> R {
        f(&mut self.0.lock().expect("status lock"))
    }

    pub fn get(&self) -> MigrationStatus {
        self.0.lock().expect("status lock").clone()
    }
}

/// Adds an event stamped now.
pub trait Events {
    fn event(&mut self, kind: EventKind, detail: impl Into<String>);
}

impl Events for MigrationStatus {
    fn event(&mut self, kind: EventKind, detail: impl Into<String>) {
        self.events.push(AgentEvent {
            unix_ms: now_ms(),
            kind,
            detail: detail.into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> Shared {
        Shared::new(
            serde_json::from_str(
                r#"{"id":"1","vm":"v","state":"running","phase":"memory","detail":"","error":null,
                "started_unix_ms":0,"stream_bytes":0,"wire":{"bytes_out":0,"bytes_in":0,
                "connections_live":0,"reconnects":0,"replayed_frames":0,"unacked_bytes":0,
                "rtt_ms":null},"qemu":{"status":"","transferred":0,"remaining":0,"total":0,
                "iteration":0},"events":[],"source_stop_unix_us":null,
                "destination_resume_unix_us":null,"qemu_downtime_ms":null,
                "switchover_round_trips":null,"digest":null}"#,
            )
            .unwrap(),
        )
    }

    #[tokio::test]
    async fn a_cancel_wakes_the_waiter_and_closes_the_window() {
        let s = shared();
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.cancelled().await }
        });
        assert!(s.request_cancel());
        waiter.await.unwrap();
        assert!(
            !s.close_cancel(),
            "the stream's end may not go out after a cancel"
        );
    }

    #[test]
    fn after_the_window_closed_a_cancel_is_refused() {
        let s = shared();
        assert!(s.close_cancel());
        assert!(!s.request_cancel());
    }
}
