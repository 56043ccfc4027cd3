//! A client of the controller's API (`ferry fleet`): through its local socket, or over mutual
//! TLS with an operator's certificate.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use ferry_api::agent::{ApiError, ErrorKind};
use ferry_api::fleet::{
    ControllerHealth, FleetGroup, FleetGroupRequest, FleetMigration, FleetMigrationRequest,
    FleetPlan, Heartbeat, HeartbeatAnswer, Host, Pool, PoolRequest, Site, Vm,
};
use ferry_wire::tls::ClientConfig;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

/// The controller refused a request; `kind` says how (none: 403, not allowed).
#[derive(Debug, thiserror::Error)]
#[error("controller: {message}")]
pub struct ControllerRefused {
    pub kind: Option<ErrorKind>,
    pub message: String,
}

/// Where the controller is.
#[derive(Clone)]
pub enum Endpoint {
    /// Its local socket.
    Local(PathBuf),
    /// Its TCP address, the name its certificate carries, and our credentials.
    Tls {
        address: String,
        server_name: String,
        tls: Arc<ClientConfig>,
    },
}

#[derive(Clone)]
pub struct ControllerClient {
    endpoint: Endpoint,
}

impl ControllerClient {
    pub fn new(endpoint: Endpoint) -> ControllerClient {
        ControllerClient { endpoint }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T> {
        let (status, bytes) = self.raw(method, path, body).await?;
        if !(200..300).contains(&status) {
            let (message, kind) = match serde_json::from_slice::<ApiError>(&bytes) {
                Ok(e) => (e.error, e.kind),
                Err(_) => (String::from_utf8_lossy(&bytes).into_owned(), None),
            };
            return Err(ControllerRefused { kind, message }.into());
        }
        serde_json::from_slice(&bytes).map_err(|e| anyhow!("malformed answer to {path}: {e}"))
    }

    /// One request; the answer's status and body as they came.
    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(u16, Bytes)> {
        match &self.endpoint {
            Endpoint::Local(socket) => {
                let stream = UnixStream::connect(socket).await.with_context(|| {
                    format!(
                        "cannot reach the controller at {} (is `ferry controller` running?)",
                        socket.display()
                    )
                })?;
                exchange_raw(stream, method, path, body).await
            }
            Endpoint::Tls {
                address,
                server_name,
                tls,
            } => {
                let tcp = TcpStream::connect(address)
                    .await
                    .with_context(|| format!("cannot reach the controller at {address}"))?;
                let name = rustls_pki_types::ServerName::try_from(server_name.clone())
                    .map_err(|e| anyhow!("controller name {server_name:?}: {e}"))?;
                let stream = tokio_rustls::TlsConnector::from(tls.clone())
                    .connect(name, tcp)
                    .await
                    .with_context(|| {
                        format!("TLS with the controller {server_name} at {address}")
                    })?;
                exchange_raw(stream, method, path, body).await
            }
        }
    }

    pub async fn health(&self) -> Result<ControllerHealth> {
        self.call("GET", "/v1/health", None).await
    }

    pub async fn sites(&self) -> Result<Vec<Site>> {
        self.call("GET", "/v1/sites", None).await
    }

    pub async fn hosts(&self) -> Result<Vec<Host>> {
        self.call("GET", "/v1/hosts", None).await
    }

    pub async fn vms(&self) -> Result<Vec<Vm>> {
        self.call("GET", "/v1/vms", None).await
    }

    pub async fn pools(&self) -> Result<Vec<Pool>> {
        self.call("GET", "/v1/pools", None).await
    }

    pub async fn create_pool(&self, req: &PoolRequest) -> Result<Pool> {
        self.call("POST", "/v1/pools", Some(serde_json::to_vec(req)?))
            .await
    }

    pub async fn delete_pool(&self, name: &str) -> Result<Pool> {
        self.call("DELETE", &format!("/v1/pools/{name}"), None)
            .await
    }

    /// Keeps (`hold`) or stops keeping `pool`'s endpoint on `host`.
    pub async fn hold(&self, pool: &str, host: &str, hold: bool) -> Result<Pool> {
        let method = if hold { "PUT" } else { "DELETE" };
        self.call(method, &format!("/v1/pools/{pool}/holds/{host}"), None)
            .await
    }

    pub async fn migrations(&self) -> Result<Vec<FleetMigration>> {
        self.call("GET", "/v1/migrations", None).await
    }

    pub async fn migration(&self, id: &str) -> Result<FleetMigration> {
        self.call("GET", &format!("/v1/migrations/{id}"), None)
            .await
    }

    pub async fn migrate(&self, req: &FleetMigrationRequest) -> Result<FleetMigration> {
        self.call("POST", "/v1/migrations", Some(serde_json::to_vec(req)?))
            .await
    }

    pub async fn migrate_group(&self, req: &FleetGroupRequest) -> Result<FleetGroup> {
        self.call("POST", "/v1/groups", Some(serde_json::to_vec(req)?))
            .await
    }

    /// What the planner would do now.
    pub async fn plan(&self) -> Result<FleetPlan> {
        self.call("GET", "/v1/plan", None).await
    }

    /// The cost model in use for each kind of VM, and its error.
    pub async fn cost_model(&self) -> Result<Vec<ferry_api::fleet::FleetCostModel>> {
        self.call("GET", "/v1/cost-model", None).await
    }

    /// Carries the plan out.
    pub async fn apply_plan(&self) -> Result<FleetPlan> {
        self.call("POST", "/v1/plan", None).await
    }

    pub async fn groups(&self) -> Result<Vec<FleetGroup>> {
        self.call("GET", "/v1/groups", None).await
    }

    pub async fn group(&self, id: &str) -> Result<FleetGroup> {
        self.call("GET", &format!("/v1/groups/{id}"), None).await
    }

    pub async fn cancel(&self, id: &str) -> Result<FleetMigration> {
        self.call("POST", &format!("/v1/migrations/{id}/cancel"), None)
            .await
    }

    /// What an agent sends (tests play agents with it).
    pub async fn heartbeat(&self, beat: &Heartbeat) -> Result<HeartbeatAnswer> {
        self.call(
            "POST",
            "/v1/agent/heartbeat",
            Some(serde_json::to_vec(beat)?),
        )
        .await
    }
}

/// One request on a fresh connection: the answer's status and body.
pub async fn exchange_raw<S>(
    stream: S,
    method: &str,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<(u16, Bytes)>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "ferry-controller")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))?;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    Ok((status, resp.into_body().collect().await?.to_bytes()))
}
