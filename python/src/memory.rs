//! Regions, imports and mappings. A `Mapping` is unmapped when its last holder goes: the
//! Python object until `unmap()`, and every view made of it — a `Pin` (the buffer
//! exporter the package builds memoryviews and numpy arrays on) or a DLPack capsule. So
//! `unmap()` while a view lives only stops new views; the view goes on reading mapped
//! memory, never freed or `PROT_NONE` pages, and the window range is freed with the last.

use std::sync::Arc;

use fabric_mm::Memory;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use crate::copy::HostBuffer;
use crate::error::{closed, invalid};
use crate::gil::Slot;
use crate::session::Owner;

/// Memory a call accepts, out of its Python object.
pub(crate) enum Source {
    Region(Arc<fabric_mm::Region>),
    Import(Arc<fabric_mm::Import>),
    Mapping(Arc<fabric_mm::Mapping>),
    Host(Arc<fabric_mm::HostBuffer>),
}

impl Source {
    pub(crate) fn of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(r) = obj.cast::<Region>() {
            return r.get().get(py).map(Source::Region);
        }
        if let Ok(i) = obj.cast::<Import>() {
            return i.get().get(py).map(Source::Import);
        }
        if let Ok(m) = obj.cast::<Mapping>() {
            return m.get().get(py).map(Source::Mapping);
        }
        if let Ok(h) = obj.cast::<HostBuffer>() {
            return h.get().get(py).map(Source::Host);
        }
        // The package wraps Mapping and HostBuffer (for the buffer protocol): once.
        if let Ok(inner) = obj.getattr("_native")
            && (inner.cast::<Mapping>().is_ok() || inner.cast::<HostBuffer>().is_ok())
        {
            return Self::of(py, &inner);
        }
        Err(invalid(py, "expected a Region, an Import, a Mapping or a HostBuffer"))
    }

    pub(crate) fn len(&self) -> u64 {
        match self {
            Source::Region(m) => m.len(),
            Source::Import(m) => m.len(),
            Source::Mapping(m) => m.len() as u64,
            Source::Host(m) => m.len(),
        }
    }
}

/// Memory this session allocated; freed in fabricd when it and its mappings are gone.
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct Region {
    pub(crate) slot: Slot<fabric_mm::Region>,
    owner: Owner,
    id: u64,
    generation: u64,
    size: u64,
    gfa: Option<u64>,
}

impl Region {
    pub(crate) fn new(r: fabric_mm::Region, owner: Owner) -> Self {
        let (id, generation, size, gfa) = (r.id(), r.generation(), r.len(), r.gfa());
        Self { slot: Slot::new(r), owner, id, generation, size, gfa }
    }

    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<Arc<fabric_mm::Region>> {
        self.slot.get().ok_or_else(|| closed(py, "region"))
    }
}

#[pymethods]
impl Region {
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.owner.traverse(&visit)
    }
    fn __clear__(&self) {
        self.owner.clear();
    }
    /// The daemon's region id.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    /// The region's generation.
    #[getter]
    fn generation(&self) -> u64 {
        self.generation
    }
    /// Bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }
    /// GFA of the first byte, when the daemon placed it in the map.
    #[getter]
    fn gfa(&self) -> Option<u64> {
        self.gfa
    }
    /// Lets go of the region: fabricd frees it (exports revoked) once its mappings are gone.
    fn free(&self) {
        self.slot.close();
    }
    fn __repr__(&self) -> String {
        format!("Region(id={}, generation={}, size={:#x}, gfa={:?})", self.id, self.generation, self.size, self.gfa)
    }
}

/// Another session's region, by handle; released when it and its mappings are gone.
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct Import {
    slot: Slot<fabric_mm::Import>,
    owner: Owner,
    import_id: u64,
    id: u64,
    size: u64,
    gfa: Option<u64>,
    writable: bool,
    copy_only: bool,
}

impl Import {
    pub(crate) fn new(i: fabric_mm::Import, owner: Owner) -> Self {
        let (import_id, id, size, gfa, writable) = (i.import_id(), i.id(), i.len(), i.gfa(), i.writable());
        let copy_only = i.copy_only();
        Self { slot: Slot::new(i), owner, import_id, id, size, gfa, writable, copy_only }
    }

    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<Arc<fabric_mm::Import>> {
        self.slot.get().ok_or_else(|| closed(py, "import"))
    }
}

#[pymethods]
impl Import {
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.owner.traverse(&visit)
    }
    fn __clear__(&self) {
        self.owner.clear();
    }
    /// The daemon's import id.
    #[getter]
    fn import_id(&self) -> u64 {
        self.import_id
    }
    /// The region it names.
    #[getter]
    fn id(&self) -> u64 {
        self.id
    }
    /// Bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }
    /// GFA of the first byte.
    #[getter]
    fn gfa(&self) -> Option<u64> {
        self.gfa
    }
    /// Whether it was imported read-write.
    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }
    /// Whether fabricd granted it copy-only (another node's memory with no memory fabric
    /// between the nodes): `map` raises `CopyOnlyError`; copy to and from its `gfa`.
    #[getter]
    fn copy_only(&self) -> bool {
        self.copy_only
    }
    /// Raises `RevokedError` once fabricd revoked it.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let i = self.get(py)?;
        let checked = i.check();
        crate::gil::outcome(py, i, checked)
    }
    /// Lets go of the import (released in fabricd once its mappings are gone).
    fn release(&self) {
        self.slot.close();
    }
    fn __repr__(&self) -> String {
        format!("Import(import_id={}, region={}, size={:#x}, gfa={:?})", self.import_id, self.id, self.size, self.gfa)
    }
}

/// Memory placed at its GFA in the session's window.
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct Mapping {
    slot: Slot<fabric_mm::Mapping>,
    owner: Owner,
    address: usize,
    size: usize,
    gfa: u64,
    writable: bool,
}

impl Mapping {
    pub(crate) fn new(m: fabric_mm::Mapping, owner: Owner) -> Self {
        let (address, size, gfa, writable) = (m.as_ptr() as usize, m.len(), m.gfa(), m.writable());
        Self { slot: Slot::new(m), owner, address, size, gfa, writable }
    }

    pub(crate) fn get(&self, py: Python<'_>) -> PyResult<Arc<fabric_mm::Mapping>> {
        self.slot.get().ok_or_else(|| closed(py, "mapping"))
    }
}

#[pymethods]
impl Mapping {
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.owner.traverse(&visit)
    }
    fn __clear__(&self) {
        self.owner.clear();
    }
    /// Address of the first byte in this process.
    #[getter]
    fn address(&self) -> usize {
        self.address
    }
    /// Bytes.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }
    /// GFA of the first byte.
    #[getter]
    fn gfa(&self) -> u64 {
        self.gfa
    }
    /// Whether stores are allowed.
    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }
    /// Whether `unmap()` was not called yet.
    #[getter]
    fn mapped(&self) -> bool {
        self.slot.is_open()
    }
    /// Raises `RevokedError` once the memory behind it was revoked (its pages stay mapped
    /// until it is unmapped).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let m = self.get(py)?;
        let checked = m.check();
        crate::gil::outcome(py, m, checked)
    }
    /// Whether the hardware keeps this host's caches coherent with the memory, making
    /// `flush` and `invalidate` no-ops (the grant's coherence: `Mapping::coherent`).
    #[getter]
    fn coherent(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.get(py)?.coherent())
    }
    /// Writes this host's stores to `size` bytes at `offset` (default: to the end) back
    /// to memory, for a fabric without hardware coherence (CXL.mem shared across hosts).
    #[pyo3(signature = (offset=0, size=None))]
    fn flush(&self, py: Python<'_>, offset: u64, size: Option<u64>) -> PyResult<()> {
        let m = self.get(py)?;
        let size = size.unwrap_or_else(|| (m.len() as u64).saturating_sub(offset));
        // A cache line at a time over what may be gigabytes: without the GIL.
        crate::gil::blocking(py, move || m.flush(offset, size))
    }
    /// Drops this host's cached copies of `size` bytes at `offset` (written back first),
    /// so that the next load reads what another host stored.
    #[pyo3(signature = (offset=0, size=None))]
    fn invalidate(&self, py: Python<'_>, offset: u64, size: Option<u64>) -> PyResult<()> {
        let m = self.get(py)?;
        let size = size.unwrap_or_else(|| (m.len() as u64).saturating_sub(offset));
        crate::gil::blocking(py, move || m.invalidate(offset, size))
    }
    /// Stops new views; the memory is unmapped when the last view made earlier goes.
    fn unmap(&self) {
        self.slot.close();
    }
    /// A holder of the mapping for one view (see the module's note).
    fn pin(&self, py: Python<'_>) -> PyResult<Pin> {
        let m = self.get(py)?;
        Ok(Pin {
            held: Some(Held::Mapping(m)),
            _owner: self.owner.share(py),
            born: crate::gil::Born::now(),
            address: self.address,
            size: self.size,
            writable: self.writable,
        })
    }
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pin = self.pin(py)?;
        crate::dlpack::export(py, pin, stream.is_some(), max_version, dl_device, copy)
    }
    fn __dlpack_device__(&self) -> (i32, i32) {
        crate::dlpack::CPU_DEVICE
    }
    fn __repr__(&self) -> String {
        format!(
            "Mapping(gfa={:#x}, size={:#x}, writable={}, mapped={})",
            self.gfa,
            self.size,
            self.writable,
            self.mapped()
        )
    }
}

/// What a pin holds alive.
#[derive(Debug)]
pub(crate) enum Held {
    Mapping(#[allow(dead_code)] Arc<fabric_mm::Mapping>),
    Host(#[allow(dead_code)] Arc<fabric_mm::HostBuffer>),
}

/// Holds mapped memory alive for one view; the memory stays mapped (and the address
/// valid) for as long as the pin lives.
#[pyclass(module = "fabric_mm._native", frozen)]
#[derive(Debug)]
pub struct Pin {
    held: Option<Held>,
    /// The session it was made from (a view may outlive every other object).
    _owner: Owner,
    born: crate::gil::Born,
    address: usize,
    size: usize,
    writable: bool,
}

impl Pin {
    pub(crate) fn host(h: Arc<fabric_mm::HostBuffer>, owner: Owner) -> Self {
        let (address, size) = (h.as_ptr() as usize, h.len() as usize);
        Self { held: Some(Held::Host(h)), _owner: owner, born: crate::gil::Born::now(), address, size, writable: true }
    }

    pub(crate) fn parts(&self) -> (usize, usize, bool) {
        (self.address, self.size, self.writable)
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        // The last holder of a mapping may free or release memory in fabricd: a round trip.
        crate::gil::drop_detached(self.held.take(), self.born);
    }
}

#[pymethods]
impl Pin {
    // The session it holds, shown to the collector: a cycle through a view (a revocation
    // callback holding an array of this memory) is collected.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self._owner.traverse(&visit)
    }
    fn __clear__(&self) {
        self._owner.clear();
    }
    #[getter]
    fn address(&self) -> usize {
        self.address
    }
    #[getter]
    fn size(&self) -> usize {
        self.size
    }
    #[getter]
    fn writable(&self) -> bool {
        self.writable
    }
}
