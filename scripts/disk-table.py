#!/usr/bin/env python3
"""Tables for disk benchmarks: `ferry bench ... --disk-mib N` JSON lines in, a Markdown table
out, one row per (system, disk mode, leg), medians over runs (ranges for the noisy columns).

Usage: scripts/disk-table.py results.jsonl [more.jsonl ...]
"""
import json
import statistics
import sys
from collections import defaultdict


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def span(xs, fmt):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{fmt(statistics.median(xs))} ({fmt(min(xs))}-{fmt(max(xs))})"


def read_ratio(record):
    """The reader's rate during the move against before it, percent (this run's own)."""
    before = record.get("disk_reads_before_per_s")
    during = (record.get("disk_write_latency") or {}).get("reads_per_s")
    return 100 * during / before if before and during is not None else None


def paced_s(record):
    """How long pacing held the copy below its unpaced rate; None: not paced."""
    ms = (record.get("disk") or {}).get("paced_ms")
    return ms / 1000 if ms is not None else None


def older_copy(kind, runs):
    """How the source knew what the destination's older copy holds; an index's read time."""
    if kind != "index":
        return kind
    took = median([(r.get("disk") or {}).get("index_ms") for r in runs])
    return f"index ({took:.0f} ms)" if took is not None else "index"


def main(paths):
    groups = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    r = json.loads(line)
                    older = (r.get("disk") or {}).get("older_copy") or "-"
                    key = (r["system"], r.get("disk_mode") or "-", r.get("leg") or "there", older)
                    groups[key].append(r)
    print(
        "| system | disk mode | leg | older copy | runs | total s | WAN MB | disk frames MB | downtime ms "
        "| write p50 ms | write p99 ms | write p99.9 ms | write max ms | writes | hot reads/s before | during | during/before % | paced s | disk changed % | verify errors |"
    )
    print("|" + "---|" * 20)
    for (system, mode, leg, older), rs in sorted(groups.items()):
        done = [r for r in rs if r.get("completed")]
        lat = [r.get("disk_write_latency") or {} for r in done]
        frames = [(r.get("disk") or {}).get("frame_bytes") for r in done]
        ms = lambda k: [l.get(k) / 1000 if l.get(k) is not None else None for l in lat]
        print(
            f"| {system} | {mode} | {leg} | {older_copy(older, done)} | {len(done)}/{len(rs)} "
            f"| {span([r['total_ms'] / 1000 for r in done], lambda x: f'{x:.1f}')} "
            f"| {span([r['wan_bytes'] / 1e6 for r in done], lambda x: f'{x:.0f}')} "
            f"| {span([f / 1e6 if f is not None else None for f in frames], lambda x: f'{x:.1f}')} "
            f"| {span([r.get('downtime_ms') for r in done], lambda x: f'{x:.0f}')} "
            f"| {span(ms('p50_us'), lambda x: f'{x:.1f}')} "
            f"| {span(ms('p99_us'), lambda x: f'{x:.0f}')} "
            f"| {span(ms('p999_us'), lambda x: f'{x:.0f}')} "
            f"| {span(ms('max_us'), lambda x: f'{x:.0f}')} "
            f"| {median([l.get('writes') for l in lat]) or '-'} "
            f"| {span([r.get('disk_reads_before_per_s') for r in done], lambda x: f'{x:.0f}')} "
            f"| {span([l.get('reads_per_s') for l in lat], lambda x: f'{x:.0f}')} "
            f"| {span([read_ratio(r) for r in done], lambda x: f'{x:.0f}')} "
            f"| {span([paced_s(r) for r in done], lambda x: f'{x:.1f}')} "
            f"| {span([r.get('disk_changed_pct') for r in done], lambda x: f'{x:.1f}')} "
            f"| {sum(r.get('verify_errors') or 0 for r in done)} |"
        )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
