//! The WAN between the two agents, in process: a TCP relay the test can darken (nothing passes
//! either way, connections stay open, as in an outage) and cut (every connection through it
//! closes, as when a middlebox forgets them).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::watch;
use tokio::task::AbortHandle;

pub struct Link {
    pub address: SocketAddr,
    lit: watch::Sender<bool>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    rt: Option<Runtime>,
}

impl Link {
    /// A relay to `target`.
    pub fn to(target: SocketAddr) -> Link {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the link");
        let address = listener.local_addr().expect("address");
        listener.set_nonblocking(true).expect("nonblocking");
        let listener = {
            let _guard = rt.enter();
            TcpListener::from_std(listener).expect("the link's listener")
        };
        let lit = watch::Sender::new(true);
        let connections = Arc::new(Mutex::new(Vec::new()));
        rt.spawn(relay(listener, target, lit.clone(), connections.clone()));
        Link {
            address,
            lit,
            connections,
            rt: Some(rt),
        }
    }

    /// Nothing passes until [`Link::light`].
    pub fn darken(&self) {
        self.lit.send_replace(false);
    }

    pub fn light(&self) {
        self.lit.send_replace(true);
    }

    /// Closes every connection through the link now.
    pub fn cut(&self) {
        for c in self.connections.lock().expect("connections").drain(..) {
            c.abort();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

async fn relay(
    listener: TcpListener,
    target: SocketAddr,
    lit: watch::Sender<bool>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
) {
    while let Ok((inbound, _)) = listener.accept().await {
        let lit = lit.clone();
        let task = tokio::spawn(async move {
            let Ok(outbound) = TcpStream::connect(target).await else {
                return;
            };
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            tokio::select! {
                () = pass(ri, wo, lit.subscribe()) => {}
                () = pass(ro, wi, lit.subscribe()) => {}
            }
        });
        connections
            .lock()
            .expect("connections")
            .push(task.abort_handle());
    }
}

/// One direction: bytes pass only while the link is lit.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut lit: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if lit.wait_for(|&l| l).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if lit.wait_for(|&l| l).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
