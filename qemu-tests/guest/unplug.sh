#!/bin/sh
# Hot-unplug: fabricd runs with a client subscribed to its events; the host removes the
# volatile CXL device with serial 0x1002 (QMP device_del); the kernel drops it; fabricd must
# notice, drop it from the topology, update the map, tell the client and keep serving.
. /fabric/common.sh
start_fabricd
fabric-guest-probe watch /run/fabric/fabricd.sock >/tmp/events.log 2>&1 &
WATCH=$!
i=0; while ! grep -q subscribed /tmp/events.log && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
fabricctl topology --daemon -o json >/tmp/before.json && blob topology-before /tmp/before.json
fabricctl map --daemon -o json >/tmp/map-before.json && blob map-before /tmp/map-before.json
# The PCI function under the memdev: its removal is the last step of the slot's power-off.
for m in /sys/bus/cxl/devices/mem*; do
  [ "$(cat "$m/serial")" = 0x1002 ] && BDF=$(basename "$(dirname "$(readlink -f "$m")")")
done
echo "unplugging the memdev at $BDF"
echo "FABRIC-READY-FOR-UNPLUG"

present() { for m in /sys/bus/cxl/devices/mem*; do [ "$(cat "$m/serial" 2>/dev/null)" = 0x1002 ] && return 0; done; return 1; }
i=0; while present && [ $i -lt 900 ]; do sleep 0.1; i=$((i + 1)); done
if present; then result kernel-unplug fail "memdev 0x1002 still present after 90 s"; else result kernel-unplug ok "gone after ~$((i / 10)) s"; fi

i=0
while [ $i -lt 300 ]; do
  if fabricctl topology --daemon -o json >/tmp/after.json 2>/tmp/after.err && ! grep -q 'serial:cxl/0x1002' /tmp/after.json; then break; fi
  sleep 0.1; i=$((i + 1))
done
if grep -q 'serial:cxl/0x1002' /tmp/after.json; then result fabric-noticed fail "still in the topology after 30 s"; else result fabric-noticed ok "~$((i / 10)) s after the kernel"; fi
blob topology-after /tmp/after.json
fabricctl map --daemon -o json >/tmp/map-after.json && blob map-after /tmp/map-after.json
sleep 1
i=0; while [ -e "/sys/bus/pci/devices/$BDF" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
if fabricctl status --daemon /run/fabric/fabricd.sock -o json >/tmp/status.json 2>&1 && kill -0 $FABRICD_PID; then result daemon-serving ok; else result daemon-serving fail "$(cat /tmp/status.json)"; fi
blob status /tmp/status.json
kill $WATCH 2>/dev/null
cat /tmp/events.log
kill $FABRICD_PID 2>/dev/null
