//! `ferry pki init | issue HOST`: the fleet's CA and its hosts' certificates.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Subcommand;
use ferry_agent::pki;

#[derive(Subcommand)]
pub enum PkiCmd {
    /// Make the fleet's CA (ca.pem, ca.key) in --dir. Keep ca.key on one trusted machine.
    Init {
        /// Where the CA goes.
        #[arg(long, default_value = pki::DEFAULT_PKI_DIR)]
        dir: PathBuf,
        /// The fleet's name, in the CA's subject.
        #[arg(long, default_value = "ferry")]
        fleet: String,
    },
    /// Issue a certificate and key for HOST (the name its agent's config gives and its peers
    /// know it by), signed by the CA in --dir.
    Issue {
        /// The host's agent name.
        host: String,
        /// Where the CA is; HOST.pem and HOST.key are written there.
        #[arg(long, default_value = pki::DEFAULT_PKI_DIR)]
        dir: PathBuf,
    },
}

pub fn run(cmd: PkiCmd) -> Result<ExitCode> {
    match cmd {
        PkiCmd::Init { dir, fleet } => {
            pki::init(&dir, &fleet)?;
            println!(
                "fleet CA: {} (give it to every host), key {} (keep it here)",
                dir.join("ca.pem").display(),
                dir.join("ca.key").display()
            );
        }
        PkiCmd::Issue { host, dir } => {
            let id = pki::issue(&dir, &host)?;
            println!(
                "{host}: certificate {}, key {}; copy them and {} to the host's [tls] section",
                id.cert.display(),
                id.key.display(),
                id.ca.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
