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
