//! Zeroing device memory before a region on it is handed out. A new sim or tmpfs region
//! file starts as zeros (the kernel's pages), but a range of a DAX device or a BAR keeps
//! whatever the range's previous holder stored — another tenant's region, a previous
//! boot's — so a client would read someone else's bytes. fabricd writes zeros over the
//! range first, through a mapping of the descriptor it hands out.

use std::fs::File;
use std::io;

use crate::copy::Mapping;
use crate::copy::fault;

/// Bytes zeroed per mapping: bounds the daemon's address space use for any region size.
const STEP: u64 = 64 << 20;

/// Source of the recovering copy: zeros in `.bss`, never written.
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

/// Why a range could not be zeroed.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// The range could not be mapped writable.
    #[error("mapping {len} bytes at offset {offset:#x} to zero them")]
    Map {
        /// Offset in the file.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A store faulted (the memory behind the file is not there: a BAR that went away).
    #[error("zeroing at offset {offset:#x}")]
    Store {
        /// Offset in the file of the chunk that faulted.
        offset: u64,
        /// The fault.
        #[source]
        source: fault::FaultError,
    },
}

/// Writes zeros over `[offset, offset + len)` of `file` (a device file opened
/// read-write), a mapping at a time, on a bulk-work thread at a lower CPU priority
/// ([`crate::sys::bulk`]): other clients' requests take a core from it when they need one.
pub fn zero_range(file: &File, offset: u64, len: u64) -> Result<(), ZeroError> {
    crate::sys::bulk::run("zeroing device memory", || zero_here(file, offset, len))
}

/// [`zero_range`] on the calling thread.
fn zero_here(file: &File, offset: u64, len: u64) -> Result<(), ZeroError> {
    let recovering = fault::ready();
    let mut done = 0;
    while done < len {
        let at = offset + done;
        let n = STEP.min(len - done);
        let map =
            Mapping::new(file, at, n, true, false).map_err(|source| ZeroError::Map { offset: at, len: n, source })?;
        let mut put = 0;
        while put < n {
            let k = (ZEROS.len() as u64).min(n - put);
            // `n` and `k` fit a usize: the mapping of `n` bytes was made.
            let dst = (map.addr() + put as usize) as *mut u8;
            if recovering {
                // SAFETY: `dst..dst + k` lies in the writable shared mapping `map` made
                // above, which no Rust reference covers; `ZEROS` is never written and does
                // not overlap it; a fault (the device memory went) is recovered.
                unsafe { fault::copy_recovering(dst, ZEROS.as_ptr(), k as usize) }
                    .map_err(|source| ZeroError::Store { offset: at + put, source })?;
            } else {
                // SAFETY: as above; without the recovering copy (not x86_64 Linux) plain
                // stores: a DAX device or a BAR file never shrinks under its mapping.
                unsafe { std::ptr::write_bytes(dst, 0, k as usize) };
            }
            put += k;
        }
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::os::unix::fs::FileExt;

    use super::*;

    #[test]
    fn zeroes_exactly_the_range_and_nothing_around_it() {
        let f = tempfile::tempfile().unwrap();
        let len = 3 * STEP / 2 + 3 * 4096;
        let total = len + 4 * 4096;
        f.set_len(total).unwrap();
        f.write_all_at(&vec![0xa5u8; total as usize], 0).unwrap();
        zero_range(&f, 2 * 4096, len).unwrap();
        let mut back = vec![0u8; total as usize];
        f.read_exact_at(&mut back, 0).unwrap();
        let (head, rest) = back.split_at(2 * 4096);
        let (mid, tail) = rest.split_at(len as usize);
        assert!(head.iter().all(|&b| b == 0xa5), "bytes before the range changed");
        assert!(mid.iter().all(|&b| b == 0), "the range is not all zeros");
        assert!(tail.iter().all(|&b| b == 0xa5), "bytes after the range changed");
    }

    #[test]
    fn a_range_past_the_end_of_the_file_is_an_error_not_a_dead_daemon() {
        if !fault::ready() {
            return; // Without the recovering copy a SIGBUS here would end the test process.
        }
        let f = tempfile::tempfile().unwrap();
        f.set_len(4096).unwrap();
        let e = zero_range(&f, 0, 8 * 4096).unwrap_err();
        assert!(matches!(e, ZeroError::Store { offset: 0, .. }), "{e}");
    }

    #[test]
    fn a_read_only_descriptor_is_refused_at_the_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        std::fs::write(&p, vec![1u8; 8192]).unwrap();
        let f = File::open(&p).unwrap();
        let e = zero_range(&f, 0, 8192).unwrap_err();
        assert!(matches!(e, ZeroError::Map { .. }), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), vec![1u8; 8192]);
    }
}
