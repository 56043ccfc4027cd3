//! A migration's status, shared between the task running it and the API reading it.

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use ferry_api::agent::{AgentEvent, MigrationStatus};
use ferry_api::EventKind;

pub fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_millis(),
    )
    .unwrap_or(u64::MAX)
}

/// The status behind a lock, and the cancel switch; clones share them.
#[derive(Debug, Clone)]
pub struct Shared(Arc<Mutex<MigrationStatus>>, Arc<Mutex<Cancel>>);

/// Whether the user asked to cancel, and whether it is still possible.
#[derive(Debug, Default)]
struct Cancel {
    requested: bool,
    /// Set when the stream's end went to the destination: from then on it decides.
    too_late: bool,
}

impl Shared {
    pub fn new(status: MigrationStatus) -> Shared {
        Shared(Arc::new(Mutex::new(status)), Arc::default())
    }

    /// Asks the migration to stop; false once it is too late.
    pub fn request_cancel(&self) -> bool {
        let mut c = self.1.lock().expect("cancel lock");
        c.requested = !c.too_late;
        c.requested
    }

    pub fn cancel_requested(&self) -> bool {
        self.1.lock().expect("cancel lock").requested
    }

    /// Closes the window for cancelling; false if a cancel came first.
    pub fn close_cancel(&self) -> bool {
        let mut c = self.1.lock().expect("cancel lock");
        c.too_late = !c.requested;
        c.too_late
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
