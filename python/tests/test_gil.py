"""The GIL is released while a call waits for fabricd: another Python thread runs meanwhile.
The daemon here is a stand-in that accepts the connection and never answers, so opening a
session blocks for as long as it keeps the connection (2 s)."""

from __future__ import annotations

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
