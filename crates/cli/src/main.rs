//! `ferry`: live migration of QEMU VMs across wide-area links.
//!
//! Exit codes (stable, see docs/cli.md): 0 success; 1 the command failed (the message says
//! why); 2 bad usage; 3 a migration did not complete or the guest's verifier found errors.

mod bench;
mod demo;
mod lab_cmd;
mod migrate;
mod plot;
mod report;
mod settings_flags;
mod vm_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit code when a migration did not complete or verification failed.
pub const EXIT_MIGRATION_FAILED: u8 = 3;

#[derive(Parser)]
#[command(name = "ferry", version = concat!(env!("CARGO_PKG_VERSION"), " (lab protocol: guest serial v1; QEMU >= 10)"))]
#[command(about = "Live migration of QEMU VMs across wide-area links")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the demo: a live migration across an emulated 100 Mbit/s, 50 ms WAN.
    Demo(demo::DemoArgs),
    /// The guest image.
    #[command(subcommand)]
    Image(ImageCmd),
    /// The two-site lab: namespaces, WAN emulator, bridges.
    #[command(subcommand)]
    Lab(lab_cmd::LabCmd),
    /// The lab's VMs.
    #[command(subcommand)]
    Vm(vm_cmd::VmCmd),
    /// Send one command to a VM's guest agent and print its reply (e.g. `mem verify`).
    Guest(vm_cmd::GuestArgs),
    /// Migrate a VM to another site.
    Migrate(migrate::MigrateArgs),
    /// Run this host's agent: the local API for the CLI and the endpoint for peer agents.
    Agent(AgentArgs),
    /// Run benchmark scenarios and print one JSON object per migration.
    Bench(bench::BenchArgs),
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
    /// This agent's name; its certificate must carry it (the lab's are `site-a`, `site-b`).
    #[arg(long)]
    name: String,
    /// Where peer agents connect (host:port).
    #[arg(long)]
    listen: String,
    /// The local API's unix socket.
    #[arg(long)]
    api: std::path::PathBuf,
    /// Directory for the sockets to and from QEMU.
    #[arg(long)]
    work_dir: std::path::PathBuf,
    /// Where memory images of VMs that left this host are kept for their return (default:
    /// `seeds` in the work directory).
    #[arg(long)]
    seed_dir: Option<std::path::PathBuf>,
    /// The fleet CA (PEM): peers must present a certificate it signed.
    #[arg(long)]
    ca: std::path::PathBuf,
    /// This agent's certificate (PEM).
    #[arg(long)]
    cert: std::path::PathBuf,
    /// This agent's private key (PEM).
    #[arg(long)]
    key: std::path::PathBuf,
}

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
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let result = rt.block_on(async {
        tokio::spawn(async {
            while tokio::signal::ctrl_c().await.is_ok() {
                if ferry_lab::interrupt::request() {
                    eprintln!("\nferry: interrupted; cancelling the migration (the source VM keeps running)");
                } else {
                    std::process::exit(130);
                }
            }
        });
        match cli.command {
            Cmd::Demo(a) => demo::run(a).await,
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
            Cmd::Lab(c) => lab_cmd::run(c).await,
            Cmd::Vm(c) => vm_cmd::run(c).await,
            Cmd::Guest(a) => vm_cmd::guest(a).await,
            Cmd::Migrate(a) => migrate::run(a).await,
            Cmd::Bench(a) => bench::run(a).await,
            Cmd::Agent(a) => ferry_agent::run(ferry_agent::AgentConfig {
                name: a.name,
                listen: a.listen,
                api_socket: a.api,
                seed_dir: a.seed_dir.unwrap_or_else(|| a.work_dir.join("seeds")),
                work_dir: a.work_dir,
                identity: ferry_wire::tls::Identity { ca: a.ca, cert: a.cert, key: a.key },
            })
            .await
            .map(|()| ExitCode::SUCCESS),
            Cmd::Report { timeline, output } => report_svg(&timeline, output),
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ferry: {}", report::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
