//! Connections: dialing a peer agent (TCP, socket buffers sized to the link, TLS, Hello) and
//! keeping N of them up for a session, reconnecting after drops until the session ends; and
//! the [`Pool`] of parked connections a session leaves behind for the next one to the same peer.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::buffers::{set_receive_buffer_for_link, set_send_buffer, socket_buffer_for};
use crate::connection_count::ConnectionCount;
use crate::frame::Frame;
use crate::session::{
    exchange_hello, read_hello, read_hello_after, ConnectionEnd, Hello, Session, SessionError,
};

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

/// Puts a WAN connection under BBR, whatever the host's default. ferry owns this hop: a
/// loss-based default (CUBIC, Debian's) reads every random loss on a long path as congestion
/// and halves its rate (at 0.1% loss and 250 ms it would carry a few Mbit/s), while BBR paces
/// at the bottleneck rate it measures. Where BBR is not available (no `tcp_bbr` module, and
/// no right to load it) the host's default stays, said once.
fn prefer_bbr(socket: &impl AsRawFd) {
    if let Err(e) = set_option(socket, libc::IPPROTO_TCP, libc::TCP_CONGESTION, b"bbr") {
        static SAID_ONCE: std::sync::Once = std::sync::Once::new();
        SAID_ONCE.call_once(|| {
            tracing::warn!("TCP_CONGESTION bbr: {e}; the host's default congestion control stays");
        });
    }
}

pub(crate) fn set_option<T>(
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

/// The round trip the kernel measured: on a fresh connection its SYN and SYN-ACK, the first
/// sample there is, taken before any data has queued anywhere; on a parked one, what it
/// measured while it last carried a session.
fn tcp_rtt(tcp: &impl AsRawFd) -> Option<Duration> {
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

/// A parked connection is used again for at most this long after it parked. The listening
/// side waits [`PARKED_IDLE_LIMIT`], longer, so a connection taken just before this age runs
/// out is still there at the other end.
pub const POOL_MAX_IDLE: Duration = Duration::from_secs(300);
/// How long the listening side keeps a parked connection waiting for the next Hello.
pub const PARKED_IDLE_LIMIT: Duration = Duration::from_secs(600);
/// Parked connections kept per peer: as many as two sessions open at most by default (the
/// relay's tunnels may end together).
const POOL_MAX_PER_PEER: usize = 2 * crate::connection_count::MAX_AUTO_CONNECTIONS as usize;
/// How long a parked connection may take to answer a new session's Hello before it is
/// dropped and a fresh one dialed: a peer that closed it answers at once, with a reset.
const WARM_HELLO_TIMEOUT: Duration = Duration::from_secs(2);
/// Padding sent ahead of the Hello on a parked connection, in a `Park` frame the peer skips.
/// After more than 10 s idle, BBR's minimum-RTT estimate has expired; the acknowledgement of
/// a lone small segment (the Hello alone) may be a delayed one, which BBR does not take as a
/// sample, and its next acknowledgement then sends it into PROBE_RTT: four segments in flight
/// for 200 ms, measured as a 200 ms stall at the start of a warm migration. Three segments'
/// worth is acknowledged at once and refreshes the estimate.
const WARM_PADDING: usize = 4096;

/// The client side of a connection to a peer agent.
pub type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;

/// Connections that finished a session cleanly (both sides sent `Park`), kept for the next
/// session to the same peer. One reused skips TCP's and TLS's handshakes (two round trips) and
/// keeps the congestion state it had: Linux's BBR does not restart from its initial window
/// after idle, so a migration on a warm connection starts at the link's rate instead of
/// spending its first few hundred milliseconds in slow start.
#[derive(Debug, Default)]
pub struct Pool {
    idle: Mutex<HashMap<PeerKey, Vec<(ClientStream, Instant)>>>,
}

/// A peer's address and the name its certificate carries.
type PeerKey = (SocketAddr, String);

impl Pool {
    pub fn new() -> Arc<Pool> {
        Arc::new(Pool::default())
    }

    /// The most recently parked connection to `peer` that is young enough, if any.
    fn take(&self, peer: &Peer) -> Option<(ClientStream, Duration)> {
        let mut idle = self.idle.lock().expect("pool lock");
        let parked = idle.get_mut(&(peer.addr, peer.name.clone()))?;
        parked.retain(|(_, since)| since.elapsed() < POOL_MAX_IDLE);
        parked
            .pop()
            .map(|(stream, since)| (stream, since.elapsed()))
    }

    fn put(&self, peer: &Peer, stream: ClientStream) {
        let mut idle = self.idle.lock().expect("pool lock");
        let parked = idle.entry((peer.addr, peer.name.clone())).or_default();
        parked.push((stream, Instant::now()));
        if parked.len() > POOL_MAX_PER_PEER {
            parked.remove(0);
        }
    }

    /// Parked connections to every peer; those too old to be used are closed first.
    pub fn parked_total(&self) -> usize {
        let mut idle = self.idle.lock().expect("pool lock");
        idle.retain(|_, parked| {
            parked.retain(|(_, since)| since.elapsed() < POOL_MAX_IDLE);
            !parked.is_empty()
        });
        idle.values().map(Vec::len).sum()
    }

    /// Parked connections to `peer` (for tests and reports).
    pub fn parked(&self, peer: &Peer) -> usize {
        self.idle
            .lock()
            .expect("pool lock")
            .get(&(peer.addr, peer.name.clone()))
            .map_or(0, Vec::len)
    }
}

/// Where and how to reach the peer.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// The name its certificate must carry.
    pub name: String,
    pub tls: Arc<ClientConfig>,
    /// Connections to keep open, shared by the session's dialers.
    pub connections: ConnectionCount,
    /// The link's rate, when known: each connection's send buffer is then sized from it and
    /// the round trip TCP measured during its handshake. `None` leaves Linux's autotuning alone.
    pub link_rate_mbit: Option<f64>,
    /// Parked connections: a dial takes one from here first, and parked ones go back.
    pub pool: Arc<Pool>,
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

/// A connection [`dial`] opened.
#[derive(Debug)]
pub struct Dialed {
    pub stream: ClientStream,
    /// What followed the peer's Hello.
    pub leftover: BytesMut,
    /// The connection's round trip (the Hellos', or TCP's own measure when they were not
    /// exchanged).
    pub rtt: Duration,
    /// How long it had been parked, when it came from the pool.
    pub warm: Option<Duration>,
    /// Only our Hello went out: the peer's is the first frame to read (carry it with
    /// [`Session::run_connection_before_hello`]).
    pub hello_due: bool,
}

impl Dialed {
    /// Carries `session` over this connection until it ends.
    pub async fn carry(self, session: &Session) -> ConnectionEnd<ClientStream> {
        if self.hello_due {
            session.run_connection_before_hello(self.stream).await
        } else {
            session.run_connection(self.stream, self.leftover).await
        }
    }
}

/// Listens for peers on `address` (`host:port`), each connection's receive buffer sized for
/// the fastest of their links when one is known ([`set_receive_buffer_for_link`]).
pub async fn listen(
    address: &str,
    fastest_link_mbit: Option<f64>,
) -> std::io::Result<tokio::net::TcpListener> {
    let addr = tokio::net::lookup_host(address)
        .await?
        .next()
        .ok_or_else(|| std::io::Error::other("the name has no address"))?;
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }?;
    socket.set_reuseaddr(true)?;
    if let Some(rate) = fastest_link_mbit {
        set_receive_buffer_for_link(&socket, rate);
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Opens one connection of `session` to `peer`: a parked one from the pool when there is one,
/// else TCP and TLS (the peer must present a certificate for `peer.name` from our CA, and gets
/// ours); then the Hellos. A fresh session does not wait for the peer's Hello (nothing to
/// replay depends on it): what it queued, the destination's Prepare, goes out with ours.
pub async fn dial(
    session: &Session,
    peer: &Peer,
    connection: u32,
    timeout: Duration,
) -> Result<Dialed, SessionError> {
    let pipelined = session.is_fresh();
    while let Some((mut stream, parked_for)) = peer.pool.take(peer) {
        tune_socket(stream.get_ref().0, peer);
        if let Err(e) = send_frame(&mut stream, &Frame::park_padded(WARM_PADDING)).await {
            tracing::debug!("parked connection to {} is gone: {e}", peer.addr);
            continue;
        }
        if pipelined {
            // A parked connection the peer closed shows when the session reads from it; the
            // keeper then dials again at once.
            match send_hello(&mut stream, session, connection).await {
                Ok(()) => {
                    return Ok(Dialed {
                        rtt: tcp_rtt(stream.get_ref().0).unwrap_or_default(),
                        stream,
                        leftover: BytesMut::new(),
                        warm: Some(parked_for),
                        hello_due: true,
                    })
                }
                Err(e) => {
                    tracing::debug!("parked connection to {} is gone: {e}", peer.addr);
                    continue;
                }
            }
        }
        let start = Instant::now();
        let hello = session.hello(connection);
        match exchange_hello(&mut stream, &hello, timeout.min(WARM_HELLO_TIMEOUT)).await {
            Ok((theirs, leftover)) => {
                let rtt = start.elapsed();
                session.accept_hello(&theirs)?;
                return Ok(Dialed {
                    stream,
                    leftover,
                    rtt,
                    warm: Some(parked_for),
                    hello_due: false,
                });
            }
            Err(e) => tracing::debug!(
                "parked connection to {} ({}) is gone: {e}",
                peer.addr,
                peer.name
            ),
        }
    }
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
    prefer_bbr(&socket);
    if let Some(rate) = peer.link_rate_mbit {
        set_receive_buffer_for_link(&socket, rate);
    }
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
    tune_socket(&tcp, peer);
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
    if pipelined {
        send_hello(&mut tls, session, connection).await?;
        return Ok(Dialed {
            rtt: tcp_rtt(tls.get_ref().0).unwrap_or_default(),
            stream: tls,
            leftover: BytesMut::new(),
            warm: None,
            hello_due: true,
        });
    }
    let start = Instant::now();
    let (theirs, leftover) = exchange_hello(&mut tls, &session.hello(connection), timeout).await?;
    let rtt = start.elapsed();
    session.accept_hello(&theirs)?;
    Ok(Dialed {
        stream: tls,
        leftover,
        rtt,
        warm: None,
        hello_due: false,
    })
}

async fn send_hello(
    stream: &mut ClientStream,
    session: &Session,
    connection: u32,
) -> Result<(), SessionError> {
    send_frame(stream, &session.hello(connection).frame()).await
}

async fn send_frame<S>(stream: &mut S, frame: &Frame) -> Result<(), SessionError>
where
    S: tokio::io::AsyncWrite + Unpin,
{
    let mut out = BytesMut::new();
    frame.encode(&mut out);
    crate::session::write_out(stream, &out).await
}

/// Sizes a connection's send buffer and pace for `peer`'s link, when its rate is known, as one
/// of the session's connections (the first decides how many, see `connection_count`). The
/// send buffer may change at any time (so a parked connection is tuned again for the session
/// that takes it); the receive side was sized before the handshake (`listen`, and `dial`
/// for what the peer sends back).
fn tune_socket(tcp: &TcpStream, peer: &Peer) {
    let rtt_ms = tcp_rtt(tcp).map_or(100.0, |rtt| rtt.as_secs_f64() * 1e3);
    let connections = peer.connections.decide(tcp, peer.link_rate_mbit, rtt_ms);
    let Some(rate) = peer.link_rate_mbit else {
        return;
    };
    let size = socket_buffer_for(rate, rtt_ms, connections);
    set_send_buffer(tcp, size);
    let pace = pacing_rate_for(rate, connections);
    if let Err(e) = set_option(tcp, libc::SOL_SOCKET, libc::SO_MAX_PACING_RATE, &pace) {
        tracing::warn!("SO_MAX_PACING_RATE {pace}: {e}");
    }
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
    Connected {
        connection: u32,
        rtt: Duration,
        /// How long the connection had been parked, when it came from the pool.
        warm: Option<Duration>,
    },
    Lost {
        connection: u32,
        error: String,
    },
    DialFailed {
        connection: u32,
        error: String,
    },
}

/// Keeps `peer.connections` connections of `session` up until the session fails or parks,
/// redialing every `retry` after a drop; parked connections go to `peer.pool`. Connection 0
/// is dialed first: the others once it decided how many there are. Each event goes to
/// `events`.
pub fn keep_connected(
    session: Session,
    peer: Peer,
    retry: Duration,
    events: tokio::sync::mpsc::UnboundedSender<LinkEvent>,
) -> tokio::task::JoinSet<()> {
    let mut set = tokio::task::JoinSet::new();
    set.spawn(keep_one(
        session.clone(),
        peer.clone(),
        0,
        retry,
        events.clone(),
    ));
    set.spawn(async move {
        let count = peer.connections.decided().await;
        let mut rest = tokio::task::JoinSet::new();
        for connection in 1..count {
            rest.spawn(keep_one(
                session.clone(),
                peer.clone(),
                connection,
                retry,
                events.clone(),
            ));
        }
        // Dropping `rest` would end them: they live as long as this task.
        while rest.join_next().await.is_some() {}
    });
    set
}

/// Keeps connection `connection` of `session` up (see [`keep_connected`]).
async fn keep_one(
    session: Session,
    peer: Peer,
    connection: u32,
    retry: Duration,
    events: tokio::sync::mpsc::UnboundedSender<LinkEvent>,
) {
    while session.failure().is_none() && !session.is_parking() {
        match dial(&session, &peer, connection, Duration::from_secs(10)).await {
            Ok(d) => {
                let warm = d.warm.is_some();
                let _ = events.send(LinkEvent::Connected {
                    connection,
                    rtt: d.rtt,
                    warm: d.warm,
                });
                let error = match d.carry(&session).await {
                    // Bytes after the peer's Park break the protocol: not reusable.
                    ConnectionEnd::Parked(stream, rest) if rest.is_empty() => {
                        peer.pool.put(&peer, stream);
                        break;
                    }
                    ConnectionEnd::Parked(..) => {
                        SessionError::Protocol("bytes after the peer's Park".into())
                    }
                    ConnectionEnd::Lost(e) => e,
                };
                if session.failure().is_some() || session.is_parking() {
                    break;
                }
                let _ = events.send(LinkEvent::Lost {
                    connection,
                    error: error.to_string(),
                });
                if warm {
                    // A parked connection failing says nothing about the WAN.
                    continue;
                }
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
    prefer_bbr(&tcp);
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

/// The server side of a connection from a peer agent.
pub type ServerStream = tokio_rustls::server::TlsStream<TcpStream>;

/// Completes an accepted connection for `session`: applies the dialer's Hello, answers with
/// ours, and carries the session until the connection ends. A parked connection comes back
/// for [`next_hello`].
pub async fn answer(
    session: &Session,
    mut stream: ServerStream,
    hello: &Hello,
    leftover: BytesMut,
) -> ConnectionEnd<ServerStream> {
    if let Err(e) = session.accept_hello(hello) {
        return ConnectionEnd::Lost(e);
    }
    if let Err(e) = send_frame(&mut stream, &session.hello(hello.connection).frame()).await {
        return ConnectionEnd::Lost(e);
    }
    session.run_connection(stream, leftover).await
}

/// Waits on a parked connection for the dialer's next session (its Hello), at most
/// [`PARKED_IDLE_LIMIT`]. The dialer closing it, which it does once it is too old to use, ends
/// the wait with an error.
pub async fn next_hello(
    mut stream: ServerStream,
    leftover: BytesMut,
) -> Result<(ServerStream, Hello, BytesMut), SessionError> {
    let (hello, rest) =
        tokio::time::timeout(PARKED_IDLE_LIMIT, read_hello_after(&mut stream, leftover))
            .await
            .map_err(|_| {
                SessionError::Io(format!(
                    "parked connection unused for {PARKED_IDLE_LIMIT:?}"
                ))
            })??;
    Ok((stream, hello, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected loopback socket (the listener's end is dropped: only options are read).
    fn loopback_socket() -> std::net::TcpStream {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect")
    }

    fn congestion_control(socket: &impl AsRawFd) -> String {
        let mut name = [0u8; 16];
        let mut len = libc::socklen_t::try_from(name.len()).expect("small");
        // SAFETY: getsockopt writes at most `len` bytes into `name`, which is that large.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_CONGESTION,
                name.as_mut_ptr().cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        let end = name.iter().position(|b| *b == 0).unwrap_or(name.len());
        String::from_utf8_lossy(&name[..end]).into_owned()
    }

    fn sysctl(path: &str) -> String {
        std::fs::read_to_string(path).unwrap_or_default()
    }

    #[test]
    fn a_wan_connection_runs_bbr_where_the_host_offers_it() {
        let socket = loopback_socket();
        // Reno is always built in: start from a loss-based one whatever the host's default.
        set_option(&socket, libc::IPPROTO_TCP, libc::TCP_CONGESTION, b"reno").expect("reno");
        let before = congestion_control(&socket);
        assert_eq!(before, "reno");
        prefer_bbr(&socket);
        let offered = sysctl("/proc/sys/net/ipv4/tcp_available_congestion_control");
        let expected = if offered.split_whitespace().any(|cc| cc == "bbr") {
            "bbr".to_owned()
        } else {
            before
        };
        assert_eq!(congestion_control(&socket), expected);
    }
}
