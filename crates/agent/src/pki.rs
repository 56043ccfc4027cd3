//! The fleet's certificates, made with rcgen so that two hosts need no openssl recipe:
//! `ferry pki init` makes the fleet's CA (`ca.pem`, `ca.key`), `ferry pki issue HOST` a
//! certificate naming HOST and its key (`HOST.pem`, `HOST.key`), signed by that CA. Agents
//! only read PEM files ([`ferry_wire::tls::Identity`]), so a fleet may bring its own CA instead.
//!
//! Keys are written mode 0600 and never overwritten: `init` refuses a directory that already
//! holds a CA, so a second run cannot orphan the certificates the first one signed.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use ferry_wire::tls::Identity;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// Where `ferry pki` keeps the CA when nothing else is said.
pub const DEFAULT_PKI_DIR: &str = "/etc/ferry/pki";

/// Why a certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{0} already holds a CA; remove it first if you mean to start a new fleet (every host certificate it signed stops working)")]
    CaExists(PathBuf),
    #[error("no CA in {dir} (make one with `ferry pki init --dir {dir}`)")]
    NoCa { dir: PathBuf },
    #[error("{0:?} is not a host name a certificate can carry (letters, digits, '-', '.')")]
    BadName(String),
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a usable CA")]
    BadCa { path: PathBuf, source: rcgen::Error },
    #[error("making the certificate")]
    Generate(#[from] rcgen::Error),
}

/// Makes a new fleet CA in `dir` (`ca.pem`, `ca.key`), named `fleet` in its subject.
pub fn init(dir: &Path, fleet: &str) -> Result<(), PkiError> {
    let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
    if cert_path.exists() || key_path.exists() {
        return Err(PkiError::CaExists(dir.to_owned()));
    }
    fs::create_dir_all(dir).map_err(|source| PkiError::Write {
        path: dir.to_owned(),
        source,
    })?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
        .distinguished_name
        .push(DnType::CommonName, format!("ferry fleet CA ({fleet})"));
    let cert = params.self_signed(&key)?;
    write_private(&key_path, &key.serialize_pem())?;
    write_private(&cert_path, &cert.pem())
}

/// Issues a certificate for the host `name`, signed by the CA in `dir`; returns the files an
/// agent named `name` uses.
pub fn issue(dir: &Path, name: &str) -> Result<Identity, PkiError> {
    if !valid_host_name(name) {
        return Err(PkiError::BadName(name.to_owned()));
    }
    let (ca_cert_path, ca_key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
    if !ca_cert_path.exists() || !ca_key_path.exists() {
        return Err(PkiError::NoCa {
            dir: dir.to_owned(),
        });
    }
    let read = |path: &Path| {
        fs::read_to_string(path).map_err(|source| PkiError::Read {
            path: path.to_owned(),
            source,
        })
    };
    let bad_ca = |source| PkiError::BadCa {
        path: ca_cert_path.clone(),
        source,
    };
    let ca_key = KeyPair::from_pem(&read(&ca_key_path)?).map_err(bad_ca)?;
    // The issuer is rebuilt from the CA's own certificate: same subject, same key, so what
    // it signs chains to the `ca.pem` every agent trusts.
    let ca = CertificateParams::from_ca_cert_pem(&read(&ca_cert_path)?)
        .map_err(bad_ca)?
        .self_signed(&ca_key)
        .map_err(bad_ca)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(vec![name.to_owned()])?;
    params.distinguished_name.push(DnType::CommonName, name);
    // Every agent is both ends: it dials its peers and accepts them.
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = params.signed_by(&key, &ca, &ca_key)?;
    let id = identity(dir, name);
    write_private(&id.key, &key.serialize_pem())?;
    write_private(&id.cert, &cert.pem())?;
    Ok(id)
}

/// The files an agent named `name` uses from `dir`.
pub fn identity(dir: &Path, name: &str) -> Identity {
    Identity {
        ca: dir.join("ca.pem"),
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}.key")),
    }
}

fn valid_host_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && !name.starts_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.'))
}

fn write_private(path: &Path, text: &str) -> Result<(), PkiError> {
    let write = || -> std::io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        f.write_all(text.as_bytes())
    };
    write().map_err(|source| PkiError::Write {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferry-pki-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn issued_certificates_authenticate_both_ways() {
        let dir = temp_dir("ok");
        init(&dir, "test").unwrap();
        let a = issue(&dir, "site-a").unwrap();
        let b = issue(&dir, "site-b").unwrap();
        // rustls accepts them as server and client identities under the CA.
        a.server_config().unwrap();
        b.client_config().unwrap();
        let mode = fs::metadata(&a.key).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn init_refuses_to_replace_a_ca_and_issue_needs_one() {
        let dir = temp_dir("twice");
        assert_eq!(
            issue(&dir, "site-a").unwrap_err().to_string(),
            format!(
                "no CA in {0} (make one with `ferry pki init --dir {0}`)",
                dir.display()
            )
        );
        init(&dir, "test").unwrap();
        assert!(init(&dir, "test")
            .unwrap_err()
            .to_string()
            .contains("already holds a CA"));
        assert_eq!(
            issue(&dir, "a/b").unwrap_err().to_string(),
            "\"a/b\" is not a host name a certificate can carry (letters, digits, '-', '.')"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
