//! `ferry swap`: a libvirt domain's swap on a peer's spare memory (Overdriver's cooperative
//! swap, docs/policies.md), through this host's agent.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use ferry_agent::client::AgentClient;
use ferry_api::agent::{SwapRequest, SwapStatus};

#[derive(Args)]
pub struct SwapArgs {
    #[command(subcommand)]
    command: SwapCmd,
    /// This host's agent: its API socket (default: `api_socket` of /etc/ferry/agent.toml, or
    /// /run/ferry/agent.sock).
    #[arg(long, global = true, env = "FERRY_AGENT", value_name = "SOCKET")]
    agent: Option<PathBuf>,
    /// Print the agent's answer as JSON.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand)]
enum SwapCmd {
    /// Give DOMAIN swap in a peer's memory, then let its balloon leave it --keep-mib (the
    /// guest needs qemu-guest-agent; the peer agent lends memory by `[host] lend_mib`).
    On {
        domain: String,
        /// The peer agent whose memory holds the swap.
        #[arg(long)]
        peer: String,
        /// The swap's size, MiB.
        #[arg(long)]
        mib: u64,
        /// The memory the balloon leaves the guest meanwhile, MiB.
        #[arg(long)]
        keep_mib: u64,
    },
    /// Give DOMAIN its memory back and its swap up (waits while the guest pages back in).
    Off { domain: String },
    /// The domains with swap on a peer.
    List,
}

pub async fn run(a: SwapArgs) -> Result<ExitCode> {
    let agent = AgentClient::new(crate::migrate::agent_socket(a.agent.as_deref()));
    let shown: Vec<SwapStatus> = match a.command {
        SwapCmd::On {
            domain,
            peer,
            mib,
            keep_mib,
        } => {
            let req = SwapRequest {
                peer,
                bytes: mib.saturating_mul(1 << 20),
                memory_bytes: keep_mib.saturating_mul(1 << 20),
            };
            vec![agent.take_swap(&domain, &req).await?]
        }
        SwapCmd::Off { domain } => vec![agent.give_swap_back(&domain).await?],
        SwapCmd::List => agent.swaps().await.context("this host's agent")?,
    };
    if a.json {
        println!("{}", serde_json::to_string(&shown)?);
    } else if shown.is_empty() {
        println!("no domain swaps to a peer");
    }
    for s in shown.iter().filter(|_| !a.json) {
        println!(
            "{}  {} MiB of swap at {} ({}), memory {} of {} MiB",
            s.domain,
            s.bytes >> 20,
            s.peer,
            s.target,
            s.memory_bytes >> 20,
            s.memory_before_bytes >> 20
        );
    }
    Ok(ExitCode::SUCCESS)
}
