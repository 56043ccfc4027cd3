//! Connections: dialing a peer agent (TCP, socket buffers sized to the link, TLS, Hello) and
//! keeping N of them up for a session, reconnecting after drops until the session ends.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::session::{exchange_hello, read_hello, Hello, Session, SessionError};

/// How long sent data may stay unacknowledged before the kernel gives the connection up.
/// Without it a connection into a black-holed WAN keeps retransmitting, with exponential
/// backoff, for many minutes, and resumes up to a minute after the WAN is back; with it the
/// connection fails, the session redials every 500 ms and replays as soon as the WAN answers.
pub const USER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one TCP connect may wait for the peer's answer. Into a dead WAN the kernel
/// retransmits a SYN after 1 s, then 3 s, then 7 s; a fresh attempt every 2.5 s (this plus
/// the redial interval) instead means a returning WAN is found within about 1.5 s. Far above
/// any terrestrial round trip.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

fn tcp_user_timeout(socket: &impl AsRawFd, timeout: Duration) {
    let ms = libc::c_uint::try_from(timeout.as_millis()).unwrap_or(libc::c_uint::MAX);
    if let Err(e) = set_option(socket, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, &ms) {
        tracing::warn!("TCP_USER_TIMEOUT: {e}");
    }
}

fn set_option<T>(
    socket: &impl AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: &T,
) -> std::io::Result<()> {
    // SAFETY: setsockopt on a socket we own, with a pointer to a live T and its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            std::ptr::from_ref(value).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<T>()).expect("small option"),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The round trip the kernel measured for a fresh connection (its SYN and SYN-ACK): the
/// first RTT sample there is, taken before any data has queued anywhere.
fn handshake_rtt(tcp: &impl AsRawFd) -> Option<Duration> {
    // SAFETY: tcp_info is plain old data; all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::tcp_info>()).ok()?;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, which is that large.
    let rc = unsafe {
        libc::getsockopt(
            tcp.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &mut len,
        )
    };
    (rc == 0 && info.tcpi_rtt > 0).then(|| Duration::from_micros(u64::from(info.tcpi_rtt)))
}

/// Where and how to reach the peer.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The name its certificate must carry.
    pub name: String,
    pub tls: Arc<ClientConfig>,
    /// Connections to keep open.
    pub connections: u32,
    /// The link's rate, when known: each connection's send buffer is then sized from it and
    /// the round trip TCP measured during its handshake. `None` leaves Linux's autotuning alone.
    pub link_rate_mbit: Option<f64>,
}

/// The send buffer for one of `connections` connections on a link of `rate_mbit` and
/// `rtt_ms`: twice the connection's share of the bandwidth-delay product, so that one lost
/// segment does not stall it, and at least 128 KiB (Linux doubles it for its bookkeeping).
pub fn socket_buffer_for(rate_mbit: f64, rtt_ms: f64, connections: u32) -> u32 {
    let bdp = rate_mbit * 1e6 / 8.0 * rtt_ms / 1e3;
    let share = 2.0 * bdp / f64::from(connections.max(1));
    // Bounded above by 64 MiB: an absurd hint must not pin absurd kernel memory.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // clamped to u32 range
    let size = share.clamp(128.0 * 1024.0, 64.0 * 1024.0 * 1024.0) as u32;
    size
}

/// The pace of one of `connections` connections on a link of `rate_mbit`, bytes per second:
/// its share of the link, a little under it. Without pacing, TCP sends bursts at the host's
/// speed into the WAN's bottleneck queue; when QEMU stops the VM and dumps its last pages the
/// burst overflows the queue, and a loss among the stream's last segments has no later segment
/// to reveal it, so only a retransmission timeout (0.8 s measured) recovers it, inside the VM's
/// pause.
pub fn pacing_rate_for(rate_mbit: f64, connections: u32) -> u64 {
    let share = rate_mbit * 1e6 / 8.0 * PACING_SHARE / f64::from(connections.max(1));
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // positive, far below u64
    let rate = share.max(1e5) as u64;
    rate
}

/// The fraction of the link the pace allows: headroom for the framing the link counts and TCP's
/// pacing does not (Ethernet headers: about 1%).
const PACING_SHARE: f64 = 0.98;

/// Opens one connection of `session` to `peer`: TCP, TLS (the peer must present a certificate
/// for `peer.name` from our CA, and gets ours), then Hellos both ways. Returns the stream, the
/// bytes that followed the peer's Hello, and the Hello round trip.
pub async fn dial(
    session: &Session,
    peer: &Peer,
    connection: u32,
    timeout: Duration,
) -> Result<
    (
        tokio_rustls::client::TlsStream<TcpStream>,
        BytesMut,
        Duration,
    ),
    SessionError,
> {
    let io = |what: &str, e: &dyn std::fmt::Display| {
        SessionError::Io(format!("{what} {} ({}): {e}", peer.addr, peer.name))
    };
    let socket = if peer.addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .map_err(|e| io("socket for", &e))?;
    tcp_user_timeout(&socket, USER_TIMEOUT);
    let connect_timeout = timeout.min(CONNECT_TIMEOUT);
    let tcp = tokio::time::timeout(connect_timeout, socket.connect(peer.addr))
        .await
        .map_err(|_| {
            io(
                "connecting to",
                &format!("no answer within {connect_timeout:?}"),
            )
        })?
        .map_err(|e| io("connecting to", &e))?;
    let _ = tcp.set_nodelay(true);
    if let Some(rate) = peer.link_rate_mbit {
        // The send buffer may change at any time; the receive side (the peer's) autotunes.
        let rtt_ms = handshake_rtt(&tcp).map_or(100.0, |rtt| rtt.as_secs_f64() * 1e3);
        let size = socket_buffer_for(rate, rtt_ms, peer.connections);
        let value = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
        if let Err(e) = set_option(&tcp, libc::SOL_SOCKET, libc::SO_SNDBUF, &value) {
            tracing::warn!("SO_SNDBUF {size}: {e}");
        }
        let pace = pacing_rate_for(rate, peer.connections);
        if let Err(e) = set_option(&tcp, libc::SOL_SOCKET, libc::SO_MAX_PACING_RATE, &pace) {
            tracing::warn!("SO_MAX_PACING_RATE {pace}: {e}");
        }
    }
    let name = ServerName::try_from(peer.name.clone()).map_err(|e| io("peer name of", &e))?;
    let mut tls = tokio::time::timeout(
        timeout,
        TlsConnector::from(peer.tls.clone()).connect(name, tcp),
    )
    .await
    .map_err(|_| {
        io(
            "TLS handshake with",
            &format!("no answer within {timeout:?}"),
        )
    })?
    .map_err(|e| io("TLS handshake with", &tls_hint(&e)))?;
    let start = Instant::now();
    let (theirs, leftover) = exchange_hello(&mut tls, &session.hello(connection), timeout).await?;
    let rtt = start.elapsed();
    session.accept_hello(&theirs)?;
    Ok((tls, leftover, rtt))
}

/// rustls's errors name the check that failed; say what it means for an operator.
fn tls_hint(e: &std::io::Error) -> String {
    let text = e.to_string();
    if text.contains("UnknownIssuer") || text.contains("BadSignature") {
        format!("{text} (the peer's certificate is not signed by this agent's CA)")
    } else if text.contains("NotValidForName") || text.contains("not valid for name") {
        format!("{text} (the peer's certificate names another agent)")
    } else if text.contains("CertificateRequired")
        || text.contains("certificate unknown")
        || text.contains("UnknownCA")
        || text.contains("unknown ca")
    {
        format!("{text} (the peer refused our certificate: it trusts another CA)")
    } else {
        text
    }
}

/// What the connection keeper reports.
#[derive(Debug, Clone)]
pub enum LinkEvent {
    Connected { connection: u32, rtt: Duration },
    Lost { connection: u32, error: String },
    DialFailed { connection: u32, error: String },
}

/// Keeps `peer.connections` connections of `session` up until the session fails, redialing
/// every `retry` after a drop. Each event goes to `events`.
pub fn keep_connected(
    session: Session,
    peer: Peer,
    retry: Duration,
    events: tokio::sync::mpsc::UnboundedSender<LinkEvent>,
) -> tokio::task::JoinSet<()> {
    let mut set = tokio::task::JoinSet::new();
    for connection in 0..peer.connections {
        let (session, peer, events) = (session.clone(), peer.clone(), events.clone());
        set.spawn(async move {
            while session.failure().is_none() {
                match dial(&session, &peer, connection, Duration::from_secs(10)).await {
                    Ok((stream, leftover, rtt)) => {
                        let _ = events.send(LinkEvent::Connected { connection, rtt });
                        let error = session.run_connection(stream, leftover).await;
                        if session.failure().is_some() {
                            break;
                        }
                        let _ = events.send(LinkEvent::Lost {
                            connection,
                            error: error.to_string(),
                        });
                    }
                    Err(e) => {
                        let _ = events.send(LinkEvent::DialFailed {
                            connection,
                            error: e.to_string(),
                        });
                    }
                }
                tokio::time::sleep(retry).await;
            }
        });
    }
    set
}

/// The listening side of one accepted TCP connection: TLS (the dialer must present a
/// certificate from our CA), then its Hello. The caller finds or creates the session the
/// Hello names and hands the rest to [`answer`].
pub async fn accept(
    tcp: TcpStream,
    tls: Arc<ServerConfig>,
    timeout: Duration,
) -> Result<(tokio_rustls::server::TlsStream<TcpStream>, Hello, BytesMut), SessionError> {
    let _ = tcp.set_nodelay(true);
    let peer = tcp
        .peer_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    let mut stream = tokio::time::timeout(timeout, TlsAcceptor::from(tls).accept(tcp))
        .await
        .map_err(|_| {
            SessionError::Io(format!(
                "TLS handshake from {peer}: no answer within {timeout:?}"
            ))
        })?
        .map_err(|e| SessionError::Io(format!("TLS handshake from {peer}: {}", tls_hint(&e))))?;
    let (hello, leftover) = tokio::time::timeout(timeout, read_hello(&mut stream))
        .await
        .map_err(|_| SessionError::Io(format!("no Hello from {peer} within {timeout:?}")))??;
    Ok((stream, hello, leftover))
}

/// Completes an accepted connection for `session`: applies the dialer's Hello, answers with
/// ours, and carries the session until the connection ends.
pub async fn answer(
    session: &Session,
    mut stream: tokio_rustls::server::TlsStream<TcpStream>,
    hello: &Hello,
    leftover: BytesMut,
) -> SessionError {
    use tokio::io::AsyncWriteExt;
    if let Err(e) = session.accept_hello(hello) {
        return e;
    }
    let mut out = BytesMut::new();
    session.hello(hello.connection).frame().encode(&mut out);
    if let Err(e) = stream.write_all(&out).await {
        return SessionError::Io(e.to_string());
    }
    session.run_connection(stream, leftover).await
}
