//! The C ABI of copies (part of `include/fabric_mm.h`): start a copy by the daemon's copy
//! engine between registrations and/or GFAs, then poll or wait for it, and free its
//! handle. A child of [`crate::ffi`], whose conventions (codes, last error, panic
//! boundary) it shares.

use std::ffi::{CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use super::{FMM_OK, FmmSession, UserData, arg_err, error_text, fail, get, guard, need_out, put};
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
        need_out(out)?;
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
/// milliseconds (then `FMM_COPY_PENDING`, which is not a failure: `fmm_last_error()` is left
/// as it was). Returns as `fmm_copy_poll` does. Refused (`FMM_E_ARG`) in one of this
/// session's callbacks, whose thread is the one that would read the completion.
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
            // Not a failure: the last error (and a pointer the caller kept to its text)
            // stays as it was, as with `fmm_copy_poll`.
            None => {
                pending = true;
                Ok(())
            }
            Some(r) => report(r, bytes),
        }
    });
    if pending && r == FMM_OK { FMM_COPY_PENDING } else { r }
}

/// Called once with a copy's result (`fmm_copy_on_complete`): `rc` 0 (every byte copied)
/// or the negative code of why it stopped, `bytes` the bytes copied, `message` NULL on
/// success, else the failure's text (valid during the call only; `fmm_last_error()` is not
/// set by a callback).
pub type FmmCopyCallback =
    Option<unsafe extern "C" fn(user: *mut c_void, rc: c_int, bytes: u64, message: *const c_char)>;

/// The callback's arguments for a result.
fn callback_args(r: &CopyOutcome) -> (c_int, u64, Option<CString>) {
    match r {
        Ok(n) => (FMM_OK, *n, None),
        Err(e) => {
            let bytes = if let crate::Error::CopyFailed { bytes, .. } = e { *bytes } else { 0 };
            let text = CString::new(error_text(e).replace('\0', " ")).unwrap_or_default();
            (e.code(), bytes, Some(text))
        }
    }
}

/// Has `cb` called once with the copy's result, instead of `fmm_copy_poll`/`fmm_copy_wait`
/// reporting it (they answer `FMM_E_ARG` afterwards). One callback per copy: a second call
/// is refused with `FMM_E_ARG` (its `cb` never runs), whether the first callback ran already
/// or is still to run.
///
/// **Thread.** When the copy is already done, `cb` runs at once on the calling thread,
/// before this returns. Else it runs on the thread that reads the daemon's completion: the
/// library's reader thread (`fabric-mm-reader`), or one of the caller's threads while it is
/// inside an `fmm_*` call of this session that waits for fabricd's answer. `user` is passed
/// as given and must stay valid until `cb` has run. If the connection to the daemon ends
/// first, `cb` runs with `FMM_E_DISCONNECTED` on the thread that saw the end (the reader
/// thread, or the caller's inside a call, or the one calling `fmm_session_disconnect`), or
/// at once here when it had already ended.
///
/// **What `cb` may not do.** Block or run long (answers to this session's calls and other
/// completions wait behind it); call any `fmm_*` function that talks to fabricd on this
/// session (it waits for the callback: deadlock); free this copy's handle
/// (`fmm_copy_free`), or use it at all; unwind or `longjmp` out of the call. Signalling
/// another thread (a flag, a condition variable, a queue) is the intended use.
///
/// `fmm_copy_free` may be called before the copy completes (from any thread but the
/// callback): the callback still runs once.
///
/// # Safety
/// `c` is a live copy; `cb` is a function safe to call from another thread with `user`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_copy_on_complete(c: *const FmmCopy, cb: FmmCopyCallback, user: *mut c_void) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let c = unsafe { get(c, "copy") }?;
        let cb = cb.ok_or_else(|| arg_err("callback is NULL"))?;
        let user = UserData(user);
        c.0.on_complete(move |r| {
            // No panic may unwind into the reader thread: the conversion is caught, the C
            // function (which cannot unwind) is called outside. A conversion that panicked
            // still reports, as FMM_E_PANIC.
            let (rc, bytes, text) = catch_unwind(AssertUnwindSafe(|| callback_args(&r))).unwrap_or((
                super::FMM_E_PANIC,
                0,
                Some(CString::from(c"internal error: a panic was caught at the C boundary")),
            ));
            let message = text.as_ref().map_or(std::ptr::null(), |t| t.as_ptr());
            // SAFETY: the caller's contract: cb may be called from this thread with user;
            // message is NULL or NUL-terminated and lives across the call.
            unsafe { cb(user.ptr(), rc, bytes, message) };
        })
        .map_err(|e| fail(&e))
    })
}

/// Frees a copy's handle (NULL is fine). A copy still running goes on in the daemon; its
/// result is discarded, unless a callback is set (`fmm_copy_on_complete`): that still runs.
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

#[cfg(test)]
mod tests {
    use std::ffi::CStr;
    use std::ptr::{null, null_mut};

    use super::*;
    use crate::ffi::{FMM_E_ARG, fmm_last_error};

    unsafe extern "C" fn never(_: *mut c_void, _: c_int, _: u64, _: *const c_char) {
        unreachable!("no copy completes in these tests");
    }

    fn last() -> String {
        // SAFETY: fmm_last_error returns a NUL-terminated string valid until the next failure.
        unsafe { CStr::from_ptr(fmm_last_error()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn on_complete_refuses_a_null_copy_before_anything_else() {
        // SAFETY: NULL copy, a valid function; nothing is dereferenced.
        assert_eq!(unsafe { fmm_copy_on_complete(null(), Some(never), null_mut()) }, FMM_E_ARG);
        assert_eq!(last(), "copy is NULL");
        // SAFETY: as above, with no callback either.
        assert_eq!(unsafe { fmm_copy_on_complete(null(), None, null_mut()) }, FMM_E_ARG);
    }

    #[test]
    fn start_poll_and_wait_refuse_nulls() {
        let e = FmmCopyEndpoint { kind: FMM_COPY_GFA, id: 0, offset: 0 };
        let mut out = null_mut();
        // SAFETY: NULL session: refused before the endpoints are read.
        assert_eq!(unsafe { fmm_copy_start(null(), &e, &e, 1, &mut out) }, FMM_E_ARG);
        assert!(out.is_null());
        // SAFETY: NULL copies are refused, not dereferenced.
        assert_eq!(unsafe { fmm_copy_poll(null(), null_mut()) }, FMM_E_ARG);
        // SAFETY: as above.
        assert_eq!(unsafe { fmm_copy_wait(null(), 0, null_mut()) }, FMM_E_ARG);
        // SAFETY: NULL is fine.
        unsafe { fmm_copy_free(null_mut()) };
    }

    #[test]
    fn callback_arguments_carry_the_code_bytes_and_text() {
        assert_eq!(callback_args(&Ok(42)), (FMM_OK, 42, None));
        let failed = crate::Error::CopyFailed {
            copy: 7,
            code: fabric_proto::wire::ErrorCode::Revoked,
            message: "import revoked".into(),
            bytes: 4096,
        };
        let (rc, bytes, text) = callback_args(&Err(failed));
        assert_eq!((rc, bytes), (crate::ffi::FMM_E_REVOKED, 4096));
        assert!(text.unwrap().to_str().unwrap().contains("import revoked"));
        let (rc, bytes, text) = callback_args(&Err(crate::Error::Disconnected));
        assert_eq!((rc, bytes), (crate::ffi::FMM_E_DISCONNECTED, 0));
        assert!(!text.unwrap().as_bytes().is_empty());
    }
}
