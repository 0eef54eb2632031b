//! The C ABI of DMA registration: host buffers, `fmm_register_*` for regions, imports,
//! host buffers and bare pointers, the registration's IOVA/length/id, and the cache's
//! statistics. Same rules as the rest of the C ABI (opaque handles, `FMM_E_*` codes, no
//! panic across the boundary).

use std::ffi::{c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use super::{FmmImport, FmmRegion, FmmSession, arg_err, fail, get, guard, need_out, opt_str, put};
use crate::hostmem::HostBuffer;
use crate::register::{Access, Registration};

/// The device only reads registered memory.
pub const FMM_ACCESS_READ_ONLY: c_int = 0;
/// The device reads and writes registered memory.
pub const FMM_ACCESS_READ_WRITE: c_int = 1;

/// A page-aligned host buffer (memfd-backed) for registration.
#[derive(Debug)]
pub struct FmmHostBuffer(HostBuffer);
/// Memory registered for DMA by a device.
#[derive(Debug)]
pub struct FmmRegistration(Registration);

/// The registration cache's counters and the session's live registrations.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FmmRegistrationStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that found nothing.
    pub misses: u64,
    /// Entries dropped to stay within the cache's bounds.
    pub evictions: u64,
    /// Entries dropped because their memory was freed, released or revoked.
    pub invalidations: u64,
    /// Entries cached now.
    pub entries: u64,
    /// Bytes of the cached entries.
    pub cached_bytes: u64,
    /// Registrations of the session alive in the daemon.
    pub live: u64,
    /// Bytes they cover.
    pub registered_bytes: u64,
    /// Of the hits, those answered by a cached registration of a larger range.
    pub range_hits: u64,
}

fn access(a: c_int) -> Result<Access, c_int> {
    match a {
        FMM_ACCESS_READ_ONLY => Ok(Access::ReadOnly),
        FMM_ACCESS_READ_WRITE => Ok(Access::ReadWrite),
        other => Err(arg_err(&format!("unknown access {other}"))),
    }
}

/// # Safety
/// `device` is NULL or a NUL-terminated string.
unsafe fn device<'a>(device: *const c_char) -> Result<&'a str, c_int> {
    // SAFETY: forwarded caller contract.
    unsafe { opt_str(device, "device") }?.ok_or_else(|| arg_err("device is NULL"))
}

/// Allocates a host buffer of at least `len` bytes (rounded up to whole pages), kept out
/// of forked children.
///
/// # Safety
/// `s` is a live session; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_host_alloc(s: *const FmmSession, len: u64, out: *mut *mut FmmHostBuffer) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        let b = s.0.alloc_host(len).map_err(|e| fail(&e))?;
        put(out, FmmHostBuffer(b))
    })
}

/// The first byte of a host buffer (NULL for NULL).
///
/// # Safety
/// `b` is NULL or a live host buffer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_host_ptr(b: *const FmmHostBuffer) -> *mut c_void {
    // SAFETY: the caller's contract.
    unsafe { b.as_ref() }.map_or(std::ptr::null_mut(), |b| b.0.as_ptr().cast())
}

/// The bytes of a host buffer (0 for NULL).
///
/// # Safety
/// `b` is NULL or a live host buffer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_host_len(b: *const FmmHostBuffer) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { b.as_ref() }.map_or(0, |b| b.0.len())
}

/// Frees a host buffer (unmapped once its registrations are gone too).
///
/// # Safety
/// `b` is NULL or a live host buffer, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_host_free(b: *mut FmmHostBuffer) {
    if !b.is_null() {
        // SAFETY: the caller's contract: b came from Box::into_raw in fmm_host_alloc.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(b) })));
    }
}

/// Registers a whole host buffer for DMA by `device` with `access` (`FMM_ACCESS_*`).
///
/// # Safety
/// `s` and `b` are live; `device` a NUL-terminated string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_register_host(
    s: *const FmmSession,
    b: *const FmmHostBuffer,
    device: *const c_char,
    access_mode: c_int,
    out: *mut *mut FmmRegistration,
) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, b, device) = unsafe { (get(s, "session")?, get(b, "host buffer")?, self::device(device)?) };
        let r = s.0.register(&b.0, device, access(access_mode)?).map_err(|e| fail(&e))?;
        put(out, FmmRegistration(r))
    })
}

/// Registers a whole region for DMA by `device`.
///
/// # Safety
/// `s` and `r` are live; `device` a NUL-terminated string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_register_region(
    s: *const FmmSession,
    r: *const FmmRegion,
    device: *const c_char,
    access_mode: c_int,
    out: *mut *mut FmmRegistration,
) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, r, device) = unsafe { (get(s, "session")?, get(r, "region")?, self::device(device)?) };
        let reg = s.0.register(&r.0, device, access(access_mode)?).map_err(|e| fail(&e))?;
        put(out, FmmRegistration(reg))
    })
}

/// Registers a whole import for DMA by `device`.
///
/// # Safety
/// `s` and `i` are live; `device` a NUL-terminated string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_register_import(
    s: *const FmmSession,
    i: *const FmmImport,
    device: *const c_char,
    access_mode: c_int,
    out: *mut *mut FmmRegistration,
) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, i, device) = unsafe { (get(s, "session")?, get(i, "import")?, self::device(device)?) };
        let reg = s.0.register(&i.0, device, access(access_mode)?).map_err(|e| fail(&e))?;
        put(out, FmmRegistration(reg))
    })
}

/// Registers `len` bytes of this process's memory at `ptr`: the library locks the pages
/// (`FMM_E_MEMLOCK` names RLIMIT_MEMLOCK when that refuses) and keeps them out of forked
/// children until the registration is dropped. Never cached.
///
/// # Safety
/// `s` is live; `device` a NUL-terminated string; `out` writable; `ptr..ptr+len` stays
/// mapped until `fmm_unregister`, and is not read or written while a device writes it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_register_ptr(
    s: *const FmmSession,
    ptr: *const c_void,
    len: usize,
    device: *const c_char,
    access_mode: c_int,
    out: *mut *mut FmmRegistration,
) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, device) = unsafe { (get(s, "session")?, self::device(device)?) };
        let a = access(access_mode)?;
        // SAFETY: forwarded caller contract (the memory stays mapped while registered).
        let reg = unsafe { s.0.register_ptr(ptr.cast(), len, device, a) }.map_err(|e| fail(&e))?;
        put(out, FmmRegistration(reg))
    })
}

/// The IOVA of a registration's first byte in its device's DMA domain (0 for NULL).
///
/// # Safety
/// `r` is NULL or a live registration.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_registration_iova(r: *const FmmRegistration) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { r.as_ref() }.map_or(0, |r| r.0.iova())
}

/// The bytes of a registration (0 for NULL).
///
/// # Safety
/// `r` is NULL or a live registration.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_registration_len(r: *const FmmRegistration) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { r.as_ref() }.map_or(0, |r| r.0.len())
}

/// The daemon's id of a registration, as copies name it (0 for NULL).
///
/// # Safety
/// `r` is NULL or a live registration.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_registration_id(r: *const FmmRegistration) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { r.as_ref() }.map_or(0, |r| r.0.id())
}

/// Where a registration's first byte lies in the daemon registration `fmm_registration_id`
/// names: 0, unless the cache answered it from a registration of a larger range (0 for
/// NULL). A `FMM_COPY_REGISTRATION` endpoint's `offset` counts from there:
/// `{FMM_COPY_REGISTRATION, fmm_registration_id(r), fmm_registration_offset(r) + off}`.
///
/// # Safety
/// `r` is NULL or a live registration.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_registration_offset(r: *const FmmRegistration) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { r.as_ref() }.map_or(0, |r| r.0.id_offset())
}

/// Drops a registration: unregistered unless the session's cache keeps it for reuse;
/// pages `fmm_register_ptr` locked are unlocked.
///
/// # Safety
/// `r` is NULL or a live registration, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_unregister(r: *mut FmmRegistration) {
    if !r.is_null() {
        // SAFETY: the caller's contract: r came from Box::into_raw in fmm_register_*.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(r) })));
    }
}

/// Writes the session's registration statistics into `out`.
///
/// # Safety
/// `s` is live; `out` points to writable storage for the struct.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_registration_stats(s: *const FmmSession, out: *mut FmmRegistrationStats) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        if out.is_null() {
            return Err(arg_err("stats pointer is NULL"));
        }
        let st = s.0.registration_stats();
        let v = FmmRegistrationStats {
            hits: st.cache.hits,
            misses: st.cache.misses,
            evictions: st.cache.evictions,
            invalidations: st.cache.invalidations,
            entries: st.cache.entries,
            cached_bytes: st.cache.bytes,
            live: st.live,
            registered_bytes: st.registered_bytes,
            range_hits: st.cache.range_hits,
        };
        // SAFETY: out is non-NULL and writable (the caller's contract).
        unsafe { out.write(v) };
        Ok(())
    })
}
