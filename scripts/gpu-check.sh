#!/usr/bin/env bash
# The GPU check: runs unattended on a machine with the NVIDIA driver (and, optionally, the
# CUDA toolkit), without a Rust toolchain or network, using binaries built beforehand
# (scripts/gpu-bundle.sh). Every step has a timeout, cut to what is left of a 440 s budget
# (GPU_CHECK_BUDGET), so the whole run, summary included, stays under 8 minutes.
#
#   gpu-check.sh OUTDIR
#
# Writes into OUTDIR: the nvidia-smi outputs (smi-query.xml, smi-query.txt, smi-topo.txt,
# smi-nvlink.txt), discovery (topology.json, topology.txt, devices.json), the comparison
# (gpu-compare.json, gpu-compare.txt), the daemon's view (fabricd.log, daemon-status.json,
# daemon-devices.json, daemon-map.json), the CUDA checks (probe.json, memory.json and
# memory.importer.json through fabricd, memory-direct*.json without it, memory-fabric*.json
# through fabricd with a fabric handle where an IMEX channel exists, imex-channel.txt; the C
# example gpu_share through fabricd: c-share.txt, c-share-fabric.txt), the PTX
# (pattern.ptx, assembled by ptxas when the toolkit is
# there), each step's log (*.log), steps.tsv and summary.json.
#
# Binaries: $FABRIC_BIN_DIR, else ./bin next to this script (the bundle layout), else the
# repository's target/release or target/debug.
#
# Exit: 0 every step passed; 3 no GPU here (CUDA/NVML/nvidia-smi not present; the summary
# says why) and nothing else failed; 1 a step failed or timed out; 2 usage.
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)

find_bins() {
    for d in "${FABRIC_BIN_DIR:-}" "$HERE/bin" "$HERE/../target/release" "$HERE/../target/debug"; do
        if [ -n "$d" ] && [ -x "$d/fabricctl" ]; then
            echo "$d"
            return
        fi
    done
}
BIN=$(find_bins)
FABRICCTL=${BIN:+$BIN/fabricctl}
GPU_CHECK=""
if [ -n "$BIN" ] && [ -x "$BIN/gpu_check" ]; then
    GPU_CHECK=$BIN/gpu_check
fi

START=$(date +%s)
# The whole run, summary included, stays under 8 minutes: every step's limit is cut to what
# is left of this budget (its kill-after margin included); a step with no time left is
# recorded as timed out.
BUDGET=${GPU_CHECK_BUDGET:-440}
DEADLINE=$((START + BUDGET))
printf 'step\texit\tseconds\toutput\n' >"$OUT/steps.tsv"

# run NAME TIMEOUT OUTPUT CMD...: runs CMD with stdout to OUTPUT and stderr to NAME.log.
run() {
    local name=$1 limit=$2 output=$3
    shift 3
    local t0 rc left
    t0=$(date +%s)
    left=$((DEADLINE - t0 - 10))
    if [ "$left" -lt 5 ]; then
        echo "out of the ${BUDGET} s budget" >"$OUT/$name.log"
        printf '%s\t124\t0\t%s\n' "$name" "$output" >>"$OUT/steps.tsv"
        return 124
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    if ! command -v "$1" >/dev/null 2>&1 && [ ! -x "$1" ]; then
        echo "$1: not found" >"$OUT/$name.log"
        rc=127
    else
        timeout --kill-after=10 "$limit" "$@" >"$OUT/$output" 2>"$OUT/$name.log"
        rc=$?
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$output" >>"$OUT/steps.tsv"
    echo "== $name: exit $rc ($(($(date +%s) - t0)) s)" >&2
    return $rc
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -a)"
    echo "binaries: ${BIN:-none found}"
    [ -r /proc/driver/nvidia/version ] && cat /proc/driver/nvidia/version
} >"$OUT/environment.txt" 2>&1

# 1. The reference: nvidia-smi.
run smi-list 30 smi-list.txt nvidia-smi -L
run smi-query-xml 60 smi-query.xml nvidia-smi -q -x
run smi-query 60 smi-query.txt nvidia-smi -q
run smi-topo 30 smi-topo.txt nvidia-smi topo -m
run smi-nvlink 30 smi-nvlink.txt nvidia-smi nvlink --status

# 2. Discovery (local, never a daemon) and the comparison.
if [ -n "$FABRICCTL" ]; then
    run topology-json 60 topology.json "$FABRICCTL" topology -o json --sysfs-root /
    run topology 60 topology.txt "$FABRICCTL" topology --sysfs-root /
    run devices 60 devices.json "$FABRICCTL" devices -o json --sysfs-root /
    if [ -s "$OUT/smi-query.xml" ] && [ -s "$OUT/smi-topo.txt" ]; then
        run gpu-compare 60 gpu-compare.json "$FABRICCTL" gpu-compare --sysfs-root / -o json \
            --smi-xml "$OUT/smi-query.xml" --smi-topo "$OUT/smi-topo.txt"
        run gpu-compare-table 60 gpu-compare.txt "$FABRICCTL" gpu-compare --sysfs-root / \
            --smi-xml "$OUT/smi-query.xml" --smi-topo "$OUT/smi-topo.txt"
    else
        printf 'gpu-compare\tskipped\t0\tno nvidia-smi output\n' >>"$OUT/steps.tsv"
    fi
else
    printf 'discovery\t127\t0\tfabricctl not found\n' >>"$OUT/steps.tsv"
fi

# 2b. The daemon on this host's GPUs: fabricd with the pci, nvml and cuda backends, its
# status (what is missing or degraded), its devices and its address map (HBM placed). It
# keeps running for the memory check, which passes GPU memory through it.
FABRICD=""
DSOCK=""
stop_daemon() {
    if [ -n "$FABRICD" ]; then
        kill -TERM "$FABRICD" 2>/dev/null
        wait "$FABRICD"
        printf 'daemon-stop\t%s\t0\tfabricd.log\n' "$?" >>"$OUT/steps.tsv"
        FABRICD=""
    fi
}
if [ -n "$FABRICCTL" ] && [ -x "$BIN/fabricd" ]; then
    DDIR=$(mktemp -d)
    cat >"$DDIR/fabricd.toml" <<TOML
[socket]
path = "$DDIR/fabricd.sock"
[state]
dir = "$DDIR/state"
[discovery]
backends = ["pci", "nvml", "cuda"]
rescan_interval_s = 0
uevents = "off"
TOML
    cp "$DDIR/fabricd.toml" "$OUT/fabricd.toml"
    "$BIN/fabricd" --config "$DDIR/fabricd.toml" >"$OUT/fabricd.log" 2>&1 &
    FABRICD=$!
    for _ in $(seq 1 300); do
        [ -S "$DDIR/fabricd.sock" ] && break
        kill -0 "$FABRICD" 2>/dev/null || break
        sleep 0.1
    done
    run daemon-status 30 daemon-status.json "$FABRICCTL" status --daemon "$DDIR/fabricd.sock" -o json
    run daemon-devices 30 daemon-devices.json "$FABRICCTL" devices --daemon "$DDIR/fabricd.sock" -o json
    run daemon-map 30 daemon-map.json "$FABRICCTL" map --daemon "$DDIR/fabricd.sock" -o json
    [ -S "$DDIR/fabricd.sock" ] && DSOCK=$DDIR/fabricd.sock
fi

# An IMEX channel for fabric handles (NVIDIA's IMEX guide, "IMEX Channels"): a CUDA
# allocation with the fabric handle type needs /dev/nvidia-caps-imex-channels/channelN. When
# there is none, GPU_CHECK_IMEX=create (as root) makes channel 0 from the major number the
# driver registered in /proc/devices, as the guide's mknod does (mode 0600), and removes it
# after the check: changing /dev is the operator's call, so only on request. Prints what it
# found or did; fails when no channel.
imex_channel() {
    local dir=${GPU_CHECK_IMEX_DIR:-/dev/nvidia-caps-imex-channels} major
    if compgen -G "$dir/channel*" >/dev/null; then
        echo "present: $(cd "$dir" && echo channel*)"
        return 0
    fi
    major=$(awk '$2 == "nvidia-caps-imex-channels" { print $1 }' "${GPU_CHECK_PROC_DEVICES:-/proc/devices}" 2>/dev/null)
    if [ -z "$major" ]; then
        echo "no IMEX channel: the driver registers no nvidia-caps-imex-channels device"
        return 1
    fi
    if [ "${GPU_CHECK_IMEX:-}" != create ]; then
        echo "no IMEX channel in $dir (GPU_CHECK_IMEX=create makes channel 0)"
        return 1
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "no IMEX channel in $dir, and creating one needs root"
        return 1
    fi
    # Mode 0600: the check runs as root; an IMEX channel is the boundary of who may import
    # fabric handles, so it is not opened to every user, and it is removed after the check.
    if mkdir -p "$dir" && mknod -m 600 "$dir/channel0" c "$major" 0; then
        IMEX_MADE=$dir/channel0
        echo "created $dir/channel0 (major $major, mode 0600; removed after the check)"
        return 0
    fi
    echo "no IMEX channel: mknod $dir/channel0 failed"
    return 1
}

# 3. CUDA: presence, then the two-process memory check (1 GiB, 20 copies per figure): through
# fabricd (Adopt, export, ImportObject) when it runs, and directly (the descriptor over a
# socket between the two processes).
if [ -n "$GPU_CHECK" ]; then
    # The kernel text, assembled offline where the toolkit is installed (the driver JIT
    # compiles the same text in the memory check).
    "$GPU_CHECK" ptx --out "$OUT/pattern.ptx"
    PTXAS=$(command -v ptxas || ls /usr/local/cuda/bin/ptxas 2>/dev/null || true)
    if [ -n "$PTXAS" ]; then
        run ptxas 60 ptxas.txt "$PTXAS" -arch=sm_90 -v "$OUT/pattern.ptx" -o "$OUT/pattern.sm_90.cubin"
    else
        printf 'ptxas\tskipped\t0\tno ptxas (CUDA toolkit) here\n' >>"$OUT/steps.tsv"
    fi
    run cuda-probe 60 probe.stdout "$GPU_CHECK" probe --out "$OUT/probe.json"
    if [ $? -ne 3 ]; then
        run cuda-memory 200 memory.stdout "$GPU_CHECK" memory --out "$OUT/memory.json" \
            --size-mib "${GPU_CHECK_SIZE_MIB:-1024}" --iters "${GPU_CHECK_ITERS:-20}" ${DSOCK:+--daemon "$DSOCK"}
        if [ -n "$DSOCK" ]; then
            run cuda-memory-direct 150 memory-direct.stdout "$GPU_CHECK" memory --out "$OUT/memory-direct.json" \
                --size-mib "${GPU_CHECK_SIZE_MIB:-1024}" --iters "${GPU_CHECK_ITERS:-20}"
            # 3b. The C ABI: gpu_share (examples/c/gpu_share.c, in the bundle) shares GPU memory
            # between two processes through fabricd with the fmm_gpu_* calls.
            C_SHARE=""
            if [ -x "$BIN/gpu_share" ]; then
                C_SHARE=$BIN/gpu_share
                run cuda-c-share 60 c-share.txt "$C_SHARE" "$DSOCK"
            else
                printf 'cuda-c-share\tskipped\t0\tno gpu_share in %s\n' "$BIN" >>"$OUT/steps.tsv"
            fi
            # 3c. Through fabricd with a fabric handle instead of a descriptor (256 MiB), from
            # Rust and from C: only where the driver can make one, which takes an IMEX channel.
            if imex_channel >"$OUT/imex-channel.txt" 2>&1; then
                printf 'imex-channel\t0\t0\timex-channel.txt\n' >>"$OUT/steps.tsv"
                run cuda-memory-fabric 120 memory-fabric.stdout "$GPU_CHECK" memory \
                    --out "$OUT/memory-fabric.json" --size-mib 256 --iters 5 --daemon "$DSOCK" --share fabric
                [ -n "$C_SHARE" ] && run cuda-c-share-fabric 60 c-share-fabric.txt "$C_SHARE" "$DSOCK" fabric
            else
                printf 'cuda-memory-fabric\tskipped\t0\t%s\n' "$(cat "$OUT/imex-channel.txt")" >>"$OUT/steps.tsv"
            fi
        fi
    else
        printf 'cuda-memory\tskipped\t0\tCUDA not present\n' >>"$OUT/steps.tsv"
    fi
    stop_daemon
    if [ -n "${IMEX_MADE:-}" ]; then
        rm -f "$IMEX_MADE"
    fi
    # 4. The summary, written by the same binary from the files above.
    timeout 20 "$GPU_CHECK" summarize "$OUT" --out "$OUT/summary.json" --elapsed "$(($(date +%s) - START))"
    exit $?
fi

stop_daemon
# Without gpu_check the summary is what the shell knows.
printf '{"status":"failed","reason":"gpu_check binary not found in %s","exit":1}\n' "${BIN:-any bin dir}" \
    >"$OUT/summary.json"
exit 1
