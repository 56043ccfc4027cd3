//! Sessions over connections that keep breaking: whatever the cuts, every payload and barrier
//! arrives once, in order, in both directions, and the sender's memory stays bounded.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use ferry_wire::frame::ChannelId;
use ferry_wire::session::exchange_hello;
use ferry_wire::{ConnectionEnd, Received, Session, SessionConfig, SessionId};
use proptest::prelude::*;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};

/// A stream that breaks after writing `budget` bytes, like a WAN connection that drops.
struct Cut {
    inner: DuplexStream,
    budget: usize,
}

impl AsyncRead for Cut {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Cut {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.budget == 0 {
            return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        let n = buf.len().min(self.budget);
        let r = Pin::new(&mut self.inner).poll_write(cx, &buf[..n]);
        if let Poll::Ready(Ok(written)) = r {
            self.budget -= written;
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[derive(Debug, Clone)]
enum Msg {
    Data(usize),
    Barrier,
}

fn payload(i: usize, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|j| (i * 31 + j).to_le_bytes()[0])
            .collect::<Vec<u8>>(),
    )
}

fn expected(msgs: &[Msg]) -> Vec<Received> {
    msgs.iter()
        .enumerate()
        .map(|(i, m)| match m {
            Msg::Data(len) => Received::Data(payload(i, *len)),
            Msg::Barrier => Received::Barrier,
        })
        .collect()
}

async fn send_all(s: &Session, ch: ChannelId, msgs: &[Msg]) {
    for (i, m) in msgs.iter().enumerate() {
        match m {
            Msg::Data(len) => s.send(ch, payload(i, *len)).await.unwrap(),
            Msg::Barrier => s.barrier(ch).unwrap(),
        }
    }
    s.flushed(ch).await.unwrap();
}

async fn recv_all(s: &Session, ch: ChannelId, n: usize) -> Vec<Received> {
    let mut got = Vec::new();
    for _ in 0..n {
        got.push(s.recv(ch).await.unwrap());
    }
    got
}

/// Keeps `slots` connections between the two sides, each cut after the next budget.
async fn connect_loop(a: Session, b: Session, slots: u32, cuts: Vec<usize>, done: Arc<AtomicBool>) {
    let cuts = Arc::new(std::sync::Mutex::new(cuts.into_iter()));
    // Dropping the set (when this task is aborted) aborts the slots.
    let mut tasks = tokio::task::JoinSet::new();
    for slot in 0..slots {
        let (a, b, cuts, done) = (a.clone(), b.clone(), cuts.clone(), done.clone());
        tasks.spawn(async move {
            while !done.load(Ordering::Relaxed) {
                let budget = cuts.lock().unwrap().next().unwrap_or(usize::MAX);
                let (x, y) = tokio::io::duplex(16 << 10);
                let mut x = Cut { inner: x, budget };
                let mut y = Cut {
                    inner: y,
                    budget: usize::MAX,
                };
                let t = Duration::from_secs(5);
                let (ha, hb) = (a.hello(slot), b.hello(slot));
                // A cut inside the Hello fails one end at once; the other end must not wait
                // out its timeout for the rest (a real dialer would hang up and redial).
                let hellos = tokio::try_join!(
                    exchange_hello(&mut x, &ha, t),
                    exchange_hello(&mut y, &hb, t)
                );
                let Ok(((hello_b, left_a), (hello_a, left_b))) = hellos else {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                };
                a.accept_hello(&hello_b).unwrap();
                b.accept_hello(&hello_a).unwrap();
                let (a2, b2) = (a.clone(), b.clone());
                let ta = tokio::spawn(async move { a2.run_connection(x, left_a).await });
                let tb = tokio::spawn(async move { b2.run_connection(y, left_b).await });
                let _ = ta.await;
                tb.abort();
                let _ = tb.await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

fn run(msgs_ab: Vec<Msg>, msgs_ba: Vec<Msg>, slots: u32, cuts: Vec<usize>, limit: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let config = SessionConfig {
            send_limit_bytes: limit,
            ack_every_bytes: 8 << 10,
            ..Default::default()
        };
        let id = SessionId::random();
        let (a, b) = (Session::new(id, config.clone()), Session::new(id, config));
        let done = Arc::new(AtomicBool::new(false));
        let net = tokio::spawn(connect_loop(
            a.clone(),
            b.clone(),
            slots,
            cuts,
            done.clone(),
        ));
        let (ch1, ch2) = (ChannelId(1), ChannelId(2));
        let work = async {
            tokio::join!(
                send_all(&a, ch1, &msgs_ab),
                send_all(&b, ch2, &msgs_ba),
                recv_all(&b, ch1, msgs_ab.len()),
                recv_all(&a, ch2, msgs_ba.len()),
            )
        };
        let (_, _, got_ab, got_ba) = tokio::time::timeout(Duration::from_secs(5), work)
            .await
            .expect("the transfer finishes despite the cuts");
        done.store(true, Ordering::Relaxed);
        net.abort();
        assert_eq!(got_ab, expected(&msgs_ab));
        assert_eq!(got_ba, expected(&msgs_ba));
        assert_eq!(a.stats().unacked_bytes, 0);
    });
}

fn msgs() -> impl Strategy<Value = Vec<Msg>> {
    prop::collection::vec(
        prop_oneof![4 => (1usize..40_000).prop_map(Msg::Data), 1 => Just(Msg::Barrier)],
        0..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn everything_arrives_once_in_order_despite_cuts(
        ab in msgs(),
        ba in msgs(),
        slots in 1u32..5,
        cuts in prop::collection::vec(1usize..200_000, 0..12),
        limit in 10_000usize..300_000,
    ) {
        run(ab, ba, slots, cuts, limit);
    }
}

#[test]
fn a_full_window_makes_send_wait_until_the_peer_consumes() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let config = SessionConfig {
            send_limit_bytes: 100_000,
            ..Default::default()
        };
        let a = Session::new(SessionId(7), config);
        // No connection: the first frame always fits, the second waits.
        a.send(ChannelId(1), Bytes::from(vec![0u8; 80_000]))
            .await
            .unwrap();
        let second = a.send(ChannelId(1), Bytes::from(vec![0u8; 80_000]));
        assert!(tokio::time::timeout(Duration::from_millis(200), second)
            .await
            .is_err());
        assert_eq!(a.stats().unacked_bytes, 80_000);
        a.fail("test over");
        let err = a
            .send(ChannelId(1), Bytes::from_static(b"x"))
            .await
            .unwrap_err();
        assert_eq!(err.to_string(), "session failed: test over");
    });
}

#[test]
fn a_hello_for_another_session_is_refused() {
    let a = Session::new(SessionId(1), SessionConfig::default());
    let b = Session::new(SessionId(2), SessionConfig::default());
    let err = a.accept_hello(&b.hello(0)).unwrap_err();
    assert!(
        err.to_string()
            .contains("is for session 00000000000000000000000000000002"),
        "{err}"
    );
}

/// Carries `a` and `b` over one in-memory connection until either side's ends.
async fn connect_once(a: &Session, b: &Session) {
    let (mut x, mut y) = tokio::io::duplex(64 << 10);
    let t = Duration::from_secs(5);
    let (ha, hb) = (a.hello(0), b.hello(0));
    let ((hello_b, left_a), (hello_a, left_b)) = tokio::try_join!(
        exchange_hello(&mut x, &ha, t),
        exchange_hello(&mut y, &hb, t)
    )
    .unwrap();
    a.accept_hello(&hello_b).unwrap();
    b.accept_hello(&hello_a).unwrap();
    tokio::select! {
        _ = a.run_connection(x, left_a) => {}
        _ = b.run_connection(y, left_b) => {}
    }
}

/// A peer whose sender allows itself more than the receiver holds (as a liar or a bug would)
/// fails the receiver's session with what it outran, before the receiver buffers more.
fn outrun(sender: SessionConfig, receiver: SessionConfig, msgs: usize, len: usize) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let id = SessionId::random();
        let (a, b) = (Session::new(id, sender), Session::new(id, receiver));
        let send = async {
            for i in 0..msgs {
                if a.send(ChannelId(1), payload(i, len)).await.is_err() {
                    break;
                }
            }
            std::future::pending::<()>().await;
        };
        tokio::select! {
            () = connect_once(&a, &b) => {}
            () = send => {}
        }
        // The receiver consumed nothing; its session has failed, and says why.
        let err = b.recv(ChannelId(1)).await.unwrap_err();
        assert!(b.stats().payload_bytes_received == 0);
        err.to_string()
    })
}

#[test]
fn a_peer_that_outruns_the_receivers_byte_limit_fails_the_session() {
    let err = outrun(
        SessionConfig {
            send_limit_bytes: 8 << 20,
            ..Default::default()
        },
        SessionConfig {
            recv_limit_bytes: 1 << 20,
            ..Default::default()
        },
        40,
        64 << 10,
    );
    assert_eq!(
        err,
        "session failed: the peer outran its window on channel 1: 1114112 bytes in 17 frames \
         unconsumed, the limit is 1048576 bytes in 66560"
    );
}

#[test]
fn a_peer_that_outruns_the_receivers_frame_limit_fails_the_session() {
    let err = outrun(
        SessionConfig::default(),
        SessionConfig {
            recv_limit_frames: 100,
            ..Default::default()
        },
        200,
        10,
    );
    assert!(
        err.contains("101 frames unconsumed") && err.contains("in 100"),
        "{err}"
    );
}

#[test]
fn a_sender_never_holds_more_than_the_largest_window() {
    let mut outbox = ferry_wire::Outbox::new(ChannelId(1), usize::MAX);
    let big = Bytes::from(vec![0u8; ferry_wire::frame::MAX_PAYLOAD_BYTES as usize]);
    let mut held = 0;
    while outbox.has_room(big.len()) {
        outbox.push(big.clone()).unwrap();
        held += big.len();
    }
    assert_eq!(held, ferry_wire::MAX_SEND_WINDOW_BYTES);
    // And never more frames than a receiver keeps, however small.
    let mut outbox = ferry_wire::Outbox::new(ChannelId(1), usize::MAX);
    while outbox.has_room(1) {
        outbox.push(Bytes::from_static(b"x")).unwrap();
    }
    assert_eq!(outbox.unacked().count(), ferry_wire::MAX_UNACKED_FRAMES);
}

/// A peer whose process stopped (its socket open, its kernel still taking bytes) is given up
/// on after ten keepalives' time, so the session redials instead of waiting on it forever.
#[tokio::test(start_paused = true)]
async fn a_connection_that_hears_nothing_is_given_up() {
    let a = Session::new(SessionId(1), SessionConfig::default());
    let b = Session::new(SessionId(1), SessionConfig::default());
    let (mut x, mut y) = tokio::io::duplex(1 << 20);
    let t = Duration::from_secs(5);
    let (ha, hb) = (a.hello(0), b.hello(0));
    let ((hello_b, left_a), _) = tokio::try_join!(
        exchange_hello(&mut x, &ha, t),
        exchange_hello(&mut y, &hb, t)
    )
    .unwrap();
    a.accept_hello(&hello_b).unwrap();
    // `y` stays open and is never read or written again: the peer has stopped.
    let started = tokio::time::Instant::now();
    match a.run_connection(x, left_a).await {
        ConnectionEnd::Lost(e) => {
            assert_eq!(
                e.to_string(),
                "connection lost: nothing heard from the peer for 10s"
            );
        }
        ConnectionEnd::Parked(..) => panic!("parked"),
    }
    assert_eq!(started.elapsed().as_secs(), 10);
    drop(y);
}

/// A frame on an urgent channel goes out before every frame queued on the others, and after
/// a reconnect its replay does too.
#[tokio::test]
async fn an_urgent_channels_frame_overtakes_the_queued_bulk() {
    use ferry_wire::frame::{Frame, FrameKind};
    const BULK: ChannelId = ChannelId(1);
    const URGENT: ChannelId = ChannelId(9);
    let a = Session::new(SessionId(3), SessionConfig::default());
    a.make_urgent(URGENT);
    // No connection yet: the bulk waits in the queue, then the urgent frame comes.
    for i in 0..16 {
        a.send(BULK, payload(i, 60_000)).await.unwrap();
    }
    a.send(URGENT, Bytes::from_static(b"the page asked for"))
        .await
        .unwrap();

    // What the first data frames on a fresh connection are, read as the peer would.
    async fn first_data_frames(a: &Session, n: usize) -> Vec<(u16, u64)> {
        let b = Session::new(SessionId(3), SessionConfig::default());
        let (mut x, mut y) = tokio::io::duplex(1 << 20);
        let t = Duration::from_secs(5);
        let (ha, hb) = (a.hello(0), b.hello(0));
        let ((hello_b, left_a), (_, mut left_b)) = tokio::try_join!(
            exchange_hello(&mut x, &ha, t),
            exchange_hello(&mut y, &hb, t)
        )
        .unwrap();
        a.accept_hello(&hello_b).unwrap();
        let carry = a.run_connection(x, left_a);
        let read = async {
            use tokio::io::AsyncReadExt;
            let mut seen = Vec::new();
            while seen.len() < n {
                while let Some(frame) = Frame::decode(&mut left_b).unwrap() {
                    if frame.kind == FrameKind::Data {
                        seen.push((frame.channel.0, frame.seq.0));
                    }
                }
                y.read_buf(&mut left_b).await.unwrap();
            }
            seen.truncate(n);
            seen
        };
        tokio::select! {
            _ = carry => panic!("the connection ended"),
            seen = read => seen,
        }
    }
    assert_eq!(
        first_data_frames(&a, 3).await,
        [(9, 0), (1, 0), (1, 1)],
        "the urgent frame first, then the bulk in order"
    );
    // The connection dropped with nothing acknowledged: the replay puts it first again.
    assert_eq!(first_data_frames(&a, 2).await, [(9, 0), (1, 0)]);
}

/// Over a stream that keeps what it is given until flushed (TLS keeps the records a full
/// socket would not take until its next write or a flush), a frame still reaches the peer at
/// once, not with a later write (virtual time: none may pass).
#[tokio::test(start_paused = true)]
async fn a_frame_goes_out_at_once_through_a_stream_that_holds_writes_until_flushed() {
    const CH: ChannelId = ChannelId(1);
    let a = Session::new(SessionId(4), SessionConfig::default());
    let b = Session::new(SessionId(4), SessionConfig::default());
    let (mut x, mut y) = tokio::io::duplex(1 << 20);
    let t = Duration::from_secs(5);
    let (ha, hb) = (a.hello(0), b.hello(0));
    let ((hello_b, left_a), (hello_a, left_b)) = tokio::try_join!(
        exchange_hello(&mut x, &ha, t),
        exchange_hello(&mut y, &hb, t)
    )
    .unwrap();
    a.accept_hello(&hello_b).unwrap();
    b.accept_hello(&hello_a).unwrap();
    let (x, y) = (tokio::io::BufWriter::new(x), tokio::io::BufWriter::new(y));
    let started = tokio::time::Instant::now();
    a.send(CH, Bytes::from_static(b"the last bytes before the pause"))
        .await
        .unwrap();
    // Half a keepalive: a frame held back until a later write fails here, not with the
    // connections given up ten seconds later.
    let recv = tokio::time::timeout(Duration::from_millis(500), b.recv(CH));
    let received = tokio::select! {
        _ = a.run_connection(x, left_a) => panic!("a's connection ended"),
        _ = b.run_connection(y, left_b) => panic!("b's connection ended"),
        r = recv => r.expect("the frame was held back").unwrap(),
    };
    assert_eq!(
        received,
        Received::Data(Bytes::from_static(b"the last bytes before the pause"))
    );
    assert_eq!(started.elapsed(), Duration::ZERO);
}
