//! Serde types of the sim fabric file format (documented in `docs/sim.md`). Every table
//! denies unknown keys, so a typo is an error that names the key, never a silent default.
//!
//! Values that later checks may reject (names, references, counts) are `Spanned`, so that
//! the error points at them.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};
use toml::Spanned;

use super::r#gen::parse_size;

/// A byte size: an integer or a string with a unit (`"80GiB"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d).map_err(|_| serde::de::Error::custom("expected a size: bytes or \"80GiB\""))? {
            Raw::Int(n) => Ok(Size(n)),
            Raw::Text(t) => parse_size(&t).map(Size).map_err(serde::de::Error::custom),
        }
    }
}

/// An integer or a pattern that renders to one (`rail = "{i}"`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum IntOrPattern {
    /// A fixed value.
    Int(u32),
    /// A pattern rendered per instance.
    Pattern(String),
}

/// One value for all, or one per `j` index.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum PerJ {
    /// The same for every `j`.
    One(u16),
    /// Indexed by `j`.
    Many(Vec<u16>),
}

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimFile {
    /// Fabric name and description.
    pub fabric: FabricSpec,
    /// Node templates by name.
    #[serde(default)]
    pub templates: BTreeMap<String, Template>,
    /// Explicit nodes (possibly generated with `count`).
    #[serde(default)]
    pub node: Vec<NodeSpec>,
    /// A generated cluster of nodes with a network.
    pub cluster: Option<ClusterSpec>,
    /// Fabric-level switches (no host): NVLink switch trays, UALink switches, network.
    #[serde(default)]
    pub switch: Vec<FabricSwitchSpec>,
    /// Fabric-level links, between nodes and fabric switches.
    #[serde(default)]
    pub link: Vec<LinkSpec>,
    /// Links running below capability or down.
    #[serde(default)]
    pub degraded: Vec<DegradedSpec>,
    /// UALink pod identity for accelerators and UALink switches.
    pub ualink: Option<UalinkPodSpec>,
}

/// `[fabric]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricSpec {
    /// Name; seeds every generated UUID and serial.
    pub name: Spanned<String>,
    /// Free text for readers of the file.
    #[expect(dead_code, reason = "documentation inside the config; nothing consumes it")]
    pub description: Option<String>,
}

/// `[templates.NAME]`: the hardware of one node.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    /// Free text for readers of the file.
    #[expect(dead_code, reason = "documentation inside the config; nothing consumes it")]
    pub description: Option<String>,
    /// Sockets / NUMA nodes.
    #[serde(default)]
    pub numa: Vec<NumaSpec>,
    /// PCI host bridges (root complexes).
    #[serde(default)]
    pub host_bridge: Vec<HostBridgeSpec>,
    /// PCIe switches.
    #[serde(default)]
    pub pcie_switch: Vec<SwitchSpec>,
    /// CXL switches.
    #[serde(default)]
    pub cxl_switch: Vec<SwitchSpec>,
    /// GPUs.
    #[serde(default)]
    pub gpu: Vec<GpuSpec>,
    /// Non-GPU accelerators (UALink).
    #[serde(default)]
    pub accelerator: Vec<GpuSpec>,
    /// Network adapters.
    #[serde(default)]
    pub nic: Vec<NicSpec>,
    /// NVMe drives.
    #[serde(default)]
    pub nvme: Vec<NvmeSpec>,
    /// NVSwitches on the board.
    #[serde(default)]
    pub nvswitch: Vec<NvSwitchSpec>,
    /// CXL type-3 memory devices.
    #[serde(default)]
    pub cxl_memdev: Vec<MemdevSpec>,
    /// CXL regions over memdevs.
    #[serde(default)]
    pub cxl_region: Vec<RegionSpec>,
    /// Scale-up links inside the node or to fabric switches.
    #[serde(default)]
    pub link: Vec<LinkSpec>,
}

/// `[[templates.T.numa]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaSpec {
    /// NUMA node number (`numaN`); defaults to the position in the list.
    pub id: Option<Spanned<u32>>,
    /// CPU list (`0-55,112-167`).
    pub cpus: Spanned<String>,
    /// DRAM attached to this NUMA node.
    pub dram: Option<Size>,
    /// CPU model.
    pub model: Option<String>,
}

/// `[[templates.T.host_bridge]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostBridgeSpec {
    /// `DDDD:BB`: PCI segment and root bus; the bridge is named `pciDDDD:BB`.
    pub bus: Spanned<String>,
    /// NUMA node it hangs off.
    pub numa: Spanned<u32>,
    /// A CXL host bridge: CXL switches and memdevs below it link with CXL.
    #[serde(default)]
    pub cxl: bool,
    /// The CXL fixed memory window (root decoder) that decodes to this host bridge.
    pub window: Option<WindowSpec>,
}

/// A CXL fixed memory window.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowSpec {
    /// Host physical base.
    pub base: u64,
    /// Size.
    pub size: Size,
    /// Capabilities (`ram`, `pmem`).
    #[serde(default)]
    pub capabilities: Vec<String>,
}

/// `[[templates.T.pcie_switch]]` / `[[templates.T.cxl_switch]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchSpec {
    /// Name pattern.
    pub name: Spanned<String>,
    /// Instances (`{i}` in patterns runs over 0..count).
    pub count: Option<Spanned<i64>>,
    /// Host bridge (`pciDDDD:BB`) or switch above it; a pattern.
    pub parent: Spanned<String>,
    /// Link generation (both the uplink and the ports).
    pub r#gen: Option<u8>,
    /// Uplink width.
    pub width: Option<u8>,
    /// Model name.
    pub model: Option<String>,
    /// `VVVV:DDDD` vendor and device id.
    pub pci_id: Option<Spanned<String>>,
}

macro_rules! endpoint_spec {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            /// Name pattern.
            pub name: Spanned<String>,
            /// Instances (`{i}` in patterns runs over 0..count).
            pub count: Option<Spanned<i64>>,
            /// Host bridge, PCIe or CXL switch above it; a pattern. None: not on PCIe.
            pub parent: Option<Spanned<String>>,
            /// Explicit PCI address (`DDDD:BB:DD.F`); a pattern. Default: allocated.
            pub bdf: Option<Spanned<String>>,
            /// PCIe generation.
            pub r#gen: Option<u8>,
            /// PCIe width.
            pub width: Option<u8>,
            /// Model name.
            pub model: Option<String>,
            /// `VVVV:DDDD` vendor and device id.
            pub pci_id: Option<Spanned<String>>,
            $($(#[$fm])* pub $f: $t,)*
        }

        impl $name {
            pub(crate) fn base(&self) -> EndpointBase<'_> {
                EndpointBase {
                    name: &self.name,
                    count: self.count.as_ref(),
                    parent: self.parent.as_ref(),
                    bdf: self.bdf.as_ref(),
                    r#gen: self.r#gen,
                    width: self.width,
                    model: self.model.as_deref(),
                    pci_id: self.pci_id.as_ref(),
                }
            }
        }
    };
}

/// The fields every endpoint kind has.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EndpointBase<'a> {
    pub name: &'a Spanned<String>,
    pub count: Option<&'a Spanned<i64>>,
    pub parent: Option<&'a Spanned<String>>,
    pub bdf: Option<&'a Spanned<String>>,
    pub r#gen: Option<u8>,
    pub width: Option<u8>,
    pub model: Option<&'a str>,
    pub pci_id: Option<&'a Spanned<String>>,
}

endpoint_spec!(
    /// `[[templates.T.gpu]]` and `[[templates.T.accelerator]]`.
    GpuSpec {
        /// HBM capacity.
        hbm: Option<Size>,
        /// NVLinks the GPU supports.
        nvlinks: Option<u16>,
        /// CUDA compute capability.
        compute_capability: Option<String>,
        /// Bits of address the device can DMA to (12 to 64; default 64).
        dma_mask_bits: Option<Spanned<u8>>,
    }
);

endpoint_spec!(
    /// `[[templates.T.nic]]`.
    NicSpec {
        /// Port speed in Gb/s.
        gbps: Option<u32>,
        /// Network rail (0-based) the cluster network plugs this NIC into.
        rail: Option<Spanned<IntOrPattern>>,
    }
);

endpoint_spec!(
    /// `[[templates.T.nvme]]`.
    NvmeSpec {
        /// Capacity.
        capacity: Option<Size>,
    }
);

endpoint_spec!(
    /// `[[templates.T.nvswitch]]`.
    NvSwitchSpec {
        /// NVLink ports.
        ports: Option<u16>,
    }
);

endpoint_spec!(
    /// `[[templates.T.cxl_memdev]]`.
    MemdevSpec {
        /// Volatile capacity.
        ram: Option<Size>,
        /// Persistent capacity.
        pmem: Option<Size>,
        /// Dynamic-capacity regions advertised.
        dc_regions: Option<u32>,
        /// Size of each dynamic-capacity region.
        dc_size: Option<Size>,
        /// Serial number; default: derived from fabric, node and name.
        serial: Option<u64>,
        /// Firmware revision.
        firmware: Option<String>,
    }
);

/// Region mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionMode {
    /// Volatile.
    Ram,
    /// Persistent.
    Pmem,
}

/// `[[templates.T.cxl_region]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionSpec {
    /// Name (`region0`).
    pub name: Spanned<String>,
    /// Mode.
    pub mode: RegionMode,
    /// Member memdevs in interleave position order.
    pub targets: Spanned<Vec<Spanned<String>>>,
    /// Interleave granularity in bytes.
    pub granularity: Spanned<u32>,
    /// Size; default: ways x the smallest member capacity of the mode.
    pub size: Option<Spanned<Size>>,
    /// NUMA node the region's DAX device onlines to.
    pub numa: Option<u32>,
}

/// Kinds of links a `[[link]]` can declare (PCIe and CXL links come from `parent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKindSpec {
    /// NVLink bundle.
    Nvlink,
    /// AMD xGMI.
    Xgmi,
    /// UALink.
    Ualink,
    /// NVLink-C2C.
    C2c,
    /// Network cable.
    Network,
}

/// `[[link]]` / `[[templates.T.link]]`: `i` x `j` links from `from` to `to`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Kind.
    pub kind: LinkKindSpec,
    /// One end; a pattern.
    pub from: Spanned<String>,
    /// Other end; a pattern.
    pub to: Spanned<String>,
    /// Range of `i` (default 1).
    pub i: Option<Spanned<i64>>,
    /// Range of `j` (default 1).
    pub j: Option<Spanned<i64>>,
    /// NVLink/xGMI link count, one or one per `j`.
    pub count: Option<Spanned<PerJ>>,
    /// NVLink generation.
    pub generation: Option<Spanned<u8>>,
    /// UALink ports (stations).
    pub ports: Option<u16>,
    /// UALink lanes per port.
    pub lanes: Option<u8>,
    /// UALink signalling rate per lane in GT/s.
    pub gts: Option<u16>,
    /// Network port speed in Gb/s.
    pub gbps: Option<u32>,
    /// Bandwidth per direction in MB/s; overrides the computed figure.
    pub mbps: Option<u64>,
    /// One-way latency.
    pub latency_ns: Option<u32>,
}

/// `[[node]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Node name pattern.
    pub name: Spanned<String>,
    /// Instances.
    pub count: Option<Spanned<i64>>,
    /// Template name.
    pub template: Spanned<String>,
}

/// `[cluster]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Template name.
    pub template: Spanned<String>,
    /// Number of nodes.
    pub nodes: Spanned<i64>,
    /// Node name pattern (default `node{i}`).
    pub name: Option<Spanned<String>>,
    /// The network connecting the nodes' rail NICs.
    pub network: Option<NetworkSpec>,
}

/// Network topologies the cluster generator builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NetworkKind {
    /// One leaf group per rail; spines shared by all rails.
    RailOptimized,
    /// All NICs of consecutive nodes share leaves.
    LeafSpine,
}

/// `[cluster.network]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Topology.
    pub kind: NetworkKind,
    /// Rails: NICs per node that the network connects (NICs with `rail` 0..rails).
    pub rails: Spanned<i64>,
    /// Leaf switch ports; half face NICs, half face spines.
    pub leaf_radix: Spanned<i64>,
    /// Spine switches (default leaf_radix / 2).
    pub spines: Option<Spanned<i64>>,
    /// NIC port speed in Gb/s.
    pub gbps: u32,
    /// Leaf-to-spine speed in Gb/s (default `gbps`).
    pub uplink_gbps: Option<u32>,
    /// Leaf switch model.
    pub leaf_model: Option<String>,
    /// Spine switch model.
    pub spine_model: Option<String>,
}

/// Fabric-level switch kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FabricSwitchKind {
    /// NVLink switch (tray chip).
    Nvswitch,
    /// UALink switch.
    Ualink,
    /// Network switch.
    Network,
}

/// `[[switch]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricSwitchSpec {
    /// Kind.
    pub kind: FabricSwitchKind,
    /// Name pattern.
    pub name: Spanned<String>,
    /// Instances.
    pub count: Option<Spanned<i64>>,
    /// Model.
    pub model: Option<String>,
    /// Ports.
    pub ports: Option<u16>,
    /// Enclosure (tray) name pattern, recorded as the `tray` attribute.
    pub tray: Option<Spanned<String>>,
}

/// Which link of a device a `[[degraded]]` entry changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DegradedLink {
    /// The device's upstream PCIe link.
    Pcie,
    /// The device's upstream CXL link.
    Cxl,
    /// NVLink bundles of the device.
    Nvlink,
    /// UALink links of the device.
    Ualink,
    /// Network links of the device.
    Network,
    /// xGMI links of the device.
    Xgmi,
    /// C2C links of the device.
    C2c,
}

/// `[[degraded]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DegradedSpec {
    /// `NODE/NAME`, or a fabric switch name.
    pub device: Spanned<String>,
    /// Which link.
    pub link: DegradedLink,
    /// Only links to this peer (`NODE/NAME` or fabric name).
    pub to: Option<Spanned<String>>,
    /// PCIe/CXL: trained width.
    pub width: Option<Spanned<u8>>,
    /// PCIe: trained generation.
    pub r#gen: Option<Spanned<u8>>,
    /// NVLink/xGMI: links down in each matching bundle; UALink: ports down.
    pub down: Option<Spanned<u16>>,
    /// Network: negotiated speed.
    pub gbps: Option<Spanned<u32>>,
    /// `true`: the whole link is down.
    #[serde(default)]
    pub link_down: bool,
}

/// `[ualink]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UalinkPodSpec {
    /// Pod id.
    pub pod: Spanned<u32>,
    /// Accelerators per virtual pod (vPod = accelerator_id / vpod_size); default: one vPod.
    pub vpod_size: Option<Spanned<i64>>,
}
