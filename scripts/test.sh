#!/usr/bin/env bash
# The one test command: installs what the tiers need (as root on Debian), then runs every
# tier that exists. CI (.ci/run) calls exactly this.
#
#   tier 0  format, lints and API docs
#   tier 1  unit, property, fixture and golden tests   (cargo nextest, all crates)
#   tier 2  integration tests with the real binaries    (part of the nextest run)
#   tier 3  QEMU guests (Debian 6.12 kernel; CXL, hot-unplug, ...) scripts/qemu-tests.sh
#   tier 4  Miri on the pure parts                      scripts/miri.sh     } side by side:
#   tier 5  fuzz targets, briefly                       (scripts/fuzz.sh --smoke) } one core each
#   python  the fabric_mm package: built from source, mypy, pytest   scripts/python-tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."

t0=$(date +%s)
# Each step says how far into the run it starts, so a log shows where the time went.
step() { printf '\n==> [%d s] %s\n' "$(($(date +%s) - t0))" "$*"; }

# Every tier builds under target/: about 35 GiB from a clean clone (debug test binaries, Miri,
# fuzz, QEMU images). Incremental artifacts would add about 16 GiB that a one-shot run never
# reuses, so they are off; and the free space is printed first, since a full disk otherwise
# shows up late, as a QEMU image that cannot be written.
export CARGO_INCREMENTAL=0
step "disk: $(df -Ph . | awk 'NR == 2 { print $4 " free on " $6 }')"

step "dependencies"
scripts/deps.sh
export FABRIC_INSTALL_DEPS=1

step "tier 0: rustfmt, clippy and rustdoc"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked --quiet

step "tiers 1-2: unit, fixture, golden and integration tests"
# The binaries and the C library (cdylib + staticlib) the integration tests run and link.
cargo build --workspace --bins --locked
cargo build -p libfabric-mm --lib --locked
# The QEMU guests (the power-loss and two-host domain tests too) run in tier 3 below, alone and
# with the tier required: not twice, and never beside the other tests on two CPUs.
cargo nextest run --workspace --locked --no-fail-fast --cargo-profile test \
  -E 'not (package(fabric-qemu-tests) & (binary(guests) | binary(power) | binary(domain)))'

step "tier 1: goldens of the 100,000-GPU cluster (ignored above: about 3 CPU-minutes)"
cargo nextest run -p fabric-cli --test golden --locked --cargo-profile test --run-ignored only

step "doc tests"
cargo test --workspace --doc --locked

step "python: the fabric_mm package (pip install ./python, mypy, pytest on fabricd)"
scripts/python-tests.sh

step "tier 3: QEMU guests"
scripts/qemu-tests.sh

# Miri interprets one test thread on one core, and libFuzzer runs one target at a time on
# one core: on two CPUs the two tiers run side by side (only their builds compete), which
# takes about the longer of the two instead of their sum. Miri's output goes to a log,
# printed whole once both have ended; either failing fails the run.
step "tiers 4-5: Miri on the pure parts, beside the fuzz smoke run (Miri's log: target/miri.log)"
mkdir -p target
scripts/miri.sh >target/miri.log 2>&1 &
miri_pid=$!
fuzz_status=0
scripts/fuzz.sh --smoke || fuzz_status=$?
miri_status=0
wait "$miri_pid" || miri_status=$?
step "tier 4: Miri's log"
sed 's/^/miri| /' target/miri.log
if [ "$miri_status" -ne 0 ] || [ "$fuzz_status" -ne 0 ]; then
  step "FAILED: Miri exited $miri_status, the fuzz smoke run $fuzz_status"
  exit 1
fi

step "all tiers passed"
