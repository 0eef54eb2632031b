#!/bin/sh
# Power loss of the memory registry: fabricd's state directory is an ext4 file system on a
# virtio disk (/dev/vda at /state), the sim device memory (region files) a second one
# (/dev/vdb at /state/memory), so that an fsync of the journal does not carry the region
# files' metadata along with it. /fabric/power.env (from the host) says which boot this is.
#
# Every boot but the first: fabricd replays its journal, and `fabric-guest-probe
# power-observe` reports what the registry and the disks hold (blob "observed") for the host
# to compare with what earlier boots acknowledged. Every boot but the last: the workload
# changes the registry and prints each acknowledged change on the data port until the host
# cuts the power (SIGKILL of QEMU). The last boot stops fabricd and unmounts cleanly; the
# host then runs e2fsck on both images.
#
# fabricd runs in a pid namespace of its own (unshare -p -f): it cannot see its clients'
# pids, so it cannot tell that their processes died with the power, and keeps their regions
# for memory.resume_grace_s (an hour here) instead of reclaiming them at start (docs/fabricd.md,
# "Ownership after a restart"). That is what lets the next boot check every region.
. /fabric/common.sh
. /fabric/power.env

mkdir -p /state
if ! mount -t ext4 /dev/vda /state; then result disks fail "mount /dev/vda"; exit 0; fi
mkdir -p /state/memory
if ! mount -t ext4 /dev/vdb /state/memory; then result disks fail "mount /dev/vdb"; exit 0; fi
result disks ok "$(grep -c ' ext4 ' /proc/mounts) ext4 mounts; $(dmesg | grep -c 'recovery complete') journal recoveries"

mkdir -p /run/fabric
ip link set lo up 2>/dev/null
cat >/tmp/fabricd.toml <<EOT
[socket]
path = "/run/fabric/fabricd.sock"
[state]
dir = "/state"
[discovery]
sim = ["/fabric/cxl-pool.toml"]
rescan_interval_s = 0
uevents = "off"
[memory]
resume_grace_s = 3600
[metrics]
listen = ""
EOT
unshare -p -f fabricd --config /tmp/fabricd.toml >/tmp/fabricd.log 2>&1 &
i=0
while [ ! -S /run/fabric/fabricd.sock ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
if [ -S /run/fabric/fabricd.sock ]; then
  result fabricd-start ok "$(grep -o 'memory registry restored.*' /tmp/fabricd.log | head -c 300)"
else
  result fabricd-start fail "no socket after 60 s: $(tail -5 /tmp/fabricd.log)"
  exit 0
fi
export FABRIC_SOCKET=/run/fabric/fabricd.sock

if [ "$PHASE" != first ]; then
  check power-observe "the registry after the power loss" -- \
    fabric-guest-probe power-observe /state/memory /fabric/power-handles /tmp/observed.json
  blob observed /tmp/observed.json
  grep -E 'torn write|interrupted journal' /tmp/fabricd.log >/tmp/replay.txt
  blob journal-replay /tmp/replay.txt
fi

if [ "$PHASE" = last ]; then
  pid=$(pidof fabricd)
  kill $pid
  i=0
  while kill -0 $pid 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  if umount /state/memory && umount /state; then result clean-unmount ok; else result clean-unmount fail "$(cat /proc/mounts)"; fi
  exit 0
fi

# Runs until the host cuts the power; returning at all is a failure.
fabric-guest-probe power-workload /dev/ttyS1 "$TOKEN" "$SEED" >/tmp/workload.log 2>&1
result power-workload fail "$(cat /tmp/workload.log)"
tail -20 /tmp/fabricd.log
