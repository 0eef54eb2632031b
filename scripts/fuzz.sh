#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ with libFuzzer coverage instrumentation on the stable
# toolchain (no cargo-fuzz or nightly needed) and runs them.
#
#   scripts/fuzz.sh --smoke          every target for FUZZ_SMOKE_SECS (default 15) seconds
#   scripts/fuzz.sh TARGET [SECS]    one target, longer
#
# Corpora live in fuzz/corpus/TARGET (ignored by git); seeds in fuzz/seeds/TARGET are
# copied in first. A crash leaves its input in fuzz/artifacts/TARGET and fails the script.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks --cfg fuzzing"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
# An explicit --target keeps the instrumentation flags off build scripts and proc macros.
triple=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --bins --quiet --target "$triple"

targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^fabric-fuzz$')
run() {
  local t=$1 secs=$2
  mkdir -p "corpus/$t" "artifacts/$t"
  [ -d "seeds/$t" ] && cp -n "seeds/$t"/* "corpus/$t"/ 2>/dev/null || true
  echo "fuzz: $t for ${secs}s"
  "$CARGO_TARGET_DIR/$triple/release/$t" "corpus/$t" -max_total_time="$secs" -max_len=65536 \
    -artifact_prefix="artifacts/$t/" -print_final_stats=1 2>&1 | grep -E '^(stat::number_of_executed_units|==|SUMMARY)|panicked' || true
  if ls "artifacts/$t"/crash-* >/dev/null 2>&1; then
    echo "fuzz: $t crashed; inputs in fuzz/artifacts/$t" >&2
    return 1
  fi
}

if [ "${1:-}" = "--smoke" ]; then
  for t in $targets; do run "$t" "${FUZZ_SMOKE_SECS:-15}"; done
else
  run "${1:?target}" "${2:-300}"
fi
