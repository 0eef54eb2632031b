//! `fabric_mm._native`: the Python binding of libfabric-mm. A thin layer over the safe
//! crate, as the C ABI is (`libfabric-mm/src/ffi.rs`): every class here owns one library
//! object, every blocking call runs with the GIL released, and every library error becomes
//! one of the exception classes of `fabric_mm.errors` with the library's code and message.
//! The pure-Python package `fabric_mm` (python/fabric_mm) wraps these classes with the
//! buffer protocol, dataclasses and asyncio; see docs/python.md.

mod copy;
mod dlpack;
mod error;
mod gil;
mod memory;
mod session;
mod values;

use pyo3::prelude::*;

/// The module the package imports as `fabric_mm._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(session::default_socket, m)?)?;
    m.add_class::<session::Session>()?;
    m.add_class::<memory::Region>()?;
    m.add_class::<memory::Import>()?;
    m.add_class::<memory::Mapping>()?;
    m.add_class::<memory::Pin>()?;
    m.add_class::<copy::HostBuffer>()?;
    m.add_class::<copy::Registration>()?;
    m.add_class::<copy::Endpoint>()?;
    m.add_class::<copy::Copy>()?;
    gil::register_hooks(m)?;
    Ok(())
}
