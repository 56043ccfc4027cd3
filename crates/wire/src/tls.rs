//! TLS with mutual authentication between agents (rustls): each agent has a certificate
//! signed by the fleet's CA, presents it, and accepts only peers whose certificate the same
//! CA signed. Server certificates name the agent (its site), and the dialer checks that name.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
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
    #[error("{path}: {source}")]
    Pem { path: PathBuf, source: pem::Error },
    #[error("{path}: no {what} found in the PEM file")]
    Empty { path: PathBuf, what: &'static str },
    #[error("TLS configuration: {0}")]
    Config(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: path.into(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            path: path.into(),
            what: "certificate",
        });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|source| match source {
        pem::Error::NoItemsFound => TlsError::Empty {
            path: path.into(),
            what: "private key",
        },
        source => TlsError::Pem {
            path: path.into(),
            source,
        },
    })
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.into(),
        source,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of its own under the system's temporary directory, removed when dropped.
    struct PemFile(PathBuf);

    impl PemFile {
        fn new(name: &str, text: &str) -> Self {
            let path =
                std::env::temp_dir().join(format!("ferry-tls-{}-{name}", std::process::id()));
            std::fs::write(&path, text).unwrap();
            Self(path)
        }
    }

    impl Drop for PemFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    const CERT_BLOCK: &str = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";

    #[test]
    fn a_key_file_without_a_key_says_so() {
        let file = PemFile::new("only-cert.pem", CERT_BLOCK);
        let error = key(&file.0).unwrap_err().to_string();
        assert!(
            error.ends_with("no private key found in the PEM file"),
            "{error}"
        );
    }

    #[test]
    fn a_broken_pem_block_names_its_file() {
        let file = PemFile::new(
            "broken.pem",
            "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
        );
        let error = certs(&file.0).unwrap_err();
        assert!(matches!(error, TlsError::Pem { .. }), "{error}");
        assert!(
            error.to_string().starts_with(&file.0.display().to_string()),
            "{error}"
        );
    }

    #[test]
    fn certificates_are_read_and_a_missing_file_is_named() {
        let file = PemFile::new("certs.pem", &CERT_BLOCK.repeat(2));
        assert_eq!(certs(&file.0).unwrap().len(), 2);
        let missing = file.0.with_extension("missing");
        let error = certs(&missing).unwrap_err().to_string();
        assert!(
            error.starts_with(&format!("reading {}", missing.display())),
            "{error}"
        );
    }
}
