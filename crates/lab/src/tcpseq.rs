//! A client of the guest's TCP sequence server, run from inside a site's namespace.
//!
//! The server sends "0\n", "1\n", ... on one connection. The client checks that every number
//! arrives exactly once and in order, and records the longest stall between two numbers: a
//! connection that kept every number across a migration proves the guest's network identity
//! moved with it.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// What the client saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TcpSeqStats {
    /// Numbers received.
    pub received: u64,
    /// The last number received.
    pub last: Option<u64>,
    /// Numbers that never arrived (a gap in the sequence).
    pub missing: u64,
    /// Numbers that arrived twice or out of order.
    pub out_of_order: u64,
    /// The longest wait between two numbers, in ms.
    pub max_stall_ms: u64,
    /// Why the connection ended, if it did.
    pub error: Option<String>,
}

impl TcpSeqStats {
    /// Every number arrived once, in order, and the connection is still open.
    pub fn intact(&self) -> bool {
        self.received > 0 && self.missing == 0 && self.out_of_order == 0 && self.error.is_none()
    }
}

/// A running client; dropping it stops the client.
pub struct TcpSeqClient {
    stats: Arc<Mutex<TcpSeqStats>>,
    stop: Arc<AtomicBool>,
}

impl TcpSeqClient {
    /// Connects from network namespace `ns` to `addr` (e.g. `10.77.0.11:7000`).
    pub fn connect(ns: &str, addr: &str, deadline: Duration) -> Result<TcpSeqClient> {
        let ns_path = format!("/run/netns/{ns}");
        let addr = addr.to_owned();
        let (tx, rx) = std::sync::mpsc::channel();
        let stats = Arc::new(Mutex::new(TcpSeqStats::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s2, stop2) = (stats.clone(), stop.clone());
        std::thread::Builder::new()
            .name("tcpseq".into())
            .spawn(move || {
                let stream = enter_ns(&ns_path).and_then(|()| connect_retry(&addr, deadline));
                match stream {
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                    Ok(s) => {
                        let _ = tx.send(Ok(()));
                        read_loop(s, &s2, &stop2);
                    }
                }
            })?;
        rx.recv().context("tcpseq thread died")??;
        Ok(TcpSeqClient { stats, stop })
    }

    /// What the client has seen so far.
    pub fn stats(&self) -> TcpSeqStats {
        self.stats.lock().expect("tcpseq stats poisoned").clone()
    }

    /// Waits until at least `n` more numbers than now have arrived.
    pub fn wait_for_more(&self, n: u64, deadline: Duration) -> Result<()> {
        let base = self.stats().received;
        crate::topology::wait_until(deadline, || {
            self.stats().received >= base + n || self.stats().error.is_some()
        })
        .with_context(|| {
            format!(
                "waiting for {n} more sequence numbers after {base}: {:?}",
                self.stats()
            )
        })?;
        if let Some(e) = self.stats().error {
            bail!("TCP sequence connection failed: {e}");
        }
        Ok(())
    }
}

impl Drop for TcpSeqClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A TCP connection to `addr` made from inside network namespace `ns` (a site's: the guests'
/// segment is reachable only there); the socket stays in that namespace wherever it is used.
pub fn connect_from(ns: &str, addr: &str, deadline: Duration) -> Result<TcpStream> {
    let (ns_path, addr) = (format!("/run/netns/{ns}"), addr.to_owned());
    std::thread::Builder::new()
        .name("connect-in-ns".into())
        .spawn(move || enter_ns(&ns_path).and_then(|()| connect_retry(&addr, deadline)))?
        .join()
        .map_err(|_| anyhow::anyhow!("the connecting thread panicked"))?
}

/// Moves the calling thread into a network namespace (only this thread).
fn enter_ns(path: &str) -> Result<()> {
    let f = std::fs::File::open(path).with_context(|| format!("open {path} (is the lab up?)"))?;
    // SAFETY: setns on a valid namespace fd; affects only the calling thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).context("setns");
    }
    Ok(())
}

fn connect_retry(addr: &str, deadline: Duration) -> Result<TcpStream> {
    let start = Instant::now();
    loop {
        match TcpStream::connect_timeout(&addr.parse()?, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if start.elapsed() > deadline => {
                bail!("connect to the guest at {addr}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn read_loop(stream: TcpStream, stats: &Mutex<TcpSeqStats>, stop: &AtomicBool) {
    // A read timeout lets the thread notice `stop`; stalls are measured, not fatal.
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    let mut last_at = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        match reader.read_line(&mut line) {
            Ok(0) => {
                stats.lock().expect("tcpseq stats poisoned").error =
                    Some("connection closed by the guest".into());
                return;
            }
            Ok(_) if line.ends_with('\n') => {}
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => {
                stats.lock().expect("tcpseq stats poisoned").error = Some(e.to_string());
                return;
            }
        }
        let now = Instant::now();
        let mut s = stats.lock().expect("tcpseq stats poisoned");
        match line.trim().parse::<u64>() {
            Ok(n) => {
                match s.last {
                    Some(prev) if n == prev + 1 => {}
                    Some(prev) if n > prev + 1 => s.missing += n - prev - 1,
                    Some(_) => s.out_of_order += 1,
                    None if n != 0 => s.missing += n,
                    None => {}
                }
                s.last = Some(n);
                s.received += 1;
                if s.received > 1 {
                    s.max_stall_ms = s.max_stall_ms.max(
                        u64::try_from(now.duration_since(last_at).as_millis()).unwrap_or(u64::MAX),
                    );
                }
                last_at = now;
            }
            Err(_) => s.out_of_order += 1,
        }
        line.clear();
    }
}
