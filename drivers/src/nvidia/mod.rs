//! NVIDIA discovery: GPUs, NVLinks, NVSwitches and fabric state through NVML, device
//! features through the CUDA driver API. Both libraries are loaded at run time; where they
//! are missing the backends report "not present" — they never panic.
//!
//! Layout: [`api`] is the trait over the NVML calls we use; [`nvml`] implements it with
//! `nvml-wrapper`; [`snapshot`] walks a source into plain records; [`model`] maps records into
//! the inventory; [`cuda`] is the CUDA backend; `sys` holds every raw FFI call.

pub mod api;
pub mod cuda;
pub mod model;
pub mod nvml;
pub mod snapshot;
mod sys;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use fabric_topology::{BackendReport, Inventory};

use crate::Backend;

pub use api::{NvmlCallError, NvmlSource};
pub use cuda::CudaBackend;
pub use nvml::{NvmlLibrary, NvmlLibraryError};
pub use snapshot::NvmlSnapshot;

/// Runs `f`, turning a panic into its message. Vendor libraries and their bindings can
/// panic (cudarc does when a symbol is missing); one backend's panic must not take the
/// daemon down.
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| panic_message(p.as_ref()))
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// GPUs, NVLinks and NVSwitches from NVML.
#[derive(Debug)]
pub struct NvmlBackend {
    node: String,
    library: PathBuf,
}

impl NvmlBackend {
    /// A backend qualifying identities with `node`, loading the library named by
    /// `FABRIC_NVML_LIBRARY`, or `libnvidia-ml.so.1` from the loader's search path.
    pub fn new(node: &str) -> Self {
        Self::with_library(node, nvml::library_from_env())
    }

    /// A backend loading NVML from `library` (for unusual installs and tests).
    pub fn with_library(node: &str, library: impl Into<PathBuf>) -> Self {
        Self { node: node.to_owned(), library: library.into() }
    }

    /// The library this backend loads.
    pub fn library(&self) -> &Path {
        &self.library
    }
}

impl Backend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn discover(&self, inventory: &mut Inventory) -> BackendReport {
        let opened = guarded(|| {
            let lib = NvmlLibrary::open(&self.library)?;
            Ok::<_, NvmlLibraryError>(guarded(|| snapshot::collect(&lib)))
        });
        match opened {
            Err(msg) => BackendReport::failed("nvml", format!("NVML panicked: {msg}")),
            Ok(Err(e)) if e.is_absence() => BackendReport::not_present("nvml", e.to_string()),
            Ok(Err(e)) => BackendReport::failed("nvml", e.to_string()),
            Ok(Ok(collected)) => report_snapshot(collected, &self.node, inventory),
        }
    }
}

/// Discovers from any [`NvmlSource`] (a fake in tests, a recorded system in sims), with the
/// same panic guard and mapping as [`NvmlBackend`].
pub fn discover_from(source: &dyn NvmlSource, node: &str, inventory: &mut Inventory) -> BackendReport {
    report_snapshot(guarded(|| snapshot::collect(source)), node, inventory)
}

fn report_snapshot(
    collected: Result<Result<NvmlSnapshot, NvmlCallError>, String>,
    node: &str,
    inventory: &mut Inventory,
) -> BackendReport {
    match collected {
        Err(msg) => BackendReport::failed("nvml", format!("NVML panicked: {msg}")),
        Ok(Err(e)) => BackendReport::failed("nvml", format!("nvmlDeviceGetCount: {e}")),
        Ok(Ok(snap)) => {
            let mut report = BackendReport::present("nvml");
            model::apply(&snap, node, inventory, &mut report);
            report
        }
    }
}
