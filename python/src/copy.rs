//! DMA registrations, host buffers and copies by fabricd's copy engine. A copy's
//! completion arrives on the library's reader thread; `Copy.on_complete` hands it to a
//! Python callable there (the package builds its asyncio awaitable on that).

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_mm::{CopyEndpoint, CopyOutcome};
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use crate::error::{closed, invalid, to_py};
use crate::gil::{Detached, Slot};
use crate::memory::Pin;
use crate::session::Owner;

/// A page-aligned host buffer for registration (memfd-backed, not inherited by `fork`).
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct HostBuffer {
    slot: Slot<fabric_mm::HostBuffer>,
    owner: Owner,
    size: u64,
}

impl HostBuffer {
    pub(crate) fn new(h: fabric_mm::HostBuffer, owner: Owner) -> Self {
        let size = h.len();
        Self { slot: Slot::new(h), owner, size }
    }

    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<Arc<fabric_mm::HostBuffer>> {
        self.slot.get().ok_or_else(|| closed(py, "host buffer"))
    }
}

#[pymethods]
impl HostBuffer {
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.owner.traverse(&visit)
    }
    fn __clear__(&self) {
        self.owner.clear();
    }
    /// Bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }
    /// A holder of the buffer for one view.
    fn pin(&self, py: Python<'_>) -> PyResult<Pin> {
        Ok(Pin::host(self.get(py)?, self.owner.share(py)))
    }
    /// Lets go of the buffer (freed when its registrations and views are gone too).
    fn free(&self) {
        self.slot.close();
    }
}

/// Memory registered for DMA by a device.
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct Registration {
    slot: Slot<fabric_mm::Registration>,
    owner: Owner,
    id: u64,
    id_offset: u64,
    iova: u64,
    size: u64,
    device: String,
    access: &'static str,
    cached: bool,
}

impl Registration {
    pub(crate) fn new(r: fabric_mm::Registration, owner: Owner) -> Self {
        Self {
            owner,
            id: r.id(),
            id_offset: r.id_offset(),
            iova: r.iova(),
            size: r.len(),
            device: r.device().to_owned(),
            access: crate::values::access_name(r.access()),
            cached: r.cached(),
            slot: Slot::new(r),
        }
    }
}

#[pymethods]
impl Registration {
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.owner.traverse(&visit)
    }
    fn __clear__(&self) {
        self.owner.clear();
    }
    /// The daemon's registration id.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    /// Where its first byte lies in registration `id` (non-zero for a cached sub-range).
    #[getter]
    fn id_offset(&self) -> u64 {
        self.id_offset
    }
    /// IOVA of the first byte in the device's DMA domain.
    #[getter]
    fn iova(&self) -> u64 {
        self.iova
    }
    /// Bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }
    /// The device it is registered for.
    #[getter]
    fn device(&self) -> &str {
        &self.device
    }
    /// `"ro"` or `"rw"`.
    #[getter]
    fn access(&self) -> &'static str {
        self.access
    }
    /// Whether it came from (or went into) the session's registration cache.
    #[getter]
    fn cached(&self) -> bool {
        self.cached
    }
    /// A copy endpoint `offset` bytes into it.
    #[pyo3(signature = (offset=0))]
    fn at(&self, py: Python<'_>, offset: u64) -> PyResult<Endpoint> {
        let r = self.slot.get().ok_or_else(|| closed(py, "registration"))?;
        Ok(Endpoint { ep: r.at(offset) })
    }
    /// Lets go of it (unregistered unless the cache keeps it for reuse).
    fn unregister(&self) {
        self.slot.close();
    }
    fn __repr__(&self) -> String {
        format!(
            "Registration(id={}, iova={:#x}, size={:#x}, device={:?}, access={:?})",
            self.id, self.iova, self.size, self.device, self.access
        )
    }
}

/// One side of a copy: a GFA, or bytes of a registration.
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct Endpoint {
    ep: CopyEndpoint,
}

#[pymethods]
impl Endpoint {
    /// The endpoint at a GFA.
    #[staticmethod]
    fn gfa(gfa: u64) -> Self {
        Self { ep: CopyEndpoint::Gfa(gfa) }
    }
    fn __repr__(&self) -> String {
        match self.ep {
            CopyEndpoint::Gfa(g) => format!("Endpoint.gfa({g:#x})"),
            CopyEndpoint::Registration { id, offset } => format!("Endpoint(registration={id}, offset={offset:#x})"),
        }
    }
}

/// A copy endpoint out of a GFA (int), a Registration or an Endpoint.
pub(crate) fn endpoint(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<CopyEndpoint> {
    if let Ok(e) = obj.cast::<Endpoint>() {
        return Ok(e.get().ep);
    }
    if let Ok(r) = obj.cast::<Registration>() {
        let r = r.get().slot.get().ok_or_else(|| closed(py, "registration"))?;
        return Ok(CopyEndpoint::from(&*r));
    }
    // An int (or anything with `__index__`, a numpy integer) out of range raises Python's
    // own `OverflowError`, as every int argument does.
    match obj.extract::<u64>() {
        Ok(g) => return Ok(CopyEndpoint::Gfa(g)),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) => return Err(e),
        Err(_) => {}
    }
    Err(invalid(py, "a copy endpoint is a GFA (int), a Registration or Registration.at(offset)"))
}

/// A copy in flight or done; dropping it does not cancel it.
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct Copy {
    copy: Detached<Arc<fabric_mm::Copy>>,
    owner: Owner,
}

impl Copy {
    pub(crate) fn new(c: fabric_mm::Copy, owner: Owner) -> Self {
        Self { copy: Detached::new(Arc::new(c)), owner }
    }

    /// The copy, unless this is a child forked after it was made: its completion comes
    /// to the parent's reader thread, which the child does not have.
    fn live(&self, py: Python<'_>) -> PyResult<&Arc<fabric_mm::Copy>> {
        self.copy.here().ok_or_else(|| closed(py, "copy"))
    }
}

/// How long a wait sleeps with the GIL released before it looks for a signal (Ctrl-C).
const SIGNAL_TICK: Duration = Duration::from_millis(100);

#[pymethods]
impl Copy {
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.owner.traverse(&visit)
    }
    fn __clear__(&self) {
        self.owner.clear();
    }
    /// The daemon's copy id.
    #[getter]
    fn id(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.live(py)?.id())
    }

    /// Bytes copied once it is done, `None` while it runs; raises why it stopped.
    fn poll(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        self.live(py)?.poll().transpose().map_err(|e| to_py(py, e))
    }

    /// Waits (GIL released) until it is done and returns the bytes copied, or until
    /// `timeout` seconds pass (`None`); raises why it stopped.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<u64>> {
        let deadline = match timeout {
            None => None,
            Some(t) if t.is_finite() && t >= 0.0 => Some(Instant::now() + Duration::from_secs_f64(t.min(1e9))),
            Some(_) => return Err(invalid(py, "timeout must be a finite number of seconds, ≥ 0")),
        };
        let copy = Arc::clone(self.live(py)?);
        loop {
            let step = deadline.map_or(SIGNAL_TICK, |d| d.saturating_duration_since(Instant::now()).min(SIGNAL_TICK));
            let c = Arc::clone(&copy);
            if let Some(r) = py.detach(move || c.wait_timeout(step)) {
                return r.map(Some).map_err(|e| to_py(py, e));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            py.check_signals()?;
        }
    }

    /// Calls `callback(bytes, error)` once when it is done — `(n, None)` or
    /// `(None, FabricError)` — on the library's reader thread, with the GIL (or here at
    /// once when it is done already). After this, `poll` and `wait` report nothing. One
    /// callback per copy: a second one raises `InvalidArgumentError`.
    fn on_complete(&self, py: Python<'_>, callback: Py<PyAny>) -> PyResult<()> {
        let c = Arc::clone(self.live(py)?);
        py.detach(move || c.on_complete(move |r: CopyOutcome| deliver(&callback, r))).map_err(|e| to_py(py, e))
    }

    fn __repr__(&self) -> String {
        self.copy.here().map_or_else(|| "Copy(of the parent process)".to_owned(), |c| format!("Copy(id={})", c.id()))
    }
}

fn deliver(callback: &Py<PyAny>, r: CopyOutcome) {
    crate::gil::callback(|py| {
        let args = match r {
            Ok(n) => (Some(n), None),
            Err(e) => (None, Some(to_py(py, e).into_value(py))),
        };
        if let Err(e) = callback.call1(py, args) {
            crate::gil::unraisable(py, e, callback.bind(py));
        }
    });
}
