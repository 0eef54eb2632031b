//! The C ABI of revocation callbacks (part of `include/fabric_mm.h`): a C function the
//! library calls when one of the session's imports is revoked, over
//! [`crate::Session::on_revocation`]. A child of [`crate::ffi`], whose conventions it
//! shares.

use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use super::{FmmSession, UserData, get, guard};
use crate::{Revocation, RevocationReason};

/// `fmm_revocation_t.reason`: the owner revoked the export.
pub const FMM_REVOKED_BY_OWNER: c_int = 0;
/// `fmm_revocation_t.reason`: the owner freed the region.
pub const FMM_REVOKED_FREED: c_int = 1;
/// `fmm_revocation_t.reason`: the owner's process exited.
pub const FMM_REVOKED_OWNER_EXITED: c_int = 2;
/// `fmm_revocation_t.reason`: the device holding the memory vanished.
pub const FMM_REVOKED_DEVICE_LOST: c_int = 3;

/// One revoked import (`fmm_revocation_callback_t`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FmmRevocation {
    /// The region's id.
    pub region: u64,
    /// The region's generation.
    pub generation: u64,
    /// The daemon's id of this session's import.
    pub import: u64,
    /// Why (`FMM_REVOKED_*`).
    pub reason: c_int,
}

/// Called for each revocation of one of the session's imports (see `fmm_on_revocation`
/// for the thread and what it may not do); `r` is valid during the call only.
pub type FmmRevocationCallback = Option<unsafe extern "C" fn(user: *mut c_void, r: *const FmmRevocation)>;

fn reason_code(r: RevocationReason) -> c_int {
    match r {
        RevocationReason::Revoked => FMM_REVOKED_BY_OWNER,
        RevocationReason::Freed => FMM_REVOKED_FREED,
        RevocationReason::OwnerExited => FMM_REVOKED_OWNER_EXITED,
        RevocationReason::DeviceLost => FMM_REVOKED_DEVICE_LOST,
    }
}

/// Sets the function called for every revocation of one of this session's imports, after
/// the import is marked revoked (its next use fails with `FMM_E_REVOKED`); replaces an
/// earlier one. `cb` NULL removes it. Once this returns, the earlier callback is not
/// running and never runs again, so its `user` may be freed. Called from inside the
/// callback (a callback that removes or replaces itself), it returns at once: the call
/// it is made from goes on, and is the last.
///
/// **Thread.** `cb` runs on the thread that reads the daemon's event: the library's reader
/// thread (`fabric-mm-reader`), or one of the caller's threads while it is inside an
/// `fmm_*` call of this session that waits for fabricd's answer. It may run until the
/// session's last object is freed (`fmm_session_close` alone does not stop it): remove it
/// with `cb` NULL first when `user` goes away earlier. `user` is passed as given.
///
/// **Fenced first.** A mapping of an import of another node's memory is fenced before `cb`
/// runs: the window's reservation is put back over it, so a load or store through it
/// faults (`SIGSEGV`) from then on; stop using its pointer before the revocation can come
/// (docs/libfabric-mm.md, "Revocation"). Imports of this node's memory keep their pages
/// until unmapped.
///
/// **What `cb` may not do.** Block or run long (answers to this session's calls wait
/// behind it); call any `fmm_*` function that talks to fabricd on this session (it waits
/// for the callback: deadlock); unwind or `longjmp` out of
/// the call. Recording the revocation (a flag, a queue) for another thread to act on is
/// the intended use; `fmm_import_check` and `fmm_unmap`/`fmm_import_release` belong on that
/// thread.
///
/// # Safety
/// `s` is a live session; `cb` is NULL or a function safe to call from another thread with
/// `user`, which stays valid as said above.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_on_revocation(
    s: *const FmmSession,
    cb: FmmRevocationCallback,
    user: *mut c_void,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        let Some(cb) = cb else {
            s.0.on_revocation(|_| {});
            return Ok(());
        };
        let user = UserData(user);
        s.0.on_revocation(move |r: &Revocation| {
            // No panic may unwind into the reader thread's caller: the conversion is
            // caught, the C function (which cannot unwind) is called outside.
            let Ok(c) = catch_unwind(AssertUnwindSafe(|| FmmRevocation {
                region: r.region,
                generation: r.generation,
                import: r.import,
                reason: reason_code(r.reason),
            })) else {
                return;
            };
            // SAFETY: the caller's contract: cb may be called from this thread with user;
            // &c is valid for the call.
            unsafe { cb(user.ptr(), &c) };
        });
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::ptr::{null, null_mut};

    use super::*;
    use crate::ffi::FMM_E_ARG;

    unsafe extern "C" fn never(_: *mut c_void, _: *const FmmRevocation) {
        unreachable!("nothing is revoked in these tests");
    }

    #[test]
    fn on_revocation_refuses_a_null_session_with_or_without_a_callback() {
        // SAFETY: NULL session: refused, nothing dereferenced or kept.
        assert_eq!(unsafe { fmm_on_revocation(null(), Some(never), null_mut()) }, FMM_E_ARG);
        // SAFETY: as above.
        assert_eq!(unsafe { fmm_on_revocation(null(), None, null_mut()) }, FMM_E_ARG);
    }

    #[test]
    fn every_reason_has_its_own_code() {
        let codes = [
            RevocationReason::Revoked,
            RevocationReason::Freed,
            RevocationReason::OwnerExited,
            RevocationReason::DeviceLost,
        ]
        .map(reason_code);
        assert_eq!(codes, [FMM_REVOKED_BY_OWNER, FMM_REVOKED_FREED, FMM_REVOKED_OWNER_EXITED, FMM_REVOKED_DEVICE_LOST]);
    }
}
