#!/usr/bin/env bash
# The soak (docs/testing.md, "The soak"): one guest under load migrated back and forth through
# ferry's agents, N times (default 200), across the lab's emulated WAN. After each migration
# the guest's memory verifier runs (`ferry migrate` does it), and each agent's footprint is
# read from its /metrics: resident memory, open descriptors, sessions, parked connections.
# One JSON line per migration goes to bench/soak-<date>.jsonl, and a summary at the end says
# whether the verifier ever found an error, whether the footprint grew, and what each agent
# holds once idle (10 s after the last migration). Needs root; not part
# of the test command (it takes about an hour).
#
#   ./scripts/soak.sh [MIGRATIONS] [extra `ferry migrate` options...]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-200}
shift || true
export PATH="$HOME/.cargo/bin:$PATH"
export FERRY_LAB=soak
ferry=./target/release/ferry
cargo build --release --locked --quiet
$ferry image build >/dev/null
$ferry lab down >/dev/null 2>&1 || true
$ferry lab up --rate-mbit 1000 --rtt-ms 2 >/dev/null
trap '$ferry lab down >/dev/null 2>&1 || true' EXIT
run_dir=${FERRY_RUN_DIR:-/run/ferry}/$FERRY_LAB
$ferry vm start soak --mem-mib 128 --workload ws --dirty-mib 32 --dirty-rate-mib-s 2 >/dev/null

mkdir -p bench
out=bench/soak-$(date -u +%Y-%m-%d).jsonl
: >"$out"

# Site a's or b's agent footprint, as JSON.
footprint() {
    curl -s --unix-socket "$run_dir/agent-$1.sock" http://agent/metrics | python3 -c '
import json, sys
want = {"ferry_agent_resident_bytes": "rss", "ferry_agent_open_fds": "fds",
        "ferry_agent_incoming_sessions": "sessions", "ferry_agent_parked_connections": "parked"}
got = {}
for line in sys.stdin:
    parts = line.split()
    if len(parts) == 2 and parts[0] in want:
        got[want[parts[0]]] = int(float(parts[1]))
print(json.dumps(got))'
}

for i in $(seq 1 "$n"); do
    to=$([ $((i % 2)) -eq 1 ] && echo b || echo a)
    started=$(date +%s.%N)
    # A failed migration or a verifier error is recorded, and the soak goes on.
    result=$($ferry migrate soak --to "$to" --json "$@") || echo "soak: migration $i to site $to: exit $?" >&2
    elapsed=$(python3 -c "import time; print(round(time.time() - $started, 1))")
    line=$(python3 -c '
import json, sys
r = json.loads(sys.argv[1])
o, v = r["outcome"], r["verify"] or {}
print(json.dumps({"migration": int(sys.argv[2]), "to": sys.argv[3], "seconds": float(sys.argv[4]),
                  "completed": o.get("completed"), "verify_errors": v.get("mem_errors"),
                  "verify_pages": v.get("mem_pages"),
                  "a": json.loads(sys.argv[5]), "b": json.loads(sys.argv[6])}))' \
        "$result" "$i" "$to" "$elapsed" "$(footprint a)" "$(footprint b)")
    echo "$line" >>"$out"
    echo "$line"
done

# The idle footprint: once the agents have given back what the last migration freed.
sleep 10
idle_a=$(footprint a)
idle_b=$(footprint b)

python3 - "$out" "$idle_a" "$idle_b" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
idle = {"a": json.loads(sys.argv[2]), "b": json.loads(sys.argv[3])}
errors = sum(r["verify_errors"] or 0 for r in rows)
incomplete = sum(1 for r in rows if not r["completed"])
print(f"soak: {len(rows)} migrations, {incomplete} incomplete, {errors} verifier errors")
tenth = max(1, len(rows) // 10)
for site in "ab":
    for key, unit, scale in (("rss", "MiB", 1 << 20), ("fds", "", 1)):
        first = sorted(r[site][key] for r in rows[:tenth])[tenth // 2] / scale
        last = sorted(r[site][key] for r in rows[-tenth:])[tenth // 2] / scale
        peak = max(r[site][key] for r in rows) / scale
        print(f"  agent {site} {key} just after a migration: median of the first tenth "
              f"{first:.1f}{unit}, of the last {last:.1f}{unit}, peak {peak:.1f}{unit}")
    print(f"  agent {site} idle 10 s after the last: {idle[site]['rss'] / (1 << 20):.1f} MiB "
          f"resident, {idle[site]['fds']} fds, {idle[site]['parked']} parked connection(s)")
PY
