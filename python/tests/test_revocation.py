"""Revocation surfaces twice: as a callback (a Revocation dataclass, on the library's
thread) and as RevokedError from every later use of the import or its mapping."""

from __future__ import annotations

import gc
import queue
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from typing import Any, Tuple

import pytest

import fabric_mm
from conftest import MIB


def test_revoke_is_a_callback_and_an_exception(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(MIB, device=gpu)
    handle = session.export(region)
    seen: "queue.Queue[fabric_mm.Revocation]" = queue.Queue()
    with fabric_mm.Session(session.socket) as importer:
        importer.on_revocation(seen.put)
        imp = importer.import_(handle)
        m = importer.map(imp)
        m.check()
        session.revoke(handle)
        r = seen.get(timeout=5)
        assert r == fabric_mm.Revocation(region=region.id, generation=region.generation,
                                         import_id=imp.import_id, reason="revoked")
        with pytest.raises(fabric_mm.RevokedError) as e:
            m.check()
        assert e.value.code == fabric_mm.errors.E_REVOKED
        assert e.value.reason == "revoked" and e.value.region == region.id
        with pytest.raises(fabric_mm.RevokedError):
            imp.check()
        with pytest.raises(fabric_mm.RevokedError):
            importer.register(imp, gpu)
        # The pages stay mapped until unmapped: a view reads, it does not crash.
        assert m.memoryview()[0] == 0
        # A new import of the revoked handle is refused by the daemon, as revoked.
        with pytest.raises(fabric_mm.RevokedError) as refused:
            importer.import_(handle)
        assert refused.value.kind == "refused" and refused.value.daemon_code == "Revoked"


def test_owner_exit_revokes(session: fabric_mm.Session) -> None:
    owner = textwrap.dedent(
        """
        import sys, fabric_mm
        s = fabric_mm.Session(sys.argv[1])
        gpu = next(d.id for d in s.devices() if d.kind == "gpu")
        r = s.alloc(1 << 20, device=gpu)
        print(s.export(r), flush=True)
        sys.stdin.readline()
        """
    )
    child = subprocess.Popen([sys.executable, "-c", owner, session.socket],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        handle = child.stdout.readline().strip()
        seen: "queue.Queue[fabric_mm.Revocation]" = queue.Queue()
        session.on_revocation(seen.put)
        m = session.map(session.import_(handle))
        child.kill()
        assert seen.get(timeout=5).reason == "owner_exited"
        with pytest.raises(fabric_mm.RevokedError):
            m.check()
    finally:
        child.kill()
        child.wait()


def test_a_failing_callback_does_not_break_the_session(session: fabric_mm.Session, gpu: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reported: "queue.Queue[BaseException]" = queue.Queue()
    monkeypatch.setattr(sys, "unraisablehook",
                        lambda u: reported.put(u.exc_value) if u.exc_value else None)

    def broken(_: fabric_mm.Revocation) -> None:
        raise RuntimeError("callback bug")

    with fabric_mm.Session(session.socket) as importer:
        importer.on_revocation(broken)
        region = session.alloc(MIB, device=gpu)
        handle = session.export(region)
        imp = importer.import_(handle)
        session.revoke(handle)
        # Reported as unraisable; the session keeps answering.
        for _ in range(50):
            importer.ping()
            try:
                imp.check()
            except fabric_mm.RevokedError:
                break
        else:
            pytest.fail("the revocation never arrived")
        # Reported through sys.unraisablehook, as Python reports errors it cannot raise.
        assert "callback bug" in str(reported.get(timeout=5))
        importer.on_revocation(None)


def test_replacing_the_callback_while_it_runs(session: fabric_mm.Session, gpu: str) -> None:
    # A replacement waits for the callback running on the library's thread, and that
    # callback needs the GIL: on_revocation must wait without the GIL, or the two deadlock
    # (this test then hangs instead of passing).
    started, finished = threading.Event(), threading.Event()

    def slow(_: fabric_mm.Revocation) -> None:
        started.set()
        time.sleep(0.5)  # releases the GIL, and needs it back to return
        finished.set()

    with fabric_mm.Session(session.socket) as importer:
        importer.on_revocation(slow)
        region = session.alloc(MIB, device=gpu)
        handle = session.export(region)
        imp = importer.import_(handle)  # held: a released import is not revoked
        session.revoke(handle)
        assert started.wait(5)
        importer.on_revocation(None)
        assert finished.is_set()
        imp.release()


def test_a_callback_that_removes_itself(session: fabric_mm.Session, gpu: str) -> None:
    # A one-shot: the callback stops its own calls. This deadlocked the session while the
    # library held its callback lock across the call.
    calls: "queue.Queue[fabric_mm.Revocation]" = queue.Queue()
    with fabric_mm.Session(session.socket) as importer:

        def once(r: fabric_mm.Revocation) -> None:
            importer.on_revocation(None)
            calls.put(r)

        importer.on_revocation(once)
        regions = [session.alloc(MIB, device=gpu) for _ in range(2)]
        handles = [session.export(r) for r in regions]
        imports = [importer.import_(h) for h in handles]
        session.revoke(handles[0])
        assert calls.get(timeout=5).import_id == imports[0].import_id
        session.revoke(handles[1])
        for _ in range(100):
            importer.ping()  # answered: the session did not hang
            try:
                imports[1].check()
            except fabric_mm.RevokedError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the second revocation never arrived")
        assert calls.empty(), "called again after it removed itself"


def _a_session_its_callback_refers_to(importer: fabric_mm.Session,
                                      gpu: str) -> "Tuple[weakref.ref[fabric_mm.Session], Any]":
    """A session whose revocation callback refers to it (and holds its region), left as
    garbage: a weak reference to it, and `importer`'s import of its region."""
    s = fabric_mm.Session(importer.socket)
    region = s.alloc(MIB, device=gpu)
    imp = importer.import_(s.export(region))

    def uses_its_session(r: fabric_mm.Revocation, region: fabric_mm.Region = region) -> None:
        s.ping()

    s.on_revocation(uses_its_session)
    return weakref.ref(s), imp


def test_a_session_whose_callback_refers_to_it_is_collected(session: fabric_mm.Session,
                                                            gpu: str) -> None:
    # The callback refers to its own session: a cycle through the library's closure that
    # the collector did not see, so the session stayed open until exit.
    seen: "queue.Queue[fabric_mm.Revocation]" = queue.Queue()
    session.on_revocation(seen.put)
    ref, imp = _a_session_its_callback_refers_to(session, gpu)
    gc.collect()
    assert ref() is None, "the session was not collected"
    # Its region went with it: the importer is told.
    assert seen.get(timeout=5).import_id == imp.import_id
    session.on_revocation(None)


def test_a_cycle_collected_on_the_library_thread(session: fabric_mm.Session, gpu: str) -> None:
    # The collector may run on the thread that reads fabricd's socket, inside a callback:
    # a session collected there is dropped there (its region freed, its connection shut).
    seen: "queue.Queue[fabric_mm.Revocation]" = queue.Queue()
    session.on_revocation(seen.put)
    gc.disable()
    try:
        ref, imp = _a_session_its_callback_refers_to(session, gpu)
        collected: "queue.Queue[str]" = queue.Queue()

        def collect(r: fabric_mm.Revocation) -> None:
            gc.collect()
            collected.put(r.reason)

        with fabric_mm.Session(session.socket) as collector:
            collector.on_revocation(collect)
            mine = session.alloc(MIB, device=gpu)
            handle = session.export(mine)
            kept = collector.import_(handle)
            session.revoke(handle)
            assert collected.get(timeout=5) == "revoked"
            assert ref() is None, "the session was not collected"
            assert seen.get(timeout=5).import_id == imp.import_id
            collector.ping()
            del kept
    finally:
        gc.enable()
        session.on_revocation(None)


def test_the_callback_lives_as_long_as_an_object_made_from_the_session(
        session: fabric_mm.Session, gpu: str) -> None:
    # The session object goes, its import stays: revocations still reach its callback
    # (the import holds the session, and with it the callback).
    seen: "queue.Queue[fabric_mm.Revocation]" = queue.Queue()
    importer = fabric_mm.Session(session.socket)
    importer.on_revocation(seen.put)
    region = session.alloc(MIB, device=gpu)
    handle = session.export(region)
    imp = importer.import_(handle)
    del importer
    gc.collect()
    session.revoke(handle)
    assert seen.get(timeout=5).import_id == imp.import_id
    with pytest.raises(fabric_mm.RevokedError):
        imp.check()


def test_a_cycle_through_a_view_is_collected(session: fabric_mm.Session, gpu: str) -> None:
    # The callback holds a view of the session's own memory: the view's pin holds the
    # session, which holds the callback. The pin shows the session to the collector, so
    # the cycle goes (before, the session, its connection and its region stayed until exit).
    seen: "queue.Queue[fabric_mm.Revocation]" = queue.Queue()
    session.on_revocation(seen.put)

    def leave_a_cycle() -> fabric_mm.Import:
        s = fabric_mm.Session(session.socket)
        region = s.alloc(MIB, device=gpu)
        imp = session.import_(s.export(region))
        view = s.map(region).memoryview()

        def holds_a_view(r: fabric_mm.Revocation, view: memoryview = view) -> None:
            pass

        s.on_revocation(holds_a_view)
        return imp

    imp = leave_a_cycle()
    gc.collect()
    # The session's region went with it: the importer is told.
    assert seen.get(timeout=5).import_id == imp.import_id
    session.on_revocation(None)


def test_a_closed_session_calls_no_callback_and_can_clear_it(session: fabric_mm.Session,
                                                           gpu: str) -> None:
    # Closing ends the calls though the import and its view keep the library's session;
    # setting None on a closed handle is no error (before: ClosedError, and the callback
    # went on being called).
    calls: "queue.Queue[fabric_mm.Revocation]" = queue.Queue()
    region = session.alloc(MIB, device=gpu)
    handle = session.export(region)
    with fabric_mm.Session(session.socket) as importer:
        importer.on_revocation(calls.put)
        imp = importer.import_(handle)
        view = importer.map(imp).memoryview()
    importer.on_revocation(None)
    with pytest.raises(fabric_mm.ClosedError):
        importer.on_revocation(calls.put)
    session.revoke(handle)
    with pytest.raises(fabric_mm.RevokedError):
        for _ in range(500):
            imp.check()
            time.sleep(0.01)
    # The import is marked revoked just before callbacks run: give one time to show.
    time.sleep(0.2)
    assert calls.empty(), "a closed handle's callback was called"
    del view
