"""Python's overhead on the control path, against the Rust library in the same run
(docs/BENCHMARKS.md, "Python binding"): import + map + unmap of an exported 2 MiB region
timed from Python, and `fabricctl bench libcontrol` (the same loop in Rust) on the same
fabricd, alternated round by round; plus what a view of a mapping costs (memoryview,
numpy.asarray, numpy.from_dlpack).

    target/python-venv/bin/python python/bench.py [--rounds 5] [--iterations 2000] [--json]

Needs the package installed (scripts/python-tests.sh does it), target/release/fabricd (or
$FABRICD) and target/release/fabricctl (or $FABRICCTL): both sides meet the same release
daemon, so its time does not dilute what Python adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy

import fabric_mm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))
from conftest import Daemon  # noqa: E402  (the tests' fabricd launcher)


def timed(n: int, f: Callable[[], object]) -> List[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        f()
        out.append((time.perf_counter_ns() - t) / 1000)
    return out


def python_import_map(socket: str, handle: str, n: int) -> float:
    """Median µs of import + map + unmap, as bench_libcontrol.rs times it (the release
    round trip after each is not in the figure)."""
    with fabric_mm.Session(socket, client_name="bench-python") as s:
        samples = []
        for i in range(n + n // 10):
            t = time.perf_counter_ns()
            imp = s.import_(handle)
            m = s.map(imp)
            m.unmap()
            elapsed = (time.perf_counter_ns() - t) / 1000
            imp.release()
            if i >= n // 10:  # the first tenth warms up
                samples.append(elapsed)
        return statistics.median(samples)


def rust_import_map(fabricctl: str, socket: str, n: int) -> float:
    out = subprocess.run([fabricctl, "bench", "libcontrol", "--socket", socket,
                          "--iterations", str(n), "--json"],
                         check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)["import_map_p50_us"])


def view_costs(socket: str, n: int) -> Dict[str, float]:
    with fabric_mm.Session(socket, client_name="bench-views") as s:
        gpu = next(d.id for d in s.devices() if d.kind == "gpu")
        m = s.map(s.alloc(2 << 20, device=gpu))
        base = bytearray(2 << 20)
        costs = {
            "memoryview_us": statistics.median(timed(n, lambda: m.memoryview().release())),
            "numpy_asarray_us": statistics.median(timed(n, lambda: numpy.asarray(m))),
            "numpy_from_dlpack_us": statistics.median(timed(n, lambda: numpy.from_dlpack(m))),
            "baseline_frombuffer_bytearray_us":
                statistics.median(timed(n, lambda: numpy.frombuffer(base, numpy.uint8))),
        }
        m.unmap()
        return costs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    fabricctl = os.environ.get("FABRICCTL", str(ROOT / "target" / "release" / "fabricctl"))
    os.environ.setdefault("FABRICD", str(ROOT / "target" / "release" / "fabricd"))
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp))
        try:
            with fabric_mm.Session(daemon.socket, client_name="bench-owner") as owner:
                gpu = next(d.id for d in owner.devices() if d.kind == "gpu")
                region = owner.alloc(2 << 20, device=gpu)
                handle = owner.export(region)
                rounds: List[Dict[str, float]] = []
                for _ in range(args.rounds):
                    rust = rust_import_map(fabricctl, daemon.socket, args.iterations)
                    py = python_import_map(daemon.socket, handle, args.iterations)
                    rounds.append({"rust_us": rust, "python_us": py, "ratio": py / rust})
                views = view_costs(daemon.socket, 20_000)
        finally:
            daemon.stop()
    result: Dict[str, Any] = {
        "bench": "python-import-map",
        "iterations": args.iterations,
        "rounds": rounds,
        "median_rust_us": statistics.median(r["rust_us"] for r in rounds),
        "median_python_us": statistics.median(r["python_us"] for r in rounds),
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "views": views,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for i, r in enumerate(rounds, 1):
            print(f"round {i}: rust {r['rust_us']:.1f} µs  python {r['python_us']:.1f} µs  ratio {r['ratio']:.2f}")
        print(f"median ratio {result['median_ratio']:.2f} (target ≤ 1.5)")
        for k, v in views.items():
            print(f"{k}: {v:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
