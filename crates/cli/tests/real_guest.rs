//! The real guest: Debian 12 booted from its own disk image through firmware (SeaBIOS and
//! GRUB, no -kernel), with a virtio disk and NIC and redis from Debian's packages serving on
//! its NIC (`scripts/debian-guest.sh` builds and caches it). A libvirt domain at site a moves
//! to site b with `ferry migrate --libvirt --copy-storage` and back with the user's own `virsh
//! migrate` through the agents' tunnels, its disk copied both times. A redis client connection
//! opened before the first move must keep working across both, every value must read back
//! the same, and after a hard reset at the end the guest must boot again from the twice-copied
//! disk and find the values redis saved there before the first move. The same guest started by
//! hand with a QEMU command line of its owner's moves with `ferry migrate --qmp --disk`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::TestLab;
use ferry_lab::topology::HOST_DIR;
use ferry_lab::Site;
use ferry_qemu::{Accel, Boot, DiskSpec, NicSpec, VmSpec};

const FAST_LINK: &[&str] = &["--libvirt", "--rate-mbit", "1000", "--rtt-ms", "10"];
const FAST_LINK_NO_LIBVIRT: &[&str] = &["--rate-mbit", "1000", "--rtt-ms", "10"];
/// The guest's address on the lab's segment (scripts/debian-guest.sh).
const REDIS: &str = "10.77.0.60:6379";
const NAME: &str = "deb1";
/// The values the client writes: this many, each this long.
const KEYS: usize = 48;
const VALUE_BYTES: usize = 256 << 10;

fn image() -> PathBuf {
    let image = ferry_lab::image::cache_dir().join("debian/debian-guest.qcow2");
    assert!(
        image.exists(),
        "{} is missing: run scripts/debian-guest.sh (scripts/test.sh does)",
        image.display()
    );
    image
}

/// The guest as a libvirt domain: firmware boot from its disk (a qcow2 in the site's host
/// directory), its console a file there, a virtio NIC on the site's bridge.
fn domain_xml() -> String {
    format!(
        "<domain type='qemu'><name>{NAME}</name><memory unit='MiB'>512</memory><vcpu>1</vcpu>\
         <os><type arch='x86_64' machine='q35'>hvm</type><boot dev='hd'/></os>\
         <devices>\
         <disk type='file' device='disk'><driver name='qemu' type='qcow2'/>\
         <source file='/run/ferry-host/{NAME}.qcow2'/><target dev='vda' bus='virtio'/></disk>\
         <serial type='file'><source path='/run/ferry-host/{NAME}.console'/>\
         <target port='0'/></serial>\
         <interface type='bridge'><source bridge='br0'/><mac address='52:54:00:77:00:3c'/>\
         <model type='virtio'/></interface></devices></domain>"
    )
}

/// The VM's disk `NAME.qcow2` in each site's host directory: at site a an overlay on the
/// guest image, at site b an empty image of the same size (no shared storage).
fn make_disks(t: &TestLab, name: &str, base: &Path) {
    let info = common::qemu_img(&["info", "--output=json", &base.to_string_lossy()]);
    let size = common::json(&info)["virtual-size"].as_u64().unwrap();
    let disk = |site| t.lab.host_dir(site).join(format!("{name}.qcow2"));
    let base = base.to_string_lossy();
    let (a, b) = (disk(Site::A), disk(Site::B));
    common::qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-F",
        "qcow2",
        "-b",
        &base,
        &a.to_string_lossy(),
    ]);
    common::qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        &b.to_string_lossy(),
        &size.to_string(),
    ]);
}

/// How many times the guest announced itself ready in the console file `path`.
fn ready_lines(path: &Path) -> usize {
    std::fs::read(path).map_or(0, |b| {
        String::from_utf8_lossy(&b)
            .matches("FERRY-GUEST-READY")
            .count()
    })
}

/// Waits for the guest's `n`th readiness line in its console file (it prints one per boot,
/// once redis answers on its NIC).
fn wait_ready(path: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while ready_lines(path) < n {
        let text = std::fs::read(path).unwrap_or_default();
        let text = String::from_utf8_lossy(&text);
        assert!(
            !text.contains("FERRY-GUEST-FAILED"),
            "the guest says redis did not come up:\n{text}"
        );
        assert!(
            Instant::now() < deadline,
            "no readiness line {n} within 300 s in {}:\n{text}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A redis client speaking RESP on one TCP connection.
struct Redis {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Redis {
    /// Connects from inside `site`'s namespace (the guests' segment is reachable only there).
    fn connect(t: &TestLab) -> Redis {
        let stream = ferry_lab::tcpseq::connect_from(
            &t.lab.site_ns(Site::A),
            REDIS,
            Duration::from_secs(30),
        )
        .expect("connect to the guest's redis");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        Redis {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        }
    }

    /// One command; its reply: a status line's text, or a bulk string's bytes.
    fn call(&mut self, args: &[&[u8]]) -> Vec<u8> {
        let mut req = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            req.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            req.extend_from_slice(a);
            req.extend_from_slice(b"\r\n");
        }
        self.writer.write_all(&req).expect("send to redis");
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("redis's reply");
        let line = line.trim_end();
        match line.as_bytes().first() {
            Some(b'+') | Some(b':') => line.as_bytes()[1..].to_vec(),
            Some(b'$') => {
                let len: usize = line[1..].parse().expect("a bulk length");
                let mut value = vec![0u8; len + 2];
                self.reader.read_exact(&mut value).expect("a bulk value");
                value.truncate(len);
                value
            }
            _ => panic!("redis answered {line:?}"),
        }
    }
}

/// Value `i`: distinct, not compressible to nothing, the same every time.
fn value(i: usize) -> Vec<u8> {
    let mut x = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..VALUE_BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b'a' + (x % 16) as u8
        })
        .collect()
}

fn check_values(redis: &mut Redis, when: &str) {
    for i in 0..KEYS {
        let got = redis.call(&[b"GET", format!("k{i}").as_bytes()]);
        assert!(got == value(i), "{when}: k{i} differs");
    }
    assert_eq!(redis.call(&[b"PING"]), b"PONG", "{when}");
}

#[test]
fn a_debian_guest_with_redis_moves_with_libvirt_and_virsh_its_client_connected() {
    let base = image();
    let t = TestLab::up("deb", FAST_LINK);
    // Its disk: an overlay on the image at site a; at site b an empty image of the same size.
    make_disks(&t, NAME, &base);
    std::fs::write(
        t.lab.host_dir(Site::A).join(format!("{NAME}.xml")),
        domain_xml(),
    )
    .unwrap();
    common::succeeded(
        "define",
        &t.virsh(Site::A, &["define", &format!("/run/ferry-host/{NAME}.xml")]),
    );
    common::succeeded("start", &t.virsh(Site::A, &["start", NAME]));
    let console_a = t.lab.host_dir(Site::A).join(format!("{NAME}.console"));
    wait_ready(&console_a, 1);

    // The client's data, saved to the guest's disk too.
    let mut redis = Redis::connect(&t);
    for i in 0..KEYS {
        assert_eq!(
            redis.call(&[b"SET", format!("k{i}").as_bytes(), &value(i)]),
            b"OK"
        );
    }
    assert_eq!(redis.call(&[b"SAVE"]), b"OK");

    // ferry drives libvirt: memory and disk to site b.
    let mut cmd = t.lab.host_command(Site::A, common::ferry_bin());
    cmd.args([
        "migrate",
        "--libvirt",
        NAME,
        "--to",
        "site-b",
        "--copy-storage",
        "--json",
        "--agent",
    ])
    .arg(t.lab.agent_socket(Site::A));
    let out = common::output_within(&mut cmd, common::VIRSH_LIMIT, "ferry migrate --libvirt");
    let v = common::json(&common::succeeded("ferry migrate --libvirt", &out));
    assert_eq!(v["outcome"]["completed"], true, "{v}");
    eprintln!("ferry migrate --libvirt: {}", v["outcome"]);
    let state = common::succeeded("domstate", &t.virsh(Site::B, &["domstate", NAME]));
    assert_eq!(state.trim(), "running");
    check_values(&mut redis, "at site b, the same connection");

    // Back with the user's own virsh command through site b's agent.
    let tunnels = "/run/ferry-host/tunnels/site-a";
    common::succeeded(
        "virsh migrate back",
        &t.virsh(
            Site::B,
            &[
                "migrate",
                "--live",
                "--p2p",
                "--persistent",
                "--undefinesource",
                "--copy-storage-all",
                NAME,
                "--desturi",
                &format!("qemu+unix:///system?socket={tunnels}/rpc.sock"),
                "--migrateuri",
                &format!("unix://{tunnels}/mig.sock"),
                "--disks-uri",
                &format!("unix://{tunnels}/nbd.sock"),
            ],
        ),
    );
    check_values(&mut redis, "back at site a, the same connection");
    let all = t.migrations(Site::B);
    assert!(
        all.iter()
            .any(|m| m["vm"] == NAME && m["state"] == "committed"),
        "site b's agent lists the virsh migration: {all:?}"
    );
    drop(redis);

    // The disk crossed twice: a hard reset boots the guest from it, and redis finds what it
    // saved before the first move.
    let boots = ready_lines(&console_a);
    common::succeeded("reset", &t.virsh(Site::A, &["reset", NAME]));
    wait_ready(&console_a, boots + 1);
    let mut redis = Redis::connect(&t);
    check_values(&mut redis, "after a reset at site a, from the copied disk");
}

/// The guest as its owner would start it by hand: firmware boot from its disk, a QMP socket,
/// its console logged to a file, a NIC on a tap of the site's bridge.
fn bare_spec(name: &str) -> VmSpec {
    let host = Path::new(HOST_DIR);
    VmSpec {
        name: name.to_owned(),
        mem_mib: 512,
        vcpus: 1,
        accel: Accel::Tcg,
        boot: Boot::Disk,
        disks: vec![DiskSpec {
            id: "disk0".into(),
            path: host.join(format!("{name}.qcow2")),
            format: "qcow2".into(),
        }],
        nics: vec![NicSpec {
            id: "net0".into(),
            tap: format!("{name}t"),
            mac: "52:54:00:77:00:3c".into(),
        }],
        qmp_socket: host.join(format!("{name}.qmp")),
        serial_socket: host.join(format!("{name}.serial")),
        serial_log: Some(host.join(format!("{name}.console"))),
        mem_file: None,
        incoming: None,
        paused: false,
        extra_args: vec![
            "-daemonize".into(),
            "-pidfile".into(),
            host.join(format!("{name}.pid")).display().to_string(),
        ],
    }
}

#[test]
fn a_debian_guest_started_by_hand_moves_with_migrate_qmp_its_client_connected() {
    let base = image();
    let t = TestLab::up("debq", FAST_LINK_NO_LIBVIRT);
    let name = "deb2";
    let spec = bare_spec(name);
    for site in Site::ALL {
        let ns = t.lab.site_ns(site);
        let tap = &spec.nics[0].tap;
        ferry_lab::sh::run_in(&ns, "ip", &["tuntap", "add", tap, "mode", "tap"]).unwrap();
        ferry_lab::sh::run_in(
            &ns,
            "ip",
            &["link", "set", "dev", tap, "master", "br0", "up"],
        )
        .unwrap();
    }
    make_disks(&t, name, &base);
    let started = t
        .lab
        .host_command(Site::A, ferry_qemu::qemu_program())
        .args(spec.argv())
        .output()
        .unwrap();
    common::succeeded("start QEMU", &started);
    wait_ready(&t.lab.host_dir(Site::A).join(format!("{name}.console")), 1);

    let mut redis = Redis::connect(&t);
    for i in 0..KEYS {
        assert_eq!(
            redis.call(&[b"SET", format!("k{i}").as_bytes(), &value(i)]),
            b"OK"
        );
    }
    let mut cmd = t.lab.host_command(Site::A, common::ferry_bin());
    cmd.args([
        "migrate",
        name,
        "--qmp",
        &format!("{HOST_DIR}/{name}.qmp"),
        "--to",
        "site-b",
        "--disk",
        "disk0",
        "--json",
        "--agent",
    ])
    .arg(t.lab.agent_socket(Site::A));
    let out = common::output_within(&mut cmd, common::VIRSH_LIMIT, "ferry migrate --qmp");
    let v = common::json(&common::succeeded("ferry migrate --qmp", &out));
    assert_eq!(v["outcome"]["completed"], true, "{v}");
    eprintln!("ferry migrate --qmp: {}", v["outcome"]);
    check_values(&mut redis, "at site b, the same connection");
    // Redis writes its snapshot to the disk as it is at site b.
    assert_eq!(redis.call(&[b"SAVE"]), b"OK");
}
