//! Types shared by everything that produces or shows a migration: the timeline now; the agent's
//! request and response types join them with the agent (issue 3). Serde only, no I/O.

pub mod timeline;

pub use timeline::{Event, EventKind, Sample, Timeline};
