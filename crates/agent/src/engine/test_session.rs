//! Two ends of one session over an in-memory connection, for tests of what the agents
//! exchange.

use std::time::Duration;

use ferry_wire::session::exchange_hello;
use ferry_wire::{Session, SessionConfig, SessionId};

pub async fn pair() -> (Session, Session) {
    let id = SessionId::random();
    let (a, b) = (
        Session::new(id, SessionConfig::default()),
        Session::new(id, SessionConfig::default()),
    );
    let (mut x, mut y) = tokio::io::duplex(1 << 20);
    let t = Duration::from_secs(5);
    let (ha, hb) = (a.hello(0), b.hello(0));
    let (ra, rb) = tokio::join!(
        exchange_hello(&mut x, &ha, t),
        exchange_hello(&mut y, &hb, t)
    );
    let ((hello_b, left_a), (hello_a, left_b)) = (ra.unwrap(), rb.unwrap());
    a.accept_hello(&hello_b).unwrap();
    b.accept_hello(&hello_a).unwrap();
    let (a2, b2) = (a.clone(), b.clone());
    tokio::spawn(async move { a2.run_connection(x, left_a).await });
    tokio::spawn(async move { b2.run_connection(y, left_b).await });
    (a, b)
}
