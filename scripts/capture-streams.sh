#!/bin/bash
# Captures the small real QEMU migration streams that crates/qemu/tests/stream.rs parses and
# re-emits byte for byte. Needs QEMU (scripts/setup.sh installs it) and python3.
#
#   idle:    a q35 VM with 64 MiB that never ran: one pass, mostly zero pages.
#   running: the same VM running its firmware, migrated at 2 MB/s so that QEMU makes
#            several passes (SECTION_PART items, pages sent again).
#
# Streams are written with `migrate exec:cat > FILE` and stored zstd-compressed.
set -euo pipefail
out=${1:-$(dirname "$0")/../crates/qemu/tests/streams}
mkdir -p "$out"
qemu=${FERRY_QEMU:-qemu-system-x86_64}

capture() { # name running
    local name=$1 running=$2 sock
    sock=$(mktemp -u /tmp/ferry-capture.XXXXXX)
    "$qemu" -machine q35,accel=tcg -m 64M -nodefaults -display none -S \
        -qmp "unix:$sock,server=on,wait=off" &
    local pid=$!
    python3 - "$sock" "$out/$name.qemu" "$running" <<'PY'
import json, socket, sys, time
path, out, running = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
for _ in range(100):
    try:
        s = socket.socket(socket.AF_UNIX); s.connect(path); break
    except OSError:
        time.sleep(0.1)
f = s.makefile("rw")
f.readline()
def q(cmd, **args):
    f.write(json.dumps({"execute": cmd, "arguments": args}) + "\n"); f.flush()
    while True:
        r = json.loads(f.readline())
        if "return" in r or "error" in r:
            if "error" in r: sys.exit(f"{cmd}: {r['error']}")
            return r["return"]
q("qmp_capabilities")
if running:
    q("cont"); time.sleep(1)
    q("migrate-set-parameters", **{"max-bandwidth": 2_000_000})
q("migrate", uri=f"exec:cat > {out}")
while (st := q("query-migrate"))["status"] not in ("completed", "failed"):
    time.sleep(0.1)
if st["status"] != "completed": sys.exit(f"migration {st['status']}")
print(f"{out}: {st['ram']['transferred']} bytes, {st['ram']['dirty-sync-count']} passes")
PY
    kill "$pid"; wait "$pid" 2>/dev/null || true
    zstd -q -19 -f --rm "$out/$name.qemu"
}
capture idle 0
capture running 1
