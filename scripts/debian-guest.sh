#!/usr/bin/env bash
# The real guest of the end-to-end tests: a small Debian 12 that boots from its own disk image
# through QEMU's firmware (SeaBIOS, then GRUB; no -kernel), with a virtio disk and NIC and redis
# from Debian's packages serving on its NIC. Built from packages with the machine's own apt
# mirrors, without loop devices or mounts:
#
#   mmdebstrap (minbase) -> directory -> mkfs.ext4 -d -> sfdisk on a file -> GRUB by hand -> qcow2
#
# It prints "FERRY-GUEST-READY ..." on its serial console once redis answers on its NIC address,
# so tests wait for that line, not for a time.
#
# usage: scripts/debian-guest.sh [--force]
# Output: $FERRY_CACHE_DIR/debian (default /var/cache/ferry/debian): debian-guest.qcow2 and
# guest.env. Rebuilt only when this script changed (or with --force).
set -euo pipefail

log() { printf '[debian-guest] %s\n' "$*" >&2; }
die() { printf 'debian-guest: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap's root mode, chroot, file ownership in the image)"
FORCE=0
for a in "$@"; do
    case $a in
        --force) FORCE=1 ;;
        *) die "unknown argument: $a (usage: $0 [--force])" ;;
    esac
done

SUITE=bookworm
# The lab's guest network (crates/lab: 10.77.0.0/24 on each site's bridge); the tiny guests use
# other addresses.
GUEST_ADDR=10.77.0.60
GUEST_IP=$GUEST_ADDR/24
ROOT_SIZE_MB=1024
OUT=${FERRY_CACHE_DIR:-/var/cache/ferry}/debian
STAMP=$(sha256sum "$0" | cut -d' ' -f1)
if [ $FORCE = 0 ] && [ -f "$OUT/debian-guest.qcow2" ] && grep -qs "^STAMP=$STAMP\$" "$OUT/guest.env"; then
    log "cached: $OUT/debian-guest.qcow2"
    exit 0
fi

need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v sfdisk >/dev/null || need+=(fdisk)
command -v grub-mkimage >/dev/null || need+=(grub-common)
[ -f /usr/lib/grub/i386-pc/boot.img ] || need+=(grub-pc-bin)
command -v qemu-img >/dev/null || need+=(qemu-utils)
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -q || die "apt-get update failed; check the apt sources"
    apt-get install -y -q --no-install-recommends "${need[@]}" || die "apt refused: ${need[*]}"
fi

T0=$(date +%s)
WORK=$OUT/work
ROOT=$WORK/rootfs
rm -rf "$WORK"
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT

# The machine's own Debian mirrors for the suite, its updates and security (one-line and deb822
# sources), never a hard-coded host.
{
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk -v s="$SUITE" '$1=="deb" {
            i=2; opts="";
            if ($2 ~ /^\[/) { while (i<=NF) { opts=opts" "$i; if ($i ~ /\]$/) { i++; break } i++ } }
            if ($(i+1)==s || $(i+1)==s"-updates" || $(i+1)==s"-security")
                print "deb" opts " " $i " " $(i+1) " main" }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        awk -v s="$SUITE" '
            function flush(   n, u, m, su, j, k, opt) {
                if (types ~ /(^| )deb( |$)/ && enabled != "no" && uris != "" && suites != "") {
                    opt = (signed != "" ? " [signed-by=" signed "]" : "")
                    n = split(uris, u, " "); m = split(suites, su, " ")
                    for (j=1; j<=n; j++) for (k=1; k<=m; k++)
                        if (su[k]==s || su[k]==s"-updates" || su[k]==s"-security")
                            print "deb" opt " " u[j] " " su[k] " main"
                }
                types=""; uris=""; suites=""; signed=""; enabled=""
            }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            { key=$1; sub(/:$/, "", key); val=$0; sub(/^[^:]*:[ \t]*/, "", val)
              if (key=="Types") types=val; else if (key=="URIs") uris=val;
              else if (key=="Suites") suites=val; else if (key=="Signed-By") signed=val;
              else if (key=="Enabled") enabled=val }
            END { flush() }' "$f"
    done
} | awk '!seen[$0]++' >"$WORK/sources.list"
grep -q " $SUITE main\$" "$WORK/sources.list" ||
    die "no 'deb ... $SUITE main' source in /etc/apt/sources.list{,.d/*.list,.d/*.sources}"

PKGS=systemd,systemd-sysv,udev,dbus,linux-image-cloud-amd64,initramfs-tools,zstd,redis-server,redis-tools,iproute2,procps,netbase
log "mmdebstrap $SUITE (minbase, no recommends): $PKGS"
# In a mount namespace of its own: what mmdebstrap mounts for maintainer scripts stays there.
# The merged-usr hook keeps usrmerge (and the Perl it pulls) out.
unshare --mount --propagation private -- \
    mmdebstrap --quiet --mode=root --variant=minbase --arch=amd64 \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include="$PKGS" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --essential-hook='mkdir -p "$1/etc/initramfs-tools/conf.d" && printf "MODULES=list\nCOMPRESS=zstd\n" > "$1/etc/initramfs-tools/conf.d/ferry-guest"' \
    "$SUITE" "$ROOT" "$WORK/sources.list" ||
    die "mmdebstrap failed (is the mirror reachable? see above)"

KVER=$(ls "$ROOT/boot" | sed -n 's/^vmlinuz-//p' | sort -V | tail -n1)
[ -n "$KVER" ] || die "no kernel in $ROOT/boot"
ROOT_UUID=$(cat /proc/sys/kernel/random/uuid)
echo ferry-debian >"$ROOT/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\tferry-debian\n' >"$ROOT/etc/hosts"
printf 'UUID=%s\t/\text4\terrors=remount-ro\t0\t1\n' "$ROOT_UUID" >"$ROOT/etc/fstab"
# A fixed machine-id: no first-boot logic that could prompt on the console.
tr -d '-' </proc/sys/kernel/random/uuid >"$ROOT/etc/machine-id"
# The cloud kernel has virtio as modules: a small initramfs with just those.
printf '%s\n' virtio_pci virtio_blk virtio_net >"$ROOT/etc/initramfs-tools/modules"

# eth0 (net.ifnames=0) with the lab's address; the guest keeps it wherever it runs.
mkdir -p "$ROOT/etc/systemd/network"
cat >"$ROOT/etc/systemd/network/50-eth0.network" <<EOF
[Match]
Name=eth0

[Network]
Address=$GUEST_IP
LinkLocalAddressing=no
IPv6AcceptRA=no
EOF
# redis on every address (the NIC's too), no protected mode: a test guest.
sed -i -e 's/^bind .*/bind * -::*/' -e 's/^protected-mode .*/protected-mode no/' "$ROOT/etc/redis/redis.conf"
grep -q '^bind \* -::\*' "$ROOT/etc/redis/redis.conf" || die "could not set redis's bind address"
echo 'vm.overcommit_memory = 1' >"$ROOT/etc/sysctl.d/90-redis.conf"

# The readiness line, once redis answers on the NIC's address.
cat >"$ROOT/usr/local/sbin/ferry-guest-ready" <<EOF
#!/bin/sh
for i in \$(seq 1 600); do
    if [ "\$(redis-cli -h $GUEST_ADDR -p 6379 ping 2>/dev/null)" = PONG ]; then
        echo "FERRY-GUEST-READY ip=$GUEST_ADDR service=redis port=6379 uptime=\$(cut -d' ' -f1 /proc/uptime)" >/dev/ttyS0
        exit 0
    fi
    sleep 0.5
done
echo "FERRY-GUEST-FAILED redis did not answer on $GUEST_ADDR:6379" >/dev/ttyS0
exit 1
EOF
chmod 755 "$ROOT/usr/local/sbin/ferry-guest-ready"
cat >"$ROOT/etc/systemd/system/ferry-guest-ready.service" <<'EOF'
[Unit]
Description=FERRY-GUEST-READY on ttyS0 once redis answers on the NIC
Wants=redis-server.service systemd-networkd.service
After=redis-server.service systemd-networkd.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/ferry-guest-ready

[Install]
WantedBy=multi-user.target
EOF
chroot "$ROOT" passwd -d root >/dev/null
chroot "$ROOT" systemctl -q enable systemd-networkd.service ferry-guest-ready.service redis-server.service
chroot "$ROOT" systemctl -q mask systemd-firstboot.service apt-daily.timer apt-daily-upgrade.timer \
    e2scrub_all.timer e2scrub_reap.service fstrim.timer systemd-networkd-wait-online.service
rm -f "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/cache/apt/*.bin
rm -rf "$ROOT"/var/lib/apt/lists/*_Packages "$ROOT"/var/log/*.log
log "initramfs for $KVER"
unshare --mount --propagation private -- chroot "$ROOT" update-initramfs -u -k "$KVER" >/dev/null 2>&1 ||
    die "update-initramfs failed"
[ -f "$ROOT/boot/initrd.img-$KVER" ] || die "no initramfs for $KVER"

CMDLINE="root=UUID=$ROOT_UUID rw console=ttyS0,115200 net.ifnames=0 biosdevname=0 panic=10"
mkdir -p "$ROOT/boot/grub"
cat >"$ROOT/boot/grub/grub.cfg" <<EOF
set timeout=0
set default=0
menuentry "Debian $SUITE (ferry's test guest)" {
  linux /vmlinuz $CMDLINE
  initrd /initrd.img
}
EOF
[ -e "$ROOT/vmlinuz" ] || ln -sf "boot/vmlinuz-$KVER" "$ROOT/vmlinuz"
[ -e "$ROOT/initrd.img" ] || ln -sf "boot/initrd.img-$KVER" "$ROOT/initrd.img"

log "root filesystem (${ROOT_SIZE_MB} MiB) and disk image"
mkfs.ext4 -q -F -L ferry-root -U "$ROOT_UUID" -d "$ROOT" "$WORK/root.img" "${ROOT_SIZE_MB}M" ||
    die "mkfs.ext4 -d failed"
DISK=$WORK/disk.raw
truncate -s $(((ROOT_SIZE_MB + 1) * 1024 * 1024)) "$DISK"
printf 'label: dos\nlabel-id: 0x46455252\nstart=2048, type=83, bootable\n' | sfdisk -q "$DISK" ||
    die "sfdisk failed"
dd if="$WORK/root.img" of="$DISK" bs=1M seek=1 conv=notrunc,sparse status=none

# GRUB for SeaBIOS without grub-install (which wants a block device): boot.img's 440 code bytes
# into the MBR (the partition table stays), core.img at sector 1, where boot.img looks for it.
cat >"$WORK/grub-early.cfg" <<EOF
serial --unit=0 --speed=115200
terminal_input serial console
terminal_output serial console
set root=(hd0,msdos1)
set prefix=(hd0,msdos1)/boot/grub
EOF
grub-mkimage -O i386-pc -o "$WORK/core.img" -c "$WORK/grub-early.cfg" -p "(hd0,msdos1)/boot/grub" \
    biosdisk part_msdos ext2 normal linux configfile serial terminal echo test boot ||
    die "grub-mkimage failed"
[ $((($(stat -c %s "$WORK/core.img") + 511) / 512)) -lt 2047 ] || die "core.img does not fit the 1 MiB gap"
dd if=/usr/lib/grub/i386-pc/boot.img of="$DISK" bs=440 count=1 conv=notrunc status=none
dd if="$WORK/core.img" of="$DISK" bs=512 seek=1 conv=notrunc status=none

qemu-img convert -f raw -O qcow2 -c "$DISK" "$OUT/debian-guest.qcow2.tmp"
mv -f "$OUT/debian-guest.qcow2.tmp" "$OUT/debian-guest.qcow2"
cat >"$OUT/guest.env" <<EOF
IMAGE=$OUT/debian-guest.qcow2
KERNEL=$KVER
GUEST_ADDR=$GUEST_ADDR
READY_LINE=FERRY-GUEST-READY
SERVICE_PORT=6379
STAMP=$STAMP
EOF
log "built $OUT/debian-guest.qcow2 in $(($(date +%s) - T0)) s ($(du -h --apparent-size "$OUT/debian-guest.qcow2" | cut -f1), kernel $KVER)"
