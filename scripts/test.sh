#!/usr/bin/env bash
# The tests: installs what ferry needs, checks formatting and lints, then runs every test:
# unit, component and integration (real guests under QEMU, migrated across the lab's WAN).
# Integration tests need root and run one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
cargo fmt --all --check
cargo clippy --workspace --all-targets --release --locked --quiet -- -D warnings
# The supply chain: licences, banned and wildcard dependencies, sources (deny.toml).
cargo deny check licenses bans sources
# Known advisories need RustSec's database, which lives on GitHub: checked where it can be
# fetched, and said where it cannot.
if timeout 120 cargo deny fetch db >/dev/null 2>&1; then
    cargo deny --offline check advisories
else
    echo "test: advisories not checked: RustSec's database could not be fetched (github.com)" >&2
fi
# What a host runs stands without the lab: it builds without it, and nothing it links is the lab.
cargo clippy -p ferry-cli --no-default-features --release --locked --quiet -- -D warnings
if cargo tree -p ferry-cli --no-default-features -e normal --locked | grep -q 'ferry-lab'; then
    echo "test: ferry without the lab feature still depends on ferry-lab" >&2
    exit 1
fi
# One build of every test and of the ferry binary. Every cargo command below selects the whole
# workspace: features are unified over the packages a command selects, so a command with fewer
# packages would build the shared crates again with other features (it did, three times over).
tests=(--workspace --release --locked)
cargo test "${tests[@]}" --lib --bins --test '*' --no-run --quiet
# First the unit tests, which need no root or guest.
cargo test "${tests[@]}" --lib --bins
./target/release/ferry image build
./scripts/debian-guest.sh
# Then every integration test, one at a time: the end-to-end tests boot TCG guests, and two at
# once would fight over 2 cores.
cargo test "${tests[@]}" --test '*' -- --test-threads=1
# Every fuzz target briefly, from its seeds (docs/testing.md, "Fuzzing").
# Built unoptimized: the instrumented release build took 7 of CI's 45 minutes, the dev one 3.
FERRY_FUZZ_PROFILE=dev ./scripts/fuzz.sh 15
