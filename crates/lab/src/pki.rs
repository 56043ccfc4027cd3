//! The lab's certificates, made the way a fleet makes them (`ferry pki init` and `issue`,
//! [`ferry_agent::pki`]): one CA for the lab and one certificate per site's agent, named
//! `site-<x>`.

use std::path::Path;

use anyhow::{Context, Result};
use ferry_agent::pki;

pub use ferry_agent::pki::identity;

use crate::topology::Site;

/// The name a site's agent carries in its certificate.
pub fn agent_name(site: Site) -> String {
    format!("site-{}", site.name())
}

/// A fresh CA in `dir` (whatever was there goes) and a certificate and key per site, for
/// the controller and for its operator.
pub fn create(dir: &Path) -> Result<()> {
    let mut names = Site::ALL.map(agent_name).to_vec();
    names.extend(crate::controller::certificate_names());
    create_with(dir, &names)
}

/// A fresh CA in `dir` and certificates for `names` (tests use it for a foreign CA).
pub fn create_with(dir: &Path, names: &[String]) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("remove {}", dir.display()))?;
    }
    pki::init(dir, "lab")?;
    for name in names {
        pki::issue(dir, name)?;
    }
    Ok(())
}
