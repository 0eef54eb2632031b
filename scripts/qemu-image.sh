#!/usr/bin/env bash
# Builds the QEMU tier's base guest image from Debian packages only (run scripts/qemu-deps.sh
# first): an initramfs with busybox-static, the 6.12 kernel's CXL/DAX/VFIO, virtio-blk and
# ext4 modules (with their dependencies, decompressed), Debian's `cxl` and `daxctl` with the
# shared libraries they load, and a generic /init.
#
# Output, in the cache (see scripts/qemu-deps.sh):
#   image/vmlinuz       the kernel
#   image/base.cpio.gz  the base initramfs
#   image/stamp         what it was built from; the image is rebuilt when that changes
#
# The project's binaries and each test's script are not in it: the test harness
# (qemu-tests/) appends them per run as a second cpio archive, which the kernel unpacks over
# the first. Prints the image directory last.
set -euo pipefail
cd "$(dirname "$0")/.."

cache=$(scripts/qemu-deps.sh)
kdir="$cache/kernel"
kver=$(basename "$(ls -d "$kdir"/lib/modules/6.12*)")
out="$cache/image"
mkdir -p "$out"

# Modules every guest loads, in this order after their dependencies (built-in ones such as
# cxl_port and intel-iommu need nothing).
# kmem is in the image but not loaded at boot: loaded, it takes every RAM region's DAX
# device and onlines it as System RAM, while the DAX tests map the device itself. The NUMA
# test (qemu-tests/guest/numa.sh) loads it from /etc/fabric-modules-optional in a guest with
# an SRAT: without one the CXL window joins node 0 and QEMU 10.0 under TCG crashes (SIGSEGV
# in access_stq) once the kernel uses that memory (docs/testing.md, "Tier 3").
# virtio_blk and ext4 (with jbd2, mbcache, crc16 and the crc32c its metadata checksums
# load, which modprobe lists as soft dependencies) serve the power-loss test's disks.
# virtio_net (with failover and net_failover) links the two nodes of the domain test to the
# host's loopback etcd (qemu-tests/tests/domain.rs).
modules=(cxl_acpi cxl_pci cxl_mem cxl_pmem dax_cxl device_dax vfio vfio_iommu_type1 vfio_pci virtio_blk ext4 virtio_net)
optional=(kmem)
tools=(/usr/bin/cxl /usr/bin/daxctl)

stamp=$(
  {
    echo "kernel $kver"
    echo "modules ${modules[*]}"
    echo "optional ${optional[*]}"
    sha256sum /bin/busybox "${tools[@]}" "$0" | cut -d' ' -f1
  } | sha256sum | cut -d' ' -f1
)
if [ -f "$out/stamp" ] && [ "$(cat "$out/stamp")" = "$stamp" ] && [ -f "$out/base.cpio.gz" ]; then
  echo "qemu-image: up to date ($out)" >&2
  echo "$out"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/root"
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,run,etc,usr/bin,lib64,lib/x86_64-linux-gnu,fabric} "$root/lib/modules/$kver"

depmod -b "$kdir" "$kver"
: >"$root/etc/fabric-modules"
# -C /dev/null: the host's modprobe.d (ndctl installs an "install libnvdimm" rule) must
# not shape the guest's load order.
for m in "${modules[@]}"; do
  modprobe -C /dev/null -d "$kdir" -S "$kver" --show-depends "$m"
done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' | while read -r ko; do
  rel=${ko#"$kdir/lib/modules/$kver/"}
  rel=${rel%.xz}
  mkdir -p "$root/lib/modules/$kver/$(dirname "$rel")"
  xz -dc "$ko" >"$root/lib/modules/$kver/$rel"
  echo "/lib/modules/$kver/$rel" >>"$root/etc/fabric-modules"
done
[ -s "$root/etc/fabric-modules" ] || { echo "qemu-image: no modules resolved" >&2; exit 1; }
# Optional modules: their own files only (their dependencies are in the boot set above).
: >"$root/etc/fabric-modules-optional"
for m in "${optional[@]}"; do
  ko=$(modprobe -C /dev/null -d "$kdir" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" { p = $2 } END { print p }')
  [ -n "$ko" ] || { echo "qemu-image: optional module $m not found" >&2; exit 1; }
  rel=${ko#"$kdir/lib/modules/$kver/"}
  rel=${rel%.xz}
  mkdir -p "$root/lib/modules/$kver/$(dirname "$rel")"
  xz -dc "$ko" >"$root/lib/modules/$kver/$rel"
  echo "/lib/modules/$kver/$rel" >>"$root/etc/fabric-modules-optional"
done

cp /bin/busybox "$root/bin/busybox"
for t in "${tools[@]}"; do
  cp "$t" "$root/usr/bin/"
  ldd "$t" | awk '/=> \// { print $3 } /^\t\/lib64/ { print $1 }' | while read -r lib; do
    case "$lib" in
      /lib64/*) cp -L "$lib" "$root/lib64/" ;;
      *) cp -L "$lib" "$root/lib/x86_64-linux-gnu/" ;;
    esac
  done
done

cat >"$root/init" <<'EOF'
#!/bin/busybox sh
# Generic guest init (scripts/qemu-image.sh): mount, load modules, run the test's script
# (/fabric/test.sh, from the harness's overlay archive), power off.
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/usr/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
echo "FABRIC-GUEST-BOOTED $(uname -r)"
while read -r ko; do
  insmod "$ko" || echo "FABRIC-GUEST-MODULE-FAILED $ko"
done </etc/fabric-modules
if [ -x /fabric/test.sh ]; then
  /fabric/test.sh
  echo "FABRIC-GUEST-EXIT $?"
else
  echo "FABRIC-GUEST-EXIT 127 no /fabric/test.sh"
fi
sync
poweroff -f
EOF
chmod +x "$root/init"

(cd "$root" && find . -print0 | cpio --null -o -H newc --quiet) | gzip -1 >"$work/base.cpio.gz"
cp "$kdir/boot/vmlinuz-$kver" "$out/vmlinuz"
mv "$work/base.cpio.gz" "$out/base.cpio.gz"
echo "$stamp" >"$out/stamp"
echo "qemu-image: built $out ($(du -h "$out/base.cpio.gz" | cut -f1), kernel $kver)" >&2
echo "$out"
