//! The lab's certificates: one CA for the fleet and one certificate per site's agent, named
//! `site-<x>`, made with rcgen. Real fleets bring their own; the agent only reads PEM files.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ferry_wire::tls::Identity;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

use crate::topology::Site;

/// The name a site's agent carries in its certificate.
pub fn agent_name(site: Site) -> String {
    format!("site-{}", site.name())
}

/// Creates `dir/ca.pem` and a certificate and key per site, signed by that CA.
pub fn create(dir: &Path) -> Result<()> {
    create_with(dir, &Site::ALL.map(agent_name))
}

/// Creates a CA and certificates for `names` in `dir` (tests use it for a foreign CA).
pub fn create_with(dir: &Path, names: &[String]) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "ferry lab CA");
    let ca = ca_params.self_signed(&ca_key)?;
    write_private(&dir.join("ca.pem"), &ca.pem())?;
    for name in names {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![name.clone()])?;
        params
            .distinguished_name
            .push(DnType::CommonName, name.as_str());
        let cert = params.signed_by(&key, &ca, &ca_key)?;
        write_private(&dir.join(format!("{name}.pem")), &cert.pem())?;
        write_private(&dir.join(format!("{name}.key")), &key.serialize_pem())?;
    }
    Ok(())
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("write {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// The files an agent named `name` uses from `dir`.
pub fn identity(dir: &Path, name: &str) -> Identity {
    let p = |f: String| -> PathBuf { dir.join(f) };
    Identity {
        ca: p("ca.pem".into()),
        cert: p(format!("{name}.pem")),
        key: p(format!("{name}.key")),
    }
}
