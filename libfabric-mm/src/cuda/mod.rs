//! The CUDA backend: GPU memory (HBM) through the CUDA driver's virtual memory management —
//! allocate with `cuMemCreate`, export as a POSIX file descriptor or a fabric handle, import
//! in another process, map into a reserved device range with access for one or more GPUs —
//! plus dma-buf export for NIC registration, host-memory registration, copies on the GPU's
//! copy engines with event timing, and PTX kernels loaded through the driver.
//!
//! `libcuda` is loaded at run time (cudarc, dynamic loading). Before the first cudarc call
//! the library is probed with `dlopen`; without it every entry point answers
//! [`CudaError::NotPresent`] (`CUDA not present: <reason>`), never a panic. Every raw call
//! lives in `sys`, behind a token that only the presence probe and `cuInit` hand out.
//!
//! Every resource is an owned value whose `Drop` undoes it: [`CudaContext`] releases the
//! primary context, [`GpuMemory`] the allocation handle, [`GpuMapping`] and
//! [`OwnedGpuMapping`] (which keeps its memory alive) unmap and free the reserved range,
//! [`Stream`], [`Event`], [`Module`], [`HostRegistration`] and [`PeerAccess`] destroy,
//! unload, unregister and disable.
//!
//! Device memory is never exposed as a Rust slice: kernels, copies and explicit
//! host-to-device/device-to-host transfers are the only accessors.

mod context;
pub mod fdpass;
mod kernel;
mod share;
mod stream;
mod sys;
mod vmm;

use std::any::Any;
use std::sync::OnceLock;

pub use context::{CudaContext, DeviceProperties, PeerAccess, format_uuid};
pub use kernel::{Module, PATTERN_PTX, entry_params, pattern_word};
pub use share::{GpuImport, GpuRegion};
pub use stream::{Event, HostRegistration, Stream};
pub use vmm::{AllocOptions, FabricHandle, GpuMapping, GpuMemory, MappedRange, OwnedGpuMapping};

/// The library cudarc would load first on Linux; probed before any cudarc call.
pub const LIBCUDA: &str = "libcuda.so.1";

/// Why a CUDA call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver: the library is missing, or `cuInit` found no device.
    #[error("CUDA not present: {0}")]
    NotPresent(String),
    /// A driver call failed.
    #[error("{op}: {code}")]
    Call {
        /// The driver function.
        op: &'static str,
        /// The `CUresult` name.
        code: String,
        /// Its numeric value.
        raw: u32,
    },
    /// The binding panicked (a symbol missing from an old driver): caught, not propagated.
    #[error("{op}: the CUDA binding panicked: {message}")]
    Panicked {
        /// The driver function.
        op: &'static str,
        /// The panic message.
        message: String,
    },
    /// No device has this ordinal.
    #[error("no CUDA device {ordinal} ({count} present)")]
    NoSuchDevice {
        /// Ordinal asked for.
        ordinal: i32,
        /// Devices the driver reports.
        count: i32,
    },
    /// Work of one device on a mapping that was not made accessible to it (give the device
    /// as a peer when mapping).
    #[error("device {device} was not granted access to this mapping of device {owner}'s memory")]
    NoAccess {
        /// The device that would have done the copy or run the kernel.
        device: i32,
        /// The device whose memory is mapped.
        owner: i32,
    },
    /// An argument the backend checks itself (zero or overflowing sizes, ranges).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A descriptor could not be duplicated or passed.
    #[error("{op}: {message}")]
    Io {
        /// What was done.
        op: &'static str,
        /// The OS error.
        message: String,
    },
}

/// `CUDA_ERROR_NOT_SUPPORTED`.
const CUDA_ERROR_NOT_SUPPORTED: u32 = 801;
/// `CUDA_ERROR_INVALID_VALUE`: what `cuMemCreate` says for an unsupported handle type.
const CUDA_ERROR_INVALID_VALUE: u32 = 1;
/// `CUDA_ERROR_NO_DEVICE`.
const CUDA_ERROR_NO_DEVICE: u32 = 100;
/// `CUDA_ERROR_STUB_LIBRARY` (the toolkit's link stub, not a driver).
const CUDA_ERROR_STUB_LIBRARY: u32 = 34;
/// `CUDA_ERROR_INSUFFICIENT_DRIVER`.
const CUDA_ERROR_INSUFFICIENT_DRIVER: u32 = 35;

impl CudaError {
    /// Whether the driver said the device or driver does not support the operation (as
    /// opposed to a failure of a supported one).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, CudaError::Call { raw, .. } if *raw == CUDA_ERROR_NOT_SUPPORTED || *raw == CUDA_ERROR_INVALID_VALUE)
    }
}

pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned())
}

/// Probes for the driver library by name, without cudarc: `Err(reason)` when none loads.
/// The reason is the loader's own message for the first name.
pub fn probe_library(names: &[&str]) -> Result<(), String> {
    let mut first = None;
    for name in names {
        // SAFETY: loading the CUDA driver library runs its initialisers, which every user of
        // the driver accepts; the handle is dropped at once (cudarc keeps its own).
        match unsafe { libloading::Library::new(*name) } {
            Ok(_) => return Ok(()),
            Err(e) => {
                // libloading's own message is "dlopen failed"; the loader's is the source.
                let why = std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
                first.get_or_insert_with(|| if why.contains(*name) { why } else { format!("{name}: {why}") });
            }
        }
    }
    Err(first.unwrap_or_else(|| "no library name to try".to_owned()))
}

/// Whether cudarc itself would find a library to load (it tries more names than
/// [`LIBCUDA`], and panics on first use when none loads).
fn cudarc_finds_library() -> bool {
    // SAFETY: as in `probe_library`: dlopen of the candidate names, handles dropped.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Decides from the probe and `cuInit`'s result whether CUDA is usable.
fn classify_init(probe: Result<(), String>, init: impl FnOnce() -> Result<(), CudaError>) -> Result<(), CudaError> {
    probe.map_err(CudaError::NotPresent)?;
    match init() {
        Ok(()) => Ok(()),
        Err(CudaError::Call {
            op,
            code,
            raw: CUDA_ERROR_NO_DEVICE | CUDA_ERROR_STUB_LIBRARY | CUDA_ERROR_INSUFFICIENT_DRIVER,
        }) => Err(CudaError::NotPresent(format!("{op}: {code}"))),
        Err(CudaError::Panicked { op, message }) => Err(CudaError::NotPresent(format!("{op}: {message}"))),
        Err(e) => Err(e),
    }
}

/// The initialised driver, or why there is none. Probes and initialises once per process.
fn driver() -> Result<sys::Driver, CudaError> {
    static STATE: OnceLock<Result<(), CudaError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let probe = probe_library(&[LIBCUDA]).and_then(|()| {
                if cudarc_finds_library() {
                    Ok(())
                } else {
                    Err(format!("{LIBCUDA} loads, but not under any name cudarc tries"))
                }
            });
            let r = classify_init(probe, sys::init);
            match &r {
                Ok(()) => tracing::info!("CUDA driver initialised"),
                Err(e) => tracing::info!("{e}"),
            }
            r
        })
        .clone()
        .map(|()| sys::Driver::after_init())
}

/// Whether CUDA is usable in this process, and why not.
pub fn available() -> Result<(), CudaError> {
    driver().map(|_| ())
}

/// The driver's CUDA version (`12080` = 12.8).
pub fn driver_version() -> Result<i32, CudaError> {
    driver()?.driver_version()
}

/// Number of CUDA devices.
pub fn device_count() -> Result<i32, CudaError> {
    driver()?.device_count()
}

/// Rounds `size` up to a multiple of `granularity` (a power of two or not), refusing zero
/// sizes and overflow.
pub fn round_up(size: usize, granularity: usize) -> Result<usize, CudaError> {
    if size == 0 {
        return Err(CudaError::InvalidArgument("size 0".into()));
    }
    if granularity == 0 {
        return Err(CudaError::InvalidArgument("granularity 0".into()));
    }
    size.div_ceil(granularity)
        .checked_mul(granularity)
        .ok_or_else(|| CudaError::InvalidArgument(format!("{size} bytes overflow at granularity {granularity}")))
}

#[cfg(test)]
mod tests;
