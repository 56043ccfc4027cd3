//! `ferry`: live migration of QEMU VMs across wide-area links.
//!
//! Exit codes (stable, see README.md): 0 success; 1 the command failed (the message says
//! why); 2 bad usage; 3 a migration did not complete or the guest's verifier found errors.

#[cfg(feature = "lab")]
mod bench;
mod cost_cmd;
#[cfg(feature = "lab")]
mod demo;
mod fleet_cmd;
#[cfg(feature = "lab")]
mod lab_cmd;
#[cfg(feature = "lab")]
mod lab_migrate;
mod migrate;
mod migrations;
mod pki_cmd;
mod plot;
mod report;
mod settings_flags;
mod sim_cmd;
mod stop;
mod swap_cmd;
#[cfg(feature = "lab")]
mod vm_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit code when a migration did not complete or verification failed.
pub const EXIT_MIGRATION_FAILED: u8 = 3;

/// Exit code for bad usage (clap's own, and requests the agent calls malformed).
pub const EXIT_USAGE: u8 = 2;

/// The exit code of a command that failed with `e`: the one place errors become exit codes.
fn exit_code_of(e: &anyhow::Error) -> ExitCode {
    use ferry_agent::client::AgentRefused;
    use ferry_api::agent::ErrorKind;
    use ferry_controller::client::ControllerRefused;
    let kind = match e.downcast_ref::<AgentRefused>() {
        Some(r) => Some(r.kind),
        None => e.downcast_ref::<ControllerRefused>().and_then(|r| r.kind),
    };
    // A setting out of bounds is bad usage whether the CLI or the agent finds it.
    let out_of_bounds = e
        .downcast_ref::<ferry_api::settings::SettingsError>()
        .is_some();
    match kind {
        Some(ErrorKind::BadRequest) => ExitCode::from(EXIT_USAGE),
        _ if out_of_bounds => ExitCode::from(EXIT_USAGE),
        _ => ExitCode::FAILURE,
    }
}

/// `ferry --version`: the release and every protocol version it speaks (peers must speak the
/// same; a test keeps these numbers equal to the constants).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (wire protocol 1, control messages 19, agent API v1, timeline 1; QEMU >= 10; lab guest serial v1)"
);

#[derive(Parser)]
#[command(name = "ferry", version = VERSION)]
#[command(about = "Live migration of QEMU VMs across wide-area links")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Move a running VM to another host through this host's agent.
    Migrate(Box<migrate::MigrateArgs>),
    /// The migrations this host's agent sent: state, figures, errors.
    Migrations(migrations::MigrationsArgs),
    /// A libvirt domain's swap on a peer's spare memory (for a transient memory overload).
    Swap(swap_cmd::SwapArgs),
    /// Run this host's agent: the local API for the CLI and the endpoint for peer agents.
    Agent(AgentArgs),
    /// Run the fleet controller: sites, hosts, VMs and migrations in one store; agents
    /// heartbeat to it and run the migrations it schedules.
    Controller(fleet_cmd::ControllerArgs),
    /// The fleet, through its controller: sites, hosts, VMs, migrations; migrate, watch.
    Fleet(fleet_cmd::FleetArgs),
    /// The fleet's certificates: a CA, and one certificate per host.
    #[command(subcommand)]
    Pki(pki_cmd::PkiCmd),
    /// Run the demo: a live migration across an emulated 100 Mbit/s, 50 ms WAN.
    #[cfg(feature = "lab")]
    Demo(demo::DemoArgs),
    /// The lab's guest image.
    #[cfg(feature = "lab")]
    #[command(subcommand)]
    Image(ImageCmd),
    /// The two-site lab: namespaces, WAN emulator, bridges.
    #[cfg(feature = "lab")]
    #[command(subcommand)]
    Lab(lab_cmd::LabCmd),
    /// The lab's VMs.
    #[cfg(feature = "lab")]
    #[command(subcommand)]
    Vm(vm_cmd::VmCmd),
    /// Send one command to a lab VM's guest agent and print its reply (e.g. `mem verify`).
    #[cfg(feature = "lab")]
    Guest(vm_cmd::GuestArgs),
    /// Run benchmark scenarios in the lab and print one JSON object per migration.
    #[cfg(feature = "lab")]
    Bench(bench::BenchArgs),
    /// Fit the migration cost model to `ferry bench` records and report its error on the
    /// migrations each fit did not see.
    CostModel(cost_cmd::CostModelArgs),
    /// The fleet simulator: ferry's policies on a simulated clock (docs/policies.md).
    Simulate(sim_cmd::SimulateArgs),
    /// Draw a migration timeline (JSON from `migrate`, `demo --timeline` or `bench --timelines`) as SVG.
    Report {
        /// The timeline JSON file.
        timeline: std::path::PathBuf,
        /// Where to write the SVG (default: the timeline's path with .svg).
        #[arg(short, long)]
        output: Option<std::path::PathBuf>,
    },
}

#[derive(clap::Args)]
struct AgentArgs {
    /// The agent's config file (TOML: name, listen address, certificates, peers, limits;
    /// docs/agent-api.md shows one).
    #[arg(long, default_value = ferry_agent::config::DEFAULT_CONFIG)]
    config: std::path::PathBuf,
}

#[cfg(feature = "lab")]
#[derive(Subcommand)]
enum ImageCmd {
    /// Build the tiny guest image (cached; rebuilt only when its inputs change).
    Build {
        /// Rebuild even if the cached image is current.
        #[arg(long)]
        force: bool,
    },
}

/// `ferry report`: reads a timeline and writes its picture.
fn report_svg(
    path: &std::path::Path,
    output: Option<std::path::PathBuf>,
) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("read timeline {}", path.display()))?;
    let t: ferry_api::Timeline = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a ferry timeline", path.display()))?;
    if t.version != ferry_api::timeline::TIMELINE_VERSION {
        anyhow::bail!(
            "{} is timeline version {}; this ferry reads version {}",
            path.display(),
            t.version,
            ferry_api::timeline::TIMELINE_VERSION
        );
    }
    let out = output.unwrap_or_else(|| path.with_extension("svg"));
    std::fs::write(&out, plot::svg(&t)).with_context(|| format!("write {}", out.display()))?;
    println!("{}", out.display());
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if matches!(cli.command, Cmd::Agent(_)) {
        // Before any thread: an idle agent then gives back what its migrations used.
        ferry_agent::memory::one_malloc_arena();
    }
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let result = rt.block_on(async {
        // The agent and the controller are services: they keep the signals' defaults (their
        // journals and stores carry them across a restart).
        if !matches!(cli.command, Cmd::Agent(_) | Cmd::Controller(_)) {
            tokio::spawn(async {
                if let Err(e) = stop::watch().await {
                    eprintln!("ferry: cannot watch for Ctrl-C and SIGTERM: {e}");
                }
            });
        }
        match cli.command {
            Cmd::Migrate(a) => migrate::run(*a).await,
            Cmd::Migrations(a) => migrations::run(a).await,
            Cmd::Swap(a) => swap_cmd::run(a).await,
            Cmd::Pki(c) => pki_cmd::run(c),
            Cmd::Agent(a) => ferry_agent::run(ferry_agent::AgentConfig::load(&a.config)?)
                .await
                .map(|()| ExitCode::SUCCESS),
            Cmd::Controller(a) => fleet_cmd::controller(a).await,
            Cmd::Fleet(a) => fleet_cmd::fleet(a).await,
            Cmd::Report { timeline, output } => report_svg(&timeline, output),
            #[cfg(feature = "lab")]
            Cmd::Demo(a) => demo::run(a).await,
            #[cfg(feature = "lab")]
            Cmd::Image(ImageCmd::Build { force }) => {
                let (img, rebuilt) =
                    tokio::task::spawn_blocking(move || ferry_lab::image::build(force)).await??;
                println!(
                    "guest image {} (kernel {}): {}",
                    if rebuilt { "built" } else { "up to date" },
                    img.kernel_version,
                    img.kernel
                        .parent()
                        .map_or_else(String::new, |p| p.display().to_string())
                );
                Ok(ExitCode::SUCCESS)
            }
            #[cfg(feature = "lab")]
            Cmd::Lab(c) => lab_cmd::run(c).await,
            #[cfg(feature = "lab")]
            Cmd::Vm(c) => vm_cmd::run(c).await,
            #[cfg(feature = "lab")]
            Cmd::Guest(a) => vm_cmd::guest(a).await,
            #[cfg(feature = "lab")]
            Cmd::Bench(a) => bench::run(a).await,
            Cmd::CostModel(a) => cost_cmd::run(&a),
            Cmd::Simulate(a) => sim_cmd::run(&a),
        }
    });
    stop::wait_if_stopping();
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ferry: {}", report::error_chain(&e));
            exit_code_of(&e)
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_version_line_names_the_protocols_spoken() {
        let wire = format!("wire protocol {}", ferry_wire::frame::WIRE_VERSION);
        let control = format!(
            "control messages {}",
            ferry_agent::engine::control::CONTROL_VERSION
        );
        let timeline = format!("timeline {}", ferry_api::timeline::TIMELINE_VERSION);
        for part in [wire, control, timeline] {
            assert!(
                super::VERSION.contains(&part),
                "{} lacks {part}",
                super::VERSION
            );
        }
    }
}
