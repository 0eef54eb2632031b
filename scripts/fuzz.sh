#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ with libFuzzer coverage instrumentation on the stable
# toolchain (no cargo-fuzz or nightly needed) and runs them.
#
#   scripts/fuzz.sh --smoke [TARGET...]   every target (or those named) for FUZZ_SMOKE_SECS
#                                         (default 15) seconds each
#   scripts/fuzz.sh TARGET [SECS]         one target, longer (default 300 s)
#
# Corpora live in fuzz/corpus/TARGET (ignored by git); seeds in fuzz/seeds/TARGET are
# copied in first. FUZZ_ARGS adds libFuzzer flags (e.g. "-jobs=4" or "-dict=FILE").
#
# A target fails when its fuzzer exits with any status but 0 (a crash, a timeout, running
# out of memory, a sanitizer's leak report, a fuzzer that cannot start, a missing binary),
# or when fuzz/artifacts/TARGET holds a crash-, timeout-, oom- or leak- input (one left by
# an earlier run counts until it is removed: it is a failure nobody has fixed yet). The
# fuzzer's whole output is in fuzz/artifacts/TARGET/run.log; on a failure its end is
# printed. Every target named runs even after one fails; the exit status is 1 if any
# failed. Each run is bounded: libFuzzer stops after SECS (-max_total_time), an input
# running longer than FUZZ_INPUT_TIMEOUT (default 25) seconds is a timeout, and a fuzzer
# still running SECS + 120 seconds after its start is killed and fails.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks --cfg fuzzing"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
triple=$(rustc -vV | sed -n 's/^host: //p')

targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^fabric-fuzz$')
known() { grep -qx -- "$1" <<<"$targets"; }
words() { tr '\n' ' ' <<<"$1" | sed 's/ *$//'; }
usage() { echo "usage: scripts/fuzz.sh --smoke [TARGET...] | TARGET [SECS]" >&2; exit 2; }

# What to run, checked before the (long) build.
if [ "${1:-}" = "--smoke" ]; then
  shift
  secs="${FUZZ_SMOKE_SECS:-15}"
  if [ $# -gt 0 ]; then selected="$*"; else selected=$targets; fi
else
  [ $# -ge 1 ] && [ $# -le 2 ] || usage
  selected=$1
  secs="${2:-300}"
fi
[[ "$secs" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz: SECS must be a positive whole number of seconds (0 is no limit to libFuzzer), not '$secs'" >&2; exit 2; }
for t in $selected; do
  known "$t" || { echo "fuzz: no target '$t' (targets: $(words "$targets"))" >&2; exit 2; }
done

# An explicit --target keeps the instrumentation flags off build scripts and proc macros.
cargo build --release --bins --quiet --target "$triple"

run() {
  local t=$1 secs=$2 bin="$CARGO_TARGET_DIR/$triple/release/$1" log="artifacts/$1/run.log" status=0 found
  mkdir -p "corpus/$t" "artifacts/$t" || return 1
  [ -d "seeds/$t" ] && cp -n "seeds/$t"/* "corpus/$t"/ 2>/dev/null || true
  echo "fuzz: $t for ${secs}s"
  if [ ! -x "$bin" ]; then
    echo "fuzz: $t FAILED: no fuzzer binary at $bin" >&2
    return 1
  fi
  # shellcheck disable=SC2086 # FUZZ_ARGS is a list of flags
  timeout --kill-after=10 "$((secs + 120))" "$bin" "corpus/$t" -max_total_time="$secs" -max_len=65536 \
    -timeout="${FUZZ_INPUT_TIMEOUT:-25}" -artifact_prefix="artifacts/$t/" -print_final_stats=1 \
    ${FUZZ_ARGS:-} >"$log" 2>&1 || status=$?
  grep -E '^(stat::number_of_executed_units|==|SUMMARY)|panicked' "$log" || true
  found=$(find "artifacts/$t" -maxdepth 1 -type f \
    \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | sort)
  if [ "$status" -eq 0 ] && [ -z "$found" ]; then
    return 0
  fi
  case $status in
    0) why="fuzz/artifacts/$t holds inputs that failed (this run or an earlier one)" ;;
    124 | 137) why="still running $((secs + 120))s after its start: killed" ;;
    *) why="the fuzzer exited with status $status" ;;
  esac
  {
    echo "fuzz: $t FAILED: $why; the end of fuzz/$log:"
    tail -n 25 "$log" | sed 's/^/  | /'
    if [ -n "$found" ]; then
      echo "fuzz: inputs that fail (reproduce: $bin FILE; remove them once fixed):"
      sed 's|^|  fuzz/|' <<<"$found"
    fi
  } >&2
  return 1
}

failed=()
for t in $selected; do
  run "$t" "$secs" || failed+=("$t")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: passed: $(words "$selected")"
