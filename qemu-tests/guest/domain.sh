#!/bin/sh
# Two hosts of one domain sharing one CXL type-3 device (qemu-tests/src/twohost.rs): both
# guests' devices are backed by the same host file. Each guest commits a 1-way region over
# its device and hands the DAX device to fabricd, which joins the domain "shared-cxl"
# through etcd on guest A over the private link, with a node-link certificate from the
# host's test CA; each claims its share of the shared device (`[[memory.shares]]`). A's
# client allocates a region on the set (in A's share) and stores a pattern; B finds
# A's GFA in its domain map (node a, the set, the offset), and B's client imports A's
# handle: B's fabricd asks A over the node link, A grants the region's place in the set
# of the shared device, and B's fabricd hands its client B's own DAX device at that place;
# the client loads A's bytes and stores its own. A then imports its region through its
# fabricd and loads B's bytes. The host checks the shared file at the same offset (the DPA).
# Each host's domain topology has both hosts and the shared device once, of no node.
#
# With /fabric/per-region (the per-region variant) both fabricds give each region a DAX
# device of its own ([memory] dax_per_region): B's fabricd carves one at A's region for the
# import. B then holds a second import mapped while A frees the region, B's fabricd
# stopped (SIGSTOP) meanwhile: A keeps the region's DPAs quarantined for B (B's device over
# them still maps them) until B, resumed, deletes that device and acknowledges; the
# holder's next load faults (SIGBUS); no device is left behind.
. /fabric/common.sh
. /fabric/node.env
LEN=0x800000
SEED_A=0x5eed00a1
SEED_B=0x5eed00b2
PER_REGION=""
[ -e /fabric/per-region ] && PER_REGION="dax_per_region = true"

ip link set lo up
ip addr add "$ME/24" dev eth0 && ip link set eth0 up && result link ok "$ME on eth0" || result link fail "$(ip addr 2>&1)"

MEM=$(memdev_by_serial "$SERIAL"); DEC=$(endpoint_decoder "$MEM")
if cxl_ram_region 256 $((256 << 20)) "$DEC"; then result cxl-region ok "$(cat /tmp/region) over $MEM"; else result cxl-region fail "see the console"; fi
R=$(cat /tmp/region 2>/dev/null)
sleep 1
DAX=""
for d in /sys/bus/cxl/devices/$R/dax_region*/dax[0-9]*; do [ -e "$d" ] && DAX=$(basename "$d"); done
[ -n "$DAX" ] && [ ! -e /sys/bus/dax/devices/$DAX/driver ] && echo "$DAX" >/sys/bus/dax/drivers/device_dax/new_id
if [ -n "$DAX" ] && [ -c "/dev/$DAX" ]; then result dax-device ok "/dev/$DAX"; else result dax-device fail "region $R has no DAX device"; fi

# waitfor SECONDS COMMAND...: retries COMMAND every 0.5 s.
waitfor() {
  t=$(($1 * 2)); shift
  while ! "$@" >/dev/null 2>&1; do t=$((t - 1)); [ $t -gt 0 ] || return 1; sleep 0.5; done
}
# (busybox's static wget crashes here: a plain HTTP/1.0 GET through nc instead.)
health() { printf 'GET /health HTTP/1.0\r\n\r\n' | nc -w 3 "$ETCD" 2379 | grep -q '"health":"true"'; }
if [ "$NODE" = a ]; then
  chmod +x /fabric/etcd
  /fabric/etcd --name a --data-dir /tmp/etcd \
    --listen-client-urls "http://$ME:2379" --advertise-client-urls "http://$ME:2379" \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster a=http://127.0.0.1:2380 >/tmp/etcd.log 2>&1 &
fi
if waitfor 180 health; then result etcd ok "http://$ETCD:2379 healthy"; else result etcd fail "no healthy etcd at $ETCD"; tail -20 /tmp/etcd.log 2>/dev/null; fi

# Each host claims its share of the shared device in the domain: 64 MiB of its 256.
FABRICD_EXTRA="[memory]
dax = [\"$DAX\"]
$PER_REGION
[[memory.shares]]
device = \"serial:cxl/$SERIAL\"
bytes = 67108864
[map]
node_span = { fixed = 1099511627776 }
[domain]
name = \"shared-cxl\"
endpoints = [\"http://$ETCD:2379\"]
node = \"$NODE\"
lease_ttl_secs = 20
[peer]
address = \"$ME:7471\"
ca = \"/fabric/ca.pem\"
cert = \"/fabric/node.pem\"
key = \"/fabric/node.key\"
shared_identities = true"
start_fabricd
both() { fabricctl domain nodes -o json >/tmp/nodes.json && [ "$(grep -c '"state": "live"' /tmp/nodes.json)" = 2 ] && ! grep -q '"ranges": 0' /tmp/nodes.json; }
if waitfor 180 both; then result domain-joined ok "a and b live with placements"; else result domain-joined fail "$(cat /tmp/nodes.json)"; tail -30 /tmp/fabricd.log; fi
blob domain-nodes /tmp/nodes.json
fabricctl domain status -o json >/tmp/status.json 2>&1 && grep -q '"shares"' /tmp/status.json && result share ok "$(tr -d ' \n' </tmp/status.json | grep -o '"shares":\[[^]]*\]')" || result share fail "$(cat /tmp/status.json)"
blob domain-status /tmp/status.json
fabricctl map --daemon -o json >/tmp/map.json 2>&1 && result fabric-map ok || result fabric-map fail "$(cat /tmp/map.json)"
blob fabric-map /tmp/map.json
# The domain's topology: both hosts, the device they share once (the pool's, no node's).
topo() { fabricctl topology --daemon -o json >/tmp/topology.json 2>&1 && tr -d ' \n' </tmp/topology.json | grep -q '"nodes":\["a","b"\]'; }
if waitfor 60 topo; then result domain-topology ok "a and b merged"; else result domain-topology fail "$(head -c 3000 /tmp/topology.json)"; fi
blob domain-topology /tmp/topology.json

# libfabric-mm's clients of a domain node mirror this node's span (slot x node_span) by
# default, and another node's span once they map its memory: no window to set here.
SLOT=$(fabricctl domain status -o json | tr -d ' \n' | grep -o '"self":{[^}]*}' | grep -o '"slot":[0-9]*' | cut -d: -f2)
result slot ok "slot $SLOT: the clients' window mirrors GFA $((SLOT << 40)) on"
if [ "$NODE" = a ]; then
  SET=$(grep -o '"set:cxl-region:[^"]*"' /tmp/map.json | head -1 | sed 's/^"set://; s/"$//')
  fabric-guest-probe owner "set:$SET" $LEN $SEED_A /tmp/lib-region >/tmp/owner.log 2>&1 &
  OWNER=$!
  if waitfor 60 test -s /tmp/lib-region; then result lib-alloc-store ok "set $SET: $(cat /tmp/lib-region)"; else result lib-alloc-store fail "$(cat /tmp/owner.log)"; fi
  blob lib-region /tmp/lib-region
  # Hand the region's line to B over the link, then wait for B's stores.
  nc -l -p 7000 </tmp/lib-region &
  if nc -l -p 7001 >/tmp/b-done && grep -q stored /tmp/b-done; then result b-stored ok "$(cat /tmp/b-done)"; else result b-stored fail "B said: $(cat /tmp/b-done)"; fi
  # B's stores, loaded through A's fabricd: a local import of A's region (this also ends the owner).
  check a-loads-b "A imports its region and loads B's pattern" -- fabric-guest-probe importer /tmp/lib-region $LEN $SEED_B
  if wait $OWNER; then result lib-owner ok "$(cat /tmp/owner.log)"; else result lib-owner fail "$(cat /tmp/owner.log)"; fi
  # The region is freed; B is told over the node link. Etcd and this node stay up until B
  # has seen its holder end.
  # (at most 120 s: a B that failed before telling must not hold A to the guest's timeout)
  if [ -n "$PER_REGION" ]; then
    # B's fabricd is stopped: its device over the region's DPAs may still map them, so
    # they stay out of reuse until B acknowledges.
    quarantine() { fabricctl domain status -o json | tr -d ' \n' | grep -o '"quarantine":\[[^]]*\]'; }
    held_for_b() { quarantine >/tmp/quarantine && grep -q '"node":"b"' /tmp/quarantine; }
    if waitfor 15 held_for_b; then result a-quarantine ok "$(cat /tmp/quarantine)"; else result a-quarantine fail "$(fabricctl domain status -o json 2>&1 | tail -20)"; fi
    tell_resume() { echo resume | nc "$PEER" 7003; }
    waitfor 30 tell_resume
    if command -v timeout >/dev/null; then timeout 120 nc -l -p 7002 >/tmp/b-final; else nc -l -p 7002 >/tmp/b-final; fi
    lifted() { ! quarantine | grep -q '"node":"b"'; }
    if waitfor 30 lifted; then result a-quarantine-lifted ok "B acknowledged: the range is free again"; else result a-quarantine-lifted fail "$(quarantine)"; fi
  fi
else
  fetch() { nc "$PEER" 7000 >/tmp/lib-region && test -s /tmp/lib-region; }
  if waitfor 240 fetch; then result region-line ok "$(cat /tmp/lib-region)"; else result region-line fail "nothing from $PEER:7000"; fi
  GFA=$(cut -d' ' -f2 /tmp/lib-region)
  fabricctl map translate "$GFA" --daemon -o json >/tmp/translate.json 2>&1 && result translate ok "$GFA" || result translate fail "$(cat /tmp/translate.json)"
  blob translate /tmp/translate.json
  OFF=$(grep -o '"offset": "[^"]*"' /tmp/translate.json | cut -d'"' -f4)
  # The same import call as for a local handle: through B's fabricd, A's grant, B's own DAX device.
  if fabric-guest-probe importer /tmp/lib-region $LEN $SEED_A $SEED_B >/tmp/b-imports.out 2>&1; then
    result b-imports ok "B imports A's region, loads A's pattern and stores its own: $(cat /tmp/b-imports.out)"
  else
    result b-imports fail "$(cat /tmp/b-imports.out)"
  fi
  # Another host's region on shared CXL memory: the grant says this host's caches are not
  # kept coherent with it (protocol 1.9), so the probe's flush and invalidate did the work.
  if grep -q "not coherent" /tmp/b-imports.out; then result b-not-coherent ok "$(cat /tmp/b-imports.out)"; else result b-not-coherent fail "$(cat /tmp/b-imports.out)"; fi
  grep 'node link: import\|shared CXL\|imported another node' /tmp/fabricd.log | tail -3 >/tmp/b-import.log
  blob b-import-log /tmp/b-import.log
  if [ -n "$PER_REGION" ]; then
    # A second import, held mapped while A frees the region (A does when told we stored).
    fabric-guest-probe hold /tmp/lib-region $LEN $SEED_B /tmp/held 60 >/tmp/hold.log 2>&1 &
    HOLD=$!
    if waitfor 30 test -s /tmp/held; then result b-holds ok "an import of A's region mapped on B"; else result b-holds fail "$(cat /tmp/hold.log)"; fi
  fi
  # Per region: B's fabricd does not answer while A frees the region (A must not reuse
  # its DPAs meanwhile); resumed once A has seen so.
  [ -n "$PER_REGION" ] && kill -STOP $FABRICD_PID
  echo "stored $LEN bytes at $OFF" | nc "$PEER" 7001
  if [ -n "$PER_REGION" ]; then
    if command -v timeout >/dev/null; then timeout 60 nc -l -p 7003 >/tmp/resume; else nc -l -p 7003 >/tmp/resume; fi
    kill -CONT $FABRICD_PID
    # 135 = 128 + SIGBUS: the load after B's fabricd deleted the import's DAX device (the
    # holder keeps revoked mappings: no library fence comes first).
    wait $HOLD; rc=$?
    if [ "$rc" = 135 ]; then result b-revoked ok "the holder's load faulted (SIGBUS) after A freed the region"; else result b-revoked fail "holder exit $rc: $(cat /tmp/hold.log)"; fi
    carved() { ls -d /sys/bus/cxl/devices/$R/dax_region*/dax[0-9]*.[0-9]* 2>/dev/null | grep -v '\.0$'; }
    no_carved() { [ -n "$R" ] && ! carved >/dev/null; }
    if waitfor 10 no_carved; then result b-device-gone ok "no DAX device of an import left on B"; else result b-device-gone fail "left: $(carved | tr '\n' ' ')"; fi
    grep 'DAX device\|revoked\|revocation' /tmp/fabricd.log | tail -8 >/tmp/b-devices.log
    blob b-devices-log /tmp/b-devices.log
    tell_done() { echo done | nc "$PEER" 7002; }
    waitfor 30 tell_done
  fi
  # Stay a member until A is done with the domain map.
  sleep 2
fi
kill $FABRICD_PID 2>/dev/null
