#!/bin/bash
# Captures the small real QEMU migration streams that crates/qemu/tests/stream.rs parses and
# re-emits byte for byte. Needs QEMU (scripts/setup.sh installs it) and python3.
#
#   idle:    a q35 VM with 64 MiB that never ran: one pass, mostly zero pages.
#   running: the same VM running its firmware, migrated at 2 MB/s so that QEMU makes
#            several passes (SECTION_PART items, pages sent again).
#   multifd/running: running, as above, with the multifd capability on and two channels;
#   multifd/zstd: idle, two channels, QEMU compressing their pages with zstd. Each connection
#            QEMU opens is kept apart: NAME.main (the main stream), NAME.0 and NAME.1 (the
#            channels, named by the id in their first packet).
#   postcopy/running: running, with postcopy-ram on and the switch asked for at once, relayed
#            to a second QEMU (postcopy needs a live destination and its return path): the
#            source's stream with the advice, the discards, the package and the pages after it.
#   postcopy/resumed: the same with the preempt channel, the relay cut in the postcopy phase
#            (both QEMUs go postcopy-paused), then resumed through a new relay
#            (`migrate-recover` at the destination, `migrate resume=true` at the source):
#            NAME.first.qemu is the source's main stream up to the cut, NAME.second.qemu the
#            resumed one (no header: a RECV_BITMAP per RAM block, RESUME, then the pages).
#   bitmaps: running, with a qcow2 disk whose two persistent dirty bitmaps (one recording, one
#            not; 512-byte granularity, so each bitmap goes in 16 chunks, most of them zero)
#            have bits set, and the dirty-bitmaps capability on: QEMU's "dirty-bitmap" section
#            beside the RAM (what libvirt turns on when a copied disk has a checkpoint).
#
# A second argument captures only the stream of that name (say postcopy/resumed).
#
# Streams are written with `migrate exec:cat > FILE` (multifd: `migrate unix:` to a listener
# that keeps each connection) and stored zstd-compressed.
set -euo pipefail
out=${1:-$(dirname "$0")/../crates/qemu/tests/streams}
mkdir -p "$out"
qemu=${FERRY_QEMU:-qemu-system-x86_64}
only=${2:-}

capture() { # name running [bitmaps]
    local name=$1 running=$2 bitmaps=${3:-0} sock disk=()
    sock=$(mktemp -u /tmp/ferry-capture.XXXXXX)
    if [ "$bitmaps" = 1 ]; then
        # The bitmaps are made and dirtied offline: the firmware alone never writes a disk.
        local img=$sock.qcow2
        qemu-img create -q -f qcow2 "$img" 64M
        qemu-img bitmap --add -g 512 "$img" recording
        qemu-img bitmap --add -g 512 --disable "$img" kept
        qemu-io -f qcow2 -c 'write -P 0xab 1M 64k' -c 'write -P 0xcd 40M 4k' "$img" >/dev/null
        qemu-img bitmap --enable "$img" kept
        qemu-io -f qcow2 -c 'write -P 0xef 50M 512' "$img" >/dev/null
        qemu-img bitmap --disable "$img" kept
        disk=(-blockdev "driver=file,filename=$img,node-name=file0"
            -blockdev "driver=qcow2,file=file0,node-name=disk0"
            -device "virtio-blk-pci,drive=disk0,id=vda")
    fi
    "$qemu" -machine q35,accel=tcg -m 64M -nodefaults -display none -S \
        -qmp "unix:$sock,server=on,wait=off" "${disk[@]}" &
    local pid=$!
    python3 - "$sock" "$out/$name.qemu" "$running" "$bitmaps" <<'PY' || { kill "$pid"; exit 1; }
import json, socket, sys, time
path, out, running, bitmaps = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
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
if bitmaps:
    q("migrate-set-capabilities", capabilities=[{"capability": "dirty-bitmaps", "state": True}])
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
    if [ "$bitmaps" = 1 ]; then rm -f "$img"; fi
    zstd -q -19 -f --rm "$out/$name.qemu"
}
capture_multifd() { # name running compression
    local name=$1 running=$2 compression=$3 sock
    sock=$(mktemp -u /tmp/ferry-capture.XXXXXX)
    "$qemu" -machine q35,accel=tcg -m 64M -nodefaults -display none -S \
        -qmp "unix:$sock,server=on,wait=off" &
    local pid=$!
    python3 - "$sock" "$out/$name" "$running" "$compression" <<'PY' || { kill "$pid"; exit 1; }
import json, os, socket, sys, threading, time
path, out, running, compression = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
listen_path = out + ".sock"
listener = socket.socket(socket.AF_UNIX); listener.bind(listen_path); listener.listen(8)
dumps = []
def keep(conn):
    data = bytearray()
    while chunk := conn.recv(1 << 20):
        data += chunk
    # The main stream starts with QEMU's magic; a channel's first packet says its id.
    kind = "main" if data[:4] == b"QEVM" else str(data[24])
    with open(f"{out}.{kind}.qemu", "wb") as f:
        f.write(data)
def accept():
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        t = threading.Thread(target=keep, args=(conn,)); t.start(); dumps.append(t)
threading.Thread(target=accept, daemon=True).start()
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
q("migrate-set-capabilities", capabilities=[{"capability": "multifd", "state": True}])
q("migrate-set-parameters", **{"multifd-channels": 2, "multifd-compression": compression})
if running:
    q("cont"); time.sleep(1)
    q("migrate-set-parameters", **{"max-bandwidth": 2_000_000})
q("migrate", uri=f"unix:{listen_path}")
while (st := q("query-migrate"))["status"] not in ("completed", "failed"):
    time.sleep(0.1)
if st["status"] != "completed": sys.exit(f"migration {st['status']}")
# QEMU has closed every connection once the migration completed.
listener.close(); os.unlink(listen_path)
for t in dumps:
    t.join()
print(f"{out}: {st['ram']['transferred']} bytes, {st['ram']['dirty-sync-count']} passes, {len(dumps)} connections")
PY
    kill "$pid"; wait "$pid" 2>/dev/null || true
    for f in "$out/$name".*.qemu; do zstd -q -19 -f --rm "$f"; done
}
capture_postcopy() { # name
    local name=$1 dir
    dir=$(mktemp -d /tmp/ferry-capture.XXXXXX)
    python3 - "$qemu" "$dir" "$out/$name.qemu" <<'PY'
import atexit, json, socket, subprocess, sys, threading, time
qemu, d, out = sys.argv[1], sys.argv[2], sys.argv[3]
# Both QEMUs go with this script, whichever way it ends.
procs = []
atexit.register(lambda: [p.kill() for p in procs])
def start(name, extra):
    sock = f"{d}/{name}.qmp"
    p = subprocess.Popen([qemu, "-machine", "q35,accel=tcg", "-m", "64M", "-nodefaults",
                          "-display", "none", "-S", "-qmp", f"unix:{sock},server=on,wait=off"] + extra)
    procs.append(p)
    for _ in range(100):
        try:
            s = socket.socket(socket.AF_UNIX); s.connect(sock); break
        except OSError:
            time.sleep(0.1)
    f = s.makefile("rw"); f.readline()
    def q(cmd, **args):
        f.write(json.dumps({"execute": cmd, "arguments": args}) + "\n"); f.flush()
        while True:
            r = json.loads(f.readline())
            if "return" in r or "error" in r:
                if "error" in r: sys.exit(f"{name} {cmd}: {r['error']}")
                return r["return"]
    q("qmp_capabilities")
    return p, q
src, qs = start("src", [])
dst, qd = start("dst", ["-incoming", "defer"])
for q in (qs, qd):
    q("migrate-set-capabilities", capabilities=[{"capability": "postcopy-ram", "state": True}])
qd("migrate-incoming", uri=f"unix:{d}/dst.mig")
# The relay: the source's bytes to the destination (and the file), the return path back.
listener = socket.socket(socket.AF_UNIX); listener.bind(f"{d}/relay.mig"); listener.listen(1)
done = threading.Event()
def relay():
    a, _ = listener.accept()
    b = socket.socket(socket.AF_UNIX); b.connect(f"{d}/dst.mig")
    def back():
        while chunk := b.recv(1 << 16):
            a.sendall(chunk)
    threading.Thread(target=back, daemon=True).start()
    with open(out, "wb") as f:
        while chunk := a.recv(1 << 16):
            f.write(chunk); b.sendall(chunk)
    done.set()
threading.Thread(target=relay, daemon=True).start()
qs("cont"); time.sleep(1)
# Slow enough that the switch comes while most pages are still to go.
qs("migrate-set-parameters", **{"max-bandwidth": 100_000})
qs("migrate", uri=f"unix:{d}/relay.mig")
time.sleep(0.1)
qs("migrate-start-postcopy")
seen = set()
while (st := qs("query-migrate"))["status"] not in ("completed", "failed"):
    seen.add(st["status"]); time.sleep(0.01)
if st["status"] != "completed" or "postcopy-active" not in seen:
    sys.exit(f"migration {st['status']}, seen {sorted(seen)}")
# The source closes its end once it completed; the file is whole when the relay saw that.
src.kill(); src.wait()
done.wait(10)
dst.kill()
print(f"{out}: {st['ram']['transferred']} bytes, postcopy")
PY
    rm -rf "$dir"
    zstd -q -19 -f --rm "$out/$name.qemu"
}
capture_postcopy_resumed() { # name
    local name=$1 dir
    dir=$(mktemp -d /tmp/ferry-capture.XXXXXX)
    python3 - "$qemu" "$dir" "$out/$name" <<'PY'
import atexit, json, socket, subprocess, sys, threading, time
qemu, d, out = sys.argv[1], sys.argv[2], sys.argv[3]
procs = []
atexit.register(lambda: [p.kill() for p in procs])
def start(name, extra):
    sock = f"{d}/{name}.qmp"
    p = subprocess.Popen([qemu, "-machine", "q35,accel=tcg", "-m", "64M", "-nodefaults",
                          "-display", "none", "-S", "-qmp", f"unix:{sock},server=on,wait=off"] + extra)
    procs.append(p)
    for _ in range(100):
        try:
            s = socket.socket(socket.AF_UNIX); s.connect(sock); break
        except OSError:
            time.sleep(0.1)
    f = s.makefile("rw"); f.readline()
    def q(cmd, **args):
        f.write(json.dumps({"execute": cmd, "arguments": args}) + "\n"); f.flush()
        while True:
            r = json.loads(f.readline())
            if "return" in r or "error" in r:
                if "error" in r: sys.exit(f"{name} {cmd}: {r['error']}")
                return r["return"]
    q("qmp_capabilities")
    return p, q
src, qs = start("src", [])
dst, qd = start("dst", ["-incoming", "defer"])
for q in (qs, qd):
    q("migrate-set-capabilities", capabilities=[
        {"capability": c, "state": True} for c in ("return-path", "postcopy-ram", "postcopy-preempt")])
qd("migrate-incoming", uri=f"unix:{d}/dst.mig")
# A relay per attempt: the connections QEMU opens (main, then preempt) go to the destination
# in the same order. The first attempt's relay is slow, so that the cut comes while most pages
# are still to go (QEMU's postcopy rate limit hardly binds on zero pages); the precopy one makes
# the switch come early (a source cut once nearly all had crossed fails instead of pausing).
conns, slow, mains = [], [True], {}
def relay(listen, target, attempt):
    listener = socket.socket(socket.AF_UNIX); listener.bind(f"{d}/{listen}"); listener.listen(4)
    for n in range(2):
        a, _ = listener.accept()
        b = socket.socket(socket.AF_UNIX); b.connect(f"{d}/{target}")
        conns.extend([a, b])
        def forward(x, y, keep):
            try:
                while chunk := x.recv(4096):
                    if keep is not None: keep += chunk
                    y.sendall(chunk)
                    if slow[0] and keep is not None: time.sleep(0.02)
            except OSError:
                pass
        keep = mains.setdefault(attempt, bytearray()) if n == 0 else None
        threading.Thread(target=forward, args=(a, b, keep), daemon=True).start()
        threading.Thread(target=forward, args=(b, a, None), daemon=True).start()
def both(status):
    for _ in range(400):
        if qs("query-migrate")["status"] == status and qd("query-migrate").get("status") == status:
            return
        time.sleep(0.05)
    sys.exit(f"never both {status}: {qs('query-migrate')['status']}, {qd('query-migrate').get('status')}")
threading.Thread(target=relay, args=("relay.mig", "dst.mig", "first"), daemon=True).start()
qs("cont"); time.sleep(1)
qs("migrate-set-parameters", **{"max-bandwidth": 100_000})
qs("migrate", uri=f"unix:{d}/relay.mig")
time.sleep(0.1)
qs("migrate-start-postcopy")
both("postcopy-active")
time.sleep(1)
for c in conns:
    try: c.shutdown(socket.SHUT_RDWR)
    except OSError: pass
conns.clear()
both("postcopy-paused")
first = bytes(mains["first"])
threading.Thread(target=relay, args=("relay2.mig", "dst2.mig", "second"), daemon=True).start()
qd("migrate-recover", uri=f"unix:{d}/dst2.mig")
slow[0] = False
qs("migrate", uri=f"unix:{d}/relay2.mig", resume=True)
seen = set()
while (st := qs("query-migrate"))["status"] not in ("completed", "failed"):
    seen.add(st["status"]); time.sleep(0.01)
if st["status"] != "completed" or not any(s.startswith("postcopy-recover") for s in seen):
    sys.exit(f"migration {st['status']}, seen {sorted(seen)}")
# The source closes its end once it completed; the resumed stream is whole soon after.
src.kill(); src.wait()
time.sleep(0.5)
second = bytes(mains["second"])
for part, data in (("first", first), ("second", second)):
    with open(f"{out}.{part}.qemu", "wb") as f:
        f.write(data)
print(f"{out}: {len(first)} bytes up to the cut, {len(second)} resumed")
PY
    rm -rf "$dir"
    for f in "$out/$name".first.qemu "$out/$name".second.qemu; do zstd -q -19 -f --rm "$f"; done
}
wanted() { [ -z "$only" ] || [ "$only" = "$1" ]; }
mkdir -p "$out/multifd" "$out/postcopy"
if wanted idle; then capture idle 0; fi
if wanted running; then capture running 1; fi
if wanted bitmaps; then capture bitmaps 1 1; fi
if wanted multifd/running; then capture_multifd multifd/running 1 none; fi
if wanted multifd/zstd; then capture_multifd multifd/zstd 0 zstd; fi
if wanted postcopy/running; then capture_postcopy postcopy/running; fi
if wanted postcopy/resumed; then capture_postcopy_resumed postcopy/resumed; fi
