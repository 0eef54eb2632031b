//! `Session`: one connection to fabricd, opened exactly as the Rust library opens one
//! (`SessionConfig`: `FABRIC_SOCKET`, then the defaults; the window from
//! `FABRIC_MM_WINDOW_*`; a resume token), with every library call of `fabric_mm::Session`
//! a method.

use std::path::PathBuf;
use std::sync::Arc;

use fabric_mm::{Policy, ResourceOffset, SessionConfig, Target, Token, WindowConfig};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::{PyTraverseError, PyVisit};

use crate::copy::{Copy, HostBuffer, Registration, endpoint};
use crate::error::{closed, invalid, to_py};
use crate::gil::{Slot, Visible, blocking};
use crate::memory::{Import, Mapping, Region, Source};
use crate::values;

/// The socket a session opens by default: `$FABRIC_SOCKET`, else
/// `/run/fabric/fabricd.sock` for root, else `$XDG_RUNTIME_DIR/fabric/fabricd.sock` (the
/// library's own resolution).
#[pyfunction]
pub(crate) fn default_socket(py: Python<'_>) -> PyResult<String> {
    fabric_mm::default_socket().map(|p| p.to_string_lossy().into_owned()).map_err(|e| to_py(py, e))
}

/// A session with fabricd (see `fabric_mm.Session`).
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct Session {
    slot: Slot<fabric_mm::Session>,
    revocation: Callback,
}

/// The revocation callback, held by the Python object (and shown to the collector) as
/// well as read by the library's closure: a callback that refers to its own session is a
/// cycle the collector breaks.
type Callback = Arc<Visible<PyAny>>;

impl Drop for Session {
    /// The callback goes with the Python object (it may hold objects that hold the
    /// library's session, which holds the closure: a cycle through Rust no collector sees).
    fn drop(&mut self) {
        self.revocation.clear();
    }
}

/// The Python session an object was made from, held by that object: the session — and
/// its revocation callback — lives as long as anything made from it (the library's
/// session does too), and the collector sees the reference, so a cycle through the
/// callback (a callback holding a region of its session) is collected.
pub(crate) type Owner = Visible<Session>;

impl Owner {
    pub(crate) fn of(session: &Bound<'_, Session>) -> Self {
        Self::new(Some(session.clone().unbind()))
    }

    /// Another holder of the same session.
    pub(crate) fn share(&self, py: Python<'_>) -> Self {
        Self::new(self.get(py))
    }
}

impl Session {
    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<std::sync::Arc<fabric_mm::Session>> {
        self.slot.get().ok_or_else(|| closed(py, "session"))
    }
}

#[pymethods]
impl Session {
    #[new]
    #[pyo3(signature = (socket=None, *, client_name=None, resume=None, window_gfa=None, window_size=None))]
    fn new(
        py: Python<'_>,
        socket: Option<PathBuf>,
        client_name: Option<String>,
        resume: Option<&str>,
        window_gfa: Option<u64>,
        window_size: Option<u64>,
    ) -> PyResult<Self> {
        let resume = resume.map(str::parse::<Token>).transpose().map_err(|e| to_py(py, e))?;
        // Either part of the window given: the rest from the environment, as the library
        // itself would take it.
        let window = match (window_gfa, window_size) {
            (None, None) => None,
            (gfa, len) => {
                let env = WindowConfig::from_env().map_err(|e| to_py(py, e))?;
                Some(WindowConfig { gfa: gfa.unwrap_or(env.gfa), len: len.unwrap_or(env.len) })
            }
        };
        let config = SessionConfig {
            socket,
            window,
            client_name: Some(client_name.unwrap_or_else(|| "fabric_mm-python".into())),
            resume,
            // A fenced page would crash the interpreter in whatever view reads it: a
            // revoked import of another node's memory is fenced softly, its views read
            // zeros (docs/python.md).
            keep_revoked_mappings: true,
        };
        let s = blocking(py, move || fabric_mm::Session::open_with(config))?;
        Ok(Self { slot: Slot::new(s), revocation: Callback::default() })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.revocation.traverse(&visit)
    }

    fn __clear__(&self) {
        self.revocation.clear();
    }

    /// Closes this handle on the session. Objects made from it (regions, imports,
    /// mappings, registrations) keep the connection until they go too.
    fn close(&self, py: Python<'_>) {
        // No more revocation calls from a closed handle (its imports and views may keep
        // the library's session): the library's callback is replaced first, which waits
        // for a call running on another thread (without the GIL, which that call may wait
        // for), then the cell is cleared.
        if let Ok(s) = self.get(py) {
            py.detach(move || s.on_revocation(|_| {}));
        }
        drop(self.revocation.replace(None));
        self.slot.close();
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        !self.slot.is_open()
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    /// The socket this session talks to.
    #[getter]
    fn socket(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.get(py)?.socket().to_string_lossy().into_owned())
    }

    /// The daemon's id of this session.
    #[getter]
    fn id(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.get(py)?.id())
    }

    /// The protocol version agreed with fabricd, `(major, minor)`.
    #[getter]
    fn protocol_version(&self, py: Python<'_>) -> PyResult<(u8, u8)> {
        let v = self.get(py)?.protocol_version();
        Ok((v.major, v.minor))
    }

    /// The resume token (32 hex digits; a secret), `None` with a protocol-1.0 daemon.
    fn token(&self, py: Python<'_>) -> PyResult<Option<String>> {
        Ok(self.get(py)?.token().map(|t| t.to_string()))
    }

    /// Drops the connection now, keeping this process's mappings.
    fn disconnect(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.get(py)?;
        py.detach(move || s.disconnect());
        Ok(())
    }

    /// One round trip to fabricd.
    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.get(py)?;
        blocking(py, move || s.ping())
    }

    /// Calls `callback(dict)` for every revocation of one of this session's imports (on
    /// the thread that reads the event, with the GIL); `None` stops the calls.
    fn on_revocation(&self, py: Python<'_>, callback: Option<Py<PyAny>>) -> PyResult<()> {
        // A closed handle's imports and views may keep the library's session, which goes
        // on calling what the cell holds: `None` still clears it.
        let s = match self.get(py) {
            Ok(s) => s,
            Err(_) if callback.is_none() => {
                drop(self.revocation.replace(None));
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        // The old callable goes here, with the GIL held.
        drop(self.revocation.replace(callback));
        // The library's closure calls whatever the cell holds then (nothing once `None`
        // was set): installed again each time for the library's rule that a replacement
        // waits for a call running on another thread — without the GIL, since that call
        // may be waiting for it. (From inside the callback it does not wait.)
        let cell = self.revocation.clone();
        py.detach(move || {
            s.on_revocation(move |r| {
                crate::gil::callback(|py| {
                    let Some(cb) = cell.get(py) else { return };
                    let call = values::revocation(py, r).and_then(|d| cb.call1(py, (d,)));
                    if let Err(e) = call {
                        crate::gil::unraisable(py, e, cb.bind(py));
                    }
                });
            });
        });
        Ok(())
    }

    #[pyo3(signature = (size, *, device=None, memory="hbm", set=None))]
    fn alloc(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        size: u64,
        device: Option<String>,
        memory: &str,
        set: Option<String>,
    ) -> PyResult<Region> {
        let target = match (device, set) {
            (Some(device), None) => {
                Target::Device { device, memory: values::class_of(memory).map_err(|e| to_py(py, e))? }
            }
            (None, Some(set)) => Target::Set(set),
            _ => return Err(invalid(py, "alloc takes exactly one of device= and set=")),
        };
        let s = slf.get().get(py)?;
        blocking(py, move || s.alloc(&target, size)).map(|r| Region::new(r, Owner::of(slf)))
    }

    fn alloc_nearest(slf: &Bound<'_, Self>, py: Python<'_>, device: String, size: u64) -> PyResult<Region> {
        let s = slf.get().get(py)?;
        blocking(py, move || s.alloc_nearest(&device, size)).map(|r| Region::new(r, Owner::of(slf)))
    }

    #[pyo3(signature = (region, *, uids=Vec::new(), gids=Vec::new(), partition=None, read_only=false))]
    fn export(
        &self,
        py: Python<'_>,
        region: &Region,
        uids: Vec<u32>,
        gids: Vec<u32>,
        partition: Option<String>,
        read_only: bool,
    ) -> PyResult<String> {
        // Both taken before either refusal is made (Python code: see `let_go`).
        let (s, r) = match (self.slot.get(), region.slot.get()) {
            (Some(s), Some(r)) => (s, r),
            (s, r) => {
                let which = if s.is_some() { "region" } else { "session" };
                crate::gil::let_go(py, (s, r));
                return Err(closed(py, which));
            }
        };
        let policy = Policy { uids, gids, partition, read_only };
        blocking(py, move || s.export(&r, &policy)).map(|h| h.to_string())
    }

    fn revoke(&self, py: Python<'_>, handle: &str) -> PyResult<()> {
        let h = handle.parse().map_err(|e| to_py(py, e))?;
        let s = self.get(py)?;
        blocking(py, move || s.revoke(&h))
    }

    #[pyo3(signature = (handle, writable=true))]
    fn import_handle(slf: &Bound<'_, Self>, py: Python<'_>, handle: &str, writable: bool) -> PyResult<Import> {
        let h = handle.parse().map_err(|e| to_py(py, e))?;
        let s = slf.get().get(py)?;
        blocking(py, move || s.import(&h, writable)).map(|i| Import::new(i, Owner::of(slf)))
    }

    fn map(slf: &Bound<'_, Self>, py: Python<'_>, memory: &Bound<'_, PyAny>) -> PyResult<Mapping> {
        let source = Source::of(py, memory)?;
        let Some(s) = slf.get().slot.get() else {
            crate::gil::let_go(py, source);
            return Err(closed(py, "session"));
        };
        let mapped = match source {
            Source::Region(r) => blocking(py, move || s.map(&*r)),
            Source::Import(i) => blocking(py, move || s.map(&*i)),
            other => {
                crate::gil::let_go(py, (s, other));
                return Err(invalid(py, "map takes a Region or an Import"));
            }
        }?;
        Ok(Mapping::new(mapped, Owner::of(slf)))
    }

    fn translate<'py>(&self, py: Python<'py>, gfas: Vec<u64>) -> PyResult<Bound<'py, PyList>> {
        let s = self.get(py)?;
        let found = blocking(py, move || s.translate(&gfas))?;
        let out = PyList::empty(py);
        for l in &found {
            out.append(values::location(py, l)?)?;
        }
        Ok(out)
    }

    /// `items`: `(device, memory class, ordinal, offset)` tuples.
    fn reverse(&self, py: Python<'_>, items: Vec<(String, String, u16, u64)>) -> PyResult<Vec<Option<u64>>> {
        let items = items
            .into_iter()
            .map(|(device, memory, ordinal, offset)| {
                Ok(ResourceOffset { device, memory: values::class_of(&memory)?, ordinal, offset })
            })
            .collect::<fabric_mm::Result<Vec<_>>>()
            .map_err(|e| to_py(py, e))?;
        let s = self.get(py)?;
        blocking(py, move || s.reverse(&items))
    }

    fn devices<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let s = self.get(py)?;
        let found = blocking(py, move || s.devices())?;
        let out = PyList::empty(py);
        for d in &found {
            out.append(values::device(py, d)?)?;
        }
        Ok(out)
    }

    fn path<'py>(&self, py: Python<'py>, a: String, b: String) -> PyResult<Bound<'py, PyDict>> {
        let s = self.get(py)?;
        let p = blocking(py, move || s.path(&a, &b))?;
        values::path(py, &p)
    }

    #[pyo3(signature = (device, memory=None))]
    fn nearest_memory<'py>(
        &self,
        py: Python<'py>,
        device: String,
        memory: Option<&str>,
    ) -> PyResult<Bound<'py, PyList>> {
        let only = memory.map(values::class_of).transpose().map_err(|e| to_py(py, e))?;
        let s = self.get(py)?;
        let found = blocking(py, move || s.nearest_memory(&device, only))?;
        let out = PyList::empty(py);
        for m in &found {
            out.append(values::near(py, m)?)?;
        }
        Ok(out)
    }

    /// Registers `memory` (a Region, Import, Mapping or HostBuffer; `length` bytes at
    /// `offset`, all of it by default) for DMA by `device`, through the session's cache.
    #[pyo3(signature = (memory, device, access="rw", *, offset=0, length=None))]
    fn register(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        memory: &Bound<'_, PyAny>,
        device: String,
        access: &str,
        offset: u64,
        length: Option<u64>,
    ) -> PyResult<Registration> {
        let access = values::access_of(access).map_err(|e| to_py(py, e))?;
        let src = Source::of(py, memory)?;
        let Some(s) = slf.get().slot.get() else {
            crate::gil::let_go(py, src);
            return Err(closed(py, "session"));
        };
        let Some(length) = length.or_else(|| src.len().checked_sub(offset)) else {
            crate::gil::let_go(py, (s, src));
            return Err(invalid(py, "offset lies past the memory"));
        };
        let reg = match src {
            Source::Region(m) => blocking(py, move || s.register_range(&*m, offset, length, &device, access)),
            Source::Import(m) => blocking(py, move || s.register_range(&*m, offset, length, &device, access)),
            Source::Mapping(m) => blocking(py, move || s.register_range(&*m, offset, length, &device, access)),
            Source::Host(m) => blocking(py, move || s.register_range(&*m, offset, length, &device, access)),
        }?;
        Ok(Registration::new(reg, Owner::of(slf)))
    }

    /// A page-aligned host buffer of at least `size` bytes, for registration.
    fn alloc_host(slf: &Bound<'_, Self>, py: Python<'_>, size: u64) -> PyResult<HostBuffer> {
        let s = slf.get().get(py)?;
        blocking(py, move || s.alloc_host(size)).map(|h| HostBuffer::new(h, Owner::of(slf)))
    }

    fn registration_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.get(py)?.registration_stats();
        values::registration_stats(py, &stats)
    }

    fn clear_registration_cache(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.get(py)?;
        py.detach(move || s.clear_registration_cache());
        Ok(())
    }

    /// Starts a copy of `length` bytes by fabricd's copy engine; endpoints are GFAs (int),
    /// Registrations (their first byte) or `Registration.at(offset)`.
    fn copy(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        dst: &Bound<'_, PyAny>,
        src: &Bound<'_, PyAny>,
        length: u64,
    ) -> PyResult<Copy> {
        let (dst, src) = (endpoint(py, dst)?, endpoint(py, src)?);
        let s = slf.get().get(py)?;
        blocking(py, move || s.copy(dst, src, length)).map(|c| Copy::new(c, Owner::of(slf)))
    }
}
