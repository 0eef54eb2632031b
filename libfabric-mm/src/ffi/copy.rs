//! The C ABI of copies (part of `include/fabric_mm.h`): start a copy by the daemon's copy
//! engine between registrations and/or GFAs, then poll or wait for it, and free its
//! handle. A child of [`crate::ffi`], whose conventions (codes, last error, panic
//! boundary) it shares.

use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use super::{FMM_OK, FmmSession, arg_err, fail, get, guard, put, set_error};
use crate::copy::{Copy, CopyEndpoint, CopyOutcome};

/// The copy has not finished yet (`fmm_copy_poll`, `fmm_copy_wait` with a timeout).
pub const FMM_COPY_PENDING: c_int = 1;
/// Endpoint kind: a DMA registration of the session (`id`, `offset` in it).
pub const FMM_COPY_REGISTRATION: c_int = 0;
/// Endpoint kind: a global fabric address (`offset` is the GFA; `id` is ignored).
pub const FMM_COPY_GFA: c_int = 1;

/// One side of a copy.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FmmCopyEndpoint {
    /// `FMM_COPY_REGISTRATION` or `FMM_COPY_GFA`.
    pub kind: c_int,
    /// The registration's id (`FMM_COPY_REGISTRATION`).
    pub id: u64,
    /// Byte offset in the registration, or the GFA (`FMM_COPY_GFA`).
    pub offset: u64,
}

/// A copy started with `fmm_copy_start`.
#[derive(Debug)]
pub struct FmmCopy(Copy);

fn endpoint(e: &FmmCopyEndpoint) -> Result<CopyEndpoint, c_int> {
    match e.kind {
        FMM_COPY_REGISTRATION => Ok(CopyEndpoint::Registration { id: e.id, offset: e.offset }),
        FMM_COPY_GFA => Ok(CopyEndpoint::Gfa(e.offset)),
        other => Err(arg_err(&format!("unknown copy endpoint kind {other}"))),
    }
}

/// Reports a finished copy: its bytes through `bytes` (when not NULL), 0 or its code.
fn report(r: CopyOutcome, bytes: *mut u64) -> Result<(), c_int> {
    let n = match &r {
        Ok(n) => *n,
        Err(crate::Error::CopyFailed { bytes, .. }) => *bytes,
        Err(_) => 0,
    };
    if !bytes.is_null() {
        // SAFETY: non-NULL `bytes` is writable (the caller's contract).
        unsafe { *bytes = n };
    }
    r.map(drop).map_err(|e| fail(&e))
}

/// Starts copying `len` bytes from `src` to `dst` with the daemon's copy engine; returns
/// at once with the copy in `out`. While it runs, the destination bytes may change at any
/// time: do not read them until the copy is done.
///
/// # Safety
/// `s` is a live session; `dst` and `src` point to endpoints; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_copy_start(
    s: *const FmmSession,
    dst: *const FmmCopyEndpoint,
    src: *const FmmCopyEndpoint,
    len: u64,
    out: *mut *mut FmmCopy,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (s, dst, src) = unsafe { (get(s, "session")?, get(dst, "dst")?, get(src, "src")?) };
        let c = s.0.copy(endpoint(dst)?, endpoint(src)?, len).map_err(|e| fail(&e))?;
        put(out, FmmCopy(c))
    })
}

/// `FMM_COPY_PENDING` while the copy runs; once done, 0 (every byte copied) or the
/// negative code of why it stopped, with the bytes copied in `*bytes` (when not NULL).
///
/// # Safety
/// `c` is a live copy; `bytes` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_copy_poll(c: *const FmmCopy, bytes: *mut u64) -> c_int {
    let mut pending = false;
    let r = guard(|| {
        // SAFETY: forwarded caller contract.
        let c = unsafe { get(c, "copy") }?;
        match c.0.poll() {
            None => {
                pending = true;
                Ok(())
            }
            Some(r) => report(r, bytes),
        }
    });
    if pending && r == FMM_OK { FMM_COPY_PENDING } else { r }
}

/// Waits for the copy: forever when `timeout_ms` is negative, else at most that many
/// milliseconds (then `FMM_COPY_PENDING`). Returns as `fmm_copy_poll` does.
///
/// # Safety
/// `c` is a live copy; `bytes` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_copy_wait(c: *const FmmCopy, timeout_ms: i64, bytes: *mut u64) -> c_int {
    let mut pending = false;
    let r = guard(|| {
        // SAFETY: forwarded caller contract.
        let c = unsafe { get(c, "copy") }?;
        let r = if timeout_ms < 0 {
            Some(c.0.wait())
        } else {
            c.0.wait_timeout(Duration::from_millis(timeout_ms.unsigned_abs()))
        };
        match r {
            None => {
                set_error("the copy is still running");
                pending = true;
                Ok(())
            }
            Some(r) => report(r, bytes),
        }
    });
    if pending && r == FMM_OK { FMM_COPY_PENDING } else { r }
}

/// Frees a copy's handle (NULL is fine). A copy still running goes on in the daemon; its
/// result is discarded.
///
/// # Safety
/// `c` is NULL or a live copy, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_copy_free(c: *mut FmmCopy) {
    if !c.is_null() {
        // SAFETY: the caller's contract: c came from Box::into_raw in fmm_copy_start.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(c) })));
    }
}
