//! Ctrl-C (or SIGTERM, SIGHUP) during a migration: cancel it cleanly instead of dying half-way.
//!
//! Killing the CLI mid-migration would leave QEMU migrating on its own: the source might stop
//! for a switchover nobody completes. So the CLI routes those signals here; while a migration runs it
//! only raises a flag that the migration's polling loops check before the commit point, and the
//! usual failure path cancels, removes the destination and keeps the source running. After the
//! destination was told to run, the flag is no longer looked at: the commit finishes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// Whether the user asked to stop.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

/// Records a Ctrl-C. Returns true if a migration will handle it, false if nothing is running
/// that needs a clean stop (the caller may exit).
pub fn request() -> bool {
    REQUESTED.store(true, Ordering::SeqCst);
    ACTIVE.load(Ordering::SeqCst) > 0
}

/// Marks a migration in progress for as long as it lives.
pub struct Active(());

impl Active {
    /// Enters a migration.
    pub fn enter() -> Active {
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        Active(())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }
}
