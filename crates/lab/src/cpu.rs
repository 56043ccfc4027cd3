//! What a migration costs the hosts' CPUs: the CPU time of the source and destination QEMUs
//! and of the sites' agents while it runs, from `/proc/<pid>/stat` (every thread, user and
//! system time).
//!
//! The processes are looked up and read every [`EVERY`], because the source QEMU exits at the
//! commit and the destination QEMU starts during the migration: a process's figure is its last
//! reading less its first (a destination QEMU counts from its start, which the migration
//! caused). What a source QEMU spends in its last interval before it exits is missed.
//!
//! For the agents it also counts what their work is cut into: voluntary context switches
//! (`/proc/<pid>/task/*/status`; each is a thread that went to sleep waiting for something;
//! threads that end during the migration take theirs with them), the read and write system
//! calls `/proc/<pid>/io` counts (`syscr`, `syscw`: read, write and their vector forms, so the
//! TLS writes to the WAN, the writes to QEMU's socket and eventfd wake-ups, but not the
//! `recv` and `send` with which the standard library reads sockets) and minor page faults
//! (`/proc/<pid>/stat`, every thread's: memory touched for the first time). A role's figures
//! are summed over its processes (the destination agent's forked monitor keeper shares its
//! command line).

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use serde::Serialize;

use crate::agents;
use crate::topology::{Lab, Site};

const EVERY: Duration = Duration::from_millis(100);

/// CPU seconds spent during one migration.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct MigrationCpu {
    pub source_qemu_s: f64,
    pub destination_qemu_s: f64,
    pub source_agent_s: f64,
    pub destination_agent_s: f64,
    /// Per agent: voluntary context switches, read and write system calls (those
    /// `/proc/<pid>/io` counts), minor page faults.
    pub source_agent_work: AgentWork,
    pub destination_agent_work: AgentWork,
    /// All of the CPU seconds per GB (10^9 bytes) on the WAN, when bytes crossed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_wan_gb_s: Option<f64>,
}

impl MigrationCpu {
    pub fn total_s(&self) -> f64 {
        self.source_qemu_s
            + self.destination_qemu_s
            + self.source_agent_s
            + self.destination_agent_s
    }

    pub fn with_wan_bytes(mut self, wan_bytes: u64) -> MigrationCpu {
        self.per_wan_gb_s = (wan_bytes > 0).then(|| self.total_s() / (wan_bytes as f64 / 1e9));
        self
    }
}

/// What an agent's work was cut into (see the module's doc).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct AgentWork {
    pub switches: u64,
    pub syscalls: u64,
    pub minor_faults: u64,
}

impl std::ops::AddAssign for AgentWork {
    fn add_assign(&mut self, other: AgentWork) {
        self.switches += other.switches;
        self.syscalls += other.syscalls;
        self.minor_faults += other.minor_faults;
    }
}

impl AgentWork {
    fn since(self, first: AgentWork) -> AgentWork {
        AgentWork {
            switches: self.switches.saturating_sub(first.switches),
            syscalls: self.syscalls.saturating_sub(first.syscalls),
            minor_faults: self.minor_faults.saturating_sub(first.minor_faults),
        }
    }

    /// This agent's counts so far, `stat` its `/proc/<pid>/stat` (what cannot be read counts
    /// as zero).
    fn of(pid: u32, stat: &str) -> AgentWork {
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
        AgentWork {
            switches: voluntary_switches(pid).unwrap_or(0),
            syscalls: parse_named_field(&io, "syscr:").unwrap_or(0)
                + parse_named_field(&io, "syscw:").unwrap_or(0),
            minor_faults: parse_stat_field(stat, 10).unwrap_or(0),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Role {
    SourceQemu,
    DestinationQemu,
    SourceAgent,
    DestinationAgent,
}

/// Runs `migration` while sampling the CPU time of VM `vm`'s QEMUs and the agents of `from`
/// and its other site.
pub async fn measure<F: Future>(
    lab: &Lab,
    vm: &str,
    from: Site,
    migration: F,
) -> (F::Output, MigrationCpu) {
    let agent_configs = [
        (agents::config_path(lab, from), Role::SourceAgent),
        (
            agents::config_path(lab, from.other()),
            Role::DestinationAgent,
        ),
    ]
    .map(|(path, role)| (path.display().to_string(), role));
    let mut sampler = Sampler::default();
    sampler.sample(vm, &agent_configs, true);
    tokio::pin!(migration);
    let output = loop {
        tokio::select! {
            out = &mut migration => break out,
            _ = tokio::time::sleep(EVERY) => sampler.sample(vm, &agent_configs, false),
        }
    };
    sampler.sample(vm, &agent_configs, false);
    (output, sampler.spent())
}

/// First and last reading of each process seen, with its role.
#[derive(Debug, Default)]
struct Sampler {
    seen: HashMap<u32, Readings>,
}

#[derive(Debug, Clone, Copy)]
struct Readings {
    role: Role,
    first: Reading,
    last: Reading,
}

#[derive(Debug, Clone, Copy, Default)]
struct Reading {
    ticks: u64,
    /// Agents only (zero for the QEMUs).
    work: AgentWork,
}

impl Sampler {
    /// Reads every matching process; those present at the `first` reading count from it, a
    /// QEMU that appears later (the destination's) from its start.
    fn sample(&mut self, vm: &str, agent_configs: &[(String, Role)], first: bool) {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let known = self.seen.get(&pid).map(|r| r.role);
            let role = match known {
                Some(role) => role,
                None => match role_of(pid, vm, agent_configs, first) {
                    Some(role) => role,
                    None => continue,
                },
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let Some(ticks) = parse_stat_ticks(&stat) else {
                continue;
            };
            let work = match role {
                Role::SourceAgent | Role::DestinationAgent => AgentWork::of(pid, &stat),
                Role::SourceQemu | Role::DestinationQemu => AgentWork::default(),
            };
            let now = Reading { ticks, work };
            let start = if first || role != Role::DestinationQemu {
                now
            } else {
                Reading::default()
            };
            self.seen
                .entry(pid)
                .and_modify(|r| r.last = now)
                .or_insert(Readings {
                    role,
                    first: start,
                    last: now,
                });
        }
    }

    fn spent(&self) -> MigrationCpu {
        let hz = ticks_per_second();
        let mut cpu = MigrationCpu::default();
        for r in self.seen.values() {
            let s = r.last.ticks.saturating_sub(r.first.ticks) as f64 / hz;
            let work = r.last.work.since(r.first.work);
            match r.role {
                Role::SourceQemu => cpu.source_qemu_s += s,
                Role::DestinationQemu => cpu.destination_qemu_s += s,
                Role::SourceAgent => {
                    cpu.source_agent_s += s;
                    cpu.source_agent_work += work;
                }
                Role::DestinationAgent => {
                    cpu.destination_agent_s += s;
                    cpu.destination_agent_work += work;
                }
            }
        }
        cpu
    }
}

/// The role of process `pid`: one of `vm`'s QEMUs (the source if it runs at the first
/// reading) or one of the agents.
fn role_of(pid: u32, vm: &str, agent_configs: &[(String, Role)], first: bool) -> Option<Role> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let program = args.first()?;
    if program.ends_with(b"qemu-system-x86_64") {
        let named = args
            .windows(2)
            .any(|w| w[0] == b"-name" && w[1] == vm.as_bytes());
        return named.then_some(if first {
            Role::SourceQemu
        } else {
            Role::DestinationQemu
        });
    }
    let config = args
        .windows(2)
        .find(|w| w[0] == b"--config")
        .map(|w| String::from_utf8_lossy(w[1]).into_owned())?;
    let is_agent = args.iter().any(|a| *a == b"agent");
    agent_configs
        .iter()
        .find(|(path, _)| is_agent && *path == config)
        .map(|(_, role)| *role)
}

/// utime + stime from a `/proc/<pid>/stat` line (fields 14 and 15).
fn parse_stat_ticks(stat: &str) -> Option<u64> {
    Some(parse_stat_field(stat, 14)? + parse_stat_field(stat, 15)?)
}

/// Field `n` (counted from 1, as in proc(5)) of a `/proc/<pid>/stat` line, a number. The
/// command name in field 2 may hold spaces and parentheses, so fields are counted after its
/// last `)`.
fn parse_stat_field(stat: &str, n: usize) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(n.checked_sub(3)?)?.parse().ok()
}

/// The number on a `name: value` line, as `/proc/<pid>/io` and `/proc/<pid>/status` have.
fn parse_named_field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))?
        .trim()
        .parse()
        .ok()
}

/// Voluntary context switches of every live thread of `pid` so far.
fn voluntary_switches(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        // A thread that ended since the directory was listed has nothing more to count.
        if let Ok(status) = std::fs::read_to_string(task.path().join("status")) {
            total += parse_named_field(&status, "voluntary_ctxt_switches:").unwrap_or(0);
        }
    }
    Some(total)
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf reads a constant of the system; it touches no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_are_read_after_the_command_name() {
        let stat =
            "4242 (tokio (rt) 1) S 1 4242 4242 0 -1 4194560 500 0 0 0 150 25 0 0 20 0 4 0 1 2 3";
        assert_eq!(parse_stat_ticks(stat), Some(175));
        assert_eq!(parse_stat_field(stat, 10), Some(500));
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    /// User and system clock ticks of every thread of `pid` so far.
    fn cpu_ticks(pid: u32) -> Option<u64> {
        parse_stat_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    }

    #[test]
    fn this_process_has_spent_some_cpu() {
        let pid = std::process::id();
        let before = cpu_ticks(pid).unwrap();
        let mut x = 0u64;
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_millis(100) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(cpu_ticks(pid).unwrap() > before);
    }

    #[test]
    fn voluntary_switches_are_read_from_their_line() {
        let status =
            "Name:\tferry\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t56\n";
        let name = "voluntary_ctxt_switches:";
        assert_eq!(parse_named_field(status, name), Some(1234));
        assert_eq!(parse_named_field("Name:\tferry\n", name), None);
    }

    #[test]
    fn system_calls_are_read_from_their_lines() {
        let io = "rchar: 10\nwchar: 20\nsyscr: 7\nsyscw: 3\nread_bytes: 0\n";
        assert_eq!(parse_named_field(io, "syscr:"), Some(7));
        assert_eq!(parse_named_field(io, "syscw:"), Some(3));
        assert_eq!(parse_named_field(io, "cancelled_write_bytes:"), None);
    }

    #[test]
    fn this_process_has_switched_voluntarily() {
        let pid = std::process::id();
        let before = voluntary_switches(pid).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        assert!(voluntary_switches(pid).unwrap() > before);
    }

    #[test]
    fn the_figure_per_gb_divides_the_total_by_the_wan_bytes() {
        let cpu = MigrationCpu {
            source_qemu_s: 1.0,
            destination_qemu_s: 0.5,
            source_agent_s: 0.25,
            destination_agent_s: 0.25,
            per_wan_gb_s: None,
            ..MigrationCpu::default()
        };
        assert_eq!(cpu.with_wan_bytes(500_000_000).per_wan_gb_s, Some(4.0));
        assert_eq!(cpu.with_wan_bytes(0).per_wan_gb_s, None);
    }
}
