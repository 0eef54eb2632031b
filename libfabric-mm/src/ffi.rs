//! The C ABI (`include/fabric_mm.h`, generated from this file by cbindgen): opaque
//! handles, `int` results (0 or a negative `FMM_E_*` code), the last error's text per
//! thread, and no panic across the boundary (each entry point catches one and reports
//! `FMM_E_PANIC`).

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use crate::error::Error;
use crate::memory::{Handle, Import, Mapping, Memory, Region};
use crate::session::{Policy, Session, SessionConfig, Target};
use crate::window::WindowConfig;
use fabric_proto::wire::MemoryClass;

mod gpu;
pub use gpu::*;
mod registration;
pub use registration::*;
mod resume;
pub use resume::*;
mod location;
pub use location::*;
mod revocation;
pub use revocation::*;

/// Success.
pub const FMM_OK: c_int = 0;
/// No daemon answers at the socket.
pub const FMM_E_CONNECT: c_int = -1;
/// The connection to the daemon failed (protocol error or unexpected answer).
pub const FMM_E_PROTOCOL: c_int = -2;
/// The connection to the daemon is closed.
pub const FMM_E_DISCONNECTED: c_int = -3;
/// The daemon refused: permission or policy.
pub const FMM_E_PERMISSION: c_int = -10;
/// The daemon refused: no such device, region, export or import.
pub const FMM_E_NOT_FOUND: c_int = -11;
/// The daemon refused: the handle names no live export.
pub const FMM_E_INVALID_HANDLE: c_int = -12;
/// The memory was revoked (owner exited, export revoked, region freed, device lost).
pub const FMM_E_REVOKED: c_int = -13;
/// The daemon refused: a per-uid limit (bytes, pinned bytes, objects).
pub const FMM_E_LIMIT: c_int = -14;
/// The daemon refused: the memory resource is full.
pub const FMM_E_NO_SPACE: c_int = -15;
/// The daemon does not serve the operation: it does not implement it, or it is too old to
/// know it (its protocol predates the operation).
pub const FMM_E_NOT_IMPLEMENTED: c_int = -16;
/// The daemon refused a malformed request.
pub const FMM_E_BAD_REQUEST: c_int = -17;
/// The daemon refused for another reason (see fmm_last_error()).
pub const FMM_E_REFUSED: c_int = -19;
/// The unified window could not be reserved at that size.
pub const FMM_E_WINDOW: c_int = -20;
/// The memory lies outside the window.
pub const FMM_E_OUTSIDE_WINDOW: c_int = -21;
/// The memory has no GFA.
pub const FMM_E_NO_GFA: c_int = -22;
/// The GFA range is already mapped.
pub const FMM_E_ALREADY_MAPPED: c_int = -23;
/// Pinning exceeds RLIMIT_MEMLOCK.
pub const FMM_E_MEMLOCK: c_int = -24;
/// The memory is granted copy-only: no descriptor, no mapping; the copy API reaches it.
pub const FMM_E_COPY_ONLY: c_int = -25;
/// An argument is invalid: NULL pointer, non-UTF-8 string, out-of-range value.
pub const FMM_E_ARG: c_int = -30;
/// A system call failed.
pub const FMM_E_OS: c_int = -31;
/// The output buffer is too small.
pub const FMM_E_BUFFER: c_int = -32;
/// The device's own driver (CUDA) refused or is not present.
pub const FMM_E_DEVICE: c_int = -33;
/// A panic inside the library was caught at the boundary (a bug; please report it).
pub const FMM_E_PANIC: c_int = -90;

/// HBM on a GPU or accelerator.
pub const FMM_MEM_HBM: c_int = 0;
/// Host DRAM.
pub const FMM_MEM_DRAM: c_int = 1;
/// CXL volatile capacity.
pub const FMM_MEM_CXL_VOLATILE: c_int = 2;
/// CXL persistent capacity.
pub const FMM_MEM_CXL_PERSISTENT: c_int = 3;
/// CXL dynamic capacity.
pub const FMM_MEM_CXL_DYNAMIC: c_int = 4;
/// Host memory exported to the fabric.
pub const FMM_MEM_HOST_EXPORTED: c_int = 5;

/// A session with fabricd.
#[derive(Debug)]
pub struct FmmSession(pub(crate) Session);
/// A region this session allocated.
#[derive(Debug)]
pub struct FmmRegion(pub(crate) Region);
/// An imported region.
#[derive(Debug)]
pub struct FmmImport(Import);
/// Memory placed at its GFA in the window.
#[derive(Debug)]
pub struct FmmMapping(Mapping);

pub mod copy;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last error. A call made while the thread exits (from a
/// thread-local destructor, after `LAST_ERROR`'s own) records nothing: `with` would panic
/// there, outside any `catch_unwind`, and abort the process.
pub(crate) fn set_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// The error's text with its sources, as `fmm_last_error()` and callbacks give it (and the
/// Python binding's exceptions).
pub fn error_text(e: &Error) -> String {
    fabric_topology::error_chain(e)
}

pub(crate) fn fail(e: &Error) -> c_int {
    set_error(&error_text(e));
    e.code()
}

/// Runs `f`, turning a panic into `FMM_E_PANIC` and an error into its code.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => FMM_OK,
        Ok(Err(code)) => code,
        Err(_) => {
            set_error("internal error: a panic was caught at the C boundary");
            FMM_E_PANIC
        }
    }
}

pub(crate) fn arg_err(what: &str) -> c_int {
    set_error(what);
    FMM_E_ARG
}

/// # Safety
/// `s` is NULL or a NUL-terminated string.
pub(crate) unsafe fn opt_str<'a>(s: *const c_char, what: &str) -> Result<Option<&'a str>, c_int> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let c = unsafe { CStr::from_ptr(s) };
    c.to_str().map(Some).map_err(|_| arg_err(&format!("{what} is not UTF-8")))
}

/// # Safety
/// `s` is NULL or a NUL-terminated string.
pub(crate) unsafe fn req_str<'a>(s: *const c_char, what: &str) -> Result<&'a str, c_int> {
    // SAFETY: forwarded caller contract.
    unsafe { opt_str(s, what) }?.ok_or_else(|| arg_err(&format!("{what} is NULL")))
}

pub(crate) fn class(c: c_int) -> Result<MemoryClass, c_int> {
    Ok(match c {
        FMM_MEM_HBM => MemoryClass::Hbm,
        FMM_MEM_DRAM => MemoryClass::Dram,
        FMM_MEM_CXL_VOLATILE => MemoryClass::CxlVolatile,
        FMM_MEM_CXL_PERSISTENT => MemoryClass::CxlPersistent,
        FMM_MEM_CXL_DYNAMIC => MemoryClass::CxlDynamic,
        FMM_MEM_HOST_EXPORTED => MemoryClass::HostExported,
        other => return Err(arg_err(&format!("unknown memory class {other}"))),
    })
}

/// The `FMM_MEM_*` code of a class.
pub(crate) fn class_code(c: MemoryClass) -> c_int {
    match c {
        MemoryClass::Hbm => FMM_MEM_HBM,
        MemoryClass::Dram => FMM_MEM_DRAM,
        MemoryClass::CxlVolatile => FMM_MEM_CXL_VOLATILE,
        MemoryClass::CxlPersistent => FMM_MEM_CXL_PERSISTENT,
        MemoryClass::CxlDynamic => FMM_MEM_CXL_DYNAMIC,
        MemoryClass::HostExported => FMM_MEM_HOST_EXPORTED,
    }
}

pub(crate) fn copy_out(text: &str, buf: *mut c_char, len: usize) -> Result<(), c_int> {
    if buf.is_null() {
        return Err(arg_err("output buffer is NULL"));
    }
    if text.len() + 1 > len {
        set_error(&format!("output buffer of {len} bytes is too small: {} needed", text.len() + 1));
        return Err(FMM_E_BUFFER);
    }
    // SAFETY: buf has room for len >= text.len() + 1 bytes (checked above).
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
        *buf.add(text.len()) = 0;
    }
    Ok(())
}

/// The user's pointer, carried to the thread that runs the callback; what it points to is
/// the C caller's to keep valid and thread-safe (the documented contract).
pub(crate) struct UserData(pub(crate) *mut c_void);

impl UserData {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub(crate) fn ptr(&self) -> *mut c_void {
        self.0
    }
}
// SAFETY: the library only passes the pointer back to the caller's callback, never reads
// through it; the callback entry points document that it is used from another thread.
unsafe impl Send for UserData {}
// SAFETY: as for Send: the pointer is only copied, never dereferenced here.
unsafe impl Sync for UserData {}

/// Refuses a NULL result pointer, before the call acts: a copy started, a region
/// allocated or an import made, then dropped for want of a place to put it, would have
/// acted while the caller was told nothing happened.
pub(crate) fn need_out<T>(out: *mut *mut T) -> Result<(), c_int> {
    if out.is_null() {
        return Err(arg_err("result pointer is NULL"));
    }
    Ok(())
}

/// Refuses a NULL output buffer, before the call acts (see [`need_out`]).
pub(crate) fn need_buf(buf: *mut c_char) -> Result<(), c_int> {
    if buf.is_null() {
        return Err(arg_err("output buffer is NULL"));
    }
    Ok(())
}

/// Writes a new export's handle text into `buf`; where it does not fit, revokes the
/// export (the caller, told `FMM_E_BUFFER`, has no handle to revoke it with) and says so.
pub(crate) fn export_out(s: &Session, h: &crate::memory::Handle, buf: *mut c_char, len: usize) -> Result<(), c_int> {
    copy_out(&h.to_string(), buf, len).inspect_err(|_| {
        if let Err(e) = s.revoke(h) {
            tracing::warn!(error = %e, "revoking an export whose handle did not fit the caller's buffer");
        }
    })
}

/// Writes `value` through `out`.
pub(crate) fn put<T>(out: *mut *mut T, value: T) -> Result<(), c_int> {
    if out.is_null() {
        return Err(arg_err("result pointer is NULL"));
    }
    // SAFETY: out is non-NULL and points to writable storage for a pointer.
    unsafe { *out = Box::into_raw(Box::new(value)) };
    Ok(())
}

/// # Safety
/// `p` is NULL or a live pointer this library returned for `T`.
pub(crate) unsafe fn get<'a, T>(p: *const T, what: &str) -> Result<&'a T, c_int> {
    // SAFETY: the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| arg_err(&format!("{what} is NULL")))
}

/// The text of the last error on this thread (valid until the next failing call on it).
/// Never NULL: an empty string when there was none, and when the thread is exiting (a
/// thread-local destructor), where the text is no longer kept.
#[unsafe(no_mangle)]
pub extern "C" fn fmm_last_error() -> *const c_char {
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"".as_ptr())
}

/// Opens a session. `socket` NULL: `$FABRIC_SOCKET` or the default path. `window_len` 0:
/// the window `FABRIC_MM_WINDOW_GFA`/`FABRIC_MM_WINDOW_SIZE` name, else on a domain node
/// one aperture per node span in use, else the default window; otherwise a window of
/// that many bytes at GFA `window_gfa`.
///
/// # Safety
/// `socket` is NULL or a NUL-terminated string; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_session_open(
    socket: *const c_char,
    window_gfa: u64,
    window_len: u64,
    out: *mut *mut FmmSession,
) -> c_int {
    // SAFETY: forwarded caller contract.
    guard(|| unsafe { open(socket, window_gfa, window_len, None, out) })
}

/// `fmm_session_open`, taking back the session `resume` names when given (ffi/resume.rs).
///
/// # Safety
/// `socket` is NULL or a NUL-terminated string; `out` is writable.
pub(crate) unsafe fn open(
    socket: *const c_char,
    window_gfa: u64,
    window_len: u64,
    resume: Option<crate::resume::Token>,
    out: *mut *mut FmmSession,
) -> Result<(), c_int> {
    need_out(out)?;
    // SAFETY: forwarded caller contract.
    let socket = unsafe { opt_str(socket, "socket") }?.map(PathBuf::from);
    let window = (window_len != 0).then_some(WindowConfig { gfa: window_gfa, len: window_len });
    let s = Session::open_with(SessionConfig {
        socket,
        window,
        client_name: Some("libfabric-mm (C)".into()),
        resume,
        keep_revoked_mappings: false,
    })
    .map_err(|e| fail(&e))?;
    put(out, FmmSession(s))
}

/// Closes a session handle (its objects keep the connection until they are dropped).
///
/// # Safety
/// `s` is NULL or a live session from `fmm_session_open`, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_session_close(s: *mut FmmSession) {
    if !s.is_null() {
        // SAFETY: the caller's contract: s came from Box::into_raw in fmm_session_open.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(s) })));
    }
}

/// Writes the identity of the first device with memory of `memory_class` into `buf`.
///
/// # Safety
/// `s` is a live session; `buf` has `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_first_device(
    s: *const FmmSession,
    memory_class: c_int,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        let c = class(memory_class)?;
        let d = s.0.first_device_with(c).map_err(|e| fail(&e))?;
        let Some(d) = d else {
            set_error("no device has memory of that class");
            return Err(FMM_E_NOT_FOUND);
        };
        copy_out(&d.id, buf, len)
    })
}

/// Allocates `size` bytes of `memory_class` on `device`.
///
/// # Safety
/// `s` is a live session; `device` a NUL-terminated string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_alloc(
    s: *const FmmSession,
    device: *const c_char,
    memory_class: c_int,
    size: u64,
    out: *mut *mut FmmRegion,
) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        // SAFETY: forwarded caller contract.
        let device = unsafe { opt_str(device, "device") }?.ok_or_else(|| arg_err("device is NULL"))?;
        let t = Target::Device { device: device.to_owned(), memory: class(memory_class)? };
        let r = s.0.alloc(&t, size).map_err(|e| fail(&e))?;
        put(out, FmmRegion(r))
    })
}

/// Allocates `size` bytes striped over the interleave set named `set` (as `fabricctl map`
/// names it, e.g. `cxl-region:hpa-0x1000000000`); the region has a GFA in the set's range.
///
/// # Safety
/// `s` is a live session; `set` a NUL-terminated string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_alloc_set(
    s: *const FmmSession,
    set: *const c_char,
    size: u64,
    out: *mut *mut FmmRegion,
) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, set) = unsafe { (get(s, "session")?, req_str(set, "set")?) };
        let r = s.0.alloc(&Target::Set(set.to_owned()), size).map_err(|e| fail(&e))?;
        put(out, FmmRegion(r))
    })
}

/// Frees a region (when its mappings are gone too).
///
/// # Safety
/// `r` is NULL or a live region, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_region_free(r: *mut FmmRegion) {
    if !r.is_null() {
        // SAFETY: the caller's contract: r came from Box::into_raw in fmm_alloc.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(r) })));
    }
}

/// Exports a region; writes the handle's text (at most 96 bytes with the NUL) into `buf`.
/// `uid` is the one other user allowed to import (`(uint32_t)-1`: the owner's uid only);
/// `read_only` non-zero limits importers to loads. A `buf` of fewer bytes than the text
/// needs is `FMM_E_BUFFER`, and the export is revoked (no export is left without a handle).
///
/// # Safety
/// `s` and `r` are live; `buf` has `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_export(
    s: *const FmmSession,
    r: *const FmmRegion,
    uid: u32,
    read_only: c_int,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (s, r) = unsafe { (get(s, "session")?, get(r, "region")?) };
        let policy = Policy {
            uids: if uid == u32::MAX { vec![] } else { vec![uid] },
            read_only: read_only != 0,
            ..Policy::default()
        };
        need_buf(buf)?;
        let h = s.0.export(&r.0, &policy).map_err(|e| fail(&e))?;
        export_out(&s.0, &h, buf, len)
    })
}

/// Imports the region a handle's text names; `writable` non-zero asks for stores.
///
/// # Safety
/// `s` is live; `handle` is a NUL-terminated string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_import(
    s: *const FmmSession,
    handle: *const c_char,
    writable: c_int,
    out: *mut *mut FmmImport,
) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        // SAFETY: forwarded caller contract.
        let text = unsafe { opt_str(handle, "handle") }?.ok_or_else(|| arg_err("handle is NULL"))?;
        let h: Handle = text.parse().map_err(|e| fail(&e))?;
        let i = s.0.import(&h, writable != 0).map_err(|e| fail(&e))?;
        put(out, FmmImport(i))
    })
}

/// 0 while the import is live, `FMM_E_REVOKED` (-13) once revoked.
///
/// # Safety
/// `i` is a live import.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_import_check(i: *const FmmImport) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let i = unsafe { get(i, "import") }?;
        i.0.check().map_err(|e| fail(&e))
    })
}

/// Writes an import's global fabric address into `gfa` — where `fmm_map_import` places
/// it, and what a copy to or from a copy-only import names (`FMM_COPY_GFA`);
/// `FMM_E_NO_GFA` when the region is not in the address map.
///
/// # Safety
/// `i` is a live import; `gfa` points to a writable `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_import_gfa(i: *const FmmImport, gfa: *mut u64) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let i = unsafe { get(i, "import") }?;
        // SAFETY: forwarded caller contract (checked non-NULL by `as_mut`).
        let out = unsafe { gfa.as_mut() }.ok_or_else(|| arg_err("gfa is NULL"))?;
        let Some(g) = Memory::gfa(&i.0) else {
            set_error("the imported region is not in the address map");
            return Err(FMM_E_NO_GFA);
        };
        *out = g;
        Ok(())
    })
}

/// 1 when the daemon granted the import copy-only (another node's memory with no memory
/// fabric between the nodes: `fmm_map_import` fails with `FMM_E_COPY_ONLY`; copy to and
/// from its GFA, `fmm_import_gfa`), 0 when it can be mapped, `FMM_E_ARG` for NULL.
///
/// # Safety
/// `i` is NULL or a live import.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_import_copy_only(i: *const FmmImport) -> c_int {
    let mut copy_only = false;
    let rc = guard(|| {
        // SAFETY: forwarded caller contract.
        let i = unsafe { get(i, "import") }?;
        copy_only = Memory::copy_only(&i.0);
        Ok(())
    });
    if rc == 0 { c_int::from(copy_only) } else { rc }
}

/// Releases an import (when its mappings are gone too).
///
/// # Safety
/// `i` is NULL or a live import, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_import_release(i: *mut FmmImport) {
    if !i.is_null() {
        // SAFETY: the caller's contract: i came from Box::into_raw in fmm_import.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(i) })));
    }
}

/// Maps a region at its GFA in the window.
///
/// # Safety
/// `s` and `r` are live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_map_region(s: *const FmmSession, r: *const FmmRegion, out: *mut *mut FmmMapping) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, r) = unsafe { (get(s, "session")?, get(r, "region")?) };
        let m = s.0.map(&r.0).map_err(|e| fail(&e))?;
        put(out, FmmMapping(m))
    })
}

/// Maps an import at its GFA in the window.
///
/// # Safety
/// `s` and `i` are live; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_map_import(s: *const FmmSession, i: *const FmmImport, out: *mut *mut FmmMapping) -> c_int {
    guard(|| {
        need_out(out)?;
        // SAFETY: forwarded caller contract.
        let (s, i) = unsafe { (get(s, "session")?, get(i, "import")?) };
        let m = s.0.map(&i.0).map_err(|e| fail(&e))?;
        put(out, FmmMapping(m))
    })
}

/// The first byte of a mapping (NULL for a NULL mapping).
///
/// # Safety
/// `m` is NULL or a live mapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_mapping_ptr(m: *const FmmMapping) -> *mut c_void {
    // SAFETY: the caller's contract.
    unsafe { m.as_ref() }.map_or(std::ptr::null_mut(), |m| m.0.as_ptr().cast())
}

/// The bytes of a mapping (0 for NULL).
///
/// # Safety
/// `m` is NULL or a live mapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_mapping_len(m: *const FmmMapping) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { m.as_ref() }.map_or(0, |m| m.0.len() as u64)
}

/// The GFA of a mapping's first byte (0 for NULL).
///
/// # Safety
/// `m` is NULL or a live mapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_mapping_gfa(m: *const FmmMapping) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { m.as_ref() }.map_or(0, |m| m.0.gfa())
}

/// 1 when the hardware keeps this host's caches coherent with a mapping's memory, so that
/// `fmm_mapping_flush` and `fmm_mapping_invalidate` are no-ops; 0 when it does not (CXL.mem
/// shared by several hosts); a negative `FMM_E_*` for a NULL mapping. See
/// docs/libfabric-mm.md, "Coherence".
///
/// # Safety
/// `m` is NULL or a live mapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_mapping_coherent(m: *const FmmMapping) -> c_int {
    let mut coherent = false;
    let rc = guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { get(m, "mapping")? };
        coherent = m.0.coherent();
        Ok(())
    });
    if rc == 0 { c_int::from(coherent) } else { rc }
}

/// Writes this host's stores to `len` bytes at `offset` of a mapping back to memory, for
/// a fabric without hardware coherence (CXL.mem shared across hosts); a no-op where the
/// mapping is coherent (`fmm_mapping_coherent`). `FMM_E_ARG` for an empty range or one
/// not inside the mapping; `FMM_E_REVOKED` once the mapping is fenced (a revoked import of
/// another node's memory: see `fmm_on_revocation`).
///
/// # Safety
/// `m` is a live mapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_mapping_flush(m: *const FmmMapping, offset: u64, len: u64) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { get(m, "mapping")? };
        m.0.flush(offset, len).map_err(|e| fail(&e))
    })
}

/// Drops this host's cached copies of `len` bytes at `offset` of a mapping (written back
/// first), so that the next load reads memory; a no-op where the mapping is coherent.
/// Errors as for `fmm_mapping_flush`.
///
/// # Safety
/// `m` is a live mapping.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_mapping_invalidate(m: *const FmmMapping, offset: u64, len: u64) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let m = unsafe { get(m, "mapping")? };
        m.0.invalidate(offset, len).map_err(|e| fail(&e))
    })
}

/// Unmaps (restores the window reservation).
///
/// # Safety
/// `m` is NULL or a live mapping, not used afterwards (nor pointers into it).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_unmap(m: *mut FmmMapping) {
    if !m.is_null() {
        // SAFETY: the caller's contract: m came from Box::into_raw in fmm_map_*.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(m) })));
    }
}

#[cfg(test)]
mod tests {
    use std::ptr::{null, null_mut};

    use super::*;

    #[test]
    fn alloc_set_refuses_a_null_session_and_writes_nothing() {
        let mut out = null_mut();
        // SAFETY: NULL session: refused before the name or out are touched.
        assert_eq!(unsafe { fmm_alloc_set(null(), c"set".as_ptr(), 1 << 20, &mut out) }, FMM_E_ARG);
        assert!(out.is_null());
        // SAFETY: fmm_last_error returns a NUL-terminated string.
        assert_eq!(unsafe { CStr::from_ptr(fmm_last_error()) }.to_str().unwrap(), "session is NULL");
        // SAFETY: as above; the result pointer is checked first of all.
        assert_eq!(unsafe { fmm_alloc_set(null(), null(), 1 << 20, null_mut()) }, FMM_E_ARG);
        // SAFETY: as above.
        assert_eq!(unsafe { CStr::from_ptr(fmm_last_error()) }.to_str().unwrap(), "result pointer is NULL");
    }

    #[test]
    fn strings_are_checked_for_null_and_utf8() {
        // SAFETY: the arguments are NULL or NUL-terminated.
        unsafe {
            assert_eq!(opt_str(null(), "set"), Ok(None));
            assert_eq!(req_str(null(), "set"), Err(FMM_E_ARG));
            assert_eq!(req_str(c"\xff\xfe".as_ptr(), "set"), Err(FMM_E_ARG));
            assert_eq!(req_str(c"cxl-region:hpa-0x1000000000".as_ptr(), "set"), Ok("cxl-region:hpa-0x1000000000"));
        }
        // SAFETY: fmm_last_error returns a NUL-terminated string.
        assert_eq!(unsafe { CStr::from_ptr(fmm_last_error()) }.to_str().unwrap(), "set is not UTF-8");
    }

    /// What a failing call made from a thread-local destructor saw, after the last error's
    /// own storage was destroyed: (storage already gone, the call's code, the text then).
    type AtExit = std::sync::Arc<std::sync::Mutex<Option<(bool, c_int, String)>>>;

    /// Makes a failing `fmm_*` call and reads the last error when the thread exits.
    struct CallsAtExit(AtExit);

    impl Drop for CallsAtExit {
        fn drop(&mut self) {
            let gone = LAST_ERROR.try_with(|_| ()).is_err();
            // SAFETY: a NULL mapping is refused before anything is dereferenced.
            let rc = unsafe { fmm_mapping_flush(null(), 0, 1) };
            let text = fmm_last_error();
            // SAFETY: fmm_last_error returns a NUL-terminated string, never NULL.
            let text = unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned();
            *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((gone, rc, text));
        }
    }

    thread_local! {
        static AT_EXIT: RefCell<Option<CallsAtExit>> = const { RefCell::new(None) };
    }

    #[test]
    fn a_failing_call_from_a_thread_local_destructor_does_not_abort() {
        let seen = AtExit::default();
        let record = seen.clone();
        std::thread::spawn(move || {
            // Registered first, so destroyed after the last error's storage, which the
            // failing call below sets up (thread-locals are destroyed in reverse order).
            AT_EXIT.with(|a| *a.borrow_mut() = Some(CallsAtExit(record)));
            // SAFETY: as above.
            assert_eq!(unsafe { fmm_mapping_flush(null(), 0, 1) }, FMM_E_ARG);
            // SAFETY: fmm_last_error returns a NUL-terminated string.
            assert_eq!(unsafe { CStr::from_ptr(fmm_last_error()) }.to_str().unwrap(), "mapping is NULL");
        })
        .join()
        .expect("the thread exits without a panic");
        let seen = seen.lock().unwrap().take().expect("the destructor ran");
        assert_eq!(seen, (true, FMM_E_ARG, String::new()), "the error is not kept once its storage is gone");
    }
}
