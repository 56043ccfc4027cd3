//! The migration engine below end to end: two real agents in this process (their API, peer
//! endpoint, session, codec, source and destination), a real captured QEMU stream, and fake
//! QEMUs that speak QMP and hold at gates so that a fault lands in a chosen phase. No root, no
//! QEMU, a few seconds each: they run first in CI.
//!
//! What each test shows is one cell of docs/GUARANTEES.md's fault matrix: which VM runs, the
//! migration's final state and message. "Runs" is the fake QEMU's own state: resumed by `cont`
//! at the destination, still (or again) running at the source.

mod agents;
mod fake_qemu;
mod link;

use std::time::Duration;

use ferry_api::agent::{CodecSettings, MigrationState, MigrationStatus, Phase};
use ferry_api::settings::MigrationSettings;

use agents::{captured_stream, Pair};
use fake_qemu::Gates;

/// Short enough that the tests of a dead peer end quickly.
const WAN_TIMEOUT_S: u64 = 3;

/// The stream channel in three shards (`engine::pipeline`): every fault below meets a stream
/// of shard lanes and order units, replayed across reconnects in order. One shard, what the
/// agents choose today, and sixteen are in the first test. The block caches pause and resume
/// every 64 KiB of QEMU's stream (the governor's doing when the CPU is the limit), so the
/// replays carry units of both kinds.
fn settings() -> MigrationSettings {
    MigrationSettings {
        wan_timeout_s: WAN_TIMEOUT_S,
        test_shards: Some(3),
        test_cache_pause_bytes: Some(64 << 10),
        ..MigrationSettings::default()
    }
}

/// Somewhere in the memory passes (the stream is 733 KB).
const MID_STREAM: u64 = 300_000;

/// Migrates with the destination's load held (`Gates::load_held`) until the source has sent
/// the stream's end and waits for the verdict; returns the migration's id.
async fn until_end_sent(pair: &Pair) -> String {
    let id = pair.migrate(settings()).await;
    pair.destination
        .gates()
        .load
        .wait_reached("the destination's load")
        .await;
    pair.wait(&id, "awaiting the commit", |s| {
        s.phase == Phase::AwaitingCommit
    })
    .await;
    id
}

/// Migrates with the source's stream held at [`MID_STREAM`] (`Gates::stream_held_at`) and a
/// WAN timeout of `wan_timeout_s`, until the stream stands there; returns the migration's id.
async fn until_mid_stream(pair: &Pair, wan_timeout_s: u64) -> String {
    let id = pair
        .migrate(MigrationSettings {
            wan_timeout_s,
            ..settings()
        })
        .await;
    pair.source
        .gates()
        .stream()
        .wait_reached("the stream's middle")
        .await;
    id
}

/// Polls `ready` until it holds (within a minute).
async fn wait_until(what: &str, ready: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !ready() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls one of `agent`'s metrics until it reads `value` (within a minute): what an agent
/// keeps after a migration settles once both ends have finished with it.
async fn wait_for_metric(agent: &agents::Agent, name: &str, value: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while agent.metric(name).await != value {
        assert!(
            std::time::Instant::now() < deadline,
            "{name} is not {value}: {}",
            agent.metrics().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The migration committed: the destination QEMU loaded exactly the source's bytes and runs,
/// the source QEMU was quit and never resumed.
fn assert_committed(pair: &Pair, status: &ferry_api::agent::MigrationStatus) {
    assert_eq!(status.state, MigrationState::Committed, "{status:?}");
    assert_eq!(status.phase, Phase::Committed, "{status:?}");
    let (source, destination) = (pair.source.seen(), pair.destination.seen());
    assert!(destination.loaded, "{destination:?}");
    assert!(destination.running(), "{destination:?}");
    assert!(source.ran("quit"), "{source:?}");
    assert!(!source.ran("cont"), "{source:?}");
    let digest = blake3::hash(&captured_stream()).to_hex().to_string();
    assert_eq!(
        status.digest.as_deref(),
        Some(digest.as_str()),
        "{status:?}"
    );
}

/// The migration failed with `message` in its error, the source runs, and the destination's
/// QEMU was told to quit without ever running.
fn assert_source_runs(pair: &Pair, status: &ferry_api::agent::MigrationStatus, message: &str) {
    assert_eq!(status.state, MigrationState::Failed, "{status:?}");
    let error = status.error.as_deref().unwrap_or_default();
    assert!(error.contains(message), "{error}");
    assert!(error.contains("the source VM keeps running"), "{error}");
    let (source, destination) = (pair.source.seen(), pair.destination.seen());
    assert!(source.running(), "{source:?}");
    assert!(!source.ran("quit"), "{source:?}");
    assert!(!destination.running(), "{destination:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_commits_with_every_byte_in_each_codec_connection_count_and_shards() {
    // 0: as many as the link needs, one here.
    for (codec, connections, shards) in [
        (CodecSettings::ALL, 0, None),
        (CodecSettings::NONE, 4, None),
        (CodecSettings::ALL, 2, Some(16)),
    ] {
        let pair = Pair::up(Gates::default(), Gates::default());
        let id = pair
            .migrate(MigrationSettings {
                codec,
                connections,
                test_shards: shards,
                ..settings()
            })
            .await;
        let status = pair.finished(&id).await;
        assert_committed(&pair, &status);
        assert_eq!(status.stream_bytes, captured_stream().len() as u64);
        assert!(pair.destination.seen().ran("cont"));
        assert_eq!(status.wire.connections, connections.max(1));
        assert_eq!(
            status.wire.connections_why.is_some(),
            connections == 0,
            "{:?}",
            status.wire
        );
        if codec.dedup {
            let report = status.codec.as_ref().expect("the codec's report");
            assert!(report.cache_paused_batches > 0, "{report:?}");
        }
        // The agent paces the WAN; QEMU's own cap (128 MiB/s by default) must not pace the
        // local hop into it.
        let max_bandwidth = &pair.source.seen().parameters["max-bandwidth"];
        assert!(
            max_bandwidth.as_u64().is_some_and(|b| b >= 100 << 30),
            "{max_bandwidth}"
        );
        // What the agents keep afterwards: the source its parked connections for the next
        // migration to b, neither a session; both report their footprint.
        wait_for_metric(
            &pair.a,
            "ferry_agent_parked_connections",
            u64::from(connections.max(1)),
        )
        .await;
        for agent in [&pair.a, &pair.b] {
            wait_for_metric(agent, "ferry_agent_incoming_sessions", 0).await;
            assert!(agent.metric("ferry_agent_resident_bytes").await > 1 << 20);
            assert!(agent.metric("ferry_agent_open_fds").await > 3);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_frame_fails_the_digest_and_the_source_resumes() {
    let pair = Pair::up(Gates::default(), Gates::default());
    let id = pair
        .migrate(MigrationSettings {
            test_corrupt_at: Some(MID_STREAM),
            ..settings()
        })
        .await;
    let status = pair.finished(&id).await;
    assert_source_runs(&pair, &status, "stream digest mismatch");
    // The source had stopped for its last pass: it was resumed.
    assert!(pair.source.seen().ran("cont"));
    assert!(pair.destination.seen().ran("quit"));
}

/// A postcopy pair: both fakes with the captured postcopy stream, the source's gates
/// `gates`.
fn postcopy_pair(gates: Gates) -> Pair {
    let stream = agents::postcopy_stream();
    Pair::up_with(gates, Gates::default(), stream.clone(), stream)
}

/// Where the captured postcopy stream's package starts and ends.
fn package() -> (usize, usize) {
    fake_qemu::package_of(&agents::postcopy_stream()).expect("a postcopy package")
}

/// The source's gates that hold the stream once the package is out (at the first piece after
/// the one the package ends in): the source QEMU is then `postcopy-active`.
fn held_after_the_package() -> Gates {
    let (start, end) = package();
    let after = start + ((end - start) / fake_qemu::PIECE + 1) * fake_qemu::PIECE;
    Gates::stream_held_at(after as u64)
}

/// A postcopy migration past its switch (the VM runs at the destination) whose source QEMU
/// holds the rest of its stream until the test opens its gate.
async fn switched_with_the_stream_held() -> (Pair, String) {
    let pair = postcopy_pair(held_after_the_package());
    let id = pair.migrate(postcopy()).await;
    pair.source
        .gates()
        .stream()
        .wait_reached("the stream after the package")
        .await;
    pair.wait(&id, "the switch", |s| s.phase == Phase::Postcopy)
        .await;
    (pair, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_agent_restarted_after_the_postcopy_switch_resumes_it_through_qemus_recovery() {
    use ferry_agent::engine::journal::Journal;
    let (mut pair, id) = switched_with_the_stream_held().await;
    // The source agent goes with the socket its QEMU writes the rest of the memory to.
    pair.a.kill();
    pair.source.gates().stream().open();
    wait_until("the source QEMU pauses its postcopy migration", || {
        pair.source.seen().migration.as_deref() == Some("postcopy-paused")
    })
    .await;
    let journal = Journal::new(&pair.a.config.work_dir);
    let record = journal.all_outgoing().unwrap().pop().expect("a record");
    assert!(record.postcopy_pending, "{record:?}");
    assert!(pair.destination.seen().running());
    // Restarted, it finds the paused QEMU its record names and resumes the migration; the
    // destination agent gives up the old session, and its QEMU recovers on a new socket.
    pair.a.restart();
    let status = pair.finished(&id).await;
    assert_recovered(&pair, &status, 1);
    assert_eq!(
        pair.destination.seen().preempt_bytes,
        fake_qemu::PREEMPT_PAGES.len() as u64
    );
    let record = journal.all_outgoing().unwrap().pop().expect("a record");
    assert!(
        !record.postcopy_pending && record.reason.is_none(),
        "{record:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_agent_restarted_after_the_postcopy_switch_is_resumed() {
    use ferry_agent::engine::journal::Journal;
    let (mut pair, id) = switched_with_the_stream_held().await;
    // The destination agent goes with its QEMU's sockets; a keeper holds its monitor.
    pair.b.kill();
    wait_until("the destination QEMU pauses its postcopy migration", || {
        pair.destination.seen().migration.as_deref() == Some("postcopy-paused")
    })
    .await;
    let journal = Journal::new(&pair.b.config.work_dir);
    let record = journal.all_incoming().unwrap().pop().expect("a record");
    assert!(
        record.postcopy_pending && record.monitor_keeper.is_some(),
        "{record:?}"
    );
    // Restarted, it takes the monitor back; the source, asking about its silent session,
    // hears the migration paused there and resumes it through QEMU's recovery.
    pair.b.restart();
    pair.wait(&id, "the source's resume", |s| {
        s.detail.contains("resuming the migration")
    })
    .await;
    pair.source.gates().stream().open();
    let status = pair.finished(&id).await;
    assert_recovered(&pair, &status, 1);
    let record = journal.all_incoming().unwrap().pop().expect("a record");
    assert!(
        !record.postcopy_pending && record.monitor_keeper.is_none(),
        "{record:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_agent_restarted_again_during_the_postcopy_recovery_resumes_it_again() {
    let (mut pair, id) = switched_with_the_stream_held().await;
    pair.a.kill();
    let held = pair.source.gates().stream();
    held.open();
    wait_until("the source QEMU pauses its postcopy migration", || {
        pair.source.seen().migration.as_deref() == Some("postcopy-paused")
    })
    .await;
    // The resumed stream is held at the same place, and the source agent goes again.
    held.close();
    pair.a.restart();
    held.wait_reached("the resumed stream").await;
    pair.a.kill();
    held.open();
    wait_until("the source QEMU pauses again", || {
        pair.source.seen().migration.as_deref() == Some("postcopy-paused")
    })
    .await;
    // The destination gives up the first resume (its monitor comes back) for the second.
    pair.a.restart();
    let status = pair.finished(&id).await;
    assert_recovered(&pair, &status, 2);
}

/// The postcopy migration ended committed through `recovers` of QEMU's recoveries: the VM runs
/// at the destination with every page, and the source QEMU quit without ever running again.
fn assert_recovered(pair: &Pair, status: &MigrationStatus, recovers: usize) {
    assert_eq!(status.state, MigrationState::Committed, "{status:?}");
    let (source, destination) = (pair.source.seen(), pair.destination.seen());
    assert!(source.ran("quit") && !source.ran("cont"), "{source:?}");
    let recovered = destination
        .commands
        .iter()
        .filter(|c| *c == "migrate-recover")
        .count();
    assert_eq!(recovered, recovers, "{destination:?}");
    assert!(
        destination.loaded && destination.running() && !destination.ran("quit"),
        "{destination:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_qemu_killed_after_the_postcopy_switch_loses_the_pages_it_held_and_says_so() {
    use ferry_agent::engine::journal::{IncomingState, Journal};
    let (mut pair, id) = switched_with_the_stream_held().await;
    pair.source.kill();
    let status = pair.finished(&id).await;
    assert_failed_saying(&status, &["the source QEMU exited", "can never have them"]);
    // The destination is told: its record says the VM is lost, and no recovery is awaited.
    let journal = Journal::new(&pair.b.config.work_dir);
    wait_until("the destination's record says lost", || {
        journal.all_incoming().unwrap().pop().map(|r| r.state) == Some(IncomingState::Lost)
    })
    .await;
    let record = journal.all_incoming().unwrap().pop().expect("a record");
    assert!(
        !record.postcopy_pending && record.monitor_keeper.is_none(),
        "{record:?}"
    );
    assert!(
        record
            .reason
            .unwrap_or_default()
            .contains("the source QEMU exited"),
        "the destination's record names the lost QEMU"
    );
    // Nothing is undone at the destination: its QEMU is an operator's to inspect.
    assert!(!pair.destination.seen().ran("quit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destination_qemu_killed_after_the_postcopy_switch_loses_the_vm_and_says_so() {
    use ferry_agent::engine::journal::{IncomingState, Journal, OutgoingState};
    let (mut pair, id) = switched_with_the_stream_held().await;
    pair.destination.kill();
    pair.source.gates().stream().open();
    let status = pair.finished(&id).await;
    assert_failed_saying(
        &status,
        &["the destination QEMU exited", "rolls the guest back"],
    );
    // The source QEMU holds the VM as it was at the switch: neither resumed nor quit, and a
    // restarted agent leaves it so (its record says failed, not committed).
    let source = pair.source.seen();
    assert!(!source.ran("quit") && !source.ran("cont"), "{source:?}");
    let outgoing = Journal::new(&pair.a.config.work_dir)
        .all_outgoing()
        .unwrap();
    assert_eq!(
        outgoing.last().map(|r| r.state),
        Some(OutgoingState::Failed)
    );
    let incoming = Journal::new(&pair.b.config.work_dir)
        .all_incoming()
        .unwrap();
    assert_eq!(incoming.last().map(|r| r.state), Some(IncomingState::Lost));
}

/// The migration failed, its error saying each of `words`.
fn assert_failed_saying(status: &MigrationStatus, words: &[&str]) {
    assert_eq!(status.state, MigrationState::Failed, "{status:?}");
    let error = status.error.as_deref().unwrap_or_default();
    for word in words {
        assert!(error.contains(word), "{word:?} not in: {error}");
    }
}

fn postcopy() -> MigrationSettings {
    MigrationSettings {
        postcopy: true,
        ..settings()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postcopy_commits_at_the_switch_before_the_streams_end() {
    // The destination runs the VM while the source still holds most of its memory.
    let (pair, id) = switched_with_the_stream_held().await;
    assert!(pair.destination.seen().running());
    // The pages the guest faults on there cross on the preempt channel, past the held stream.
    let faulted = fake_qemu::PREEMPT_PAGES.len() as u64;
    wait_until("the faulted pages at the destination QEMU", || {
        pair.destination.seen().preempt_bytes >= faulted
    })
    .await;
    let stream = agents::postcopy_stream();
    let (destination, (_, package_end)) = (pair.destination.seen(), package());
    assert!(
        destination.preempt_at_stream_bytes < Some(stream.len() as u64 - fake_qemu::PIECE as u64),
        "{destination:?}"
    );
    assert!(destination.stream_bytes >= package_end as u64);
    pair.source.gates().stream().open();
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Committed, "{status:?}");
    let (source, destination) = (pair.source.seen(), pair.destination.seen());
    assert!(source.ran("migrate-start-postcopy"), "{source:?}");
    assert!(source.ran("quit") && !source.ran("cont"), "{source:?}");
    assert!(
        destination.loaded && destination.running(),
        "{destination:?}"
    );
    assert_eq!(status.preempt_bytes, faulted);
    assert!(
        source.has("postcopy-preempt") && destination.has("postcopy-preempt"),
        "{source:?} {destination:?}"
    );
    // The destination ran the VM with pages still to come.
    let resumed_at = destination.resumed_at_bytes.expect("resumed");
    assert!(
        resumed_at < stream.len() as u64,
        "resumed at byte {resumed_at} of {}",
        stream.len()
    );
    let digest = blake3::hash(&stream).to_hex().to_string();
    assert_eq!(status.digest.as_deref(), Some(digest.as_str()));
    assert!(status.postcopy_done_unix_us >= status.destination_resume_unix_us);
    let committed = status
        .events
        .iter()
        .position(|e| {
            e.detail
                .starts_with("postcopy: the destination runs the VM")
        })
        .expect("the switch's commit event");
    let ended = status
        .events
        .iter()
        .position(|e| e.kind == ferry_api::EventKind::StreamEnded)
        .expect("the stream's end");
    assert!(committed < ended, "{:?}", status.events);
}

/// Asked to switch only once the throttle is hard, the source switches when QEMU reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postcopy_at_a_throttle_switches_once_qemu_throttles_that_hard() {
    let pair = postcopy_pair(Gates::default());
    let pct = u8::try_from(fake_qemu::THROTTLE_AT_THE_SWITCH).unwrap();
    let id = pair
        .migrate(MigrationSettings {
            postcopy_at_throttle_pct: Some(pct),
            ..settings()
        })
        .await;
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Committed, "{status:?}");
    let (source, destination) = (pair.source.seen(), pair.destination.seen());
    assert!(source.ran("migrate-start-postcopy"), "{source:?}");
    assert!(
        source.has("postcopy-ram") && destination.has("postcopy-ram"),
        "{source:?} {destination:?}"
    );
    assert!(destination.loaded && destination.running());
    assert_eq!(status.preempt_bytes, fake_qemu::PREEMPT_PAGES.len() as u64);
}

/// Once the VM runs at the destination, failing would help nobody: both agents hold on past
/// the WAN timeout, and the pages follow when the link returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_dark_beyond_the_wan_timeout_after_the_postcopy_switch_only_stalls_it() {
    let (pair, id) = switched_with_the_stream_held().await;
    pair.link.darken();
    pair.link.cut();
    // Both ends have been without a connection for longer than the WAN timeout (3 s).
    let silent_s = |s: &ferry_api::agent::MigrationStatus| {
        s.detail
            .strip_prefix("postcopy: no connection to the destination for ")
            .and_then(|rest| rest.split('s').next())
            .and_then(|n| n.parse::<u64>().ok())
    };
    let status = pair
        .wait(&id, "holding on past the WAN timeout", |s| {
            silent_s(s).is_some_and(|n| n > WAN_TIMEOUT_S + 1)
        })
        .await;
    assert_eq!(status.state, MigrationState::Running, "{status:?}");
    assert_eq!(status.phase, Phase::Postcopy, "{status:?}");
    let destination = pair.destination.seen();
    assert!(
        destination.running() && !destination.ran("quit"),
        "{destination:?}"
    );
    pair.source.gates().stream().open();
    pair.link.light();
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Committed, "{status:?}");
    let destination = pair.destination.seen();
    assert!(
        destination.loaded && destination.running(),
        "{destination:?}"
    );
    assert!(pair.source.seen().ran("quit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_frame_before_the_postcopy_switch_never_reaches_the_destination_qemu() {
    let pair = postcopy_pair(held_after_the_package());
    let id = pair
        .migrate(MigrationSettings {
            test_corrupt_at: Some(100_000),
            ..postcopy()
        })
        .await;
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Failed, "{status:?}");
    let error = status.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("stream digest mismatch at the postcopy package"),
        "{error}"
    );
    // QEMU 10.0 can take its postcopy back neither way: the source stays paused, and says so.
    assert!(error.contains("the source VM stays paused"), "{error}");
    assert_eq!(status.detail, "the source VM stays paused");
    let (source, destination) = (pair.source.seen(), pair.destination.seen());
    assert!(!source.running() && !source.ran("quit"), "{source:?}");
    // The destination never got the package's end, never ran, and was told to quit.
    let (start, package_end) = package();
    assert!(start > 100_000, "the flipped bit lies before the package");
    let package_end = package_end as u64;
    assert!(
        destination.stream_bytes < package_end,
        "{} of {package_end}",
        destination.stream_bytes
    );
    assert!(
        !destination.ran("cont") && destination.ran("quit"),
        "{destination:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_destination_qemu_cannot_load_fails_and_the_source_resumes() {
    let pair = Pair::up_expecting(Gates::default(), Gates::default(), agents::idle_stream());
    let id = pair.migrate(settings()).await;
    let status = pair.finished(&id).await;
    assert_source_runs(&pair, &status, "destination QEMU failed to load the stream");
    assert!(pair.destination.seen().ran("quit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_during_the_memory_passes_resumes_the_source() {
    let pair = Pair::up(Gates::stream_held_at(MID_STREAM), Gates::default());
    let id = pair.migrate(settings()).await;
    pair.source
        .gates()
        .stream()
        .wait_reached("the stream's middle")
        .await;
    pair.a.client().cancel(&id).await.expect("cancel is taken");
    pair.source.gates().stream().open();
    let status = pair.finished(&id).await;
    assert_source_runs(&pair, &status, "cancelled by the user");
    assert!(pair.source.seen().ran("migrate_cancel"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_after_the_streams_end_went_out_is_refused_and_the_migration_commits() {
    let pair = Pair::up(Gates::default(), Gates::load_held());
    let id = until_end_sent(&pair).await;
    let refused = pair.a.client().cancel(&id).await.unwrap_err();
    assert!(
        refused.to_string().contains("can no longer be cancelled"),
        "{refused:#}"
    );
    pair.destination.gates().load.open();
    let status = pair.finished(&id).await;
    assert_committed(&pair, &status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_qemu_killed_mid_stream_fails_it_and_nothing_runs_at_the_destination() {
    let mut pair = Pair::up(Gates::stream_held_at(MID_STREAM), Gates::default());
    let id = pair.migrate(settings()).await;
    pair.source
        .gates()
        .stream()
        .wait_reached("the stream's middle")
        .await;
    pair.source.kill();
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Failed, "{status:?}");
    wait_until("the destination quits its QEMU", || {
        pair.destination.seen().ran("quit")
    })
    .await;
    assert!(!pair.destination.seen().running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destination_qemu_killed_before_the_commit_fails_it_and_the_source_resumes() {
    let mut pair = Pair::up(Gates::default(), Gates::load_held());
    let id = pair.migrate(settings()).await;
    pair.destination
        .gates()
        .load
        .wait_reached("the destination's load")
        .await;
    pair.destination.kill();
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Failed, "{status:?}");
    let error = status.error.clone().unwrap_or_default();
    assert!(error.contains("the destination aborted"), "{error}");
    let source = pair.source.seen();
    assert!(source.running() && source.ran("cont"), "{source:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destination_agent_killed_mid_stream_fails_it_at_the_wan_timeout() {
    let mut pair = Pair::up(Gates::stream_held_at(MID_STREAM), Gates::default());
    let id = pair.migrate(settings()).await;
    pair.source
        .gates()
        .stream()
        .wait_reached("the stream's middle")
        .await;
    // QEMU still has passes to send when the destination goes (if the rest of the stream and
    // its end fit in the send window, the source is in doubt instead: see below).
    pair.b.kill();
    let status = pair.finished(&id).await;
    assert_source_runs(&pair, &status, "the WAN timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destination_agent_killed_after_the_streams_end_leaves_the_source_paused_in_doubt() {
    let mut pair = Pair::up(Gates::default(), Gates::load_held());
    let id = until_end_sent(&pair).await;
    pair.b.kill();
    pair.destination.gates().load.open();
    // Without the destination's verdict the source may not run: the destination might.
    let status = pair
        .wait(&id, "in doubt", |s| s.phase == Phase::InDoubt)
        .await;
    assert_eq!(status.state, MigrationState::Running, "{status:?}");
    let (source, destination) = (pair.source.seen(), pair.destination.seen());
    assert!(!source.running() && !source.ran("cont"), "{source:?}");
    assert!(!destination.running(), "{destination:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_dark_for_5s_or_reset_mid_stream_does_not_fail_it() {
    for reset in [false, true] {
        let pair = Pair::up(Gates::stream_held_at(MID_STREAM), Gates::default());
        let id = until_mid_stream(&pair, 30).await;
        if reset {
            pair.link.cut();
        } else {
            pair.link.darken();
        }
        pair.source.gates().stream().open();
        if !reset {
            tokio::time::sleep(Duration::from_secs(5)).await;
            // The middlebox forgot the connections while it was dark.
            pair.link.cut();
            pair.link.light();
        }
        let status = pair.finished(&id).await;
        assert_committed(&pair, &status);
        assert!(status.wire.reconnects >= 1, "{status:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_dark_beyond_the_wan_timeout_mid_stream_fails_it_and_the_source_resumes() {
    let pair = Pair::up(Gates::stream_held_at(MID_STREAM), Gates::default());
    let id = pair.migrate(settings()).await;
    pair.source
        .gates()
        .stream()
        .wait_reached("the stream's middle")
        .await;
    pair.link.darken();
    let status = pair.finished(&id).await;
    assert_source_runs(&pair, &status, "the WAN timeout");
    // The destination gave up too: its QEMU was told to quit.
    wait_until("the destination quits its QEMU", || {
        pair.destination.seen().ran("quit")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_dark_while_the_destination_commits_leaves_the_source_in_doubt_until_it_hears() {
    let pair = Pair::up(Gates::default(), Gates::cont_held());
    let id = pair.migrate(settings()).await;
    pair.destination
        .gates()
        .cont
        .wait_reached("the destination's cont")
        .await;
    pair.link.darken();
    pair.destination.gates().cont.open();
    let status = pair
        .wait(&id, "in doubt", |s| s.phase == Phase::InDoubt)
        .await;
    assert_eq!(status.state, MigrationState::Running, "{status:?}");
    assert!(!pair.source.seen().running());
    // The destination runs; once the link is back the source hears it and quits.
    pair.link.cut();
    pair.link.light();
    let status = pair.finished(&id).await;
    assert_committed(&pair, &status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_reset_or_dark_for_5s_after_the_streams_end_does_not_fail_it() {
    // Every connection reset while the destination loads: redialed, committed.
    let pair = Pair::up(Gates::default(), Gates::load_held());
    let id = until_end_sent(&pair).await;
    pair.link.cut();
    pair.destination.gates().load.open();
    let status = pair.finished(&id).await;
    assert_committed(&pair, &status);
    // Dark for 5 s while it loads, its connections then forgotten: committed.
    let pair = Pair::up(Gates::default(), Gates::load_held());
    let id = pair
        .migrate(MigrationSettings {
            wan_timeout_s: 30,
            ..settings()
        })
        .await;
    pair.destination
        .gates()
        .load
        .wait_reached("the destination's load")
        .await;
    pair.link.darken();
    pair.destination.gates().load.open();
    tokio::time::sleep(Duration::from_secs(5)).await;
    pair.link.cut();
    pair.link.light();
    let status = pair.finished(&id).await;
    assert_committed(&pair, &status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_qemu_killed_while_being_resumed_leaves_the_source_paused_for_an_operator() {
    let mut pair = Pair::up(Gates::default(), Gates::cont_held());
    let id = pair.migrate(settings()).await;
    pair.destination
        .gates()
        .cont
        .wait_reached("the destination's cont")
        .await;
    // Whether the VM ran there nobody can tell: the destination answers "unknown", and the
    // source stays paused, in doubt, asking, never resumed and never quit.
    pair.destination.kill();
    let status = pair
        .wait(&id, "the destination's answer", |s| {
            s.phase == Phase::InDoubt && s.detail.contains("the destination says it cannot tell")
        })
        .await;
    assert_eq!(status.state, MigrationState::Running, "{status:?}");
    let source = pair.source.seen();
    assert!(
        !source.running() && !source.ran("cont") && !source.ran("quit"),
        "{source:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_agent_killed_mid_stream_leaves_the_source_running() {
    let mut pair = Pair::up(Gates::stream_held_at(MID_STREAM), Gates::default());
    pair.migrate(settings()).await;
    pair.source
        .gates()
        .stream()
        .wait_reached("the stream's middle")
        .await;
    pair.a.kill();
    pair.source.gates().stream().open();
    // QEMU's migration fails on the closed socket (or was cancelled by the agent as it went:
    // the harness's kill lets its tasks run until they next wait, SIGKILL would not) and its
    // VM runs on; the destination gives up at the WAN timeout.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !matches!(
        pair.source.seen().migration.as_deref(),
        Some("failed" | "cancelled")
    ) {
        assert!(
            std::time::Instant::now() < deadline,
            "the source QEMU's migration did not end: {:?}",
            pair.source.seen()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pair.source.seen().running());
    wait_until("the destination quits its QEMU", || {
        pair.destination.seen().ran("quit")
    })
    .await;
    assert!(!pair.destination.seen().running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_agent_killed_after_the_streams_end_leaves_only_the_destination_running() {
    let mut pair = Pair::up(Gates::default(), Gates::load_held());
    until_end_sent(&pair).await;
    pair.a.kill();
    pair.destination.gates().load.open();
    // The destination holds the whole verified stream: it commits without the source.
    wait_until("the destination runs", || pair.destination.seen().running()).await;
    let source = pair.source.seen();
    assert!(!source.running() && !source.ran("cont"), "{source:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_agent_restarted_before_its_digest_check_aborts_and_the_source_resumes() {
    // Its QEMU stops reading half way: the source has sent everything and its end (the coded
    // stream fits its window), the destination cannot finish feeding QEMU (more is left than
    // the socket holds), so it has not checked the digest and its record says receiving.
    let mut pair = Pair::up(Gates::default(), Gates::read_held_at(MID_STREAM));
    let id = pair.migrate(settings()).await;
    pair.destination
        .gates()
        .read()
        .wait_reached("the destination's reading")
        .await;
    pair.wait(&id, "awaiting the commit", |s| {
        s.phase == Phase::AwaitingCommit
    })
    .await;
    pair.b.kill();
    pair.destination.gates().read().open();
    // The restarted agent quits the QEMU it left and tells the source, which asks once it is
    // in doubt.
    pair.b.restart();
    let status = pair.finished(&id).await;
    assert_source_runs(
        &pair,
        &status,
        "the destination agent restarted before the commit",
    );
    assert!(pair.destination.seen().ran("quit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_agent_restarted_mid_stream_says_so_and_the_source_resumes_at_once() {
    let mut pair = Pair::up(Gates::stream_held_at(MID_STREAM), Gates::default());
    // A WAN timeout beyond the minute `finished` waits: the source learns from the
    // destination's word, not from the silence.
    let id = until_mid_stream(&pair, 120).await;
    // Its record says `receiving`: the restarted agent quits its QEMU, and answers the
    // source's question about the silent session "aborted".
    pair.b.restart();
    pair.source.gates().stream().open();
    let status = pair.finished(&id).await;
    assert_source_runs(
        &pair,
        &status,
        "the destination aborted: the destination agent restarted before the commit",
    );
    assert!(pair.destination.seen().ran("quit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_agent_restarted_after_recording_its_commit_resumes_its_vm() {
    let mut pair = Pair::up(Gates::default(), Gates::load_held());
    let id = pair.migrate(settings()).await;
    pair.destination
        .gates()
        .load
        .wait_reached("the destination's load")
        .await;
    // The digest matched and the commit is on record while QEMU finishes loading.
    let journal = pair.b.config.work_dir.join("journal/incoming");
    wait_until("the destination records its commit", || {
        std::fs::read_dir(&journal).is_ok_and(|d| {
            d.filter_map(Result::ok).any(|e| {
                std::fs::read_to_string(e.path()).is_ok_and(|r| r.contains("\"committing\""))
            })
        })
    })
    .await;
    pair.b.kill();
    pair.destination.gates().load.open();
    // The restarted agent resumes the VM it decided to resume; the source, asking, quits its.
    pair.b.restart();
    let status = pair.finished(&id).await;
    assert_committed(&pair, &status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_agent_restarted_after_the_streams_end_asks_the_destination_and_quits_the_source()
{
    let mut pair = Pair::up(Gates::default(), Gates::load_held());
    let id = until_end_sent(&pair).await;
    pair.a.kill();
    pair.destination.gates().load.open();
    wait_until("the destination runs", || pair.destination.seen().running()).await;
    // The restarted agent lists the migration under its id, asks the destination, and quits
    // the source QEMU it left paused.
    pair.a.restart();
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Committed, "{status:?}");
    assert_eq!(status.error, None, "{status:?}");
    let source = pair.source.seen();
    assert!(source.ran("quit") && !source.ran("cont"), "{source:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_restarted_after_the_commit_was_acknowledged_quit_the_source_and_keep_the_destination(
) {
    let mut pair = Pair::up(Gates::pmemsave_held(), Gates::default());
    let id = pair.migrate(settings()).await;
    // The source heard the commit and keeps the VM's memory for its return before it quits
    // its QEMU: killed there, it leaves its QEMU paused, its migration completed.
    pair.source
        .gates()
        .pmemsave
        .wait_reached("saving the VM's memory after the commit")
        .await;
    pair.a.kill();
    pair.source.gates().pmemsave.open();
    assert_eq!(pair.source.seen().status, "postmigrate");
    assert!(!pair.source.seen().ran("quit"));
    // The restarted source agent finds its record committed and quits the QEMU it left; the
    // restarted destination agent leaves the VM running.
    pair.a.restart();
    pair.b.restart();
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Committed, "{status:?}");
    wait_until("the source QEMU quits", || pair.source.seen().ran("quit")).await;
    let (source, destination) = (pair.source.seen(), pair.destination.seen());
    assert!(!source.ran("cont"), "{source:?}");
    assert!(
        destination.loaded && destination.running(),
        "{destination:?}"
    );
    assert!(!destination.ran("quit"), "{destination:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_source_leaves_alone_a_qemu_its_committed_record_does_not_name() {
    use ferry_agent::engine::journal::Journal;
    let mut pair = Pair::up(Gates::pmemsave_held(), Gates::default());
    pair.migrate(settings()).await;
    pair.source
        .gates()
        .pmemsave
        .wait_reached("saving the VM's memory after the commit")
        .await;
    pair.a.kill();
    pair.source.gates().pmemsave.open();
    // The record names another process than the QEMU now at its socket (as when the VM came
    // back in a new QEMU): the restarted agent looks, and leaves it.
    let journal = Journal::new(&pair.a.config.work_dir);
    let mut record = journal.all_outgoing().unwrap().pop().expect("a record");
    assert_eq!(record.source_pid, Some(std::process::id()));
    record.source_pid = Some(std::process::id() + 1);
    journal.write_outgoing(&record).unwrap();
    wait_until("the killed agent's QMP connection closes", || {
        !pair.source.seen().client_connected
    })
    .await;
    let looked = pair.source.seen().clients_gone + 1;
    pair.a.restart();
    wait_until("the restarted agent looked at the source QEMU", || {
        pair.source.seen().clients_gone >= looked
    })
    .await;
    let source = pair.source.seen();
    assert!(!source.ran("quit"), "{source:?}");
    assert_eq!(source.status, "postmigrate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_agent_restarted_mid_stream_asks_the_destination_and_the_source_runs() {
    let mut pair = Pair::up(Gates::stream_held_at(MID_STREAM), Gates::default());
    let id = pair.migrate(settings()).await;
    pair.source
        .gates()
        .stream()
        .wait_reached("the stream's middle")
        .await;
    pair.a.kill();
    pair.source.gates().stream().open();
    // Its record says the stream had started: the restarted agent asks the destination, which
    // answers once its side gave up (at the WAN timeout), and the source runs.
    pair.a.restart();
    let status = pair.finished(&id).await;
    assert_source_runs(&pair, &status, "the destination aborted");
    wait_until("the destination quits its QEMU", || {
        pair.destination.seen().ran("quit")
    })
    .await;
}

/// A session to site b from another host of the fleet, kept connected; its link events.
fn open_session(
    pair: &Pair,
    tls: &std::sync::Arc<ferry_wire::tls::ClientConfig>,
) -> (
    ferry_wire::Session,
    tokio::task::JoinSet<()>,
    tokio::sync::mpsc::UnboundedReceiver<ferry_wire::net::LinkEvent>,
) {
    let session = ferry_wire::Session::new(
        ferry_wire::SessionId::random(),
        ferry_wire::SessionConfig::default(),
    );
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let connections = ferry_wire::net::keep_connected(
        session.clone(),
        ferry_wire::net::Peer {
            addr: pair.link.address,
            name: "b".into(),
            tls: tls.clone(),
            connections: ferry_wire::connection_count::ConnectionCount::fixed(1),
            link_rate_mbit: None,
            pool: ferry_wire::net::Pool::new(),
        },
        Duration::from_millis(200),
        events,
    );
    (session, connections, rx)
}

/// Waits for the next link event that says the peer refused the connection.
async fn refused(rx: &mut tokio::sync::mpsc::UnboundedReceiver<ferry_wire::net::LinkEvent>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some(
                ferry_wire::net::LinkEvent::Lost { .. }
                | ferry_wire::net::LinkEvent::DialFailed { .. },
            )) => return,
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => panic!("the connection was not refused within 30 s"),
        }
    }
}

/// Sends `message` on `session`'s control channel; returns the peer's answer (within 30 s).
async fn exchange(session: &ferry_wire::Session, message: &serde_json::Value) -> serde_json::Value {
    session
        .send(
            ferry_wire::ChannelId(0),
            serde_json::to_vec(message).unwrap().into(),
        )
        .await
        .unwrap();
    let answer = tokio::time::timeout(
        Duration::from_secs(30),
        session.recv(ferry_wire::ChannelId(0)),
    )
    .await
    .expect("an answer within 30 s")
    .unwrap();
    let ferry_wire::Received::Data(answer) = answer else {
        panic!("a barrier on the control channel");
    };
    serde_json::from_slice(&answer).unwrap()
}

/// Asks site b about a session it never saw, on `session`: its answer is "aborted".
async fn ask_b(session: &ferry_wire::Session) {
    let question = serde_json::json!({
        "type": "verdict",
        "version": ferry_agent::engine::control::CONTROL_VERSION,
        "of": ferry_wire::SessionId::random().to_string(),
    });
    let answer = exchange(session, &question).await;
    assert_eq!(answer["type"], "verdict-is", "{answer}");
    assert_eq!(answer["verdict"]["verdict"], "aborted", "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_carries_at_most_256_incoming_sessions_and_takes_more_as_they_end() {
    let pair = Pair::up(Gates::default(), Gates::default());
    let tls = pair.peer_tls("c");
    // Sessions that say nothing yet: each holds its place until its first message (30 s), so
    // they are opened together.
    let held: Vec<_> = (0..256).map(|_| open_session(&pair, &tls)).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while pair.b.metric("ferry_agent_incoming_sessions").await < 256 {
        assert!(
            std::time::Instant::now() < deadline,
            "256 sessions not taken within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (extra, _connections, mut rx) = open_session(&pair, &tls);
    refused(&mut rx).await;
    assert_eq!(pair.b.metric("ferry_agent_incoming_sessions").await, 256);
    // One says what it is for, is answered and ends; the one waiting is taken at its next
    // dial, and answered too.
    ask_b(&held[0].0).await;
    ask_b(&extra).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_whose_resume_failed_is_resumed_when_the_source_asks() {
    let pair = Pair::up(Gates::default(), Gates::cont_refused_once());
    let id = pair.migrate(settings()).await;
    // The destination decided to commit and its QEMU refused `cont`: nothing is undone there
    // (its record says committing), the source is in doubt, asks, and the destination settles
    // it by resuming its QEMU then.
    let status = pair.finished(&id).await;
    assert_committed(&pair, &status);
    let destination = pair.destination.seen();
    assert_eq!(
        destination.commands.iter().filter(|c| *c == "cont").count(),
        2,
        "{destination:?}"
    );
    assert!(!destination.ran("quit"), "{destination:?}");
}

/// Opens the agent's API socket, writes a raw HTTP/1.1 POST of `body` of which only
/// `sent` bytes go out) and closes the connection without reading an answer.
async fn post_and_vanish(agent: &agents::Agent, body: &[u8], sent: usize) {
    use tokio::io::AsyncWriteExt;
    let mut api = tokio::net::UnixStream::connect(&agent.config.api_socket)
        .await
        .expect("the agent's API socket");
    let head = format!(
        "POST /v1/migrations HTTP/1.1\r\nhost: ferry-agent\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        body.len()
    );
    api.write_all(head.as_bytes()).await.expect("write");
    api.write_all(&body[..sent]).await.expect("write");
    api.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_client_gone_mid_request_starts_nothing_and_one_gone_after_it_stops_nothing() {
    let pair = Pair::up(Gates::default(), Gates::default());
    let body = serde_json::to_vec(&pair.request(settings())).expect("JSON");
    // Half a request: the agent never sees a migration, and goes on serving.
    post_and_vanish(&pair.a, &body, body.len() / 2).await;
    let listed = pair
        .a
        .client()
        .migrations()
        .await
        .expect("the agent still answers");
    assert!(listed.is_empty(), "{listed:?}");
    assert!(pair.source.seen().running());
    drop(pair);
    // A whole request whose client leaves before the answer: the migration is the agent's,
    // and it commits. Without half-close, hyper dropped such a request about 2 times in 10:
    // 20 tries miss that with a chance of about 1%.
    for _ in 0..20 {
        let pair = Pair::up(Gates::default(), Gates::default());
        let body = serde_json::to_vec(&pair.request(settings())).expect("JSON");
        post_and_vanish(&pair.a, &body, body.len()).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let id = loop {
            let listed = pair.a.client().migrations().await.expect("list");
            if let Some(m) = listed.first() {
                break m.id.clone();
            }
            assert!(std::time::Instant::now() < deadline, "never started");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let status = pair.finished(&id).await;
        assert_committed(&pair, &status);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_agent_down_at_connect_fails_it_at_the_wan_timeout_and_the_source_never_stops(
) {
    let mut pair = Pair::up(Gates::default(), Gates::default());
    pair.b.kill();
    let id = pair.migrate(settings()).await;
    let status = pair.finished(&id).await;
    assert_source_runs(&pair, &status, "the WAN timeout");
    let source = pair.source.seen();
    assert!(!source.ran("migrate"), "{source:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_qemu_dead_at_connect_fails_it_and_the_source_never_stops() {
    let mut pair = Pair::up(Gates::default(), Gates::default());
    pair.destination.kill();
    let id = pair.migrate(settings()).await;
    let status = pair.finished(&id).await;
    assert_source_runs(
        &pair,
        &status,
        "the destination refused: destination QEMU: connect to QMP socket",
    );
    let source = pair.source.seen();
    assert!(!source.ran("migrate"), "{source:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_qemu_dead_at_connect_fails_it_and_nothing_runs_at_the_destination() {
    let mut pair = Pair::up(Gates::default(), Gates::default());
    pair.source.kill();
    let id = pair.migrate(settings()).await;
    let status = pair.finished(&id).await;
    assert_eq!(status.state, MigrationState::Failed, "{status:?}");
    let error = status.error.unwrap_or_default();
    assert!(
        error.starts_with("source QEMU: connect to QMP socket"),
        "{error}"
    );
    let destination = pair.destination.seen();
    assert!(
        !destination.running() && destination.commands.is_empty(),
        "{destination:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_opens_out_of_order_is_refused_and_touches_no_qemu() {
    let pair = Pair::up(Gates::default(), Gates::default());
    let tls = pair.peer_tls("c");
    // The stream's end before any Prepare: the destination answers with an Abort naming what
    // it got, and never contacts its QEMU.
    let (session, _connections, _events) = open_session(&pair, &tls);
    let end = serde_json::json!({ "type": "end", "bytes": 0, "digest": "00" });
    let answer = exchange(&session, &end).await;
    assert_eq!(answer["type"], "abort", "{answer}");
    let reason = answer["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("expected Prepare first, got End"),
        "{answer}"
    );
    assert!(pair.destination.seen().commands.is_empty());
    // The agent goes on: a migration after it commits.
    let id = pair.migrate(settings()).await;
    let status = pair.finished(&id).await;
    assert_committed(&pair, &status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_agent_restarted_at_connect_fails_it_and_the_source_never_stops() {
    // The link dark: the source agent is still reaching the destination when it goes.
    let mut pair = Pair::up(Gates::default(), Gates::default());
    pair.link.darken();
    let id = pair
        .migrate(MigrationSettings {
            wan_timeout_s: 120,
            ..settings()
        })
        .await;
    pair.wait(&id, "reaching the destination", |s| {
        s.phase == Phase::PreparingDestination
    })
    .await;
    // Its record says `preparing`: the restarted agent lists it failed; QEMU was never told
    // to migrate and the destination never heard of it.
    pair.a.restart();
    pair.link.light();
    let status = pair.finished(&id).await;
    assert_source_runs(
        &pair,
        &status,
        "the source agent restarted before the stream started",
    );
    assert!(!pair.source.seen().ran("migrate"));
    assert!(pair.destination.seen().commands.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_dark_at_connect_for_5s_commits_and_one_dark_beyond_the_wan_timeout_fails_it() {
    // Dark for 5 s while the source first dials (TLS handshakes stall in the relay), then lit.
    let pair = Pair::up(Gates::default(), Gates::default());
    pair.link.darken();
    let id = pair
        .migrate(MigrationSettings {
            wan_timeout_s: 30,
            ..settings()
        })
        .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    pair.link.cut();
    pair.link.light();
    let status = pair.finished(&id).await;
    assert_committed(&pair, &status);
    // Dark for longer than the WAN timeout: failed, and the source was never stopped.
    let pair = Pair::up(Gates::default(), Gates::default());
    pair.link.darken();
    let id = pair.migrate(settings()).await;
    let status = pair.finished(&id).await;
    assert_source_runs(&pair, &status, "the WAN timeout");
    assert!(!pair.source.seen().ran("migrate"));
}
