//! Every raw CUDA driver call of the CUDA backend, through cudarc's dynamically loaded
//! bindings. Each call runs behind a panic guard (cudarc panics when a symbol is missing)
//! and turns its `CUresult` into a [`CudaError`].
//!
//! The calls are methods of [`Driver`], a token that only [`super::driver`] hands out, after
//! the library probe and a successful `cuInit`: holding one is the proof that calling into
//! cudarc cannot panic for want of `libcuda`.

use std::ffi::{CString, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use cudarc::driver::sys as cu;

use super::CudaError;

pub(super) use cu::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmemGenericAllocationHandle, CUmodule, CUstream,
};

/// Runs one driver call, mapping a panic of the binding and a failed `CUresult` to errors.
fn call(op: &'static str, f: impl FnOnce() -> cu::CUresult) -> Result<(), CudaError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(cu::CUresult::CUDA_SUCCESS) => Ok(()),
        Ok(code) => Err(CudaError::Call { op, code: format!("{code:?}"), raw: code as u32 }),
        Err(p) => Err(CudaError::Panicked { op, message: super::panic_message(p.as_ref()) }),
    }
}

/// `cuInit(0)`. Only [`super::driver`] calls it, after the library probe succeeded.
pub(super) fn init() -> Result<(), CudaError> {
    // SAFETY: cuInit takes no pointers; the caller has checked that cudarc can load the
    // library, and a missing symbol is caught by `call`.
    call("cuInit", || unsafe { cu::cuInit(0) })
}

/// Proof that the driver library is loaded and initialised; the way to every other call.
#[derive(Debug, Clone, Copy)]
pub(super) struct Driver(());

impl Driver {
    /// Only [`super::driver`] creates one, after [`init`] succeeded.
    pub(super) fn after_init() -> Self {
        Driver(())
    }

    pub(super) fn driver_version(self) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a live, writable int.
        call("cuDriverGetVersion", || unsafe { cu::cuDriverGetVersion(&mut v) })?;
        Ok(v)
    }

    pub(super) fn device_count(self) -> Result<i32, CudaError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a live, writable int; the driver is initialised.
        call("cuDeviceGetCount", || unsafe { cu::cuDeviceGetCount(&mut n) })?;
        Ok(n)
    }

    pub(super) fn device(self, ordinal: i32) -> Result<CUdevice, CudaError> {
        let mut d: CUdevice = 0;
        // SAFETY: `d` is writable; the driver validates the ordinal.
        call("cuDeviceGet", || unsafe { cu::cuDeviceGet(&mut d, ordinal) })?;
        Ok(d)
    }

    pub(super) fn uuid(self, dev: CUdevice) -> Result<[u8; 16], CudaError> {
        let mut u = cu::CUuuid { bytes: [0; 16] };
        // SAFETY: `u` is a writable 16-byte struct; `dev` came from cuDeviceGet.
        call("cuDeviceGetUuid", || unsafe { cu::cuDeviceGetUuid_v2(&mut u, dev) })?;
        Ok(u.bytes.map(|b| b as u8))
    }

    pub(super) fn attribute(self, dev: CUdevice, attr: cu::CUdevice_attribute) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is writable; `dev` came from cuDeviceGet.
        call("cuDeviceGetAttribute", || unsafe { cu::cuDeviceGetAttribute(&mut v, attr, dev) })?;
        Ok(v)
    }

    pub(super) fn can_access_peer(self, dev: CUdevice, peer: CUdevice) -> Result<bool, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is writable; both devices came from cuDeviceGet.
        call("cuDeviceCanAccessPeer", || unsafe { cu::cuDeviceCanAccessPeer(&mut v, dev, peer) })?;
        Ok(v != 0)
    }

    pub(super) fn primary_ctx_retain(self, dev: CUdevice) -> Result<CUcontext, CudaError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is writable; `dev` came from cuDeviceGet.
        call("cuDevicePrimaryCtxRetain", || unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        Ok(ctx)
    }

    pub(super) fn primary_ctx_release(self, dev: CUdevice) -> Result<(), CudaError> {
        // SAFETY: called once per successful retain of `dev` (the owner's Drop).
        call("cuDevicePrimaryCtxRelease", || unsafe { cu::cuDevicePrimaryCtxRelease_v2(dev) })
    }

    pub(super) fn set_current(self, ctx: CUcontext) -> Result<(), CudaError> {
        // SAFETY: `ctx` is a primary context retained by the caller for as long as it uses it.
        call("cuCtxSetCurrent", || unsafe { cu::cuCtxSetCurrent(ctx) })
    }

    pub(super) fn enable_peer_access(self, peer: CUcontext) -> Result<(), CudaError> {
        // SAFETY: `peer` is a retained primary context; the current context is the caller's.
        call("cuCtxEnablePeerAccess", || unsafe { cu::cuCtxEnablePeerAccess(peer, 0) })
    }

    pub(super) fn disable_peer_access(self, peer: CUcontext) -> Result<(), CudaError> {
        // SAFETY: as for `enable_peer_access`.
        call("cuCtxDisablePeerAccess", || unsafe { cu::cuCtxDisablePeerAccess(peer) })
    }

    pub(super) fn granularity(
        self,
        prop: &cu::CUmemAllocationProp,
        option: cu::CUmemAllocationGranularity_flags,
    ) -> Result<usize, CudaError> {
        let mut g = 0usize;
        // SAFETY: `g` is writable and `prop` a live, fully initialised property struct.
        call("cuMemGetAllocationGranularity", || unsafe { cu::cuMemGetAllocationGranularity(&mut g, prop, option) })?;
        Ok(g)
    }

    pub(super) fn mem_create(
        self,
        size: usize,
        prop: &cu::CUmemAllocationProp,
    ) -> Result<CUmemGenericAllocationHandle, CudaError> {
        let mut h: CUmemGenericAllocationHandle = 0;
        // SAFETY: `h` is writable and `prop` fully initialised; the driver checks `size`
        // against the granularity.
        call("cuMemCreate", || unsafe { cu::cuMemCreate(&mut h, size, prop, 0) })?;
        Ok(h)
    }

    pub(super) fn mem_release(self, h: CUmemGenericAllocationHandle) -> Result<(), CudaError> {
        // SAFETY: `h` is an allocation handle owned by the caller and released once.
        call("cuMemRelease", || unsafe { cu::cuMemRelease(h) })
    }

    pub(super) fn export_fd(self, h: CUmemGenericAllocationHandle) -> Result<c_int, CudaError> {
        let mut fd: c_int = -1;
        let ty = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes an `int` through the pointer,
        // and `fd` is a live, writable int; `h` is a live allocation handle.
        call("cuMemExportToShareableHandle(fd)", || unsafe {
            cu::cuMemExportToShareableHandle((&raw mut fd).cast::<c_void>(), h, ty, 0)
        })?;
        Ok(fd)
    }

    pub(super) fn export_fabric(self, h: CUmemGenericAllocationHandle) -> Result<[u8; 64], CudaError> {
        let mut fh = cu::CUmemFabricHandle { data: [0; 64] };
        let ty = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
        // SAFETY: for FABRIC the driver writes a `CUmemFabricHandle` (64 bytes), which `fh` is.
        call("cuMemExportToShareableHandle(fabric)", || unsafe {
            cu::cuMemExportToShareableHandle((&raw mut fh).cast::<c_void>(), h, ty, 0)
        })?;
        Ok(fh.data)
    }

    pub(super) fn import_fd(self, fd: c_int) -> Result<CUmemGenericAllocationHandle, CudaError> {
        let mut h: CUmemGenericAllocationHandle = 0;
        let ty = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the "pointer" is the descriptor's value (the
        // CUDA documentation says so); the driver dups what it needs and does not take
        // ownership; `h` is writable.
        call("cuMemImportFromShareableHandle(fd)", || unsafe {
            cu::cuMemImportFromShareableHandle(&mut h, fd as isize as *mut c_void, ty)
        })?;
        Ok(h)
    }

    pub(super) fn import_fabric(self, data: &[u8; 64]) -> Result<CUmemGenericAllocationHandle, CudaError> {
        let mut h: CUmemGenericAllocationHandle = 0;
        let mut fh = cu::CUmemFabricHandle { data: *data };
        let ty = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
        // SAFETY: for FABRIC the driver reads a `CUmemFabricHandle` through the pointer; `fh`
        // is one and outlives the call.
        call("cuMemImportFromShareableHandle(fabric)", || unsafe {
            cu::cuMemImportFromShareableHandle(&mut h, (&raw mut fh).cast::<c_void>(), ty)
        })?;
        Ok(h)
    }

    pub(super) fn address_reserve(self, size: usize, alignment: usize) -> Result<CUdeviceptr, CudaError> {
        let mut va: CUdeviceptr = 0;
        // SAFETY: `va` is writable; no fixed address is requested.
        call("cuMemAddressReserve", || unsafe { cu::cuMemAddressReserve(&mut va, size, alignment, 0, 0) })?;
        Ok(va)
    }

    pub(super) fn address_free(self, va: CUdeviceptr, size: usize) -> Result<(), CudaError> {
        // SAFETY: `va`/`size` is a range the caller reserved and no longer maps.
        call("cuMemAddressFree", || unsafe { cu::cuMemAddressFree(va, size) })
    }

    pub(super) fn map(self, va: CUdeviceptr, size: usize, h: CUmemGenericAllocationHandle) -> Result<(), CudaError> {
        // SAFETY: `va`/`size` lies in a range the caller reserved and has not mapped; `h` is
        // a live allocation handle at least `size` bytes long.
        call("cuMemMap", || unsafe { cu::cuMemMap(va, size, 0, h, 0) })
    }

    pub(super) fn unmap(self, va: CUdeviceptr, size: usize) -> Result<(), CudaError> {
        // SAFETY: `va`/`size` is a range the caller mapped; nothing uses it any more.
        call("cuMemUnmap", || unsafe { cu::cuMemUnmap(va, size) })
    }

    pub(super) fn set_access(
        self,
        va: CUdeviceptr,
        size: usize,
        desc: &[cu::CUmemAccessDesc],
    ) -> Result<(), CudaError> {
        // SAFETY: `desc` is a live slice of initialised descriptors and we pass its length;
        // `va`/`size` is a mapped range.
        call("cuMemSetAccess", || unsafe { cu::cuMemSetAccess(va, size, desc.as_ptr(), desc.len()) })
    }

    pub(super) fn dma_buf_fd(self, va: CUdeviceptr, size: usize) -> Result<c_int, CudaError> {
        let mut fd: c_int = -1;
        let ty = cu::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;
        // SAFETY: for DMA_BUF_FD the driver writes an `int`; `fd` is a writable int; the
        // range is mapped in the current context.
        call("cuMemGetHandleForAddressRange", || unsafe {
            cu::cuMemGetHandleForAddressRange((&raw mut fd).cast::<c_void>(), va, size, ty, 0)
        })?;
        Ok(fd)
    }

    /// # Safety
    /// `ptr..ptr+len` must be host memory this process owns and keeps allocated until
    /// [`Driver::host_unregister`].
    pub(super) unsafe fn host_register(self, ptr: *mut c_void, len: usize) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees the range (this function's contract).
        call("cuMemHostRegister", || unsafe { cu::cuMemHostRegister_v2(ptr, len, 0) })
    }

    pub(super) fn host_unregister(self, ptr: *mut c_void) -> Result<(), CudaError> {
        // SAFETY: `ptr` was registered by `host_register` and is unregistered once.
        call("cuMemHostUnregister", || unsafe { cu::cuMemHostUnregister(ptr) })
    }

    pub(super) fn stream_create(self) -> Result<CUstream, CudaError> {
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: `s` is writable; flags 1 = CU_STREAM_NON_BLOCKING.
        call("cuStreamCreate", || unsafe { cu::cuStreamCreate(&mut s, 1) })?;
        Ok(s)
    }

    pub(super) fn stream_destroy(self, s: CUstream) -> Result<(), CudaError> {
        // SAFETY: `s` was created by `stream_create` and is destroyed once.
        call("cuStreamDestroy", || unsafe { cu::cuStreamDestroy_v2(s) })
    }

    pub(super) fn stream_synchronize(self, s: CUstream) -> Result<(), CudaError> {
        // SAFETY: `s` is a live stream.
        call("cuStreamSynchronize", || unsafe { cu::cuStreamSynchronize(s) })
    }

    pub(super) fn event_create(self) -> Result<CUevent, CudaError> {
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: `e` is writable; flags 0 = default (timing enabled).
        call("cuEventCreate", || unsafe { cu::cuEventCreate(&mut e, 0) })?;
        Ok(e)
    }

    pub(super) fn event_destroy(self, e: CUevent) -> Result<(), CudaError> {
        // SAFETY: `e` was created by `event_create` and is destroyed once.
        call("cuEventDestroy", || unsafe { cu::cuEventDestroy_v2(e) })
    }

    pub(super) fn event_record(self, e: CUevent, s: CUstream) -> Result<(), CudaError> {
        // SAFETY: both are live objects of the current context.
        call("cuEventRecord", || unsafe { cu::cuEventRecord(e, s) })
    }

    pub(super) fn event_synchronize(self, e: CUevent) -> Result<(), CudaError> {
        // SAFETY: `e` is a live event.
        call("cuEventSynchronize", || unsafe { cu::cuEventSynchronize(e) })
    }

    pub(super) fn event_elapsed_ms(self, start: CUevent, end: CUevent) -> Result<f32, CudaError> {
        let mut ms = 0f32;
        // SAFETY: `ms` is writable; both events are live and were recorded.
        call("cuEventElapsedTime", || unsafe { cu::cuEventElapsedTime(&mut ms, start, end) })?;
        Ok(ms)
    }

    /// # Safety
    /// Both ranges must be device memory the current context can access, `len` bytes long,
    /// and stay mapped until the stream has finished the copy.
    pub(super) unsafe fn memcpy_dtod_async(
        self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        len: usize,
        s: CUstream,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees both ranges (this function's contract).
        call("cuMemcpyDtoDAsync", || unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, len, s) })
    }

    /// # Safety
    /// As for [`Driver::memcpy_dtod_async`]. The driver does not wait for device-to-device
    /// copies (CUDA's "API synchronization behavior"): the copy is finished when this
    /// returns only because the context is synchronised after it.
    pub(super) unsafe fn memcpy_dtod(self, dst: CUdeviceptr, src: CUdeviceptr, len: usize) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees both ranges (this function's contract).
        call("cuMemcpyDtoD", || unsafe { cu::cuMemcpyDtoD_v2(dst, src, len) })?;
        self.ctx_synchronize()
    }

    /// Waits for all work of the current context.
    pub(super) fn ctx_synchronize(self) -> Result<(), CudaError> {
        // SAFETY: no arguments; acts on the current context.
        call("cuCtxSynchronize", || unsafe { cu::cuCtxSynchronize() })
    }

    /// # Safety
    /// `src..src+len` must be mapped device memory the current context can access.
    pub(super) unsafe fn memcpy_dtoh(self, dst: &mut [u8], src: CUdeviceptr) -> Result<(), CudaError> {
        // SAFETY: `dst` is a writable host slice of exactly the length passed; the caller
        // guarantees the device range.
        call("cuMemcpyDtoH", || unsafe { cu::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) })
    }

    /// # Safety
    /// `dst..dst+src.len()` must be mapped device memory the current context can write.
    pub(super) unsafe fn memcpy_htod(self, dst: CUdeviceptr, src: &[u8]) -> Result<(), CudaError> {
        // SAFETY: `src` is a readable host slice of the length passed; the caller
        // guarantees the device range.
        call("cuMemcpyHtoD", || unsafe { cu::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) })
    }

    pub(super) fn module_load_data(self, image: &CString) -> Result<CUmodule, CudaError> {
        let mut m: CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a NUL-terminated PTX text that outlives the call; `m` is writable.
        call("cuModuleLoadData", || unsafe { cu::cuModuleLoadData(&mut m, image.as_ptr().cast()) })?;
        Ok(m)
    }

    pub(super) fn module_unload(self, m: CUmodule) -> Result<(), CudaError> {
        // SAFETY: `m` was loaded by `module_load_data` and is unloaded once.
        call("cuModuleUnload", || unsafe { cu::cuModuleUnload(m) })
    }

    pub(super) fn module_function(self, m: CUmodule, name: &CString) -> Result<CUfunction, CudaError> {
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: `m` is a live module, `name` NUL-terminated, `f` writable.
        call("cuModuleGetFunction", || unsafe { cu::cuModuleGetFunction(&mut f, m, name.as_ptr()) })?;
        Ok(f)
    }

    /// # Safety
    /// `params` must point at one live value per kernel parameter, of the parameter's type,
    /// and every device pointer among them must stay mapped until the stream finishes.
    pub(super) unsafe fn launch(
        self,
        f: CUfunction,
        grid: c_uint,
        block: c_uint,
        s: CUstream,
        params: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees `params` (this function's contract); no shared
        // memory, no `extra`.
        call("cuLaunchKernel", || unsafe {
            cu::cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, s, params.as_mut_ptr(), std::ptr::null_mut())
        })
    }
}
