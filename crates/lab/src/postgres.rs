//! A PostgreSQL server for the lab's controllers (`lab up --controller --postgres`): the
//! distribution's own server binary, a fresh cluster in the lab's directory, run as the
//! `postgres` user at site a and reachable from both sites. Both controllers share it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::topology::{detach, reap, wait_until, Lab, Site};

/// The site it runs at.
pub const SITE: Site = Site::A;
const PORT: u16 = 5432;
const USER: &str = "ferry";
const DATABASE: &str = "fleet";

/// The URL controllers connect to.
pub fn url() -> String {
    format!("postgres://{USER}@{}:{PORT}/{DATABASE}", SITE.underlay_ip())
}

fn dir(lab: &Lab) -> PathBuf {
    lab.dir().join("postgres")
}

fn pid_path(lab: &Lab) -> PathBuf {
    lab.dir().join("postgres.pid")
}

/// The newest installed server's binaries (`/usr/lib/postgresql/<major>/bin`).
fn bin_dir() -> Result<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .context("PostgreSQL is not installed (scripts/setup.sh installs it)")?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((major, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, bin)| bin)
        .context("no PostgreSQL server under /usr/lib/postgresql (scripts/setup.sh installs it)")
}

/// setpriv's arguments that run a program as the postgres user (the server refuses root);
/// setpriv execs it, so the pid it starts with is the program's.
const AS_POSTGRES: [&str; 4] = [
    "--reuid=postgres",
    "--regid=postgres",
    "--init-groups",
    "--",
];

fn as_postgres(program: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(AS_POSTGRES).arg(program);
    cmd
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().with_context(|| format!("run {what}"))?;
    if !out.status.success() {
        bail!("{what}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Makes a fresh cluster, starts its server at site a and creates the fleet's database.
pub fn start(lab: &Lab) -> Result<()> {
    let bin = bin_dir()?;
    let (dir, data) = (dir(lab), dir(lab).join("data"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&data)?;
    run(
        Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir),
        "chown",
    )?;
    let mut initdb = as_postgres(&bin.join("initdb"));
    // Trust from the lab's sites (pg_hba below): nothing else can reach the server.
    initdb
        .arg("-D")
        .arg(&data)
        .args(["-U", USER, "--auth=trust", "-E", "UTF8"]);
    run(&mut initdb, "initdb")?;
    let hba = data.join("pg_hba.conf");
    let mut rules = fs::read_to_string(&hba)?;
    for site in Site::ALL {
        rules.push_str(&format!("host all all {}/32 trust\n", site.underlay_ip()));
    }
    fs::write(&hba, rules)?;
    let log = fs::File::create(lab.dir().join("postgres.log"))?;
    let mut cmd = lab.host_command(SITE, "setpriv");
    cmd.args(AS_POSTGRES)
        .arg(bin.join("postgres"))
        .arg("-D")
        .arg(&data)
        .args(["-c", &format!("listen_addresses={}", SITE.underlay_ip())])
        .args(["-p", &PORT.to_string()])
        .arg("-k")
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    detach(&mut cmd);
    let child = cmd.spawn().context("start postgres")?;
    fs::write(pid_path(lab), child.id().to_string())?;
    reap(child);
    // The socket accepts connections before the server does ("the database system is
    // starting up"); pg_isready exits 0 only once it accepts sessions.
    let ready = || {
        Command::new(bin.join("pg_isready"))
            .arg("-h")
            .arg(&dir)
            .args(["-p", &PORT.to_string(), "-U", USER, "-q"])
            .status()
            .is_ok_and(|status| status.success())
    };
    wait_until(Duration::from_secs(30), ready).with_context(|| {
        format!(
            "PostgreSQL did not come up; see {}",
            lab.dir().join("postgres.log").display()
        )
    })?;
    let mut createdb = as_postgres(&bin.join("createdb"));
    createdb
        .arg("-h")
        .arg(&dir)
        .args(["-p", &PORT.to_string(), "-U", USER, DATABASE]);
    run(&mut createdb, "createdb")
}

/// Stops the server at once (SIGQUIT: its immediate shutdown), as a database going away.
pub fn stop(lab: &Lab) -> Result<()> {
    let Ok(pid) = fs::read_to_string(pid_path(lab)) else {
        return Ok(());
    };
    let pid: i32 = pid.trim().parse().context("postgres.pid")?;
    // SAFETY: kill(2) on the pid the lab started; a stale pid only fails.
    unsafe { libc::kill(pid, libc::SIGQUIT) };
    let _ = fs::remove_file(pid_path(lab));
    Ok(())
}
