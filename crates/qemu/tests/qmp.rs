//! The QMP client against a scripted fake server and against real QEMU.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use ferry_qemu::commands::{Cont, MigrateSetParameters, QueryKvm, QueryStatus, Quit};
use ferry_qemu::{Qmp, QmpError};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

fn socket_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ferry-qmp-{tag}-{}.sock", std::process::id()))
}

/// A fake QEMU: greets, accepts capabilities, answers query-status, refuses cont, sends an
/// event, and hangs up on quit without replying.
async fn fake_qemu(listener: UnixListener) {
    let (stream, _) = listener.accept().await.unwrap();
    let (r, mut w) = stream.into_split();
    w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
        .await
        .unwrap();
    let mut lines = BufReader::new(r).lines();
    while let Some(line) = lines.next_line().await.unwrap() {
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        let id = v["id"].clone();
        let reply = match v["execute"].as_str().unwrap() {
            "qmp_capabilities" => serde_json::json!({"return": {}, "id": id}),
            "query-status" => {
                w.write_all(b"{\"event\": \"STOP\", \"data\": {}, \"timestamp\": {\"seconds\": 5, \"microseconds\": 7}}\n").await.unwrap();
                serde_json::json!({"return": {"running": false, "status": "paused"}, "id": id})
            }
            "cont" => {
                serde_json::json!({"error": {"class": "GenericError", "desc": "not now"}, "id": id})
            }
            "quit" => return,
            other => panic!("unexpected command {other}"),
        };
        w.write_all(format!("{reply}\n").as_bytes()).await.unwrap();
    }
}

#[tokio::test]
async fn replies_errors_events_and_disconnects_are_told_apart() {
    let path = socket_path("fake");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    tokio::spawn(fake_qemu(listener));
    let qmp = Qmp::connect(&path).await.unwrap();

    let st = qmp.execute(&QueryStatus).await.unwrap();
    assert!(!st.running);
    assert_eq!(st.status, "paused");
    let stop = qmp
        .wait_event("STOP", |_| true, Duration::from_secs(5))
        .await
        .expect("STOP event");
    assert_eq!(stop.timestamp.as_micros(), 5_000_007);

    let err = qmp.execute(&Cont).await.unwrap_err();
    assert!(matches!(err, QmpError::Qemu { .. }), "{err:?}");
    assert_eq!(err.to_string(), "QEMU refused cont: not now (GenericError)");

    let err = qmp.execute(&Quit).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "QMP connection closed while waiting for quit (did QEMU exit?)"
    );
    let err = qmp.execute(&QueryStatus).await.unwrap_err();
    assert!(
        matches!(
            err,
            QmpError::Disconnected {
                command: "query-status"
            }
        ),
        "{err:?}"
    );
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn connecting_to_nothing_names_the_socket() {
    let path = socket_path("missing");
    let err = Qmp::connect(&path).await.err().expect("no server");
    assert!(
        err.to_string().starts_with("connect to QMP socket /"),
        "{err}"
    );
}

/// Real QEMU, no guest: typed commands, a typed refusal, and quit.
#[tokio::test]
async fn real_qemu_answers_typed_commands() {
    let path = socket_path("real");
    let _ = std::fs::remove_file(&path);
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-machine",
            "none",
            "-nodefaults",
            "-display",
            "none",
            "-S",
            "-qmp",
        ])
        .arg(format!("unix:{},server=on,wait=off", path.display()))
        .stdin(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64 must be installed (scripts/setup.sh)");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let qmp = loop {
        match Qmp::connect(&path).await {
            Ok(q) => break q,
            Err(e) if std::time::Instant::now() > deadline => {
                panic!("QEMU's QMP never came up: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let st = qmp.execute(&QueryStatus).await.unwrap();
    assert_eq!(st.status, "prelaunch");
    let kvm = qmp.execute(&QueryKvm).await.unwrap();
    assert!(!kvm.enabled, "-machine none runs no accelerator's guest");
    let bad = MigrateSetParameters {
        multifd_compression: Some("lz5".into()),
        ..Default::default()
    };
    let err = qmp.execute(&bad).await.unwrap_err();
    assert!(
        matches!(
            err,
            QmpError::Qemu {
                command: "migrate-set-parameters",
                ..
            }
        ),
        "{err:?}"
    );
    let _ = qmp.execute(&Quit).await;
    let status = child.wait().unwrap();
    assert!(status.success(), "QEMU exited with {status}");
    let _ = std::fs::remove_file(&path);
}

/// A QMP peer that sends `junk` bytes without a newline (in place of the greeting, or of the
/// reply to the first command after the handshake), then keeps the connection open.
async fn serve_line(listener: UnixListener, greeting: bool, junk: usize) {
    let (stream, _) = listener.accept().await.unwrap();
    let (r, mut w) = stream.into_split();
    if greeting {
        w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
            .await
            .unwrap();
        let mut lines = BufReader::new(r).lines();
        let line = lines.next_line().await.unwrap().unwrap();
        let id = serde_json::from_str::<serde_json::Value>(&line).unwrap()["id"].clone();
        let reply = serde_json::json!({"return": {}, "id": id});
        w.write_all(format!("{reply}\n").as_bytes()).await.unwrap();
        // The next command gets a line with no end.
        let _ = lines.next_line().await;
    }
    let chunk = vec![b'x'; 1 << 20];
    for _ in 0..junk.div_ceil(chunk.len()) {
        if w.write_all(&chunk).await.is_err() {
            return;
        }
    }
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn a_line_longer_than_the_limit_is_refused_before_it_is_held() {
    // In place of the greeting: the handshake fails and says why.
    let path = socket_path("long-greeting");
    let _ = std::fs::remove_file(&path);
    tokio::spawn(serve_line(
        UnixListener::bind(&path).unwrap(),
        false,
        40 << 20,
    ));
    let Err(err) = Qmp::connect(&path).await else {
        panic!("a greeting longer than the limit was taken")
    };
    assert!(
        err.to_string()
            .ends_with("reading greeting: a line longer than 16777216 bytes"),
        "{err}"
    );
    // In place of a reply: the connection is closed, and the command told so.
    let path = socket_path("long-reply");
    let _ = std::fs::remove_file(&path);
    tokio::spawn(serve_line(
        UnixListener::bind(&path).unwrap(),
        true,
        40 << 20,
    ));
    let qmp = Qmp::connect(&path).await.unwrap();
    let err = qmp.execute(&QueryStatus).await.unwrap_err();
    assert!(matches!(err, QmpError::Disconnected { .. }), "{err}");
}
