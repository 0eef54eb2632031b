"""The GIL is released while a call waits for fabricd: another Python thread runs meanwhile.
The daemon here is a stand-in that accepts the connection and never answers, so opening a
session blocks for as long as it keeps the connection (2 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import List

import fabric_mm

SILENT = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.socket(socket.AF_UNIX)
    s.bind(sys.argv[1])
    s.listen()
    c, _ = s.accept()
    time.sleep(2)
    """
)


def test_a_blocked_call_lets_other_threads_run(tmp_path: Path) -> None:
    path = tmp_path / "silent.sock"
    server = subprocess.Popen([sys.executable, "-c", SILENT, str(path)])
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.01)
        outcome: List[BaseException] = []

        def open_session() -> None:
            try:
                fabric_mm.Session(str(path)).close()
            except fabric_mm.FabricError as e:
                outcome.append(e)

        blocked = threading.Thread(target=open_session)
        blocked.start()
        time.sleep(0.3)
        # With the GIL held by the blocked call this thread would only get here after it
        # returned (about 2 s after the accept), and would find it finished.
        spins = 0
        window = time.monotonic() + 0.2
        while time.monotonic() < window:
            spins += 1
        assert blocked.is_alive(), "the call returned early, or held the GIL while it waited"
        assert spins > 0
        blocked.join(30)
        assert not blocked.is_alive()
        # The stand-in hung up without a word: a connection error, not a hang or a crash.
        assert outcome and isinstance(outcome[0], (fabric_mm.DisconnectedError, fabric_mm.ProtocolError,
                                                   fabric_mm.ConnectError))
    finally:
        server.kill()
        server.wait()


LAST_HANDLE_IN_AN_ERROR = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, threading, time
    import fabric_mm, fabric_mm.errors
    faulthandler.dump_traceback_later(20, exit=True)
    socket, daemon = sys.argv[1], int(sys.argv[2])
    s = fabric_mm.Session(socket)
    gpu = next(d.id for d in s.devices() if any(c == "hbm" for c, _ in d.memory))
    region = s.alloc(2 << 20, device=gpu)
    original = fabric_mm.errors._from_native

    def resume() -> None:
        time.sleep(0.5)
        os.kill(daemon, signal.SIGCONT)

    def hook(*args):
        fabric_mm.errors._from_native = original
        region.free()  # the refused call's own handle is the region's last one now
        os.kill(daemon, signal.SIGSTOP)
        threading.Thread(target=resume).start()
        return original(*args)

    fabric_mm.errors._from_native = hook
    try:
        s.register(region, gpu, offset=region.size + 1)
    except fabric_mm.InvalidArgumentError:
        print("refused")
    """
)


def test_a_refused_call_lets_go_of_its_handles_without_the_gil(tmp_path: Path) -> None:
    # The error of a refused call is made by Python code, during which another thread
    # (here the error hook itself) may free the region the call holds a handle of; that
    # handle is then the last, and its drop is the Free round trip. Before, it was dropped
    # with the GIL held: with fabricd stopped and the thread that resumes it waiting for
    # the GIL, the process hung.
    from conftest import Daemon

    d = Daemon(tmp_path)
    try:
        run = subprocess.run([sys.executable, "-c", LAST_HANDLE_IN_AN_ERROR, d.socket, str(d.process.pid)],
                             capture_output=True, text=True, timeout=60)
    finally:
        os.kill(d.process.pid, signal.SIGCONT)
        d.stop()
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "refused", run.stdout + run.stderr
