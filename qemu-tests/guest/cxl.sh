#!/bin/sh
# CXL: a 2-way volatile region at 256 B granularity across the switch's ports, created
# through sysfs; then the kernel's view (cxl list -vvv), fabricd's view and the address map
# go back to the host. fabricd then exports the region's DAX device ([memory] dax): a
# libfabric-mm client allocates on the region's interleave set, maps it at its GFA and
# stores; a second process imports and loads; the host reads the stores back from the
# memory backends' files.
. /fabric/common.sh

A=$(memdev_by_serial 0x1000); B=$(memdev_by_serial 0x1001)
DA=$(endpoint_decoder "$A"); DB=$(endpoint_decoder "$B")
echo "region targets: $A ($DA) $B ($DB)"
# 6.12 allocates DPA in 256 MiB units: each target gives all of its 256 MiB.
create_region() { cxl_ram_region 256 $((512 << 20)) "$DA" "$DB"; }
if create_region; then
  R=$(cat /tmp/region)
  result cxl-region ok "$R committed"
else
  result cxl-region fail "see the console"
fi
R=$(cat /tmp/region 2>/dev/null)
sleep 1
echo "$R" >/tmp/region-name
blob region-name /tmp/region-name

cxl list -vvv >/tmp/cxl.json 2>/tmp/cxl.err && result cxl-list ok || { result cxl-list fail "$(cat /tmp/cxl.err)"; }
blob cxl-list /tmp/cxl.json

# The region's DAX device, handed to device_dax before fabricd starts (it exports it).
DAX=""
for d in /sys/bus/cxl/devices/$R/dax_region*/dax[0-9]*; do [ -e "$d" ] && DAX=$(basename "$d"); done
echo "$DAX" >/tmp/dax-name && blob dax-name /tmp/dax-name
# dax_cxl prefers the kmem driver for RAM regions (which is not loaded here, see
# scripts/qemu-image.sh): hand the device to device_dax by id, as daxctl reconfigure-device does.
[ -n "$DAX" ] && [ ! -e /sys/bus/dax/devices/$DAX/driver ] && echo "$DAX" >/sys/bus/dax/drivers/device_dax/new_id
if [ -n "$DAX" ] && [ -c "/dev/$DAX" ] && [ -e /sys/bus/dax/devices/$DAX/driver ]; then
  result dax-device ok "/dev/$DAX size $(cat /sys/bus/dax/devices/$DAX/size) align $(cat /sys/bus/dax/devices/$DAX/align 2>/dev/null)"
  # The host filled the backends before boot: read that through the raw device first
  # (libfabric-mm's low-level DeviceMapping).
  check dax-read "host pattern read through /dev/$DAX" -- fabric-guest-probe check "/dev/$DAX" 0x800000 0x5eed0001
else
  result dax-device fail "region $R has no DAX device"; ls -lR /sys/bus/cxl/devices/$R/ | head -40
fi

# fabricd exports the DAX device: regions on the CXL region's interleave set are ranges of it.
FABRICD_EXTRA="[memory]
dax = [\"$DAX\"]"
start_fabricd
fabricctl topology --daemon -o json >/tmp/topo.json 2>/tmp/topo.err && result fabric-topology ok || result fabric-topology fail "$(cat /tmp/topo.err)"
blob fabric-topology /tmp/topo.json
fabricctl map --daemon -o json >/tmp/map.json 2>/tmp/map.err && result fabric-map ok || result fabric-map fail "$(cat /tmp/map.err)"
blob fabric-map /tmp/map.json

SET=$(grep -o '"set:cxl-region:[^"]*"' /tmp/map.json | head -1 | sed 's/^"set://; s/"$//')
# Latency isolation on the DAX device (issue 17's bench on real device memory): Ping while
# four clients allocate and free 2 MiB regions on the set, one in eight of 4 MiB, which
# fabricd zeroes on the device (QEMU emulates CXL memory one access at a time,
# so it zeroes at a few MB/s), then group commit; the JSON goes back to the host. Before
# the library's stores below, which the host reads back after the guest (the bench's
# zeroing would clear them).
if fabricctl bench control --mode isolation --socket /run/fabric/fabricd.sock --set "$SET" \
  --zeroed-bytes $((4 << 20)) --iterations 300 --seconds 1 --json >/tmp/isolation.json 2>/tmp/isolation.err; then
  result bench-isolation ok "set $SET"
else
  result bench-isolation fail "$(cat /tmp/isolation.err)"
fi
blob bench-isolation /tmp/isolation.json

# Through the library: one process allocates on the set, maps it at its GFA and stores the
# pattern, exports; a second imports by handle, maps at the same GFA and loads it. The host
# then finds the owner's stores in the memdevs' backing files (the second path).
fabric-guest-probe owner "set:$SET" 0x800000 0x5eed0002 /tmp/lib-region >/tmp/owner.log 2>&1 &
OWNER=$!
i=0
while [ ! -s /tmp/lib-region ] && kill -0 $OWNER 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
if [ -s /tmp/lib-region ]; then
  result lib-alloc-store ok "set $SET: $(cat /tmp/lib-region)"
  check lib-import-load "a second process imports the region and loads the pattern" -- fabric-guest-probe importer /tmp/lib-region 0x800000 0x5eed0002
else
  result lib-alloc-store fail "set $SET: $(cat /tmp/owner.log)"; tail -20 /tmp/fabricd.log
fi
if wait $OWNER; then result lib-owner ok "$(cat /tmp/owner.log)"; else result lib-owner fail "$(cat /tmp/owner.log)"; fi
blob lib-region /tmp/lib-region
kill $FABRICD_PID 2>/dev/null
