//! One chunk of a copy: from a side's memory to the other's — by the CPU between two
//! daemon mappings (a fault, as from a file a client shrank, recovered into an error:
//! [`super::fault`]), by the kernel to or from a client's own memory (see the module above
//! for which call moves which pair of sides), and by the kernel for everything where the
//! target has no recovering copy (then the CPU only between memory that cannot shrink).

use std::sync::Arc;

use fabric_proto::wire::ErrorCode;

use super::BOUNCE;
use super::fault::{self, FaultError};
use super::regionmap::RegionMaps;
use super::sys::{self, Mapping};
use crate::memory::Side;
use crate::transport::peer::Process;

/// Why a chunk did not move.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    /// The process whose memory a side is has exited.
    #[error("the process {0} whose memory is registered has exited")]
    ProcessGone(i32),
    /// A side's memory file could not be mapped.
    #[error("mapping {what} memory for the copy")]
    Map {
        /// `source` or `destination`.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused the copy (memory shrunk or unmapped under the copy, a
    /// process's memory no longer there).
    #[error("moving {len} bytes at offset {at}")]
    Move {
        /// Offset in the copy.
        at: u64,
        /// Bytes.
        len: u64,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The CPU copy faulted (memory shrunk or unmapped under the copy) and recovered;
    /// the same code as the kernel's refusal.
    #[error("moving {len} bytes at offset {at}")]
    Fault {
        /// Offset in the copy.
        at: u64,
        /// Bytes.
        len: u64,
        /// Where and how.
        #[source]
        source: FaultError,
    },
}

impl ChunkError {
    /// The code the copy's completion carries.
    pub fn code(&self) -> ErrorCode {
        match self {
            ChunkError::ProcessGone(_) => ErrorCode::NotFound,
            ChunkError::Map { .. } | ChunkError::Move { .. } | ChunkError::Fault { .. } => ErrorCode::Internal,
        }
    }
}

/// A side at one chunk: a daemon address, or a process address.
enum At<'a> {
    /// Daemon memory at this address.
    Local {
        addr: usize,
        /// The mapping, when the chunk made one (unmapped after the move) or took a
        /// region's kept one (held for the move).
        _map: Option<Arc<Mapping>>,
    },
    /// Process memory: reached by pid only inside [`Process::with`] ([`remote`]).
    Remote(&'a Process, u64),
}

/// Moves bytes to or from `process` by its pid, which names it throughout the move (it
/// has not exited before nor after).
fn remote(process: &Process, f: impl FnOnce(i32) -> std::io::Result<()>) -> Result<std::io::Result<()>, ChunkError> {
    process.with(f).map_err(|_| ChunkError::ProcessGone(process.pid()))
}

fn at<'a>(side: &'a Side, offset: u64, write: bool, maps: &RegionMaps) -> Result<At<'a>, ChunkError> {
    let what = if write { "destination" } else { "source" };
    Ok(match side {
        Side::Pinned { map, base } => At::Local { addr: map.as_ptr() as usize + (base + offset) as usize, _map: None },
        // A region: its kept mapping (made by the first chunk that reached it), writable
        // for a destination.
        Side::File { file, offset: o, writable, region, base, region_len, .. } => {
            if write && !writable {
                return Err(ChunkError::Map { what, source: std::io::Error::from_raw_os_error(libc::EBADF) });
            }
            let m = maps
                .get(*region, file, *base, *region_len, write)
                .map_err(|source| ChunkError::Map { what, source })?;
            At::Local { addr: m.addr() + (o - base + offset) as usize, _map: Some(m) }
        }
        Side::Process { process, addr } => {
            if !process.running() {
                return Err(ChunkError::ProcessGone(process.pid()));
            }
            At::Remote(process, addr + offset)
        }
    })
}

/// Whether the CPU copy may reach a side: memory the daemon maps — a region by GFA,
/// device memory included (through its kept mapping), or a registration of ordinary
/// memory (a registration of a DAX or BAR region keeps the kernel path).
fn cpu_reaches(side: &Side) -> bool {
    match side {
        Side::Pinned { map, .. } => map.ordinary(),
        Side::File { .. } => true,
        Side::Process { .. } => false,
    }
}

/// Moves `len` bytes between the daemon buffer at `local` and bytes `[offset, offset +
/// len)` of `side`, a side the daemon maps (a region on device memory, through its kept
/// mapping): `store` writes the side. The recovering CPU copy, else the kernel (which
/// reaches a DAX device's pages, not a BAR's).
pub(super) fn with_buffer(
    side: &Side,
    offset: u64,
    local: usize,
    len: u64,
    store: bool,
    maps: &RegionMaps,
) -> Result<(), ChunkError> {
    let At::Local { addr, _map } = at(side, offset, store, maps)? else {
        return Err(ChunkError::Move { at: offset, len, source: std::io::Error::from_raw_os_error(libc::EINVAL) });
    };
    let (d, s) = if store { (addr, local) } else { (local, addr) };
    if fault::ready() {
        return cpu_recovering(d, s, offset, len).map(|_| ());
    }
    sys::vm_read(sys::own_pid(), d, s as u64, len).map_err(|source| ChunkError::Move { at: offset, len, source })
}

/// The file behind a daemon-held side and the file offset of its byte 0, when the kernel
/// reads it (`pread`): not device memory, which serves `mmap` only.
fn file_of(side: &Side) -> Option<(&std::fs::File, u64)> {
    match side {
        Side::Pinned { map, base } if map.ordinary() => Some((map.file(), map.offset() + base)),
        Side::File { file, offset, device: false, .. } => Some((file, *offset)),
        Side::Pinned { .. } | Side::File { .. } | Side::Process { .. } => None,
    }
}

/// The CPU copy of a chunk between two daemon addresses, `d` and `s`, that the caller
/// resolved with [`at`] and holds (with their mappings) across the call — or, one of
/// them, a buffer of the caller's own of `len` bytes ([`with_buffer`]).
fn cpu_recovering(d: usize, s: usize, offset: u64, len: u64) -> Result<bool, ChunkError> {
    let n = usize::try_from(len).map_err(|_| ChunkError::Move {
        at: offset,
        len,
        source: std::io::Error::from_raw_os_error(libc::EOVERFLOW),
    })?;
    // SAFETY: both addresses lie in mappings the caller holds alive (its `At`s hold the
    // kept region mappings, the job holds the registrations' pinned ones) or in a buffer
    // the caller owns and no other reference reaches during the call, `len` bytes inside
    // each as the endpoints were checked against the registrations' and regions' lengths
    // when resolved; the destination is mapped writable (a region's writable
    // mapping; a registration a copy writes is read-write); the memory is clients' shared
    // memory that no Rust reference covers; the request path refused overlapping ranges of
    // one object. What a client may still do — shrink a file under a mapping — is a
    // fault, recovered into an error.
    match unsafe { fault::copy_recovering(d as *mut u8, s as *const u8, n) } {
        Ok(()) => Ok(true),
        Err(source) => {
            if let FaultError::Access { addr, signal, .. } = &source {
                tracing::warn!(
                    addr = format_args!("{addr:#x}"),
                    signal,
                    at = offset,
                    len,
                    "a copy faulted (recovered)"
                );
            }
            Err(ChunkError::Fault { at: offset, len, source })
        }
    }
}

/// Copies bytes `[offset, offset + len)` of `src` to the same range of `dst`; `bounce`
/// is the engine's buffer for process-to-process copies, `maps` the regions' kept
/// mappings. Returns whether the CPU moved the bytes (else the kernel or nothing did).
pub fn copy(
    dst: &Side,
    src: &Side,
    offset: u64,
    len: u64,
    bounce: &mut Vec<u8>,
    maps: &RegionMaps,
) -> Result<bool, ChunkError> {
    let moved = |source| ChunkError::Move { at: offset, len, source };
    let d = at(dst, offset, true, maps)?;
    // Two sides the daemon maps (registrations of memory files, regions by GFA): the CPU
    // copies between the mappings, once, at memcpy speed; a fault (a client shrank a file
    // under the copy) fails the chunk and nothing else.
    if matches!(d, At::Local { .. }) && cpu_reaches(dst) && cpu_reaches(src) && fault::ready() {
        let s = at(src, offset, false, maps)?;
        if let (At::Local { addr: d_addr, .. }, At::Local { addr: s_addr, .. }) = (&d, &s) {
            return cpu_recovering(*d_addr, *s_addr, offset, len);
        }
    }
    // Without a recovering copy: two pinned mappings of memory no one can shrink: no load
    // or store can fault, so the CPU copies, once, at memcpy speed.
    if let (Side::Pinned { map: dm, base: db }, Side::Pinned { map: sm, base: sb }) = (dst, src)
        && dm.cannot_shrink()
        && sm.cannot_shrink()
        && dm.writable()
    {
        let d = dm.as_ptr() as usize + (db + offset) as usize;
        let s = sm.as_ptr() as usize + (sb + offset) as usize;
        // SAFETY: both ranges lie in the registrations' pinned mappings (the endpoints
        // were checked against the registrations' lengths when resolved), which this job
        // holds alive; their files are sealed against shrinking, so no access faults; the
        // destination is mapped writable; the request path refused overlapping ranges of
        // one object, and two memfds do not share pages.
        unsafe { sys::cpu_copy(d, s, len) };
        return Ok(true);
    }
    // A source the daemon holds a file of is read from the file's page cache straight
    // into the destination: one copy, and no mapping of the source to make.
    if let (At::Local { addr, .. }, Some((file, off))) = (&d, file_of(src)) {
        return sys::pread_into(file, *addr, off + offset, len).map_err(moved).map(|()| false);
    }
    let s = at(src, offset, false, maps)?;
    let r = match (&d, &s) {
        (At::Local { addr: d, .. }, At::Local { addr: s, .. }) => {
            sys::vm_read(sys::own_pid(), *d, *s as u64, len).map_err(moved)
        }
        (At::Local { addr: d, .. }, At::Remote(p, s)) => {
            remote(p, |pid| sys::vm_read(pid, *d, *s, len))?.map_err(moved)
        }
        (At::Remote(p, d), At::Local { addr: s, .. }) => {
            remote(p, |pid| sys::vm_write(pid, *s, *d, len))?.map_err(moved)
        }
        (At::Remote(dp, d), At::Remote(sp, s)) => {
            bounce.resize(BOUNCE, 0);
            let buf = bounce.as_mut_ptr() as usize;
            let mut done = 0;
            while done < len {
                let n = (len - done).min(BOUNCE as u64);
                remote(sp, |pid| sys::vm_read(pid, buf, s + done, n))?.map_err(moved)?;
                remote(dp, |pid| sys::vm_write(pid, buf, d + done, n))?.map_err(moved)?;
                done += n;
            }
            Ok(())
        }
    };
    r.map(|()| false)
}
