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
# start_fabricd: the daemon on the live sysfs, its socket in /run/fabric; waits for it.
# FABRICD_EXTRA, when set, is appended to its config (e.g. a [memory] table).
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
