//! CXL discovery from sysfs (placeholder until the PCI backend lands).

use fabric_topology::{BackendReport, Inventory};

use crate::{Backend, SysfsRoot};

/// Discovers CXL objects under `sys/bus/cxl/devices`.
#[derive(Debug)]
pub struct CxlBackend {
    #[allow(dead_code)]
    root: SysfsRoot,
}

impl CxlBackend {
    /// A backend reading under `root`.
    pub fn new(root: SysfsRoot) -> Self {
        Self { root }
    }
}

impl Backend for CxlBackend {
    fn name(&self) -> &'static str {
        "cxl"
    }

    fn discover(&self, _inventory: &mut Inventory) -> BackendReport {
        BackendReport::failed("cxl", "not implemented")
    }
}
