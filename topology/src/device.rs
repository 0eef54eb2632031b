//! Devices: discovered endpoints and fabric elements, with their PCI, GPU, CXL and UALink
//! details and the memory resources they expose.
//!
//! Every attribute a source may not expose is an `Option`: `None` means "unknown" and is
//! shown as such, never replaced by a guess.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cpuset::CpuSet;
use crate::cxl::CxlMemdevInfo;
use crate::hmem::NumaMemoryInfo;
use crate::id::{DeviceId, PciAddress};
use crate::rdma::RdmaDevice;

/// What a device is, as far as the fabric is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// A CPU package / NUMA node: the anchor of CPU and memory affinity.
    Cpu,
    /// A PCI host bridge (root complex, `pciDDDD:BB`).
    HostBridge,
    /// A PCI-to-PCI bridge: a root port or a switch port.
    PciBridge,
    /// A GPU (NVIDIA, AMD, ...).
    Gpu,
    /// A non-GPU accelerator (UALink accelerators, Xeon Phi, NPUs, ...).
    Accelerator,
    /// An NVSwitch (NVLink switch ASIC).
    NvSwitch,
    /// A network adapter.
    Nic,
    /// A storage controller (NVMe, SATA, RAID).
    Storage,
    /// A CXL switch (its upstream port).
    CxlSwitch,
    /// A CXL memory device (type-3 expander, `memN`).
    CxlMemdev,
    /// A UALink switch.
    UalinkSwitch,
    /// A network switch (leaf, spine).
    NetworkSwitch,
    /// A memory-only NUMA node (no CPUs): CXL, soft-reserved, NVDIMM or coherent device
    /// memory the kernel onlined as a node of its own.
    MemoryNode,
    /// Any other PCI function.
    Other,
}

impl DeviceKind {
    /// Short label prefix used in matrices (`GPU0`, `NIC1`, ...).
    pub fn label(&self) -> &'static str {
        match self {
            DeviceKind::Cpu => "CPU",
            DeviceKind::HostBridge => "HB",
            DeviceKind::PciBridge => "BR",
            DeviceKind::Gpu => "GPU",
            DeviceKind::Accelerator => "ACC",
            DeviceKind::NvSwitch => "NVS",
            DeviceKind::Nic => "NIC",
            DeviceKind::Storage => "STO",
            DeviceKind::CxlSwitch => "CXLSW",
            DeviceKind::CxlMemdev => "CXL",
            DeviceKind::UalinkSwitch => "UALSW",
            DeviceKind::NetworkSwitch => "NETSW",
            DeviceKind::MemoryNode => "MEM",
            DeviceKind::Other => "DEV",
        }
    }

    /// Whether the device forwards traffic (paths may pass through it).
    pub fn is_transit(&self) -> bool {
        matches!(
            self,
            DeviceKind::Cpu
                | DeviceKind::HostBridge
                | DeviceKind::PciBridge
                | DeviceKind::NvSwitch
                | DeviceKind::CxlSwitch
                | DeviceKind::UalinkSwitch
                | DeviceKind::NetworkSwitch
                | DeviceKind::Nic
        )
    }

    /// Whether the device is a compute endpoint shown in the topology matrix.
    pub fn is_compute(&self) -> bool {
        matches!(self, DeviceKind::Gpu | DeviceKind::Accelerator)
    }
}

/// A PCI base address register as read from `resource`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bar {
    /// BAR index (0..=5; 6 is the expansion ROM).
    pub index: u8,
    /// Start physical address.
    pub start: u64,
    /// Size in bytes.
    pub size: u64,
    /// The raw resource flags (`IORESOURCE_*`).
    pub flags: u64,
}

impl Bar {
    /// `IORESOURCE_MEM`.
    pub const FLAG_MEM: u64 = 0x200;
    /// `IORESOURCE_PREFETCH`.
    pub const FLAG_PREFETCH: u64 = 0x2000;
    /// `IORESOURCE_MEM_64`.
    pub const FLAG_MEM64: u64 = 0x0010_0000;
}

/// What a PCI function told us through sysfs. Each field is `None` when not exposed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PciInfo {
    /// The function's address.
    pub address: Option<PciAddress>,
    /// 24-bit class code (class, subclass, prog-if).
    pub class: Option<u32>,
    /// Vendor id.
    pub vendor_id: Option<u16>,
    /// Device id.
    pub device_id: Option<u16>,
    /// Subsystem vendor id.
    pub subsystem_vendor_id: Option<u16>,
    /// Subsystem device id.
    pub subsystem_device_id: Option<u16>,
    /// Vendor name from the PCI id database (display only).
    pub vendor_name: Option<String>,
    /// Device name from the PCI id database (display only).
    pub device_name: Option<String>,
    /// Current link speed in GT/s.
    pub link_speed_gts: Option<f64>,
    /// Current link width.
    pub link_width: Option<u8>,
    /// Maximum link speed in GT/s.
    pub max_link_speed_gts: Option<f64>,
    /// Maximum link width.
    pub max_link_width: Option<u8>,
    /// Memory and I/O BARs that are assigned.
    pub bars: Vec<Bar>,
    /// IOMMU group number.
    pub iommu_group: Option<u32>,
    /// Bound kernel driver.
    pub driver: Option<String>,
}

/// GPU details from a vendor library (NVML) or a sim config.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Vendor UUID (`GPU-…`).
    pub uuid: Option<String>,
    /// Product name.
    pub model: Option<String>,
    /// Serial number.
    pub serial: Option<String>,
    /// Number of NVLinks the GPU supports.
    pub nvlink_capable: Option<u16>,
    /// NVLink generation.
    pub nvlink_generation: Option<u8>,
    /// GPU fabric (NVSwitch registration) state: `not_supported`, `not_started`,
    /// `in_progress`, `completed`.
    pub fabric_state: Option<String>,
    /// Fabric cluster UUID and clique id, when registered.
    pub fabric_cluster: Option<String>,
    /// Fabric clique id.
    pub fabric_clique: Option<u32>,
    /// Compute capability `major.minor` (CUDA).
    pub compute_capability: Option<String>,
    /// AMD: the GFX target the kernel reports (`gfx942`), from KFD's `gfx_target_version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gfx_target: Option<String>,
    /// Compute units of the whole device (all its partitions), when the source says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_units: Option<u32>,
    /// AMD: the xGMI hive the GPU belongs to (`0x…`, the kernel's `hive_id`); GPUs of one
    /// hive reach each other over xGMI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xgmi_hive: Option<String>,
    /// The compute partition mode (AMD `SPX`/`DPX`/`QPX`/`CPX`), when the driver says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_partition_mode: Option<String>,
    /// The memory partition mode (AMD `NPS1`/`NPS4`), when the driver says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_partition_mode: Option<String>,
    /// The compute partitions of this physical GPU (AMD compute partitions, MIG-like
    /// instances), in index order. Empty when the GPU is not partitioned or the source
    /// does not show partitions; a partition the source hides is absent here and named in
    /// the backend's report, never invented.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<GpuPartition>,
}

/// One compute partition of a physical GPU. It has no identity of its own beyond its
/// GPU's and its index: the kernel renumbers its own handles (KFD node ids, render
/// minors) whenever devices or modes change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPartition {
    /// Index within the GPU (AMD: the XCP id, 0 for the first).
    pub index: u32,
    /// Compute units of this partition, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_units: Option<u32>,
    /// Bytes of device memory local to this partition, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// The DRM render node minor serving it (`/dev/dri/renderD<minor>`), for display: the
    /// kernel may renumber it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub render_minor: Option<u32>,
}

/// UALink identity of an accelerator or switch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UalinkInfo {
    /// Pod id.
    pub pod: Option<u32>,
    /// Virtual pod id (a partition of the pod).
    pub vpod: Option<u32>,
    /// Accelerator id within the pod (10 bits: up to 1,024 accelerators).
    pub accelerator_id: Option<u16>,
    /// Switch id for UALink switches.
    pub switch_id: Option<u16>,
    /// Number of UALink ports (stations).
    pub ports: Option<u16>,
}

/// Kind of a memory resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    /// GPU / accelerator high-bandwidth memory.
    Hbm,
    /// Host DRAM (a NUMA node's memory).
    Dram,
    /// CXL volatile capacity.
    CxlVolatile,
    /// CXL persistent capacity.
    CxlPersistent,
    /// A CXL dynamic-capacity region.
    CxlDynamic,
    /// Host memory exported to the fabric: a node fabricd serves, or the memory of a
    /// memory-only NUMA node (CXL, soft-reserved, NVDIMM or coherent device memory the
    /// kernel onlined as a node of its own; its origin is in the device's
    /// [`NumaMemoryInfo`]), which is the fabric's rather than the host's own DRAM.
    HostExported,
}

/// A byte range a device exposes. `base` is device-relative (a DPA for CXL, an offset in
/// HBM) unless the source gives a host physical address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryResource {
    /// Kind of memory.
    pub kind: MemoryKind,
    /// Size in bytes.
    pub size: u64,
    /// Host physical address, when the resource is mapped in the host's address space.
    pub hpa: Option<u64>,
    /// NUMA node that onlines it, when any.
    pub numa_node: Option<u32>,
}

/// A discovered endpoint or fabric element.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Device {
    /// Stable identity.
    pub id: DeviceId,
    /// What it is.
    pub kind: DeviceKind,
    /// The node (host) it belongs to; `None` for fabric-level switches shared by nodes.
    pub node: Option<String>,
    /// Display name (model or PCI database name).
    pub name: Option<String>,
    /// NUMA node it is local to, when known.
    pub numa_node: Option<u32>,
    /// CPUs it is local to, when known.
    pub local_cpus: Option<CpuSet>,
    /// PCI details, for PCI functions.
    pub pci: Option<PciInfo>,
    /// GPU details, for GPUs.
    pub gpu: Option<GpuInfo>,
    /// CXL memdev details.
    pub cxl: Option<CxlMemdevInfo>,
    /// UALink details.
    pub ualink: Option<UalinkInfo>,
    /// Memory the device exposes.
    pub memory: Vec<MemoryResource>,
    /// Which backends contributed to this device (`pci`, `nvml`, `cxl`, `sim`, ...).
    pub sources: Vec<String>,
    /// Extra backend-specific facts, as text. [`FAILED_ATTR`] marks a failed device.
    pub attrs: BTreeMap<String, String>,
    /// Bits of address the device can DMA to (`dma_mask_bits` in sysfs, or the sim
    /// file), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dma_mask_bits: Option<u8>,
    /// The RDMA devices of a NIC (`/sys/class/infiniband`), with their ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rdma: Vec<RdmaDevice>,
    /// For NUMA node devices: what the kernel says about the node's memory (origin, tier,
    /// HMAT access classes, memory-side caches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_memory: Option<NumaMemoryInfo>,
}

/// The attribute a backend sets, to the reason in words, when the device reports a failure
/// (a PCI function with fatal AER errors or that no longer answers config reads, a GPU whose
/// fabric health is unhealthy). Consumers treat the device's memory as lost.
pub const FAILED_ATTR: &str = "failed";

/// The attribute a domain's merged inventory sets on each node's devices: `live` while
/// the node is a member of the domain, `down` once its member key is gone. Two devices of
/// live members of one domain reach each other over the network the nodes talk on (their
/// node link), whether or not the inventory describes that network, so they are at least
/// `NET` apart ([`crate::Fabric::classify`]).
pub const DOMAIN_NODE_ATTR: &str = "domain_node";

/// [`DOMAIN_NODE_ATTR`]'s value for a device of a live member.
pub const DOMAIN_NODE_LIVE: &str = "live";

/// [`DOMAIN_NODE_ATTR`]'s value for a device of a node that is down.
pub const DOMAIN_NODE_DOWN: &str = "down";

impl Device {
    /// A device with only identity and kind filled.
    pub fn new(id: DeviceId, kind: DeviceKind, node: Option<&str>) -> Self {
        Self {
            id,
            kind,
            node: node.map(str::to_owned),
            name: None,
            numa_node: None,
            local_cpus: None,
            pci: None,
            gpu: None,
            cxl: None,
            ualink: None,
            memory: Vec::new(),
            sources: Vec::new(),
            attrs: BTreeMap::new(),
            dma_mask_bits: None,
            rdma: Vec::new(),
            numa_memory: None,
        }
    }

    /// The device's PCI address, if it is a PCI function.
    pub fn pci_address(&self) -> Option<PciAddress> {
        self.pci.as_ref().and_then(|p| p.address)
    }

    /// Total bytes of memory the device exposes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory.iter().map(|m| m.size).fold(0, u64::saturating_add)
    }
}
