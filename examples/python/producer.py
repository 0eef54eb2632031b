"""Producer: "prefill" a toy KV cache into fabric memory on a GPU, export it, and print the
handle on stdout for a consumer (another process, another runtime) to import — the
hand-off of a disaggregated-serving prefill node to its decode node. Waits until the
consumer marks the cache consumed, then exits (which frees the region).

    python3 examples/python/producer.py | python3 examples/python/consumer.py
"""

from __future__ import annotations

import sys
import time

import numpy

import fabric_mm
from kvcache import BYTES, HEAD_DIM, HEADS, LAYERS, MAGIC, SHAPE, TOKENS, checksum, views


def main() -> int:
    with fabric_mm.Session(client_name="kv-producer") as s:
        gpu = next(d.id for d in s.devices() if any(c == "hbm" for c, _ in d.memory))
        region = s.alloc(BYTES, device=gpu)
        mapping = s.map(region)
        header, kv = views(mapping)
        rng = numpy.random.default_rng(7)
        kv[...] = rng.standard_normal(SHAPE, dtype=numpy.float32).astype(numpy.float16)
        header[0] = (MAGIC, LAYERS, TOKENS, HEADS, HEAD_DIM, checksum(kv), 0)
        print(s.export(region), flush=True)
        print(f"producer: {LAYERS} layers x {TOKENS} tokens on {gpu} at GFA {mapping.gfa:#x}",
              file=sys.stderr)
        deadline = time.monotonic() + 60
        while header["consumed"][0] == 0:
            if time.monotonic() > deadline:
                print("producer: no consumer within 60 s", file=sys.stderr)
                return 1
            time.sleep(0.01)
        print("producer: consumed; freeing the cache", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
