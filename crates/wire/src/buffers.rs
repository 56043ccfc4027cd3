//! Socket buffers sized to the link. A TCP connection carries at most one window per round
//! trip, and Linux autotunes the buffers that bound the window only up to the maxima of
//! `net.ipv4.tcp_wmem` (4 MiB by default) and `net.ipv4.tcp_rmem` (6 MiB on many kernels,
//! Debian 12's 6.1 among them; 32 MiB on the lab's 6.18), where a 1 Gbit/s link at 200 ms holds
//! 25 MB in flight. So an agent that knows a link's rate sizes both ends itself: the sender
//! each connection's send buffer from the round trip its handshake measured
//! ([`set_send_buffer`]); the receiver, which must size its buffer before the handshake (the
//! window scale is agreed there, from the buffer then), for the longest round trip a link
//! is expected to have ([`set_receive_buffer_for_link`]).

use std::os::fd::AsRawFd;

use crate::net::set_option;

/// The longest round trip a receive buffer is sized for: the longest link (250 ms);
/// VMware supports long-distance vMotion to 150 ms.
pub const LONGEST_RTT_MS: f64 = 250.0;

/// A socket buffer never asked for beyond this: an absurd rate must not pin absurd kernel
/// memory.
const MAX_BUFFER: f64 = 64.0 * 1024.0 * 1024.0;

/// Nor below this.
const MIN_BUFFER: f64 = 128.0 * 1024.0;

/// The send buffer for one of `connections` connections on a link of `rate_mbit` and
/// `rtt_ms`: twice the connection's share of the bandwidth-delay product, so that one lost
/// segment does not stall it, and at least 128 KiB (Linux doubles it for its bookkeeping).
pub fn socket_buffer_for(rate_mbit: f64, rtt_ms: f64, connections: u32) -> u32 {
    let bdp = rate_mbit * 1e6 / 8.0 * rtt_ms / 1e3;
    let share = 2.0 * bdp / f64::from(connections.max(1));
    clamped(share)
}

/// The receive buffer a connection on a link of `rate_mbit` asks for: the link's
/// bandwidth-delay product at [`LONGEST_RTT_MS`]. Linux doubles it for its bookkeeping, and
/// on older kernels (`tcp_adv_win_scale` 1) half of that is window.
pub fn receive_buffer_for(rate_mbit: f64) -> u32 {
    clamped(rate_mbit * 1e6 / 8.0 * LONGEST_RTT_MS / 1e3)
}

fn clamped(bytes: f64) -> u32 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // clamped to u32 range
    let size = bytes.clamp(MIN_BUFFER, MAX_BUFFER) as u32;
    size
}

/// Sizes the receive buffer of `socket`, not yet connected or listening, for a link of
/// `rate_mbit` (a listener's connections inherit it), where the kernel's autotuning would stop
/// short of [`receive_buffer_for`]; elsewhere autotuning stays, since a set buffer turns it
/// off. `SO_RCVBUF` is capped at `net.core.rmem_max` (4 MiB here, 212992 bytes on older
/// kernels), less than autotuning reaches, so only an agent with `CAP_NET_ADMIN` (root, `SO_RCVBUFFORCE`) sets it;
/// one without is told once what limits it.
pub fn set_receive_buffer_for_link(socket: &impl AsRawFd, rate_mbit: f64) {
    let wanted = receive_buffer_for(rate_mbit);
    // How far Linux autotunes a connection's receive buffer in this network namespace.
    let autotuned = sysctl_u64("/proc/sys/net/ipv4/tcp_rmem");
    if autotuned.is_some_and(|max| max >= 2 * u64::from(wanted)) {
        return;
    }
    let value = libc::c_int::try_from(wanted).unwrap_or(libc::c_int::MAX);
    if let Err(e) = set_option(socket, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &value) {
        static CAPPED_ONCE: std::sync::Once = std::sync::Once::new();
        CAPPED_ONCE.call_once(|| {
            tracing::warn!(
                "the receive buffer stays at net.ipv4.tcp_rmem's maximum ({} bytes), not the {} \
                 a {rate_mbit} Mbit/s link needs at round trips up to {LONGEST_RTT_MS} ms \
                 (SO_RCVBUFFORCE: {e}): raise tcp_rmem's maximum or run the agent with \
                 CAP_NET_ADMIN",
                autotuned.map_or_else(|| "unknown".to_owned(), |max| max.to_string()),
                2 * u64::from(wanted)
            );
        });
    }
}

/// Sets a connection's send buffer to `size` bytes. An agent with `CAP_NET_ADMIN` (root) sets
/// it with `SO_SNDBUFFORCE`. One without has `SO_SNDBUF`, which stops at `net.core.wmem_max`
/// and turns the kernel's autotuning off; where that cap is below what autotuning reaches, the
/// buffer is left to autotuning (see [`unforced_send_buffer`]). Either way it is told once
/// what limits it.
pub(crate) fn set_send_buffer(tcp: &impl AsRawFd, size: u32) {
    let value = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    if set_option(tcp, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, &value).is_ok() {
        return;
    }
    let cap = sysctl_u64("/proc/sys/net/core/wmem_max");
    let autotuned = sysctl_u64("/proc/sys/net/ipv4/tcp_wmem");
    let got = match unforced_send_buffer(cap, autotuned) {
        Unforced::Set => {
            if let Err(e) = set_option(tcp, libc::SOL_SOCKET, libc::SO_SNDBUF, &value) {
                tracing::warn!("SO_SNDBUF {size}: {e}");
                return;
            }
            // Linux reports twice what it was asked, its bookkeeping included.
            send_buffer(tcp).map(u64::from)
        }
        Unforced::Autotune => autotuned,
    };
    static CAPPED_ONCE: std::sync::Once = std::sync::Once::new();
    if let Some(got) = got.filter(|got| *got < 2 * u64::from(size)) {
        CAPPED_ONCE.call_once(|| {
            tracing::warn!(
                "the send buffer stops at {got} bytes, not the {} this link needs: raise \
                 net.core.wmem_max (and net.ipv4.tcp_wmem's maximum) or run the agent with \
                 CAP_NET_ADMIN",
                2 * u64::from(size)
            );
        });
    }
}

/// The largest send buffer one connection of this agent can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LargestSendBuffer {
    /// As the kernel counts it (bookkeeping included: twice what is asked).
    pub bytes: u64,
    pub limit: SendBufferLimit,
}

/// What stops a connection's send buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendBufferLimit {
    /// The most this module asks for (64 MiB): the agent may force any size.
    Asked,
    /// `net.core.wmem_max`, for an agent without `CAP_NET_ADMIN`.
    HostCap,
    /// `net.ipv4.tcp_wmem`'s maximum, the kernel's autotuning, for an agent without it.
    Autotuning,
}

/// The largest send buffer [`set_send_buffer`] can give a connection on `tcp` (whose buffer
/// is tried here, and must be set again after): with `CAP_NET_ADMIN`, what `SO_SNDBUFFORCE`
/// gets at the most this module asks for; without, twice `net.core.wmem_max` (at most what
/// is asked) or autotuning's maximum, as [`unforced_send_buffer`] chooses, and where the cap
/// cannot be read (a container's own network namespace may hide it), what `SO_SNDBUF` gets.
pub(crate) fn largest_send_buffer(tcp: &impl AsRawFd) -> Option<LargestSendBuffer> {
    #[allow(clippy::cast_possible_truncation)] // 64 MiB
    let most = MAX_BUFFER as libc::c_int;
    let most_bytes = u64::try_from(most).expect("positive");
    let largest = |bytes: Option<u32>, limit| {
        bytes.map(|bytes| LargestSendBuffer {
            bytes: u64::from(bytes),
            limit,
        })
    };
    if set_option(tcp, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, &most).is_ok() {
        return largest(send_buffer(tcp), SendBufferLimit::Asked);
    }
    let cap = sysctl_u64("/proc/sys/net/core/wmem_max");
    let autotuned = sysctl_u64("/proc/sys/net/ipv4/tcp_wmem");
    match (unforced_send_buffer(cap, autotuned), cap) {
        (Unforced::Autotune, _) => autotuned.map(|bytes| LargestSendBuffer {
            bytes,
            limit: SendBufferLimit::Autotuning,
        }),
        (Unforced::Set, Some(cap)) => Some(LargestSendBuffer {
            bytes: 2 * cap.min(most_bytes),
            limit: if cap < most_bytes {
                SendBufferLimit::HostCap
            } else {
                SendBufferLimit::Asked
            },
        }),
        (Unforced::Set, None) => {
            set_option(tcp, libc::SOL_SOCKET, libc::SO_SNDBUF, &most).ok()?;
            let bytes = send_buffer(tcp)?;
            let limit = if u64::from(bytes) < 2 * most_bytes {
                SendBufferLimit::HostCap
            } else {
                SendBufferLimit::Asked
            };
            largest(Some(bytes), limit)
        }
    }
}

/// Without `CAP_NET_ADMIN`, how a send buffer is best had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unforced {
    /// `SO_SNDBUF`: the size, or `net.core.wmem_max` if that is less, doubled by the kernel.
    Set,
    /// Nothing set: the kernel's autotuning grows the buffer up to `net.ipv4.tcp_wmem`'s
    /// maximum as the connection's window needs.
    Autotune,
}

/// `cap`: `net.core.wmem_max`; `autotuned`: `net.ipv4.tcp_wmem`'s maximum (`None`: unknown).
/// A set buffer stops at twice the cap, autotuning at its own maximum: where autotuning goes
/// further, nothing is set, whatever the size. On kernels whose `wmem_max` is 212992 bytes
/// (older ones) against autotuning's 4 MiB, setting it held every connection of an agent
/// without the capability to a 416 KiB buffer: by arithmetic under 70 Mbit/s at 50 ms, where a
/// single connection is meant to carry the link. A buffer within the cap could be set exactly,
/// but a set buffer stays locked against autotuning, and a parked connection is tuned again
/// for the next session's size: the choice depends on the host alone, so it is the same for
/// every tuning of a socket. The session's send window bounds what is in flight either way.
fn unforced_send_buffer(cap: Option<u64>, autotuned: Option<u64>) -> Unforced {
    match (cap, autotuned) {
        (Some(cap), Some(autotuned)) if autotuned > 2 * cap => Unforced::Autotune,
        _ => Unforced::Set,
    }
}

/// A sysctl's value, or its last field for one of several (`tcp_wmem`'s maximum).
fn sysctl_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// A socket's send buffer as the kernel sized it, bookkeeping included.
fn send_buffer(tcp: &impl AsRawFd) -> Option<u32> {
    buffer_size(tcp, libc::SO_SNDBUF)
}

/// A socket's buffer (`SO_SNDBUF` or `SO_RCVBUF`) as the kernel sized it.
fn buffer_size(socket: &impl AsRawFd, option: libc::c_int) -> Option<u32> {
    let mut value: libc::c_int = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).ok()?;
    // SAFETY: getsockopt writes at most `len` bytes into `value`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            std::ptr::from_mut(&mut value).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        u32::try_from(value).ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use caps::{CapSet, Capability};

    use super::*;

    /// A connected loopback socket (the listener's end is dropped: only options are read).
    fn loopback_socket() -> std::net::TcpStream {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect")
    }

    fn sysctl(path: &str) -> String {
        std::fs::read_to_string(path).unwrap_or_default()
    }

    fn receive_buffer(socket: &impl AsRawFd) -> u32 {
        buffer_size(socket, libc::SO_RCVBUF).expect("SO_RCVBUF")
    }

    #[test]
    fn a_receive_buffer_holds_the_link_at_the_longest_round_trip_within_bounds() {
        // 1 Gbit/s for 250 ms: 31.25 MB.
        assert_eq!(receive_buffer_for(1000.0), 31_250_000);
        assert_eq!(receive_buffer_for(0.001), 128 * 1024);
        assert_eq!(receive_buffer_for(1e6), 64 * 1024 * 1024);
    }

    #[test]
    fn the_receive_buffer_is_set_only_where_autotuning_stops_short_and_the_agent_may() {
        let autotuned: u64 = sysctl("/proc/sys/net/ipv4/tcp_rmem")
            .split_whitespace()
            .nth(2)
            .and_then(|max| max.parse().ok())
            .expect("tcp_rmem");
        for rate in [1.0, 10_000.0] {
            let socket = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
            let before = receive_buffer(&socket);
            set_receive_buffer_for_link(&socket, rate);
            let wanted = 2 * u64::from(receive_buffer_for(rate));
            let expected = if autotuned >= wanted || !has_net_admin() {
                before
            } else {
                u32::try_from(wanted).expect("small")
            };
            assert_eq!(receive_buffer(&socket), expected, "{rate} Mbit/s");
        }
        // A listener's connections take its buffer.
        if has_net_admin() && autotuned < 2 * u64::from(receive_buffer_for(10_000.0)) {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
            set_receive_buffer_for_link(&listener, 10_000.0);
            let _dialer = std::net::TcpStream::connect(listener.local_addr().expect("address"))
                .expect("connect");
            let (accepted, _) = listener.accept().expect("accept");
            assert_eq!(receive_buffer(&accepted), receive_buffer(&listener));
        }
    }

    #[test]
    fn without_the_capability_the_send_buffer_is_left_to_autotuning_where_it_goes_further() {
        const KIB: u64 = 1024;
        for (cap, autotuned, expected) in [
            // Twice 208 KiB set against 4 MiB autotuned.
            (Some(212_992), Some(4096 * KIB), Unforced::Autotune),
            // Twice the cap is as much as autotuning reaches, or more (this lab).
            (Some(4096 * KIB), Some(4096 * KIB), Unforced::Set),
            (Some(212_992), Some(300 * KIB), Unforced::Set),
            // Unknown sysctls: as before, set and see.
            (None, Some(4096 * KIB), Unforced::Set),
            (Some(212_992), None, Unforced::Set),
        ] {
            assert_eq!(
                unforced_send_buffer(cap, autotuned),
                expected,
                "cap {cap:?}, autotuned {autotuned:?}"
            );
        }
    }

    #[test]
    fn the_send_buffer_goes_past_the_hosts_cap_when_the_agent_may() {
        let socket = loopback_socket();
        let cap: u64 = sysctl("/proc/sys/net/core/wmem_max")
            .trim()
            .parse()
            .unwrap_or(0);
        let wanted: u32 = 4 * u32::try_from(cap).unwrap_or(u32::MAX / 8).max(1 << 20);
        let autotuned = sysctl_u64("/proc/sys/net/ipv4/tcp_wmem");
        // Without CAP_NET_ADMIN: the cap (doubled, as Linux doubles what it is given), or
        // the buffer untouched for autotuning.
        let unforced = move |before: u32| match unforced_send_buffer(Some(cap), autotuned) {
            Unforced::Set => u32::try_from(2 * cap).expect("small"),
            Unforced::Autotune => before,
        };
        let before = send_buffer(&socket).expect("SO_SNDBUF");
        set_send_buffer(&socket, wanted);
        let got = send_buffer(&socket).expect("SO_SNDBUF");
        let expected = if has_net_admin() {
            2 * wanted
        } else {
            unforced(before)
        };
        assert_eq!(got, expected);

        // The same on a thread without CAP_NET_ADMIN (capabilities are per thread).
        let unforced_thread = std::thread::spawn(move || {
            drop_net_admin();
            let socket = loopback_socket();
            let before = send_buffer(&socket).expect("SO_SNDBUF");
            set_send_buffer(&socket, wanted);
            (before, send_buffer(&socket).expect("SO_SNDBUF"))
        });
        let (before, got) = unforced_thread
            .join()
            .expect("the thread without CAP_NET_ADMIN");
        assert_eq!(got, unforced(before));
    }

    #[test]
    fn the_largest_send_buffer_is_what_the_agent_may_force_or_the_hosts_limit() {
        const FORCED_MOST: u64 = 64 << 20;
        let unforced = || {
            let cap = sysctl_u64("/proc/sys/net/core/wmem_max");
            let autotuned = sysctl_u64("/proc/sys/net/ipv4/tcp_wmem");
            match unforced_send_buffer(cap, autotuned) {
                Unforced::Set => cap.map(|cap| 2 * cap.min(FORCED_MOST)),
                Unforced::Autotune => autotuned,
            }
        };
        let bytes = |largest: Option<LargestSendBuffer>| largest.map(|l| l.bytes);
        let expected = if has_net_admin() {
            // Linux doubles what it is given.
            Some(2 * FORCED_MOST)
        } else {
            unforced()
        };
        let with = largest_send_buffer(&loopback_socket());
        assert_eq!(bytes(with), expected);
        if has_net_admin() {
            assert_eq!(with.map(|l| l.limit), Some(SendBufferLimit::Asked));
        }
        let without = std::thread::spawn(move || {
            drop_net_admin();
            largest_send_buffer(&loopback_socket())
        });
        let got = without.join().expect("the thread without CAP_NET_ADMIN");
        assert_eq!(bytes(got), unforced());
        // A host whose cap is below what the agent asks (this lab's: 4 MiB) holds it there.
        if sysctl_u64("/proc/sys/net/core/wmem_max").is_some_and(|cap| cap < FORCED_MOST) {
            assert_ne!(
                got.map(|l| l.limit),
                Some(SendBufferLimit::Asked),
                "{got:?}"
            );
        }
    }

    /// Whether this thread may force buffers past the host's caps (not whether it is root: a
    /// container's root may lack it).
    fn has_net_admin() -> bool {
        caps::has_cap(None, CapSet::Effective, Capability::CAP_NET_ADMIN).expect("capget")
    }

    /// Takes CAP_NET_ADMIN out of this thread's effective capabilities (they are per thread).
    fn drop_net_admin() {
        caps::drop(None, CapSet::Effective, Capability::CAP_NET_ADMIN).expect("capset");
        assert!(!has_net_admin());
    }
}
