//! What the local API refuses, as types, and the one place each becomes an HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_api::agent::{ApiError, ErrorKind};
use ferry_api::settings::SettingsError;

use crate::config::UnknownPeer;

/// A request the agent will not carry out, and why.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("malformed migration request: {0}")]
    Malformed(String),
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error(transparent)]
    UnknownPeer(#[from] UnknownPeer),
    #[error("{0} (or turn seeding off: codec without seed)")]
    SeedName(String),
    #[error("this agent already sends {running} migrations, its limit (limits.outgoing in its config); try again when one ends")]
    Busy { running: usize },
    #[error("VM {vm:?} is already migrating ({id})")]
    AlreadyMigrating { vm: String, id: String },
    #[error("no migration {0:?} on this agent")]
    NoMigration(String),
    #[error("this agent carries no libvirt migrations: its config has no [libvirt] section")]
    NoLibvirt,
    #[error("libvirt's migration cannot honour {0}; leave it at its default")]
    NotWithLibvirt(String),
    #[error("no domain {0:?} in this host's libvirt ({1})")]
    UnknownDomain(String, String),
    #[error("domain {domain:?} is {state}: only a running domain migrates live")]
    DomainNotRunning { domain: String, state: String },
    #[error("this host's libvirt ({0}) does not answer: {1}")]
    LibvirtUnavailable(String, String),
    #[error("the libvirt of {peer} does not answer through ferry's tunnel: {why}")]
    PeerLibvirtUnavailable { peer: String, why: String },
    #[error("{running} libvirt migrations to {peer} are running, as many as run at once")]
    PeerBusy { peer: String, running: u32 },
    #[error("no QEMU VM {name:?} on this host (its monitor {socket} is not there)")]
    UnknownQemuVm { name: String, socket: String },
    #[error(transparent)]
    Monitor(#[from] crate::engine::monitor_dir::MonitorError),
    #[error("{0}: the destination names the VM's monitor after it; give it another name (`ferry migrate NAME --qmp ...`)")]
    VmName(String),
    #[error("VM {name:?}'s monitor does not answer: {why}")]
    QemuVmUnavailable { name: String, why: String },
    #[error("QEMU VMs do not move in groups (only libvirt domains do)")]
    QemuVmInGroup,
    #[error(
        "migration {0} can no longer be cancelled (its stream has ended; the destination decides)"
    )]
    TooLateToCancel(String),
    #[error("{0}")]
    SwapRequest(String),
    #[error("domain {0:?} already swaps to a peer")]
    SwapExists(String),
    #[error("domain {0:?} swaps to no peer")]
    NoSwap(String),
    #[error("domain {0:?}'s swap is being set up or given back; try again when that ends")]
    SwapBusy(String),
    #[error("swap: {0}")]
    Swap(String),
    #[error("domain {0:?} swaps to a peer: give its swap back first (ferry swap off)")]
    MigratingWithSwap(String),
}

impl Refusal {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Refusal::Malformed(_)
            | Refusal::Settings(_)
            | Refusal::UnknownPeer(_)
            | Refusal::SeedName(_)
            | Refusal::NoLibvirt
            | Refusal::NotWithLibvirt(_) => ErrorKind::BadRequest,
            Refusal::UnknownDomain(..) | Refusal::UnknownQemuVm { .. } => ErrorKind::NotFound,
            Refusal::Monitor(_) | Refusal::VmName(_) | Refusal::QemuVmInGroup => {
                ErrorKind::BadRequest
            }
            Refusal::QemuVmUnavailable { .. } => ErrorKind::Unavailable,
            Refusal::DomainNotRunning { .. } | Refusal::PeerBusy { .. } => ErrorKind::Conflict,
            Refusal::LibvirtUnavailable(..) | Refusal::PeerLibvirtUnavailable { .. } => {
                ErrorKind::Unavailable
            }
            Refusal::Busy { .. } => ErrorKind::Busy,
            Refusal::AlreadyMigrating { .. } | Refusal::TooLateToCancel(_) => ErrorKind::Conflict,
            Refusal::NoMigration(_) | Refusal::NoSwap(_) => ErrorKind::NotFound,
            Refusal::SwapRequest(_) => ErrorKind::BadRequest,
            Refusal::SwapExists(_) | Refusal::SwapBusy(_) | Refusal::MigratingWithSwap(_) => {
                ErrorKind::Conflict
            }
            Refusal::Swap(_) => ErrorKind::Unavailable,
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let kind = self.kind();
        let status = StatusCode::from_u16(kind.http_status())
            .expect("ErrorKind's statuses are valid HTTP statuses");
        let body = ApiError {
            error: self.to_string(),
            kind: Some(kind),
        };
        (status, Json(body)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_has_its_status_and_says_why() {
        let unknown = UnknownPeer {
            name: "x".into(),
            known: vec!["b".into()],
        };
        for (refusal, status) in [
            (Refusal::Malformed("eof".into()), 400),
            (Refusal::Settings(SettingsError::Connections(65)), 400),
            (Refusal::UnknownPeer(unknown), 400),
            (Refusal::Busy { running: 4 }, 503),
            (
                Refusal::AlreadyMigrating {
                    vm: "v".into(),
                    id: "1".into(),
                },
                409,
            ),
            (Refusal::NoMigration("9".into()), 404),
            (Refusal::TooLateToCancel("9".into()), 409),
        ] {
            let text = refusal.to_string();
            let response = refusal.into_response();
            assert_eq!(response.status().as_u16(), status, "{text}");
        }
        assert_eq!(
            Refusal::Settings(SettingsError::Connections(65)).to_string(),
            "connections 65 is out of range; use 1 to 64, or 0 for as many as the link needs"
        );
    }
}
