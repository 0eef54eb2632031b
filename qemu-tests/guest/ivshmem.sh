#!/bin/sh
# Shared memory through a PCI BAR: ivshmem-plain's BAR2 is a host file. The host filled it
# before boot; the guest maps sysfs resource2, checks the host's pattern, stores its own for
# the host to find after power-off; fabricd must list the device with its BAR.
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
check bar-write "guest pattern written through resource2" -- fabric-guest-probe fill "$DEV/resource2" 0x100000 0x5eed0004
start_fabricd
fabricctl topology --daemon -o json >/tmp/topo.json && result fabric-topology ok
blob topology /tmp/topo.json
kill $FABRICD_PID 2>/dev/null
