#!/usr/bin/env bash
# Fuzzes ferry's decoders (fuzz/fuzz_targets: the frame, the migration stream, multifd
# channels, control messages, the codec, disk frames, indexes, the NBD server, the API's JSON)
# with libFuzzer,
# each for SECONDS (default 60), keeping each target's corpus in fuzz/corpus/<target> between
# runs (seeded from the repository's captured QEMU streams). A crash stops the script with
# the input saved in fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# FERRY_FUZZ_PROFILE=dev builds the targets unoptimized: in 40% of the time, running several
# times slower. CI's brief pass from the seeds uses it; long runs should not.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
seconds="${1:-60}"
shift || true
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: cargo-fuzz is missing; ./scripts/setup.sh installs it" >&2
    exit 1
fi
# cargo-fuzz's instrumentation flags (-Zsanitizer) on the stable toolchain the project pins.
export RUSTC_BOOTSTRAP=1
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
    mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi
seed() {
    local dir="fuzz/corpus/$1"
    mkdir -p "$dir"
    [ -n "$(ls -A "$dir")" ] && return
    case "$1" in
        migration_stream)
            # The head of each captured stream, after a chunk-size byte (its top bit set for a
            # resumed postcopy stream).
            for f in crates/qemu/tests/streams/*.qemu.zst crates/qemu/tests/streams/multifd/*.main.qemu.zst \
                crates/qemu/tests/streams/postcopy/*.qemu.zst; do
                mode='\x07'
                case "$f" in *resumed.second*) mode='\x87' ;; esac
                { printf "$mode"; zstd -dc "$f" 2>/dev/null | head -c 65536 || true; } >"$dir/$(basename "$(dirname "$f")")-$(basename "$f" .qemu.zst)"
            done
            ;;
        multifd_channel)
            # The head of each captured multifd channel (its init and first packets).
            for f in crates/qemu/tests/streams/multifd/*.[0-9].qemu.zst; do
                { printf '\x07'; zstd -dc "$f" 2>/dev/null | head -c 65536 || true; } >"$dir/$(basename "$f" .qemu.zst)"
            done
            ;;
        *)
            # Hand-made seeds that pass the target's first checks (fuzz/seeds/<target>).
            if [ -d "fuzz/seeds/$1" ]; then cp "fuzz/seeds/$1"/* "$dir/"; else printf '' >"$dir/empty"; fi
            ;;
    esac
}
profile="--release"
if [ "${FERRY_FUZZ_PROFILE:-release}" = dev ]; then profile="--dev"; fi
cargo fuzz build --fuzz-dir fuzz "$profile"
mkdir -p target/fuzz-logs
for target in "${targets[@]}"; do
    seed "$target"
    log="target/fuzz-logs/$target.log"
    echo "fuzz: $target for ${seconds}s (log: $log)"
    # A single allocation over 256 MiB counts as a crash: no decoder needs one.
    if ! cargo fuzz run --fuzz-dir fuzz "$profile" "$target" "fuzz/corpus/$target" -- \
        -max_total_time="$seconds" -rss_limit_mb=4096 -malloc_limit_mb=256 -timeout=10 \
        -print_final_stats=1 >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "fuzz: $target failed; the input is in fuzz/artifacts/$target/" >&2
        exit 1
    fi
    grep -E "^stat::(number_of_executed_units|peak_rss_mb)|DONE +cov" "$log" || true
    echo "fuzz: $target corpus: $(ls "fuzz/corpus/$target" | wc -l) inputs"
done
