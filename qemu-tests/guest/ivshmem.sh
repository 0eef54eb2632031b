#!/bin/sh
# Shared memory through a PCI BAR: ivshmem-plain's BAR2 is a host file. The host filled it
# before boot; the guest maps sysfs resource2 and checks the host's pattern; then fabricd
# exports the BAR and a libfabric-mm client stores its own pattern through a region on it
# for the host to find after power-off; fabricd must list the device with its BAR.
. /fabric/common.sh
DEV=""
for d in /sys/bus/pci/devices/*; do
  [ "$(cat "$d/vendor")" = 0x1af4 ] && [ "$(cat "$d/device")" = 0x1110 ] && DEV=$d
done
if [ -z "$DEV" ]; then result ivshmem-device fail "no 1af4:1110 function"; exit 0; fi
result ivshmem-device ok "$(basename "$DEV")"
echo 1 >"$DEV/enable" 2>/dev/null
basename "$DEV" >/tmp/bdf && blob ivshmem-bdf /tmp/bdf
check bar-read "host pattern read through resource2" -- fabric-guest-probe check "$DEV/resource2" 0x100000 0x5eed0003
# fabricd exports BAR2 ([memory] bars): a libfabric-mm client allocates on it, maps it at
# its GFA and stores; a second process imports and loads; the host reads the file. The
# client (root) uses the whole 4 MiB BAR: the derived per-uid default would be half of it.
FABRICD_EXTRA="[memory]
bars = [\"$(basename "$DEV")/2\"]
[limits]
allocated_bytes_per_uid = 0x400000"
start_fabricd
fabricctl topology --daemon -o json >/tmp/topo.json && result fabric-topology ok
blob topology /tmp/topo.json
fabric-guest-probe owner "bar:$(basename "$DEV")" 0x100000 0x5eed0004 /tmp/lib-region >/tmp/owner.log 2>&1 &
OWNER=$!
i=0
while [ ! -s /tmp/lib-region ] && kill -0 $OWNER 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
if [ -s /tmp/lib-region ]; then
  result lib-alloc-store ok "$(cat /tmp/lib-region)"
  check lib-import-load "a second process imports the region and loads the pattern" -- fabric-guest-probe importer /tmp/lib-region 0x100000 0x5eed0004
else
  result lib-alloc-store fail "$(cat /tmp/owner.log)"; tail -20 /tmp/fabricd.log
fi
if wait $OWNER; then result lib-owner ok "$(cat /tmp/owner.log)"; else result lib-owner fail "$(cat /tmp/owner.log)"; fi
blob lib-region /tmp/lib-region
kill $FABRICD_PID 2>/dev/null
