#!/usr/bin/env bash
# Installs what the QEMU tier (tier 3) needs, from Debian packages only, and unpacks the
# guest kernel into the cache:
#
#   qemu-system-x86 (10.x) and linux-image-amd64 (6.12) from <codename>-backports,
#   busybox-static, ndctl (cxl), daxctl, kmod (depmod), xz-utils, cpio (the base initramfs),
#   e2fsprogs (mkfs.ext4 and e2fsck for the power-loss test's disk images) from the base suite.
#
# The backports suite is added by deriving it from the machine's own Debian source entry
# (deb822 *.sources or one-line sources.list): same URIs, components and Signed-By, suite
# <codename>-backports. No mirror host name is written here.
#
# The kernel package is downloaded into the cache and unpacked there (it is not installed
# on the host). Cache: $FABRIC_QEMU_CACHE, else /var/cache/fabric-qemu as root, else
# ${XDG_CACHE_HOME:-~/.cache}/fabric-qemu. Idempotent; prints the cache path last.
#
# Exit status: 0 when everything is in place; 1 when something is missing and cannot be
# installed (not root, no apt-get) or an install fails — the tier then fails, never skips.
set -euo pipefail

cache="${FABRIC_QEMU_CACHE:-}"
if [ -z "$cache" ]; then
  if [ "$(id -u)" -eq 0 ]; then cache=/var/cache/fabric-qemu; else cache="${XDG_CACHE_HOME:-$HOME/.cache}/fabric-qemu"; fi
fi
mkdir -p "$cache/debs"

log() { printf 'qemu-deps: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck disable=SC1091
. /etc/os-release
codename="${VERSION_CODENAME:?/etc/os-release has no VERSION_CODENAME}"
bpo="$codename-backports"
list=/etc/apt/sources.list.d/fabric-backports.sources

# The first deb822 stanza (or one-line entry) that serves $codename itself, rewritten for
# the backports suite.
derive_backports() {
  local f stanza
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] || continue
    [ "$f" = "$list" ] && continue
    stanza=$(awk -v want="$codename" 'BEGIN { RS = ""; FS = "\n" }
      {
        deb = 0; hit = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^Types:/ && $i ~ /(^|[ \t])deb([ \t]|$)/) deb = 1
          if ($i ~ /^Suites:/) { n = split(substr($i, 8), s, /[ \t]+/); for (j = 1; j <= n; j++) if (s[j] == want) hit = 1 }
          if ($i ~ /^Enabled:[ \t]*no/) deb = 0
        }
        if (deb && hit) { print; exit }
      }' "$f")
    if [ -n "$stanza" ]; then
      printf '# Derived by scripts/qemu-deps.sh from %s: the same entry, suite %s.\n' "$f" "$bpo"
      printf '%s\n' "$stanza" | grep -v '^#' | sed -e "s/^Suites:.*/Suites: $bpo/" -e 's/^Types:.*/Types: deb/'
      return 0
    fi
  done
  # One-line format: "deb [opts] URI codename components".
  local line
  line=$(grep -hE "^deb[ \t]+(\[[^]]*\][ \t]+)?[^ \t]+[ \t]+$codename[ \t]" /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1 || true)
  if [ -n "$line" ]; then
    local opts="" rest uri comps
    if [[ "$line" =~ ^deb[[:space:]]+\[([^]]*)\][[:space:]]+(.*)$ ]]; then opts="${BASH_REMATCH[1]}"; rest="${BASH_REMATCH[2]}"; else rest="${line#deb }"; fi
    read -r uri _ comps <<<"$rest"
    printf '# Derived by scripts/qemu-deps.sh from a one-line entry: the same entry, suite %s.\n' "$bpo"
    printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: %s\n' "$uri" "$bpo" "$comps"
    if [[ "$opts" =~ signed-by=([^[:space:]]+) ]]; then printf 'Signed-By: %s\n' "${BASH_REMATCH[1]}"; fi
    return 0
  fi
  return 1
}

qemu_ok() {
  command -v qemu-system-x86_64 >/dev/null 2>&1 || return 1
  local v
  v=$(qemu-system-x86_64 --version | sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p')
  [ "${v:-0}" -ge 10 ]
}
kernel_ok() { compgen -G "$cache/kernel/boot/vmlinuz-6.12*" >/dev/null; }
tools_ok() {
  [ -x /bin/busybox ] && file_static /bin/busybox && command -v cxl >/dev/null && command -v daxctl >/dev/null && command -v depmod >/dev/null && command -v xz >/dev/null && command -v cpio >/dev/null \
    && command -v mkfs.ext4 >/dev/null && command -v e2fsck >/dev/null && command -v etcd >/dev/null
}
file_static() { ! ldd "$1" >/dev/null 2>&1; }

if qemu_ok && kernel_ok && tools_ok; then
  log "all present"
  echo "$cache"
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "missing packages; run as root on Debian (qemu-system-x86 10.x, busybox-static, ndctl, daxctl, kmod, xz-utils, e2fsprogs, etcd-server, the 6.12 kernel in $cache)"
command -v apt-get >/dev/null || die "no apt-get: the QEMU tier needs a Debian machine"

export DEBIAN_FRONTEND=noninteractive
if [ ! -e "$list" ]; then
  entry=$(derive_backports) || die "no Debian source entry for $codename to derive $bpo from"
  printf '%s\n' "$entry" >"$list"
  log "added $bpo ($list)"
fi
apt-get update -qq || die "apt-get update failed"

if ! qemu_ok; then
  log "installing qemu-system-x86 from $bpo"
  apt-get install -y -qq --no-install-recommends -t "$bpo" qemu-system-x86 >/dev/null || die "installing qemu-system-x86 from $bpo failed"
  qemu_ok || die "qemu-system-x86_64 is not 10.x after the install"
fi
if ! tools_ok; then
  # etcd-server: the two-host domain test runs etcd inside one of its guests.
  log "installing busybox-static ndctl daxctl kmod xz-utils cpio e2fsprogs etcd-server"
  apt-get install -y -qq --no-install-recommends busybox-static ndctl daxctl kmod xz-utils cpio e2fsprogs etcd-server >/dev/null || die "installing busybox-static ndctl daxctl kmod xz-utils cpio e2fsprogs etcd-server failed"
fi

if ! kernel_ok; then
  # linux-image-amd64 from backports names the 6.12 image package it depends on.
  image=$(apt-cache depends "linux-image-amd64/$bpo" 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-6\.12[^ ]*\)$/\1/p' | head -n1)
  [ -n "$image" ] || die "linux-image-amd64 in $bpo does not name a 6.12 image"
  log "downloading $image from $bpo"
  (cd "$cache/debs" && apt-get download -qq -o APT::Sandbox::User=root "$image/$bpo") || die "downloading $image failed"
  deb=$(ls -t "$cache/debs/${image}_"*.deb | head -n1)
  rm -rf "$cache/kernel.tmp"
  dpkg-deb -x "$deb" "$cache/kernel.tmp" || die "unpacking $deb failed"
  rm -rf "$cache/kernel"
  mv "$cache/kernel.tmp" "$cache/kernel"
  kernel_ok || die "$deb has no boot/vmlinuz-6.12*"
fi

log "ready: $(qemu-system-x86_64 --version | head -n1); kernel $(basename "$(ls "$cache"/kernel/boot/vmlinuz-6.12*)")"
echo "$cache"
