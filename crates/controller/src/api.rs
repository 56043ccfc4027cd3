//! The controller's REST API (docs/fleet.md): the fleet's views for anyone who may connect,
//! changes for operators, heartbeats for agents. Who calls is decided by the listener
//! ([`Caller`]), once per connection: a certificate's name over mutual TLS, or a local user
//! on the unix socket.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use ferry_api::agent::{ApiError, ErrorKind};
use ferry_api::fleet::{ControllerHealth, FleetMigrationRequest, Heartbeat};

use crate::fleet::{Controller, FleetError};
use crate::store::now_ms;

/// Who is calling, as the connection proved it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A client certificate the fleet's CA signed, naming a host or an operator.
    Certificate(String),
    /// A process on the controller's host, through its socket; `privileged` when it runs as
    /// root or as the controller's own user (the kernel says which: SO_PEERCRED).
    Local { uid: u32, privileged: bool },
}

impl Caller {
    fn name(&self) -> String {
        match self {
            Caller::Certificate(name) => name.clone(),
            Caller::Local { uid, .. } => format!("local uid {uid}"),
        }
    }
}

/// The API's routes over a controller.
pub fn router(controller: Arc<Controller>) -> Router {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/sites", get(sites))
        .route("/v1/hosts", get(hosts))
        .route("/v1/vms", get(vms))
        .route("/v1/migrations", get(migrations).post(migrate))
        .route("/v1/migrations/{id}", get(migration))
        .route("/v1/migrations/{id}/cancel", post(cancel))
        .route("/v1/agent/heartbeat", post(heartbeat))
        .with_state(controller)
}

fn refuse(kind: ErrorKind, message: String) -> Response {
    let status =
        StatusCode::from_u16(kind.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(ApiError {
            error: message,
            kind: Some(kind),
        }),
    )
        .into_response()
}

fn forbidden(message: String) -> Response {
    (
        StatusCode::FORBIDDEN,
        Json(ApiError {
            error: message,
            kind: None,
        }),
    )
        .into_response()
}

impl IntoResponse for FleetError {
    fn into_response(self) -> Response {
        let kind = self.kind();
        match self {
            FleetError::Refused(_, message) => refuse(kind, message),
            FleetError::Forbidden(message) => forbidden(message),
            store => {
                let message = format!("{:#}", anyhow::Error::from(store));
                tracing::error!("{message}");
                refuse(kind, message)
            }
        }
    }
}

fn answer<T: serde::Serialize>(result: Result<T, FleetError>) -> Response {
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Changes need an operator: a certificate named in `operators`, or a privileged local user.
fn operator(controller: &Controller, caller: &Caller) -> Result<(), FleetError> {
    match caller {
        Caller::Local {
            privileged: true, ..
        } => Ok(()),
        Caller::Certificate(name) if controller.config.operators.contains(name) => Ok(()),
        Caller::Certificate(name) => Err(FleetError::Forbidden(format!(
            "{name} may read but not change the fleet (not among the controller's operators)"
        ))),
        Caller::Local { uid, .. } => Err(FleetError::Forbidden(format!(
            "uid {uid} may read but not change the fleet (run as root, or use an operator's certificate)"
        ))),
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, FleetError> {
    serde_json::from_slice(body).map_err(|e| FleetError::bad(format!("malformed request: {e}")))
}

async fn health(State(c): State<Arc<Controller>>) -> Response {
    answer(
        async {
            Ok(ControllerHealth {
                name: c.config.name.clone(),
                version: env!("CARGO_PKG_VERSION").into(),
                store: c.store.kind().name().into(),
                leader: c.store.leader(now_ms()).await?,
            })
        }
        .await,
    )
}

async fn sites(State(c): State<Arc<Controller>>) -> Response {
    answer(c.store.sites().await.map_err(FleetError::from))
}

async fn hosts(State(c): State<Arc<Controller>>) -> Response {
    answer(c.store.hosts().await.map_err(FleetError::from))
}

async fn vms(State(c): State<Arc<Controller>>) -> Response {
    answer(c.store.vms().await.map_err(FleetError::from))
}

async fn migrations(State(c): State<Arc<Controller>>) -> Response {
    answer(c.store.migrations().await.map_err(FleetError::from))
}

async fn migration(State(c): State<Arc<Controller>>, Path(id): Path<String>) -> Response {
    match c.store.migration(&id).await {
        Ok(Some(m)) => Json(m).into_response(),
        Ok(None) => refuse(ErrorKind::NotFound, format!("no migration {id}")),
        Err(e) => FleetError::from(e).into_response(),
    }
}

async fn migrate(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    body: axum::body::Bytes,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        let req: FleetMigrationRequest = parse(&body)?;
        c.request(req, &caller.name()).await
    };
    match result.await {
        Ok(m) => (StatusCode::CREATED, Json(m)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn cancel(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        c.cancel(&id, &caller.name()).await
    };
    answer(result.await)
}

/// An agent's heartbeat: the host is the certificate's name, never the body's.
async fn heartbeat(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    body: axum::body::Bytes,
) -> Response {
    let Caller::Certificate(host) = caller else {
        return forbidden("agents heartbeat over mutual TLS, with their host's certificate".into());
    };
    if c.config.operators.contains(&host) || host == c.config.name {
        return forbidden(format!(
            "{host} is an operator's or a controller's certificate, not a host's"
        ));
    }
    let result = async {
        let beat: Heartbeat = parse(&body)?;
        c.heartbeat(&host, beat).await
    };
    answer(result.await)
}
