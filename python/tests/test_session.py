"""Sessions: the version, socket resolution (the library's), the context manager, resume."""

from __future__ import annotations

import gc
import importlib.metadata
import os
import re
import time

import pytest

import fabric_mm
from conftest import MIB, ROOT, Daemon


def test_version_is_the_workspace_version() -> None:
    cargo = (ROOT / "Cargo.toml").read_text()
    section = cargo[cargo.index("[workspace.package]"):]
    match = re.search(r'^version\s*=\s*"([^"]+)"', section, re.M)
    assert match is not None
    assert fabric_mm.__version__ == match.group(1)
    assert importlib.metadata.version("fabric-mm") == match.group(1)


def test_fabric_socket_is_found_as_the_library_finds_it(daemon: Daemon,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_SOCKET", daemon.socket)
    assert fabric_mm.default_socket() == daemon.socket
    with fabric_mm.Session() as s:
        assert s.socket == daemon.socket
        s.ping()
    monkeypatch.delenv("FABRIC_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/nonexistent-run")
    expected = "/run/fabric/fabricd.sock" if os.geteuid() == 0 else "/nonexistent-run/fabric/fabricd.sock"
    assert fabric_mm.default_socket() == expected


def test_context_manager_closes(daemon: Daemon) -> None:
    with fabric_mm.Session(daemon.socket) as s:
        assert s.protocol_version >= (1, 0)
        assert s.id > 0
    assert s.closed
    with pytest.raises(fabric_mm.ClosedError) as e:
        s.ping()
    assert e.value.code == fabric_mm.errors.E_ARG
    assert isinstance(e.value, ValueError)


def test_objects_outlive_a_closed_session_handle(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(1 << 20, device=gpu)
    m = session.map(region)
    session.close()
    # The mapping holds the connection and the memory: still usable.
    m.memoryview()[0] = 5
    assert m.memoryview()[0] == 5


def test_resume_by_token(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = Daemon(tmp_path_factory.mktemp("grace"), extra="[memory]\ndetach_grace_s = 60\n")
    try:
        s = fabric_mm.Session(d.socket)
        gpu = next(x.id for x in s.devices() if x.kind == "gpu")
        region = s.alloc(1 << 20, device=gpu)
        handle = s.export(region)
        token = s.token()
        assert token is not None and re.fullmatch(r"[0-9a-f]{32}", token)
        s.disconnect()
        with pytest.raises(fabric_mm.DisconnectedError):
            s.ping()
        # The daemon takes a moment to see the connection go; until then the session is
        # not detached, and a resume finds nothing to take back.
        deadline = time.monotonic() + 10
        while True:
            try:
                back = fabric_mm.Session(d.socket, resume=token)
                break
            except fabric_mm.NotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with back:
            assert back.token() == token
            # The export came back with the session: it still imports.
            other = fabric_mm.Session(d.socket)
            other.import_(handle).release()
            other.close()
        with pytest.raises(fabric_mm.InvalidArgumentError):
            fabric_mm.Session(d.socket, resume="not a token")
    finally:
        d.stop()


def test_a_forked_child_leaves_its_parents_session_alone(session: fabric_mm.Session, gpu: str) -> None:
    # The child drops and uses objects made before the fork: refused there, and the
    # parent's session, region and import carry on (the child's drops once freed the
    # region in fabricd and shut the parent's socket down).
    regions = [session.alloc(MIB, device=gpu)]
    imports = [session.import_(session.export(regions[0]))]
    socket = session.socket
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                session.ping()
            except fabric_mm.ClosedError as e:
                code = 0 if "forked" in str(e) else 3
            regions.clear()
            imports.clear()
            gc.collect()
            # A new session works in the child.
            with fabric_mm.Session(socket) as child:
                child.ping()
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    session.ping()
    imports[0].check()
    assert session.map(regions[0]).size >= MIB
