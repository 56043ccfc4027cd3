//! Running the controller: the store opened, the leader's loop, and the API on its two
//! listeners (TCP with mutual TLS; the local unix socket), each connection tagged with who it
//! is ([`Caller`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_rustls::TlsAcceptor;

use crate::api::{self, Caller};
use crate::config::ControllerConfig;
use crate::fleet::Controller;
use crate::store::{now_ms, Store};

/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the controller until it is killed.
pub async fn run(config: ControllerConfig) -> Result<()> {
    // The credentials are checked before anything is opened or bound.
    config.identity.server_config()?;
    let store = Store::open(&config.database).await?;
    let tcp = TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("listen on {}", config.listen))?;
    if let Some(dir) = config.api_socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let _ = std::fs::remove_file(&config.api_socket);
    let local = UnixListener::bind(&config.api_socket)
        .with_context(|| format!("API socket {}", config.api_socket.display()))?;
    // Anyone on the host may read the fleet; who may change it is checked per request.
    std::fs::set_permissions(
        &config.api_socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )?;
    tracing::info!(
        "controller {} on {} (mutual TLS) and {}, store {}",
        config.name,
        config.listen,
        config.api_socket.display(),
        store.kind().name()
    );
    let http = match &config.http_listen {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .with_context(|| format!("http_listen {address}"))?,
        ),
        None => None,
    };
    serve(Arc::new(Controller::new(config, store)), tcp, local, http).await
}

/// Serves the API on its listeners (the read-only HTTP one if given) and leads when it can,
/// until an error.
pub async fn serve(
    controller: Arc<Controller>,
    tcp: TcpListener,
    local: UnixListener,
    http: Option<TcpListener>,
) -> Result<()> {
    let tls = TlsAcceptor::from(controller.config.identity.server_config()?);
    let app = api::router(controller.clone());
    let read_only = async {
        match http {
            Some(listener) => serve_read_only(listener, app.clone()).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = serve_tls(tcp, tls, app.clone()) => r,
        r = serve_local(local, app.clone()) => r,
        r = read_only => r,
        r = lead(controller) => r,
    }
}

/// Leads while it holds the store's lease: renews it every third of the lease, and runs the
/// leader's round each heartbeat. A controller that cannot reach the store stops leading
/// (its lease runs out) and tries again.
async fn lead(controller: Arc<Controller>) -> Result<()> {
    let timing = controller.config.timing;
    let me = controller.config.name.clone();
    let mut leading = false;
    let period = Duration::from_millis(timing.heartbeat_ms.min(timing.lease_ms / 3).max(50));
    loop {
        match controller
            .store
            .try_lead(&me, now_ms(), timing.lease_ms)
            .await
        {
            Ok(now_leading) => {
                if now_leading != leading {
                    tracing::info!(
                        "{me} {} the fleet's migrations",
                        if now_leading {
                            "leads"
                        } else {
                            "no longer leads"
                        }
                    );
                    leading = now_leading;
                }
                if leading {
                    if let Err(e) = controller.lead().await {
                        tracing::warn!("leader's round: {:#}", anyhow::Error::from(e));
                    }
                    if let Err(e) = controller.observe().await {
                        tracing::warn!("planning: {:#}", anyhow::Error::from(e));
                    }
                }
            }
            Err(e) => {
                tracing::warn!(
                    "cannot reach the store to lead: {:#}",
                    anyhow::Error::from(e)
                );
                leading = false;
            }
        }
        tokio::time::sleep(period).await;
    }
}

async fn serve_tls(listener: TcpListener, tls: TlsAcceptor, app: Router) -> Result<()> {
    loop {
        let (tcp, peer) = listener.accept().await.context("accept")?;
        let (tls, app) = (tls.clone(), app.clone());
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return tracing::info!("TLS from {peer} refused: {e}"),
                Err(_) => return tracing::info!("TLS from {peer}: no handshake in time"),
            };
            let name = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|certs| certs.first())
                .and_then(|cert| certificate_name(cert.as_ref()));
            let Some(name) = name else {
                return tracing::info!("TLS from {peer}: its certificate names nobody");
            };
            serve_connection(stream, app, Caller::Certificate(name)).await;
        });
    }
}

/// Plain HTTP for the dashboard, the read-only views and the metrics; every change is refused.
async fn serve_read_only(listener: TcpListener, app: Router) -> Result<()> {
    loop {
        let (stream, _) = listener.accept().await.context("accept")?;
        tokio::spawn(serve_connection(stream, app.clone(), Caller::Anonymous));
    }
}

async fn serve_local(listener: UnixListener, app: Router) -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let own_uid = unsafe { libc::geteuid() };
    loop {
        let (stream, _) = listener.accept().await.context("accept")?;
        let Ok(cred) = stream.peer_cred() else {
            continue;
        };
        let caller = Caller::Local {
            uid: cred.uid(),
            privileged: cred.uid() == 0 || cred.uid() == own_uid,
        };
        tokio::spawn(serve_connection(stream, app.clone(), caller));
    }
}

async fn serve_connection<S>(io: S, app: Router, caller: Caller)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = TowerToHyperService::new(app.layer(axum::Extension(caller)));
    // Half-close: a request received whole is carried out (a migration started, a pool
    // made) even when its client closed the connection before reading the answer; hyper
    // otherwise drops the request's handler on reading the connection's end.
    if let Err(e) = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .serve_connection(TokioIo::new(io), service)
        .await
    {
        tracing::debug!("API connection: {e}");
    }
}

/// The name a certificate carries: its first DNS subject alternative name (`ferry pki issue`
/// puts the host's name there), else its common name.
pub fn certificate_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
                return Some((*dns).to_owned());
            }
        }
    }
    let common_name = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::to_owned);
    common_name
}
