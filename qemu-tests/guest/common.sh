# Helpers every guest test script sources (qemu-tests/guest/common.sh; docs/testing.md,
# "Tier 3"). Results go to the console as FABRIC-TEST-RESULT lines; bulk data (JSON) goes to
# the second serial port, framed by FABRIC-BLOB-BEGIN/END lines.
export PATH=/fabric/bin:/bin:/sbin:/usr/bin
stty -F /dev/ttyS1 raw -echo 2>/dev/null

# result NAME ok|fail DETAIL...
# The guest uptime ends each line: where a slow test spends its time.
result() { n=$1; v=$2; shift 2; echo "FABRIC-TEST-RESULT $n $v $* [t=$(cut -d" " -f1 /proc/uptime)s]"; }
# check NAME DETAIL -- COMMAND...: runs COMMAND, reports ok/fail with its exit status.
check() {
  n=$1; d=$2; shift 3
  if "$@"; then result "$n" ok "$d"; else result "$n" fail "$d (exit $?)"; fi
}
# blob NAME FILE: sends FILE on the data port.
blob() {
  { echo "FABRIC-BLOB-BEGIN $1"; cat "$2"; echo; echo "FABRIC-BLOB-END $1"; } >/dev/ttyS1
}
# memdev_by_serial SERIAL: the memdev (mem3) with that serial.
memdev_by_serial() {
  for m in /sys/bus/cxl/devices/mem*; do
    [ "$(cat "$m/serial")" = "$1" ] && { basename "$m"; return; }
  done
}
# endpoint_decoder MEMDEV: decoderN.0 of the endpoint port whose uport is the memdev.
endpoint_decoder() {
  for e in /sys/bus/cxl/devices/endpoint*; do
    [ "$(basename "$(readlink -f "$e/uport")")" = "$1" ] && { echo "decoder${e##*endpoint}.0"; return; }
  done
}
# cxl_ram_region GRANULARITY SIZE DECODER...: a RAM region under decoder0.0 over the
# endpoint decoders in position order (each gives SIZE / ways), created, committed and bound
# through sysfs (binding the region driver brings up its DAX region); its name goes to
# /tmp/region. Returns non-zero, with the failing write on the console, if a step fails.
cxl_ram_region() {
  g=$1; size=$2; shift 2
  cxl_wr() { echo "$2" >"$1" || { echo "writing $2 to $1 failed"; return 1; }; }
  root=/sys/bus/cxl/devices/decoder0.0
  R=$(cat $root/create_ram_region) || return 1
  cxl_wr $root/create_ram_region "$R" || return 1
  r=/sys/bus/cxl/devices/$R
  cxl_wr $r/interleave_granularity "$g" || return 1
  cxl_wr $r/interleave_ways $# || return 1
  for d in "$@"; do
    cxl_wr /sys/bus/cxl/devices/$d/mode ram || return 1
    cxl_wr /sys/bus/cxl/devices/$d/dpa_size $((size / $#)) || return 1
  done
  cxl_wr $r/size "$size" || return 1
  i=0
  for d in "$@"; do cxl_wr $r/target$i "$d" || return 1; i=$((i + 1)); done
  cxl_wr $r/commit 1 || return 1
  cxl_wr /sys/bus/cxl/drivers/cxl_region/bind "$R" || return 1
  echo "$R" >/tmp/region
}
# start_fabricd: the daemon on the live sysfs, its socket in /run/fabric; waits for it.
# $FABRICD_EXTRA (TOML) is appended to its configuration.
start_fabricd() {
  mkdir -p /run/fabric /tmp/fabric-state
  ip link set lo up 2>/dev/null
  cat >/tmp/fabricd.toml <<EOT
[socket]
path = "/run/fabric/fabricd.sock"
[state]
dir = "/tmp/fabric-state"
[discovery]
sysfs_root = "/"
backends = ["pci", "cxl"]
rescan_interval_s = 0
uevents = "on"
[metrics]
listen = ""
${FABRICD_EXTRA:-}
EOT
  fabricd --config /tmp/fabricd.toml >/tmp/fabricd.log 2>&1 &
  FABRICD_PID=$!
  i=0
  while [ ! -S /run/fabric/fabricd.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
  if [ -S /run/fabric/fabricd.sock ]; then
    result fabricd-start ok "pid $FABRICD_PID"
  else
    result fabricd-start fail "no socket after 30 s"; cat /tmp/fabricd.log
  fi
  export FABRIC_SOCKET=/run/fabric/fabricd.sock
}
