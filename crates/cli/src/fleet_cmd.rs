//! `ferry controller` (the fleet's service) and `ferry fleet ...` (its API from the command
//! line: the fleet's sites, hosts, VMs and migrations; migrate, watch, cancel).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferry_api::fleet::{
    FleetGroup, FleetGroupRequest, FleetMigration, FleetMigrationRequest, FleetMigrationState,
    GroupState,
};
use ferry_controller::client::{ControllerClient, Endpoint};

use crate::report;
use crate::settings_flags::SettingsFlags;

#[derive(Args)]
pub struct ControllerArgs {
    /// The controller's config file (TOML: name, listen address, database, certificates,
    /// operators; contrib/controller.toml is a commented example).
    #[arg(long, default_value = ferry_controller::config::DEFAULT_CONFIG)]
    config: PathBuf,
}

pub async fn controller(a: ControllerArgs) -> Result<ExitCode> {
    let config = ferry_controller::config::ControllerConfig::load(&a.config)?;
    ferry_controller::serve::run(config).await?;
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct FleetArgs {
    /// The controller: its local socket, or `host:port` of its TLS listener (then with
    /// --controller-name and --as).
    #[arg(long, env = "FERRY_CONTROLLER", default_value = ferry_controller::config::DEFAULT_API_SOCKET)]
    controller: String,
    /// Over TLS: the name the controller's certificate carries.
    #[arg(long)]
    controller_name: Option<String>,
    /// Over TLS: the operator certificate to present (`NAME.pem` and `NAME.key` in --pki-dir).
    #[arg(long = "as", value_name = "NAME")]
    identity: Option<String>,
    /// Over TLS: where the fleet's CA and the operator's certificate are.
    #[arg(long, default_value = "/etc/ferry/pki")]
    pki_dir: PathBuf,
    #[command(subcommand)]
    command: FleetCmd,
}

#[derive(Subcommand)]
enum FleetCmd {
    /// The controller: its name, its store, which controller leads.
    Status(ListArgs),
    /// The sites, with their hosts up and VMs.
    Sites(ListArgs),
    /// The hosts (agents), up or down, with their peers.
    Hosts(ListArgs),
    /// The VMs and where they run.
    Vms(ListArgs),
    /// The virtual cloud pools: each tenant's layer-2 segment and the hosts it spans now.
    Pools(ListArgs),
    /// Create, delete, hold or release a pool.
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Every migration the controller knows.
    Migrations(ListArgs),
    /// Move a VM of the fleet to a host, or to a site (the controller picks the host); with
    /// --group, several VMs that arrive together.
    Migrate(Box<MigrateArgs>),
    /// The groups of migrations that arrive together.
    Groups(ListArgs),
    /// What the planner would do now (spread VMs off hosts over capacity, empty hosts the
    /// fleet does not need; docs/policies.md); --apply carries it out.
    Plan {
        #[command(flatten)]
        list: ListArgs,
        /// Carry the plan out: its moves become migrations (and groups).
        #[arg(long)]
        apply: bool,
    },
    /// The cost model moves are priced with, per kind of VM: built-in figures until the fleet
    /// has enough committed migrations of its own, then fitted to them, with the error on the
    /// migrations each fit did not see.
    CostModel(ListArgs),
    /// Follow a migration until it ends (exit 0 committed, 3 failed).
    Watch { id: String },
    /// Cancel a migration (one not yet started ends at once; a running one is cancelled by
    /// its source agent).
    Cancel { id: String },
}

#[derive(Subcommand)]
enum PoolCmd {
    /// A new pool: its VMs plug into bridge `fp<VNI>` (or --bridge) on any host.
    Create {
        name: String,
        /// Its VXLAN network identifier (1 to 16777215), unique in the fleet.
        #[arg(long)]
        vni: u32,
        /// The bridge its VMs plug into (default fp<VNI>).
        #[arg(long)]
        bridge: Option<String>,
        /// A plain learning VXLAN, without the controller's MAC directory and re-pointing at
        /// switchover (what a moved VM's ARP announcement alone achieves).
        #[arg(long)]
        learning: bool,
        /// The controller's directory without the agents' re-pointing at switchover (it follows
        /// when the controller learns of the commit): for comparison.
        #[arg(long, conflicts_with = "learning")]
        no_repoint: bool,
        /// Keep its endpoint up on these hosts (to start its first VMs there).
        #[arg(long, value_delimiter = ',')]
        hold: Vec<String>,
    },
    /// Delete a pool that has no VMs.
    Delete { name: String },
    /// Keep a pool's endpoint up on a host whether or not its VMs run there.
    Hold { name: String, host: String },
    /// Stop keeping it: the endpoint stays only while the pool's VMs need it.
    Release { name: String, host: String },
}

#[derive(Args)]
struct ListArgs {
    /// Print JSON, as the API answers.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct MigrateArgs {
    /// The VM, or with --group the group's VMs.
    #[arg(required = true)]
    vms: Vec<String>,
    /// Move the VMs together (a web tier and its database): their memory passes end together
    /// and all resume at the destination within a short window, or none does.
    #[arg(long)]
    group: bool,
    /// The destination host.
    #[arg(long, conflicts_with = "to_site", required_unless_present = "to_site")]
    to: Option<String>,
    /// The destination site (the controller chooses a host there).
    #[arg(long)]
    to_site: Option<String>,
    /// Copy the VM's disks too (no shared storage).
    #[arg(long)]
    copy_storage: bool,
    /// Return once the controller accepted it, without following it.
    #[arg(long)]
    no_wait: bool,
    #[command(flatten)]
    settings: SettingsFlags,
}

impl FleetArgs {
    fn client(&self) -> Result<ControllerClient> {
        let tls = !self.controller.starts_with('/') && self.controller.contains(':');
        if !tls {
            return Ok(ControllerClient::new(Endpoint::Local(PathBuf::from(
                &self.controller,
            ))));
        }
        let (Some(server_name), Some(identity)) = (&self.controller_name, &self.identity) else {
            bail!("--controller {} is a TLS address: give --controller-name (its certificate's name) and --as (your operator certificate's name)", self.controller);
        };
        let id = ferry_agent::pki::identity(&self.pki_dir, identity);
        Ok(ControllerClient::new(Endpoint::Tls {
            address: self.controller.clone(),
            server_name: server_name.clone(),
            tls: id.client_config()?,
        }))
    }
}

pub async fn fleet(a: FleetArgs) -> Result<ExitCode> {
    let client = a.client()?;
    match a.command {
        FleetCmd::Status(l) => {
            let h = client.health().await?;
            print(l.json, &h, || {
                println!(
                    "controller {} (ferry {}), store {}, leader {}",
                    h.name,
                    h.version,
                    h.store,
                    h.leader.as_deref().unwrap_or("none (no lease held)")
                );
            })
        }
        FleetCmd::Sites(l) => {
            let sites = client.sites().await?;
            print(l.json, &sites, || {
                for s in &sites {
                    println!(
                        "{:<20} hosts {} ({} up)  VMs {}",
                        s.name, s.hosts, s.hosts_up, s.vms
                    );
                }
            })
        }
        FleetCmd::Hosts(l) => {
            let hosts = client.hosts().await?;
            print(l.json, &hosts, || {
                for h in &hosts {
                    println!(
                        "{:<20} {:<12} {:<5} VMs {:<3} peers {}",
                        h.name,
                        h.site,
                        match h.state {
                            ferry_api::fleet::HostState::Up => "up",
                            ferry_api::fleet::HostState::Down => "down",
                        },
                        h.vms,
                        h.peers.join(",")
                    );
                }
            })
        }
        FleetCmd::Vms(l) => {
            let vms = client.vms().await?;
            print(l.json, &vms, || {
                for v in &vms {
                    println!(
                        "{:<20} {:<8} {:<20} {:<12} {}",
                        v.name,
                        v.kind.name(),
                        v.host,
                        v.site,
                        v.state
                    );
                }
            })
        }
        FleetCmd::Pools(l) => {
            let pools = client.pools().await?;
            print(l.json, &pools, || {
                if pools.is_empty() {
                    println!("no pools");
                }
                for p in &pools {
                    println!("{}", pool_line(p));
                }
            })
        }
        FleetCmd::Pool(cmd) => {
            let pool = match cmd {
                PoolCmd::Create {
                    name,
                    vni,
                    bridge,
                    learning,
                    no_repoint,
                    hold,
                } => {
                    let req = ferry_api::fleet::PoolRequest {
                        name,
                        vni,
                        bridge,
                        learning,
                        no_repoint,
                        hold,
                    };
                    client.create_pool(&req).await?
                }
                PoolCmd::Delete { name } => client.delete_pool(&name).await?,
                PoolCmd::Hold { name, host } => client.hold(&name, &host, true).await?,
                PoolCmd::Release { name, host } => client.hold(&name, &host, false).await?,
            };
            println!("{}", pool_line(&pool));
            Ok(ExitCode::SUCCESS)
        }
        FleetCmd::Migrations(l) => {
            let all = client.migrations().await?;
            print(l.json, &all, || {
                if all.is_empty() {
                    println!("no migrations");
                }
                for m in &all {
                    println!("{}", line(m));
                }
            })
        }
        FleetCmd::Groups(l) => {
            let all = client.groups().await?;
            print(l.json, &all, || {
                if all.is_empty() {
                    println!("no groups");
                }
                for g in &all {
                    println!("{}", group_line(g));
                }
            })
        }
        FleetCmd::Migrate(m) if m.group => {
            let req = FleetGroupRequest {
                vms: m.vms.clone(),
                to: m.to.clone(),
                to_site: m.to_site.clone(),
                copy_storage: m.copy_storage,
                settings: m.settings.settings()?,
            };
            let created = client.migrate_group(&req).await?;
            println!("{}", group_line(&created));
            if m.no_wait {
                return Ok(ExitCode::SUCCESS);
            }
            watch_group(&client, &created.id).await
        }
        FleetCmd::Migrate(m) => {
            let [vm] = &m.vms[..] else {
                bail!(
                    "{} VMs named: give --group to move them together, or one VM",
                    m.vms.len()
                );
            };
            let req = FleetMigrationRequest {
                vm: vm.clone(),
                to: m.to.clone(),
                to_site: m.to_site.clone(),
                copy_storage: m.copy_storage,
                settings: m.settings.settings()?,
            };
            let created = client.migrate(&req).await?;
            println!("{}", line(&created));
            if m.no_wait {
                return Ok(ExitCode::SUCCESS);
            }
            watch(&client, &created.id).await
        }
        FleetCmd::Plan { list, apply } => {
            let plan = if apply {
                client.apply_plan().await?
            } else {
                client.plan().await?
            };
            if list.json {
                println!("{}", serde_json::to_string_pretty(&plan)?);
            } else {
                print_plan(&plan);
            }
            Ok(ExitCode::SUCCESS)
        }
        FleetCmd::CostModel(l) => {
            let models = client.cost_model().await?;
            print(l.json, &models, || print_cost_model(&models))
        }
        FleetCmd::Watch { id } => watch(&client, &id).await,
        FleetCmd::Cancel { id } => {
            println!("{}", line(&client.cancel(&id).await?));
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn print<T: serde::Serialize>(json: bool, value: &T, text: impl FnOnce()) -> Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string(value)?);
    } else {
        text();
    }
    Ok(ExitCode::SUCCESS)
}

/// One pool in a line: name, VNI, bridge, mode, and its endpoints with their VMs.
fn pool_line(p: &ferry_api::fleet::Pool) -> String {
    let endpoints: Vec<String> = p
        .endpoints
        .iter()
        .map(|e| {
            format!(
                "{}{}[{}]",
                e.host,
                if e.ready { "" } else { " (coming up)" },
                e.vms.join(",")
            )
        })
        .collect();
    format!(
        "{:<16} VNI {:<8} bridge {:<15} {:<9} {}",
        p.name,
        p.vni,
        p.bridge,
        match (p.learning, p.repoint) {
            (true, _) => "learning",
            (false, true) => "repointed",
            (false, false) => "directory",
        },
        if endpoints.is_empty() {
            "no endpoints".into()
        } else {
            endpoints.join(" ")
        }
    )
}

/// One migration in a line: id, VM, hosts, state, the agent's phase and bytes, the error.
fn line(m: &FleetMigration) -> String {
    let progress = m.agent.as_ref().map_or_else(String::new, |a| {
        format!(
            " | {}, {} on the wire",
            a.phase.name(),
            report::bytes(a.wire.bytes_out + a.wire.bytes_in)
        )
    });
    format!(
        "{}  {:<16} {} -> {}  {}{progress}{}",
        m.id,
        m.vm,
        m.source_host,
        m.destination_host,
        m.state.name(),
        m.error
            .as_ref()
            .map_or_else(String::new, |e| format!(": {e}"))
    )
}

/// One group in a line: id, state, its VMs, the resume window once known, why it aborted.
fn group_line(g: &FleetGroup) -> String {
    let vms: Vec<&str> = g.members.iter().map(|m| m.vm.as_str()).collect();
    format!(
        "{}  {:<9} {}{}{}",
        g.id,
        g.state.name(),
        vms.join(", "),
        g.resume_window_ms
            .map_or_else(String::new, |ms| format!(" | resumed within {ms} ms")),
        g.reason
            .as_ref()
            .filter(|_| g.state == GroupState::Aborted)
            .map_or_else(String::new, |r| format!(": {r}"))
    )
}

/// Prints each member's line whenever it changes, until every member ended; then the
/// group's line. Exit 0 when all committed, 3 otherwise.
async fn watch_group(client: &ControllerClient, id: &str) -> Result<ExitCode> {
    let mut last: Vec<String> = Vec::new();
    loop {
        let g = client
            .group(id)
            .await
            .with_context(|| format!("following group {id}"))?;
        let now: Vec<String> = g.members.iter().map(line).collect();
        for (i, l) in now.iter().enumerate() {
            if last.get(i) != Some(l) {
                println!("{l}");
            }
        }
        last = now;
        if g.state != GroupState::Open && g.members.iter().all(|m| m.state.finished()) {
            println!("{}", group_line(&g));
            let all = g
                .members
                .iter()
                .all(|m| m.state == FleetMigrationState::Committed);
            return Ok(if all {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(crate::EXIT_MIGRATION_FAILED)
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Prints the migration's line whenever it changes, until it ends.
async fn watch(client: &ControllerClient, id: &str) -> Result<ExitCode> {
    let mut last = String::new();
    loop {
        let m = client
            .migration(id)
            .await
            .with_context(|| format!("following migration {id}"))?;
        let now = line(&m);
        if now != last {
            println!("{now}");
            last = now;
        }
        match m.state {
            FleetMigrationState::Committed => return Ok(ExitCode::SUCCESS),
            FleetMigrationState::Failed => return Ok(ExitCode::from(crate::EXIT_MIGRATION_FAILED)),
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

fn print_cost_model(models: &[ferry_api::fleet::FleetCostModel]) {
    for m in models {
        match (m.fitted_samples, &m.error) {
            (Some(fitted), Some(e)) => println!(
                "{}: fitted to {fitted} of its migrations ({} now); median error on unseen ones ({}-fold): total time {:.1}%, WAN bytes {:.1}%, pause {}",
                m.kind,
                m.samples,
                e.folds,
                e.total * 100.0,
                e.wan_bytes * 100.0,
                e.pause.map_or_else(|| "-".into(), |p| format!("{:.1}%", p * 100.0))
            ),
            _ => println!(
                "{}: built-in figures ({} committed migrations with figures, {} needed to fit)",
                m.kind, m.samples, m.samples_needed
            ),
        }
        // The most recent few; --json has them all.
        const SHOWN: usize = 10;
        for l in m.left_out.iter().rev().take(SHOWN) {
            println!("  left out {}: {}", l.name, l.why);
        }
        if m.left_out.len() > SHOWN {
            println!(
                "  ... and {} more left out (--json lists them)",
                m.left_out.len() - SHOWN
            );
        }
    }
}

fn print_plan(plan: &ferry_api::fleet::FleetPlan) {
    if let Some(quiet) = &plan.quiet {
        println!("nothing to move: {quiet}");
    }
    if !plan.moves.is_empty() {
        println!("moves, cheapest first (the cost model's predictions):");
        for m in &plan.moves {
            println!(
                "  {:<24} {} -> {}  {:<11}  ~{:.1} s, {} over the WAN, pause ~{} ms",
                m.vms.join(","),
                m.from,
                m.to,
                m.reason,
                m.predicted_s,
                report::bytes(m.predicted_wan_bytes),
                m.predicted_pause_ms
            );
        }
    }
    for (what, hosts) in [
        ("hosts to empty (they take no VMs)", &plan.drain),
        ("hosts empty (they may be stopped)", &plan.empty),
        ("hosts kept on (what is left fits nowhere else)", &plan.keep),
    ] {
        if !hosts.is_empty() {
            println!("{what}: {}", hosts.join(", "));
        }
    }
    for u in &plan.unplanned {
        println!("left out: {}: {}", u.name, u.why);
    }
    if !plan.requested.is_empty() {
        println!("requested: {}", plan.requested.join(", "));
    }
    for u in &plan.refused {
        println!("refused: {}: {}", u.name, u.why);
    }
}
