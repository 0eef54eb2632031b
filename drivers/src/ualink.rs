//! UALink discovery from vendor sysfs attributes (placeholder until the PCI backend lands).

use fabric_topology::{BackendReport, Inventory};

use crate::{Backend, SysfsRoot};

/// Discovers UALink attributes of accelerators.
#[derive(Debug)]
pub struct UalinkBackend {
    #[allow(dead_code)]
    root: SysfsRoot,
}

impl UalinkBackend {
    /// A backend reading under `root`.
    pub fn new(root: SysfsRoot) -> Self {
        Self { root }
    }
}

impl Backend for UalinkBackend {
    fn name(&self) -> &'static str {
        "ualink"
    }

    fn discover(&self, _inventory: &mut Inventory) -> BackendReport {
        BackendReport::failed("ualink", "not implemented")
    }
}
