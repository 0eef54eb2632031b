"""Zero-copy views of a mapping (memoryview, numpy, DLPack) and their lifetime: views keep
the mapping alive. unmap() stops new views; the memory stays mapped — never freed, never
PROT_NONE under a live view — until the last view goes, which the window shows: the GFA
range cannot be mapped again until then."""

from __future__ import annotations

import gc

import numpy
import pytest

import fabric_mm
from conftest import GRANULE, MIB


def test_memoryview_and_numpy_share_the_bytes(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(2 * MIB, device=gpu)
    m = session.map(region)
    view = m.memoryview()
    assert len(view) == m.size == len(m) == 2 * MIB
    assert not view.readonly and view.format == "B"
    a = numpy.asarray(m)
    b = numpy.frombuffer(m.memoryview(), dtype=numpy.uint8)
    assert a.ctypes.data == b.ctypes.data == m.address  # no copies
    a[:4] = [1, 2, 3, 4]
    assert bytes(view[:4]) == b"\x01\x02\x03\x04" and list(b[:4]) == [1, 2, 3, 4]
    words = numpy.asarray(m, dtype=numpy.uint32)
    assert words.shape == (MIB // 2,)
    copied = numpy.array(m, copy=True)
    copied[0] = 99
    assert a[0] == 1


def test_views_keep_the_mapping_alive(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(2 * MIB, device=gpu)
    m = session.map(region)
    a = numpy.asarray(m)
    a[-1] = 42
    m.unmap()
    assert not m.mapped
    with pytest.raises(fabric_mm.ClosedError):
        m.memoryview()
    # Still mapped under the array: reading and writing are safe.
    assert a[-1] == 42
    a[0] = 7
    # …and the range is still taken in the window.
    with pytest.raises(fabric_mm.WindowError) as e:
        session.map(region)
    assert e.value.code == fabric_mm.errors.E_ALREADY_MAPPED
    del a
    gc.collect()
    again = session.map(region)
    assert numpy.asarray(again)[0] == 7


def test_freeing_the_region_keeps_the_mapping(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(GRANULE, device=gpu)
    m = session.map(region)
    region.free()
    with pytest.raises(fabric_mm.ClosedError):
        session.export(region)
    numpy.asarray(m)[:] = 3
    assert int(numpy.asarray(m).sum()) == 3 * GRANULE


def test_dlpack_round_trip_with_numpy(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(GRANULE, device=gpu)
    m = session.map(region)
    assert m.__dlpack_device__() == (1, 0)
    a = numpy.from_dlpack(m)
    assert a.dtype == numpy.uint8 and a.shape == (GRANULE,)
    assert a.ctypes.data == m.address
    a[10] = 77
    assert m.memoryview()[10] == 77
    # A capsule holds the mapping too, consumed or not.
    capsule = m.__dlpack__()
    m.unmap()
    with pytest.raises(fabric_mm.WindowError):
        session.map(region)
    del capsule
    assert a[10] == 77
    del a
    gc.collect()
    session.map(region).unmap()


def test_dlpack_refusals(session: fabric_mm.Session, gpu: str) -> None:
    m = session.map(session.alloc(GRANULE, device=gpu))
    with pytest.raises(BufferError):
        m.__dlpack__(stream=1)
    with pytest.raises(BufferError):
        m.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        m.__dlpack__(copy=True)


def test_read_only_views_refuse_stores(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(GRANULE, device=gpu)
    handle = session.export(region, read_only=True)
    with fabric_mm.Session(session.socket) as other:
        imported = other.import_(handle, writable=False)
        assert not imported.copy_only, "a local export is mapped, never copy-only"
        m = other.map(imported)
        assert not m.writable
        view = m.memoryview()
        assert view.readonly
        with pytest.raises(TypeError):
            view[0] = 1
        a = numpy.asarray(m)
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 1
        # Legacy DLPack has no read-only flag: refused rather than handed out writable.
        with pytest.raises(BufferError):
            m.__dlpack__()
        d = numpy.from_dlpack(m)
        assert not d.flags.writeable


def test_flush_and_invalidate_check_their_range(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(2 * MIB, device=gpu)
    m = session.map(region)
    assert m.coherent  # this node's own memory: both are no-ops past the range check
    numpy.asarray(m)[:4] = [1, 2, 3, 4]
    m.flush()
    m.flush(0, 4)
    m.invalidate(2 * MIB - 1, 1)
    for offset, size in [(2 * MIB, 1), (0, 0), (2 * MIB - 1, 2)]:
        with pytest.raises(fabric_mm.FabricError) as e:
            m.flush(offset, size)
        assert e.value.code == fabric_mm.errors.E_ARG
    assert list(numpy.asarray(m)[:4]) == [1, 2, 3, 4]
