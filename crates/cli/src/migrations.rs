//! `ferry migrations`: what this host's agent sent, one line each (or JSON).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;
use ferry_agent::client::AgentClient;
use ferry_api::agent::MigrationState;

use crate::report;

#[derive(Args)]
pub struct MigrationsArgs {
    /// This host's agent: its API socket (default: `api_socket` of /etc/ferry/agent.toml, or
    /// /run/ferry/agent.sock).
    #[arg(long, env = "FERRY_AGENT", value_name = "SOCKET")]
    agent: Option<PathBuf>,
    /// Print the agent's statuses as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: MigrationsArgs) -> Result<ExitCode> {
    let agent = AgentClient::new(crate::migrate::agent_socket(a.agent.as_deref()));
    let all = agent.migrations().await.context("this host's agent")?;
    if a.json {
        println!("{}", serde_json::to_string(&all)?);
        return Ok(ExitCode::SUCCESS);
    }
    if all.is_empty() {
        println!("no migrations");
    }
    for m in &all {
        let state = match m.state {
            MigrationState::Running => "running",
            MigrationState::Committed => "committed",
            MigrationState::Failed => "failed",
        };
        let downtime = m
            .source_stop_unix_us
            .zip(m.destination_resume_unix_us.filter(|r| *r > 0))
            .map_or_else(String::new, |(s, r)| {
                format!(", downtime {} ms", (r - s) / 1000)
            });
        println!(
            "{}  {:<16} {:<10} {}, {} on the wire{downtime}{}",
            m.id,
            m.vm,
            state,
            m.phase.name(),
            report::bytes(m.wire.bytes_out + m.wire.bytes_in),
            m.error
                .as_ref()
                .map_or_else(String::new, |e| format!(": {e}"))
        );
    }
    Ok(ExitCode::SUCCESS)
}
