#!/usr/bin/env python3
"""ferry against a QEMU mode on each link, as an SVG: the medians of ferry's total time and WAN
bytes over the QEMU mode's, per link and workload (below 1: ferry wins).

Usage: scripts/link-plot.py OUT.svg FILE[:SYSTEM,...] ...
A FILE may be limited to some of its systems (`bench.jsonl:qemu-multifd-zstd`), so that a file
whose ferry rows are a build since reverted gives only its QEMU rows. Records of one system,
workload and link are pooled over the files. --against SYSTEM (default qemu-multifd-zstd).
Standard library only: the figure is plain SVG.
"""

import json
import sys
from collections import defaultdict
from statistics import median

WORKLOADS = ["delta", "ws", "zero"]
COLOURS = {"delta": "#4e79a7", "ws": "#f28e2b", "zero": "#59a14f"}
METRICS = [("total_ms", "total time"), ("wan_bytes", "WAN bytes")]


def load(args):
    runs = defaultdict(list)
    for arg in args:
        path, _, only = arg.partition(":")
        systems = set(only.split(",")) if only else None
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if not r.get("completed") or (systems and r["system"] not in systems):
                    continue
                link = (r["link"]["rate_mbit"], r["link"]["rtt_ms"])
                runs[(r["system"], r["workload"], link)].append(r)
    return runs


def ratios(runs, against):
    """{link: {workload: {metric: ferry median / against median}}}"""
    out = defaultdict(dict)
    for (system, workload, link), rs in runs.items():
        theirs = runs.get((against, workload, link))
        if system != "ferry" or not theirs or workload not in WORKLOADS:
            continue
        out[link][workload] = {
            m: median(r[m] for r in rs) / median(r[m] for r in theirs) for m, _ in METRICS
        }
    return out


def link_name(link):
    rate, rtt = link
    rate = f"{rate / 1000:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s"
    return f"{rate}, {rtt:g} ms"


def svg(data, against):
    links = sorted(data, key=lambda l: (l[0], l[1]))
    panel_w, panel_h, top, left, bottom = 420, 260, 40, 50, 50
    width, height = left + panel_w * len(METRICS) + 20, top + panel_h + bottom + 30
    y_max = max(2.0, max((v[m] for l in links for v in data[l].values() for m, _ in METRICS),
                         default=1.0) * 1.1)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">ferry / {against}, '
        f"medians (below 1: ferry wins)</text>",
    ]
    for p, (metric, title) in enumerate(METRICS):
        x0 = left + p * panel_w
        y = lambda v: top + panel_h - v / y_max * panel_h  # noqa: E731
        out.append(f'<text x="{x0 + panel_w / 2}" y="{top - 6}" text-anchor="middle">{title}</text>')
        for tick in [0, 0.5, 1, 1.5, 2, 2.5, 3]:
            if tick > y_max:
                break
            out.append(f'<line x1="{x0}" x2="{x0 + panel_w - 30}" y1="{y(tick)}" y2="{y(tick)}" '
                       f'stroke="{"#333" if tick == 1 else "#ddd"}"/>')
            out.append(f'<text x="{x0 - 4}" y="{y(tick) + 4}" text-anchor="end">{tick:g}</text>')
        group_w = (panel_w - 30) / max(len(links), 1)
        bar_w = group_w / (len(WORKLOADS) + 1)
        for g, link in enumerate(links):
            gx = x0 + g * group_w
            for b, workload in enumerate(WORKLOADS):
                v = data[link].get(workload, {}).get(metric)
                if v is None:
                    continue
                bx = gx + (b + 0.5) * bar_w
                out.append(f'<rect x="{bx:.1f}" y="{y(v):.1f}" width="{bar_w * 0.9:.1f}" '
                           f'height="{top + panel_h - y(v):.1f}" fill="{COLOURS[workload]}">'
                           f"<title>{workload}, {link_name(link)}: {v:.2f}</title></rect>")
                out.append(f'<text x="{bx + bar_w * 0.45:.1f}" y="{y(v) - 3:.1f}" '
                           f'text-anchor="middle" font-size="10">{v:.2f}</text>')
            out.append(f'<text x="{gx + group_w / 2:.1f}" y="{top + panel_h + 16}" '
                       f'text-anchor="middle">{link_name(link)}</text>')
    lx = left
    for workload in WORKLOADS:
        out.append(f'<rect x="{lx}" y="{height - 22}" width="12" height="12" '
                   f'fill="{COLOURS[workload]}"/>')
        out.append(f'<text x="{lx + 16}" y="{height - 12}">{workload}</text>')
        lx += 80
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv):
    against = "qemu-multifd-zstd"
    if "--against" in argv:
        i = argv.index("--against")
        against = argv[i + 1]
        del argv[i : i + 2]
    if len(argv) < 2:
        sys.exit(__doc__)
    out, files = argv[0], argv[1:]
    data = ratios(load(files), against)
    if not data:
        sys.exit(f"no link has both ferry and {against} runs in {files}")
    with open(out, "w") as f:
        f.write(svg(data, against))
    for link in sorted(data):
        cells = ", ".join(
            f"{w} {data[link][w]['total_ms']:.2f}/{data[link][w]['wan_bytes']:.2f}"
            for w in WORKLOADS if w in data[link]
        )
        print(f"{link_name(link)}: time/bytes {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
