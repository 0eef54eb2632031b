//! The C ABI of the CUDA backend (part of `include/fabric_mm.h`): a GPU (its primary
//! context, the one the CUDA runtime uses), GPU memory (`cuMemCreate`), mappings whose device
//! address a C or CUDA program hands to its kernels, host<->device and device-to-device
//! copies, dma-buf export, and GPU memory shared through fabricd (adopt, export, import,
//! revocation). A child of [`crate::ffi`], whose conventions (codes, last error, panic
//! boundary) it shares. Without a CUDA driver every entry point that returns an `int`
//! answers `FMM_E_DEVICE` with `CUDA not present: <reason>` before looking at its
//! arguments; an argument the backend refuses (a range outside a mapping, an unknown flag)
//! is `FMM_E_ARG`.

use std::ffi::{c_char, c_int, c_void};
use std::os::fd::IntoRawFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use super::{FMM_E_ARG, arg_err, copy_out, fail, get, guard, need_out, put};
use crate::cuda::{self, AllocOptions, CudaContext, CudaError, GpuImport, GpuMemory, GpuRegion, OwnedGpuMapping};
use crate::error::Error;

mod share;
pub use share::*;

/// `fmm_gpu_alloc` flag: also allow export as a CUDA fabric handle (NVSwitch / IMEX
/// systems; refused by the driver elsewhere: retry without).
pub const FMM_GPU_ALLOC_FABRIC: u32 = 1;
/// `fmm_gpu_alloc` flag: ask for GPUDirect RDMA capability (needed by `fmm_gpu_dma_buf`).
pub const FMM_GPU_ALLOC_GPU_DIRECT_RDMA: u32 = 2;
/// Every `fmm_gpu_alloc` flag this library knows.
const ALLOC_FLAGS: u32 = FMM_GPU_ALLOC_FABRIC | FMM_GPU_ALLOC_GPU_DIRECT_RDMA;

/// A GPU: its retained primary context.
#[derive(Debug)]
pub struct FmmGpu(CudaContext);
/// A physical GPU allocation; kept until it is freed and its mappings are gone.
#[derive(Debug)]
pub struct FmmGpuMemory(Arc<GpuMemory>);
/// GPU memory (local or imported) mapped at a device address; keeps what it maps alive.
#[derive(Debug)]
pub struct FmmGpuMapping(OwnedGpuMapping);
/// GPU memory this session handed to fabricd: a region on the GPU's HBM.
#[derive(Debug)]
pub struct FmmGpuRegion(GpuRegion);
/// Another process's GPU memory, imported through fabricd into a GPU; kept until it is
/// released and its mappings are gone.
#[derive(Debug)]
pub struct FmmGpuImport(Arc<GpuImport>);

/// What a GPU offers the memory paths.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FmmGpuProperties {
    /// CUDA ordinal.
    pub ordinal: i32,
    /// Compute capability, major.
    pub compute_major: i32,
    /// Compute capability, minor.
    pub compute_minor: i32,
    /// 1 when `cuMemCreate`/`cuMemMap` (virtual memory management) is supported.
    pub virtual_memory_management: c_int,
    /// 1 when allocations export as POSIX descriptors (what fabricd passes).
    pub posix_fd_handles: c_int,
    /// 1 when allocations export as fabric handles (NVSwitch / IMEX systems).
    pub fabric_handles: c_int,
    /// 1 when GPUDirect RDMA works with these allocations (`fmm_gpu_dma_buf`).
    pub gpu_direct_rdma_with_vmm: c_int,
    /// The allocation granularity: sizes are rounded up to a multiple of it.
    pub granularity: u64,
    /// The granularity the driver recommends for performance.
    pub recommended_granularity: u64,
}

/// Reports `e` as the last error; its code, except that an argument the backend refused is
/// `FMM_E_ARG` (not the driver's `FMM_E_DEVICE`).
fn error(e: impl Into<Error>) -> c_int {
    let e = e.into();
    let code = fail(&e);
    // The caller's mistakes, not the device's.
    if matches!(e, Error::Cuda(CudaError::InvalidArgument(_) | CudaError::NoAccess { .. })) { FMM_E_ARG } else { code }
}

/// [`guard`] that first answers `FMM_E_DEVICE` ("CUDA not present: …") without a driver.
fn cuda_guard(f: impl FnOnce() -> Result<(), c_int>) -> c_int {
    guard(|| {
        cuda::available().map_err(error)?;
        f()
    })
}

fn size_arg(v: u64, what: &str) -> Result<usize, c_int> {
    usize::try_from(v).map_err(|_| arg_err(&format!("{what} {v} does not fit this machine")))
}

/// Drops a boxed handle, catching a panic (the `fmm_*_free`/`close`/`release` shape).
///
/// # Safety
/// `p` is NULL or came from [`put`] for `T`, and is not used afterwards.
unsafe fn drop_handle<T>(p: *mut T) {
    if !p.is_null() {
        // SAFETY: the caller's contract: p came from Box::into_raw in `put`.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(p) })));
    }
}

/// Writes the number of CUDA devices into `count`.
///
/// # Safety
/// `count` points to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_count(count: *mut c_int) -> c_int {
    cuda_guard(|| {
        let n = cuda::device_count().map_err(error)?;
        // SAFETY: the caller's contract (checked non-NULL by `as_mut`).
        *unsafe { count.as_mut() }.ok_or_else(|| arg_err("count is NULL"))? = n;
        Ok(())
    })
}

/// Opens GPU `ordinal` (0-based CUDA ordinal): initialises the driver once per process and
/// retains the device's primary context, the one the CUDA runtime uses, so device pointers
/// from this library work in the caller's kernels and `cudaMemcpy`s.
///
/// # Safety
/// `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_open(ordinal: c_int, out: *mut *mut FmmGpu) -> c_int {
    cuda_guard(|| put(out, FmmGpu(CudaContext::new(ordinal).map_err(error)?)))
}

/// Closes a GPU handle (memory and mappings made on it keep the context until they go).
///
/// # Safety
/// `g` is NULL or a live GPU from `fmm_gpu_open`, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_close(g: *mut FmmGpu) {
    // SAFETY: forwarded caller contract.
    unsafe { drop_handle(g) }
}

/// Writes the GPU's identity in the fabric (`uuid:GPU-…`, as fabricd names it: the device
/// `fmm_gpu_adopt` places memory on) into `buf`.
///
/// # Safety
/// `g` is a live GPU; `buf` has `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_device(g: *const FmmGpu, buf: *mut c_char, len: usize) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let g = unsafe { get(g, "gpu") }?;
        copy_out(&g.0.fabric_device().map_err(error)?, buf, len)
    })
}

/// Writes the GPU's UUID as `nvidia-smi -L` prints it (`GPU-` and 32 hex digits in
/// 8-4-4-4-12 groups, 41 bytes with the NUL) into `buf`.
///
/// # Safety
/// `g` is a live GPU; `buf` has `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_uuid(g: *const FmmGpu, buf: *mut c_char, len: usize) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let g = unsafe { get(g, "gpu") }?;
        copy_out(&g.0.uuid().map_err(error)?, buf, len)
    })
}

/// Writes the GPU's memory features into `out`.
///
/// # Safety
/// `g` is a live GPU; `out` points to writable storage for the struct.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_properties(g: *const FmmGpu, out: *mut FmmGpuProperties) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let g = unsafe { get(g, "gpu") }?;
        if out.is_null() {
            return Err(arg_err("properties pointer is NULL"));
        }
        let p = g.0.properties().map_err(error)?;
        let (min, rec) = g.0.granularity(AllocOptions::default()).map_err(error)?;
        let v = FmmGpuProperties {
            ordinal: p.ordinal,
            compute_major: p.compute_capability.0,
            compute_minor: p.compute_capability.1,
            virtual_memory_management: p.virtual_memory_management.into(),
            posix_fd_handles: p.posix_fd_handles.into(),
            fabric_handles: p.fabric_handles.into(),
            gpu_direct_rdma_with_vmm: p.gpu_direct_rdma_with_vmm.into(),
            granularity: min as u64,
            recommended_granularity: rec as u64,
        };
        // SAFETY: out is non-NULL and writable (the caller's contract).
        unsafe { out.write(v) };
        Ok(())
    })
}

/// Allocates at least `size` bytes of the GPU's memory (`cuMemCreate`), rounded up to the
/// allocation granularity (`fmm_gpu_memory_size` gives the real size), exportable as a
/// POSIX descriptor. `flags`: `FMM_GPU_ALLOC_*` or 0; an unknown bit is `FMM_E_ARG`. Not
/// mapped yet: see `fmm_gpu_map`.
///
/// # Safety
/// `g` is a live GPU; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_alloc(g: *const FmmGpu, size: u64, flags: u32, out: *mut *mut FmmGpuMemory) -> c_int {
    cuda_guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let g = unsafe { get(g, "gpu") }?;
        if flags & !ALLOC_FLAGS != 0 {
            return Err(arg_err(&format!("unknown allocation flags {:#x}", flags & !ALLOC_FLAGS)));
        }
        let opts = AllocOptions {
            fabric: flags & FMM_GPU_ALLOC_FABRIC != 0,
            gpu_direct_rdma: flags & FMM_GPU_ALLOC_GPU_DIRECT_RDMA != 0,
        };
        let m = g.0.allocate(size_arg(size, "size")?, opts).map_err(error)?;
        put(out, FmmGpuMemory(Arc::new(m)))
    })
}

/// Frees GPU memory (`cuMemRelease` once its mappings are gone too). A region adopted from
/// it stays in fabricd until `fmm_gpu_region_free`: the daemon holds its own reference.
///
/// # Safety
/// `m` is NULL or live GPU memory, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_free(m: *mut FmmGpuMemory) {
    // SAFETY: forwarded caller contract.
    unsafe { drop_handle(m) }
}

/// The bytes of GPU memory: the size asked for, rounded up to the granularity (0 for NULL).
///
/// # Safety
/// `m` is NULL or live GPU memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_memory_size(m: *const FmmGpuMemory) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { m.as_ref() }.map_or(0, |m| m.0.size() as u64)
}

/// The GPUs in `peers[0..npeers]` (`peers` may be NULL when `npeers` is 0).
///
/// # Safety
/// `peers` is NULL or points to `npeers` pointers, each NULL or a live GPU.
unsafe fn peer_list<'a>(peers: *const *const FmmGpu, npeers: usize) -> Result<Vec<&'a CudaContext>, c_int> {
    if npeers == 0 {
        return Ok(vec![]);
    }
    if peers.is_null() {
        return Err(arg_err("peers is NULL"));
    }
    // SAFETY: the caller's contract: `npeers` readable pointers at `peers`.
    let list = unsafe { std::slice::from_raw_parts(peers, npeers) };
    list.iter()
        .map(|p| {
            // SAFETY: each entry is NULL or a live GPU (the caller's contract).
            unsafe { get(*p, "peer gpu") }.map(|g| &g.0)
        })
        .collect()
}

/// Maps the whole of GPU memory into a newly reserved device range, read-write for the
/// memory's GPU and each GPU in `peers` (`npeers` of them; NULL and 0 for none). The
/// mapping keeps the memory alive: `fmm_gpu_free` may come before `fmm_gpu_unmap`.
///
/// # Safety
/// `m` is live GPU memory; `peers` is NULL or holds `npeers` live GPUs; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_map(
    m: *const FmmGpuMemory,
    peers: *const *const FmmGpu,
    npeers: usize,
    out: *mut *mut FmmGpuMapping,
) -> c_int {
    cuda_guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (m, peers) = unsafe { (get(m, "gpu memory")?, peer_list(peers, npeers)?) };
        let map = OwnedGpuMapping::new(m.0.clone(), &peers).map_err(error)?;
        put(out, FmmGpuMapping(map))
    })
}

/// Maps an import as `fmm_gpu_map` maps local memory: its GPU's kernels and copies reach
/// the exporter's memory. The mapping keeps the import alive.
///
/// # Safety
/// `i` is a live GPU import; `peers` is NULL or holds `npeers` live GPUs; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_map_import(
    i: *const FmmGpuImport,
    peers: *const *const FmmGpu,
    npeers: usize,
    out: *mut *mut FmmGpuMapping,
) -> c_int {
    cuda_guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (i, peers) = unsafe { (get(i, "gpu import")?, peer_list(peers, npeers)?) };
        let map = OwnedGpuMapping::new(i.0.clone(), &peers).map_err(error)?;
        put(out, FmmGpuMapping(map))
    })
}

/// The device address (`CUdeviceptr`) of a mapping's first byte, for the caller's kernels
/// and CUDA calls in the GPU's primary context (0 for NULL).
///
/// # Safety
/// `m` is NULL or a live GPU mapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_mapping_ptr(m: *const FmmGpuMapping) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { m.as_ref() }.map_or(0, |m| m.0.device_ptr())
}

/// The bytes of a GPU mapping (0 for NULL).
///
/// # Safety
/// `m` is NULL or a live GPU mapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_mapping_len(m: *const FmmGpuMapping) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { m.as_ref() }.map_or(0, |m| m.0.len() as u64)
}

/// Copies `len` bytes of the mapping at `offset` into host memory at `dst`, and waits.
///
/// # Safety
/// `m` is a live GPU mapping; `dst` has `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_read(m: *const FmmGpuMapping, offset: u64, dst: *mut c_void, len: usize) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let m = unsafe { get(m, "gpu mapping") }?;
        if dst.is_null() {
            return Err(arg_err("dst is NULL"));
        }
        // SAFETY: dst is non-NULL with `len` writable bytes (the caller's contract).
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) };
        m.0.read(size_arg(offset, "offset")?, dst).map_err(error)
    })
}

/// Copies `len` bytes of host memory at `src` into the mapping at `offset`, and waits until
/// they are there.
///
/// # Safety
/// `m` is a live GPU mapping; `src` has `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_write(m: *const FmmGpuMapping, offset: u64, src: *const c_void, len: usize) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let m = unsafe { get(m, "gpu mapping") }?;
        if src.is_null() {
            return Err(arg_err("src is NULL"));
        }
        // SAFETY: src is non-NULL with `len` readable bytes (the caller's contract).
        let src = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), len) };
        m.0.write(size_arg(offset, "offset")?, src).map_err(error)
    })
}

/// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset` on the GPU
/// (`cuMemcpyDtoD` in `dst`'s context), and waits until the copy is done. `dst`'s GPU must
/// reach `src`: the same GPU, or a peer given when `src` was mapped.
///
/// # Safety
/// `dst` and `src` are live GPU mappings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_copy(
    dst: *const FmmGpuMapping,
    dst_offset: u64,
    src: *const FmmGpuMapping,
    src_offset: u64,
    len: u64,
) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let (dst, src) = unsafe { (get(dst, "dst mapping")?, get(src, "src mapping")?) };
        let (dst_offset, src_offset) = (size_arg(dst_offset, "dst offset")?, size_arg(src_offset, "src offset")?);
        dst.0.copy_range(dst_offset, &src.0, src_offset, size_arg(len, "len")?).map_err(error)
    })
}

/// Exports a mapping's range as a dma-buf descriptor for a NIC or another device to
/// register; writes it into `fd` (the caller closes it). Needs GPUDirect RDMA support and
/// memory allocated with `FMM_GPU_ALLOC_GPU_DIRECT_RDMA`; `FMM_E_DEVICE` otherwise.
///
/// # Safety
/// `m` is a live GPU mapping; `fd` points to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_dma_buf(m: *const FmmGpuMapping, fd: *mut c_int) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let m = unsafe { get(m, "gpu mapping") }?;
        if fd.is_null() {
            return Err(arg_err("fd is NULL"));
        }
        let owned = m.0.dma_buf_fd().map_err(error)?;
        // SAFETY: fd is non-NULL and writable (the caller's contract).
        unsafe { fd.write(owned.into_raw_fd()) };
        Ok(())
    })
}

/// Unmaps (`cuMemUnmap`, `cuMemAddressFree`), then lets go of the memory or import it kept.
///
/// # Safety
/// `m` is NULL or a live GPU mapping, not used afterwards (nor its device address).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_unmap(m: *mut FmmGpuMapping) {
    // SAFETY: forwarded caller contract.
    unsafe { drop_handle(m) }
}
