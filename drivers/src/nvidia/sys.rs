//! Every raw FFI call of the NVIDIA backend: the NVML functions `nvml-wrapper` does not
//! expose correctly, and the `unsafe` parts of the CUDA driver API through cudarc.
//!
//! NVML: `nvmlDeviceGetGpuFabricInfo[V]` has no wrapper in nvml-wrapper 0.13, and its
//! `NvLink::remote_device_type` passes a pointer to a temporary, so it always answers
//! `Unknown`; both are called here through the function pointers nvml-wrapper resolved.

use std::ffi::{CStr, c_char, c_int};

use cudarc::driver::sys as cu;
use nvml_wrapper::Device;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings as ffi;

use super::api::{FabricHealth, FabricInfo, FabricState, NvmlCallError, RemoteType};

/// Maps an NVML return code to the backend's call error.
pub(super) fn check(rc: ffi::nvmlReturn_t) -> Result<(), NvmlCallError> {
    match rc {
        ffi::nvmlReturn_enum_NVML_SUCCESS => Ok(()),
        ffi::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED | ffi::nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND => {
            Err(NvmlCallError::NotSupported)
        }
        ffi::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => Err(NvmlCallError::InvalidArgument),
        rc => Err(NvmlCallError::Failed(format!("{} (code {rc})", NvmlError::from(rc)))),
    }
}

/// `NVML_STRUCT_VERSION(GpuFabricInfo, ver)`: the struct size with the version in the top byte.
fn struct_version<T>(ver: u32) -> u32 {
    (std::mem::size_of::<T>() as u32) | (ver << 24)
}

/// `nvmlDeviceGetGpuFabricInfoV` (v3, then v2), falling back to the older
/// `nvmlDeviceGetGpuFabricInfo`.
pub(super) fn gpu_fabric_info(device: &Device<'_>) -> Result<FabricInfo, NvmlCallError> {
    let lib = device.nvml().lib();
    if let Ok(sym) = lib.nvmlDeviceGetGpuFabricInfoV.as_ref() {
        // v3 is the largest layout; a v2 request in the same buffer leaves the tail alone.
        let attempts = [
            (3, struct_version::<ffi::nvmlGpuFabricInfo_v3_t>(3)),
            (2, struct_version::<ffi::nvmlGpuFabricInfo_v2_t>(2)),
        ];
        for (ver, version) in attempts {
            let mut info = ffi::nvmlGpuFabricInfo_v3_t {
                version,
                clusterUuid: [0; 16],
                status: 0,
                cliqueId: 0,
                state: 0,
                healthMask: 0,
                healthSummary: 0,
            };
            // SAFETY: `sym` was resolved from the library that `device.nvml()` initialised and
            // has the signature bindgen generated from nvml.h; `device.handle()` is a handle that
            // library returned and that stays valid while `device` borrows the `Nvml`; `info`
            // is a live, writable `nvmlGpuFabricInfo_v3_t`, the largest layout NVML may write
            // for the version we put in it.
            let rc = unsafe { sym(device.handle(), &mut info) };
            if rc == ffi::nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH {
                continue;
            }
            check(rc)?;
            return Ok(FabricInfo {
                state: FabricState::from_raw(info.state),
                status: info.status,
                cluster_uuid: info.clusterUuid,
                clique_id: info.cliqueId,
                health: (ver == 3).then(|| FabricHealth::from_raw(info.healthSummary)),
            });
        }
    }
    let sym = lib.nvmlDeviceGetGpuFabricInfo.as_ref().map_err(|_| NvmlCallError::NotSupported)?;
    let mut info = ffi::nvmlGpuFabricInfo_t { clusterUuid: [0; 16], status: 0, cliqueId: 0, state: 0 };
    // SAFETY: as above; `info` is a live, writable `nvmlGpuFabricInfo_t`, the type the
    // function writes.
    check(unsafe { sym(device.handle(), &mut info) })?;
    Ok(FabricInfo {
        state: FabricState::from_raw(info.state),
        status: info.status,
        cluster_uuid: info.clusterUuid,
        clique_id: info.cliqueId,
        health: None,
    })
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType`.
pub(super) fn nvlink_remote_type(device: &Device<'_>, link: u32) -> Result<RemoteType, NvmlCallError> {
    let sym =
        device.nvml().lib().nvmlDeviceGetNvLinkRemoteDeviceType.as_ref().map_err(|_| NvmlCallError::NotSupported)?;
    let mut t: ffi::nvmlIntNvLinkDeviceType_t = ffi::nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_UNKNOWN;
    // SAFETY: `sym` comes from the initialised library `device` borrows, with the signature
    // from nvml.h; the handle is live for the borrow; `t` is a writable
    // `nvmlIntNvLinkDeviceType_t`. NVML validates `link` itself.
    check(unsafe { sym(device.handle(), link, &mut t) })?;
    Ok(RemoteType::from_raw(t))
}

/// The Linux CUDA driver's soname: every driver install provides it.
const LIBCUDA: &str = "libcuda.so.1";

/// Whether cudarc can load the CUDA driver library. cudarc panics on first use when it
/// cannot, so nothing else in cudarc may be called before this says yes.
///
/// [`LIBCUDA`] is tried first, alone: without it there is no usable driver on Linux, and
/// cudarc's own probe tries 30 names (about 0.8 ms of failed `dlopen`s, a fifth of a
/// `fabricctl topology` run on a host without NVIDIA hardware).
pub(super) fn cuda_library_present() -> bool {
    // SAFETY: loading the CUDA driver library runs its initialisers, which every user of the
    // driver accepts; the handle is dropped at once (cudarc keeps its own).
    if unsafe { libloading::Library::new(LIBCUDA) }.is_err() {
        return false;
    }
    // SAFETY: `is_culib_present` dlopens the candidate names cudarc itself would load (and
    // drops the handles); loading runs the library's initialisers, which is what any user of
    // the CUDA driver accepts. It touches no Rust state.
    unsafe { cu::is_culib_present() }
}

/// One integer attribute of a device.
pub(super) fn cuda_attribute(dev: cu::CUdevice, attr: cu::CUdevice_attribute) -> Result<i32, cu::CUresult> {
    // SAFETY: `dev` came from `cuDeviceGet` after a successful `cuInit` (the only callers are
    // in `cuda.rs`, which guarantee that), as `get_attribute` requires.
    unsafe { cudarc::driver::result::device::get_attribute(dev, attr) }.map_err(|e| e.0)
}

/// Total device memory in bytes.
pub(super) fn cuda_total_mem(dev: cu::CUdevice) -> Result<usize, cu::CUresult> {
    // SAFETY: as for `cuda_attribute`, `dev` is a device from `cuDeviceGet`.
    unsafe { cudarc::driver::result::device::total_mem(dev) }.map_err(|e| e.0)
}

/// The device's PCI bus id (`0000:17:00.0`).
pub(super) fn cuda_pci_bus_id(dev: cu::CUdevice) -> Result<String, cu::CUresult> {
    const LEN: usize = 32;
    let mut buf = [0 as c_char; LEN];
    // SAFETY: `buf` is writable for `LEN` bytes and we pass that length, so the driver writes
    // at most `LEN` bytes including the terminating NUL; `dev` is a device from `cuDeviceGet`.
    let rc = unsafe { cu::cuDeviceGetPCIBusId(buf.as_mut_ptr(), LEN as c_int, dev) };
    if rc != cu::CUresult::CUDA_SUCCESS {
        return Err(rc);
    }
    let bytes = buf.map(|c| c as u8);
    CStr::from_bytes_until_nul(&bytes)
        .map(|c| c.to_string_lossy().into_owned())
        .map_err(|_| cu::CUresult::CUDA_ERROR_INVALID_VALUE)
}
