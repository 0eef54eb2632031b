"""fabric_mm: fabric memory from Python — the Python binding of libfabric-mm.

A :class:`Session` talks to fabricd (``$FABRIC_SOCKET``, else the library's defaults).
Memory is allocated (:meth:`Session.alloc`), exported as a handle (a ``str``), imported by
another process (:meth:`Session.import_`) and mapped at its global fabric address
(:meth:`Session.map`): the :class:`Mapping` exposes the bytes without copies through
:meth:`Mapping.memoryview`, ``numpy.asarray`` and DLPack. Memory is registered for DMA
(:meth:`Session.register`) and copied by fabricd's copy engine (:meth:`Session.copy`: wait,
poll, or ``await``). Every blocking call releases the GIL. See docs/python.md.

Views keep the mapping alive: :meth:`Mapping.unmap` stops new views, and the memory is
unmapped when the last memoryview, array or DLPack tensor made of it goes.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple, Union

from . import _native
from .errors import (
    BadRequestError, ClosedError, ConnectError, CopyFailedError, CopyOnlyError, DeviceError,
    DisconnectedError, FabricError, InvalidArgumentError, InvalidHandleError, LimitError,
    NotFoundError, NotSupportedError, PermissionDeniedError, ProtocolError, RefusedError,
    RevokedError, SystemCallError, WindowError,
)
from ._native import Endpoint, Import, Region, Registration

__version__: str = _native.__version__

__all__ = [
    "Session", "Region", "Import", "Mapping", "HostBuffer", "Registration", "Endpoint", "Copy",
    "Device", "Path", "NearMemory", "Location", "Revocation", "default_socket",
    "FabricError", "ConnectError", "DisconnectedError", "ProtocolError", "RefusedError",
    "PermissionDeniedError", "NotFoundError", "InvalidHandleError", "LimitError",
    "NotSupportedError", "BadRequestError", "RevokedError", "WindowError",
    "InvalidArgumentError", "ClosedError", "CopyFailedError", "CopyOnlyError", "SystemCallError",
    "DeviceError",
    "__version__",
]


def default_socket() -> str:
    """The socket a Session opens by default: ``$FABRIC_SOCKET``, else
    ``/run/fabric/fabricd.sock`` for root, else ``$XDG_RUNTIME_DIR/fabric/fabricd.sock``."""
    return _native.default_socket()


@dataclass(frozen=True)
class Device:
    """A device and its memory: ``memory`` is ``[(class, bytes), …]``."""

    id: str
    kind: str
    node: Optional[str]
    memory: List[Tuple[str, int]]


@dataclass(frozen=True)
class Path:
    """The widest path between two devices. ``path_class`` as ``nvidia-smi topo -m`` writes
    it (``X``, ``NV18``, ``PIX``, ``SYS``, …); bandwidths per direction in MB/s."""

    path_class: str
    bandwidth_mbps: Optional[int]
    max_bandwidth_mbps: Optional[int]
    latency_ns: Optional[int]
    route: List[str]
    degraded_links: int


@dataclass(frozen=True)
class NearMemory:
    """A memory resource and the path to it from the device asked about."""

    device: str
    memory: str
    size: int
    path: Path


@dataclass(frozen=True)
class Location:
    """Where a GFA lands: ``kind`` is ``"resource"`` (then device, memory, ordinal, offset
    and the interleave ``set``), ``"hole"`` (``owner``), ``"unmapped"``,
    ``"not_in_partition"`` or ``"remote"``: in another node's slot of the domain (then
    ``node``, ``live``, and device, memory, ordinal and offset for a resource of that node,
    ``set`` and offset for one of its interleave sets, neither for a hole of its slot)."""

    kind: str
    device: Optional[str] = None
    memory: Optional[str] = None
    ordinal: Optional[int] = None
    offset: Optional[int] = None
    set: Optional[str] = None
    owner: Optional[str] = None
    node: Optional[str] = None
    live: Optional[bool] = None


@dataclass(frozen=True)
class Revocation:
    """An import of this session was revoked: ``reason`` is ``"revoked"``, ``"freed"``,
    ``"owner_exited"`` or ``"device_lost"``."""

    region: int
    generation: int
    import_id: int
    reason: str


def _view(pin: _native.Pin) -> memoryview:
    # A ctypes array is the buffer exporter: CPython's limited API (which the abi3 wheel
    # is built against) has no buffer protocol before 3.11, ctypes has one everywhere. The
    # array holds the pin, the memoryview the array, an ndarray the memoryview: whoever
    # holds the last of them keeps the memory mapped.
    array = (ctypes.c_ubyte * pin.size).from_address(pin.address)
    array._fabric_pin = pin  # type: ignore[attr-defined]
    view = memoryview(array).cast("B")
    return view if pin.writable else view.toreadonly()


class _Bytes:
    """Zero-copy access to pinned bytes: memoryview, numpy, and (3.12+) the buffer protocol."""

    __slots__ = ("__weakref__",)

    def _pin(self) -> _native.Pin:
        raise NotImplementedError

    @property
    def size(self) -> int:
        """Bytes."""
        raise NotImplementedError

    def memoryview(self) -> memoryview:
        """The bytes as a memoryview, without a copy (read-only when the memory is)."""
        return _view(self._pin())

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> Any:
        # numpy.asarray(m): a uint8 array on the memory itself (copy=True: a copy).
        import numpy

        array = numpy.frombuffer(self.memoryview(), dtype=numpy.uint8)
        if dtype is not None and numpy.dtype(dtype) != array.dtype:
            array = array.view(dtype)
        return array.copy() if copy else array

    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int) -> memoryview:
            view = self.memoryview()
            if view.readonly and flags & 0x1:  # PyBUF_WRITABLE
                raise BufferError("the memory is read-only")
            return view

    def __len__(self) -> int:
        return self.size


class Mapping(_Bytes):
    """Memory placed at its GFA in the session's window (from :meth:`Session.map`)."""

    __slots__ = ("_native",)

    def __init__(self, native: _native.Mapping) -> None:
        self._native = native

    def _pin(self) -> _native.Pin:
        return self._native.pin()

    @property
    def gfa(self) -> int:
        """GFA of the first byte."""
        return self._native.gfa

    @property
    def address(self) -> int:
        """Address of the first byte in this process."""
        return self._native.address

    @property
    def size(self) -> int:
        """Bytes."""
        return self._native.size

    @property
    def writable(self) -> bool:
        """Whether stores are allowed."""
        return self._native.writable

    @property
    def mapped(self) -> bool:
        """False once :meth:`unmap` was called (views made before may still hold it)."""
        return self._native.mapped

    @property
    def coherent(self) -> bool:
        """Whether :meth:`flush` and :meth:`invalidate` are no-ops, as the daemon's grant
        says: not for CXL memory shared by several hosts, yes for memory only this host
        reaches, the sim's shared files and NVLink (docs/libfabric-mm.md, "Coherence")."""
        return self._native.coherent

    def check(self) -> None:
        """Raises :class:`RevokedError` once the memory was revoked."""
        self._native.check()

    def flush(self, offset: int = 0, size: Optional[int] = None) -> None:
        """Writes this host's stores in ``size`` bytes (to the end: ``None``) at ``offset``
        back to memory, before another host loads them. A range not inside the mapping
        raises :class:`FabricError` (``E_ARG``)."""
        self._native.flush(offset, size)

    def invalidate(self, offset: int = 0, size: Optional[int] = None) -> None:
        """Drops this host's cached copies of the range (written back first), so that the
        next load reads what another host stored. Range errors as :meth:`flush`."""
        self._native.invalidate(offset, size)

    def unmap(self) -> None:
        """Stops new views; unmapped when the last view made before goes."""
        self._native.unmap()

    def __enter__(self) -> "Mapping":
        return self

    def __exit__(self, *exc: object) -> None:
        self.unmap()

    def __dlpack__(self, *, stream: Any = None, max_version: Optional[Tuple[int, int]] = None,
                   dl_device: Optional[Tuple[int, int]] = None, copy: Optional[bool] = None) -> Any:
        """A DLPack capsule of the bytes (1-D uint8, CPU), holding the mapping."""
        return self._native.__dlpack__(stream=stream, max_version=max_version,
                                       dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._native.__dlpack_device__()

    def __repr__(self) -> str:
        return repr(self._native)


class HostBuffer(_Bytes):
    """A page-aligned host buffer for DMA registration (from :meth:`Session.alloc_host`)."""

    __slots__ = ("_native",)

    def __init__(self, native: _native.HostBuffer) -> None:
        self._native = native

    def _pin(self) -> _native.Pin:
        return self._native.pin()

    @property
    def size(self) -> int:
        """Bytes."""
        return self._native.size

    def free(self) -> None:
        """Lets go of it (freed when its registrations and views are gone)."""
        self._native.free()


def _settle(future: "asyncio.Future[int]", n: Optional[int], error: Optional[BaseException]) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(n if n is not None else 0)


class Copy:
    """A copy by fabricd's copy engine: :meth:`wait`, :meth:`poll`, :meth:`on_complete`, or
    ``await`` it (one of them: a callback or an await takes the result). It may be awaited
    any number of times, by several tasks of the event loop of its first ``await``: all get
    the same result."""

    __slots__ = ("_native", "_future")

    def __init__(self, native: _native.Copy) -> None:
        self._native = native
        # The one future every await of this copy shares (its result goes to one callback).
        self._future: "Optional[asyncio.Future[int]]" = None

    @property
    def id(self) -> int:
        return self._native.id

    def poll(self) -> Optional[int]:
        """Bytes copied when done, ``None`` while it runs; raises why it stopped."""
        return self._native.poll()

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Waits (GIL released) and returns the bytes copied; ``None`` after ``timeout``
        seconds; raises why it stopped."""
        return self._native.wait(timeout)

    def on_complete(self, callback: Callable[[Optional[int], Optional[FabricError]], None]) -> None:
        """``callback(bytes, None)`` or ``callback(None, error)``, once, on the library's
        thread: it must not block or call the session. One callback per copy (an ``await``
        counts as one): a second raises :class:`InvalidArgumentError`."""
        self._native.on_complete(callback)

    def __await__(self) -> Generator[Any, None, int]:
        future = self._future
        if future is None:
            loop = asyncio.get_running_loop()
            made: "asyncio.Future[int]" = loop.create_future()

            def done(n: Optional[int], error: Optional[FabricError]) -> None:
                try:
                    loop.call_soon_threadsafe(_settle, made, n, error)
                except RuntimeError:
                    pass  # the loop closed before the copy ended: nobody awaits it any more

            self._native.on_complete(done)  # raises when a callback took the result
            future = self._future = made
        # Shielded: a cancelled await leaves the shared future (and the result) to the
        # other awaits and to later ones.
        return (yield from asyncio.shield(future).__await__())

    def __repr__(self) -> str:
        return repr(self._native)


Memory = Union[Region, Import]
Registrable = Union[Region, Import, Mapping, HostBuffer]
EndpointLike = Union[int, Registration, Endpoint]


class Session:
    """A session with fabricd; a context manager (closed on exit).

    ``socket``: the daemon's socket (default :func:`default_socket`); ``resume``: a token
    from :meth:`token` to take a session back; ``window_gfa``/``window_size``: the unified
    window (default: GFA 0, 16 TiB, or ``FABRIC_MM_WINDOW_GFA``/``_SIZE``).
    """

    __slots__ = ("_native", "__weakref__")

    def __init__(self, socket: Optional[str] = None, *, client_name: Optional[str] = None,
                 resume: Optional[str] = None, window_gfa: Optional[int] = None,
                 window_size: Optional[int] = None) -> None:
        self._native = _native.Session(socket, client_name=client_name, resume=resume,
                                       window_gfa=window_gfa, window_size=window_size)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes this handle; objects made from it keep the connection until they go."""
        self._native.close()

    @property
    def closed(self) -> bool:
        return self._native.closed

    @property
    def socket(self) -> str:
        return self._native.socket

    @property
    def id(self) -> int:
        """The daemon's id of this session."""
        return self._native.id

    @property
    def protocol_version(self) -> Tuple[int, int]:
        return self._native.protocol_version

    def token(self) -> Optional[str]:
        """The resume token (a secret: 32 hex digits)."""
        return self._native.token()

    def disconnect(self) -> None:
        """Drops the connection now, keeping this process's mappings."""
        self._native.disconnect()

    def ping(self) -> None:
        """One round trip to fabricd."""
        self._native.ping()

    def on_revocation(self, callback: Optional[Callable[[Revocation], None]]) -> None:
        """Calls ``callback(Revocation)`` for each revocation of this session's imports, on
        the thread that reads fabricd's event: the library's, or one of yours inside a call
        of this session. It must not block or call the session, except to remove or replace
        itself (``on_revocation`` inside it returns at once); ``None`` stops it."""
        if callback is None:
            self._native.on_revocation(None)
            return
        cb = callback

        def deliver(d: Any) -> None:
            cb(Revocation(**d))

        self._native.on_revocation(deliver)

    def alloc(self, size: int, *, device: Optional[str] = None, memory: str = "hbm",
              set: Optional[str] = None) -> Region:
        """Allocates ``size`` bytes: on ``device`` (memory class ``memory``) or on the
        interleave set ``set``."""
        return self._native.alloc(size, device=device, memory=memory, set=set)

    def alloc_nearest(self, device: str, size: int) -> Region:
        """Allocates on the memory nearest to ``device`` that has room."""
        return self._native.alloc_nearest(device, size)

    def export(self, region: Region, *, uids: Sequence[int] = (), gids: Sequence[int] = (),
               partition: Optional[str] = None, read_only: bool = False) -> str:
        """Exports a region; the handle is text for another process."""
        return self._native.export(region, uids=list(uids), gids=list(gids),
                                   partition=partition, read_only=read_only)

    def revoke(self, handle: str) -> None:
        """Revokes an export: importers are told, new imports fail."""
        self._native.revoke(handle)

    def import_(self, handle: str, writable: bool = True) -> Import:
        """Imports the region a handle names."""
        return self._native.import_handle(handle, writable)

    import_handle = import_

    def map(self, memory: Memory) -> Mapping:
        """Maps a region or import at its GFA in the window."""
        return Mapping(self._native.map(memory))

    def translate(self, gfas: Sequence[int]) -> List[Location]:
        """Where each GFA lands (at most 1,024 per call)."""
        return [Location(**d) for d in self._native.translate(list(gfas))]

    def reverse(self, items: Sequence[Tuple[str, str, int, int]]) -> List[Optional[int]]:
        """The GFA of each ``(device, memory class, ordinal, offset)``, ``None`` where it
        has none this session may see."""
        return self._native.reverse(list(items))

    def devices(self) -> List[Device]:
        """The devices fabricd shows this session."""
        return [Device(d["id"], d["kind"], d["node"], list(d["memory"])) for d in self._native.devices()]

    def path(self, a: str, b: str) -> Path:
        """The path between two devices."""
        return Path(**self._native.path(a, b))

    def nearest_memory(self, device: str, memory: Optional[str] = None) -> List[NearMemory]:
        """Memory nearest to ``device`` first (of class ``memory`` only, when given)."""
        return [NearMemory(m["device"], m["memory"], m["size"], Path(**m["path"]))
                for m in self._native.nearest_memory(device, memory)]

    def register(self, memory: Registrable, device: str, access: str = "rw", *,
                 offset: int = 0, length: Optional[int] = None) -> Registration:
        """Registers memory for DMA by ``device`` (``access`` ``"ro"`` or ``"rw"``), through
        the session's registration cache."""
        return self._native.register(memory, device, access, offset=offset, length=length)

    def alloc_host(self, size: int) -> HostBuffer:
        """A page-aligned host buffer of at least ``size`` bytes, for registration."""
        return HostBuffer(self._native.alloc_host(size))

    def registration_stats(self) -> Dict[str, int]:
        """The registration cache's counters and the live registrations."""
        return dict(self._native.registration_stats())

    def clear_registration_cache(self) -> None:
        self._native.clear_registration_cache()

    def copy(self, dst: EndpointLike, src: EndpointLike, length: int) -> Copy:
        """Starts a copy by fabricd's copy engine; endpoints are GFAs, registrations, or
        ``Registration.at(offset)``."""
        return Copy(self._native.copy(dst, src, length))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"id={self.id}"
        return f"Session({state})"
