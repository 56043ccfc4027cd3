//! `ferry migrate`: moves a VM through this host's agent to a peer agent.
//!
//! - `--libvirt DOMAIN`: a domain of this host's libvirt, by libvirt's own peer-to-peer
//!   migration carried and steered by the agents (`--copy-storage`: its disks too).
//! - `--qmp SOCKET`: any QEMU its owner started with a QMP socket. The destination agent
//!   starts the destination from the source QEMU's own command line (or from
//!   `--destination-argv-file`), so nothing needs a shell on the destination host.
//! - a lab VM's name (without `--qmp`, in builds with the lab): the lab's path, with the test
//!   guest's verifiers.
//!
//! The agent owns the migration; this command asks for it, follows it with a progress bar,
//! writes its timeline and prints the report. Ctrl-C cancels it (the source VM keeps running).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferry_agent::client::AgentClient;
use ferry_agent::follow::{self, follow, AgentWire, Followed, Start, WanCounter};
use ferry_api::agent::{Destination, LibvirtMigrationRequest, MigrationRequest};
use ferry_api::outcome::Progress;
use ferry_api::Timeline;
use tokio::sync::watch;

use crate::report;
use crate::settings_flags::SettingsFlags;

/// Who counts the WAN bytes of a migration outside the lab.
const AGENT_COUNTERS: &str = "the agents (TLS and framing; not TCP/IP headers)";

#[derive(Args)]
pub struct MigrateArgs {
    /// With --qmp: a name for the reports (default: the socket's file name). Without --qmp or
    /// --libvirt: the lab VM to move.
    vm: Option<String>,
    /// The destination: a peer named in the agent's config (`[peers.NAME]`); for lab VMs, the
    /// site (a or b).
    #[arg(long)]
    to: String,
    /// Move the QEMU that serves this QMP socket (on this host). The agent takes the socket
    /// over for the migration (QEMU serves one QMP client at a time).
    #[arg(long, value_name = "SOCKET", conflicts_with = "libvirt")]
    qmp: Option<PathBuf>,
    /// Move this domain of the host's libvirt: libvirt's own migration, carried by the agents
    /// (their configs need a `[libvirt]` section) and steered through libvirt.
    #[arg(long, value_name = "DOMAIN")]
    libvirt: Option<String>,
    /// With --libvirt: copy the domain's disks too (libvirt's --copy-storage-all).
    /// Otherwise they are on storage both hosts share.
    #[arg(long, requires = "libvirt")]
    copy_storage: bool,
    /// With --libvirt: QEMU's multifd, in this many channels (libvirt's --parallel
    /// --parallel-connections; 1 to 255). The agents code each channel as they do the main
    /// stream.
    #[arg(long, value_name = "CHANNELS", requires = "libvirt")]
    parallel: Option<u32>,
    /// With --qmp: start the destination from this command line (one argument per line,
    /// program first) instead of the source QEMU's own.
    #[arg(long, value_name = "FILE", requires = "qmp")]
    destination_argv_file: Option<PathBuf>,
    /// With --qmp: a disk to copy to the destination (a QEMU block node name; repeat for
    /// each). Without, the disks are taken to be on storage both hosts share.
    #[arg(long = "disk", value_name = "NODE", requires = "qmp")]
    disks: Vec<String>,
    /// This host's agent: its API socket (default: `api_socket` of /etc/ferry/agent.toml, or
    /// /run/ferry/agent.sock).
    #[arg(long, env = "FERRY_AGENT", value_name = "SOCKET")]
    agent: Option<PathBuf>,
    /// Print the outcome as JSON instead of the report.
    #[arg(long)]
    json: bool,
    /// Where to write the migration's timeline.
    #[arg(long)]
    timeline: Option<PathBuf>,
    #[command(flatten)]
    settings: SettingsFlags,
    #[cfg(feature = "lab")]
    #[command(flatten)]
    lab: crate::lab_migrate::LabFlags,
}

pub async fn run(a: MigrateArgs) -> Result<ExitCode> {
    #[cfg(feature = "lab")]
    if a.lab.system.system != "ferry" && (a.qmp.is_some() || a.libvirt.is_some()) {
        bail!(
            "--system {} moves lab VMs only; --qmp and --libvirt go through the agents",
            a.lab.system.system
        );
    }
    if let Some(domain) = a.libvirt.clone() {
        return run_libvirt(a, domain).await;
    }
    let Some(qmp) = a.qmp.clone() else {
        #[cfg(feature = "lab")]
        {
            let Some(vm) = &a.vm else {
                bail!("name the lab VM to move, or give --libvirt DOMAIN or --qmp SOCKET");
            };
            return crate::lab_migrate::run(vm, &a.to, &a.lab, &a.settings, a.json, a.timeline)
                .await;
        }
        #[cfg(not(feature = "lab"))]
        bail!("give --libvirt DOMAIN or --qmp SOCKET: the VM to move");
    };
    let settings = a.settings.settings()?;
    let destination = match &a.destination_argv_file {
        Some(file) => Destination::Argv(read_argv(file)?),
        None => Destination::SourceConfig,
    };
    let source_qmp =
        std::path::absolute(&qmp).with_context(|| format!("--qmp {}", qmp.display()))?;
    if !source_qmp.exists() {
        bail!("--qmp {}: no such socket", qmp.display());
    }
    let vm = a.vm.clone().unwrap_or_else(|| {
        source_qmp
            .file_stem()
            .map_or_else(|| "vm".to_owned(), |s| s.to_string_lossy().into_owned())
    });
    let agent = AgentClient::new(agent_socket(a.agent.as_deref()));
    let req = MigrationRequest {
        vm: vm.clone(),
        source_qmp,
        to: a.to.clone(),
        destination,
        link_rate_mbit: None,
        disks: a.disks.clone(),
        settings,
    };
    let started = Start::now();
    let health = agent.health().await.context("this host's agent")?;
    // From the request on, Ctrl-C cancels: the agent may start the migration even if we left.
    let _active = ferry_agent::interrupt::Active::enter();
    let status = agent.start_migration(&req).await?;
    follow_and_report(&a, &agent, &health.name, &vm, &status.id, started).await
}

/// `--libvirt DOMAIN`: the agent drives libvirt's migration.
async fn run_libvirt(a: MigrateArgs, domain: String) -> Result<ExitCode> {
    if a.vm.is_some() {
        bail!("--libvirt names the domain; drop the VM name");
    }
    let agent = AgentClient::new(agent_socket(a.agent.as_deref()));
    let req = LibvirtMigrationRequest {
        domain: domain.clone(),
        to: a.to.clone(),
        copy_storage: a.copy_storage,
        link_rate_mbit: None,
        parallel: a.parallel,
        settings: a.settings.settings()?,
    };
    let started = Start::now();
    let health = agent.health().await.context("this host's agent")?;
    // From the request on, Ctrl-C cancels: the agent may start the migration even if we left.
    let _active = ferry_agent::interrupt::Active::enter();
    let status = agent.start_libvirt_migration(&req).await?;
    follow_and_report(&a, &agent, &health.name, &domain, &status.id, started).await
}

/// Follows migration `id` on this host's agent with a progress bar (Ctrl-C cancels it),
/// writes its timeline and prints the report; the exit code says how it ended.
async fn follow_and_report(
    a: &MigrateArgs,
    agent: &AgentClient,
    here: &str,
    vm: &str,
    id: &str,
    start: Start,
) -> Result<ExitCode> {
    let timeline = Mutex::new(Timeline::new(
        "ferry",
        vm,
        here,
        &a.to,
        u64::try_from(start.unix_us / 1000).unwrap_or(0),
        0.0,
    ));
    let (tx, rx) = watch::channel(Progress::default());
    let drawer = (!a.json).then(|| tokio::spawn(report::progress_bar(rx)));
    let followed = follow(agent, id, start, &mut AgentWire, &tx, &timeline).await;
    drop(tx);
    if let Some(d) = drawer {
        let _ = d.await;
    }
    let Followed {
        status,
        interrupted,
    } = followed?;
    let outcome = follow::outcome(&status, start, AgentWire.read(&status)?);
    let timeline_path = a
        .timeline
        .clone()
        .unwrap_or_else(|| default_timeline_path(vm, start));
    write_timeline(&timeline_path, &timeline)?;
    if a.json {
        let v = serde_json::json!({ "system": "ferry", "id": status.id, "outcome": outcome, "timeline": timeline_path });
        println!("{v}");
    } else {
        report::print_report("ferry", &outcome, AGENT_COUNTERS);
        println!(
            "  timeline             {} (draw it: ferry report FILE)",
            timeline_path.display()
        );
        if !status.detail.is_empty() {
            println!("  state                {}", status.detail);
        }
    }
    if outcome.completed {
        return Ok(ExitCode::SUCCESS);
    }
    let why = status.error.unwrap_or_else(|| "failed".into());
    if interrupted {
        eprintln!("ferry: interrupted by the user ({why}); the source VM keeps running");
    } else {
        eprintln!("ferry: {why}");
    }
    Ok(ExitCode::from(crate::EXIT_MIGRATION_FAILED))
}

/// The agent's API socket: the flag, else the config's, else the default.
pub fn agent_socket(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_owned();
    }
    ferry_agent::AgentConfig::load(Path::new(ferry_agent::config::DEFAULT_CONFIG))
        .map(|c| c.api_socket)
        .unwrap_or_else(|_| PathBuf::from(ferry_agent::config::DEFAULT_API_SOCKET))
}

/// A command line from a file: one argument per line, empty lines kept out.
fn read_argv(file: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("--destination-argv-file {}", file.display()))?;
    let argv: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    if argv.is_empty() {
        bail!(
            "--destination-argv-file {}: no command line in it (one argument per line, program first)",
            file.display()
        );
    }
    Ok(argv)
}

fn default_timeline_path(vm: &str, start: Start) -> PathBuf {
    let dir = std::env::var_os("FERRY_RUN_DIR")
        .map_or_else(|| PathBuf::from("/run/ferry"), PathBuf::from)
        .join("timelines");
    dir.join(format!("{vm}-{}.json", start.unix_us / 1000))
}

/// Writes `timeline` as JSON to `path`, creating its directory.
pub fn write_timeline(path: &Path, timeline: &Mutex<Timeline>) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let t = timeline.lock().expect("timeline poisoned");
    std::fs::write(path, serde_json::to_vec_pretty(&*t)?)
        .with_context(|| format!("write timeline {}", path.display()))
}
