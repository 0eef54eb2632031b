"""DMA registration (with the library's cache) and copies by fabricd's copy engine: wait,
poll, a callback and asyncio."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from typing import List, Optional, Tuple

import numpy
import numpy.typing
import pytest

import fabric_mm
from conftest import GRANULE, MIB


def pattern(n: int, seed: int) -> "numpy.typing.NDArray[numpy.uint8]":
    return ((numpy.arange(n) * 7 + seed) % 256).astype(numpy.uint8)


def test_register_and_copy_wait_and_poll(session: fabric_mm.Session, gpu: str) -> None:
    src, dst = session.alloc(2 * MIB, device=gpu), session.alloc(2 * MIB, device=gpu)
    a, b = numpy.asarray(session.map(src)), numpy.asarray(session.map(dst))
    a[:] = pattern(a.size, 3)
    rs = session.register(src, gpu, "ro")
    rd = session.register(dst, gpu, "rw")
    assert rs.access == "ro" and rd.size == 2 * MIB and rd.device == gpu
    assert session.copy(rd, rs, 2 * MIB).wait() == 2 * MIB
    assert (a == b).all()
    # The second half again, by offset, polled.
    a[MIB:] = pattern(MIB, 9)
    c = session.copy(rd.at(MIB), rs.at(MIB), MIB)
    n: Optional[int] = None
    for _ in range(10_000):
        n = c.poll()
        if n is not None:
            break
        c.wait(0.001)
    assert n == MIB and (b[MIB:] == pattern(MIB, 9)).all()


def test_registration_cache_hits(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(GRANULE, device=gpu)
    first = session.register(region, gpu)
    before = session.registration_stats()
    again = session.register(region, gpu)
    after = session.registration_stats()
    assert again.cached and again.id == first.id
    assert after["hits"] == before["hits"] + 1
    part = session.register(region, gpu, offset=4096, length=4096)
    assert part.id == first.id and part.id_offset == 4096 and part.iova == first.iova + 4096
    region.free()
    first.unregister()
    again.unregister()
    part.unregister()
    assert session.registration_stats()["invalidations"] >= 1


def test_host_buffer_copy_and_callback(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(GRANULE, device=gpu)
    m = session.map(region)
    numpy.asarray(m)[:MIB] = pattern(MIB, 5)
    host = session.alloc_host(MIB)
    reg = session.register(host, gpu)
    done = threading.Event()
    got: List[Tuple[Optional[int], Optional[fabric_mm.FabricError]]] = []

    def on_done(n: Optional[int], error: Optional[fabric_mm.FabricError]) -> None:
        got.append((n, error))
        done.set()

    session.copy(reg, m.gfa, MIB).on_complete(on_done)
    assert done.wait(10)
    assert got == [(MIB, None)]
    assert (numpy.asarray(host) == pattern(MIB, 5)).all()


def test_copy_awaited_in_asyncio(session: fabric_mm.Session, gpu: str) -> None:
    src, dst = session.alloc(GRANULE, device=gpu), session.alloc(GRANULE, device=gpu)
    ms, md = session.map(src), session.map(dst)
    numpy.asarray(ms)[:MIB] = pattern(MIB, 11)

    async def run() -> List[int]:
        halves = [session.copy(md.gfa + i * (MIB // 2), ms.gfa + i * (MIB // 2), MIB // 2)
                  for i in range(2)]
        return list(await asyncio.gather(*halves))

    assert asyncio.run(run()) == [MIB // 2, MIB // 2]
    assert (numpy.asarray(md)[:MIB] == pattern(MIB, 11)).all()


def test_a_copy_awaited_twice_gives_its_result_each_time(session: fabric_mm.Session, gpu: str) -> None:
    src, dst = session.alloc(GRANULE, device=gpu), session.alloc(GRANULE, device=gpu)
    ms, md = session.map(src), session.map(dst)

    async def awaited(c: fabric_mm.Copy) -> int:
        return await c

    async def twice() -> List[int]:
        c = session.copy(md.gfa, ms.gfa, MIB)
        first = await asyncio.wait_for(awaited(c), 10)
        # Again once the result was delivered (before: a hang), and by two tasks at once.
        again = await asyncio.wait_for(awaited(c), 10)
        both = await asyncio.wait_for(asyncio.gather(awaited(c), awaited(c)), 10)
        return [first, again, *both]

    assert asyncio.run(twice()) == [MIB] * 4

    async def cancelled_then_awaited() -> int:
        c = session.copy(md.gfa, ms.gfa, GRANULE)
        waiter = asyncio.ensure_future(awaited(c))
        await asyncio.sleep(0)  # the waiter awaits the copy now (or has its result)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return await asyncio.wait_for(awaited(c), 10)  # a cancelled await left the result

    assert asyncio.run(cancelled_then_awaited()) == GRANULE

    # One callback per copy: an await is one, and a second on_complete is refused.
    c = session.copy(md.gfa, ms.gfa, 4096)
    assert asyncio.run(awaited(c)) == 4096
    with pytest.raises(fabric_mm.InvalidArgumentError):
        c.on_complete(lambda n, err: None)
    c = session.copy(md.gfa, ms.gfa, 4096)
    c.on_complete(lambda n, err: None)
    with pytest.raises(fabric_mm.InvalidArgumentError):
        asyncio.run(awaited(c))


def test_copy_refusals_and_failures(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(GRANULE, device=gpu)
    assert region.gfa is not None
    with pytest.raises(fabric_mm.BadRequestError) as e:
        session.copy(region.gfa, region.gfa + 4096, 0)
    assert e.value.code == fabric_mm.errors.E_BAD_REQUEST
    with pytest.raises(fabric_mm.RefusedError):
        session.copy(region.gfa, region.gfa + MIB, GRANULE)  # past the end
    with pytest.raises(fabric_mm.InvalidArgumentError):
        session.copy("not an endpoint", region.gfa, 1)  # type: ignore[arg-type]
    # An int out of range is Python's own OverflowError (before: InvalidArgumentError).
    for out_of_range in (-1, 1 << 64):
        with pytest.raises(OverflowError):
            session.copy(out_of_range, region.gfa, 1)
        with pytest.raises(OverflowError):
            session.copy(region.gfa, out_of_range, 1)
    # A numpy integer is an int endpoint (its __index__), as for every int argument.
    assert session.copy(numpy.uint64(region.gfa + MIB), numpy.int64(region.gfa), 4096).wait() == 4096  # type: ignore[arg-type]

    gfa = region.gfa

    async def refused() -> int:
        return await session.copy(gfa, 1 << 52, 4096)

    with pytest.raises(fabric_mm.RefusedError):
        asyncio.run(refused())


def test_ctrl_c_in_a_callback_is_raised_again(session: fabric_mm.Session, gpu: str) -> None:
    # A KeyboardInterrupt raised inside a callback (what Ctrl-C does while the callback's
    # code runs, taking the signal's flag) reaches the main thread at its next check.
    # Before, it was printed as an unraisable exception and the Ctrl-C was lost.
    region = session.alloc(GRANULE, device=gpu)
    m = session.map(region)
    c = session.copy(m.gfa + MIB, m.gfa, MIB)
    assert c.wait() == MIB

    def interrupted(n: Optional[int], error: Optional[fabric_mm.FabricError]) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        c.on_complete(interrupted)  # done already: runs here, at once
        for _ in range(200):
            threading.Event().wait(0.01)


def test_an_interpreter_exits_cleanly_with_completions_on_their_way(session: fabric_mm.Session) -> None:
    # Copies whose completions reach the library's thread while the interpreter exits:
    # the callback must not attach to a finalizing interpreter (which ends the thread
    # inside the library's frames, or blocks it for good).
    child = textwrap.dedent(
        """
        import sys, fabric_mm
        s = fabric_mm.Session(sys.argv[1])
        gpu = next(d.id for d in s.devices() if d.kind == "gpu")
        size = 32 << 20
        src, dst = s.map(s.alloc(size, device=gpu)), s.map(s.alloc(size, device=gpu))
        for _ in range(8):
            s.copy(dst.gfa, src.gfa, size).on_complete(lambda n, err: print("done", n))
        """
    )
    for _ in range(10):
        run = subprocess.run([sys.executable, "-c", child, session.socket], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        assert "Fatal" not in run.stderr and "panicked" not in run.stderr, run.stderr
