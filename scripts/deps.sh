#!/usr/bin/env bash
# Installs the Debian packages the test tiers use, when running as root on Debian.
# Idempotent: packages already present are left alone. Without root it only reports.
set -euo pipefail

# Package -> a command it provides (what we check for).
declare -A WANT=(
  [hwloc]=lstopo-no-graphics   # tier 1: compare PCI discovery with hwloc on the live host
  [graphviz]=dot               # tier 1: check that `fabricctl topology -o dot` parses
  [hyperfine]=hyperfine        # benchmarks: whole-process timing side by side
  [prometheus]=promtool        # fabricd tests: `promtool check metrics` on the metrics page
  [pkgconf]=pkg-config          # libfabric-mm tests: build the C examples through fabric-mm.pc
)

missing=()
for pkg in "${!WANT[@]}"; do
  command -v "${WANT[$pkg]}" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all present"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "deps: missing ${missing[*]} (run as root on Debian to install; tests that need them skip with a message)"
  exit 0
fi
echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
