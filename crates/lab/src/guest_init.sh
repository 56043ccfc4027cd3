#!/bin/busybox sh
# /init of ferry's tiny guest. Kernel command-line key=value pairs arrive as environment variables:
#   ferry_ip=10.77.0.10   the guest's address on the site bridges' shared /24
#   ferry_probe=1         print a marker and power off (accelerator detection)
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

# virtio drivers are modules in Debian's kernels; a wrong order fails silently (PLATFORM.md).
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_blk failover net_failover virtio_net \
         virtio_console virtio_balloon; do
    [ -f "/lib/modules/$m.ko" ] && insmod "/lib/modules/$m.ko"
done

if [ -n "$ferry_probe" ]; then
    echo FERRY-PROBE-OK > /dev/ttyS0
    poweroff -f
fi

ip link set lo up
if [ -n "$ferry_ip" ]; then
    ip addr add "$ferry_ip/24" dev eth0
    ip link set eth0 up
fi
mkdir -p /data
[ -b /dev/vda ] && mount -t ext4 /dev/vda /data

# The QEMU guest agent, for `virsh qemu-agent-command` (guest/qga.c). It waits a few seconds for
# its virtio-serial port to appear and exits 2 if the domain has none; restarted if it dies. Its
# messages go to a file, not the console: ttyS0 carries the serial agent's protocol.
(
    while true; do
        ferry-guest qga
        [ $? -eq 2 ] && break
        sleep 1
    done
) >/tmp/ferry-qga.log 2>&1 &

ferry-guest tcpseq 7000 &
while true; do
    ferry-guest agent /dev/ttyS0
    sleep 1
done
