#!/usr/bin/env bash
# Installs everything ferry needs on a Debian 12 host: QEMU 10 and libvirt from the backports
# suite of the machine's own Debian mirror, the lab's tools, PostgreSQL and headless Chromium for
# the fleet's tests, and checks the Rust toolchain. Safe to run twice.
set -euo pipefail

die() { echo "setup: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (the lab creates network namespaces and installs packages); try: sudo $0"

# A tiny guest image, the build and a few VMs' disks need a few GiB.
avail_kib=$(df -Pk /var | awk 'NR==2 {print $4}')
[ "${avail_kib:-0}" -ge $((3 * 1024 * 1024)) ] || die "less than 3 GiB free under /var ($((avail_kib / 1024)) MiB); free some space and rerun"

. /etc/os-release
[ "${ID:-}" = debian ] || die "this script supports Debian (found ID=${ID:-unknown}); install QEMU >= 10, busybox-static, cpio, iperf3, ethtool by hand"
codename=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
backports="${codename}-backports"

# Derive the backports mirror from the machine's own apt configuration: never hard-code a host.
backports_file=/etc/apt/sources.list.d/ferry-backports.sources
if ! grep -rqs "^Suites:.*${backports}" /etc/apt/sources.list.d/ && ! grep -qs "${backports}" /etc/apt/sources.list; then
    uri=""; keyring=""
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        # The stanza whose Suites line carries the plain codename is the main archive.
        read -r uri keyring < <(awk -v c="$codename" '
            /^URIs:/ {u=$2} /^Signed-By:/ {k=$2}
            /^Suites:/ {for (i=2;i<=NF;i++) if ($i==c) main=1}
            /^$/ { if (main && !done) {print u, k; done=1} main=0; u=""; k="" }
            END { if (main && !done) print u, k }' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk -v c="$codename" '$1=="deb" && $3==c {print $2; exit}' /etc/apt/sources.list)
    fi
    [ -n "$uri" ] || die "could not find the Debian mirror for '$codename' in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"
    {
        echo "Types: deb"
        echo "URIs: $uri"
        echo "Suites: $backports"
        echo "Components: main"
        [ -n "$keyring" ] && echo "Signed-By: $keyring"
    } > "$backports_file"
    echo "setup: added $backports from $uri"
fi

need_pkgs=(busybox-static cpio iperf3 ethtool e2fsprogs iproute2 kmod procps util-linux zstd gzip gcc libc6-dev)
missing=()
for p in "${need_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
qemu_ok=0
if command -v qemu-system-x86_64 >/dev/null; then
    major=$(qemu-system-x86_64 --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
    [ "${major:-0}" -ge 10 ] && qemu_ok=1
fi
if [ ${#missing[@]} -gt 0 ] || [ $qemu_ok -eq 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || die "apt-get update failed; check the apt sources above"
    if [ ${#missing[@]} -gt 0 ]; then
        apt-get install -y -q --no-install-recommends "${missing[@]}" || die "apt refused: ${missing[*]}"
    fi
    if [ $qemu_ok -eq 0 ]; then
        apt-get install -y -q --no-install-recommends -t "$backports" qemu-system-x86 qemu-utils \
            || die "could not install qemu-system-x86 from $backports (Debian's own QEMU 7.2 corrupts guests during migration under TCG)"
    fi
fi
# libvirt from the same suite as QEMU (11.x: UNIX-socket migration, the switchover bandwidth);
# the lab runs one daemon per site (`ferry lab up --libvirt`). No systemd here: nothing starts
# it by itself.
if ! command -v libvirtd >/dev/null || ! command -v virsh >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || die "apt-get update failed; check the apt sources above"
    apt-get install -y -q --no-install-recommends -t "$backports" \
        libvirt-daemon-driver-qemu libvirt-daemon libvirt-clients \
        || die "could not install libvirt from $backports"
fi
# PostgreSQL for the fleet controller's shared store (the tests start their own server in the
# lab, as the postgres user; the package's own cluster is not used).
if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || die "apt-get update failed; check the apt sources above"
    apt-get install -y -q --no-install-recommends postgresql || die "could not install postgresql"
fi
# Headless Chromium for the fleet dashboard's test (a real browser runs the page).
if ! command -v chromium >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || die "apt-get update failed; check the apt sources above"
    apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core || die "could not install chromium"
fi
qemu-system-x86_64 --version | head -1 | grep -Eq 'version (1[0-9]|[2-9][0-9])\.' \
    || die "QEMU >= 10 is required; found: $(qemu-system-x86_64 --version | head -1)"

if ! command -v cargo >/dev/null; then
    for c in "$HOME/.cargo/bin" /root/.cargo/bin /usr/local/cargo/bin; do
        [ -x "$c/cargo" ] && export PATH="$c:$PATH" && break
    done
fi
command -v cargo >/dev/null || die "cargo not found; install Rust (rustup) and rerun"
# cargo-fuzz for scripts/fuzz.sh (libFuzzer; its C++ part builds with g++), pinned.
CARGO_FUZZ_VERSION=0.13.2
if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
    command -v g++ >/dev/null || {
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends g++ || die "could not install g++"
    }
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --quiet \
        || die "could not install cargo-fuzz $CARGO_FUZZ_VERSION"
fi
# cargo-deny for the supply-chain check in scripts/test.sh (deny.toml), pinned.
CARGO_DENY_VERSION=0.20.2
if ! cargo deny --version 2>/dev/null | grep -q "$CARGO_DENY_VERSION"; then
    cargo install cargo-deny --version "$CARGO_DENY_VERSION" --locked --quiet \
        || die "could not install cargo-deny $CARGO_DENY_VERSION"
fi
echo "setup: ok ($(qemu-system-x86_64 --version | head -1), $(libvirtd --version), $(cargo --version))"
