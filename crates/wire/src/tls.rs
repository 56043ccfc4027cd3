//! TLS with mutual authentication between agents (rustls): each agent has a certificate
//! signed by the fleet's CA, presents it, and accepts only peers whose certificate the same
//! CA signed. Server certificates name the agent (its site), and the dialer checks that name.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
pub use rustls::{ClientConfig, ServerConfig};

/// Where an agent's credentials are.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    /// The CA that signs every agent of the fleet (PEM).
    pub ca: PathBuf,
    /// This agent's certificate (PEM), naming it.
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no {what} found in the PEM file")]
    Empty { path: PathBuf, what: &'static str },
    #[error("TLS configuration: {0}")]
    Config(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read = |source| TlsError::Read {
        path: path.into(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    let certs = rustls_pemfile::certs(&mut std::io::BufReader::new(file))
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.into(),
            what: "certificate",
        });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let read = |source| TlsError::Read {
        path: path.into(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read)?;
    rustls_pemfile::private_key(&mut std::io::BufReader::new(file))
        .map_err(read)?
        .ok_or_else(|| TlsError::Empty {
            path: path.into(),
            what: "private key",
        })
}

fn roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certs(path)? {
        roots
            .add(cert)
            .map_err(|e| TlsError::Config(format!("CA {}: {e}", path.display())))?;
    }
    Ok(Arc::new(roots))
}

impl Identity {
    /// The listening side: presents our certificate, requires one from the peer.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(roots(&self.ca)?, provider())
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs(&self.cert)?, key(&self.key)?)
            .map_err(|e| TlsError::Config(format!("{}: {e}", self.cert.display())))?;
        Ok(Arc::new(config))
    }

    /// The dialing side: checks the peer's certificate and name, presents ours.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        let config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_root_certificates(roots(&self.ca)?)
            .with_client_auth_cert(certs(&self.cert)?, key(&self.key)?)
            .map_err(|e| TlsError::Config(format!("{}: {e}", self.cert.display())))?;
        Ok(Arc::new(config))
    }
}
