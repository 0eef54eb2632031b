//! NVIDIA discovery through NVML and CUDA (placeholder until the NVIDIA backend lands).

use fabric_topology::{BackendReport, Inventory};

use crate::Backend;

/// GPUs, NVLinks and NVSwitches from NVML.
#[derive(Debug)]
pub struct NvmlBackend {
    #[allow(dead_code)]
    node: String,
}

impl NvmlBackend {
    /// A backend qualifying identities with `node`.
    pub fn new(node: &str) -> Self {
        Self { node: node.to_owned() }
    }
}

impl Backend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn discover(&self, _inventory: &mut Inventory) -> BackendReport {
        BackendReport::failed("nvml", "not implemented")
    }
}

/// Device properties from the CUDA driver API.
#[derive(Debug)]
pub struct CudaBackend {
    #[allow(dead_code)]
    node: String,
}

impl CudaBackend {
    /// A backend qualifying identities with `node`.
    pub fn new(node: &str) -> Self {
        Self { node: node.to_owned() }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn discover(&self, _inventory: &mut Inventory) -> BackendReport {
        BackendReport::failed("cuda", "not implemented")
    }
}
