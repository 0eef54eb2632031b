//! The few system calls the daemon makes directly; everything else goes through std, nix
//! or tokio.

/// The effective user id of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions, cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() }
}
