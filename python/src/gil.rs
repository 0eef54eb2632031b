//! The GIL rules of the binding: every call that may block (a round trip to fabricd, a
//! wait, a drop that frees or releases in the daemon) runs with the GIL released. Besides
//! letting other Python threads run, this is what keeps callbacks from deadlocking: the
//! library runs revocation and copy callbacks on whichever thread reads fabricd's socket,
//! and those callbacks take the GIL — a thread that held the GIL while it waited for
//! fabricd's answer could wait forever behind one.
//!
//! And the process's life around those objects: no callback attaches to an interpreter
//! that is exiting ([`EXITING`]), and a child forked after an object was made neither uses
//! nor drops it ([`Born`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use crate::error::to_py;

/// Runs `f` with the GIL released; a library error becomes its Python exception.
pub(crate) fn blocking<T: Send>(py: Python<'_>, f: impl FnOnce() -> fabric_mm::Result<T> + Send) -> PyResult<T> {
    py.detach(f).map_err(|e| to_py(py, e))
}

/// Set by an `atexit` hook (registered when the module loads) once the interpreter begins
/// to exit: from then on no callback attaches to it. A thread that attaches while the
/// interpreter finalizes is ended inside the library's frames (CPython before 3.14) or
/// blocks forever (3.14), and the module's abi3 build leaves that check to us.
static EXITING: AtomicBool = AtomicBool::new(false);

#[pyfunction]
fn _interpreter_exiting() {
    EXITING.store(true, Ordering::SeqCst);
}

/// Forks since the module loaded in this process's line: each child after `fork()` (an
/// `os.register_at_fork` hook) counts one more. The child has the parent's sessions'
/// descriptors and state but not their reader threads, and not the window's mappings
/// (`MADV_DONTFORK`). An object made before the fork ([`Born`]) is neither used nor dropped
/// there: a use is an error, and a drop forgets the library object rather than end the
/// parent's session (a Free, a Release or a shutdown of the shared socket, a join of a
/// thread that does not exist, an unmap of whatever the child mapped there since).
static FORKS: AtomicU64 = AtomicU64::new(0);

#[pyfunction]
fn _after_fork_in_child() {
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// Whether this process is a child forked after the module loaded.
pub(crate) fn forked() -> bool {
    FORKS.load(Ordering::SeqCst) > 0
}

/// The process an object was made in (see [`FORKS`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Born(u64);

impl Born {
    pub(crate) fn now() -> Self {
        Self(FORKS.load(Ordering::SeqCst))
    }

    /// Whether this is still the process it was made in.
    pub(crate) fn here(self) -> bool {
        self.0 == FORKS.load(Ordering::SeqCst)
    }
}

/// Registers [`EXITING`]'s hook with `atexit` and [`FORKS`]'s with `os.register_at_fork`.
pub(crate) fn register_hooks(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let hook = wrap_pyfunction!(_interpreter_exiting, m)?;
    py.import("atexit")?.call_method1("register", (hook,))?;
    let child = wrap_pyfunction!(_after_fork_in_child, m)?;
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("after_in_child", child)?;
    py.import("os")?.call_method("register_at_fork", (), Some(&kwargs))?;
    Ok(())
}

/// What a callback of the application's raised, `e`, with nobody to raise it to: a
/// `KeyboardInterrupt` (Ctrl-C while the callback ran, which took the signal's flag) is
/// raised again in the main thread at its next check, as if the signal came now;
/// anything else is reported as unraisable (`sys.unraisablehook`), naming `callback`.
pub(crate) fn unraisable(py: Python<'_>, e: PyErr, callback: &Bound<'_, PyAny>) {
    if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) {
        // SAFETY: sets the interpreter's pending-signal flag; the GIL is held.
        unsafe { pyo3::ffi::PyErr_SetInterrupt() };
        return;
    }
    e.write_unraisable(py, Some(callback));
}

/// Runs a callback's `f` with the GIL on the library's thread (or a caller's, inside a
/// call that reads fabricd's event), unless the interpreter is exiting: then there is no
/// one left to tell, and attaching could end the thread.
pub(crate) fn callback(f: impl FnOnce(Python<'_>)) {
    if EXITING.load(Ordering::SeqCst) {
        return;
    }
    let _ = Python::try_attach(f);
}

/// Drops `v`, made in process `born`, with the GIL released. During interpreter shutdown
/// (no GIL to release) it is dropped as it is: nothing can call back into Python then. In
/// a child forked since, it is forgotten: it is the parent's (see [`FORKS`]).
pub(crate) fn drop_detached<T: Send>(v: T, born: Born) {
    if !born.here() {
        std::mem::forget(v);
        return;
    }
    let mut v = Some(v);
    let detached = Python::try_attach(|py| py.detach(|| drop(v.take())));
    if detached.is_none() {
        drop(v);
    }
}

/// Lets go of `v`, a handle a call took out of a [`Slot`], with the GIL released, before
/// the call runs Python code (an error's conversion, `fabric_mm.errors._from_native`):
/// that code may let another thread close the slot, making `v` the last handle, whose drop
/// may wait for fabricd (a `Free`, a `Release`) or for the library's reader thread (the
/// session's end) — which may be waiting for the GIL.
pub(crate) fn let_go<T: Send>(py: Python<'_>, v: T) {
    py.detach(move || drop(v));
}

/// `r`, the outcome of a call on `held`: its error is made (Python code) only once `held`
/// is let go of ([`let_go`]); a success runs no Python code, and keeps the GIL.
pub(crate) fn outcome<T: Send, R>(py: Python<'_>, held: T, r: fabric_mm::Result<R>) -> PyResult<R> {
    r.map_err(|e| {
        let_go(py, held);
        to_py(py, e)
    })
}

/// A library object a Python object holds for its whole life, dropped with the GIL
/// released ([`drop_detached`]) when the Python object goes: its last drop may end the
/// session, which waits for the library's reader thread — and that thread may be
/// waiting for the GIL, to run a callback.
pub(crate) struct Detached<T: Send>(Option<T>, Born);

impl<T: Send> Detached<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(Some(v), Born::now())
    }

    /// The value, unless this is a child forked since it was made (see [`FORKS`]).
    pub(crate) fn here(&self) -> Option<&T> {
        self.1.here().then_some(self.0.as_ref()).flatten()
    }
}

impl<T: Send + std::fmt::Debug> std::fmt::Debug for Detached<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<T: Send> Drop for Detached<T> {
    fn drop(&mut self) {
        drop_detached(self.0.take(), self.1);
    }
}

/// A library object a Python object owns until it is closed: `get` clones a handle out in
/// a short critical section (never held across a call to fabricd or Python, so no lock
/// order with the GIL exists), `take` closes it.
pub(crate) struct Slot<T: Send + Sync>(Mutex<Option<Arc<T>>>, Born);

impl<T: Send + Sync> Slot<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(Mutex::new(Some(Arc::new(v))), Born::now())
    }

    fn lock(&self) -> MutexGuard<'_, Option<Arc<T>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The object, unless closed (or made before this process was forked from its
    /// parent: see [`FORKS`]).
    pub(crate) fn get(&self) -> Option<Arc<T>> {
        if !self.1.here() {
            return None;
        }
        self.lock().clone()
    }

    /// Closes the slot, dropping its handle with the GIL released (the object itself goes
    /// when its last holder — a view, a pin — lets go).
    pub(crate) fn close(&self) {
        let v = self.lock().take();
        drop_detached(v, self.1);
    }

    pub(crate) fn is_open(&self) -> bool {
        self.lock().is_some()
    }
}

impl<T: Send + Sync + std::fmt::Debug> std::fmt::Debug for Slot<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Slot").field(&*self.lock()).finish()
    }
}

impl<T: Send + Sync> Drop for Slot<T> {
    fn drop(&mut self) {
        let v = self.0.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        drop_detached(v, self.1);
    }
}

/// A Python object a native object holds and shows to the collector: the holder's
/// `__traverse__` visits it and its `__clear__` lets go, so a cycle through it is
/// collected. Taken only with the GIL held and never across a call into Python, so the
/// collector (which holds the GIL) always finds the lock free.
pub(crate) struct Visible<T>(Mutex<Option<Py<T>>>);

impl<T> std::fmt::Debug for Visible<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Visible").field(&self.0.try_lock().map(|v| v.is_some()).ok()).finish()
    }
}

impl<T> Default for Visible<T> {
    fn default() -> Self {
        Self(Mutex::new(None))
    }
}

impl<T> Visible<T> {
    pub(crate) fn new(v: Option<Py<T>>) -> Self {
        Self(Mutex::new(v))
    }

    fn lock(&self) -> MutexGuard<'_, Option<Py<T>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Another reference to the object held, if any.
    pub(crate) fn get(&self, py: Python<'_>) -> Option<Py<T>> {
        self.lock().as_ref().map(|v| v.clone_ref(py))
    }

    /// Holds `v` instead; the one held before, to drop with the GIL held.
    pub(crate) fn replace(&self, v: Option<Py<T>>) -> Option<Py<T>> {
        std::mem::replace(&mut *self.lock(), v)
    }

    /// For the holder's `__traverse__`.
    pub(crate) fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Ok(v) = self.0.try_lock()
            && let Some(v) = &*v
        {
            visit.call(v)?;
        }
        Ok(())
    }

    /// For the holder's `__clear__`: lets go of the object (outside the lock).
    pub(crate) fn clear(&self) {
        drop(self.replace(None));
    }
}
