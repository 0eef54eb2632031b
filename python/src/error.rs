//! Library errors as Python exceptions. The classes live in `fabric_mm.errors` (Python, so
//! that they can also derive from `ValueError`, `PermissionError`, …); this module gathers
//! what a Python caller needs from an [`Error`] — the C ABI's code, a kind, the message
//! with its causes and fix hint, the numbers — and has `fabric_mm.errors._from_native`
//! build the exception.

use fabric_mm::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `fabric_mm.errors.ClosedError`'s kind: an object of this binding used after `close()`,
/// `free()`, `unmap()`, ….
const CLOSED: &str = "closed";

/// The Python exception for a library error.
pub(crate) fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let message = fabric_mm::ffi::error_text(&e);
    let code = e.code();
    build(py, code, kind(&e), &message, |d| details(d, &e)).unwrap_or_else(|fallback| fallback)
}

/// The exception for an object of this binding used after it was closed or released.
pub(crate) fn closed(py: Python<'_>, what: &str) -> PyErr {
    let message = if crate::gil::forked() {
        format!("the {what} is closed, or was made before this process was forked (it is the parent's)")
    } else {
        format!("the {what} is closed")
    };
    build(py, fabric_mm::ffi::FMM_E_ARG, CLOSED, &message, |_| Ok(())).unwrap_or_else(|fallback| fallback)
}

/// An argument this binding refuses before calling the library.
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    to_py(py, Error::InvalidArgument(message.into()))
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::Connect { .. } => "connect",
        Error::Refused { .. } => "refused",
        Error::Protocol(_) | Error::Unexpected(_) => "protocol",
        Error::Disconnected => "disconnected",
        Error::Revoked { .. } => "revoked",
        Error::WindowReserve { .. } => "window",
        Error::OutsideWindow { .. } => "outside_window",
        Error::NoGfa(_) => "no_gfa",
        Error::CopyOnly(_) => "copy_only",
        Error::AlreadyMapped { .. } => "already_mapped",
        Error::MemlockLimit { .. } => "memlock",
        Error::PinnedLimit { .. } => "pinned_limit",
        Error::DaemonMemlockLimit { .. } => "daemon_memlock",
        Error::InvalidArgument(_) => "invalid_argument",
        Error::Os { .. } => "os",
        Error::CopyFailed { .. } => "copy_failed",
        Error::Cuda(_) => "device",
    }
}

/// The numbers of the error, as attributes of the exception.
fn details(d: &Bound<'_, PyDict>, e: &Error) -> PyResult<()> {
    match e {
        Error::Connect { path, .. } => d.set_item("socket", path.to_string_lossy())?,
        Error::Refused { op, code, limit, .. } => {
            d.set_item("operation", op.to_string())?;
            d.set_item("daemon_code", format!("{code:?}"))?;
            if let Some((what, used, requested, max)) = limit {
                d.set_item("limit", (what, *used, *requested, *max))?;
            }
        }
        Error::Revoked { region, generation, reason } => {
            d.set_item("region", *region)?;
            d.set_item("generation", *generation)?;
            d.set_item("reason", crate::values::reason_name(*reason))?;
        }
        Error::CopyFailed { copy, code, bytes, .. } => {
            d.set_item("copy", *copy)?;
            d.set_item("daemon_code", format!("{code:?}"))?;
            d.set_item("bytes", *bytes)?;
        }
        Error::Os { source, .. } => d.set_item("errno", source.raw_os_error())?,
        Error::PinnedLimit { used, requested, max } => {
            d.set_item("limit", ("pinned_bytes", *used, *requested, *max))?
        }
        Error::MemlockLimit { requested, limit } => d.set_item("limit", ("RLIMIT_MEMLOCK", 0, *requested, *limit))?,
        Error::DaemonMemlockLimit { locked, requested, limit } => {
            d.set_item("limit", ("RLIMIT_MEMLOCK", *locked, *requested, *limit))?
        }
        _ => {}
    }
    Ok(())
}

fn build(
    py: Python<'_>,
    code: i32,
    kind: &str,
    message: &str,
    fill: impl FnOnce(&Bound<'_, PyDict>) -> PyResult<()>,
) -> Result<PyErr, PyErr> {
    let attempt = || -> PyResult<PyErr> {
        let d = PyDict::new(py);
        fill(&d)?;
        let make = py.import("fabric_mm.errors")?.getattr("_from_native")?;
        Ok(PyErr::from_value(make.call1((code, kind, message, d))?))
    };
    // A broken installation (fabric_mm.errors missing) gets here: say so, with the
    // library's message still in it. An interrupt (Ctrl-C's KeyboardInterrupt, SystemExit)
    // raised meanwhile is no failure of the installation: it goes on as it is.
    attempt().map_err(|e| {
        if !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
            return e;
        }
        PyRuntimeError::new_err(format!("{message} (and fabric_mm.errors failed: {e})"))
    })
}
