//! libvirt's own account of when domains resumed at a site: `virsh event --loop --event
//! lifecycle --timestamp` as a process of the site's host, its lines kept. A group's resume
//! window is measured from these (libvirt's clock at the destination), not from ferry's
//! reports.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::libvirt::virsh;
use crate::topology::{Lab, Site};

/// A running `virsh event` at one site.
pub struct LifecycleEvents {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

/// The domain defined and undefined to see that the watcher listens.
const PROBE: &str = "ferry-event-probe";

impl LifecycleEvents {
    /// Starts watching `site`'s libvirt; returns once it demonstrably hears events (a probe
    /// domain defined and undefined there was seen).
    pub fn watch(lab: &Lab, site: Site) -> Result<LifecycleEvents> {
        let mut child = lab
            .host_command(site, "stdbuf")
            .args(["-oL", "virsh", "-q", "-c", "qemu:///system"])
            .args(["event", "--loop", "--event", "lifecycle", "--timestamp"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("run virsh event")?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        // Its errors are kept among its lines: they say why it heard nothing.
        let outputs: [Box<dyn std::io::Read + Send>; 2] = [
            Box::new(child.stdout.take().expect("piped")),
            Box::new(child.stderr.take().expect("piped")),
        ];
        for output in outputs {
            let kept = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(output).lines().map_while(Result::ok) {
                    kept.lock().expect("lines lock").push(line);
                }
            });
        }
        let events = LifecycleEvents { child, lines };
        let xml = lab.host_dir(site).join(format!("{PROBE}.xml"));
        std::fs::write(
            &xml,
            format!(
                "<domain type='qemu'><name>{PROBE}</name><memory unit='MiB'>16</memory>\
                 <os><type>hvm</type></os></domain>"
            ),
        )?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            virsh(
                lab,
                site,
                &[
                    "define",
                    &format!("{}/{PROBE}.xml", crate::topology::HOST_DIR),
                ],
            )?;
            virsh(lab, site, &["undefine", PROBE])?;
            // virsh registers its callback a moment after it starts: probe until it hears.
            let heard = Instant::now() + Duration::from_millis(500);
            while Instant::now() < heard {
                if events.lines().iter().any(|l| l.contains(PROBE)) {
                    return Ok(events);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if Instant::now() > deadline {
                bail!(
                    "virsh event at site {} heard nothing in 20 s: {}",
                    site.name(),
                    events.lines().join("; ")
                );
            }
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().expect("lines lock").clone()
    }

    /// When `domain` last resumed after an incoming migration (`Resumed Migrated`), in
    /// milliseconds since the epoch.
    pub fn resumed_unix_ms(&self, domain: &str) -> Option<u64> {
        let tag = format!("for domain '{domain}': Resumed Migrated");
        self.lines()
            .iter()
            .rev()
            .find(|l| l.contains(&tag))
            .and_then(|l| parse_timestamp(l))
    }

    /// When `domain` first had `event` (`Resumed Migrated`, `Suspended Migrated`, ...) at or
    /// after `since_unix_ms`, in milliseconds since the epoch.
    pub fn first_since(&self, domain: &str, event: &str, since_unix_ms: u64) -> Option<u64> {
        let tag = format!("for domain '{domain}': {event}");
        self.lines()
            .iter()
            .filter(|l| l.contains(&tag))
            .filter_map(|l| parse_timestamp(l))
            .find(|&at| at >= since_unix_ms)
    }
}

impl Drop for LifecycleEvents {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// virsh's `--timestamp` prefix, `2026-11-26 00:41:02.123+0000: ...` (UTC), in
/// milliseconds since the epoch.
fn parse_timestamp(line: &str) -> Option<u64> {
    let stamp = line.get(..23)?;
    let number = |range: std::ops::Range<usize>| stamp.get(range)?.parse::<u64>().ok();
    let (year, month, day) = (number(0..4)?, number(5..7)?, number(8..10)?);
    let (hour, minute, second, millis) = (
        number(11..13)?,
        number(14..16)?,
        number(17..19)?,
        number(20..23)?,
    );
    if line.get(23..28) != Some("+0000") {
        return None;
    }
    let days = days_from_civil(year, month, day)?;
    Some((((days * 24 + hour) * 60 + minute) * 60 + second) * 1000 + millis)
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (H. Hinnant's
/// algorithm), for dates from 1970 on.
fn days_from_civil(year: u64, month: u64, day: u64) -> Option<u64> {
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || year < 1970 {
        return None;
    }
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some(era * 146_097 + doe - 719_468)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virsh_timestamps_are_read_as_utc_milliseconds() {
        let line =
            "2026-11-26 00:41:02.123+0000: event 'lifecycle' for domain 'grp1': Resumed Migrated";
        // date -u -d '2026-11-26 00:41:02' +%s = 1795653662
        assert_eq!(parse_timestamp(line), Some(1_795_653_662_123));
        assert_eq!(parse_timestamp("1970-01-01 00:00:00.001+0000: x"), Some(1));
        assert_eq!(parse_timestamp("2026-11-26 00:41:02.123+0100: x"), None);
        assert_eq!(parse_timestamp("event 'lifecycle'"), None);
    }
}
