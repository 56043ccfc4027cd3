//! The lab's fleet controller (`lab up --controller`): `ferry controller` at site a, as a
//! fleet would run it, with its store in the lab's directory; both sites' agents heartbeat to
//! it across the WAN.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::pki;
use crate::topology::{detach, reap, wait_until, Lab, Site};

/// The controller's certificate name.
pub const NAME: &str = "controller";
/// The operator certificate the lab issues (`ferry fleet --as operator` over TLS).
pub const OPERATOR: &str = "operator";
/// Its TLS port at site a's underlay address.
pub const PORT: u16 = 7443;
/// The site it runs at.
pub const SITE: Site = Site::A;

/// Where agents reach it.
pub fn address() -> String {
    format!("{}:{PORT}", SITE.underlay_ip())
}

/// Its local socket (`ferry fleet --controller PATH`).
pub fn socket(lab: &Lab) -> PathBuf {
    lab.dir().join("controller.sock")
}

/// Its SQLite store.
pub fn database(lab: &Lab) -> PathBuf {
    lab.dir().join("controller.db")
}

fn config_path(lab: &Lab) -> PathBuf {
    lab.dir().join("controller.toml")
}

fn pid_path(lab: &Lab) -> PathBuf {
    lab.dir().join("controller.pid")
}

/// The `[controller]` section of an agents' config.
pub fn agent_section() -> String {
    format!("[controller]\naddress = {:?}\nname = {NAME:?}\n", address())
}

/// The lab's certificates for the controller and its operator, beside the agents'.
pub fn certificate_names() -> [String; 2] {
    [NAME.to_owned(), OPERATOR.to_owned()]
}

/// The controller's config: quick heartbeats (the lab's hosts are two), the lab's PKI.
fn config(lab: &Lab) -> String {
    let id = pki::identity(&lab.pki_dir(), NAME);
    let q = |p: &Path| format!("{:?}", p.display().to_string());
    format!(
        "# made by `ferry lab up --controller`\nname = {NAME:?}\nlisten = {:?}\napi_socket = {}\ndatabase = {}\noperators = [{OPERATOR:?}]\n\n[tls]\nca = {}\ncert = {}\nkey = {}\n\n[timing]\nheartbeat_s = 1\nhost_timeout_s = 4\nlease_s = 6\n",
        address(),
        q(&socket(lab)),
        q(&database(lab)),
        q(&id.ca),
        q(&id.cert),
        q(&id.key),
    )
}

/// Starts the controller at site a and waits until its socket answers. Returns its pid.
pub fn start(lab: &Lab, ferry_exe: &Path) -> Result<u32> {
    let (sock, config_path) = (socket(lab), config_path(lab));
    let _ = fs::remove_file(&sock);
    fs::write(&config_path, config(lab))
        .with_context(|| format!("write {}", config_path.display()))?;
    let log_path = lab.dir().join("controller.log");
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    let mut cmd = lab.host_command(SITE, ferry_exe);
    cmd.args(["controller", "--config"])
        .arg(&config_path)
        .env(
            "FERRY_LOG",
            std::env::var("FERRY_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    detach(&mut cmd);
    let child = cmd.spawn().context("start the controller")?;
    let pid = child.id();
    reap(child);
    fs::write(pid_path(lab), pid.to_string())?;
    wait_until(Duration::from_secs(10), || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    })
    .with_context(|| format!("the controller did not come up; see {}", log_path.display()))?;
    Ok(pid)
}

/// Kills the controller (SIGKILL: as a crash would), if it runs.
pub fn kill(lab: &Lab) -> Result<()> {
    let Ok(pid) = fs::read_to_string(pid_path(lab)) else {
        return Ok(());
    };
    let pid: i32 = pid.trim().parse().context("controller.pid")?;
    // SAFETY: kill(2) on the pid the lab started; a stale pid only fails.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = fs::remove_file(pid_path(lab));
    Ok(())
}
