#!/usr/bin/env python3
"""Summarizes `ferry bench` JSON lines into a markdown table of medians per workload and system.

usage: scripts/bench-table.py results.jsonl [more.jsonl ...]
"""
import json
import statistics
import sys
from collections import defaultdict


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs):
    xs = [x for x in xs if x is not None]
    return f"{min(xs):.0f}-{max(xs):.0f}" if xs else "-"


def label_workload(r):
    """The workload, and the leg when it is the way back."""
    return r["workload"] + (f" ({r['leg']})" if r.get("leg") else "")


def label_system(r):
    """The system, and ferry's switchover policy when it is not the default."""
    policy = r.get("switchover")
    if policy and policy != "target+converge":
        return f"{r['system']} [{policy}]"
    return r["system"]


def returns(groups):
    """The way back: how much of the guest's memory crossed the WAN."""
    rows = [(k, rs) for k, rs in sorted(groups.items()) if rs[0].get("leg") == "return"]
    if not rows:
        return
    print()
    print("| workload | system | runs | changed at the other site, % of pages (median) | WAN MB (median) | WAN bytes, % of guest memory (median, range) | seeded pages (median) |")
    print("|---|---|---|---|---|---|---|")
    for (workload, system), rs in rows:
        done = [r for r in rs if r["completed"]]
        pct = [100.0 * r["wan_bytes"] / (r["mem_mib"] << 20) for r in done]
        seeded = median([(r.get("codec") or {}).get("seeded") for r in done])
        print(
            f"| {workload} | {system} | {len(rs)} | {median([r['changed_pct'] for r in rs]):.1f} | "
            f"{median([r['wan_bytes'] for r in done]) / 1e6:.1f} | {median(pct):.1f} ({min(pct):.1f}-{max(pct):.1f}) | "
            f"{'-' if seeded is None else f'{seeded:.0f}'} |"
        )


def main(paths):
    groups = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    r = json.loads(line)
                    groups[(label_workload(r), label_system(r))].append(r)
    print("| workload | system | runs | completed | total s (median) | WAN MB (median) | x floor bytes | x floor time | downtime ms (median, range) | QEMU's downtime ms | guest gap ms | passes | WAN drops (median) | verify errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (workload, system), rs in sorted(groups.items()):
        done = [r for r in rs if r["completed"]]
        floor_b = median([r["floor_bytes"] for r in rs])
        floor_ms = median([r["floor_ms"] for r in rs])
        total = median([r["total_ms"] for r in done])
        wan = median([r["wan_bytes"] for r in done])
        down = [r["downtime_ms"] for r in done]
        drops = median([r.get("wan_drops") for r in done])
        if not done:
            print(f"| {workload} | {system} | {len(rs)} | 0 | - | - | - | - | - | - | - | - | - | - |")
            continue
        print(
            f"| {workload} | {system} | {len(rs)} | {len(done)} | "
            f"{total / 1000:.1f} | {wan / 1e6:.1f} | {wan / floor_b:.2f} | {total / floor_ms:.2f} | "
            f"{median(down):.0f} ({spread(down)}) | {median([r['qemu_downtime_ms'] for r in done]):.0f} | "
            f"{median([r['guest_gap_ms'] for r in done]):.0f} | {median([r['iterations'] for r in done]):.0f} | "
            f"{'-' if drops is None else f'{drops:.0f}'} | {sum(r['verify_errors'] or 0 for r in done)} |"
        )
    compare(groups)
    cpu(groups)
    returns(groups)
    floors = defaultdict(list)
    for (workload, _), rs in groups.items():
        floors[workload] += [r["floor_bytes"] for r in rs]
    print()
    for w, fs in sorted(floors.items()):
        print(f"- floor for {w}: median {median(fs) / 1e6:.1f} MB (range {min(fs) / 1e6:.1f}-{max(fs) / 1e6:.1f})")


def cpu(groups):
    """CPU seconds each process spent during the migration, and their sum per GB on the WAN."""
    rows = [(k, [r for r in rs if r["completed"] and r.get("cpu")]) for k, rs in sorted(groups.items())]
    rows = [(k, rs) for k, rs in rows if rs]
    if not rows:
        return
    print()
    print("| workload | system | CPU s: src QEMU / dst QEMU / src agent / dst agent (medians) | CPU s per WAN GB (median, range) |")
    print("|---|---|---|---|")
    for (workload, system), rs in rows:
        c = [r["cpu"] for r in rs]
        each = " / ".join(f"{median([x[k] for x in c]):.2f}" for k in
                          ("source_qemu_s", "destination_qemu_s", "source_agent_s", "destination_agent_s"))
        per_gb = [x["per_wan_gb_s"] for x in c]
        print(f"| {workload} | {system} | {each} | {median(per_gb):.1f} ({min(per_gb):.1f}-{max(per_gb):.1f}) |")


def compare(groups, target_ms=300):
    """ferry's medians against QEMU's best mode (per figure) and QEMU plain, per workload."""
    by_workload = defaultdict(dict)
    for (workload, system), rs in groups.items():
        done = [r for r in rs if r["completed"]]
        if done:
            by_workload[workload][system] = done
    lines = []
    for workload, systems in sorted(by_workload.items()):
        qemu = {s: rs for s, rs in systems.items() if s.startswith("qemu-")}
        if not qemu:
            continue
        best_bytes = min(median([r["wan_bytes"] for r in rs]) for rs in qemu.values())
        best_time = min(median([r["total_ms"] for r in rs]) for rs in qemu.values())
        plain = qemu.get("qemu-plain")
        for system, rs in sorted(systems.items()):
            if not system.startswith("ferry"):
                continue
            b = median([r["wan_bytes"] for r in rs])
            t = median([r["total_ms"] for r in rs])
            within = sum(1 for r in rs if r["downtime_ms"] is not None and r["downtime_ms"] <= target_ms)
            vs_plain = "-"
            if plain:
                vs_plain = (f"{b / median([r['wan_bytes'] for r in plain]):.2f} / "
                            f"{t / median([r['total_ms'] for r in plain]):.2f}")
            lines.append(f"| {workload} | {system} | {b / best_bytes:.2f} / {t / best_time:.2f} | "
                         f"{vs_plain} | {within} of {len(rs)} |")
    if lines:
        print()
        print(f"| workload | system | bytes / time vs QEMU's best mode | bytes / time vs QEMU plain | real downtime <= {target_ms} ms |")
        print("|---|---|---|---|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
