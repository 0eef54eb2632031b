//! The C ABI of session resume (part of `include/fabric_mm.h`): a session's resume token
//! as text, opening a session that takes back the one a token names, closing the
//! connection on purpose while keeping the process's mappings, and the owner's revoke
//! (what a resumed session uses to end the exports it took back). A child of
//! [`crate::ffi`], whose conventions (codes, last error, panic boundary) it shares.

use std::ffi::{c_char, c_int};

use super::{FMM_E_NOT_IMPLEMENTED, FmmSession, copy_out, fail, get, guard, open, opt_str, req_str, set_error};
use crate::memory::Handle;
use crate::resume::Token;

/// Bytes a resume token's text takes with its NUL (32 hex digits + 1).
pub const FMM_TOKEN_LEN: usize = 33;

/// Writes the session's resume token (32 hex digits and a NUL: `FMM_TOKEN_LEN` bytes) into
/// `buf`. The token is a secret: whoever holds it (and has the owner's uid) can take the
/// session's regions and exports; keep it where only the owner reads it.
/// `FMM_E_NOT_IMPLEMENTED` when the daemon speaks protocol 1.0, which has no tokens.
///
/// # Safety
/// `s` is a live session; `buf` has `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_session_token(s: *const FmmSession, buf: *mut c_char, len: usize) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        let Some(t) = s.0.token() else {
            set_error("the daemon gives no resume token (protocol 1.0)");
            return Err(FMM_E_NOT_IMPLEMENTED);
        };
        copy_out(&t.to_string(), buf, len)
    })
}

/// `fmm_session_open` that takes back the session `token` (its text form) names: its
/// regions and exports become the new session's, and the new session keeps the token.
/// Works after a daemon restart (within `memory.resume_grace_s`) or after the old
/// connection closed while its process lived (`fmm_session_disconnect`, within
/// `memory.detach_grace_s`). A token resumes once: one that names nothing to take back
/// fails with `FMM_E_NOT_FOUND` (open without it then); a malformed one with `FMM_E_ARG`.
/// `token` NULL is `fmm_session_open`.
///
/// # Safety
/// `socket` and `token` are NULL or NUL-terminated strings; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_session_resume(
    socket: *const c_char,
    window_gfa: u64,
    window_len: u64,
    token: *const c_char,
    out: *mut *mut FmmSession,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let token = unsafe { opt_str(token, "token") }?;
        let token = token.map(str::parse::<Token>).transpose().map_err(|e| fail(&e))?;
        // SAFETY: forwarded caller contract.
        unsafe { open(socket, window_gfa, window_len, token, out) }
    })
}

/// Closes the session's connection to the daemon now, keeping this process's mappings
/// (they hold the memory). With `memory.detach_grace_s` set, the daemon keeps the
/// session's regions and exports that long for `fmm_session_resume`; otherwise it
/// reclaims them at once. Every later call on this session fails with
/// `FMM_E_DISCONNECTED`; its handles must still be freed (which then does nothing in the
/// daemon) and the session closed.
///
/// # Safety
/// `s` is a live session.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_session_disconnect(s: *const FmmSession) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        unsafe { get(s, "session") }?.0.disconnect();
        Ok(())
    })
}

/// A no-op round trip to the daemon: 0 while the connection serves,
/// `FMM_E_DISCONNECTED` once it is closed.
///
/// # Safety
/// `s` is a live session.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_session_ping(s: *const FmmSession) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        unsafe { get(s, "session") }?.0.ping().map_err(|e| fail(&e))
    })
}

/// Revokes the export whose handle text is `handle` (this session must own the region,
/// e.g. after taking it back with `fmm_session_resume`): no new imports, and importers
/// are told.
///
/// # Safety
/// `s` is a live session; `handle` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_revoke(s: *const FmmSession, handle: *const c_char) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (s, handle) = unsafe { (get(s, "session")?, req_str(handle, "handle")?) };
        let h: Handle = handle.parse().map_err(|e| fail(&e))?;
        s.0.revoke(&h).map_err(|e| fail(&e))
    })
}
