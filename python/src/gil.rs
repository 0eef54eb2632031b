//! The GIL rules of the binding: every call that may block (a round trip to fabricd, a
//! wait, a drop that frees or releases in the daemon) runs with the GIL released. Besides
//! letting other Python threads run, this is what keeps callbacks from deadlocking: the
//! library runs revocation and copy callbacks on whichever thread reads fabricd's socket,
//! and those callbacks take the GIL — a thread that held the GIL while it waited for
//! fabricd's answer could wait forever behind one.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;

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

/// Registers [`EXITING`]'s hook with `atexit`.
pub(crate) fn register_exit_hook(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(_interpreter_exiting, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
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

/// Drops `v` with the GIL released. During interpreter shutdown (no GIL to release) it is
/// dropped as it is: nothing can call back into Python then.
pub(crate) fn drop_detached<T: Send>(v: T) {
    let mut v = Some(v);
    let detached = Python::try_attach(|py| py.detach(|| drop(v.take())));
    if detached.is_none() {
        drop(v);
    }
}

/// A library object a Python object holds for its whole life, dropped with the GIL
/// released ([`drop_detached`]) when the Python object goes: its last drop may end the
/// session, which waits for the library's reader thread — and that thread may be
/// waiting for the GIL, to run a callback.
pub(crate) struct Detached<T: Send>(Option<T>);

impl<T: Send> Detached<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(Some(v))
    }
}

impl<T: Send> std::ops::Deref for Detached<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_ref().unwrap_or_else(|| unreachable!("taken only when dropped"))
    }
}

impl<T: Send + std::fmt::Debug> std::fmt::Debug for Detached<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<T: Send> Drop for Detached<T> {
    fn drop(&mut self) {
        drop_detached(self.0.take());
    }
}

/// A library object a Python object owns until it is closed: `get` clones a handle out in
/// a short critical section (never held across a call to fabricd or Python, so no lock
/// order with the GIL exists), `take` closes it.
pub(crate) struct Slot<T: Send + Sync>(Mutex<Option<Arc<T>>>);

impl<T: Send + Sync> Slot<T> {
    pub(crate) fn new(v: T) -> Self {
        Self(Mutex::new(Some(Arc::new(v))))
    }

    fn lock(&self) -> MutexGuard<'_, Option<Arc<T>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn get(&self) -> Option<Arc<T>> {
        self.lock().clone()
    }

    /// Closes the slot, dropping its handle with the GIL released (the object itself goes
    /// when its last holder — a view, a pin — lets go).
    pub(crate) fn close(&self) {
        let v = self.lock().take();
        drop_detached(v);
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
        drop_detached(v);
    }
}
