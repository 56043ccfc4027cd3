//! Agents authenticate each other: a peer whose certificate another CA signed, or that names
//! another agent, is refused with an error that says so; the right peer gets through.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_lab::pki;
use ferry_wire::net::{accept, answer, dial, Peer, Pool};
use ferry_wire::{Session, SessionConfig, SessionId};
use tokio::net::TcpListener;

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferry-tls-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Listens with `server`'s identity and dials with `client`'s, expecting the server's
/// certificate to carry `name`. Returns the dialer's error, if any.
async fn attempt(
    server: &Path,
    server_name: &str,
    client: &Path,
    client_name: &str,
    name: &str,
) -> Result<(), String> {
    let server_tls = pki::identity(server, server_name).server_config().unwrap();
    let client_tls = pki::identity(client, client_name).client_config().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        if let Ok((stream, hello, left)) = accept(tcp, server_tls, Duration::from_secs(5)).await {
            // Answer the Hello so that a successful dial completes.
            let s = Session::new(hello.session, SessionConfig::default());
            answer(&s, stream, &hello, left).await;
        }
    });
    let session = Session::new(SessionId(1), SessionConfig::default());
    let peer = Peer {
        addr,
        name: name.into(),
        tls: client_tls,
        connections: ferry_wire::connection_count::ConnectionCount::fixed(1),
        link_rate_mbit: None,
        pool: Pool::new(),
    };
    dial(&session, &peer, 0, Duration::from_secs(5))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn only_peers_from_the_same_ca_with_the_right_name_get_through() {
    let fleet = dir("fleet");
    let foreign = dir("foreign");
    let names = ["site-a".to_owned(), "site-b".to_owned()];
    pki::create_with(&fleet, &names).unwrap();
    pki::create_with(&foreign, &names).unwrap();

    attempt(&fleet, "site-b", &fleet, "site-a", "site-b")
        .await
        .expect("same CA, right name");

    let err = attempt(&foreign, "site-b", &fleet, "site-a", "site-b")
        .await
        .unwrap_err();
    assert!(err.contains("not signed by this agent's CA"), "{err}");

    let err = attempt(&fleet, "site-b", &fleet, "site-a", "site-c")
        .await
        .unwrap_err();
    assert!(err.contains("names another agent"), "{err}");

    // A dialer with a certificate from another CA is refused by the listener.
    let err = attempt(&fleet, "site-b", &foreign, "site-a", "site-b")
        .await
        .unwrap_err();
    assert!(!err.is_empty());

    let _ = std::fs::remove_dir_all(&fleet);
    let _ = std::fs::remove_dir_all(&foreign);
}
