//! `ferry lab up | down | status | set | outage | check | relay`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferry_lab::wan::{self, ControlRequest};
use ferry_lab::{sh, Lab, LinkConfig, Site};

/// The emulated link, as flags.
#[derive(Args, Debug, Clone)]
pub struct LinkArgs {
    /// Bottleneck rate, Mbit/s.
    #[arg(long, default_value_t = 100.0)]
    pub rate_mbit: f64,
    /// Round-trip time, ms.
    #[arg(long, default_value_t = 50.0)]
    pub rtt_ms: f64,
    /// Extra random one-way delay, up to this many ms.
    #[arg(long, default_value_t = 0.0)]
    pub jitter_ms: f64,
    /// Random frame loss, percent.
    #[arg(long, default_value_t = 0.0)]
    pub loss_pct: f64,
    /// The sites' hosts' default TCP congestion control (cubic: stock Linux), which QEMU's own
    /// migrations use; ferry's agents ask for BBR on their connections. Default: this machine's.
    #[arg(long)]
    pub host_congestion: Option<ferry_lab::link::Congestion>,
    /// Coalesce the frames each site receives from the WAN (GRO), as a data center host's NIC
    /// does. Off by default: every frame reaches TCP on its own.
    #[arg(long)]
    pub receive_gro: bool,
    /// The sites' hosts autotune a TCP connection's receive buffer up to this many MiB
    /// (`net.ipv4.tcp_rmem`'s maximum), as older kernels do (6). Default: this machine's.
    #[arg(long)]
    pub host_tcp_rmem_max_mib: Option<u32>,
    /// Run the sites' agents without CAP_NET_ADMIN, as agents not run as root: their socket
    /// buffers stop at the hosts' limits.
    #[arg(long)]
    pub agents_without_net_admin: bool,
}

impl LinkArgs {
    pub fn config(&self) -> LinkConfig {
        LinkConfig {
            rate_mbit: self.rate_mbit,
            rtt_ms: self.rtt_ms,
            jitter_ms: self.jitter_ms,
            loss_pct: self.loss_pct,
            host_congestion: self.host_congestion,
            receive_gro: self.receive_gro,
            host_tcp_rmem_max_mib: self.host_tcp_rmem_max_mib,
            agents_without_net_admin: self.agents_without_net_admin,
        }
    }
}

#[derive(Subcommand)]
pub enum LabCmd {
    /// Create the sites, the WAN emulator between them and the bridges joined by VXLAN.
    Up {
        #[command(flatten)]
        link: LinkArgs,
        /// Also run libvirt at each site (its own libvirtd, as on two hosts).
        #[arg(long)]
        libvirt: bool,
        /// Also run the fleet controller at site a, both agents heartbeating to it
        /// (`ferry fleet --controller <lab dir>/controller-a.sock ...`).
        #[arg(long)]
        controller: bool,
        /// With --controller: PostgreSQL at site a and a controller at each site sharing it
        /// (one leads at a time).
        #[arg(long, requires = "controller")]
        postgres: bool,
        /// With --controller: each host offers VMs this much memory (MiB; else 1024) and the
        /// controller meets memory overload: swap on the peer's memory, a migration when it
        /// lasts (`[policy] overload`, sampled every 3 s).
        #[arg(long, requires = "controller", value_parser = clap::value_parser!(u32).range(64..=1048576))]
        overload_mib: Option<u32>,
    },
    /// Remove everything `lab up` made, with every VM in it.
    Down,
    /// Show the lab, its link, counters and VMs.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Change the link while the lab runs.
    Set(LinkArgs),
    /// Cut the WAN (`down`), restore it (`up`), or make it forget its connections (`reset`:
    /// every TCP connection between the sites is aborted at both ends, as when a stateful
    /// firewall or NAT on the path loses its state).
    Outage {
        #[arg(value_parser = ["down", "up", "reset"])]
        state: String,
    },
    /// Measure RTT and throughput through the WAN and compare them with the configured link.
    Check {
        /// Seconds of iperf3 traffic.
        #[arg(long, default_value_t = 5)]
        seconds: u32,
        #[arg(long)]
        json: bool,
    },
    /// Follow a VM's TCP sequence server from a site for some seconds and report what arrived.
    Tcpseq {
        vm: String,
        /// Site the client runs at.
        #[arg(long, default_value = "a")]
        from: String,
        #[arg(long, default_value_t = 10)]
        seconds: u64,
    },
    /// Run the WAN relay in this namespace (started by `lab up`).
    #[command(hide = true)]
    Relay {
        #[arg(long)]
        if_a: String,
        #[arg(long)]
        if_b: String,
        #[command(flatten)]
        link: LinkArgs,
        #[arg(long)]
        control: PathBuf,
    },
}

pub async fn run(cmd: LabCmd) -> Result<ExitCode> {
    let lab = Lab::from_env();
    match cmd {
        LabCmd::Up {
            link,
            libvirt,
            controller,
            postgres,
            overload_mib,
        } => {
            let exe = std::env::current_exe().context("locate the ferry binary")?;
            let cfg = link.config();
            if libvirt && !ferry_lab::libvirt::installed() {
                bail!("--libvirt: libvirt is not installed (scripts/setup.sh installs it)");
            }
            let state = tokio::task::spawn_blocking({
                let lab = lab.clone();
                move || {
                    lab.up(
                        cfg,
                        &exe,
                        ferry_lab::Services {
                            libvirt,
                            controller,
                            postgres,
                            overload_mib,
                            overload_migrate_only: false,
                        },
                    )
                }
            })
            .await??;
            println!(
                "lab {:?} up: sites a, b; WAN {} Mbit/s, {} ms RTT, jitter {} ms, loss {}%",
                state.name,
                state.link.rate_mbit,
                state.link.rtt_ms,
                state.link.jitter_ms,
                state.link.loss_pct
            );
            let services = ferry_lab::Services {
                libvirt,
                controller,
                postgres,
                overload_mib,
                overload_migrate_only: false,
            };
            for site in services.controller_sites() {
                println!(
                    "fleet controller at site {}: ferry fleet --controller {} hosts",
                    site.name(),
                    ferry_lab::controller::socket(&lab, site).display()
                );
            }
            if libvirt {
                for site in Site::ALL {
                    println!(
                        "libvirt at site {}: {}",
                        site.name(),
                        ferry_lab::libvirt::uri(&lab, site)
                    );
                }
            }
        }
        LabCmd::Down => {
            let name = lab.name.clone();
            tokio::task::spawn_blocking(move || lab.down(false)).await??;
            println!("lab {name:?} down");
        }
        LabCmd::Status { json } => status(&lab, json)?,
        LabCmd::Set(link) => {
            lab.state()?;
            if link.host_congestion.is_some()
                || link.receive_gro
                || link.host_tcp_rmem_max_mib.is_some()
                || link.agents_without_net_admin
            {
                bail!("--host-congestion, --receive-gro, --host-tcp-rmem-max-mib and --agents-without-net-admin are set when the lab comes up (`ferry lab up`); `lab set` changes the rate, delay, jitter and loss");
            }
            let cfg = link.config();
            cfg.validate()?;
            wan::control(&lab.wan_socket(), &ControlRequest::Set { link: cfg })?;
            lab.record_link(cfg)?;
            println!(
                "WAN now {} Mbit/s, {} ms RTT, jitter {} ms, loss {}%",
                cfg.rate_mbit, cfg.rtt_ms, cfg.jitter_ms, cfg.loss_pct
            );
        }
        LabCmd::Outage { state } if state == "reset" => {
            let aborted = lab.reset_wan_connections()?;
            println!("WAN reset: {aborted} TCP connections between the sites aborted");
        }
        LabCmd::Outage { state } => {
            let req = if state == "down" {
                ControlRequest::Down
            } else {
                ControlRequest::Up
            };
            wan::control(&lab.wan_socket(), &req)?;
            println!("WAN {state}");
        }
        LabCmd::Check { seconds, json } => {
            let r = tokio::task::spawn_blocking(move || check(&lab, seconds)).await??;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "RTT {:.1} ms (configured {:.1}); throughput {:.1} Mbit/s (configured {:.1})",
                    r.rtt_ms, r.configured.rtt_ms, r.throughput_mbit, r.configured.rate_mbit
                );
            }
        }
        LabCmd::Tcpseq { vm, from, seconds } => {
            let rec = ferry_lab::vm::load(&lab, &vm)?;
            let ns = lab.site_ns(Site::parse(&from)?);
            let client = ferry_lab::tcpseq::TcpSeqClient::connect(
                &ns,
                &format!("{}:7000", rec.guest_ip),
                std::time::Duration::from_secs(10),
            )?;
            for _ in 0..seconds {
                std::thread::sleep(std::time::Duration::from_secs(1));
                println!("{}", serde_json::to_string(&client.stats())?);
            }
        }
        LabCmd::Relay {
            if_a,
            if_b,
            link,
            control,
        } => {
            wan::run_relay(&if_a, &if_b, link.config(), &control)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn status(lab: &Lab, json: bool) -> Result<()> {
    let state = lab.state()?;
    let stats = wan::stats(&lab.wan_socket())?;
    let vms = ferry_lab::vm::list(lab)?;
    if json {
        let v = serde_json::json!({ "lab": state, "wan": stats, "vms": vms });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "lab {:?}: namespaces {}, {}, {}",
        lab.name,
        lab.site_ns(Site::A),
        lab.wan_ns(),
        lab.site_ns(Site::B)
    );
    println!(
        "WAN: {} Mbit/s, {} ms RTT, jitter {} ms, loss {}%{}",
        stats.link.rate_mbit,
        stats.link.rtt_ms,
        stats.link.jitter_ms,
        stats.link.loss_pct,
        if stats.down { " (OUTAGE)" } else { "" }
    );
    for (dir, d) in [("a->b", stats.a_to_b), ("b->a", stats.b_to_a)] {
        println!(
            "  {dir}: {} bytes, {} frames, dropped {} (loss) {} (queue) {} (outage)",
            d.bytes, d.frames, d.dropped_loss, d.dropped_queue, d.dropped_down
        );
    }
    if vms.is_empty() {
        println!("VMs: none");
    }
    for v in vms {
        println!(
            "VM {} at site {}: {} MiB, guest {}, pid {}",
            v.name,
            v.site.name(),
            v.spec.mem_mib,
            v.guest_ip,
            v.pid
        );
    }
    Ok(())
}

/// Measured link figures.
#[derive(serde::Serialize)]
pub struct CheckResult {
    pub rtt_ms: f64,
    pub throughput_mbit: f64,
    pub configured: LinkConfig,
}

/// Pings site B's underlay from site A and runs iperf3 from A to B.
pub fn check(lab: &Lab, seconds: u32) -> Result<CheckResult> {
    let state = lab.state()?;
    let (a, b) = (lab.site_ns(Site::A), lab.site_ns(Site::B));
    let ping = sh::run_in(
        &a,
        "busybox",
        &["ping", "-c", "5", "-i", "0.2", Site::B.underlay_ip()],
    )?;
    // busybox: "round-trip min/avg/max = 50.3/50.4/50.6 ms"
    let rtt_ms = ping
        .lines()
        .find_map(|l| l.split(" = ").nth(1))
        .and_then(|v| v.split('/').nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .with_context(|| format!("cannot read the RTT from ping's output: {ping}"))?;
    let server = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &b,
            "iperf3",
            "-s",
            "-1",
            "-B",
            Site::B.underlay_ip(),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("start iperf3 server")?;
    let mut server = KillOnDrop(server);
    let mut out = String::new();
    for _ in 0..50 {
        match sh::run_in(
            &a,
            "iperf3",
            &[
                "-c",
                Site::B.underlay_ip(),
                "-t",
                &seconds.to_string(),
                "-J",
            ],
        ) {
            Ok(o) => {
                out = o;
                break;
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
    let _ = server.0.wait();
    if out.is_empty() {
        bail!("iperf3 could not connect through the WAN");
    }
    let v: serde_json::Value = serde_json::from_str(&out).context("iperf3 -J output")?;
    let bps = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 reported no received rate")?;
    Ok(CheckResult {
        rtt_ms,
        throughput_mbit: bps / 1e6,
        configured: state.link,
    })
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
