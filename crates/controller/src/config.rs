//! The controller's configuration: one TOML file (`ferry controller --config
//! /etc/ferry/controller.toml`), checked whole before anything is bound or opened.
//!
//! ```toml
//! name = "ctl1"                                # its certificate's name (agents check it)
//! listen = "0.0.0.0:7443"                      # agents and remote operators, mutual TLS
//! api_socket = "/run/ferry/controller.sock"    # local: anyone reads, root changes
//! database = "/var/lib/ferry/controller.db"    # SQLite file, or postgres://user:pw@host/db
//! http_listen = "127.0.0.1:7480"               # optional: dashboard, views, metrics (read-only)
//! operators = ["ops-alice"]                    # certificate names that may change things
//!
//! [tls]
//! ca = "/etc/ferry/pki/ca.pem"
//! cert = "/etc/ferry/pki/ctl1.pem"
//! key = "/etc/ferry/pki/ctl1.key"
//!
//! [timing]
//! heartbeat_s = 2        # agents call this often
//! host_timeout_s = 10    # a host silent this long is down
//! lease_s = 10           # the leader's lease (another controller takes over after it)
//! queue_timeout_s = 300  # a migration waiting for its hosts this long fails
//!
//! [limits]
//! per_site_pair = 2      # migrations between two sites at once
//!
//! [policy]               # the planner (docs/policies.md): `ferry fleet plan`
//! auto = false           # carry its plans out without being asked
//! headroom = 0.2         # share of each host's capacity kept free
//! hold_s = 600           # a surplus of hosts must last this long before hosts are emptied
//! margin_hosts = 1       # ... and be at least this many hosts
//! cooldown_s = 1800      # a VM that moved is left alone this long
//! min_on_s = 3600        # a host is not emptied within this long of joining
//! max_moves = 16         # moves per plan
//! lan_mbit = 10000       # the links the cost model prices moves on: within a site
//! wan_mbit = 1000        # ... and between sites
//! wan_rtt_ms = 30
//! overload = false       # meet hosts' memory overload: swap on peers, migrate when it lasts
//! overload_interval_s = 10   # memory pressure is sampled this often (Overdriver's 10 s)
//! overload_swap = true   # false: every overload migrates at once (Overdriver's baseline)
//! ```

use std::path::{Path, PathBuf};

use ferry_api::names::{check_address, valid_name};
use ferry_wire::tls::Identity;
use serde::Deserialize;

pub const DEFAULT_CONFIG: &str = "/etc/ferry/controller.toml";
pub const DEFAULT_API_SOCKET: &str = "/run/ferry/controller.sock";
pub const DEFAULT_DATABASE: &str = "/var/lib/ferry/controller.db";

#[derive(Debug, Clone, PartialEq)]
pub struct ControllerConfig {
    pub name: String,
    pub listen: String,
    pub api_socket: PathBuf,
    /// A SQLite file's path or a `postgres://` URL.
    pub database: String,
    /// Plain HTTP, read-only: the dashboard, the views, the metrics (none: not served so).
    pub http_listen: Option<String>,
    /// Certificate names that may start and cancel migrations over the network.
    pub operators: Vec<String>,
    pub identity: Identity,
    pub timing: Timing,
    pub per_site_pair: u32,
    pub policy: PolicyConfig,
}

/// `[policy]`: the planner's settings and the links it prices moves on.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    pub auto: bool,
    pub settings: ferry_policy::consolidate::Settings,
    pub lan_bits_per_s: f64,
    pub wan_bits_per_s: f64,
    pub wan_rtt_s: f64,
    /// The overload response: `None` when off, else how often memory pressure is sampled.
    pub overload_interval_ms: Option<u64>,
    /// Whether a transient overload is met by swap on a peer (else by a migration at once).
    pub overload_swap: bool,
}

/// The controller's clocks, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub heartbeat_ms: u64,
    pub host_timeout_ms: u64,
    pub lease_ms: u64,
    pub queue_timeout_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the controller's config {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("{path}: {key}: {problem}")]
    Invalid {
        path: PathBuf,
        key: String,
        problem: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    name: String,
    listen: String,
    #[serde(default)]
    api_socket: Option<PathBuf>,
    #[serde(default)]
    database: Option<String>,
    #[serde(default)]
    http_listen: Option<String>,
    #[serde(default)]
    operators: Vec<String>,
    tls: Identity,
    #[serde(default)]
    timing: TimingFile,
    #[serde(default)]
    limits: LimitsFile,
    #[serde(default)]
    policy: PolicyFile,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    auto: Option<bool>,
    headroom: Option<f64>,
    hold_s: Option<f64>,
    margin_hosts: Option<usize>,
    cooldown_s: Option<f64>,
    min_on_s: Option<f64>,
    max_moves: Option<usize>,
    lan_mbit: Option<f64>,
    wan_mbit: Option<f64>,
    overload: Option<bool>,
    overload_interval_s: Option<f64>,
    overload_swap: Option<bool>,
    wan_rtt_ms: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TimingFile {
    heartbeat_s: Option<f64>,
    host_timeout_s: Option<f64>,
    lease_s: Option<f64>,
    queue_timeout_s: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsFile {
    per_site_pair: Option<u32>,
}

impl ControllerConfig {
    pub fn load(path: &Path) -> Result<ControllerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        ControllerConfig::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<ControllerConfig, ConfigError> {
        let file: File = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            path: path.to_owned(),
            message: e.to_string().trim().replace('\n', " ").replace("  ", " "),
        })?;
        let invalid = |key: &str, problem: String| ConfigError::Invalid {
            path: path.to_owned(),
            key: key.to_owned(),
            problem,
        };
        if !valid_name(&file.name) {
            return Err(invalid(
                "name",
                format!(
                    "{:?} is not a certificate's name (letters, digits, '-', '.')",
                    file.name
                ),
            ));
        }
        check_address(&file.listen).map_err(|p| invalid("listen", p))?;
        if let Some(address) = &file.http_listen {
            check_address(address).map_err(|p| invalid("http_listen", p))?;
        }
        for name in &file.operators {
            if !valid_name(name) {
                return Err(invalid(
                    "operators",
                    format!("{name:?} is not a certificate's name"),
                ));
            }
        }
        for (key, p) in [
            ("tls.ca", &file.tls.ca),
            ("tls.cert", &file.tls.cert),
            ("tls.key", &file.tls.key),
        ] {
            if !p.is_absolute() {
                return Err(invalid(
                    key,
                    format!("{} is not an absolute path", p.display()),
                ));
            }
        }
        let database = file.database.unwrap_or_else(|| DEFAULT_DATABASE.into());
        if !(database.starts_with("postgres://")
            || database.starts_with("postgresql://")
            || Path::new(database.strip_prefix("sqlite://").unwrap_or(&database)).is_absolute())
        {
            return Err(invalid(
                "database",
                format!(
                    "{database:?} is neither a SQLite file's absolute path nor a postgres:// URL"
                ),
            ));
        }
        let seconds = |key: &str, value: Option<f64>, default: f64, range: (f64, f64)| {
            let v = value.unwrap_or(default);
            if !(range.0..=range.1).contains(&v) {
                return Err(invalid(
                    &format!("timing.{key}"),
                    format!("{v} is out of range; use {} to {}", range.0, range.1),
                ));
            }
            // Whole milliseconds; the range keeps it far from overflow.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            Ok((v * 1000.0).round() as u64)
        };
        let t = &file.timing;
        let timing = Timing {
            heartbeat_ms: seconds("heartbeat_s", t.heartbeat_s, 2.0, (0.1, 60.0))?,
            host_timeout_ms: seconds("host_timeout_s", t.host_timeout_s, 10.0, (0.5, 3600.0))?,
            lease_ms: seconds("lease_s", t.lease_s, 10.0, (0.5, 600.0))?,
            queue_timeout_ms: seconds("queue_timeout_s", t.queue_timeout_s, 300.0, (1.0, 86400.0))?,
        };
        if timing.host_timeout_ms < 2 * timing.heartbeat_ms {
            return Err(invalid(
                "timing.host_timeout_s",
                "must be at least twice timing.heartbeat_s (one lost heartbeat must not mark a host down)".into(),
            ));
        }
        let per_site_pair = file.limits.per_site_pair.unwrap_or(2);
        if !(1..=64).contains(&per_site_pair) {
            return Err(invalid(
                "limits.per_site_pair",
                format!("{per_site_pair} is out of range; use 1 to 64"),
            ));
        }
        let p = &file.policy;
        let number = |key: &str, v: Option<f64>, default: f64, (lo, hi): (f64, f64)| {
            let v = v.unwrap_or(default);
            if v.is_finite() && (lo..=hi).contains(&v) {
                Ok(v)
            } else {
                Err(invalid(
                    &format!("policy.{key}"),
                    format!("{v} is out of range; use {lo} to {hi}"),
                ))
            }
        };
        let count = |key: &str, v: Option<usize>, default: usize, hi: usize| {
            let v = v.unwrap_or(default);
            if (1..=hi).contains(&v) {
                Ok(v)
            } else {
                Err(invalid(
                    &format!("policy.{key}"),
                    format!("{v} is out of range; use 1 to {hi}"),
                ))
            }
        };
        let policy = PolicyConfig {
            auto: p.auto.unwrap_or(false),
            settings: ferry_policy::consolidate::Settings {
                headroom: number("headroom", p.headroom, 0.2, (0.0, 0.9))?,
                hold_s: number("hold_s", p.hold_s, 600.0, (0.0, 604800.0))?,
                margin_hosts: count("margin_hosts", p.margin_hosts, 1, 10_000)?,
                cooldown_s: number("cooldown_s", p.cooldown_s, 1800.0, (0.0, 604800.0))?,
                min_on_s: number("min_on_s", p.min_on_s, 3600.0, (0.0, 604800.0))?,
                max_moves: count("max_moves", p.max_moves, 16, 100_000)?,
            },
            lan_bits_per_s: number("lan_mbit", p.lan_mbit, 10000.0, (0.1, 1e7))? * 1e6,
            wan_bits_per_s: number("wan_mbit", p.wan_mbit, 1000.0, (0.1, 1e7))? * 1e6,
            wan_rtt_s: number("wan_rtt_ms", p.wan_rtt_ms, 30.0, (0.0, 10000.0))? / 1000.0,
            overload_interval_ms: {
                let interval_s = number(
                    "overload_interval_s",
                    p.overload_interval_s,
                    10.0,
                    (0.1, 3600.0),
                )?;
                // Whole milliseconds; the range keeps it far from overflow.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                p.overload
                    .unwrap_or(false)
                    .then(|| (interval_s * 1000.0).round() as u64)
            },
            overload_swap: p.overload_swap.unwrap_or(true),
        };
        Ok(ControllerConfig {
            name: file.name,
            listen: file.listen,
            api_socket: file
                .api_socket
                .unwrap_or_else(|| PathBuf::from(DEFAULT_API_SOCKET)),
            database,
            http_listen: file.http_listen,
            operators: file.operators,
            identity: file.tls,
            timing,
            per_site_pair,
            policy,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ControllerConfig, String> {
        ControllerConfig::parse(text, Path::new("/etc/ferry/controller.toml"))
            .map_err(|e| e.to_string())
    }

    const GOOD: &str = r#"
name = "ctl1"
listen = "0.0.0.0:7443"

[tls]
ca = "/etc/ferry/pki/ca.pem"
cert = "/etc/ferry/pki/ctl1.pem"
key = "/etc/ferry/pki/ctl1.key"
"#;

    #[test]
    fn a_minimal_file_gets_the_defaults() {
        let c = parse(GOOD).unwrap();
        assert_eq!(c.database, DEFAULT_DATABASE);
        assert_eq!(c.api_socket, Path::new(DEFAULT_API_SOCKET));
        assert_eq!(c.timing.heartbeat_ms, 2000);
        assert_eq!(c.timing.host_timeout_ms, 10_000);
        assert_eq!(c.per_site_pair, 2);
        assert!(c.operators.is_empty());
    }

    #[test]
    fn bad_values_name_their_key() {
        let err = parse(&GOOD.replace("listen =", "lisen =")).unwrap_err();
        assert!(
            err.contains("unknown field `lisen`") && err.contains("line 3"),
            "{err}"
        );
        assert_eq!(
            parse(&format!("database = \"fleet.db\"\n{GOOD}")).unwrap_err(),
            "/etc/ferry/controller.toml: database: \"fleet.db\" is neither a SQLite file's absolute path nor a postgres:// URL"
        );
        assert_eq!(
            parse(&format!("{GOOD}[timing]\nheartbeat_s = 5\nhost_timeout_s = 6\n")).unwrap_err(),
            "/etc/ferry/controller.toml: timing.host_timeout_s: must be at least twice timing.heartbeat_s (one lost heartbeat must not mark a host down)"
        );
        assert!(parse(&format!("operators = [\"a b\"]\n{GOOD}"))
            .unwrap_err()
            .contains("operators: \"a b\""));
    }

    #[test]
    fn the_example_in_the_repository_is_valid() {
        let c = parse(include_str!("../../../contrib/controller.toml")).unwrap();
        assert_eq!(c.name, "ctl1");
        assert_eq!(c.operators, vec!["ops-alice"]);
    }
}
