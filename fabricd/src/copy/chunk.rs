//! One chunk of a copy: from a side's memory to the other's — by the CPU between two
//! daemon mappings (a fault, as from a file a client shrank, recovered into an error:
//! [`super::fault`]), by the kernel between a client's own memory and the engine's buffer
//! (the daemon-held side then to or from that buffer: see the module above for which call
//! moves which pair of sides), and by the kernel for everything where the target has no
//! recovering copy (then the CPU only between memory that cannot shrink).

use std::sync::Arc;

use fabric_proto::wire::ErrorCode;

use super::BOUNCE;
use super::fault::{self, FaultError};
use super::regionmap::RegionMaps;
use super::sys::{self, Mapping};
use crate::dma::{ClientGate, Unreached};
use crate::memory::Side;
use crate::transport::peer::Process;

/// Why a chunk did not move.
#[derive(Debug, thiserror::Error)]
pub enum ChunkError {
    /// The process whose memory a side is has exited.
    #[error("the process {0} whose memory is registered has exited")]
    ProcessGone(i32),
    /// The registration of a client's memory that a side is was undone.
    #[error("the registered memory was unregistered")]
    Unregistered,
    /// The copy was stopped (what it depends on went): not a failure of its own, the
    /// copy ends with the reason it was stopped for.
    #[error("the copy was stopped")]
    Stopped,
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
            ChunkError::ProcessGone(_) | ChunkError::Unregistered | ChunkError::Stopped => ErrorCode::NotFound,
            ChunkError::Map { .. } | ChunkError::Move { .. } | ChunkError::Fault { .. } => ErrorCode::Internal,
        }
    }
}

/// A daemon-held side at one chunk: its address, and the mapping that keeps it there.
struct Local {
    addr: usize,
    /// The mapping, when the chunk took a region's kept one (held for the move).
    _map: Option<Arc<Mapping>>,
}

/// Moves bytes to or from `process` by its pid, which names it throughout the move (it
/// has not exited before nor after), with the registration's gate held
/// ([`crate::dma::ClientGate`]): never the copy's own.
pub(super) fn remote(
    process: &Process,
    gate: &ClientGate,
    f: impl FnOnce(i32) -> std::io::Result<()>,
) -> Result<std::io::Result<()>, ChunkError> {
    gate.reach(process, f).map_err(|u| match u {
        Unreached::Unregistered => ChunkError::Unregistered,
        Unreached::ProcessGone => ChunkError::ProcessGone(process.pid()),
    })
}

/// How a chunk's accesses are held ([`copy`]).
pub struct Holds<E, V> {
    /// Begins an access to daemon-held memory: the job's gate read-locked, `None` once
    /// the job is stopped (the chunk then ends with [`ChunkError::Stopped`]).
    pub enter: E,
    /// Marks an access to a client's memory in flight for as long as what it returns is
    /// held (the engine's watchdog times it: `crew.rs`).
    pub visit: V,
}

/// The daemon address of byte `offset` of a daemon-held side (a region's kept mapping,
/// made by the first chunk that reached it, writable for a destination).
fn local(side: &Side, offset: u64, write: bool, maps: &RegionMaps) -> Result<Local, ChunkError> {
    let what = if write { "destination" } else { "source" };
    Ok(match side {
        Side::Pinned { map, base } => Local { addr: map.as_ptr() as usize + (base + offset) as usize, _map: None },
        Side::File { file, offset: o, writable, region, base, region_len, .. } => {
            if write && !writable {
                return Err(ChunkError::Map { what, source: std::io::Error::from_raw_os_error(libc::EBADF) });
            }
            let m = maps
                .get(*region, file, *base, *region_len, write)
                .map_err(|source| ChunkError::Map { what, source })?;
            Local { addr: m.addr() + (o - base + offset) as usize, _map: Some(m) }
        }
        // A client's memory has no daemon address: it moves through a buffer.
        Side::Process { .. } => {
            return Err(ChunkError::Map { what, source: std::io::Error::from_raw_os_error(libc::EINVAL) });
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

/// Moves `len` bytes between the daemon buffer at `buf` and bytes `[offset, offset +
/// len)` of `side`, a side the daemon maps (a region on device memory through its kept
/// mapping): `store` writes the side. The recovering CPU copy where it may reach the side,
/// else the kernel, with the side's mapping as the call's local end (which the kernel
/// reaches as the daemon's own memory: a BAR's too) and the buffer as its remote end.
pub(super) fn with_buffer(
    side: &Side,
    offset: u64,
    buf: usize,
    len: u64,
    store: bool,
    maps: &RegionMaps,
) -> Result<(), ChunkError> {
    let Local { addr, _map } = local(side, offset, store, maps)?;
    if cpu_reaches(side) && fault::ready() {
        let (d, s) = if store { (addr, buf) } else { (buf, addr) };
        return cpu_recovering(d, s, offset, len).map(|_| ());
    }
    let moved = if store {
        sys::vm_read(sys::own_pid(), addr, buf as u64, len)
    } else {
        sys::vm_write(sys::own_pid(), addr, buf as u64, len)
    };
    moved.map_err(|source| ChunkError::Move { at: offset, len, source })
}

/// Reads bytes `[offset, offset + len)` of daemon-held `side` into the buffer at `buf`:
/// from the file's page cache where the daemon holds a file of it (no mapping to make),
/// else through its mapping ([`with_buffer`]).
fn load(side: &Side, offset: u64, buf: usize, len: u64, maps: &RegionMaps) -> Result<(), ChunkError> {
    match file_of(side) {
        Some((file, off)) => {
            sys::pread_into(file, buf, off + offset, len).map_err(|source| ChunkError::Move { at: offset, len, source })
        }
        None => with_buffer(side, offset, buf, len, false, maps),
    }
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
/// resolved with [`local`] and holds (with their mappings) across the call — or, one of
/// them, a buffer of the caller's own of `len` bytes ([`with_buffer`]).
fn cpu_recovering(d: usize, s: usize, offset: u64, len: u64) -> Result<bool, ChunkError> {
    let n = usize::try_from(len).map_err(|_| ChunkError::Move {
        at: offset,
        len,
        source: std::io::Error::from_raw_os_error(libc::EOVERFLOW),
    })?;
    // SAFETY: both addresses lie in mappings the caller holds alive (its `Local`s hold the
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
/// is the engine's buffer for a client's memory, `maps` the regions' kept mappings.
/// Returns whether the CPU moved the bytes (else the kernel or nothing did).
///
/// `holds.enter` is held around every load or store of a daemon-held side and around
/// nothing else: a client's memory moves between the client and `bounce` under its
/// registration's gate alone (and `holds.visit`), so a client that stalls its own memory
/// stalls no sweep ([`crate::dma::ClientGate`]).
pub fn copy<G, S>(
    dst: &Side,
    src: &Side,
    offset: u64,
    len: u64,
    bounce: &mut Vec<u8>,
    maps: &RegionMaps,
    holds: &Holds<impl Fn() -> Option<G>, impl Fn() -> S>,
) -> Result<bool, ChunkError> {
    if dst.is_client() || src.is_client() {
        return through_buffer(dst, src, offset, len, bounce, maps, holds).map(|()| false);
    }
    let _in = (holds.enter)().ok_or(ChunkError::Stopped)?;
    between_daemon_sides(dst, src, offset, len, maps)
}

/// A chunk of which one side, or both, is a client's memory: piece by piece through
/// `bounce`, the client's end under its registration's gate and the daemon's under
/// `holds.enter` ([`copy`]), never both at once.
fn through_buffer<G, S>(
    dst: &Side,
    src: &Side,
    offset: u64,
    len: u64,
    bounce: &mut Vec<u8>,
    maps: &RegionMaps,
    holds: &Holds<impl Fn() -> Option<G>, impl Fn() -> S>,
) -> Result<(), ChunkError> {
    bounce.resize(BOUNCE, 0);
    let buf = bounce.as_mut_ptr() as usize;
    let mut done = 0;
    while done < len {
        let (at, n) = (offset + done, (len - done).min(BOUNCE as u64));
        piece(src, at, buf, n, false, maps, holds)?;
        piece(dst, at, buf, n, true, maps, holds)?;
        done += n;
    }
    Ok(())
}

/// Moves bytes `[at, at + n)` of `side` between it and the buffer at `buf` (`store`
/// writes the side): a client's memory under its registration's gate, daemon-held memory
/// under `holds.enter` ([`copy`]).
fn piece<G, S>(
    side: &Side,
    at: u64,
    buf: usize,
    n: u64,
    store: bool,
    maps: &RegionMaps,
    holds: &Holds<impl Fn() -> Option<G>, impl Fn() -> S>,
) -> Result<(), ChunkError> {
    match side {
        Side::Process { process, addr, gate } => {
            // A stopped copy touches no more of the client's memory either.
            drop((holds.enter)().ok_or(ChunkError::Stopped)?);
            let _visit = (holds.visit)();
            let call = |pid| {
                if store { sys::vm_write(pid, buf, addr + at, n) } else { sys::vm_read(pid, buf, addr + at, n) }
            };
            remote(process, gate, call)?.map_err(|source| ChunkError::Move { at, len: n, source })
        }
        _ => {
            let _in = (holds.enter)().ok_or(ChunkError::Stopped)?;
            if store { with_buffer(side, at, buf, n, true, maps) } else { load(side, at, buf, n, maps) }
        }
    }
}

/// A chunk between two daemon-held sides, with the job's gate held by the caller.
fn between_daemon_sides(dst: &Side, src: &Side, offset: u64, len: u64, maps: &RegionMaps) -> Result<bool, ChunkError> {
    let moved = |source| ChunkError::Move { at: offset, len, source };
    // Two sides the daemon maps (registrations of memory files, regions by GFA): the CPU
    // copies between the mappings, once, at memcpy speed; a fault (a client shrank a file
    // under the copy) fails the chunk and nothing else.
    if cpu_reaches(dst) && cpu_reaches(src) && fault::ready() {
        let d = local(dst, offset, true, maps)?;
        let s = local(src, offset, false, maps)?;
        return cpu_recovering(d.addr, s.addr, offset, len);
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
    let d = local(dst, offset, true, maps)?;
    // A source the daemon holds a file of is read from the file's page cache straight
    // into the destination: one copy, and no mapping of the source to make.
    if let Some((file, off)) = file_of(src) {
        return sys::pread_into(file, d.addr, off + offset, len).map_err(moved).map(|()| false);
    }
    let s = local(src, offset, false, maps)?;
    sys::vm_read(sys::own_pid(), d.addr, s.addr as u64, len).map_err(moved).map(|()| false)
}
