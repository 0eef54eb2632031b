#!/bin/sh
# Dynamic capacity: a DCD (serial 0x3000, two DC regions) next to the other devices. fabricd
# must report it as the kernel shows it; then the host adds an extent over QMP
# (cxl-add-dynamic-capacity) and the guest reports what the kernel shows afterwards.
. /fabric/common.sh
start_fabricd
cxl list -vvv >/tmp/cxl-before.json && result cxl-list ok
blob cxl-list-before /tmp/cxl-before.json
fabricctl topology --daemon -o json >/tmp/topo-before.json && result fabric-topology ok
blob topology-before /tmp/topo-before.json
dmesg >/tmp/dmesg-before
echo "FABRIC-READY-FOR-DC [t=$(cut -d" " -f1 /proc/uptime)s]"
# 6.12 has no DCD support: the event the extent raises is all it may show. Wait for new
# kernel messages (up to 5 s), then take the kernel's and fabricd's views again.
i=0
while [ $i -lt 50 ]; do
  [ "$(dmesg | wc -l)" -gt "$(wc -l </tmp/dmesg-before)" ] && break
  sleep 0.1; i=$((i + 1))
done
sleep 2
dmesg | tail -n +"$(($(wc -l </tmp/dmesg-before) + 1))" >/tmp/dmesg-after
blob kernel-log-after /tmp/dmesg-after
cxl list -vvv >/tmp/cxl-after.json
blob cxl-list-after /tmp/cxl-after.json
fabricctl topology --daemon -o json >/tmp/topo-after.json && result fabric-topology-after ok
blob topology-after /tmp/topo-after.json
kill $FABRICD_PID 2>/dev/null
