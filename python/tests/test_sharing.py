"""Two Python processes share a region through export/import and see each other's numpy
writes; the importer's process is a real second interpreter (subprocess)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy

import fabric_mm
from conftest import MIB

CHILD = textwrap.dedent(
    """
    import sys, numpy, fabric_mm
    socket, handle = sys.argv[1], sys.argv[2]
    with fabric_mm.Session(socket) as s:
        m = s.map(s.import_(handle))
        a = numpy.asarray(m)
        expected = (numpy.arange(a.size) % 251).astype(numpy.uint8)
        assert (a[: 1 << 20] == expected[: 1 << 20]).all(), "owner's bytes differ"
        a[1 << 20 : (1 << 20) + 8] = 0xAB          # the importer's store
        print("stored", m.gfa, flush=True)
        assert sys.stdin.readline().strip() == "check"
        assert a[0] == 0xCD, "owner's second store not seen"
        print("seen", flush=True)
    """
)


def test_two_processes_share_numpy_writes(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(4 * MIB, device=gpu)
    m = session.map(region)
    a = numpy.asarray(m)
    a[:] = (numpy.arange(a.size) % 251).astype(numpy.uint8)
    handle = session.export(region)
    assert isinstance(handle, str)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, session.socket, handle],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().split()
        assert line[:1] == ["stored"], child.stderr.read() if child.stderr else ""
        assert int(line[1]) == m.gfa  # the same GFA in both processes
        assert list(a[MIB: MIB + 8]) == [0xAB] * 8 and a[MIB + 8] == (MIB + 8) % 251
        a[0] = 0xCD
        child.stdin.write("check\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "seen"
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.wait()
