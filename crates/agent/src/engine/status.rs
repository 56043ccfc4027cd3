//! A migration's status, shared between the task running it and the API reading it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use ferry_api::agent::{AgentEvent, MigrationState, MigrationStatus, Phase};
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

/// Finished migrations an agent lists, the newest; older ones are forgotten (the journal keeps
/// its own records on disk).
pub const KEPT_FINISHED: usize = 1024;

/// Adds migration `id` to `registry`; the oldest finished ones beyond [`KEPT_FINISHED`] go, so
/// that what an agent holds does not grow with every migration it ran.
pub fn register(registry: &Registry, id: String, status: Shared) {
    let mut all = registry.lock().expect("registry lock");
    all.insert(id, status);
    let mut finished: Vec<(u64, String)> = all
        .iter()
        .filter_map(|(id, s)| {
            s.update(|st| (st.state != MigrationState::Running).then_some(st.started_unix_ms))
                .map(|started| (started, id.clone()))
        })
        .collect();
    if finished.len() > KEPT_FINISHED {
        finished.sort();
        for (_, id) in &finished[..finished.len() - KEPT_FINISHED] {
            all.remove(id);
        }
    }
}

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

    #[test]
    fn the_oldest_finished_migrations_beyond_the_kept_number_are_forgotten() {
        let registry = Registry::default();
        let running = Shared::new(MigrationStatus::starting("run".into(), "v".into(), 0));
        register(&registry, "run".into(), running);
        for i in 1..=KEPT_FINISHED as u64 + 3 {
            let s = Shared::new(MigrationStatus::starting(i.to_string(), "v".into(), i));
            s.update(|st| st.state = MigrationState::Failed);
            register(&registry, i.to_string(), s);
        }
        let all = registry.lock().unwrap();
        assert_eq!(all.len(), KEPT_FINISHED + 1);
        assert!(all.contains_key("run"), "a running one is never forgotten");
        assert!(!all.contains_key("3") && all.contains_key("4"));
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
