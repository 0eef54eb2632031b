//! A CPU copy that survives its own faults, the way the Linux kernel's exception tables
//! let `copy_from_user` survive a bad user address: one copy routine in assembly whose
//! only memory-touching instruction lies between two known labels, and a process-wide
//! `SIGBUS`/`SIGSEGV` handler that, when the faulting instruction is that one, resumes the
//! routine at its fixup label, which returns how many bytes were left and where the fault
//! was. Any other fault is passed on as if the handler were not there.
//!
//! This is what lets the copy engine `memcpy` through mappings of files a client may
//! shrink (region files, registered memory objects): a client that truncates a file under
//! a copy turns into a [`FaultError::Access`] for that copy, never a dead daemon.
//!
//! x86_64 Linux only (`rep movsb`: as fast as glibc's `memcpy` from 1 MiB on ERMS/FSRM
//! CPUs, measured); elsewhere, and under Miri, [`ready`] is false and the copy engine keeps
//! its kernel path (`pread`, `process_vm_readv`).

use std::io;

/// Why a recovering copy did not move every byte.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// A load or store of the copy faulted: the memory behind a mapping went (a file
    /// shrunk under it: `SIGBUS`) or the address was not mapped as needed (`SIGSEGV`).
    // No address in the text: it travels to clients (`CopyDone`), and the daemon's
    // addresses are its own (the daemon logs it).
    #[error("{} after {done} of {len} bytes", signal_name(*.signal))]
    Access {
        /// The faulting address the kernel reported.
        addr: usize,
        /// Bytes copied before the fault (the bytes from `dst` on; at most the distance
        /// to the fault).
        done: usize,
        /// Bytes asked for.
        len: usize,
        /// `SIGBUS` or `SIGSEGV`.
        signal: i32,
    },
    /// The signal handler could not be installed (then no CPU copy runs).
    #[error("installing the SIGBUS/SIGSEGV handler")]
    Install(#[source] io::Error),
    /// No recovering copy on this target.
    #[error("no recovering CPU copy on this target")]
    Unsupported,
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGBUS => "SIGBUS",
        libc::SIGSEGV => "SIGSEGV",
        _ => "signal",
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
mod imp;
#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
pub use imp::{copy_recovering, install};

#[cfg(all(test, target_arch = "x86_64", target_os = "linux", not(miri)))]
mod tests;

/// Installs the handler (once per process); on this target there is none.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri))))]
pub fn install() -> Result<(), FaultError> {
    Err(FaultError::Unsupported)
}

/// Copies `len` bytes from `src` to `dst`, recovering from faults; on this target it
/// always says [`FaultError::Unsupported`] (and touches nothing).
///
/// # Safety
/// As the x86_64 version's.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri))))]
pub unsafe fn copy_recovering(_dst: *mut u8, _src: *const u8, _len: usize) -> Result<(), FaultError> {
    Err(FaultError::Unsupported)
}

/// Whether [`copy_recovering`] can run here: the target has it and the handler is
/// installed (installing it on first call; a failure is logged once).
pub fn ready() -> bool {
    static WARNED: std::sync::Once = std::sync::Once::new();
    match install() {
        Ok(()) => true,
        Err(FaultError::Unsupported) => false,
        Err(e) => {
            WARNED.call_once(|| {
                tracing::warn!(error = %crate::error_chain(&e), "no recovering CPU copy: the copy engine uses the kernel");
            });
            false
        }
    }
}
