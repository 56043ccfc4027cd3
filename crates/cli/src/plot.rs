//! `ferry report`: a migration timeline drawn as an SVG picture.
//!
//! Two series over time: the WAN rate (left axis, Mbit/s, with the link's rate as a dashed
//! line) and QEMU's remaining bytes (right axis, MiB); the phases as labelled vertical lines,
//! and the downtime (source STOP to destination RESUME) as a shaded band.

use std::fmt::Write;

use ferry_api::{EventKind, Timeline};

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 80.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 50.0;

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The SVG document for a timeline.
pub fn svg(t: &Timeline) -> String {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let end_ms = t
        .samples
        .iter()
        .map(|s| s.t_ms)
        .chain(t.events.iter().map(|e| e.t_ms))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let max_mbit = t
        .samples
        .iter()
        .map(|s| s.wan_mbit)
        .fold(t.link_rate_mbit, f64::max)
        .max(1.0)
        * 1.1;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let max_rem = t
        .samples
        .iter()
        .filter_map(|s| s.qemu_remaining)
        .map(mib)
        .fold(1.0, f64::max)
        * 1.1;
    let x = |ms: f64| LEFT + ms / end_ms * plot_w;
    let y_rate = |m: f64| TOP + plot_h - m / max_mbit * plot_h;
    let y_rem = |m: f64| TOP + plot_h - m / max_rem * plot_h;

    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let title = format!(
        "{} migrating {} from site {} to site {}",
        t.system, t.vm, t.from_site, t.to_site
    );
    let _ = writeln!(
        o,
        r#"<text x="{LEFT}" y="24" font-size="15">{}</text>"#,
        esc(&title)
    );

    // Downtime band.
    if let (Some(stop), Some(resume)) = (
        t.find(EventKind::SourceStopped),
        t.find(EventKind::DestinationResumed),
    ) {
        let (x0, x1) = (x(stop.t_ms as f64), x(resume.t_ms as f64));
        let _ = writeln!(
            o,
            r##"<rect x="{x0:.1}" y="{TOP}" width="{:.1}" height="{plot_h}" fill="#f4c7c3" opacity="0.7"><title>downtime {} ms</title></rect>"##,
            (x1 - x0).max(1.0),
            resume.t_ms.saturating_sub(stop.t_ms)
        );
    }
    // Axes and ticks.
    let _ = writeln!(
        o,
        r#"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>"#
    );
    for i in 0..=5 {
        let f = f64::from(i) / 5.0;
        let (tx, ty) = (LEFT + f * plot_w, TOP + plot_h - f * plot_h);
        let _ = writeln!(
            o,
            r#"<text x="{tx:.1}" y="{:.1}" text-anchor="middle">{:.1}</text>"#,
            TOP + plot_h + 16.0,
            f * end_ms / 1000.0
        );
        let _ = writeln!(
            o,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#1f5fbf">{:.0}</text>"##,
            LEFT - 6.0,
            ty + 4.0,
            f * max_mbit
        );
        let _ = writeln!(
            o,
            r##"<text x="{:.1}" y="{:.1}" fill="#c0561b">{:.0}</text>"##,
            LEFT + plot_w + 6.0,
            ty + 4.0,
            f * max_rem
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (s)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 12.0
    );
    let _ = writeln!(
        o,
        r##"<text x="14" y="{:.1}" fill="#1f5fbf" transform="rotate(-90 14 {:.1})" text-anchor="middle">WAN Mbit/s</text>"##,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    let rx = WIDTH - 14.0;
    let _ = writeln!(
        o,
        r##"<text x="{rx}" y="{:.1}" fill="#c0561b" transform="rotate(90 {rx} {:.1})" text-anchor="middle">QEMU remaining MiB</text>"##,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    // The link's rate.
    let yl = y_rate(t.link_rate_mbit);
    let _ = writeln!(
        o,
        r##"<line x1="{LEFT}" y1="{yl:.1}" x2="{:.1}" y2="{yl:.1}" stroke="#1f5fbf" stroke-dasharray="4 4" opacity="0.6"/>"##,
        LEFT + plot_w
    );
    // Series.
    let rate: Vec<String> = t
        .samples
        .iter()
        .map(|s| format!("{:.1},{:.1}", x(s.t_ms as f64), y_rate(s.wan_mbit)))
        .collect();
    let _ = writeln!(
        o,
        r##"<polyline fill="none" stroke="#1f5fbf" stroke-width="1.5" points="{}"/>"##,
        rate.join(" ")
    );
    // The rate QEMU hands bytes over (ferry: into the agent), clipped to the plot: it spikes
    // while buffers fill.
    let handed: Vec<String> = t
        .samples
        .iter()
        .filter_map(|s| {
            s.qemu_mbit
                .map(|m| format!("{:.1},{:.1}", x(s.t_ms as f64), y_rate(m.min(max_mbit))))
        })
        .collect();
    if !handed.is_empty() {
        let _ = writeln!(
            o,
            r##"<polyline fill="none" stroke="#6a9be0" stroke-width="1" stroke-dasharray="3 2" points="{}"><title>QEMU's output rate, Mbit/s</title></polyline>"##,
            handed.join(" ")
        );
        let _ = writeln!(
            o,
            r##"<text x="{:.1}" y="{:.1}" fill="#6a9be0">dashed: QEMU's output Mbit/s</text>"##,
            LEFT + plot_w - 190.0,
            TOP + plot_h - 6.0
        );
    }
    let rem: Vec<String> = t
        .samples
        .iter()
        .filter_map(|s| {
            s.qemu_remaining
                .map(|r| format!("{:.1},{:.1}", x(s.t_ms as f64), y_rem(mib(r))))
        })
        .collect();
    let _ = writeln!(
        o,
        r##"<polyline fill="none" stroke="#c0561b" stroke-width="1.5" points="{}"/>"##,
        rem.join(" ")
    );
    // Events.
    for (i, e) in t.events.iter().enumerate() {
        let ex = x(e.t_ms as f64);
        let ly = TOP + 12.0 + (i % 4) as f64 * 13.0;
        let color = if e.kind == EventKind::Failed {
            "#b00020"
        } else {
            "#444"
        };
        let _ = writeln!(
            o,
            r#"<line x1="{ex:.1}" y1="{TOP}" x2="{ex:.1}" y2="{:.1}" stroke="{color}" stroke-dasharray="2 3"/>"#,
            TOP + plot_h
        );
        let mut label = e.kind.label().to_owned();
        if !e.detail.is_empty() {
            label = format!("{label}: {}", e.detail);
        }
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{ly:.1}" fill="{color}">{}</text>"#,
            ex + 3.0,
            esc(&label)
        );
    }
    o.push_str("</svg>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::Sample;

    #[test]
    fn svg_has_both_series_every_event_and_the_downtime_band() {
        let mut t = Timeline::new("qemu-plain", "vm<1>", "a", "b", 0, 100.0);
        for i in 0..10u64 {
            t.samples.push(Sample {
                t_ms: i * 100,
                wan_mbit: 90.0,
                qemu_remaining: Some((10 - i) << 20),
                ..Default::default()
            });
        }
        t.event(0, EventKind::DestinationStarted, "");
        t.event(800, EventKind::SourceStopped, "");
        t.event(950, EventKind::DestinationResumed, "");
        let s = svg(&t);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains("downtime 150 ms"), "{s}");
        for label in ["dst started", "src STOP", "dst RESUME"] {
            assert!(s.contains(label), "missing {label}");
        }
        assert!(s.contains("vm&lt;1&gt;"), "titles are escaped");
    }

    #[test]
    fn an_empty_timeline_still_draws() {
        let s = svg(&Timeline::new("qemu-plain", "vm", "a", "b", 0, 100.0));
        assert!(s.contains("</svg>"));
    }
}
