//! A session that finished parks its connection, and the next session to the same peer runs on
//! it (no TCP or TLS handshake); a parked connection the peer closed meanwhile is noticed and a
//! fresh one dialed instead. Where one connection cannot hold the link, the session opens as
//! many as it needs, and all of them park.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use caps::{CapSet, Capability};
use ferry_lab::pki;
use ferry_wire::connection_count::{ConnectionCount, MAX_AUTO_CONNECTIONS};
use ferry_wire::net::{accept, answer, keep_connected, next_hello, LinkEvent, Peer, Pool};
use ferry_wire::tls::ServerConfig;
use ferry_wire::{ChannelId, ConnectionEnd, Received, Session, SessionConfig, SessionId};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

const CH: ChannelId = ChannelId(1);

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferry-warm-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The listening agent, reduced to its connection handling: every accepted connection serves
/// one session after another, as `server.rs` does; each session echoes what it receives. With
/// `close_parked`, a parked connection is closed instead of waiting for the next Hello.
async fn listen(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    accepted: Arc<Mutex<u32>>,
    close_parked: bool,
) {
    let sessions: Arc<Mutex<HashMap<SessionId, Session>>> = Arc::default();
    loop {
        let (tcp, _) = listener.accept().await.unwrap();
        *accepted.lock().unwrap() += 1;
        let (tls, sessions) = (tls.clone(), sessions.clone());
        tokio::spawn(async move {
            let Ok((mut stream, mut hello, mut left)) =
                accept(tcp, tls, Duration::from_secs(5)).await
            else {
                return;
            };
            loop {
                let session = sessions
                    .lock()
                    .unwrap()
                    .entry(hello.session)
                    .or_insert_with(|| {
                        let s = Session::new(hello.session, SessionConfig::default());
                        tokio::spawn(echo(s.clone()));
                        s
                    })
                    .clone();
                let ConnectionEnd::Parked(parked, rest) =
                    answer(&session, stream, &hello, left).await
                else {
                    return;
                };
                if close_parked {
                    return;
                }
                let Ok(next) = next_hello(parked, rest).await else {
                    return;
                };
                (stream, hello, left) = next;
            }
        });
    }
}

/// Sends back every message received on `CH`.
async fn echo(s: Session) {
    while let Ok(Received::Data(b)) = s.recv(CH).await {
        if s.send(CH, b).await.is_err() {
            return;
        }
    }
}

/// One session from the dialer: sends `msgs` messages, checks they come back, parks. Returns
/// whether its connection came from the pool.
async fn one_session(peer: &Peer, msgs: usize) -> bool {
    let session = Session::new(SessionId::random(), SessionConfig::default());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _keeper = keep_connected(session.clone(), peer.clone(), Duration::from_millis(50), tx);
    for i in 0..msgs {
        session
            .send(
                CH,
                Bytes::from(vec![u8::try_from(i % 251).unwrap(); 1000 + i]),
            )
            .await
            .unwrap();
    }
    for i in 0..msgs {
        let Received::Data(b) = session.recv(CH).await.unwrap() else {
            panic!("a barrier nobody sent");
        };
        assert_eq!(b.len(), 1000 + i, "message {i} came back whole");
        assert!(b.iter().all(|&x| usize::from(x) == i % 251));
    }
    session.park();
    tokio::time::timeout(Duration::from_secs(5), session.parked())
        .await
        .expect("both sides park within a round trip or two")
        .unwrap();
    session.fail("done");
    let mut warm = None;
    while let Ok(ev) = rx.try_recv() {
        if let LinkEvent::Connected { warm: w, .. } = ev {
            warm = Some(w.is_some());
        }
    }
    warm.expect("a connection was up")
}

fn peer_for(tag: &str, close_parked: bool) -> (Peer, Arc<Mutex<u32>>, PathBuf) {
    let pki_dir = dir(tag);
    pki::create_with(&pki_dir, &["site-a".to_owned(), "site-b".to_owned()]).unwrap();
    let server_tls = pki::identity(&pki_dir, "site-b").server_config().unwrap();
    let client_tls = pki::identity(&pki_dir, "site-a").client_config().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(Mutex::new(0));
    tokio::spawn(listen(
        TcpListener::from_std(listener).unwrap(),
        server_tls,
        accepted.clone(),
        close_parked,
    ));
    let peer = Peer {
        addr,
        name: "site-b".into(),
        tls: client_tls,
        connections: ConnectionCount::fixed(1),
        link_rate_mbit: Some(100.0),
        pool: Pool::new(),
    };
    (peer, accepted, pki_dir)
}

#[tokio::test]
async fn the_next_session_runs_on_the_parked_connection() {
    let (peer, accepted, pki_dir) = peer_for("reuse", false);
    assert!(!one_session(&peer, 50).await, "the first session dials");
    assert_eq!(peer.pool.parked(&peer), 1, "its connection parked");
    for _ in 0..3 {
        assert!(one_session(&peer, 200).await, "later sessions run warm");
    }
    assert_eq!(
        *accepted.lock().unwrap(),
        1,
        "one TCP connection for all four"
    );
    let _ = std::fs::remove_dir_all(&pki_dir);
}

#[tokio::test]
async fn a_parked_connection_the_peer_closed_is_replaced() {
    let (peer, accepted, pki_dir) = peer_for("closed", true);
    assert!(!one_session(&peer, 20).await);
    assert_eq!(peer.pool.parked(&peer), 1);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !one_session(&peer, 20).await,
        "the closed one is dropped and a fresh one dialed"
    );
    assert_eq!(*accepted.lock().unwrap(), 2);
    let _ = std::fs::remove_dir_all(&pki_dir);
}

/// One session over every connection `peer` asks for: waits until they are all up, sends
/// messages that come back over them, parks. Returns each connection's index and whether it
/// came from the pool.
async fn session_on_every_connection(peer: &Peer) -> Vec<(u32, bool)> {
    let session = Session::new(SessionId::random(), SessionConfig::default());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _keeper = keep_connected(session.clone(), peer.clone(), Duration::from_millis(50), tx);
    let mut connected = Vec::new();
    while connected.len() < peer.connections.decided().await as usize {
        let event = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("every connection up within 10 s")
            .expect("the keeper runs");
        match event {
            LinkEvent::Connected {
                connection, warm, ..
            } => connected.push((connection, warm.is_some())),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(session.stats().connections_live as usize, connected.len());
    for i in 0..64 {
        let message = Bytes::from(vec![u8::try_from(i).unwrap(); 100_000]);
        session.send(CH, message).await.unwrap();
    }
    for i in 0..64 {
        let Received::Data(b) = session.recv(CH).await.unwrap() else {
            panic!("a barrier nobody sent");
        };
        assert!(b.len() == 100_000 && b.iter().all(|&x| usize::from(x) == i));
    }
    session.park();
    tokio::time::timeout(Duration::from_secs(5), session.parked())
        .await
        .expect("both sides park")
        .unwrap();
    session.fail("done");
    connected.sort_unstable();
    connected
}

/// An agent without `CAP_NET_ADMIN` on a link one connection's send buffer cannot hold (at
/// loopback's round trip, a rate no host buffer holds): the first connection decides how many
/// the session needs, the others follow and carry it with the first, and all of them park for
/// the next session, which decides the same on a parked one and runs warm on all of them.
#[test]
fn without_the_capability_a_link_one_connection_cannot_hold_is_split_over_several() {
    std::thread::spawn(|| {
        // Capabilities are per thread; this thread's runtime runs dialer and listener.
        caps::drop(None, CapSet::Effective, Capability::CAP_NET_ADMIN).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (mut peer, accepted, pki_dir) = peer_for("split", false);
            peer.link_rate_mbit = Some(1e9);
            let all: Vec<u32> = (0..MAX_AUTO_CONNECTIONS).collect();
            for (session, warm) in [(0, false), (1, true)] {
                peer.connections = ConnectionCount::auto();
                let connected = session_on_every_connection(&peer).await;
                assert_eq!(
                    connected,
                    all.iter().map(|&c| (c, warm)).collect::<Vec<_>>(),
                    "session {session}"
                );
                let why = peer.connections.get().and_then(|d| d.why).unwrap();
                assert!(why.contains("the agent lacks CAP_NET_ADMIN"), "{why}");
                assert_eq!(peer.pool.parked(&peer), all.len(), "session {session}");
            }
            assert_eq!(*accepted.lock().unwrap(), MAX_AUTO_CONNECTIONS);
            let _ = std::fs::remove_dir_all(&pki_dir);
        });
    })
    .join()
    .unwrap();
}

/// With a link one connection holds, one connection, whatever the capability.
#[tokio::test]
async fn a_link_one_connection_holds_gets_one() {
    let (mut peer, accepted, pki_dir) = peer_for("one", false);
    peer.connections = ConnectionCount::auto();
    assert_eq!(session_on_every_connection(&peer).await, vec![(0, false)]);
    let why = peer.connections.get().and_then(|d| d.why).unwrap();
    assert!(why.contains("holds a 100 Mbit/s link"), "{why}");
    assert_eq!(*accepted.lock().unwrap(), 1);
    let _ = std::fs::remove_dir_all(&pki_dir);
}
