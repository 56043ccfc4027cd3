//! The CLI's client for an agent's local API (HTTP/1.1 over its unix socket).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use ferry_api::agent::{
    ApiError, ErrorKind, Health, LibvirtMigrationRequest, MigrationRequest, MigrationStatus,
    SwapRequest, SwapStatus,
};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::net::UnixStream;

/// The largest answer taken from the agent (a list of 1,024 finished migrations with their
/// events is a few MiB).
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// The agent refused a request; `kind` says how (and decides the CLI's exit code).
#[derive(Debug, thiserror::Error)]
#[error("agent: {message}")]
pub struct AgentRefused {
    pub kind: ErrorKind,
    pub message: String,
}

/// An agent, reached through its API socket.
#[derive(Debug, Clone)]
pub struct AgentClient {
    socket: PathBuf,
}

impl AgentClient {
    pub fn new(socket: impl Into<PathBuf>) -> AgentClient {
        AgentClient {
            socket: socket.into(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T> {
        let stream = UnixStream::connect(&self.socket).await.with_context(|| {
            format!(
                "cannot reach the agent at {} (is `ferry agent` running?)",
                self.socket.display()
            )
        })?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "ferry-agent")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let resp = sender.send_request(req).await?;
        let status = resp.status();
        // A list of migrations is the largest answer: at most 1,024 finished ones are kept.
        let bytes = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| anyhow!("the agent's answer to {path}: {e}"))?
            .to_bytes();
        if !status.is_success() {
            let (message, kind) = match serde_json::from_slice::<ApiError>(&bytes) {
                Ok(e) => (e.error, e.kind),
                Err(_) => (String::from_utf8_lossy(&bytes).into_owned(), None),
            };
            return Err(AgentRefused {
                kind: kind.unwrap_or_else(|| ErrorKind::from_http_status(status.as_u16())),
                message,
            }
            .into());
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| anyhow!("agent sent a malformed answer to {path}: {e}"))
    }

    pub async fn health(&self) -> Result<Health> {
        self.call("GET", "/v1/health", None).await
    }

    pub async fn start_migration(&self, req: &MigrationRequest) -> Result<MigrationStatus> {
        self.call("POST", "/v1/migrations", Some(serde_json::to_vec(req)?))
            .await
    }

    pub async fn start_libvirt_migration(
        &self,
        req: &LibvirtMigrationRequest,
    ) -> Result<MigrationStatus> {
        self.call(
            "POST",
            "/v1/libvirt/migrations",
            Some(serde_json::to_vec(req)?),
        )
        .await
    }

    pub async fn migration(&self, id: &str) -> Result<MigrationStatus> {
        self.call("GET", &format!("/v1/migrations/{id}"), None)
            .await
    }

    /// Cancels a migration whose stream has not ended yet (the source VM keeps running).
    pub async fn cancel(&self, id: &str) -> Result<MigrationStatus> {
        self.call("POST", &format!("/v1/migrations/{id}/cancel"), None)
            .await
    }

    pub async fn migrations(&self) -> Result<Vec<MigrationStatus>> {
        self.call("GET", "/v1/migrations", None).await
    }

    /// The domains with swap on a peer.
    pub async fn swaps(&self) -> Result<Vec<SwapStatus>> {
        self.call("GET", "/v1/swap", None).await
    }

    /// Gives `domain` swap on a peer's memory and squeezes its balloon (returns once the
    /// guest swaps).
    pub async fn take_swap(&self, domain: &str, req: &SwapRequest) -> Result<SwapStatus> {
        let path = format!("/v1/vms/{domain}/swap");
        self.call("PUT", &path, Some(serde_json::to_vec(req)?))
            .await
    }

    /// Gives `domain`'s memory back and its swap up (returns once the guest swapped off).
    pub async fn give_swap_back(&self, domain: &str) -> Result<SwapStatus> {
        self.call("DELETE", &format!("/v1/vms/{domain}/swap"), None)
            .await
    }
}
