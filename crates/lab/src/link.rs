//! The emulated WAN link's settings, validated before anything is created.

use serde::{Deserialize, Serialize};

/// One emulated wide-area link, the same in both directions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkConfig {
    /// Bottleneck rate in Mbit/s.
    pub rate_mbit: f64,
    /// Round-trip time in ms; each direction delays frames by half.
    pub rtt_ms: f64,
    /// Random extra one-way delay, uniform in [0, jitter_ms]; frames are never reordered.
    #[serde(default)]
    pub jitter_ms: f64,
    /// Share of frames dropped at random, in percent.
    #[serde(default)]
    pub loss_pct: f64,
    /// The sites' default TCP congestion control, which QEMU's own migrations use (ferry's
    /// agents ask for BBR on their connections); `None` keeps this machine's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_congestion: Option<Congestion>,
    /// Each site's end of the WAN coalesces the frames it receives (GRO), as a data center
    /// host's NIC does; off, every frame reaches TCP, and a receiver, on its own.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub receive_gro: bool,
    /// The sites' hosts autotune a connection's receive buffer up to this many MiB
    /// (`net.ipv4.tcp_rmem`'s maximum), as an older kernel does (6 MiB on many, Debian 12's
    /// 6.1 among them); `None` keeps this machine's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_tcp_rmem_max_mib: Option<u32>,
    /// The sites' agents run without `CAP_NET_ADMIN`, as an agent not run as root does: their
    /// sockets' buffers stop at the host's limits (`net.core.wmem_max`, autotuning's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub agents_without_net_admin: bool,
}

/// A TCP congestion control a site's host may default to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Congestion {
    /// Linux's default and Debian's: loss-based.
    Cubic,
    /// Model-based: paces at the bottleneck rate it measures, random loss aside.
    Bbr,
}

impl Congestion {
    /// The kernel's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Congestion::Cubic => "cubic",
            Congestion::Bbr => "bbr",
        }
    }
}

impl std::str::FromStr for Congestion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cubic" => Ok(Congestion::Cubic),
            "bbr" => Ok(Congestion::Bbr),
            _ => Err(format!(
                "unknown congestion control {s:?}: use cubic or bbr"
            )),
        }
    }
}

impl Default for LinkConfig {
    /// The brief's reference WAN: 100 Mbit/s, 50 ms RTT.
    fn default() -> Self {
        LinkConfig {
            rate_mbit: 100.0,
            rtt_ms: 50.0,
            jitter_ms: 0.0,
            loss_pct: 0.0,
            host_congestion: None,
            receive_gro: false,
            host_tcp_rmem_max_mib: None,
            agents_without_net_admin: false,
        }
    }
}

/// A link setting outside what the emulator can honour.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LinkError {
    #[error("rate {0} Mbit/s is out of range; use 0.1 to 10000")]
    Rate(f64),
    #[error("rtt {0} ms is out of range; use 0 to 5000")]
    Rtt(f64),
    #[error("jitter {0} ms is out of range; use 0 to 1000")]
    Jitter(f64),
    #[error("loss {0}% is out of range; use 0 to 100")]
    Loss(f64),
    #[error("receive buffer limit {0} MiB is out of range; use 1 to 1024")]
    ReceiveBuffer(u32),
}

impl LinkConfig {
    /// Checks every field; the first bad one is reported.
    pub fn validate(&self) -> Result<(), LinkError> {
        let ok = |v: f64, lo: f64, hi: f64| v.is_finite() && v >= lo && v <= hi;
        if !ok(self.rate_mbit, 0.1, 10_000.0) {
            return Err(LinkError::Rate(self.rate_mbit));
        }
        if !ok(self.rtt_ms, 0.0, 5_000.0) {
            return Err(LinkError::Rtt(self.rtt_ms));
        }
        if !ok(self.jitter_ms, 0.0, 1_000.0) {
            return Err(LinkError::Jitter(self.jitter_ms));
        }
        if !ok(self.loss_pct, 0.0, 100.0) {
            return Err(LinkError::Loss(self.loss_pct));
        }
        if let Some(mib) = self
            .host_tcp_rmem_max_mib
            .filter(|mib| !(1..=1024).contains(mib))
        {
            return Err(LinkError::ReceiveBuffer(mib));
        }
        Ok(())
    }

    /// The bottleneck queue: one bandwidth-delay product (at least 64 KiB), the usual router
    /// sizing rule, so one TCP flow can fill the link without a standing queue of seconds.
    pub fn queue_limit_bytes(&self) -> f64 {
        (self.rate_mbit * 1e6 / 8.0 * self.rtt_ms.max(10.0) / 1000.0).max(65536.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_the_reference_wan() {
        assert_eq!(LinkConfig::default().validate(), Ok(()));
    }

    #[test]
    fn out_of_range_settings_are_named() {
        let bad = |f: fn(&mut LinkConfig)| {
            let mut l = LinkConfig::default();
            f(&mut l);
            l.validate().unwrap_err().to_string()
        };
        assert_eq!(
            bad(|l| l.rate_mbit = 0.0),
            "rate 0 Mbit/s is out of range; use 0.1 to 10000"
        );
        assert_eq!(
            bad(|l| l.rtt_ms = -1.0),
            "rtt -1 ms is out of range; use 0 to 5000"
        );
        assert_eq!(
            bad(|l| l.loss_pct = 101.0),
            "loss 101% is out of range; use 0 to 100"
        );
        assert_eq!(
            bad(|l| l.jitter_ms = f64::NAN),
            "jitter NaN ms is out of range; use 0 to 1000"
        );
        assert_eq!(
            bad(|l| l.host_tcp_rmem_max_mib = Some(0)),
            "receive buffer limit 0 MiB is out of range; use 1 to 1024"
        );
    }

    #[test]
    fn a_lab_recorded_before_host_congestion_and_gro_keeps_the_machines_defaults() {
        let old: LinkConfig =
            serde_json::from_str(r#"{"rate_mbit":20.0,"rtt_ms":250.0,"loss_pct":0.1}"#).unwrap();
        assert_eq!(old.host_congestion, None);
        let cubic = LinkConfig {
            host_congestion: Some("cubic".parse().unwrap()),
            ..old
        };
        let json = serde_json::to_string(&cubic).unwrap();
        assert!(json.contains(r#""host_congestion":"cubic""#), "{json}");
        assert_eq!(serde_json::from_str::<LinkConfig>(&json).unwrap(), cubic);
        assert!(!json.contains("receive_gro"), "{json}");
        let gro = LinkConfig {
            receive_gro: true,
            ..cubic
        };
        let json = serde_json::to_string(&gro).unwrap();
        assert_eq!(serde_json::from_str::<LinkConfig>(&json).unwrap(), gro);
        assert_eq!(
            "vegas".parse::<Congestion>().unwrap_err(),
            r#"unknown congestion control "vegas": use cubic or bbr"#
        );
    }

    #[test]
    fn queue_is_one_bdp() {
        let l = LinkConfig::default();
        assert!((l.queue_limit_bytes() - 625_000.0).abs() < 1.0);
    }
}
