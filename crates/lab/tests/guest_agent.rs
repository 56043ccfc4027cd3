//! The tiny guest's QEMU guest agent (guest/qga.c), on the host over a pty: built as the image
//! builds it, then driven by guest/test_qga.py (libvirt's sync handshake, guest-exec and its
//! status, malformed and over-long input, exactly one JSON line per request). Fast, no root.

use std::path::Path;
use std::process::Command;

#[test]
fn the_guest_agent_answers_as_qemu_guest_agent_does() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let guest = root.join("guest");
    let bin = std::env::temp_dir().join(format!("ferry-guest-qga-{}", std::process::id()));
    let mut gcc = Command::new("gcc");
    gcc.args(["-O2", "-static", "-pthread", "-Wall", "-Werror", "-o"])
        .arg(&bin);
    for src in ferry_lab::image::guest_c_files() {
        gcc.arg(guest.join(src));
    }
    let built = gcc.output().expect("run gcc");
    assert!(
        built.status.success(),
        "gcc: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new("python3")
        .arg(guest.join("test_qga.py"))
        .arg(&bin)
        .output()
        .expect("run python3");
    let _ = std::fs::remove_file(&bin);
    assert!(
        run.status.success(),
        "test_qga.py:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
