#!/bin/sh
# Per-region DAX ([memory] dax_per_region): the 2-way region of the CXL test, its first DAX
# device bound to device_dax over the whole region; fabricd takes the DAX region over
# (shrinks that device to 0) and carves a device per region. A libfabric-mm client
# (fabric-guest-probe split) allocates A and B, frees A, allocates C; fabricd is killed and
# restarted with an extra device nobody asked for in the region. Each step's sysfs state goes
# to the host (dax-devices-* blobs: NAME SIZE START END DRIVER per device).
. /fabric/common.sh

DA=$(endpoint_decoder "$(memdev_by_serial 0x1000)"); DB=$(endpoint_decoder "$(memdev_by_serial 0x1001)")
if cxl_ram_region 256 $((512 << 20)) "$DA" "$DB"; then result cxl-region ok "$(cat /tmp/region) committed"; else result cxl-region fail "see the console"; fi
R=$(cat /tmp/region 2>/dev/null)
sleep 1
cxl list -vvv >/tmp/cxl.json 2>/tmp/cxl.err || echo "cxl list: $(cat /tmp/cxl.err)"
blob cxl-list /tmp/cxl.json

SEED=""
for d in /sys/bus/cxl/devices/$R/dax_region*/dax[0-9]*.0; do [ -e "$d" ] && SEED=$(basename "$d"); done
DR=$(readlink -f /sys/bus/dax/devices/$SEED/..)
[ -n "$SEED" ] && echo "$SEED" >/sys/bus/dax/drivers/device_dax/new_id
RSIZE=$(cat $DR/dax_region/size)
if [ -e /sys/bus/dax/devices/$SEED/driver ] && [ "$(cat /sys/bus/dax/devices/$SEED/size)" = "$RSIZE" ]; then
  result dax-seed ok "$SEED bound to device_dax over the whole DAX region ($RSIZE bytes, available $(cat $DR/dax_region/available_size))"
else
  result dax-seed fail "$SEED in $DR"; ls -l $DR
fi

# devices NAME: one line per device of the DAX region: NAME SIZE START END DRIVER.
devices() {
  for d in $DR/dax[0-9]*; do
    n=$(basename "$d")
    drv=-
    [ -e "$d/driver" ] && drv=$(basename "$(readlink -f "$d/driver")")
    echo "$n $(cat "$d/size") $(cat "$d/mapping0/start" 2>/dev/null || echo -) $(cat "$d/mapping0/end" 2>/dev/null || echo -) $drv"
  done >"/tmp/$1"
  blob "$1" "/tmp/$1"
}
size_of() { cat "/sys/bus/dax/devices/$1/size" 2>/dev/null; }
wait_file() { i=0; while [ ! -s "$1" ] && kill -0 $PROBE 2>/dev/null && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done; [ -s "$1" ]; }

FABRICD_EXTRA="[memory]
dax = [\"$SEED\"]
dax_per_region = true"
start_fabricd
if [ "$(size_of $SEED)" = 0 ] && [ ! -e /sys/bus/dax/devices/$SEED/driver ] && [ "$(cat $DR/dax_region/available_size)" = "$RSIZE" ]; then
  result seed-taken-over ok "$SEED unbound and shrunk to 0; all $RSIZE bytes available"
else
  result seed-taken-over fail "$SEED size $(size_of $SEED), available $(cat $DR/dax_region/available_size)"; tail -20 /tmp/fabricd.log
fi
fabricctl map --daemon -o json >/tmp/map.json 2>/tmp/map.err || echo "map: $(cat /tmp/map.err)"
blob fabric-map /tmp/map.json
SET=$(grep -o '"set:cxl-region:[^"]*"' /tmp/map.json | head -1 | sed 's/^"set://; s/"$//')

S=/tmp/split
mkdir -p $S
fabric-guest-probe split "$SET" $S >/tmp/split.log 2>&1 &
PROBE=$!
if wait_file $S/regions; then
  result split-alloc ok "$(cat /tmp/split.log | tr '\n' ';')"
else
  result split-alloc fail "$(cat /tmp/split.log)"; tail -20 /tmp/fabricd.log
fi
blob split-regions $S/regions
devices dax-devices-1
# Each descriptor is its own device, of its region's size.
ok=1
while read -r n dev gfa len off; do
  d=${dev#/dev/}
  [ "$(size_of "$d")" = "$((len))" ] && [ "$off" = 0x0 ] || { ok=0; echo "$n: $dev size $(size_of "$d"), region $len, fd offset $off"; }
done <$S/regions
DEV_A=$(awk '$1 == "A" { print $2 }' $S/regions); DEV_B=$(awk '$1 == "B" { print $2 }' $S/regions)
LEN_A=$(awk '$1 == "A" { print $4 }' $S/regions)
[ -n "$DEV_A" ] && [ "$DEV_A" != "$DEV_B" ] && [ "$DEV_A" != /dev/$SEED ] || ok=0
if [ $ok = 1 ]; then result split-devices ok "A on $DEV_A, B on $DEV_B, each its region's size"; else result split-devices fail "see above"; fi

# Free A: its device goes, its bytes are available again.
AVAIL=$(cat $DR/dax_region/available_size)
touch $S/go-free
wait_file $S/freed
AFTER=$(cat $DR/dax_region/available_size)
if [ ! -e "/sys/bus/dax/devices/${DEV_A#/dev/}" ] && [ "$AFTER" = "$((AVAIL + LEN_A))" ]; then
  result split-free ok "${DEV_A#/dev/} deleted; available $AVAIL -> $AFTER"
else
  result split-free fail "${DEV_A#/dev/} exists: $(ls -d /sys/bus/dax/devices/${DEV_A#/dev/} 2>/dev/null); available $AVAIL -> $AFTER"; tail -20 /tmp/fabricd.log
fi
touch $S/go-realloc
if wait_file $S/c; then result split-realloc ok "$(cat $S/c)"; else result split-realloc fail "$(cat /tmp/split.log)"; fi
blob split-c $S/c
devices dax-devices-2

# A device no region names (as a crash between carve and journal would leave), then a
# crash and restart of fabricd: B's and C's devices are found, the stray one deleted.
echo 1 >$DR/dax_region/create
STRAY=$(cat $DR/dax_region/create)
echo $((2 << 20)) >/sys/bus/dax/devices/$STRAY/size
echo "stray device $STRAY: $(size_of $STRAY) bytes"
kill -9 $FABRICD_PID; wait $FABRICD_PID 2>/dev/null
rm -f /run/fabric/fabricd.sock
mv /tmp/fabricd.log /tmp/fabricd-1.log
start_fabricd
devices dax-devices-3
if [ -n "$STRAY" ] && [ ! -e /sys/bus/dax/devices/$STRAY ] && grep -q "region's DAX device found" /tmp/fabricd.log; then
  result split-restart ok "stray $STRAY deleted; $(grep -c "region's DAX device found" /tmp/fabricd.log) region devices found"
else
  result split-restart fail "stray $STRAY: $(ls -d /sys/bus/dax/devices/$STRAY 2>/dev/null)"; cat /tmp/fabricd.log
fi
touch $S/go-check
if wait $PROBE; then result split-probe ok "$(tail -1 /tmp/split.log)"; else result split-probe fail "$(cat /tmp/split.log)"; fi
kill $FABRICD_PID 2>/dev/null
