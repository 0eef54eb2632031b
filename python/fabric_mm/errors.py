"""The exceptions of fabric_mm: one class per kind of failure, each carrying the library's
code (the C ABI's ``FMM_E_*``, negative), its message, a fix hint where there is one, and
the numbers of the failure (``details``, also as attributes)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

# The C ABI's codes (libfabric-mm/include/fabric_mm.h).
E_CONNECT = -1
E_PROTOCOL = -2
E_DISCONNECTED = -3
E_PERMISSION = -10
E_NOT_FOUND = -11
E_INVALID_HANDLE = -12
E_REVOKED = -13
E_LIMIT = -14
E_NO_SPACE = -15
E_NOT_IMPLEMENTED = -16
E_BAD_REQUEST = -17
E_REFUSED = -19
E_WINDOW = -20
E_OUTSIDE_WINDOW = -21
E_NO_GFA = -22
E_ALREADY_MAPPED = -23
E_MEMLOCK = -24
E_COPY_ONLY = -25
E_ARG = -30
E_OS = -31
E_DEVICE = -33


class FabricError(Exception):
    """Any failure of fabric_mm. ``code``: the library's code; ``kind``: what failed, in a
    word (``"connect"``, ``"refused"``, ``"revoked"``, …); ``message``: the library's text;
    ``hint``: how to fix it, when known; ``details``: the failure's numbers."""

    code: int
    kind: str
    message: str
    hint: Optional[str]
    details: Dict[str, Any]

    def __init__(self, message: str, code: int = E_REFUSED, kind: str = "refused",
                 details: Optional[Dict[str, Any]] = None, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.kind = kind
        self.details = dict(details or {})
        self.hint = hint
        if isinstance(self, OSError) and "errno" in self.details:
            # OSError has an errno attribute of its own, which __getattr__ never sees.
            setattr(self, "errno", self.details["errno"])

    def __getattr__(self, name: str) -> Any:
        # The failure's numbers as attributes (e.args stays the message alone).
        details = self.__dict__.get("details", {})
        if name in details:
            return details[name]
        raise AttributeError(name)

    def __str__(self) -> str:
        if self.hint and self.hint not in self.message:
            return f"{self.message} (hint: {self.hint})"
        return self.message


class ConnectError(FabricError, ConnectionError):
    """No fabricd answers at the socket."""


class DisconnectedError(FabricError, ConnectionError):
    """The connection to fabricd closed; the session's objects are gone with it."""


class ProtocolError(FabricError):
    """fabricd's answer did not decode, or was not the one asked for."""


class RefusedError(FabricError):
    """fabricd refused the operation; ``daemon_code`` names why, ``operation`` what."""


class PermissionDeniedError(RefusedError, PermissionError):
    """The export's policy or the caller's rights refuse it."""


class NotFoundError(RefusedError, LookupError):
    """No such device, region, registration or interleave set."""


class InvalidHandleError(RefusedError, ValueError):
    """The handle names nothing (a wrong secret, a freed region)."""


class LimitError(RefusedError):
    """A limit refuses it: fabricd's per-client and per-user limits, no space, or
    ``RLIMIT_MEMLOCK``; ``limit`` is ``(what, used, requested, max)`` when known."""


class NotSupportedError(RefusedError):
    """fabricd does not do this (yet), or not for this kind of memory."""


class BadRequestError(RefusedError, ValueError):
    """fabricd found the request malformed (an empty copy, a range past the memory, …)."""


class RevokedError(FabricError):
    """The memory was revoked (owner exited, export revoked, region freed, device lost);
    ``region``, ``generation``, ``reason``."""


class WindowError(FabricError):
    """The unified window cannot hold it: not reserved, outside it, no GFA, or the range
    is mapped already."""


class CopyOnlyError(FabricError):
    """The memory is granted copy-only (a region another node serves that way): it has no
    descriptor and cannot be mapped; copy to and from its GFA instead."""


class InvalidArgumentError(FabricError, ValueError):
    """An argument is out of range (checked before anything reaches fabricd)."""


class ClosedError(FabricError, ValueError):
    """The object was closed, freed, released or unmapped."""


class CopyFailedError(FabricError):
    """A copy stopped before every byte moved; ``bytes`` says how many did."""


class SystemCallError(FabricError, OSError):
    """A system call failed (``errno``)."""


class DeviceError(FabricError):
    """A device driver refused, or is not there (CUDA)."""


_BY_KIND: Dict[str, Type[FabricError]] = {
    "connect": ConnectError,
    "disconnected": DisconnectedError,
    "protocol": ProtocolError,
    "revoked": RevokedError,
    "window": WindowError,
    "outside_window": WindowError,
    "no_gfa": WindowError,
    "already_mapped": WindowError,
    "copy_only": CopyOnlyError,
    "memlock": LimitError,
    "pinned_limit": LimitError,
    "daemon_memlock": LimitError,
    "invalid_argument": InvalidArgumentError,
    "closed": ClosedError,
    "os": SystemCallError,
    "copy_failed": CopyFailedError,
    "device": DeviceError,
}

_BY_CODE: Dict[int, Type[FabricError]] = {
    E_PERMISSION: PermissionDeniedError,
    E_NOT_FOUND: NotFoundError,
    E_INVALID_HANDLE: InvalidHandleError,
    E_REVOKED: RevokedError,
    E_LIMIT: LimitError,
    E_NO_SPACE: LimitError,
    E_NOT_IMPLEMENTED: NotSupportedError,
    E_BAD_REQUEST: BadRequestError,
}

_HINTS: Dict[str, str] = {
    "connect": "start fabricd (scripts/run.sh), or point FABRIC_SOCKET at its socket",
    "disconnected": "fabricd went away; open a new Session (or resume one with its token)",
    "revoked": "stop using the memory and unmap it; the owner took it back",
    "outside_window": "widen the window: Session(window_gfa=..., window_size=...) or "
                      "FABRIC_MM_WINDOW_GFA / FABRIC_MM_WINDOW_SIZE",
    "already_mapped": "one mapping per GFA range in a process: unmap the other mapping "
                      "and let its views go first",
    "closed": "make a new one; a closed object stays closed",
}


def _from_native(code: int, kind: str, message: str, details: Dict[str, Any]) -> FabricError:
    """The exception for a library error (called by fabric_mm._native)."""
    cls = _BY_KIND.get(kind)
    if cls is None:
        cls = _BY_CODE.get(code, RefusedError) if kind == "refused" else FabricError
    return cls(message, code=code, kind=kind, details=details, hint=_HINTS.get(kind))


__all__ = [name for name, value in list(globals().items())
           if isinstance(value, type) and issubclass(value, FabricError)] + [
    name for name in list(globals()) if name.startswith("E_")]
