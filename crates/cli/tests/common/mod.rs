//! The end-to-end harness: a lab of the test's own (namespaces named after the test), the
//! `ferry` binary pointed at it, and teardown that removes everything even when the test fails.

#![allow(dead_code)] // each test binary uses a part of the harness

pub mod bare;
pub mod domains;
pub mod fleet;

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferry_lab::{Lab, Site};

/// How long one `virsh` command (a migration included) may take before the test fails: a
/// migration that hangs must name itself, not cost CI its whole time.
pub const VIRSH_LIMIT: Duration = Duration::from_secs(600);

/// Runs `cmd` to its end with its output captured; a command still running after `limit` is
/// killed and fails the test with `what`.
pub fn output_within(cmd: &mut Command, limit: Duration, what: &str) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    // Read both pipes while it runs, so that a full pipe never stops it.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the command") {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let err = String::from_utf8_lossy(&stderr.join().unwrap_or_default()).into_owned();
            panic!(
                "{what}: still running after {}s, killed; stderr: {err}",
                limit.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// The `ferry` binary under test.
pub fn ferry_bin() -> &'static str {
    env!("CARGO_BIN_EXE_ferry")
}

/// A lab for one test. Dropping it takes the lab down (VMs, relay, namespaces, files).
pub struct TestLab {
    pub lab: Lab,
}

impl TestLab {
    /// A lab name unique to this test; nothing is created yet.
    pub fn named(tag: &str) -> TestLab {
        let lab = Lab {
            name: format!("ft{tag}{}", std::process::id() % 10000),
        };
        // A previous crashed run may have left it behind.
        let _ = lab.down(true);
        TestLab { lab }
    }

    /// Brings the lab up with the given `ferry lab up` flags; panics with ferry's message if it fails.
    pub fn up(tag: &str, link_flags: &[&str]) -> TestLab {
        let t = TestLab::named(tag);
        let mut args = vec!["lab", "up"];
        args.extend_from_slice(link_flags);
        t.ok(&args);
        t
    }

    /// `ferry ARGS` in this lab.
    pub fn run(&self, args: &[&str]) -> Output {
        Command::new(ferry_bin())
            .args(args)
            .env("FERRY_LAB", &self.lab.name)
            .output()
            .expect("run ferry")
    }

    /// `ferry ARGS`, which must succeed; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "ferry {} failed ({}):\nstdout: {}\nstderr: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `ferry ARGS`, which must fail with exit code `code`; returns stderr.
    pub fn fails(&self, args: &[&str], code: i32) -> String {
        let out = self.run(args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(
            out.status.code(),
            Some(code),
            "ferry {} should fail with {code}; stderr: {stderr}",
            args.join(" ")
        );
        stderr
    }

    /// Kills the QEMU of `vm` at `site` with SIGKILL.
    pub fn kill_qemu(&self, vm: &str, site: Site) {
        let qmp = self.lab.dir().join(format!("vms/{vm}-{}.qmp", site.name()));
        let killed = Command::new("pkill")
            .args(["-KILL", "-f", &qmp.to_string_lossy()])
            .status()
            .unwrap();
        assert!(
            killed.success(),
            "the QEMU of {vm} at {site:?} was not found"
        );
    }

    /// Whether the QEMU of `vm` at `site` runs its guest (`query-status`); it must answer.
    pub fn guest_running(&self, vm: &str, site: Site) -> bool {
        let socket = self.lab.dir().join(format!("vms/{vm}-{}.qmp", site.name()));
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let qmp = ferry_qemu::Qmp::connect(&socket).await.unwrap();
            let status = qmp.execute(&ferry_qemu::commands::QueryStatus).await;
            status.unwrap().running
        })
    }

    /// The site a VM runs at, from `ferry vm list`.
    pub fn site_of(&self, vm: &str) -> Site {
        let rec = ferry_lab::vm::load(&self.lab, vm).expect("VM record");
        rec.site
    }

    /// Starts `ferry migrate VM --to b --json` with `extra` options, its output piped; returns
    /// at once.
    pub fn spawn_migrate(&self, vm: &str, extra: &[&str]) -> std::process::Child {
        Command::new(ferry_bin())
            .args(["migrate", vm, "--to", "b", "--json", "--timeout-s", "300"])
            .args(extra)
            .env("FERRY_LAB", &self.lab.name)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start ferry migrate")
    }

    /// Namespaces of this lab that exist now.
    pub fn namespaces(&self) -> Vec<String> {
        let out = Command::new("ip")
            .args(["netns", "list"])
            .output()
            .expect("ip netns list");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&format!("{}-", self.lab.name)))
            .map(str::to_owned)
            .collect()
    }
}

impl TestLab {
    /// For a failed test, before teardown removes them: the end of every QEMU's log and
    /// console, and the agents' warnings and errors. CI keeps only the test's output, and a
    /// QEMU or a guest that died says why only there.
    fn print_log_tails(&self) {
        let dir = self.lab.dir();
        let mut logs: Vec<_> = std::fs::read_dir(dir.join("vms"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        logs.sort();
        for log in logs {
            print_tail(&log, 15, |_| true);
        }
        for site in [Site::A, Site::B] {
            let log = ferry_lab::agents::log_path(&self.lab, site);
            // `ferry: ` begins the error an agent exits with (its chain, printed once).
            print_tail(&log, 30, |l| {
                l.contains("WARN") || l.contains("ERROR") || l.starts_with("ferry: ")
            });
        }
        // The host's view: a process the kernel killed (memory) or that faulted, a full tmpfs
        // under the guests' memory files.
        for (what, program, args) in [
            ("kernel log", "dmesg", &["--ctime"][..]),
            ("/dev/shm", "df", &["-h", "/dev/shm"][..]),
        ] {
            if let Ok(out) = Command::new(program).args(args).output() {
                print_last(what, &String::from_utf8_lossy(&out.stdout), 15, |_| true);
            }
        }
    }
}

/// Prints the last `n` lines of `path` that `keep` selects.
fn print_tail(path: &std::path::Path, n: usize, keep: impl Fn(&str) -> bool) {
    // Lossy: a console holds whatever the guest printed as it died.
    let Ok(bytes) = std::fs::read(path) else {
        return;
    };
    let title = path.display().to_string();
    print_last(&title, &String::from_utf8_lossy(&bytes), n, keep);
}

/// Prints, under `title`, the last `n` lines of `text` that `keep` selects.
fn print_last(title: &str, text: &str, n: usize, keep: impl Fn(&str) -> bool) {
    let lines: Vec<&str> = text.lines().filter(|l| keep(l)).collect();
    eprintln!("--- {title} (last {n} lines kept) ---");
    for l in &lines[lines.len().saturating_sub(n)..] {
        eprintln!("{l}");
    }
}

impl Drop for TestLab {
    fn drop(&mut self) {
        if std::env::var_os("FERRY_TEST_KEEP_LAB").is_some() {
            eprintln!("FERRY_TEST_KEEP_LAB: leaving lab {} up", self.lab.name);
            return;
        }
        if std::thread::panicking() {
            self.print_log_tails();
        }
        if let Err(e) = self.lab.down(true) {
            eprintln!("teardown of lab {}: {e:#}", self.lab.name);
        }
        // Teardown must leave nothing behind, whatever the test did.
        let left = self.namespaces();
        if !left.is_empty() && !std::thread::panicking() {
            panic!("namespaces left after teardown: {left:?}");
        }
    }
}

/// The JSON object `ferry migrate --json` printed.
pub fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("migrate --json printed {out:?}: {e}"))
}

/// The timeline a `ferry migrate --json` result names.
pub fn timeline(v: &serde_json::Value) -> ferry_api::Timeline {
    let path = v["timeline"]
        .as_str()
        .expect("migrate --json names its timeline");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

impl TestLab {
    /// `virsh ARGS` as a process of `site`'s host (its own libvirtd at qemu:///system).
    pub fn virsh(&self, site: Site, args: &[&str]) -> Output {
        output_within(
            self.lab
                .host_command(site, "virsh")
                .args(["-c", "qemu:///system"])
                .args(args),
            VIRSH_LIMIT,
            &format!("virsh {}", args.join(" ")),
        )
    }

    /// The state of domain `name` in `site`'s libvirt ("running", "shut off"), or None when
    /// it has no such domain.
    pub fn domstate(&self, site: Site, name: &str) -> Option<String> {
        let out = self.virsh(site, &["domstate", name]);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// `site`'s agent's migrations (`ferry migrations --json`, run on that host).
    pub fn migrations(&self, site: Site) -> Vec<serde_json::Value> {
        let out = self
            .lab
            .host_command(site, ferry_bin())
            .args(["migrations", "--json", "--agent"])
            .arg(self.lab.agent_socket(site))
            .output()
            .expect("run ferry migrations");
        let all = succeeded("ferry migrations", &out);
        json(&all).as_array().cloned().unwrap_or_default()
    }
}

/// The standard output of a command that must have succeeded (`what` names it otherwise).
pub fn succeeded(what: &str, out: &Output) -> String {
    assert!(
        out.status.success(),
        "{what}: status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `qemu-img ARGS`, which must succeed; its standard output.
pub fn qemu_img(args: &[&str]) -> String {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .expect("run qemu-img");
    succeeded(&format!("qemu-img {args:?}"), &out)
}

/// A process's status and output, for an assertion's message.
pub fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// VM `name`'s guest through its serial socket at `site` (`HOST_DIR/<name>.serial` there),
/// once it is up, with `commands` (its workloads) started.
pub fn guest_at(
    rt: &tokio::runtime::Runtime,
    t: &TestLab,
    site: Site,
    name: &str,
    commands: &[&str],
) -> ferry_lab::guest::GuestLink {
    let serial = t.lab.host_dir(site).join(format!("{name}.serial"));
    rt.block_on(async {
        let link = ferry_lab::guest::GuestLink::connect(
            &serial,
            std::sync::Arc::new(ferry_lab::guest::Heartbeats::default()),
        )
        .await
        .unwrap();
        link.wait_ready(std::time::Duration::from_secs(120))
            .await
            .unwrap();
        for cmd in commands {
            link.call(cmd, std::time::Duration::from_secs(60))
                .await
                .unwrap();
        }
        link
    })
}
