#!/bin/sh
# VFIO under the emulated intel-iommu, driven by fabricd and libfabric-mm: fabricd takes edu
# (dma.vfio), binds it to vfio-pci and attaches its group to its own type-1 container; a
# libfabric-mm client registers two host buffers for edu (mapped at IOVAs inside edu's
# 28-bit mask) and copies between them through the copy API, which fabricd runs on edu's
# DMA engine (RAM -> edu -> RAM). After the destination is unregistered a copy to it is
# refused, and fabricd's unmap check (dma.vfio_verify_unmap, a test hook) DMAs to the
# unmapped IOVA in its container: the IOMMU must block it and the kernel log the fault.
# Then, with fabricd gone, fabric-guest-probe drives the same device through a container
# of its own (the kernel-level baseline).
. /fabric/common.sh
DEV=""
for d in /sys/bus/pci/devices/*; do
  [ "$(cat "$d/vendor")" = 0x1234 ] && [ "$(cat "$d/device")" = 0x11e8 ] && DEV=$d
done
[ -n "$DEV" ] || { result edu-device fail "no 1234:11e8 function"; exit 0; }
BDF=$(basename "$DEV")
if [ -e "$DEV/iommu_group" ]; then
  GROUP=$(basename "$(readlink -f "$DEV/iommu_group")")
  result iommu-group ok "$BDF in group $GROUP"
else
  result iommu-group fail "$BDF has no IOMMU group (is intel_iommu on?)"; dmesg | grep -i -e dmar -e iommu | head -20; exit 0
fi
FABRICD_EXTRA="[dma]
vfio = [\"$BDF\"]
vfio_verify_unmap = true"
start_fabricd
if [ "$(basename "$(readlink -f "$DEV/driver")")" = vfio-pci ] && grep -q "VFIO device open.*engine=true" /tmp/fabricd.log; then
  result vfio-bind ok "fabricd bound $BDF to vfio-pci and opened group $GROUP with edu's engine"
else
  result vfio-bind fail "driver $(readlink "$DEV/driver")"; cat /tmp/fabricd.log; exit 0
fi
fabricctl topology --daemon -o json >/tmp/topo.json && result fabric-topology ok
blob topology /tmp/topo.json
echo "$BDF $GROUP" >/tmp/edu && blob edu /tmp/edu
dmesg >/tmp/dmesg-before
fabric-guest-probe mm-edu "$BDF" >/tmp/mm.out 2>&1
rc=$?
cat /tmp/mm.out
if [ $rc = 0 ]; then result vfio-mm ok "libfabric-mm round trip through fabricd"; else result vfio-mm fail "exit $rc"; fi
IOVA=$(sed -n 's/^unregistered-iova //p' /tmp/mm.out)
# edu, not an engine thread, moved the bytes between the two registrations' IOVAs.
set -- $(sed -n 's/^registered-iovas //p' /tmp/mm.out)
if [ $# = 2 ] && grep -q "device DMA copy done.*src=$1 dst=$2 len=8192" /tmp/fabricd.log; then
  result vfio-engine-copy ok "$(grep 'device DMA copy done' /tmp/fabricd.log | head -n1)"
else
  result vfio-engine-copy fail "fabricd logged no device DMA copy from '$1' to '$2'"
fi
i=0
while ! grep -q "unmap verified.*iova=$IOVA " /tmp/fabricd.log && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
if [ -n "$IOVA" ] && grep -q "unmap verified.*iova=$IOVA " /tmp/fabricd.log; then
  result vfio-unmap-verified ok "$(grep "unmap verified.*iova=$IOVA " /tmp/fabricd.log | head -n1)"
else
  result vfio-unmap-verified fail "no unmap check for IOVA '$IOVA'"; grep -i -e vfio -e unmap /tmp/fabricd.log
fi
kill $FABRICD_PID 2>/dev/null
wait $FABRICD_PID 2>/dev/null
blob fabricd-log /tmp/fabricd.log
dmesg | tail -n +"$(($(wc -l </tmp/dmesg-before) + 1))" >/tmp/dmesg-mm
if [ -n "$IOVA" ] && grep -q -i "DMAR.*fault addr $IOVA " /tmp/dmesg-mm; then
  result fabricd-fault-in-kernel-log ok "$(grep -i "fault addr $IOVA " /tmp/dmesg-mm | head -n1)"
else
  result fabricd-fault-in-kernel-log fail "no DMAR fault for '$IOVA' in the kernel log"
fi

# The baseline: a container of the probe's own, now that fabricd has let the group go.
dmesg >/tmp/dmesg-before
check vfio-probe "edu DMA through VFIO" -- fabric-guest-probe edu-dma "$BDF" "$GROUP"
sleep 1
dmesg | tail -n +"$(($(wc -l </tmp/dmesg-before) + 1))" >/tmp/dmesg-after
blob kernel-log-after /tmp/dmesg-after
if grep -q -i "DMAR.*fault addr 0x200000" /tmp/dmesg-after; then
  result iommu-fault-reported ok "$(grep -i 'fault addr 0x200000' /tmp/dmesg-after | head -n1)"
else
  result iommu-fault-reported fail "no DMAR fault for 0x200000 in the kernel log"
fi
