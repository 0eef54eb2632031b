//! CXL objects as the kernel's CXL core models them: root decoders (host windows), ports,
//! HDM decoders, memdevs, regions and DAX devices.
//!
//! Objects are keyed by stable identity (memdev serial, PCI address of a port, the root
//! decoder's host physical window) rather than the kernel's `portN`/`decoderN.M`/`regionN`
//! numbering, which changes between boots. The kernel names are kept for display only.

use serde::{Deserialize, Serialize};

use crate::id::{DeviceId, PciAddress};

/// Details of a CXL memory device (`/sys/bus/cxl/devices/memN`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CxlMemdevInfo {
    /// Device serial number (from the PCIe DSN); the stable key.
    pub serial: Option<u64>,
    /// Kernel name (`mem0`), display only.
    pub kernel_name: Option<String>,
    /// PCI address of the memdev's PCI function.
    pub pci_address: Option<PciAddress>,
    /// Volatile (RAM) capacity in bytes.
    pub ram_size: Option<u64>,
    /// Persistent capacity in bytes.
    pub pmem_size: Option<u64>,
    /// Firmware revision.
    pub firmware_version: Option<String>,
    /// Number of dynamic-capacity regions the device advertises.
    pub dc_regions: Option<u32>,
}

/// What a decoder or region decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CxlMode {
    /// Volatile memory.
    Ram,
    /// Persistent memory.
    Pmem,
    /// Dynamic capacity.
    DynamicRam,
    /// Not configured.
    None,
    /// Mixed / other value the kernel printed.
    Unknown,
}

/// Where a decoder sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CxlDecoderLevel {
    /// A root decoder: a CFMWS window of host physical address space.
    Root,
    /// A switch or host-bridge decoder.
    Switch,
    /// An endpoint decoder on a memdev.
    Endpoint,
}

/// An HDM decoder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CxlDecoder {
    /// Kernel name (`decoder0.0`), display only.
    pub kernel_name: String,
    /// Level.
    pub level: CxlDecoderLevel,
    /// The stable identity of the port or memdev that owns it.
    pub owner: Option<DeviceId>,
    /// Host physical start, when committed / for root decoders.
    pub start: Option<u64>,
    /// Size in bytes.
    pub size: Option<u64>,
    /// Interleave ways.
    pub ways: Option<u32>,
    /// Interleave granularity in bytes.
    pub granularity: Option<u32>,
    /// Decoded mode (endpoint decoders).
    pub mode: Option<CxlMode>,
    /// Device physical address base (endpoint decoders).
    pub dpa_start: Option<u64>,
    /// Device physical address size (endpoint decoders).
    pub dpa_size: Option<u64>,
    /// Targets in interleave order, by stable identity where resolvable.
    pub targets: Vec<String>,
    /// Root decoder capabilities (`ram`, `pmem`, `accelmem`, `expander`).
    pub capabilities: Vec<String>,
    /// The platform's QoS class for the window (root decoders; from CDAT/ACPI), when set.
    pub qos_class: Option<u32>,
    /// Region this decoder is part of, by region UUID or kernel name.
    pub region: Option<String>,
    /// Whether the decoder is locked by firmware.
    pub locked: Option<bool>,
}

/// A CXL region: an interleaved host physical range backed by memdevs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CxlRegion {
    /// Kernel name (`region0`), display only.
    pub kernel_name: String,
    /// Region UUID (pmem regions) — the stable key where present.
    pub uuid: Option<String>,
    /// Mode.
    pub mode: Option<CxlMode>,
    /// Host physical start.
    pub resource: Option<u64>,
    /// Size in bytes.
    pub size: Option<u64>,
    /// Interleave ways.
    pub ways: Option<u32>,
    /// Interleave granularity in bytes.
    pub granularity: Option<u32>,
    /// Member memdevs in position order, by stable identity.
    pub targets: Vec<DeviceId>,
    /// Commit state.
    pub committed: Option<bool>,
    /// DAX devices carved from the region (`dax0.0`) with their sizes.
    pub dax: Vec<CxlDax>,
    /// The root decoder (window) that decodes it.
    pub root_decoder: Option<String>,
}

/// A device-DAX instance over a region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CxlDax {
    /// Kernel name (`dax0.0`).
    pub name: String,
    /// Size in bytes.
    pub size: Option<u64>,
    /// NUMA node the region is (or would be) onlined to.
    pub numa_node: Option<u32>,
}

/// Everything CXL-specific that is not a device or a link.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CxlInventory {
    /// All decoders (root, switch, endpoint).
    pub decoders: Vec<CxlDecoder>,
    /// Regions.
    pub regions: Vec<CxlRegion>,
}
