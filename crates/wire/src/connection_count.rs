//! How many TCP connections a session keeps to its peer. One connection carries a link as long
//! as its send buffer holds the link's bandwidth-delay product, and more only make the
//! receiver wait for the slowest (BENCHMARKS.md, "How many connections"). Where this host
//! cannot give one connection that much (an agent without `CAP_NET_ADMIN` is held to the
//! kernel's caps), the link is split over as many as it needs. The count is decided once per
//! session, when its first connection knows the round trip (TCP measured it in its handshake),
//! before that connection's buffer and pace are set; the other connections are dialed then.

use std::sync::Arc;

use tokio::sync::watch;

use crate::buffers::{largest_send_buffer, LargestSendBuffer, SendBufferLimit};

/// The most connections the automatic count opens: past that, per-connection ACKs and the
/// wait for the slowest cost more than a larger buffer would gain.
pub const MAX_AUTO_CONNECTIONS: u32 = 8;

/// The count once decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    pub connections: u32,
    /// Why, for an automatic count (`None`: given by the user, or one by default).
    pub why: Option<String>,
}

/// A session's connection count, shared by its dialers: given, or decided by the first of them.
#[derive(Debug, Clone)]
pub struct ConnectionCount(Arc<watch::Sender<Option<Decided>>>);

impl ConnectionCount {
    /// Exactly `connections` (at least one).
    pub fn fixed(connections: u32) -> Self {
        Self(Arc::new(watch::Sender::new(Some(Decided {
            connections: connections.max(1),
            why: None,
        }))))
    }

    /// As many as the link needs on this host, decided by the first connection.
    pub fn auto() -> Self {
        Self(Arc::new(watch::Sender::new(None)))
    }

    /// From a setting where 0 means automatic.
    pub fn from_setting(connections: u32) -> Self {
        if connections == 0 {
            Self::auto()
        } else {
            Self::fixed(connections)
        }
    }

    /// The count, once decided.
    pub fn get(&self) -> Option<Decided> {
        self.0.borrow().clone()
    }

    /// Waits until the count is decided.
    pub async fn decided(&self) -> u32 {
        let mut rx = self.0.subscribe();
        let decided = rx
            .wait_for(Option::is_some)
            .await
            .expect("the sender lives in self");
        decided.as_ref().map_or(1, |d| d.connections)
    }

    /// The count for a connection on `tcp` to a link of `rate_mbit` (`None`: unknown, one
    /// connection) measured at `rtt_ms`: decided now from what this host gives one
    /// connection's send buffer, unless it already was.
    pub(crate) fn decide(
        &self,
        tcp: &impl std::os::fd::AsRawFd,
        rate_mbit: Option<f64>,
        rtt_ms: f64,
    ) -> u32 {
        self.0.send_if_modified(|count| {
            if count.is_some() {
                return false;
            }
            // The probe only where the rate is known: it sets the buffer, which a known rate
            // then sizes again (`net::tune_socket`); unknown, autotuning must stay.
            let largest = rate_mbit.and_then(|_| largest_send_buffer(tcp));
            *count = Some(choose(rate_mbit, rtt_ms, largest));
            true
        });
        self.get().map_or(1, |d| d.connections)
    }
}

/// The automatic choice for a link of `rate_mbit` at `rtt_ms` when one connection's send
/// buffer reaches `largest`, and its reason.
fn choose(rate_mbit: Option<f64>, rtt_ms: f64, largest: Option<LargestSendBuffer>) -> Decided {
    let one = |why: &str| Decided {
        connections: 1,
        why: Some(why.to_owned()),
    };
    let Some(rate) = rate_mbit else {
        return one("the link's rate is not configured");
    };
    let Some(largest) = largest else {
        return one("this host's send buffer limit could not be read");
    };
    let needed = connections_needed(rate, rtt_ms, largest.bytes);
    let connections = needed.min(MAX_AUTO_CONNECTIONS);
    let mib = largest.bytes as f64 / f64::from(1 << 20);
    let link = format!("a {rate} Mbit/s link at {rtt_ms:.1} ms");
    let why = if connections == 1 {
        format!("one connection's send buffer (up to {mib:.1} MiB here) holds {link}")
    } else {
        let limit = match largest.limit {
            SendBufferLimit::Asked => "the most the agent asks for",
            SendBufferLimit::HostCap => "net.core.wmem_max; the agent lacks CAP_NET_ADMIN",
            SendBufferLimit::Autotuning => {
                "net.ipv4.tcp_wmem's maximum; the agent lacks CAP_NET_ADMIN"
            }
        };
        let capped = if needed > MAX_AUTO_CONNECTIONS {
            format!(" ({needed} would hold it; at most {MAX_AUTO_CONNECTIONS})")
        } else {
            String::new()
        };
        format!("one connection's send buffer stops at {mib:.1} MiB here ({limit}), short of {link}{capped}")
    };
    Decided {
        connections,
        why: Some(why),
    }
}

/// Connections a link of `rate_mbit` and `rtt_ms` needs when one connection's send buffer
/// reaches at most `largest` bytes as the kernel counts them (its bookkeeping included): each
/// connection is given twice its share of the bandwidth-delay product
/// ([`crate::buffers::socket_buffer_for`]), which the kernel doubles, so the link needs four
/// times the product in all. At least one; the automatic count takes at most
/// [`MAX_AUTO_CONNECTIONS`] of them.
pub fn connections_needed(rate_mbit: f64, rtt_ms: f64, largest: u64) -> u32 {
    let bdp = rate_mbit * 1e6 / 8.0 * rtt_ms / 1e3;
    let needed = (4.0 * bdp / largest.max(1) as f64).ceil();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // clamped
    let connections = needed.clamp(1.0, f64::from(u32::MAX)) as u32;
    connections
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback_socket() -> std::net::TcpStream {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect")
    }

    #[tokio::test]
    async fn the_first_decision_holds_and_wakes_the_waiters() {
        let count = ConnectionCount::auto();
        assert_eq!(count.get(), None);
        let waiter = tokio::spawn({
            let count = count.clone();
            async move { count.decided().await }
        });
        let socket = loopback_socket();
        assert_eq!(count.decide(&socket, None, 10.0), 1);
        assert_eq!(waiter.await.expect("waiter"), 1);
        // A later connection, whatever its link, keeps the count.
        assert_eq!(count.decide(&socket, Some(100_000.0), 250.0), 1);
        assert_eq!(
            count.get().and_then(|d| d.why),
            Some("the link's rate is not configured".into())
        );
    }

    #[test]
    fn a_link_is_split_only_where_one_connection_cannot_hold_it_and_the_reason_says_what_holds_it()
    {
        use SendBufferLimit::{Asked, Autotuning, HostCap};
        const MIB: u64 = 1 << 20;
        for (rate, rtt, bytes, limit, expected, why) in [
            // With CAP_NET_ADMIN: twice the 64 MiB asked at most; 1 Gbit/s at 250 ms needs
            // 4 x 31.25 MB.
            (1000.0, 250.0, 128 * MIB, Asked, 1, "(up to 128.0 MiB here) holds a 1000 Mbit/s link at 250.0 ms"),
            (10_000.0, 50.0, 128 * MIB, Asked, 2, "stops at 128.0 MiB here (the most the agent asks for), short of a 10000 Mbit/s link at 50.0 ms"),
            // Autotuning's 4 MiB: the main link holds, a fast short one barely does not.
            (100.0, 50.0, 4 * MIB, Autotuning, 1, "holds"),
            (1000.0, 10.0, 4 * MIB, Autotuning, 2, "(net.ipv4.tcp_wmem's maximum; the agent lacks CAP_NET_ADMIN)"),
            // Twice this lab's 4 MiB wmem_max, set without the capability: the 1 Gbit/s,
            // 200 ms link needs 100 MB.
            (1000.0, 200.0, 8 * MIB, HostCap, 8, "(net.core.wmem_max; the agent lacks CAP_NET_ADMIN), short of a 1000 Mbit/s link at 200.0 ms (12 would hold it; at most 8)"),
            (250.0, 200.0, 8 * MIB, HostCap, 3, "lacks CAP_NET_ADMIN), short of a 250 Mbit/s link at 200.0 ms"),
            // Twice an older kernel's 212992 bytes.
            (100.0, 50.0, 425_984, HostCap, 6, "stops at 0.4 MiB here"),
            (0.0, 50.0, 4 * MIB, Autotuning, 1, "holds"),
            (100.0, 50.0, 0, HostCap, 8, "at most 8)"),
        ] {
            let largest = LargestSendBuffer { bytes, limit };
            let decided = choose(Some(rate), rtt, Some(largest));
            assert_eq!(decided.connections, expected, "{rate} Mbit/s, {rtt} ms, {largest:?}");
            let said = decided.why.expect("a reason");
            assert!(said.contains(why), "{said}");
        }
        // 8 exactly: not capped.
        let largest = LargestSendBuffer {
            bytes: 4 * MIB,
            limit: HostCap,
        };
        let said = choose(Some(671.0), 100.0, Some(largest))
            .why
            .expect("a reason");
        assert!(said.ends_with("at 100.0 ms"), "{said}");
        assert_eq!(
            choose(Some(100.0), 50.0, None),
            Decided {
                connections: 1,
                why: Some("this host's send buffer limit could not be read".into())
            }
        );
    }

    #[test]
    fn a_given_count_is_never_decided_again() {
        let count = ConnectionCount::from_setting(3);
        let socket = loopback_socket();
        assert_eq!(count.decide(&socket, Some(100_000.0), 250.0), 3);
        assert_eq!(
            count.get(),
            Some(Decided {
                connections: 3,
                why: None
            })
        );
        assert_eq!(ConnectionCount::from_setting(0).get(), None);
    }
}
