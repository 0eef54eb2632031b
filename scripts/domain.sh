#!/usr/bin/env bash
# A domain on this machine, as the current user (root only for FABRIC_DOMAIN_NETNS=1): a private etcd and N fabricd
# nodes, node i serving tray i of configs/sim/supernode-64.toml (docs/domain.md).
#
#   scripts/domain.sh up N     start etcd and nodes tray0..tray(N-1) (1 <= N <= 16); prints
#                              each node's socket
#   scripts/domain.sh status   the nodes and whether they run
#   scripts/domain.sh down     stop what `up` started (only those pids) and remove the run dir
#
# Everything lives in one run dir ($FABRIC_DOMAIN_RUN, default ${TMPDIR:-/tmp}/fabric-domain-UID):
# etcd's data, each node's configuration, socket, state dir and log, and the pids. etcd listens
# on free loopback ports. FABRICD (default target/debug/fabricd, else fabricd on PATH),
# FABRIC_CERTS (default target/debug/fabric-certs, else fabric-certs on PATH) and FABRIC_ETCD
# (default etcd on PATH) pick the binaries. With fabric-certs, the run dir also holds a test
# CA and each node's certificate (pki/), and the nodes link over mutual TLS and share the
# sim's memory (shared/): a client of one node imports what a client of another exported.
# FABRIC_DOMAIN_NET=K leaves the last K nodes off the shared memory (class NET: their
# clients get copy-only grants and copy over the node link; `fabricctl bench netcopy`).
# FABRIC_DOMAIN_ANSWER_POLL_US sets the nodes' peer.answer_poll_us (default: fabricd's).
# FABRIC_DOMAIN_NETNS=1 (root, `ip` from iproute2) runs etcd and each node in a network
# namespace of its own, joined by veth pairs to a bridge in a "switch" namespace, at
# addresses in 10.79.0.0/24 that exist only there (etcd .1, tray i .(10+i)); the node link
# then crosses a veth, not loopback. Sockets and files stay where they are; `down` deletes
# the namespaces `up` created, whatever prefix they had (their names are in the run dir's
# `netns`; FABRIC_DOMAIN_NETNS_PREFIX, default fabric-domain, starts them). An `up` that
# fails takes down what it started.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUN=${FABRIC_DOMAIN_RUN:-${TMPDIR:-/tmp}/fabric-domain-$(id -u)}
SIM=$ROOT/configs/sim/supernode-64.toml
ETCD=${FABRIC_ETCD:-etcd}
if [ -z "${FABRICD:-}" ]; then
  if [ -x "$ROOT/target/debug/fabricd" ]; then FABRICD=$ROOT/target/debug/fabricd; else FABRICD=fabricd; fi
fi
if [ -z "${FABRIC_CERTS:-}" ]; then
  if [ -x "$ROOT/target/debug/fabric-certs" ]; then FABRIC_CERTS=$ROOT/target/debug/fabric-certs; else FABRIC_CERTS=fabric-certs; fi
fi
DOMAIN=supernode
NETNS=${FABRIC_DOMAIN_NETNS:-0}
[[ $NETNS =~ ^[01]$ ]] || { echo "domain.sh: FABRIC_DOMAIN_NETNS is 0 or 1" >&2; exit 1; }
# Namespace names: PREFIX-sw, PREFIX-etcd, PREFIX-tray0... (FABRIC_DOMAIN_NETNS_PREFIX
# keeps two runs apart: each has its own switch, so their addresses never meet).
PREFIX=${FABRIC_DOMAIN_NETNS_PREFIX:-fabric-domain}
[[ $PREFIX =~ ^[A-Za-z0-9-]{1,24}$ ]] || { echo "domain.sh: FABRIC_DOMAIN_NETNS_PREFIX is 1-24 of [A-Za-z0-9-]" >&2; exit 1; }
NET=10.79.0
TTL=${FABRIC_DOMAIN_TTL:-6}
SPAN=1099511627776 # 1 TiB: every node's slot, the same on all of them

die() { echo "domain.sh: $*" >&2; exit 1; }

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits up to $3 seconds for the etcd at $1:$2 to answer its /health with
# "health":"true" (an open port is not enough: a fresh member elects itself first, and a
# node that cannot join a domain whose slot it never held refuses to start). With
# namespaces, asked from inside etcd's.
wait_etcd() {
  local host=$1 port=$2 i reply
  for ((i = 0; i < $3 * 10; i++)); do
    # shellcheck disable=SC2016 # expanded by the inner bash
    reply=$(in_ns etcd bash -c '(exec 3<>"/dev/tcp/$0/$1" &&
      printf "GET /health HTTP/1.0\r\nHost: $0\r\n\r\n" >&3 && timeout 2 cat <&3) 2>/dev/null || true' "$host" "$port")
    [[ $reply == *'"health":"true"'* ]] && return 0
    sleep 0.1
  done
  return 1
}

# The run dir must be this user's own directory, not a symlink: under /tmp another user
# could have made it first (and root writes logs and pids there).
own_run() {
  [ -d "$RUN" ] && [ ! -L "$RUN" ] && [ -O "$RUN" ] ||
    die "$RUN is not a directory of this user's own (a symlink, or someone else's): set FABRIC_DOMAIN_RUN"
}

# Execs "$@" in namespace $1 of this run (etcd, trayN) when namespaces are on, else here.
# It replaces the shell it runs in: call it in a subshell (`&`, `$(...)`), so that `$!`
# is the program's own pid.
in_ns() {
  local ns=$1
  shift
  if ((NETNS)); then
    [ -e "/run/netns/$PREFIX-$ns" ] || die "namespace $PREFIX-$ns does not exist"
    exec ip netns exec "$PREFIX-$ns" "$@"
  fi
  exec "$@"
}

# Creates namespace $PREFIX-$1 at address $2, joined to the switch's bridge by veth port
# $3 (made inside the switch namespace, so the host's own namespace never sees either
# end), and records it for `down`.
add_ns() {
  local ns=$PREFIX-$1 addr=$2 port=$3
  ip netns add "$ns"
  echo "$ns" >>"$RUN/netns"
  ip netns exec "$PREFIX-sw" ip link add "$port" type veth peer name eth0 netns "$ns"
  ip netns exec "$PREFIX-sw" ip link set "$port" master br0 up
  ip netns exec "$ns" ip addr add "$addr/24" dev eth0
  ip netns exec "$ns" ip link set eth0 up
  ip netns exec "$ns" ip link set lo up
}

# The switch namespace with its bridge, etcd's namespace and one per node ($1 nodes).
make_net() {
  local n=$1 i
  [ "$(id -u)" = 0 ] || die "FABRIC_DOMAIN_NETNS=1 needs root (it creates network namespaces)"
  command -v ip >/dev/null || die "FABRIC_DOMAIN_NETNS=1 needs ip (iproute2)"
  for ns in sw etcd $(seq -f 'tray%g' 0 $((n - 1))); do
    [ -e "/run/netns/$PREFIX-$ns" ] && die "namespace $PREFIX-$ns exists already (another run? scripts/domain.sh down)"
  done
  ip netns add "$PREFIX-sw"
  echo "$PREFIX-sw" >>"$RUN/netns"
  ip netns exec "$PREFIX-sw" ip link add br0 type bridge
  ip netns exec "$PREFIX-sw" ip link set br0 up
  add_ns etcd "$NET.1" p0
  for ((i = 0; i < n; i++)); do add_ns "tray$i" "$NET.$((10 + i))" "p$((i + 1))"; done
}

# Whether pid $1 still runs the command whose arguments include $2 (never a reused pid).
ours() {
  [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -qF -- "$2"
}

# Stops pid file $1's process if it still is ours (its command line names $2).
stop() {
  local file=$1 mark=$2 pid i
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if ours "$pid" "$mark"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do ours "$pid" "$mark" || break; sleep 0.1; done
    if ours "$pid" "$mark"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$file"
}

up() {
  local n=${1:-}
  [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 16)) || die "up N: N is 1 to 16 (the supernode has 16 trays)"
  [ -e "$RUN/etcd.pid" ] && die "a domain is already up in $RUN (scripts/domain.sh down first)"
  command -v "$ETCD" >/dev/null || die "no etcd (scripts/deps.sh installs Debian's etcd-server)"
  command -v "$FABRICD" >/dev/null || [ -x "$FABRICD" ] || die "no fabricd at $FABRICD (cargo build -p fabricd)"
  mkdir -p "$RUN"
  own_run
  chmod 700 "$RUN"
  # From here on a failure (or ^C) takes down what this `up` started.
  # The logs' last lines say why; they go with the run dir.
  trap 'echo "domain.sh: up failed; taking down what it started" >&2; tail -n 20 "$RUN"/etcd.log "$RUN"/tray*/fabricd.log >&2 2>/dev/null; down >/dev/null' EXIT
  trap 'exit 130' INT TERM
  local client peer host=127.0.0.1
  if ((NETNS)); then
    make_net "$n"
    # Each namespace has its own ports: etcd's defaults are free in its own.
    host=$NET.1 client=2379 peer=2380
    echo "namespaces: $(tr '\n' ' ' <"$RUN/netns")(10.79.0.0/24)"
  else
    client=$(free_port)
    peer=$(free_port)
  fi
  in_ns etcd "$ETCD" --name fabric-domain --data-dir "$RUN/etcd" \
    --listen-client-urls "http://$host:$client" --advertise-client-urls "http://$host:$client" \
    --listen-peer-urls "http://$host:$peer" --initial-advertise-peer-urls "http://$host:$peer" \
    --initial-cluster "fabric-domain=http://$host:$peer" </dev/null >"$RUN/etcd.log" 2>&1 &
  echo $! >"$RUN/etcd.pid"
  wait_etcd "$host" "$client" 20 || die "etcd on $host:$client is not healthy (see $RUN/etcd.log)"
  echo "etcd http://$host:$client (data $RUN/etcd)"
  local link=0
  if command -v "$FABRIC_CERTS" >/dev/null || [ -x "$FABRIC_CERTS" ]; then
    "$FABRIC_CERTS" ca "$RUN/pki" --domain "$DOMAIN" >/dev/null
    link=1
    echo "node link: CA $RUN/pki/ca.pem, shared sim memory $RUN/shared"
  else
    echo "node link: off (no fabric-certs: cargo build -p fabric-nodelink)"
  fi
  local i dir addr
  for ((i = 0; i < n; i++)); do
    dir=$RUN/tray$i
    if ((NETNS)); then addr=$NET.$((10 + i)):7471; else addr=127.0.0.1:$((7471 + i)); fi
    mkdir -p "$dir"
    cat >"$dir/fabricd.toml" <<EOF
[socket]
path = "$dir/fabricd.sock"
[state]
dir = "$dir/state"
[discovery]
sim = ["$SIM"]
sim_node = "tray$i"
[metrics]
listen = ""
[map]
node_span = { fixed = $SPAN }
[domain]
name = "$DOMAIN"
endpoints = ["http://$host:$client"]
node = "tray$i"
lease_ttl_secs = $TTL
[peer]
address = "$addr"
EOF
    if ((link)); then
      "$FABRIC_CERTS" node "$RUN/pki" --domain "$DOMAIN" --node "tray$i" --san "${addr%:*}" >/dev/null
      cat >>"$dir/fabricd.toml" <<EOF
ca = "$RUN/pki/ca.pem"
cert = "$RUN/pki/tray$i.pem"
key = "$RUN/pki/tray$i.key"
shared_identities = true
EOF
      if [ -n "${FABRIC_DOMAIN_ANSWER_POLL_US:-}" ]; then
        echo "answer_poll_us = $FABRIC_DOMAIN_ANSWER_POLL_US" >>"$dir/fabricd.toml"
      fi
      # The last $FABRIC_DOMAIN_NET nodes share no memory fabric (class NET: copy only).
      if ((i < n - ${FABRIC_DOMAIN_NET:-0})); then
        echo "shared_dir = \"$RUN/shared\"" >>"$dir/fabricd.toml"
      fi
    fi
    in_ns "tray$i" "$FABRICD" --config "$dir/fabricd.toml" </dev/null >/dev/null 2>"$dir/fabricd.log" &
    echo $! >"$dir/pid"
  done
  for ((i = 0; i < n; i++)); do
    dir=$RUN/tray$i
    local t
    for ((t = 0; t < 300; t++)); do
      [ -S "$dir/fabricd.sock" ] && break
      ours "$(cat "$dir/pid")" "$dir/fabricd.toml" || die "tray$i did not start (see $dir/fabricd.log)"
      sleep 0.1
    done
    [ -S "$dir/fabricd.sock" ] || die "tray$i: no socket after 30 s (see $dir/fabricd.log)"
    echo "tray$i $dir/fabricd.sock"
  done
  trap - EXIT INT TERM
  echo "try: FABRIC_SOCKET=$RUN/tray0/fabricd.sock fabricctl domain status -o json"
}

status() {
  [ -e "$RUN/etcd.pid" ] || { echo "no domain up in $RUN"; return 0; }
  local dir pid state
  for dir in "$RUN"/tray*; do
    [ -d "$dir" ] || continue
    pid=$(cat "$dir/pid" 2>/dev/null || echo 0)
    if ours "$pid" "$dir/fabricd.toml"; then state="running (pid $pid)"; else state="stopped"; fi
    echo "$(basename "$dir") $state $dir/fabricd.sock"
  done
}

down() {
  [ -d "$RUN" ] || { echo "no domain up in $RUN"; return 0; }
  own_run
  local dir
  for dir in "$RUN"/tray*; do
    [ -d "$dir" ] && stop "$dir/pid" "$dir/fabricd.toml"
  done
  stop "$RUN/etcd.pid" "$RUN/etcd"
  # The namespaces `up` recorded, whatever prefix it had; only names of the shape it
  # makes, and the record kept (with the run dir) while any of them is left.
  if [ -f "$RUN/netns" ]; then
    local ns left=0
    while read -r ns; do
      [[ $ns =~ ^[A-Za-z0-9-]{1,24}-(sw|etcd|tray[0-9]{1,2})$ ]] || { echo "domain.sh: skipping $ns in $RUN/netns" >&2; continue; }
      [ -e "/run/netns/$ns" ] || continue
      ip netns del "$ns" || left=1
    done <"$RUN/netns"
    ((left == 0)) || die "some namespaces of $RUN/netns are left (root is needed to delete them)"
  fi
  rm -rf "$RUN"
  echo "domain down"
}

case "${1:-}" in
  up) up "${2:-}" ;;
  down) down ;;
  status) status ;;
  *) die "usage: scripts/domain.sh up N | status | down" ;;
esac
