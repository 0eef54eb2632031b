//! Discovery backends: PCI and CXL from sysfs, AMD GPUs from KFD and amdgpu sysfs, RDMA NICs
//! from `/sys/class/infiniband`, NVIDIA
//! through NVML and CUDA, UALink from vendor sysfs attributes, and sim fabrics from TOML.
//!
//! Every backend implements [`Backend`]: it adds what it finds to a shared
//! [`Inventory`] and returns a [`BackendReport`] saying whether its source was present and
//! which attributes were unknown. A backend never panics and never invents a value; a
//! backend that fails leaves the others unaffected.

pub mod amd;
pub mod cxl;
pub mod hmem;
pub mod nvidia;
pub mod pci;
pub mod rdma;
pub mod sim;
pub mod sysfs;
pub mod ualink;

use fabric_topology::{BackendReport, Inventory};

pub use sysfs::SysfsRoot;

/// A discovery source.
pub trait Backend {
    /// Short name (`pci`, `cxl`, `nvml`, `cuda`, `ualink`, `sim`).
    fn name(&self) -> &'static str;

    /// Adds what the backend finds to `inventory`. Backends later in the order may enrich
    /// devices earlier ones added (NVML recognises a PCI function as a GPU by its UUID).
    fn discover(&self, inventory: &mut Inventory) -> BackendReport;
}

/// Runs backends in order into one inventory, collecting their reports.
pub fn discover(backends: &[&dyn Backend]) -> Inventory {
    let mut inv = Inventory::new();
    for b in backends {
        let _span = tracing::debug_span!("discover", backend = b.name()).entered();
        let report = b.discover(&mut inv);
        tracing::debug!(backend = b.name(), state = ?report.state, devices = report.devices, "backend done");
        inv.backends.push(report);
    }
    inv
}

/// The host backends in their standard order, all reading under `root`: PCI, CXL, UALink
/// attributes, AMD (KFD), RDMA devices, then NVML and CUDA (which consult the driver libraries, not the root).
pub fn host_backends(root: &SysfsRoot) -> Vec<Box<dyn Backend>> {
    vec![
        Box::new(pci::PciBackend::new(root.clone())),
        Box::new(cxl::CxlBackend::new(root.clone())),
        Box::new(ualink::UalinkBackend::new(root.clone())),
        Box::new(amd::AmdBackend::new(root.clone())),
        Box::new(rdma::RdmaBackend::new(root.clone())),
        Box::new(nvidia::NvmlBackend::new(root.node())),
        Box::new(nvidia::CudaBackend::new(root.node())),
    ]
}

/// Discovers the host described by `root` with every host backend.
pub fn discover_host(root: &SysfsRoot) -> Inventory {
    let backends = host_backends(root);
    let refs: Vec<&dyn Backend> = backends.iter().map(|b| b.as_ref()).collect();
    discover(&refs)
}
