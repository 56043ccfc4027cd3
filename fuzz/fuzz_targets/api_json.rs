//! The agents' and the controller's API bodies: requests, heartbeats and their answers.
#![no_main]

use ferry_api::agent::{LibvirtMigrationRequest, MigrationRequest};
use ferry_api::fleet::{FleetGroupRequest, FleetMigrationRequest, Heartbeat, HeartbeatAnswer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = serde_json::from_slice::<MigrationRequest>(data) {
        let _ = req.settings.validate();
    }
    if let Ok(req) = serde_json::from_slice::<LibvirtMigrationRequest>(data) {
        let _ = req.settings.validate();
    }
    let _ = FleetMigrationRequest::parse(data);
    let _ = FleetGroupRequest::parse(data);
    let _ = serde_json::from_slice::<Heartbeat>(data);
    let _ = serde_json::from_slice::<HeartbeatAnswer>(data);
});
