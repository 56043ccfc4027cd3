//! A session that finished parks its connection, and the next session to the same peer runs on
//! it (no TCP or TLS handshake); a parked connection the peer closed meanwhile is noticed and a
//! fresh one dialed instead.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_lab::pki;
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
        connections: 1,
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
