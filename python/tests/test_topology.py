"""Topology queries as plain data, and translate/reverse, on the HGX sim (8 H100s on
NVSwitches, as libfabric-mm/tests/topology.rs checks them from Rust)."""

from __future__ import annotations

import dataclasses

import pytest

import fabric_mm
from conftest import MIB


def test_devices_paths_and_nearest_memory(session: fabric_mm.Session) -> None:
    devices = session.devices()
    gpus = [d for d in devices if d.kind == "gpu"]
    assert len(gpus) == 8
    assert all(dataclasses.is_dataclass(d) for d in devices)
    assert all(c == "hbm" and size > 0 for c, size in gpus[0].memory)
    p = session.path(gpus[0].id, gpus[1].id)
    assert p.path_class == "NV18" and p.bandwidth_mbps == 5 * 25_000
    assert p.route[0] == gpus[0].id and p.route[-1] == gpus[1].id
    near = session.nearest_memory(gpus[0].id)
    assert near[0].device == gpus[0].id and near[0].memory == "hbm" and near[0].path.path_class == "X"
    assert {m.device for m in near[1:8]} == {g.id for g in gpus[1:]}
    assert all(m.memory == "dram" for m in session.nearest_memory(gpus[0].id, "dram"))
    with pytest.raises(fabric_mm.InvalidArgumentError):
        session.path(gpus[0].id, "uuid:GPU-nobody")


def test_alloc_nearest_translate_and_reverse(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc_nearest(gpu, MIB)
    assert region.gfa is not None
    [here, past] = session.translate([region.gfa + 4096, 1 << 56])
    assert here.kind == "resource" and here.device == gpu and here.memory == "hbm"
    assert here.ordinal is not None and here.offset is not None
    assert past.kind == "unmapped"
    back = session.reverse([(gpu, "hbm", here.ordinal, here.offset),
                            ("uuid:GPU-nobody", "hbm", 0, 0)])
    assert back == [region.gfa + 4096, None]
