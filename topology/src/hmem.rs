//! Heterogeneous memory: what the kernel says about a NUMA node's memory (its origin, its
//! memory tier, the firmware's HMAT access classes and memory-side caches) and the DAX
//! devices of every origin.
//!
//! Every figure is an `Option` or an empty list when sysfs does not show it: an origin
//! the kernel does not name is [`MemoryOrigin::Unknown`], never a guess.

use serde::{Deserialize, Serialize};

/// Where a NUMA node's (or a DAX device's) memory comes from, as far as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum MemoryOrigin {
    /// Ordinary system memory of a node with CPUs.
    System,
    /// A CXL region (its DAX device lives below the region, or the node's memory blocks
    /// lie inside the region's host physical range).
    CxlRegion {
        /// The region's stable key in the CXL inventory (`hpa:0x…` or its UUID), when the
        /// CXL backend found it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        region: Option<String>,
        /// The kernel's region name (`region0`), for display only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kernel_name: Option<String>,
    },
    /// EFI specific-purpose ("soft reserved") memory handed out by `dax_hmem` (`hmem.N`
    /// platform devices): HBM or other memory the firmware keeps off the general pool.
    SoftReserved,
    /// An NVDIMM namespace (`ndbus`, `nd_pmem`/`nd_dax`) used as memory.
    Nvdimm,
    /// Memory of a device (a GPU's HBM on a coherent system) onlined by its driver.
    DeviceMemory {
        /// The driver that owns it, as sysfs names it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        driver: Option<String>,
    },
    /// Sysfs does not say.
    Unknown,
}

impl MemoryOrigin {
    /// Short name for tables (`cxl`, `soft_reserved`, …).
    pub fn name(&self) -> &'static str {
        match self {
            MemoryOrigin::System => "system",
            MemoryOrigin::CxlRegion { .. } => "cxl",
            MemoryOrigin::SoftReserved => "soft_reserved",
            MemoryOrigin::Nvdimm => "nvdimm",
            MemoryOrigin::DeviceMemory { .. } => "device",
            MemoryOrigin::Unknown => "unknown",
        }
    }
}

/// One HMAT access class of a memory node (`nodeN/accessC/initiators/`): the best
/// performance any initiator gets, and which initiator nodes get it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccessClass {
    /// The class: 0 = any initiator (CPUs, GPUs, …), 1 = CPU initiators only.
    pub class: u8,
    /// Initiator NUMA nodes (the `nodeM` links in `initiators/`), sorted.
    pub initiators: Vec<u32>,
    /// Read bandwidth in MB/s.
    pub read_bandwidth_mbps: Option<u64>,
    /// Write bandwidth in MB/s.
    pub write_bandwidth_mbps: Option<u64>,
    /// Read latency in nanoseconds.
    pub read_latency_ns: Option<u64>,
    /// Write latency in nanoseconds.
    pub write_latency_ns: Option<u64>,
}

impl AccessClass {
    /// The bandwidth a path may count on: the slower direction (a copy reads and writes).
    pub fn bandwidth_mbps(&self) -> Option<u64> {
        match (self.read_bandwidth_mbps, self.write_bandwidth_mbps) {
            (Some(r), Some(w)) => Some(r.min(w)),
            (r, w) => r.or(w),
        }
    }

    /// The latency a path may count on: the slower direction.
    pub fn latency_ns(&self) -> Option<u64> {
        match (self.read_latency_ns, self.write_latency_ns) {
            (Some(r), Some(w)) => Some(r.max(w)),
            (r, w) => r.or(w),
        }
    }
}

/// One level of memory-side cache in front of a node's memory
/// (`nodeN/memory_side_cache/indexK`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySideCache {
    /// The cache level (`indexK`: K = 1 nearest the memory... as the kernel numbers them).
    pub level: u32,
    /// Size in bytes.
    pub size: Option<u64>,
    /// Line size in bytes.
    pub line_size: Option<u64>,
    /// `indexing`: 0 direct-mapped, 1 indexed (complex), 2 unknown (ACPI HMAT encoding).
    pub indexing: Option<u32>,
    /// `write_policy`: 0 write-back, 1 write-through, 2 unknown (ACPI HMAT encoding).
    pub write_policy: Option<u32>,
}

/// What the kernel says about one NUMA node's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaMemoryInfo {
    /// The node has memory and no CPUs (its `cpulist` is empty).
    pub memory_only: bool,
    /// Where the memory comes from.
    pub origin: MemoryOrigin,
    /// The kernel memory tier holding the node (`memory_tierN`; smaller is faster, DRAM
    /// is tier 4), when the kernel has memory tiering.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<u32>,
    /// HMAT access classes, by class.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub access: Vec<AccessClass>,
    /// Memory-side caches, by level.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caches: Vec<MemorySideCache>,
}

/// The driver a DAX device is bound to, which says how its memory is used.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DaxMode {
    /// `device_dax`: a character device (`/dev/daxX.Y`) mapped directly.
    Device,
    /// `kmem`: onlined as system memory of its target node.
    SystemRam,
    /// Bound to no driver.
    Unbound,
    /// Another driver.
    Other(String),
}

/// A DAX device (`/sys/bus/dax/devices/daxX.Y`) of any origin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaxDevice {
    /// Kernel name (`dax0.0`), display only: the kernel numbers them at probe time.
    pub name: String,
    /// Where its memory comes from, from its place in the device tree.
    pub origin: MemoryOrigin,
    /// How it is used.
    pub mode: DaxMode,
    /// Size in bytes.
    pub size: Option<u64>,
    /// Host physical start (`resource`, 5.x+).
    pub resource: Option<u64>,
    /// The NUMA node its memory is (or would be) onlined to.
    pub target_node: Option<u32>,
}

/// A kernel memory tier (`/sys/devices/virtual/memory_tiering/memory_tierN`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryTier {
    /// N: the tier covers abstract distances `[N × 128, N × 128 + 128)`; smaller is faster.
    pub id: u32,
    /// Its nodes (`nodelist`).
    pub nodes: Vec<u32>,
}

impl MemoryTier {
    /// The kernel's `MEMTIER_CHUNK_BITS`: each tier spans 128 units of abstract distance.
    pub const CHUNK_BITS: u32 = 7;

    /// The abstract distances the tier covers, `[start, end)`.
    pub fn abstract_distance(&self) -> (u64, u64) {
        let start = u64::from(self.id) << Self::CHUNK_BITS;
        (start, start + (1 << Self::CHUNK_BITS))
    }
}

/// Heterogeneous-memory objects that are not devices: DAX devices and memory tiers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HmemInventory {
    /// DAX devices, by name.
    #[serde(default)]
    pub dax: Vec<DaxDevice>,
    /// Memory tiers, by id.
    #[serde(default)]
    pub tiers: Vec<MemoryTier>,
}

impl HmemInventory {
    /// Whether discovery found nothing.
    pub fn is_empty(&self) -> bool {
        self.dax.is_empty() && self.tiers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_spans_follow_the_kernels_chunks() {
        // DRAM's abstract distance is 4 × 128 + 64 = 576: tier 4.
        let t = MemoryTier { id: 4, nodes: vec![0] };
        let (a, b) = t.abstract_distance();
        assert!(a <= 576 && 576 < b);
    }

    #[test]
    fn access_figures_take_the_slower_direction() {
        let a = AccessClass {
            read_bandwidth_mbps: Some(100),
            write_bandwidth_mbps: Some(50),
            read_latency_ns: Some(200),
            write_latency_ns: None,
            ..AccessClass::default()
        };
        assert_eq!(a.bandwidth_mbps(), Some(50));
        assert_eq!(a.latency_ns(), Some(200));
    }
}
