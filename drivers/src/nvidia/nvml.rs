//! The real [`NvmlSource`]: `libnvidia-ml` loaded at run time through `nvml-wrapper`.

use std::ffi::{OsStr, c_ulong};
use std::path::{Path, PathBuf};

use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus as WrapperP2p};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};

use super::api::{FabricInfo, NvmlCallError, NvmlPci, NvmlSource, P2pCap, P2pStatus, RemoteType};
use super::sys;

/// The library name the NVIDIA driver installs (the unversioned `.so` link only comes with
/// development packages).
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// Environment variable that overrides the library path.
pub const LIBRARY_ENV: &str = "FABRIC_NVML_LIBRARY";

/// 64-bit words asked for in NUMA node masks (1,024 nodes).
const NODE_MASK_WORDS: usize = 16;
/// 64-bit words asked for in CPU masks (8,192 CPUs, the kernel's NR_CPUS maximum).
const CPU_MASK_WORDS: usize = 128;

/// Why NVML could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum NvmlLibraryError {
    /// The shared object could not be loaded.
    #[error("{path} not found: {reason}")]
    Load {
        /// The path or name tried.
        path: String,
        /// The loader's message.
        reason: String,
    },
    /// It loaded, but is not an NVML library (`nvmlInit_v2` missing).
    #[error("{path} is not an NVML library: {reason}")]
    NotNvml {
        /// The path or name tried.
        path: String,
        /// Which symbol was missing.
        reason: String,
    },
    /// The library is there but the kernel driver is not loaded.
    #[error("NVIDIA driver not loaded")]
    DriverNotLoaded,
    /// `nvmlInit` failed for another reason (permissions, driver/library mismatch).
    #[error("nvmlInit failed: {0}")]
    Init(String),
}

impl NvmlLibraryError {
    /// True when the failure means "no NVIDIA stack here" rather than "broken stack".
    pub fn is_absence(&self) -> bool {
        matches!(
            self,
            NvmlLibraryError::Load { .. } | NvmlLibraryError::NotNvml { .. } | NvmlLibraryError::DriverNotLoaded
        )
    }
}

/// The library path to use: `FABRIC_NVML_LIBRARY` when set and not empty, else
/// [`DEFAULT_LIBRARY`] (resolved by the dynamic loader's search path).
pub fn library_from_env() -> PathBuf {
    std::env::var_os(LIBRARY_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_LIBRARY), PathBuf::from)
}

/// An initialised NVML. `nvmlShutdown` runs when it is dropped.
#[derive(Debug)]
pub struct NvmlLibrary {
    nvml: Nvml,
}

impl NvmlLibrary {
    /// Loads the library at `path` (a file name is searched for like `dlopen` does) and
    /// initialises NVML.
    pub fn open(path: &Path) -> Result<Self, NvmlLibraryError> {
        let shown = path.display().to_string();
        let nvml = Nvml::builder().lib_path(OsStr::new(path.as_os_str())).init().map_err(|e| match e {
            NvmlError::LibloadingError(e) => NvmlLibraryError::Load { path: shown.clone(), reason: e.to_string() },
            NvmlError::FailedToLoadSymbol(s) => NvmlLibraryError::NotNvml { path: shown.clone(), reason: s },
            NvmlError::DriverNotLoaded => NvmlLibraryError::DriverNotLoaded,
            e => NvmlLibraryError::Init(e.to_string()),
        })?;
        Ok(Self { nvml })
    }

    fn device(&self, dev: u32) -> Result<Device<'_>, NvmlCallError> {
        self.nvml.device_by_index(dev).map_err(call_error)
    }
}

/// Maps nvml-wrapper's error to the backend's call error.
fn call_error(e: NvmlError) -> NvmlCallError {
    match e {
        NvmlError::NotSupported | NvmlError::FunctionNotFound | NvmlError::FailedToLoadSymbol(_) => {
            NvmlCallError::NotSupported
        }
        NvmlError::InvalidArg => NvmlCallError::InvalidArgument,
        NvmlError::GpuLost => NvmlCallError::GpuLost,
        e => NvmlCallError::Failed(e.to_string()),
    }
}

/// Repacks a `c_ulong` bitmask into 64-bit words, whatever the width of `c_ulong`.
fn to_u64_words(words: &[c_ulong]) -> Vec<u64> {
    let bits = c_ulong::BITS as usize;
    let mut out = vec![0u64; (words.len() * bits).div_ceil(64)];
    for (i, &w) in words.iter().enumerate() {
        for b in 0..bits {
            if (w >> b) & 1 == 1 {
                let n = i * bits + b;
                out[n / 64] |= 1 << (n % 64);
            }
        }
    }
    out
}

impl NvmlSource for NvmlLibrary {
    fn device_count(&self) -> Result<u32, NvmlCallError> {
        self.nvml.device_count().map_err(call_error)
    }

    fn uuid(&self, dev: u32) -> Result<String, NvmlCallError> {
        self.device(dev)?.uuid().map_err(call_error)
    }

    fn name(&self, dev: u32) -> Result<String, NvmlCallError> {
        self.device(dev)?.name().map_err(call_error)
    }

    fn serial(&self, dev: u32) -> Result<String, NvmlCallError> {
        self.device(dev)?.serial().map_err(call_error)
    }

    fn pci(&self, dev: u32) -> Result<NvmlPci, NvmlCallError> {
        let p = self.device(dev)?.pci_info().map_err(call_error)?;
        Ok(NvmlPci { bus_id: p.bus_id, pci_device_id: p.pci_device_id })
    }

    fn memory_total(&self, dev: u32) -> Result<u64, NvmlCallError> {
        Ok(self.device(dev)?.memory_info().map_err(call_error)?.total)
    }

    fn memory_numa_node(&self, dev: u32) -> Result<u32, NvmlCallError> {
        self.device(dev)?.numa_node_id().map_err(call_error)
    }

    #[cfg(target_os = "linux")]
    fn numa_affinity(&self, dev: u32) -> Result<Vec<u64>, NvmlCallError> {
        let scope = nvml_wrapper_sys::bindings::NVML_AFFINITY_SCOPE_NODE;
        let words = self.device(dev)?.memory_affinity(NODE_MASK_WORDS, scope).map_err(call_error)?;
        Ok(to_u64_words(&words))
    }

    #[cfg(not(target_os = "linux"))]
    fn numa_affinity(&self, _dev: u32) -> Result<Vec<u64>, NvmlCallError> {
        Err(NvmlCallError::NotSupported)
    }

    #[cfg(target_os = "linux")]
    fn cpu_affinity(&self, dev: u32) -> Result<Vec<u64>, NvmlCallError> {
        let words = self.device(dev)?.cpu_affinity(CPU_MASK_WORDS).map_err(call_error)?;
        Ok(to_u64_words(&words))
    }

    #[cfg(not(target_os = "linux"))]
    fn cpu_affinity(&self, _dev: u32) -> Result<Vec<u64>, NvmlCallError> {
        Err(NvmlCallError::NotSupported)
    }

    fn fabric_info(&self, dev: u32) -> Result<FabricInfo, NvmlCallError> {
        sys::gpu_fabric_info(&self.device(dev)?)
    }

    fn nvlink_active(&self, dev: u32, link: u32) -> Result<bool, NvmlCallError> {
        self.device(dev)?.link_wrapper_for(link).is_active().map_err(call_error)
    }

    fn nvlink_version(&self, dev: u32, link: u32) -> Result<u32, NvmlCallError> {
        self.device(dev)?.link_wrapper_for(link).version().map_err(call_error)
    }

    fn nvlink_remote_bus_id(&self, dev: u32, link: u32) -> Result<String, NvmlCallError> {
        Ok(self.device(dev)?.link_wrapper_for(link).remote_pci_info().map_err(call_error)?.bus_id)
    }

    fn nvlink_remote_type(&self, dev: u32, link: u32) -> Result<RemoteType, NvmlCallError> {
        sys::nvlink_remote_type(&self.device(dev)?, link)
    }

    fn p2p_status(&self, a: u32, b: u32, cap: P2pCap) -> Result<P2pStatus, NvmlCallError> {
        let index = match cap {
            P2pCap::Read => P2pCapabilitiesIndex::Read,
            P2pCap::Write => P2pCapabilitiesIndex::Write,
            P2pCap::NvLink => P2pCapabilitiesIndex::NvLink,
            P2pCap::Atomics => P2pCapabilitiesIndex::Atomics,
            P2pCap::Pci => P2pCapabilitiesIndex::Prop,
        };
        let s = self.device(a)?.p2p_status(&self.device(b)?, index).map_err(call_error)?;
        Ok(match s {
            WrapperP2p::Ok => P2pStatus::Ok,
            WrapperP2p::ChipsetNotSupported => P2pStatus::ChipsetNotSupported,
            WrapperP2p::GpuNotSupported => P2pStatus::GpuNotSupported,
            WrapperP2p::IohTopologyNotSupported => P2pStatus::TopologyNotSupported,
            WrapperP2p::DisabledByRegkey => P2pStatus::DisabledByRegkey,
            WrapperP2p::NotSupported => P2pStatus::NotSupported,
            WrapperP2p::Unknown => P2pStatus::Unknown,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_repack_into_u64_words() {
        let words: Vec<c_ulong> = vec![0b101, 1];
        let out = to_u64_words(&words);
        let bits = c_ulong::BITS as usize;
        let set: Vec<usize> = (0..out.len() * 64).filter(|&n| out[n / 64] >> (n % 64) & 1 == 1).collect();
        assert_eq!(set, vec![0, 2, bits]);
    }
}
