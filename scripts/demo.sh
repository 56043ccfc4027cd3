#!/usr/bin/env bash
# The demo: installs what ferry needs, builds it and the guest image, then migrates a busy VM
# from site a to site b across an emulated 100 Mbit/s, 50 ms RTT WAN. Extra arguments go to
# `ferry demo` (see `ferry demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
echo "building ferry (release)..."
cargo build --release --locked --quiet
./target/release/ferry image build
exec ./target/release/ferry demo "$@"
