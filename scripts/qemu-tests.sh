#!/usr/bin/env bash
# Tier 3: QEMU guests. Installs what the guests need (scripts/qemu-deps.sh, as root on
# Debian), builds the base image (scripts/qemu-image.sh, cached), builds the project's guest
# binaries statically, then runs the guest tests with the tier required: a missing input
# fails, it never skips. Extra arguments go to nextest, e.g. `scripts/qemu-tests.sh cxl`.
#
# Logs of each guest: target/qemu-tests/TEST/ (console.log, data.log, qemu.log, the JSON the
# guest sent). Cache: see scripts/qemu-deps.sh. FABRIC_QEMU_ACCEL=tcg|kvm forces one.
set -euo pipefail
cd "$(dirname "$0")/.."

start=$(date +%s)
scripts/qemu-image.sh >/dev/null
# Static binaries for the guests, in target/x86_64-unknown-linux-gnu/debug (an explicit
# --target keeps RUSTFLAGS off build scripts and proc macros, and off target/debug).
RUSTFLAGS="-C target-feature=+crt-static -C debuginfo=0" \
  cargo build --locked --target x86_64-unknown-linux-gnu -p fabricd -p fabric-cli -p fabric-qemu-tests --bins
export FABRIC_QEMU_TESTS=1
if command -v cargo-nextest >/dev/null 2>&1; then
  cargo nextest run --locked -p fabric-qemu-tests --no-fail-fast "$@"
else
  cargo test --locked -p fabric-qemu-tests -- "$@"
fi
echo "qemu tier: $(( $(date +%s) - start )) s"
