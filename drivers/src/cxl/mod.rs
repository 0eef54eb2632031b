//! CXL discovery from `/sys/bus/cxl/devices`, as the Linux 6.x CXL core lays it out.
//!
//! The kernel's objects and where they live (see `Documentation/ABI/testing/sysfs-bus-cxl`
//! and ndctl's `cxl/lib/libcxl.c`, which walks the same tree):
//!
//! - `root0` → `devices/platform/ACPI0017:00/root0`: the platform CXL root. Its `dportN`
//!   links name the host bridges (`pciDDDD:BB`, N = the CEDT CHBS UID) and its
//!   `decoder0.Y` are the root decoders: CFMWS windows (`start`, `size`, `cap_*`,
//!   `interleave_*`, `target_list` of host-bridge UIDs, `qos_class`).
//! - `portN`, nested in the parent port's directory: a host bridge (`uport` → `pciDDDD:BB`,
//!   `dportN` → root ports by PCIe port number) or a switch (`uport` → the upstream port's
//!   PCI function, `dportN` → downstream ports); `parent_dport` (6.3+),
//!   `decoders_committed` (6.7+), and switch decoders `decoderN.Y` (`target_list`, ...).
//! - `endpointN`, nested in its parent port: `uport` → the memdev, endpoint decoders
//!   (`mode`, `dpa_resource`, `dpa_size`, `interleave_*`).
//! - `memN`, under its PCI function's directory: `serial`, `ram/size`, `pmem/size`,
//!   `numa_node`, `firmware_version`, and dynamic-capacity partitions where a DCD kernel
//!   shows them.
//! - `regionN`, inside its root decoder: `uuid` (pmem), `mode` (6.3+), `size`, `resource`,
//!   `interleave_*`, `targetN` (endpoint decoder names), `commit`, and
//!   `dax_regionN/daxN.M` (`size`, `target_node`, `numa_node`).
//!
//! Discovery reads that tree ([`scan`]), parses every attribute with the total functions in
//! [`parse`], and models it into the inventory keyed by stable identity ([`model`]). Links
//! that leave the sysfs root are not followed.

pub mod model;
pub mod parse;
pub mod scan;

use fabric_topology::{BackendReport, Inventory};

use crate::{Backend, SysfsRoot};

pub use parse::{parse_decoder, parse_mode, parse_region, parse_target_list};

/// Discovers CXL objects under `sys/bus/cxl/devices`.
#[derive(Debug)]
pub struct CxlBackend {
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

    fn discover(&self, inventory: &mut Inventory) -> BackendReport {
        let bus = self.root.path("sys/bus/cxl");
        if !bus.is_dir() {
            return BackendReport::not_present("cxl", "no /sys/bus/cxl: kernel without CXL support or no CXL devices");
        }
        let Some(res) = scan::Resolver::new(self.root.root()) else {
            return BackendReport::failed(
                "cxl",
                format!("{}: cannot resolve the sysfs root", self.root.root().display()),
            );
        };
        let scanned = match scan::scan(&bus.join("devices"), &res) {
            Ok(s) => s,
            Err(e) => return BackendReport::failed("cxl", e.to_string()),
        };
        let mut report = BackendReport::present("cxl");
        for n in &scanned.notes {
            report.note_unknown(n.clone());
        }
        report.devices = model::build(&scanned, self.root.node(), inventory, &mut report);
        crate::hmem::resolve_cxl(&self.root, inventory, &mut report);
        tracing::debug!(
            memdevs = scanned.memdevs.len(),
            ports = scanned.ports.len(),
            decoders = scanned.decoders.len(),
            regions = scanned.regions.len(),
            "cxl scan"
        );
        report
    }
}
