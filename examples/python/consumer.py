"""Consumer: read the handle from stdin (or argv), import and map the producer's KV cache
at its GFA, check it in place (no copy), "decode" from it, and tell the producer it is
done by a store into the shared header.

    python3 examples/python/producer.py | python3 examples/python/consumer.py
"""

from __future__ import annotations

import sys

import numpy

import fabric_mm
from kvcache import MAGIC, checksum, views


def main() -> int:
    handle = sys.argv[1] if len(sys.argv) > 1 else sys.stdin.readline().strip()
    with fabric_mm.Session(client_name="kv-consumer") as s:
        with s.map(s.import_(handle)) as mapping:
            header, kv = views(mapping)
            h = header[0]
            if h["magic"] != MAGIC or checksum(kv) != h["checksum"]:
                print("consumer: the cache does not check out", file=sys.stderr)
                return 1
            # One "decode step": attention of the last token's query against layer 0's keys.
            q = kv[0, 0, -1].astype(numpy.float32)
            scores = numpy.einsum("hd,thd->ht", q, kv[0, 0].astype(numpy.float32))
            print(f"consumer: {h['layers']} layers x {h['tokens']} tokens at GFA {mapping.gfa:#x}, "
                  f"checksum ok, top token per head {scores.argmax(axis=1).tolist()}")
            header["consumed"] = 1
            del header, kv  # views keep the mapping alive; let them go before unmapping
    return 0


if __name__ == "__main__":
    sys.exit(main())
