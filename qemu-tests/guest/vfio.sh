#!/bin/sh
# VFIO under the emulated intel-iommu: edu bound to vfio-pci, a DMA round trip through the
# type-1 container at IOVAs inside edu's 28-bit mask, and after unmapping, a DMA to that
# IOVA blocked by the IOMMU with the fault in the kernel log. Driven by fabric-guest-probe:
# fabricd has no VFIO backend yet (docs/testing.md, "Tier 3").
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
echo vfio-pci >"$DEV/driver_override"
echo "$BDF" >/sys/bus/pci/drivers_probe
if [ "$(basename "$(readlink -f "$DEV/driver")")" = vfio-pci ] && [ -c "/dev/vfio/$GROUP" ]; then
  result vfio-bind ok "/dev/vfio/$GROUP"
else
  result vfio-bind fail "driver $(readlink "$DEV/driver")"; exit 0
fi
start_fabricd
fabricctl topology --daemon -o json >/tmp/topo.json && result fabric-topology ok
blob topology /tmp/topo.json
echo "$BDF $GROUP" >/tmp/edu && blob edu /tmp/edu
kill $FABRICD_PID 2>/dev/null
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
