//! `ferry simulate` end to end, small (300 hosts, 3,000 VMs, a day): the tables it prints
//! and the pictures it writes. No root, no QEMU.

use std::process::Command;

#[test]
fn a_small_fleet_is_simulated_for_a_day_with_its_tables_and_pictures() {
    let out = std::env::temp_dir().join(format!("ferry-simulate-{}", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "simulate", "--hosts", "300", "--vms", "3000", "--speeds", "0.05,10",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("300 hosts, 3000 VMs, 24 h"), "{stdout}");
    // The slow speed's row and the fast one's: energy falls with faster migrations.
    let energy: Vec<f64> = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with("0.05") || l.trim_start().starts_with("10 "))
        .map(|l| l.split_whitespace().nth(4).unwrap().parse().unwrap())
        .collect();
    assert_eq!(energy.len(), 2, "{stdout}");
    assert!(energy[1] < energy[0], "{stdout}");
    assert!(
        stdout.contains("Overdriver") && stdout.contains("Spare memory"),
        "{stdout}"
    );
    for file in [
        "consolidation.json",
        "consolidation-energy.svg",
        "consolidation-hosts.svg",
        "overload-traffic.svg",
    ] {
        let text = std::fs::read_to_string(out.join(file)).unwrap();
        assert!(!text.is_empty(), "{file}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn bad_numbers_are_refused_with_what_is_wrong() {
    let run = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["simulate", "--speeds", "0"])
        .output()
        .unwrap();
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("--speeds must be rates above zero"),
        "{stderr}"
    );
}
