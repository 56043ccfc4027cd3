//! The NBD server (what QEMU's mirror and libvirt's disk copy write through) with the input
//! as everything its client sends: the handshake's options, then requests and payloads.
#![no_main]

use std::sync::Arc;

use bytes::Bytes;
use ferry_qemu::nbd::server::{serve, Blocks, Export};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;

/// A 1 MiB export that accepts everything and keeps nothing.
struct Sink;

impl Blocks for Sink {
    async fn write(&self, _offset: u64, _data: Bytes) -> Result<(), u32> {
        Ok(())
    }
    async fn write_zeroes(&self, _offset: u64, _len: u64, _may_trim: bool) -> Result<(), u32> {
        Ok(())
    }
    async fn trim(&self, _offset: u64, _len: u64) -> Result<(), u32> {
        Ok(())
    }
    async fn flush(&self) -> Result<(), u32> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let (mut client, server) = tokio::io::duplex(1 << 16);
        let export = Export {
            name: "disk0".into(),
            size: 1 << 20,
            write_zeroes: true,
        };
        let served = tokio::spawn(async move { serve(server, &export, Arc::new(Sink)).await });
        let data = data.to_vec();
        let writer = tokio::spawn(async move {
            // The server's replies are read and dropped so that it never blocks on them.
            let (mut read, mut write) = tokio::io::split(&mut client);
            let drain = async {
                let _ = tokio::io::copy(&mut read, &mut tokio::io::sink()).await;
            };
            let send = async {
                let _ = write.write_all(&data).await;
                let _ = write.shutdown().await;
            };
            tokio::join!(drain, send);
        });
        let _ = served.await;
        writer.abort();
    });
});
