//! The lab's fleet controllers (`lab up --controller`): `ferry controller` as a fleet would
//! run it, with the lab's certificates. Alone, one at site a with a SQLite store in the lab's
//! directory; with `--postgres`, one at each site sharing the lab's PostgreSQL
//! ([`crate::postgres`]), one leading at a time. Both sites' agents heartbeat to them.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::link::LinkConfig;
use crate::pki;
use crate::topology::{detach, reap, wait_until, Lab, Site};

/// The operator certificate the lab issues (`ferry fleet --as operator` over TLS).
pub const OPERATOR: &str = "operator";
/// The controllers' TLS port at their site's underlay address.
pub const PORT: u16 = 7443;

/// The name (and certificate) of the controller at `site`.
pub fn name(site: Site) -> String {
    format!("controller-{}", site.name())
}

/// Where agents reach the controller at `site`.
pub fn address(site: Site) -> String {
    format!("{}:{PORT}", site.underlay_ip())
}

/// The local socket of the controller at `site` (`ferry fleet --controller PATH`).
pub fn socket(lab: &Lab, site: Site) -> PathBuf {
    lab.dir().join(format!("controller-{}.sock", site.name()))
}

/// The SQLite store of a lone controller.
pub fn sqlite_database(lab: &Lab) -> PathBuf {
    lab.dir().join("controller.db")
}

fn config_path(lab: &Lab, site: Site) -> PathBuf {
    lab.dir().join(format!("controller-{}.toml", site.name()))
}

fn pid_path(lab: &Lab, site: Site) -> PathBuf {
    lab.dir().join(format!("controller-{}.pid", site.name()))
}

/// The `[[controllers]]` sections of an agent's config: the controllers at `sites`, in order.
pub fn agent_sections(sites: &[Site]) -> String {
    sites
        .iter()
        .map(|&site| {
            format!(
                "\n[[controllers]]\naddress = {:?}\nname = {:?}\n",
                address(site),
                name(site)
            )
        })
        .collect()
}

/// The lab's certificates for its controllers and their operator, beside the agents'.
pub fn certificate_names() -> Vec<String> {
    let mut names: Vec<String> = Site::ALL.into_iter().map(name).collect();
    names.push(OPERATOR.to_owned());
    names
}

/// A controller's config: quick heartbeats (the lab's hosts are two), the lab's PKI, and a
/// planner that acts at once (the lab's hosts are new, its days short, and its idle guests'
/// CPU, sampled each second on a shared 2-core machine, too jumpy for a hold), carrying
/// plans out only when asked (`ferry fleet plan --apply`), pricing moves on the lab's `link`
/// (its cost model's inputs). With `overload`, it meets memory
/// overload, sampling every 3 s (a lab's overloads last seconds, not Overdriver's minutes),
/// with swap on the peer (`Some(true)`) or by migrations alone (`Some(false)`).
fn config(
    lab: &Lab,
    site: Site,
    database: &str,
    link: &LinkConfig,
    overload: Option<bool>,
) -> String {
    let id = pki::identity(&lab.pki_dir(), &name(site));
    let q = |p: &Path| format!("{:?}", p.display().to_string());
    let overload = match overload {
        Some(swap) => format!("overload = true\noverload_interval_s = 3\noverload_swap = {swap}\n"),
        None => String::new(),
    };
    format!(
        "# made by `ferry lab up --controller`\nname = {:?}\nlisten = {:?}\napi_socket = {}\ndatabase = {database:?}\noperators = [{OPERATOR:?}]\n\n[tls]\nca = {}\ncert = {}\nkey = {}\n\n[timing]\nheartbeat_s = 1\nhost_timeout_s = 4\nlease_s = 6\n\n[limits]\nper_site_pair = 4\n\n[policy]\nhold_s = 0\nmin_on_s = 0\ncooldown_s = 30\nwan_mbit = {}\nwan_rtt_ms = {}\n{overload}",
        name(site),
        address(site),
        q(&socket(lab, site)),
        q(&id.ca),
        q(&id.cert),
        q(&id.key),
        link.rate_mbit,
        link.rtt_ms,
    )
}

/// Starts the controller at `site` on `database` and waits until its socket answers.
pub fn start(
    lab: &Lab,
    ferry_exe: &Path,
    site: Site,
    database: &str,
    link: &LinkConfig,
    overload: Option<bool>,
) -> Result<u32> {
    let (sock, config_path) = (socket(lab, site), config_path(lab, site));
    let _ = fs::remove_file(&sock);
    fs::write(&config_path, config(lab, site, database, link, overload))
        .with_context(|| format!("write {}", config_path.display()))?;
    let log_path = lab.dir().join(format!("controller-{}.log", site.name()));
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)?;
    let mut cmd = lab.host_command(site, ferry_exe);
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
    fs::write(pid_path(lab, site), pid.to_string())?;
    wait_until(Duration::from_secs(30), || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    })
    .with_context(|| {
        // The lab is taken down after a failed `up`, its logs with it: say what the log said.
        format!(
            "the controller at site {} did not come up: {}",
            site.name(),
            crate::agents::log_tail(&log_path, 3).join(" | ")
        )
    })?;
    Ok(pid)
}

/// Kills the controller at `site` (SIGKILL: as a crash would), if it runs.
pub fn kill(lab: &Lab, site: Site) -> Result<()> {
    let Ok(pid) = fs::read_to_string(pid_path(lab, site)) else {
        return Ok(());
    };
    let pid: i32 = pid.trim().parse().context("controller pid file")?;
    // SAFETY: kill(2) on the pid the lab started; a stale pid only fails.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = fs::remove_file(pid_path(lab, site));
    Ok(())
}

/// `ferry fleet ARGS` against the lab's controller at site a, as the `ferry` at `exe`; its
/// stdout, or its stderr as the error.
pub fn fleet(lab: &Lab, exe: &Path, args: &[String]) -> Result<String> {
    let out = std::process::Command::new(exe)
        .args(["fleet", "--controller"])
        .arg(socket(lab, Site::A))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("run ferry fleet")?;
    if !out.status.success() {
        anyhow::bail!(
            "ferry fleet {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ferry fleet WHAT --json` (hosts, vms, pools, migrations, groups): its list.
pub fn fleet_json(lab: &Lab, exe: &Path, what: &str) -> Result<Vec<serde_json::Value>> {
    let out = fleet(lab, exe, &[what.to_owned(), "--json".into()])?;
    Ok(serde_json::from_str::<serde_json::Value>(&out)?
        .as_array()
        .cloned()
        .unwrap_or_default())
}
