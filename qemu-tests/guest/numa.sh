#!/bin/sh
# CXL memory as a NUMA node: kmem onlines a 1-way RAM region as System RAM (movable), which
# becomes a memory-only node; fabricd serves that node ([memory] numa) and a libfabric-mm
# client allocates a region there (a file on fabricd's tmpfs numa_dir, bound to the node),
# maps it at its GFA and stores; a second process imports and loads. The owner's numa_maps shows where the
# kernel put the pages; the host then finds them in the device's backing file.
. /fabric/common.sh
wr() { echo "$2" >"$1" || { echo "writing $2 to $1 failed"; return 1; }; }

# kmem before the region: dax_cxl then hands the region's DAX device to kmem.
while read -r ko; do insmod "$ko" || echo "insmod $ko failed"; done </etc/fabric-modules-optional
E=$(ls -d /sys/bus/cxl/devices/endpoint* | head -1)
D=decoder${E##*endpoint}.0
create_region() { cxl_ram_region 256 $((256 << 20)) "$D"; }
if create_region; then result cxl-region ok "$(cat /tmp/region) committed"; else result cxl-region fail "see the console"; fi
R=$(cat /tmp/region 2>/dev/null)
sleep 1
DAX=""
for d in /sys/bus/cxl/devices/$R/dax_region*/dax[0-9]*; do [ -e "$d" ] && DAX=$(basename "$d"); done
DRV=$(basename "$(readlink -f /sys/bus/dax/devices/$DAX/driver 2>/dev/null)" 2>/dev/null)
NODE=$(cat /sys/bus/dax/devices/$DAX/target_node 2>/dev/null)
if [ "$DRV" = kmem ] && [ -n "$NODE" ]; then result kmem ok "$DAX bound to kmem, target node $NODE"; else result kmem fail "$DAX driver '$DRV' node '$NODE'"; fi
# memhp_default_state=offline left the blocks offline: online them movable, so that only
# movable (user, shmem) pages can land in the CXL window (docs/testing.md, "Tier 3").
N=/sys/devices/system/node/node$NODE
n=0
for m in $N/memory[0-9]*; do [ -e "$m/state" ] && wr "$m/state" online_movable && n=$((n + 1)); done
MEM=$(grep MemTotal $N/meminfo 2>/dev/null)
CPUS=$(cat $N/cpulist 2>/dev/null)
if [ $n -gt 0 ] && [ -z "$CPUS" ] && [ -n "$MEM" ]; then
  result kmem-online ok "node $NODE: $n memory blocks online_movable, no CPUs, $MEM"
else
  result kmem-online fail "node $NODE: $n blocks, cpus '$CPUS', '$MEM'"
fi
echo "$R $DAX $NODE" >/tmp/kmem-info && blob kmem-info /tmp/kmem-info
cxl list -vvv >/tmp/cxl.json 2>/tmp/cxl.err || echo "cxl list: $(cat /tmp/cxl.err)"
blob cxl-list /tmp/cxl.json

# The region files' directory: tmpfs, as numa_dir must be (the guest's / is not).
mkdir -p /run/fabric-numa && mount -t tmpfs -o mode=0700 tmpfs /run/fabric-numa || echo "mounting tmpfs failed"
FABRICD_EXTRA="[memory]
numa = [$NODE]
numa_dir = \"/run/fabric-numa\""
start_fabricd
fabricctl topology --daemon -o json >/tmp/topo.json 2>/tmp/topo.err && result fabric-topology ok || result fabric-topology fail "$(cat /tmp/topo.err)"
blob fabric-topology /tmp/topo.json

fabric-guest-probe owner "numa:$NODE" 0x200000 0x5eed0005 /tmp/lib-region >/tmp/owner.log 2>&1 &
OWNER=$!
i=0
while [ ! -s /tmp/lib-region ] && kill -0 $OWNER 2>/dev/null && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
if [ -s /tmp/lib-region ]; then
  result lib-alloc-store ok "node $NODE: $(cat /tmp/lib-region)"
  # The kernel's account of the owner's mapping of the region (fabricd's file under
  # numa_dir): bound to the node, all 512 pages there and none elsewhere.
  grep "file=/run/fabric-numa/" /proc/$OWNER/numa_maps >/tmp/numa-maps
  blob numa-maps /tmp/numa-maps
  L=$(cat /tmp/numa-maps)
  others=$(tr ' ' '\n' </tmp/numa-maps | grep -E '^N[0-9]+=' | grep -v "^N$NODE=")
  if [ "$(wc -l </tmp/numa-maps)" = 1 ] && echo "$L" | grep -q "bind:$NODE" && echo "$L" | grep -q " N$NODE=512 " && [ -z "$others" ]; then
    result numa-placement ok "$L"
  else
    result numa-placement fail "$L"
  fi
  check lib-import-load "a second process imports the region and loads the pattern" -- fabric-guest-probe importer /tmp/lib-region 0x200000 0x5eed0005
else
  result lib-alloc-store fail "node $NODE: $(cat /tmp/owner.log)"; tail -20 /tmp/fabricd.log
fi
if wait $OWNER; then result lib-owner ok "$(cat /tmp/owner.log)"; else result lib-owner fail "$(cat /tmp/owner.log)"; fi
blob lib-region /tmp/lib-region
grep -i "numa" /tmp/fabricd.log | tail -5
kill $FABRICD_PID 2>/dev/null
