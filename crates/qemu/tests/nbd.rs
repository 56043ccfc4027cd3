//! The NBD server and client against the real peers (QEMU's client in `qemu-io`/`qemu-img`,
//! QEMU's server in `qemu-nbd`), and the server against malformed input.

use std::path::{Path, PathBuf};
use std::process::Command as Process;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ferry_qemu::nbd::proto::*;
use ferry_qemu::nbd::{serve, Blocks, Client, Export, NbdError, ServeEnd};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

/// The in-memory twin of a mirror target: records every operation, refuses reads (as the
/// agent's target does).
#[derive(Default)]
struct MemoryBlocks {
    bytes: Mutex<Vec<u8>>,
    log: Mutex<Vec<String>>,
}

impl MemoryBlocks {
    fn new(size: usize) -> Arc<MemoryBlocks> {
        Arc::new(MemoryBlocks {
            bytes: Mutex::new(vec![0x5a; size]),
            log: Mutex::default(),
        })
    }
    fn fill(&self, offset: u64, len: u64, data: Option<&[u8]>) {
        let mut b = self.bytes.lock().unwrap();
        let range = usize::try_from(offset).unwrap()..usize::try_from(offset + len).unwrap();
        match data {
            Some(d) => b[range].copy_from_slice(d),
            None => b[range].fill(0),
        }
    }
}

impl Blocks for MemoryBlocks {
    async fn write(&self, offset: u64, data: Bytes) -> Result<(), u32> {
        self.fill(offset, data.len() as u64, Some(&data));
        self.log
            .lock()
            .unwrap()
            .push(format!("write {offset} {}", data.len()));
        Ok(())
    }
    async fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool) -> Result<(), u32> {
        self.fill(offset, len, None);
        self.log
            .lock()
            .unwrap()
            .push(format!("zeroes {offset} {len} trim={may_trim}"));
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u64) -> Result<(), u32> {
        self.log
            .lock()
            .unwrap()
            .push(format!("trim {offset} {len}"));
        Ok(())
    }
    async fn flush(&self) -> Result<(), u32> {
        self.log.lock().unwrap().push("flush".into());
        Ok(())
    }
}

const MIB: u64 = 1024 * 1024;
const MIB_USIZE: usize = 1024 * 1024;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferry-nbd-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Serves one connection of `blocks` on a fresh socket; returns the socket path and the
/// server's result.
fn serve_once(
    dir: &Path,
    size: u64,
    blocks: Arc<MemoryBlocks>,
) -> (PathBuf, tokio::task::JoinHandle<Result<ServeEnd, NbdError>>) {
    let path = dir.join("nbd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let task = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let export = Export {
            name: "disk0".into(),
            size,
            write_zeroes: true,
        };
        serve(stream, &export, blocks).await
    });
    (path, task)
}

fn nbd_url(sock: &Path) -> String {
    format!("nbd+unix:///disk0?socket={}", sock.display())
}

#[tokio::test]
async fn qemu_io_writes_zeroes_trims_and_flushes_through_the_server() {
    let dir = temp_dir("qemu-io");
    let blocks = MemoryBlocks::new(usize::try_from(4 * MIB).unwrap());
    let (sock, server) = serve_once(&dir, 4 * MIB, blocks.clone());
    let url = nbd_url(&sock);
    let out = tokio::task::spawn_blocking(move || {
        Process::new("qemu-io")
            .args(["-f", "raw", &url])
            .args(["-c", "write -P 0xab 4096 65536"])
            .args(["-c", "write -z 1048576 131072"])
            .args(["-c", "discard 2097152 4096"])
            .args(["-c", "flush"])
            .args(["-c", "read 0 4096"])
            .output()
            .expect("qemu-io runs")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("wrote 65536/65536 bytes at offset 4096"),
        "{stdout}{stderr}"
    );
    assert!(stdout.contains("wrote 131072/131072 bytes at offset 1048576"));
    assert!(stdout.contains("discard 4096/4096 bytes at offset 2097152"));
    // A mirror target is never read: QEMU's client gets an error, not garbage.
    assert!(
        stdout.contains("read failed: Invalid argument")
            || stderr.contains("read failed: Invalid argument"),
        "{stdout}{stderr}"
    );
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap(),
        Ok(ServeEnd::Disconnected)
    );
    let b = blocks.bytes.lock().unwrap();
    assert!(b[4096..4096 + 65536].iter().all(|&x| x == 0xab));
    assert_eq!(b[4095], 0x5a);
    assert!(b[MIB_USIZE..MIB_USIZE + 131072].iter().all(|&x| x == 0));
    let log = blocks.log.lock().unwrap();
    assert!(log.contains(&"trim 2097152 4096".to_string()), "{log:?}");
    assert!(log.contains(&"flush".to_string()), "{log:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn qemu_img_convert_copies_an_image_through_the_server() {
    let dir = temp_dir("convert");
    let size = 8 * MIB;
    // An image with data, a hole and a run of zeros.
    let image: Vec<u8> = (0..size)
        .map(|i| match i / MIB {
            2 | 3 => 0,
            _ => u8::try_from((i * 7 + i / 4096) % 251).unwrap(),
        })
        .collect();
    let src = dir.join("src.raw");
    std::fs::write(&src, &image).unwrap();
    let blocks = MemoryBlocks::new(usize::try_from(size).unwrap());
    let (sock, server) = serve_once(&dir, size, blocks.clone());
    let url = nbd_url(&sock);
    let out = tokio::task::spawn_blocking(move || {
        Process::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(&url)
            .output()
            .expect("qemu-img runs")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(*blocks.bytes.lock().unwrap() == image, "image differs");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A raw connection past the handshake (NBD_OPT_EXPORT_NAME, no zeroes).
async fn raw_connection(sock: &Path) -> UnixStream {
    let mut s = UnixStream::connect(sock).await.unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).await.unwrap();
    assert_eq!(&greeting[0..8], b"NBDMAGIC");
    s.write_u32(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .await
        .unwrap();
    s.write_u64(IHAVEOPT).await.unwrap();
    s.write_u32(OPT_EXPORT_NAME).await.unwrap();
    s.write_u32(5).await.unwrap();
    s.write_all(b"disk0").await.unwrap();
    let size = s.read_u64().await.unwrap();
    let _flags = s.read_u16().await.unwrap();
    assert_eq!(size, MIB);
    s
}

async fn request(s: &mut UnixStream, command: u16, offset: u64, len: u32, payload: &[u8]) -> u32 {
    let h = RequestHeader {
        flags: 0,
        command: Command::from_wire(command),
        cookie: 77,
        offset,
        length: len,
    };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(payload).await.unwrap();
    let mut r = [0u8; REPLY_BYTES];
    s.read_exact(&mut r).await.unwrap();
    let reply = SimpleReply::decode(&r).unwrap();
    assert_eq!(reply.cookie, 77);
    reply.errno
}

#[tokio::test]
async fn malformed_requests_get_errors_and_the_connection_goes_on() {
    let dir = temp_dir("malformed");
    let blocks = MemoryBlocks::new(usize::try_from(MIB).unwrap());
    let (sock, server) = serve_once(&dir, MIB, blocks.clone());
    let mut s = raw_connection(&sock).await;
    // Unknown command.
    assert_eq!(request(&mut s, 42, 0, 0, &[]).await, EINVAL);
    // A write past the end: its payload is consumed, the answer is EINVAL.
    assert_eq!(
        request(&mut s, 1, MIB - 512, 1024, &[1u8; 1024]).await,
        EINVAL
    );
    // Offset + length overflowing u64.
    assert_eq!(request(&mut s, 6, u64::MAX - 10, 4096, &[]).await, EINVAL);
    // A zero-length write.
    assert_eq!(request(&mut s, 1, 0, 0, &[]).await, EINVAL);
    // Still serving: a good write lands.
    assert_eq!(request(&mut s, 1, 512, 4, &[9, 9, 9, 9]).await, 0);
    assert_eq!(blocks.bytes.lock().unwrap()[512..516], [9, 9, 9, 9]);
    // A bad magic ends the connection with a named error.
    s.write_all(&[0u8; REQUEST_BYTES]).await.unwrap();
    let end = server.await.unwrap();
    assert_eq!(
        end.unwrap_err().to_string(),
        "nbd: bad magic 0x0 in request (expected 0x25609513)"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn an_oversized_write_ends_the_connection_before_allocating() {
    let dir = temp_dir("oversized");
    let blocks = MemoryBlocks::new(usize::try_from(MIB).unwrap());
    let (sock, server) = serve_once(&dir, MIB, blocks);
    let mut s = raw_connection(&sock).await;
    let h = RequestHeader {
        flags: 0,
        command: Command::Write,
        cookie: 1,
        offset: 0,
        length: u32::MAX,
    };
    s.write_all(&h.encode()).await.unwrap();
    let end = server.await.unwrap();
    assert_eq!(
        end.unwrap_err().to_string(),
        "nbd: request of 4294967295 bytes exceeds the 33554432-byte maximum"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn handshake_refusals_are_clear() {
    let dir = temp_dir("handshake");
    let blocks = MemoryBlocks::new(usize::try_from(MIB).unwrap());
    let (sock, server) = serve_once(&dir, MIB, blocks.clone());
    // Our client asking for another export gets the server's message.
    let stream = UnixStream::connect(&sock).await.unwrap();
    let err = Client::connect(stream, "disk9").await.err().unwrap();
    assert_eq!(
        err.to_string(),
        "nbd: no export \"disk9\": this server offers \"disk0\""
    );
    // The server stays in the handshake; closing there is a clean abort.
    assert_eq!(server.await.unwrap(), Ok(ServeEnd::HandshakeAborted));

    // Unsupported options are refused with NBD_REP_ERR_UNSUP, and an over-long option ends it.
    let (sock, server) = {
        let _ = std::fs::remove_file(dir.join("nbd.sock"));
        serve_once(&dir, MIB, blocks)
    };
    let mut s = UnixStream::connect(&sock).await.unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).await.unwrap();
    s.write_u32(FLAG_C_FIXED_NEWSTYLE).await.unwrap();
    s.write_u64(IHAVEOPT).await.unwrap();
    s.write_u32(8).await.unwrap(); // NBD_OPT_STRUCTURED_REPLY
    s.write_u32(0).await.unwrap();
    let mut reply = [0u8; 20];
    s.read_exact(&mut reply).await.unwrap();
    assert_eq!(
        u32::from_be_bytes(reply[12..16].try_into().unwrap()),
        REP_ERR_UNSUP
    );
    let len = u32::from_be_bytes(reply[16..20].try_into().unwrap());
    let mut msg = vec![0u8; usize::try_from(len).unwrap()];
    s.read_exact(&mut msg).await.unwrap();
    assert_eq!(
        String::from_utf8(msg).unwrap(),
        "option 8 is not supported by ferry's NBD server"
    );
    s.write_u64(IHAVEOPT).await.unwrap();
    s.write_u32(OPT_GO).await.unwrap();
    s.write_u32(1 << 30).await.unwrap();
    assert_eq!(
        server.await.unwrap().unwrap_err().to_string(),
        "nbd: option 7 carries 1073741824 bytes, more than the 65536 allowed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_client_writes_into_qemu_nbd_and_reads_back() {
    let dir = temp_dir("client");
    let image = dir.join("disk.raw");
    std::fs::write(&image, vec![0x33u8; usize::try_from(4 * MIB).unwrap()]).unwrap();
    let sock = dir.join("qemu-nbd.sock");
    let mut qemu_nbd = Process::new("qemu-nbd")
        .args(["-f", "raw", "-x", "disk0", "--persistent", "--socket"])
        .arg(&sock)
        .arg(&image)
        .spawn()
        .expect("qemu-nbd runs");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let stream = loop {
        match UnixStream::connect(&sock).await {
            Ok(s) => break s,
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("qemu-nbd did not listen: {e}"),
        }
    };
    let client = Client::connect(stream, "disk0").await.unwrap();
    assert_eq!(client.info().size, 4 * MIB);
    // Pipelined: several requests in flight, none overlapping.
    let data = Bytes::from(vec![0xc4u8; 65536]);
    let a = client.write(0, data.clone()).await.unwrap();
    let b = client.write(MIB, data.clone()).await.unwrap();
    let c = client.write_zeroes(2 * MIB, 8192, true).await.unwrap();
    for p in [a, b, c] {
        p.wait().await.unwrap();
    }
    client.flush().await.unwrap().wait().await.unwrap();
    assert_eq!(client.read(0, 65536).await.unwrap(), data);
    assert!(client
        .read(2 * MIB, 8192)
        .await
        .unwrap()
        .iter()
        .all(|&x| x == 0));
    assert!(client
        .read(2 * MIB + 8192, 16)
        .await
        .unwrap()
        .iter()
        .all(|&x| x == 0x33));
    // An error from the server names the request.
    let err = client.read(4 * MIB, 4096).await.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("nbd: READ at 4194304+4096 failed: "),
        "{err}"
    );
    client.disconnect().await.unwrap();
    drop(client);
    let _ = qemu_nbd.kill();
    let _ = qemu_nbd.wait();
    let on_disk = std::fs::read(&image).unwrap();
    assert!(on_disk[..65536].iter().all(|&x| x == 0xc4));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Blocks whose writes never complete (a relay whose destination gave up), saying when one
/// has begun.
struct StuckBlocks {
    began: tokio::sync::mpsc::UnboundedSender<()>,
}

impl Blocks for StuckBlocks {
    async fn write(&self, _offset: u64, _data: Bytes) -> Result<(), u32> {
        let _ = self.began.send(());
        std::future::pending().await
    }
    async fn write_zeroes(&self, _offset: u64, _len: u64, _may_trim: bool) -> Result<(), u32> {
        std::future::pending().await
    }
    async fn trim(&self, _offset: u64, _len: u64) -> Result<(), u32> {
        std::future::pending().await
    }
    async fn flush(&self) -> Result<(), u32> {
        std::future::pending().await
    }
}

/// The caller drops the server while a request is in flight (its relay failed): the client
/// sees the connection close, rather than waiting for its reply for ever (QEMU's mirror hung
/// that way inside a libvirt migration).
#[tokio::test]
async fn a_server_dropped_mid_request_closes_the_connection() {
    let dir = temp_dir("dropped");
    let path = dir.join("nbd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let (began, mut writing) = tokio::sync::mpsc::unbounded_channel();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let export = Export {
            name: "disk0".into(),
            size: MIB,
            write_zeroes: true,
        };
        serve(stream, &export, Arc::new(StuckBlocks { began })).await
    });
    let mut s = raw_connection(&path).await;
    let h = RequestHeader {
        flags: 0,
        command: Command::Write,
        cookie: 5,
        offset: 0,
        length: 4096,
    };
    s.write_all(&h.encode()).await.unwrap();
    s.write_all(&[7u8; 4096]).await.unwrap();
    writing.recv().await.expect("the write began");
    server.abort();
    let mut reply = [0u8; REPLY_BYTES];
    let read = tokio::time::timeout(Duration::from_secs(10), s.read(&mut reply))
        .await
        .expect("the connection closed once the server was dropped");
    assert_eq!(read.unwrap(), 0, "no reply, just the end of the connection");
    let _ = std::fs::remove_dir_all(&dir);
}
