//! PCI discovery from sysfs (placeholder until the PCI backend lands).

use fabric_topology::{BackendReport, Inventory};

use crate::{Backend, SysfsRoot};

/// Discovers PCI functions under `sys/bus/pci/devices`.
#[derive(Debug)]
pub struct PciBackend {
    #[allow(dead_code)]
    root: SysfsRoot,
}

impl PciBackend {
    /// A backend reading under `root`.
    pub fn new(root: SysfsRoot) -> Self {
        Self { root }
    }
}

impl Backend for PciBackend {
    fn name(&self) -> &'static str {
        "pci"
    }

    fn discover(&self, _inventory: &mut Inventory) -> BackendReport {
        BackendReport::failed("pci", "not implemented")
    }
}
