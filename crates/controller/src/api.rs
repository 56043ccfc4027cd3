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
use ferry_api::fleet::{
    ControllerHealth, FleetCostModel, FleetGroup, FleetGroupRequest, FleetMigration,
    FleetMigrationRequest, FleetPlan, Heartbeat, HeartbeatAnswer, Host, Pool, PoolRequest, Site,
    Vm,
};
use utoipa::OpenApi;

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
    /// Anyone who reaches the read-only HTTP listener (`http_listen`: the dashboard, metrics).
    Anonymous,
}

impl Caller {
    fn name(&self) -> String {
        match self {
            Caller::Certificate(name) => name.clone(),
            Caller::Local { uid, .. } => format!("local uid {uid}"),
            Caller::Anonymous => "anonymous".into(),
        }
    }
}

/// The API's OpenAPI document, served at `/v1/openapi.json` (the tests check every answer
/// against it).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "ferry fleet controller",
        description = "Sites, hosts, VMs and migrations of a ferry fleet (docs/fleet.md)"
    ),
    paths(
        health,
        sites,
        hosts,
        vms,
        pools,
        pool,
        create_pool,
        delete_pool,
        hold,
        release,
        migrations,
        migration,
        migrate,
        cancel,
        groups,
        group,
        migrate_group,
        plan,
        apply_plan,
        cost_model,
        heartbeat
    )
)]
pub struct ApiDoc;

/// The API's routes over a controller.
pub fn router(controller: Arc<Controller>) -> Router {
    Router::new()
        .route("/", get(dashboard))
        .route("/v1/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .route("/v1/health", get(health))
        .route("/v1/sites", get(sites))
        .route("/v1/hosts", get(hosts))
        .route("/v1/vms", get(vms))
        .route("/v1/pools", get(pools).post(create_pool))
        .route("/v1/pools/{name}", get(pool).delete(delete_pool))
        .route(
            "/v1/pools/{name}/holds/{host}",
            axum::routing::put(hold).delete(release),
        )
        .route("/v1/migrations", get(migrations).post(migrate))
        .route("/v1/migrations/{id}", get(migration))
        .route("/v1/migrations/{id}/cancel", post(cancel))
        .route("/v1/groups", get(groups).post(migrate_group))
        .route("/v1/groups/{id}", get(group))
        .route("/v1/plan", get(plan).post(apply_plan))
        .route("/v1/cost-model", get(cost_model))
        .route("/v1/agent/heartbeat", post(heartbeat))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(controller)
}

/// The largest request body taken: a heartbeat of a host with a thousand VMs and their
/// migrations is well under 1 MiB; anything larger is refused (413) before it is held.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// `GET /metrics`: the fleet in Prometheus's text format: hosts and migrations by state, and
/// the migrations' figures as their source agents last reported them.
async fn metrics(State(c): State<Arc<Controller>>) -> Response {
    use ferry_api::metrics::StateLabel;
    use prometheus_client::metrics::{family::Family, gauge::Gauge};
    let result = async {
        let (hosts, migrations) = (c.store.hosts().await?, c.store.migrations().await?);
        let mut registry = prometheus_client::registry::Registry::with_prefix("ferry_fleet");
        let host_states = Family::<StateLabel, Gauge>::default();
        for state in ["up", "down"] {
            drop(host_states.get_or_create(&StateLabel {
                state: state.into(),
            }));
        }
        for h in &hosts {
            let state = match h.state {
                ferry_api::fleet::HostState::Up => "up",
                ferry_api::fleet::HostState::Down => "down",
            };
            host_states
                .get_or_create(&StateLabel {
                    state: state.into(),
                })
                .inc();
        }
        registry.register("hosts", "Hosts by state", host_states);
        let states = Family::<StateLabel, Gauge>::default();
        for m in &migrations {
            states
                .get_or_create(&StateLabel {
                    state: m.state.name().into(),
                })
                .inc();
        }
        registry.register("migrations", "The controller's migrations by state", states);
        let reported: Vec<_> = migrations.iter().filter_map(|m| m.agent.clone()).collect();
        ferry_api::metrics::register_migrations(
            registry.sub_registry_with_prefix("agent"),
            &reported,
            now_ms(),
        );
        Ok::<_, FleetError>(ferry_api::metrics::encode(&registry))
    };
    match result.await {
        Ok(text) => ([("content-type", ferry_api::metrics::CONTENT_TYPE)], text).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /`: the dashboard, one page drawing the read-only views above (no framework).
async fn dashboard() -> Response {
    (
        [("content-type", "text/html; charset=utf-8")],
        include_str!("dashboard.html"),
    )
        .into_response()
}

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
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
        Caller::Anonymous => Err(FleetError::Forbidden(
            "this listener is read-only; change the fleet through the controller's socket or its mutual-TLS listener".into(),
        )),
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, FleetError> {
    serde_json::from_slice(body).map_err(|e| FleetError::bad(format!("malformed request: {e}")))
}

#[utoipa::path(get, path = "/v1/health", responses(
    (status = 200, description = "this controller, its store, who leads", body = ControllerHealth),
    (status = 503, description = "the store does not answer", body = ApiError)))]
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

#[utoipa::path(get, path = "/v1/sites", responses(
    (status = 200, description = "the sites, from their hosts", body = [Site]),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn sites(State(c): State<Arc<Controller>>) -> Response {
    let sites = async {
        let vms = c.vms().await?;
        Ok(c.store.sites(vms).await?)
    };
    answer(sites.await)
}

#[utoipa::path(get, path = "/v1/hosts", responses(
    (status = 200, description = "every host, up or down", body = [Host]),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn hosts(State(c): State<Arc<Controller>>) -> Response {
    answer(c.store.hosts().await.map_err(FleetError::from))
}

#[utoipa::path(get, path = "/v1/vms", responses(
    (status = 200, description = "the VMs and where they run", body = [Vm]),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn vms(State(c): State<Arc<Controller>>) -> Response {
    answer(c.vms().await)
}

#[utoipa::path(get, path = "/v1/pools", responses(
    (status = 200, description = "the virtual cloud pools and their endpoints", body = [Pool]),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn pools(State(c): State<Arc<Controller>>) -> Response {
    answer(c.pools().await)
}

#[utoipa::path(get, path = "/v1/pools/{name}", params(("name" = String, Path, description = "the pool's name")), responses(
    (status = 200, description = "the pool and its endpoints", body = Pool),
    (status = 404, description = "no such pool", body = ApiError)))]
async fn pool(State(c): State<Arc<Controller>>, Path(name): Path<String>) -> Response {
    answer(c.pool(&name).await)
}

#[utoipa::path(post, path = "/v1/pools", request_body = PoolRequest, responses(
    (status = 201, description = "created", body = Pool),
    (status = 400, description = "a bad name, VNI or bridge", body = ApiError),
    (status = 403, description = "the caller may not change the fleet", body = ApiError),
    (status = 404, description = "a host to hold it on is unknown", body = ApiError),
    (status = 409, description = "the name, VNI or bridge is taken, or a host has no overlay", body = ApiError)))]
async fn create_pool(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    body: axum::body::Bytes,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        c.create_pool(parse(&body)?).await
    };
    match result.await {
        Ok(p) => (StatusCode::CREATED, Json(p)).into_response(),
        Err(e) => e.into_response(),
    }
}

#[utoipa::path(delete, path = "/v1/pools/{name}", params(("name" = String, Path, description = "the pool's name")), responses(
    (status = 200, description = "deleted: the pool as it was", body = Pool),
    (status = 403, description = "the caller may not change the fleet", body = ApiError),
    (status = 404, description = "no such pool", body = ApiError),
    (status = 409, description = "the pool still has VMs", body = ApiError)))]
async fn delete_pool(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        let pool = c.pool(&name).await?;
        c.delete_pool(&name).await?;
        Ok(pool)
    };
    answer(result.await)
}

#[utoipa::path(put, path = "/v1/pools/{name}/holds/{host}", params(
    ("name" = String, Path, description = "the pool's name"),
    ("host" = String, Path, description = "the host to keep its endpoint on")), responses(
    (status = 200, description = "held: the endpoint stays up there", body = Pool),
    (status = 403, description = "the caller may not change the fleet", body = ApiError),
    (status = 404, description = "no such pool or host", body = ApiError),
    (status = 409, description = "the host has no overlay", body = ApiError)))]
async fn hold(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    Path((name, host)): Path<(String, String)>,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        c.hold(&name, &host, true).await
    };
    answer(result.await)
}

#[utoipa::path(delete, path = "/v1/pools/{name}/holds/{host}", params(
    ("name" = String, Path, description = "the pool's name"),
    ("host" = String, Path, description = "the host")), responses(
    (status = 200, description = "released: the endpoint stays only while VMs need it", body = Pool),
    (status = 403, description = "the caller may not change the fleet", body = ApiError),
    (status = 404, description = "no such pool or host", body = ApiError)))]
async fn release(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    Path((name, host)): Path<(String, String)>,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        c.hold(&name, &host, false).await
    };
    answer(result.await)
}

#[utoipa::path(get, path = "/v1/migrations", responses(
    (status = 200, description = "every migration, oldest first", body = [FleetMigration]),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn migrations(State(c): State<Arc<Controller>>) -> Response {
    answer(c.store.migrations().await.map_err(FleetError::from))
}

#[utoipa::path(get, path = "/v1/migrations/{id}", params(("id" = String, Path, description = "the migration's id")), responses(
    (status = 200, description = "the migration", body = FleetMigration),
    (status = 404, description = "no such migration", body = ApiError)))]
async fn migration(State(c): State<Arc<Controller>>, Path(id): Path<String>) -> Response {
    match c.store.migration(&id).await {
        Ok(Some(m)) => Json(m).into_response(),
        Ok(None) => refuse(ErrorKind::NotFound, format!("no migration {id}")),
        Err(e) => FleetError::from(e).into_response(),
    }
}

#[utoipa::path(post, path = "/v1/migrations", request_body = FleetMigrationRequest, responses(
    (status = 201, description = "accepted: requested", body = FleetMigration),
    (status = 400, description = "a bad request: what was wrong", body = ApiError),
    (status = 403, description = "the caller may not change the fleet", body = ApiError),
    (status = 404, description = "an unknown VM, host or site", body = ApiError),
    (status = 409, description = "the VM is already there, or already migrating", body = ApiError),
    (status = 503, description = "a host is down, or the store does not answer", body = ApiError)))]
async fn migrate(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    body: axum::body::Bytes,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        let req = FleetMigrationRequest::parse(&body).map_err(FleetError::bad)?;
        c.request(req, &caller.name()).await
    };
    match result.await {
        Ok(m) => (StatusCode::CREATED, Json(m)).into_response(),
        Err(e) => e.into_response(),
    }
}

#[utoipa::path(post, path = "/v1/migrations/{id}/cancel", params(("id" = String, Path, description = "the migration's id")), responses(
    (status = 200, description = "cancelled, or the cancel goes to the source agent", body = FleetMigration),
    (status = 403, description = "the caller may not change the fleet", body = ApiError),
    (status = 404, description = "no such migration", body = ApiError),
    (status = 409, description = "already finished", body = ApiError)))]
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

#[utoipa::path(get, path = "/v1/groups", responses(
    (status = 200, description = "every group with its members, oldest first", body = [FleetGroup]),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn groups(State(c): State<Arc<Controller>>) -> Response {
    answer(c.groups().await)
}

#[utoipa::path(get, path = "/v1/groups/{id}", params(("id" = String, Path, description = "the group's id")), responses(
    (status = 200, description = "the group and its members", body = FleetGroup),
    (status = 404, description = "no such group", body = ApiError)))]
async fn group(State(c): State<Arc<Controller>>, Path(id): Path<String>) -> Response {
    answer(c.group(&id).await)
}

#[utoipa::path(post, path = "/v1/groups", request_body = FleetGroupRequest, responses(
    (status = 201, description = "accepted: every member requested", body = FleetGroup),
    (status = 400, description = "a bad request, or a group over the limits: what was wrong", body = ApiError),
    (status = 403, description = "the caller may not change the fleet", body = ApiError),
    (status = 404, description = "an unknown VM, host or site", body = ApiError),
    (status = 409, description = "a VM is already there, or already migrating", body = ApiError),
    (status = 503, description = "a host is down, or the store does not answer", body = ApiError)))]
async fn migrate_group(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
    body: axum::body::Bytes,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        let req = FleetGroupRequest::parse(&body).map_err(FleetError::bad)?;
        c.request_group(req, &caller.name()).await
    };
    match result.await {
        Ok(g) => (StatusCode::CREATED, Json(g)).into_response(),
        Err(e) => e.into_response(),
    }
}

#[utoipa::path(get, path = "/v1/plan", responses(
    (status = 200, description = "what the planner would do now (docs/policies.md)", body = FleetPlan),
    (status = 400, description = "the fleet cannot be planned: what is wrong", body = ApiError),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn plan(State(c): State<Arc<Controller>>) -> Response {
    answer(c.plan().await)
}

#[utoipa::path(post, path = "/v1/plan", responses(
    (status = 200, description = "the plan carried out: the migrations and groups requested, the moves refused", body = FleetPlan),
    (status = 400, description = "the fleet cannot be planned: what is wrong", body = ApiError),
    (status = 403, description = "the caller may not change the fleet", body = ApiError),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn apply_plan(
    State(c): State<Arc<Controller>>,
    Extension(caller): Extension<Caller>,
) -> Response {
    let result = async {
        operator(&c, &caller)?;
        c.apply_plan(&caller.name()).await
    };
    answer(result.await)
}

#[utoipa::path(get, path = "/v1/cost-model", responses(
    (status = 200, description = "the figures moves are priced with, per kind of VM, and their error on the fleet's migrations each fit did not see (docs/policies.md)", body = [FleetCostModel]),
    (status = 503, description = "the store does not answer", body = ApiError)))]
async fn cost_model(State(c): State<Arc<Controller>>) -> Response {
    answer(c.cost_model().await)
}

#[utoipa::path(post, path = "/v1/agent/heartbeat", request_body = Heartbeat, responses(
    (status = 200, description = "what to start and cancel, when to call again", body = HeartbeatAnswer),
    (status = 400, description = "a malformed report", body = ApiError),
    (status = 403, description = "not a host's certificate over mutual TLS", body = ApiError)))]
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
