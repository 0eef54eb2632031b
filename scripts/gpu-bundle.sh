#!/usr/bin/env bash
# Builds what the GPU check needs and packs it for a GPU machine that has the NVIDIA driver
# but no Rust toolchain and no network (docs/gpu.md):
#
#   scripts/gpu-bundle.sh [DESTDIR]      (default: target/gpu-check)
#
# DESTDIR/ gets bin/fabricctl, bin/fabricd, bin/gpu_check, gpu-check.sh, pattern.ptx and a
# README; DESTDIR.tar.gz is the same as one file. Run it on an ordinary x86-64 Linux
# machine: glibc binaries built on Debian 12 (glibc 2.36) run on current GPU images.
# On the GPU machine: tar xzf gpu-check.tar.gz && gpu-check/gpu-check.sh results/
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-target/gpu-check}

cargo build --release --locked -p fabric-cli -p fabricd -p libfabric-mm --bins

rm -rf "$DEST"
mkdir -p "$DEST/bin"
cp target/release/fabricctl target/release/fabricd target/release/gpu_check "$DEST/bin/"
# Line tables are for backtraces here; the bundle travels without them (a quarter the size).
if command -v strip >/dev/null; then
    strip --strip-debug "$DEST"/bin/*
fi
cp scripts/gpu-check.sh "$DEST/"
"$DEST/bin/gpu_check" ptx --out "$DEST/pattern.ptx"
# The newest glibc symbol the binaries need: the GPU machine's glibc must be at least that.
GLIBC=unknown
if command -v objdump >/dev/null; then
    GLIBC=$(objdump -T "$DEST"/bin/* | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
fi
cat >"$DEST/README" <<TXT
Fabric GPU check, built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse --short HEAD 2>/dev/null || echo unknown).
Run: ./gpu-check.sh OUTDIR   (at most 8 minutes; needs the NVIDIA driver, nothing else)
Needs: x86-64 Linux with glibc >= ${GLIBC#GLIBC_} (bash, coreutils timeout).
Exit: 0 passed, 3 no GPU/driver here (summary.json says why), 1 a step failed.
Bring back OUTDIR: summary.json has the status and the figures.
pattern.ptx is the kernel text gpu_check loads with cuModuleLoadData (for ptxas -arch=sm_90 if in doubt).
TXT
scripts/gpu-bundle-c.sh "$DEST" # bin/gpu_share, the CUDA C ABI example, linked statically
tar -C "$(dirname "$DEST")" -czf "$DEST.tar.gz" "$(basename "$DEST")"
echo "bundle: $DEST ($(du -sh "$DEST" | cut -f1)), $DEST.tar.gz"
