"""The exception classes: hierarchy, the library's codes and messages, hints."""

from __future__ import annotations

import pytest

import fabric_mm
from fabric_mm import errors
from conftest import Daemon


def test_no_daemon_is_a_connect_error_with_a_hint(tmp_path: object) -> None:
    with pytest.raises(fabric_mm.ConnectError) as e:
        fabric_mm.Session(f"{tmp_path}/nobody.sock")
    assert e.value.code == errors.E_CONNECT
    assert isinstance(e.value, ConnectionError)
    assert "cannot reach fabricd" in e.value.message
    assert e.value.hint is not None and "FABRIC_SOCKET" in str(e.value)
    assert e.value.socket.endswith("nobody.sock")


def test_an_interrupt_while_an_error_is_built_goes_on_as_it_is(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C landing while the exception is made: before, it became a RuntimeError
    # ("fabric_mm.errors failed"), which `except KeyboardInterrupt` does not catch.
    def interrupted(*_: object) -> BaseException:
        raise KeyboardInterrupt

    monkeypatch.setattr(errors, "_from_native", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fabric_mm.Session(f"{tmp_path}/nobody.sock")

    def broken(*_: object) -> BaseException:
        raise ValueError("broken")

    monkeypatch.setattr(errors, "_from_native", broken)
    with pytest.raises(RuntimeError, match="and fabric_mm.errors failed"):
        fabric_mm.Session(f"{tmp_path}/nobody.sock")


def test_malformed_handle_is_an_argument_error(session: fabric_mm.Session) -> None:
    with pytest.raises(fabric_mm.InvalidArgumentError) as e:
        session.import_("definitely not a handle")
    assert e.value.code == errors.E_ARG
    assert e.value.message.startswith("handle:")


def test_a_handle_with_the_wrong_secret_is_refused(session: fabric_mm.Session, gpu: str) -> None:
    region = session.alloc(1 << 20, device=gpu)
    handle = session.export(region)
    # Same region and generation, another secret: the daemon refuses it.
    last = handle[-1]
    forged = handle[:-1] + ("0" if last != "0" else "1")
    with pytest.raises(fabric_mm.RefusedError) as e:
        session.import_(forged)
    assert e.value.code in (errors.E_INVALID_HANDLE, errors.E_PERMISSION, errors.E_NOT_FOUND)
    assert e.value.operation and e.value.daemon_code


def test_unknown_device_and_class(session: fabric_mm.Session, gpu: str) -> None:
    with pytest.raises(fabric_mm.RefusedError) as refused:
        session.alloc(1 << 20, device="uuid:GPU-nonexistent")
    assert refused.value.code < 0
    with pytest.raises(fabric_mm.InvalidArgumentError, match="cxl_volatile"):
        session.alloc(1 << 20, device=gpu, memory="flash")
    with pytest.raises(fabric_mm.InvalidArgumentError, match="exactly one"):
        session.alloc(1 << 20)
    with pytest.raises(OverflowError):
        session.alloc(-1, device=gpu)


def test_hierarchy() -> None:
    for cls in (fabric_mm.NotFoundError, fabric_mm.PermissionDeniedError, fabric_mm.LimitError,
                fabric_mm.BadRequestError, fabric_mm.InvalidHandleError):
        assert issubclass(cls, fabric_mm.RefusedError)
    for other in (fabric_mm.RefusedError, fabric_mm.RevokedError, fabric_mm.WindowError,
                  fabric_mm.ClosedError, fabric_mm.CopyFailedError, fabric_mm.ConnectError):
        assert issubclass(other, fabric_mm.FabricError)
    assert issubclass(fabric_mm.NotFoundError, LookupError)
    assert issubclass(fabric_mm.PermissionDeniedError, PermissionError)
    e = errors._from_native(errors.E_OS, "os", "mmap failed", {"errno": 12})
    assert isinstance(e, OSError) and e.errno == 12
    e = errors._from_native(errors.E_LIMIT, "refused", "too many", {"limit": ("regions", 3, 1, 3)})
    assert type(e) is fabric_mm.LimitError and e.limit == ("regions", 3, 1, 3)


def test_window_errors(daemon: Daemon, gpu: str) -> None:
    # A window that starts past the sim's GFAs cannot hold any of its regions.
    with fabric_mm.Session(daemon.socket, window_gfa=1 << 50, window_size=1 << 30) as s:
        region = s.alloc(1 << 20, device=gpu)
        with pytest.raises(fabric_mm.WindowError) as e:
            s.map(region)
        assert e.value.code == errors.E_OUTSIDE_WINDOW
        assert "FABRIC_MM_WINDOW" in str(e.value)
