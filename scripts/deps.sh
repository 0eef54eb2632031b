#!/usr/bin/env bash
# Installs the Debian packages the test tiers use, when running as root on Debian.
# Idempotent: packages already present are left alone. Without root it only reports.
set -euo pipefail

# Package -> a command it provides, or an absolute path of a file it installs (what we check for).
declare -A WANT=(
  [hwloc]=lstopo-no-graphics   # tier 1: compare PCI discovery with hwloc on the live host
  [graphviz]=dot               # tier 1: check that `fabricctl topology -o dot` parses
  [hyperfine]=hyperfine        # benchmarks: whole-process timing side by side
  [prometheus]=promtool        # fabricd tests: `promtool check metrics` on the metrics page
  [pkgconf]=pkg-config          # libfabric-mm tests: build the C examples through fabric-mm.pc
  [etcd-server]=etcd           # domain tests: each test starts its own private etcd
  [etcd-client]=etcdctl        # domain: inspect a private etcd by hand
  [iptables]=/usr/sbin/iptables  # domain fault tests: cut a node's namespace off from etcd
  [iproute2]=/usr/sbin/ip        # domain fault tests: the network namespaces and their links
  [protobuf-compiler]=protoc   # builds etcd's protos for the etcd-client crate (fabric-domain)
  [libprotobuf-dev]=/usr/include/google/protobuf/descriptor.proto  # the protos etcd's import
)

missing=()
for pkg in "${!WANT[@]}"; do
  want=${WANT[$pkg]}
  if [[ $want == /* ]]; then
    [ -e "$want" ] || missing+=("$pkg")
  else
    command -v "$want" >/dev/null 2>&1 || missing+=("$pkg")
  fi
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
# Debian's etcd-server starts a system etcd on install; tests never use one (each starts its
# own on free ports), so no service may start while installing: policy-rc.d answers "denied"
# for the install only, and a service that exists is stopped and disabled afterwards.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  trap 'rm -f "$policy"' EXIT
fi
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
if command -v systemctl >/dev/null 2>&1 && systemctl list-unit-files etcd.service >/dev/null 2>&1; then
  systemctl disable --now etcd.service >/dev/null 2>&1 || true
fi
