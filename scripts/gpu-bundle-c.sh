#!/usr/bin/env bash
# Adds the C example of the CUDA C ABI to a GPU check bundle: builds libfabric_mm's static
# library and links libfabric-mm/examples/c/gpu_share.c against it (glibc stays dynamic;
# libcuda is opened at run time), so the GPU machine needs no libfabric_mm.so:
#
#   scripts/gpu-bundle-c.sh DESTDIR [PROFILE]      (PROFILE: release, the default, or debug)
#
# Writes DESTDIR/bin/gpu_share and, when DESTDIR/README exists, a line in it. With
# FABRIC_BUNDLE_NO_BUILD=1 it links what target/PROFILE holds without running cargo (the
# tests do: tests/c_examples.rs). scripts/gpu-bundle.sh calls it.
#
# On the GPU machine: bin/gpu_share SOCKET, SOCKET a fabricd that serves this host's GPUs
# (gpu-check.sh starts one). Exit: 0 passed, 3 no CUDA driver or GPU here, 1 a check
# failed, 2 usage.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 DESTDIR [release|debug]" >&2
    exit 2
fi
DEST=$1
PROFILE=${2:-release}
case $PROFILE in
release) BUILD=(cargo build --release --locked -p libfabric-mm --lib) ;;
debug) BUILD=(cargo build --locked -p libfabric-mm --lib) ;;
*)
    echo "$0: profile is release or debug, not $PROFILE" >&2
    exit 2
    ;;
esac
[ -n "${FABRIC_BUNDLE_NO_BUILD:-}" ] || "${BUILD[@]}"
LIB=target/$PROFILE/libfabric_mm.a
if [ ! -f "$LIB" ]; then
    echo "$0: $LIB is not built" >&2
    exit 1
fi
mkdir -p "$DEST/bin"
# What the Rust standard library needs from the system: `cargo rustc -p libfabric-mm --lib
# --crate-type staticlib -- --print native-static-libs` lists it.
NATIVE=(-ldl -lgcc_s -lutil -lrt -lpthread -lm -lc)
"${CC:-cc}" -std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -Ilibfabric-mm/include \
    libfabric-mm/examples/c/gpu_share.c "$LIB" "${NATIVE[@]}" -o "$DEST/bin/gpu_share"
if command -v strip >/dev/null; then
    strip --strip-debug "$DEST/bin/gpu_share"
fi
if [ -f "$DEST/README" ]; then
    echo "bin/gpu_share SOCKET: the CUDA C ABI's two-process example through a fabricd (exit 0 passed, 3 no GPU, 1 failed)." \
        >>"$DEST/README"
fi
echo "gpu_share: $DEST/bin/gpu_share"
