//! The fabricd half of the CUDA C ABI: GPU memory adopted into a session as a region
//! (`fmm_gpu_adopt`, by POSIX descriptor or fabric handle), exported, imported by handle into
//! another process's GPU (`fmm_gpu_import`, mapped with `fmm_gpu_map_import`), checked for
//! revocation and released. Conventions and helpers are the parent module's.

use std::ffi::{c_char, c_int};
use std::sync::Arc;

use super::super::{
    FMM_E_NO_GFA, FmmSession, arg_err, export_out, get, need_buf, need_out, opt_str, put, req_str, set_error,
};
use super::{FmmGpu, FmmGpuImport, FmmGpuMemory, FmmGpuRegion, cuda_guard, drop_handle, error};
use crate::memory::Handle;
use crate::session::Policy;

/// `fmm_gpu_adopt` flag: hand the allocation over as a fabric handle (protocol 1.4; the
/// memory must have been allocated with `FMM_GPU_ALLOC_FABRIC`) instead of a descriptor.
pub const FMM_GPU_ADOPT_FABRIC: u32 = 1;
/// Every `fmm_gpu_adopt` flag this library knows.
const ADOPT_FLAGS: u32 = FMM_GPU_ADOPT_FABRIC;

/// Hands local GPU memory to fabricd as a region of session `s` on its GPU's HBM (the
/// allocation's POSIX export travels with `Adopt`, or with `FMM_GPU_ADOPT_FABRIC` its
/// fabric handle): it gets a GFA, counts against the owner's limits, and is exported,
/// revoked and reclaimed like any region. `device` is the GPU's fabric identity; NULL asks
/// CUDA (`uuid:GPU-…`, as `fmm_gpu_device`). `flags`: 0 or `FMM_GPU_ADOPT_FABRIC`; an
/// unknown bit is `FMM_E_ARG`. Imported memory is refused (`FMM_E_ARG`): it is its
/// exporter's to hand over. `fmm_gpu_import` takes either kind.
///
/// # Safety
/// `s` is a live session and `m` live GPU memory; `device` is NULL or a NUL-terminated
/// string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_adopt(
    s: *const FmmSession,
    m: *const FmmGpuMemory,
    device: *const c_char,
    flags: u32,
    out: *mut *mut FmmGpuRegion,
) -> c_int {
    cuda_guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, m, device) = unsafe { (get(s, "session")?, get(m, "gpu memory")?, opt_str(device, "device")?) };
        if flags & !ADOPT_FLAGS != 0 {
            return Err(arg_err(&format!("unknown adopt flags {:#x}", flags & !ADOPT_FLAGS)));
        }
        let r = if flags & FMM_GPU_ADOPT_FABRIC != 0 {
            s.0.adopt_gpu_fabric(&m.0, device)
        } else {
            s.0.adopt_gpu(&m.0, device)
        };
        put(out, FmmGpuRegion(r.map_err(error)?))
    })
}

/// Exports an adopted region; writes the handle's text (at most 96 bytes with the NUL)
/// into `buf`, as `fmm_export` does. `uid` is the one other user allowed to import
/// (`(uint32_t)-1`: the owner's uid only). `read_only` must be 0: an importer's driver maps
/// GPU memory read-write whatever the policy says, so fabricd refuses read-only exports of
/// it (`FMM_E_BAD_REQUEST`).
///
/// # Safety
/// `r` is a live GPU region; `buf` has `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_export(
    r: *const FmmGpuRegion,
    uid: u32,
    read_only: c_int,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let r = unsafe { get(r, "gpu region") }?;
        let policy = Policy {
            uids: if uid == u32::MAX { vec![] } else { vec![uid] },
            read_only: read_only != 0,
            ..Policy::default()
        };
        need_buf(buf)?;
        let h = r.0.export(&policy).map_err(error)?;
        export_out(r.0.session(), &h, buf, len)
    })
}

/// The bytes of an adopted region (0 for NULL).
///
/// # Safety
/// `r` is NULL or a live GPU region.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_region_size(r: *const FmmGpuRegion) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { r.as_ref() }.map_or(0, |r| r.0.size())
}

/// Writes an adopted region's global fabric address into `gfa`; `FMM_E_NO_GFA` when the
/// GPU's memory is not in the address map.
///
/// # Safety
/// `r` is a live GPU region; `gfa` points to a writable `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_region_gfa(r: *const FmmGpuRegion, gfa: *mut u64) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        let r = unsafe { get(r, "gpu region") }?;
        // SAFETY: forwarded caller contract (checked non-NULL by `as_mut`).
        let out = unsafe { gfa.as_mut() }.ok_or_else(|| arg_err("gfa is NULL"))?;
        let Some(g) = r.0.gfa() else {
            set_error("the region's memory is not in the address map");
            return Err(FMM_E_NO_GFA);
        };
        *out = g;
        Ok(())
    })
}

/// Frees an adopted region in fabricd: its exports are revoked and its importers told
/// (`fmm_gpu_import_check` answers `FMM_E_REVOKED`). The GPU memory stays the caller's.
///
/// # Safety
/// `r` is NULL or a live GPU region, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_region_free(r: *mut FmmGpuRegion) {
    // SAFETY: forwarded caller contract.
    unsafe { drop_handle(r) }
}

/// Imports the GPU memory a handle's text names (exported with `fmm_gpu_export`) into GPU
/// `g` (`cuMemImportFromShareableHandle` on the descriptor fabricd passes). Map it with
/// `fmm_gpu_map_import`; always read-write.
///
/// # Safety
/// `s` is a live session and `g` a live GPU; `handle` is a NUL-terminated string; `out`
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_import(
    s: *const FmmSession,
    handle: *const c_char,
    g: *const FmmGpu,
    out: *mut *mut FmmGpuImport,
) -> c_int {
    cuda_guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, text, g) = unsafe { (get(s, "session")?, req_str(handle, "handle")?, get(g, "gpu")?) };
        let h: Handle = text.parse().map_err(error)?;
        let i = s.0.import_gpu(&h, &g.0).map_err(error)?;
        put(out, FmmGpuImport(Arc::new(i)))
    })
}

/// 0 while the import is live, `FMM_E_REVOKED` (-13) once fabricd told this session it was
/// revoked (owner exited, export revoked, region freed). The driver's reference keeps what
/// this process mapped readable after that: a revoked import must stop using it.
///
/// # Safety
/// `i` is a live GPU import.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_import_check(i: *const FmmGpuImport) -> c_int {
    cuda_guard(|| {
        // SAFETY: forwarded caller contract.
        unsafe { get(i, "gpu import") }?.0.check().map_err(error)
    })
}

/// The bytes of a GPU import (0 for NULL).
///
/// # Safety
/// `i` is NULL or a live GPU import.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_import_size(i: *const FmmGpuImport) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { i.as_ref() }.map_or(0, |i| i.0.memory().size() as u64)
}

/// Releases a GPU import (the allocation, then the import in fabricd) once its mappings
/// are gone too.
///
/// # Safety
/// `i` is NULL or a live GPU import, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_gpu_import_release(i: *mut FmmGpuImport) {
    // SAFETY: forwarded caller contract.
    unsafe { drop_handle(i) }
}
