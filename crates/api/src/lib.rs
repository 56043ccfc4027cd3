//! Types shared by everything that produces or shows a migration: the timeline, and the
//! agent's request and response types, their OpenAPI schemas and Prometheus metrics. No I/O.

pub mod agent;
pub mod fleet;
pub mod metrics;
pub mod names;
pub mod outcome;
pub mod settings;
pub mod timeline;

pub use timeline::{Event, EventKind, Sample, Timeline};
