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
/// off. `SO_RCVBUF` is capped at `net.core.rmem_max` (4 MiB here and by default), less than
/// autotuning reaches, so only an agent with `CAP_NET_ADMIN` (root, `SO_RCVBUFFORCE`) sets it;
/// one without is told once what limits it.
pub fn set_receive_buffer_for_link(socket: &impl AsRawFd, rate_mbit: f64) {
    let wanted = receive_buffer_for(rate_mbit);
    let autotuned = autotuned_receive_max();
    if autotuned.is_some_and(|max| u64::from(max) >= 2 * u64::from(wanted)) {
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

/// How far Linux autotunes a connection's receive buffer in this network namespace:
/// `net.ipv4.tcp_rmem`'s maximum.
fn autotuned_receive_max() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_rmem")
        .ok()?
        .split_whitespace()
        .nth(2)?
        .parse()
        .ok()
}

/// Sets a connection's send buffer to `size` bytes. `SO_SNDBUF` is capped at
/// `net.core.wmem_max` (4 MiB by default: an 8 MiB buffer once Linux doubles it, a third of a
/// 1 Gbit/s, 200 ms link's bandwidth-delay product, so one connection would carry a third of
/// the link). An agent with `CAP_NET_ADMIN` (root) goes past the cap with `SO_SNDBUFFORCE`;
/// one without is told once what limits it.
pub(crate) fn set_send_buffer(tcp: &impl AsRawFd, size: u32) {
    let value = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    if set_option(tcp, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, &value).is_ok() {
        return;
    }
    if let Err(e) = set_option(tcp, libc::SOL_SOCKET, libc::SO_SNDBUF, &value) {
        tracing::warn!("SO_SNDBUF {size}: {e}");
        return;
    }
    static CAPPED_ONCE: std::sync::Once = std::sync::Once::new();
    // Linux reports twice what it was asked, its bookkeeping included.
    if let Some(got) = send_buffer(tcp).filter(|got| u64::from(*got) < 2 * u64::from(size)) {
        CAPPED_ONCE.call_once(|| {
            tracing::warn!(
                "the send buffer is capped at {got} bytes, not the {} this link needs: \
                 raise net.core.wmem_max or run the agent with CAP_NET_ADMIN",
                2 * u64::from(size)
            );
        });
    }
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
    use super::*;

    /// A connected loopback socket (the listener's end is dropped: only options are read).
    fn loopback_socket() -> std::net::TcpStream {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect")
    }

    fn sysctl(path: &str) -> String {
        std::fs::read_to_string(path).unwrap_or_default()
    }

    fn root() -> bool {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        uid == 0
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
            let expected = if autotuned >= wanted || !root() {
                before
            } else {
                u32::try_from(wanted).expect("small")
            };
            assert_eq!(receive_buffer(&socket), expected, "{rate} Mbit/s");
        }
        // A listener's connections take its buffer.
        if root() && autotuned < 2 * u64::from(receive_buffer_for(10_000.0)) {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
            set_receive_buffer_for_link(&listener, 10_000.0);
            let _dialer = std::net::TcpStream::connect(listener.local_addr().expect("address"))
                .expect("connect");
            let (accepted, _) = listener.accept().expect("accept");
            assert_eq!(receive_buffer(&accepted), receive_buffer(&listener));
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
        set_send_buffer(&socket, wanted);
        let got = u64::from(send_buffer(&socket).expect("SO_SNDBUF"));
        // Linux doubles what it is given; without CAP_NET_ADMIN it stops at the cap.
        let expected = if root() {
            2 * u64::from(wanted)
        } else {
            2 * cap
        };
        assert_eq!(got, expected);
    }
}
