"""The layout the producer and consumer agree on: a toy KV cache in one fabric region — a
header, then for each layer the keys and the values of every token as float16."""

from __future__ import annotations

from typing import Any, Tuple

import numpy

MAGIC = 0x4B56_4341_4348_4531  # "KVCACHE1"
LAYERS, TOKENS, HEADS, HEAD_DIM = 4, 256, 8, 64
# magic, layers, tokens, heads, head_dim, checksum, consumed flag (set by the consumer)
HEADER = numpy.dtype([("magic", "<u8"), ("layers", "<u4"), ("tokens", "<u4"), ("heads", "<u4"),
                      ("head_dim", "<u4"), ("checksum", "<u8"), ("consumed", "<u8")])
HEADER_BYTES = 64
SHAPE: Tuple[int, ...] = (LAYERS, 2, TOKENS, HEADS, HEAD_DIM)  # layer, K/V, token, head, dim
BYTES = HEADER_BYTES + int(numpy.prod(SHAPE)) * 2


def views(mapping: Any) -> Tuple[Any, Any]:
    """The header record and the KV tensor, both views of the mapping (no copies)."""
    raw = numpy.asarray(mapping)
    header = raw[: HEADER.itemsize].view(HEADER)
    kv = raw[HEADER_BYTES:BYTES].view(numpy.float16).reshape(SHAPE)
    return header, kv


def checksum(kv: Any) -> int:
    return int(kv.view(numpy.uint16).astype(numpy.uint64).sum())
