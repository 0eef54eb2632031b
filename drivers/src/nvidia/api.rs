//! The NVML calls the NVIDIA backend uses, behind one trait, so that discovery logic runs
//! against the real library ([`super::nvml::NvmlLibrary`]) or a fake in tests.
//!
//! Devices are addressed by NVML's enumeration index. The index is only a handle for one
//! discovery pass; identities are built from the UUID (or the PCI address), never from it.

use std::fmt;

/// NVML's ceiling on NVLinks per device (`NVML_NVLINK_MAX_LINKS`, 18 since Hopper).
pub const NVLINK_MAX_LINKS: u32 = nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS;

/// Why one NVML call gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NvmlCallError {
    /// The device, the driver or this library version does not support the query (including
    /// a function missing from an older `libnvidia-ml`).
    #[error("not supported")]
    NotSupported,
    /// NVML rejected an argument: for NVLink queries, a link the device does not have.
    #[error("invalid argument")]
    InvalidArgument,
    /// `NVML_ERROR_GPU_IS_LOST`: the GPU fell off the bus or stopped responding.
    #[error("the GPU is lost (fell off the bus or stopped responding)")]
    GpuLost,
    /// Any other failure, with NVML's description.
    #[error("{0}")]
    Failed(String),
}

/// A device's PCI identity as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmlPci {
    /// The bus id string, e.g. `00000000:17:00.0` (8-hex-digit domain).
    pub bus_id: String,
    /// NVML's combined id: device id in the high 16 bits, vendor id in the low 16 bits.
    pub pci_device_id: u32,
}

/// The GPU fabric (NVSwitch / IMEX registration) probe result of one GPU
/// (`nvmlDeviceGetGpuFabricInfo[V]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricInfo {
    /// Probe state.
    pub state: FabricState,
    /// NVML's return code for the probe, meaningful once `state` is `Completed`
    /// (0 = success).
    pub status: u32,
    /// Fabric cluster UUID (all zero until registration completes).
    pub cluster_uuid: [u8; 16],
    /// Clique id within the cluster.
    pub clique_id: u32,
    /// Health summary (v3 of the struct only): `None` when the driver did not report it.
    pub health: Option<FabricHealth>,
}

/// `nvmlGpuFabricState_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricState {
    /// The GPU does not take part in a fabric.
    NotSupported,
    /// Registration has not started.
    NotStarted,
    /// Registration is running.
    InProgress,
    /// Registration finished (see `status` for the outcome).
    Completed,
    /// A value this code does not know.
    Other(u8),
}

impl FabricState {
    /// Decodes NVML's state byte.
    pub fn from_raw(v: u8) -> Self {
        match v {
            0 => FabricState::NotSupported,
            1 => FabricState::NotStarted,
            2 => FabricState::InProgress,
            3 => FabricState::Completed,
            v => FabricState::Other(v),
        }
    }

    /// The name used in [`fabric_topology::GpuInfo::fabric_state`].
    pub fn name(&self) -> String {
        match self {
            FabricState::NotSupported => "not_supported".to_owned(),
            FabricState::NotStarted => "not_started".to_owned(),
            FabricState::InProgress => "in_progress".to_owned(),
            FabricState::Completed => "completed".to_owned(),
            FabricState::Other(v) => format!("unknown({v})"),
        }
    }
}

/// `NVML_GPU_FABRIC_HEALTH_SUMMARY_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FabricHealth {
    /// The driver does not report health.
    NotSupported,
    /// Healthy.
    Healthy,
    /// Unhealthy.
    Unhealthy,
    /// Running with reduced capacity (e.g. links or routes lost).
    LimitedCapacity,
    /// A value this code does not know.
    Other(u8),
}

impl FabricHealth {
    /// Decodes NVML's health-summary byte.
    pub fn from_raw(v: u8) -> Self {
        match v {
            0 => FabricHealth::NotSupported,
            1 => FabricHealth::Healthy,
            2 => FabricHealth::Unhealthy,
            3 => FabricHealth::LimitedCapacity,
            v => FabricHealth::Other(v),
        }
    }
}

impl fmt::Display for FabricHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricHealth::NotSupported => f.write_str("not_supported"),
            FabricHealth::Healthy => f.write_str("healthy"),
            FabricHealth::Unhealthy => f.write_str("unhealthy"),
            FabricHealth::LimitedCapacity => f.write_str("limited_capacity"),
            FabricHealth::Other(v) => write!(f, "unknown({v})"),
        }
    }
}

/// What sits at the far end of an NVLink (`nvmlIntNvLinkDeviceType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RemoteType {
    /// Another GPU.
    Gpu,
    /// An IBM POWER NPU (the CPU end of a CPU-GPU NVLink).
    IbmNpu,
    /// An NVSwitch.
    Switch,
    /// NVML does not know.
    Unknown,
}

impl RemoteType {
    /// Decodes NVML's device-type value.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0 => RemoteType::Gpu,
            1 => RemoteType::IbmNpu,
            2 => RemoteType::Switch,
            _ => RemoteType::Unknown,
        }
    }
}

/// The peer-to-peer capabilities the backend asks about (`nvmlGpuP2PCapsIndex_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum P2pCap {
    /// P2P reads.
    Read,
    /// P2P writes.
    Write,
    /// P2P over NVLink.
    NvLink,
    /// P2P atomics.
    Atomics,
    /// P2P over PCIe (NVML's "prop" index: PCIe peer traffic).
    Pci,
}

impl P2pCap {
    /// Every capability the backend queries, in matrix order.
    pub const ALL: [P2pCap; 5] = [P2pCap::Read, P2pCap::Write, P2pCap::NvLink, P2pCap::Atomics, P2pCap::Pci];

    /// Short name for attribute keys.
    pub fn as_str(&self) -> &'static str {
        match self {
            P2pCap::Read => "read",
            P2pCap::Write => "write",
            P2pCap::NvLink => "nvlink",
            P2pCap::Atomics => "atomics",
            P2pCap::Pci => "pci",
        }
    }
}

/// `nvmlGpuP2PStatus_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum P2pStatus {
    /// Supported.
    Ok,
    /// The chipset does not support it.
    ChipsetNotSupported,
    /// The GPU does not support it.
    GpuNotSupported,
    /// The IOH topology does not support it.
    TopologyNotSupported,
    /// Disabled by a driver registry key.
    DisabledByRegkey,
    /// Not supported.
    NotSupported,
    /// NVML does not know.
    Unknown,
}

impl fmt::Display for P2pStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            P2pStatus::Ok => "ok",
            P2pStatus::ChipsetNotSupported => "chipset_not_supported",
            P2pStatus::GpuNotSupported => "gpu_not_supported",
            P2pStatus::TopologyNotSupported => "topology_not_supported",
            P2pStatus::DisabledByRegkey => "disabled_by_regkey",
            P2pStatus::NotSupported => "not_supported",
            P2pStatus::Unknown => "unknown",
        })
    }
}

/// The NVML queries discovery needs. Every method answers for one device (by enumeration
/// index) and may fail independently; a failure makes that attribute unknown, nothing more.
pub trait NvmlSource {
    /// Number of GPUs NVML sees.
    fn device_count(&self) -> Result<u32, NvmlCallError>;
    /// `GPU-…` UUID.
    fn uuid(&self, dev: u32) -> Result<String, NvmlCallError>;
    /// Product name.
    fn name(&self, dev: u32) -> Result<String, NvmlCallError>;
    /// Board serial number.
    fn serial(&self, dev: u32) -> Result<String, NvmlCallError>;
    /// PCI bus id and ids.
    fn pci(&self, dev: u32) -> Result<NvmlPci, NvmlCallError>;
    /// Total framebuffer memory in bytes.
    fn memory_total(&self, dev: u32) -> Result<u64, NvmlCallError>;
    /// NUMA node of the GPU's own memory, where the GPU memory is a NUMA node (C2C systems).
    fn memory_numa_node(&self, dev: u32) -> Result<u32, NvmlCallError>;
    /// Bitmask (64-bit words, CPU 0 in bit 0 of word 0) of the NUMA nodes near the GPU.
    fn numa_affinity(&self, dev: u32) -> Result<Vec<u64>, NvmlCallError>;
    /// Bitmask (64-bit words) of the CPUs near the GPU.
    fn cpu_affinity(&self, dev: u32) -> Result<Vec<u64>, NvmlCallError>;
    /// GPU fabric registration state.
    fn fabric_info(&self, dev: u32) -> Result<FabricInfo, NvmlCallError>;
    /// Whether an NVLink is active; `InvalidArgument`/`NotSupported` for links the device
    /// does not have.
    fn nvlink_active(&self, dev: u32, link: u32) -> Result<bool, NvmlCallError>;
    /// The link's version as NVML reports it (an `nvmlNvlinkVersion_t` code, see
    /// [`nvlink_generation`]).
    fn nvlink_version(&self, dev: u32, link: u32) -> Result<u32, NvmlCallError>;
    /// PCI bus id of the device at the far end of the link.
    fn nvlink_remote_bus_id(&self, dev: u32, link: u32) -> Result<String, NvmlCallError>;
    /// Type of the device at the far end of the link.
    fn nvlink_remote_type(&self, dev: u32, link: u32) -> Result<RemoteType, NvmlCallError>;
    /// P2P status of a capability between two GPUs.
    fn p2p_status(&self, a: u32, b: u32, cap: P2pCap) -> Result<P2pStatus, NvmlCallError>;
}

/// Maps NVML's `nvmlNvlinkVersion_t` code to the NVLink generation.
///
/// `nvmlDeviceGetNvLinkVersion` returns the enum code, not the generation: A100 reports 5
/// (NVLink 3.1), H100 reports 6 (NVLink 4.0), B200 7 (NVLink 5.0).
pub fn nvlink_generation(code: u32) -> Option<u8> {
    match code {
        1 => Some(1),     // 1.0
        2 | 3 => Some(2), // 2.0, 2.2
        4 | 5 => Some(3), // 3.0, 3.1
        6 => Some(4),     // 4.0
        7 => Some(5),     // 5.0
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvlink_version_codes_map_to_generations() {
        assert_eq!(nvlink_generation(5), Some(3), "A100 reports 3.1");
        assert_eq!(nvlink_generation(6), Some(4), "H100 reports 4.0");
        assert_eq!(nvlink_generation(7), Some(5));
        assert_eq!(nvlink_generation(0), None, "invalid");
        assert_eq!(nvlink_generation(8), None);
    }

    #[test]
    fn raw_enums_decode() {
        assert_eq!(FabricState::from_raw(3).name(), "completed");
        assert_eq!(FabricState::from_raw(9).name(), "unknown(9)");
        assert_eq!(RemoteType::from_raw(2), RemoteType::Switch);
        assert_eq!(RemoteType::from_raw(255), RemoteType::Unknown);
        assert_eq!(FabricHealth::from_raw(3).to_string(), "limited_capacity");
    }
}
