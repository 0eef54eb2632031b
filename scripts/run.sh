#!/usr/bin/env bash
# Command 1 of the README: build, start fabricd on the bundled simulated fabric (an 8-GPU
# HGX H100 board) as the current user, show what it serves (topology, address map,
# status), then keep it running until Ctrl-C, which stops it cleanly (SIGTERM, wait).
#
# Needs no root and no GPU. Socket and state live in a private directory under
# $XDG_RUNTIME_DIR (or /tmp), removed on exit. SIM=FILE picks another bundled fabric;
# FABRIC_BIN=DIR runs the fabricd and fabricctl in DIR instead of building release ones
# (cli/tests/run_script.rs runs this script so, with the test build's binaries). Exit
# status: 0 when fabricd stopped cleanly, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
sim=${SIM:-configs/sim/hgx-h100-8gpu.toml}
[[ -f $sim ]] || { echo "run.sh: no sim fabric $sim" >&2; exit 2; }

if [[ -n ${FABRIC_BIN:-} ]]; then
  bin=$(cd "$FABRIC_BIN" && pwd)
else
  # fabricd's etcd client needs protoc to build (scripts/protoc.sh).
  source scripts/protoc.sh
  ensure_protoc
  cargo build --release --locked --bin fabricd --bin fabricctl
  bin=$root/target/release
fi

dir=$(mktemp -d "${XDG_RUNTIME_DIR:-/tmp}/fabric-run.XXXXXX")
export FABRIC_SOCKET=$dir/fabricd.sock
cat >"$dir/fabricd.toml" <<EOF
[socket]
path = "$FABRIC_SOCKET"
[state]
dir = "$dir/state"
[discovery]
sim = ["$root/$sim"]
[metrics]
listen = ""
EOF

"$bin/fabricd" --config "$dir/fabricd.toml" 2>"$dir/fabricd.log" &
daemon=$!
# On Ctrl-C the whole foreground process group gets SIGINT, fabricd too: it may already be
# stopping (or gone) here, so wait for it whatever state it is in; its status is kept.
stop() {
  trap - INT TERM EXIT
  local status=${daemon_status:-}
  if [[ -z $status ]]; then
    kill -TERM "$daemon" 2>/dev/null || true
    status=0
    wait "$daemon" || status=$?
  fi
  rm -rf "$dir"
  if ((status == 0)); then
    echo "fabricd stopped cleanly"
  else
    echo "fabricd exited with status $status" >&2
    exit 1
  fi
}
trap stop EXIT
trap 'echo; exit 0' INT TERM

# Ready when its log says so (it also tells systemd with READY=1 when run as a service).
for _ in $(seq 1 300); do
  grep -q '"ready"\|ready' "$dir/fabricd.log" 2>/dev/null && [[ -S $FABRIC_SOCKET ]] && break
  kill -0 "$daemon" 2>/dev/null || { cat "$dir/fabricd.log" >&2; exit 1; }
  sleep 0.1
done
[[ -S $FABRIC_SOCKET ]] || { echo "fabricd did not come up:" >&2; cat "$dir/fabricd.log" >&2; exit 1; }

section() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
section "fabricctl topology --daemon   ($sim)"
"$bin/fabricctl" topology --daemon
section "fabricctl map --daemon"
"$bin/fabricctl" map --daemon
section "fabricctl status --daemon"
"$bin/fabricctl" status --daemon

section "fabricd is serving on $FABRIC_SOCKET (pid $daemon)"
echo "In another shell:  FABRIC_SOCKET=$FABRIC_SOCKET $bin/fabricctl devices --daemon"
echo "Ctrl-C stops it."
# Returns only when fabricd ended by itself (a Ctrl-C runs the trap instead).
st=0
wait "$daemon" || st=$?
daemon_status=$st
