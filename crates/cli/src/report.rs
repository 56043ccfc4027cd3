//! Human output: error chains, the live progress bar and the migration report.

use std::time::Duration;

use ferry_api::agent::ZstdLevelReport;
use ferry_api::outcome::{MigrationOutcome, Progress};
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::watch;

/// `outer: cause: root cause`, each message once.
pub fn error_chain(e: &anyhow::Error) -> String {
    e.chain()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// Formats a byte count with binary units.
pub fn bytes(n: u64) -> String {
    let n = n as f64;
    if n >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", n / (1024.0 * 1024.0 * 1024.0))
    } else if n >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", n / (1024.0 * 1024.0))
    } else if n >= 1024.0 {
        format!("{:.1} KiB", n / 1024.0)
    } else {
        format!("{n} B")
    }
}

/// Draws `rx` as a progress bar until the sender is dropped. The bar tracks QEMU's RAM
/// transferred against RAM transferred plus remaining, which grows while the guest dirties.
pub async fn progress_bar(mut rx: watch::Receiver<Progress>) {
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {percent:>3}% {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    while rx.changed().await.is_ok() {
        let p = rx.borrow_and_update().clone();
        let total = (p.ram_transferred + p.ram_remaining).max(1);
        bar.set_length(total);
        bar.set_position(p.ram_transferred.min(total));
        let eta = p
            .eta_s
            .map_or_else(|| "-".to_owned(), |s| format!("{s:.0}s"));
        bar.set_message(format!(
            "{} | WAN {} at {:.1} Mbit/s | remaining {} | pass {} | ETA {eta}",
            p.phase,
            bytes(p.wan_bytes),
            p.wan_mbit,
            bytes(p.ram_remaining),
            p.iteration
        ));
    }
    bar.finish_and_clear();
}

/// Prints the report of one migration; `wan_counted_by` says whose counter the WAN bytes are.
pub fn print_report(system: &str, o: &MigrationOutcome, wan_counted_by: &str) {
    let ms = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.0} ms"));
    println!("migration report ({system})");
    println!(
        "  completed            {}",
        if o.completed { "yes" } else { "NO" }
    );
    if let Some(e) = &o.error {
        println!("  reason               {e}");
    }
    println!("  total time           {:.1} s", o.total_ms as f64 / 1000.0);
    println!(
        "  downtime             {} (source STOP to destination RESUME)",
        ms(o.downtime_ms)
    );
    println!(
        "  QEMU's own downtime  {}",
        ms(o.qemu_downtime_ms.map(|v| v as f64))
    );
    if let Some(p) = o.postcopy_ms {
        println!(
            "  postcopy             {:.1} s running at the destination before its last page arrived",
            p as f64 / 1000.0
        );
    }
    if let Some(b) = o.postcopy_blocktime_ms {
        println!("  waiting for pages    {b} ms with every vCPU blocked on a page (QEMU's postcopy blocktime)");
    }
    if let Some(p) = o.preempt_bytes {
        println!(
            "  faulted pages        {:.1} MiB sent ahead of the rest (QEMU's preempt channel)",
            p as f64 / f64::from(1 << 20)
        );
    }
    if o.guest_gap_ms.is_some() {
        println!(
            "  guest-observed gap   {} (longest heartbeat gap)",
            ms(o.guest_gap_ms)
        );
    }
    println!(
        "  bytes on the WAN     {} ({} bytes, both directions, counted by {wan_counted_by})",
        bytes(o.wan_bytes),
        o.wan_bytes
    );
    println!("  precopy passes       {}", o.iterations);
    if let Some(pct) = o.cpu_throttle_pct {
        println!(
            "  guest throttled      up to {pct}% of its vCPU time, {:.1} s of vCPU time taken (auto-converge)",
            o.throttle_vcpu_s.unwrap_or(0.0)
        );
    }
    if let Some(d) = &o.disk {
        println!(
            "  disks                {} ({} mirroring, {} copy): {} written by the mirror, {} coalesced before sending, {} as zero ranges, {} already at the destination, {} on the WAN in {} snapshots",
            d.disks,
            d.mode.name(),
            d.copy.as_deref().unwrap_or("write-blocking"),
            bytes(d.written_bytes),
            bytes(d.coalesced_bytes),
            bytes(d.zero_bytes),
            bytes(d.same_bytes),
            bytes(d.frame_bytes),
            d.snapshots,
        );
        if let Some(ms) = d.paced_ms {
            println!(
                "                       the copy was paced by the guest's IO: {:.1} s below its unpaced rate",
                ms as f64 / 1000.0
            );
        }
        match d.older_copy.as_deref() {
            Some("bitmap") => println!(
                "                       the destination's older copy was untouched since the VM left: QEMU's dirty bitmaps said what changed, nothing was read there"
            ),
            Some("remembered") => println!(
                "                       the destination's older copy was untouched since the VM left: the index kept then stood for it ({} ms), nothing was read there",
                d.index_ms.unwrap_or(0)
            ),
            Some(_) => println!(
                "                       the destination read and indexed its older copy in {} ms ({})",
                d.index_ms.unwrap_or(0),
                d.older_copy_note.as_deref().unwrap_or("no bitmap")
            ),
            None => {}
        }
        if !d.zstd_levels.is_empty() {
            println!(
                "                       zstd frames: {}",
                zstd_levels(&d.zstd_levels)
            );
        }
        if d.overlay_only > 0 {
            println!(
                "                       {} disk(s) copied as overlay only: the destination held their backing image",
                d.overlay_only
            );
        }
        if d.layers_shipped > 0 {
            println!(
                "                       {} backing layer(s) the destination lacked sent first: {}",
                d.layers_shipped,
                bytes(d.layer_bytes)
            );
        }
    }
    if let Some(n) = o.connections {
        match &o.connections_why {
            Some(why) => println!("  connections          {n} ({why})"),
            None => println!("  connections          {n}"),
        }
    }
    if let Some(c) = &o.codec {
        println!(
            "  codec                {}: QEMU's {} became {} ({:.1}%)",
            c.settings,
            bytes(c.bytes_in),
            bytes(c.bytes_out),
            100.0 * c.bytes_out as f64 / c.bytes_in.max(1) as f64,
        );
        println!(
            "                       {} pages: {} zero, {} unchanged, {} delta, {} with cached blocks ({} hits), {} raw",
            c.pages, c.zero, c.unchanged, c.delta, c.blocks, c.block_hits, c.raw,
        );
        if c.shards > 1 {
            println!(
                "                       {} shards on {}, {} of order units",
                c.shards,
                match c.threads {
                    0 => "the agent's stream task".to_string(),
                    1 => "one thread".to_string(),
                    n => format!("{n} threads"),
                },
                bytes(c.order_bytes),
            );
        }
        if c.cache_paused_ms > 0 {
            println!(
                "                       block cache paused for {} batches ({} ms): the agent's CPU, not the link, was the limit",
                c.cache_paused_batches, c.cache_paused_ms,
            );
        } else if c.cache_paused_batches > 0 {
            println!(
                "                       block cache paused for {} batches (test hook)",
                c.cache_paused_batches,
            );
        }
        if let Some(seed) = &c.seed {
            println!(
                "                       seed: {} pages from the destination's image of {} ({} index, {} ms to index), {} pages sent as references",
                seed.pages,
                seed.image,
                bytes(seed.index_bytes),
                seed.index_ms,
                c.seeded,
            );
        }
        println!(
            "                       zstd batches: {}",
            zstd_levels(&c.zstd_levels)
        );
    }
}

/// What each zstd level did: batches, output share, speed and what it saved over the fastest
/// level.
fn zstd_levels(levels: &[ZstdLevelReport]) -> String {
    if levels.is_empty() {
        return "off".to_owned();
    }
    let each: Vec<String> = levels
        .iter()
        .map(|l| {
            let gain = match l.gain {
                Some(g) if g >= 0.0 => format!(", {:.1}% smaller than the fastest", 100.0 * g),
                Some(g) => format!(", {:.1}% larger than the fastest", -100.0 * g),
                None => String::new(),
            };
            format!(
                "level {} x{} ({:.0}%, {:.0} MB/s{gain})",
                l.level,
                l.batches,
                100.0 * l.bytes_out as f64 / l.bytes_in.max(1) as f64,
                l.bytes_in as f64 / l.seconds.max(1e-9) / 1e6
            )
        })
        .collect();
    each.join(", ")
}
