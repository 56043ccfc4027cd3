//! `ferry bench --groups`: related VMs moved to another site as a group (`ferry fleet migrate
//! --group`: released together once every member's destination holds its whole stream)
//! against the same VMs moved on their own, all requested at once (each switches over when it
//! is ready) and one by one (each requested once the previous one committed).
//!
//! Three libvirt domains of the tiny guest (a web tier, an app tier and a database) with the
//! same memory and working sets of a third, two thirds and all of the workload's size, so that
//! on their own the smallest arrives first. Each run moves them to site b and back in each
//! mode, the modes interleaved. libvirt's lifecycle events at both sites (its own clock) say
//! when each member paused at its source (`Suspended Migrated`) and resumed at its destination
//! (`Resumed Migrated`). From them:
//! - the resume window: the first resume at the destination to the last;
//! - the split: how long a member already ran at the destination while another still ran at
//!   the source (the last pause at the source minus the first resume at the destination, or 0);
//! - each member's pause, its source's pause to its destination's resume (a group member's
//!   includes the wait for the others).
//!
//! The WAN emulator counts the bytes of the whole move.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::bench::Workload;
use crate::controller::{fleet, fleet_json};
use crate::image::Image;
use crate::libvirt::{self, GuestNic};
use crate::libvirt_events::LifecycleEvents;
use crate::topology::{wait_until, Lab, Site};

/// The members, smallest working set first.
pub const MEMBERS: [&str; 3] = ["grp-web", "grp-app", "grp-db"];

/// How the members travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// `ferry fleet migrate --group`: resumed together, or none.
    Group,
    /// Each on its own, all requested at once.
    AtOnce,
    /// Each on its own, requested once the previous one committed.
    OneByOne,
}

impl Arrival {
    pub const ALL: [Arrival; 3] = [Arrival::Group, Arrival::AtOnce, Arrival::OneByOne];

    pub fn parse(s: &str) -> Option<Arrival> {
        Arrival::ALL.into_iter().find(|a| a.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            Arrival::Group => "group",
            Arrival::AtOnce => "at-once",
            Arrival::OneByOne => "one-by-one",
        }
    }
}

/// One move of the three members, as libvirt and the WAN emulator saw it.
#[derive(Debug, Clone, Serialize)]
pub struct GroupMoveRecord {
    pub mode: &'static str,
    pub run: u32,
    pub from: &'static str,
    pub to: &'static str,
    /// Every member committed at the destination.
    pub completed: bool,
    /// From the first request to the last member's commit (`ferry fleet migrate`'s wall time).
    pub total_ms: u64,
    /// The first member's resume at the destination to the last one's.
    pub resume_window_ms: Option<u64>,
    /// How long members ran at both sites at once.
    pub split_ms: Option<u64>,
    /// Each member's pause (source paused to destination resumed), in [`MEMBERS`] order.
    pub pauses_ms: Vec<u64>,
    /// Group only: the first member held to the group's release (the controller's clock).
    pub hold_ms: Option<u64>,
    pub wan_bytes: u64,
    pub error: Option<String>,
}

/// The bench's settings; `workload`'s size is the largest member's.
pub struct GroupBench {
    pub runs: u32,
    /// The ways to travel compared, interleaved in each run.
    pub arrivals: Vec<Arrival>,
    pub mem_mib: u32,
    pub workload: Workload,
    pub ferry_exe: PathBuf,
}

impl GroupBench {
    /// Member `i`'s workload: (i + 1) thirds of the bench's.
    fn member_workload(&self, i: usize) -> Workload {
        let thirds = u32::try_from(i + 1).unwrap_or(3);
        Workload {
            dirty_mib: (self.workload.dirty_mib * thirds / 3).max(1),
            ..self.workload.clone()
        }
    }
}

/// Runs the bench in a lab up with libvirt and a controller; `emit` gets each move's record.
/// A move that fails ends the bench (the members are not all where the next one starts):
/// its record is emitted, then the error returned.
pub async fn run(
    lab: &Lab,
    img: &Image,
    bench: &GroupBench,
    mut emit: impl FnMut(&GroupMoveRecord) -> Result<()>,
) -> Result<usize> {
    let exe = bench.ferry_exe.as_path();
    wait_until(Duration::from_secs(60), || {
        fleet_json(lab, exe, "hosts")
            .is_ok_and(|h| h.len() == 2 && h.iter().all(|h| h["state"] == "up"))
    })
    .context("the agents did not register with the controller")?;
    for (i, name) in MEMBERS.into_iter().enumerate() {
        let nic = GuestNic::lab(40 + u8::try_from(i)?);
        let command = bench.member_workload(i).start_command();
        // The link goes: the workload runs on without it.
        drop(libvirt::start_tiny_domain(lab, img, (name, bench.mem_mib, &nic), &command).await?);
    }
    wait_for_members_at(lab, exe, Site::A)?;
    let events = {
        let lab = lab.clone();
        tokio::task::spawn_blocking(move || -> Result<[LifecycleEvents; 2]> {
            Ok([
                LifecycleEvents::watch(&lab, Site::A)?,
                LifecycleEvents::watch(&lab, Site::B)?,
            ])
        })
        .await??
    };

    for run in 1..=bench.runs {
        for &mode in &bench.arrivals {
            for (from, to) in [(Site::A, Site::B), (Site::B, Site::A)] {
                let record = move_once(lab, exe, &events, mode, (from, to), run).await;
                emit(&record)?;
                if !record.completed {
                    bail!("{} {} -> {} failed", mode.name(), from.name(), to.name());
                }
            }
        }
    }
    Ok(0)
}

async fn move_once(
    lab: &Lab,
    exe: &Path,
    events: &[LifecycleEvents; 2],
    mode: Arrival,
    (from, to): (Site, Site),
    run: u32,
) -> GroupMoveRecord {
    let mut record = GroupMoveRecord {
        mode: mode.name(),
        run,
        from: from.name(),
        to: to.name(),
        completed: false,
        total_ms: 0,
        resume_window_ms: None,
        split_ms: None,
        pauses_ms: Vec::new(),
        hold_ms: None,
        wan_bytes: 0,
        error: None,
    };
    if let Err(e) = measure(lab, exe, events, mode, (from, to), &mut record).await {
        record.error = Some(format!("{e:#}"));
    }
    record
}

async fn measure(
    lab: &Lab,
    exe: &Path,
    events: &[LifecycleEvents; 2],
    mode: Arrival,
    (from, to): (Site, Site),
    record: &mut GroupMoveRecord,
) -> Result<()> {
    let since = unix_ms();
    let wan_before = crate::wan::stats(&lab.wan_socket())?.total_bytes();
    let started = Instant::now();
    let moved = {
        let (lab, exe) = (lab.clone(), exe.to_owned());
        tokio::task::spawn_blocking(move || travel(&lab, &exe, mode, to)).await?
    };
    record.total_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    record.wan_bytes = crate::wan::stats(&lab.wan_socket())?
        .total_bytes()
        .saturating_sub(wan_before);
    moved?;

    let [at_a, at_b] = events;
    let (at_source, at_destination) = match from {
        Site::A => (at_a, at_b),
        Site::B => (at_b, at_a),
    };
    let mut paused = Vec::new();
    let mut resumed = Vec::new();
    // libvirt's events come a moment after the commit the CLI saw.
    wait_until(Duration::from_secs(10), || {
        MEMBERS.iter().all(|m| {
            at_source
                .first_since(m, "Suspended Migrated", since)
                .is_some()
                && at_destination
                    .first_since(m, "Resumed Migrated", since)
                    .is_some()
        })
    })
    .with_context(|| {
        format!(
            "libvirt's events of the move: at the source {:?}, at the destination {:?}",
            at_source.lines(),
            at_destination.lines()
        )
    })?;
    for member in MEMBERS {
        let stop = at_source
            .first_since(member, "Suspended Migrated", since)
            .context("source event")?;
        let resume = at_destination
            .first_since(member, "Resumed Migrated", since)
            .context("destination event")?;
        paused.push(stop);
        resumed.push(resume);
        record.pauses_ms.push(resume.saturating_sub(stop));
    }
    let (first_resume, last_resume) = (min(&resumed), max(&resumed));
    record.resume_window_ms = Some(last_resume - first_resume);
    record.split_ms = Some(max(&paused).saturating_sub(first_resume));
    if mode == Arrival::Group {
        let groups = fleet_json(lab, exe, "groups")?;
        let group = groups.last().context("the controller lists no group")?;
        let held = group["members"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["held_unix_ms"].as_u64())
            .min();
        record.hold_ms = held
            .zip(group["decided_unix_ms"].as_u64())
            .map(|(held, decided)| decided.saturating_sub(held));
    }
    wait_for_members_at(lab, exe, to)?;
    record.completed = true;
    Ok(())
}

/// Moves the members to `to` as `mode` says; returns once every one committed.
fn travel(lab: &Lab, exe: &Path, mode: Arrival, to: Site) -> Result<()> {
    let migrate = |vms: &[&str], group: bool| {
        let mut args: Vec<String> = vec!["migrate".into()];
        args.extend(vms.iter().map(|v| (*v).to_owned()));
        if group {
            args.push("--group".into());
        }
        args.extend(["--to-site".into(), to.name().into()]);
        fleet(lab, exe, &args).map(drop)
    };
    match mode {
        Arrival::Group => migrate(&MEMBERS, true),
        Arrival::OneByOne => MEMBERS.iter().try_for_each(|m| migrate(&[m], false)),
        Arrival::AtOnce => std::thread::scope(|s| {
            let moves: Vec<_> = MEMBERS
                .iter()
                .map(|m| s.spawn(move || migrate(&[m], false)))
                .collect();
            moves
                .into_iter()
                .map(|m| m.join().expect("a move's thread panicked"))
                .collect::<Result<Vec<()>>>()
                .map(drop)
        }),
    }
}

/// Waits until the controller lists every member at `site` (its next request starts there).
fn wait_for_members_at(lab: &Lab, exe: &Path, site: Site) -> Result<()> {
    let host = format!("site-{}", site.name());
    wait_until(Duration::from_secs(60), || {
        fleet_json(lab, exe, "vms").is_ok_and(|vms| {
            MEMBERS.iter().all(|m| {
                vms.iter()
                    .any(|v| v["name"] == *m && v["host"] == host.as_str())
            })
        })
    })
    .with_context(|| format!("the controller does not list the members at {host}"))
}

fn min(values: &[u64]) -> u64 {
    values.iter().copied().min().unwrap_or_default()
}

fn max(values: &[u64]) -> u64 {
    values.iter().copied().max().unwrap_or_default()
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_own_thirds_of_the_workload() {
        let bench = GroupBench {
            runs: 1,
            arrivals: Arrival::ALL.to_vec(),
            mem_mib: 256,
            workload: Workload {
                pattern: "ws".into(),
                dirty_mib: 48,
                rate_mib_s: 1.0,
            },
            ferry_exe: PathBuf::new(),
        };
        let sizes: Vec<u32> = (0..3).map(|i| bench.member_workload(i).dirty_mib).collect();
        assert_eq!(sizes, [16, 32, 48]);
    }
}
