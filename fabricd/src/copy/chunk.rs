//! One chunk of a copy: from a side's memory to the other's, by the kernel (see the
//! module above for which call moves which pair of sides), or by the CPU between two
//! mappings of memory that cannot shrink.

use std::os::fd::AsFd;
use std::sync::Arc;

use fabric_proto::wire::ErrorCode;

use super::BOUNCE;
use super::regionmap::RegionMaps;
use super::sys::{self, Mapping};
use crate::dma::sys::pidfd_alive;
use crate::memory::Side;

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
}

impl ChunkError {
    /// The code the copy's completion carries.
    pub fn code(&self) -> ErrorCode {
        match self {
            ChunkError::ProcessGone(_) => ErrorCode::NotFound,
            ChunkError::Map { .. } | ChunkError::Move { .. } => ErrorCode::Internal,
        }
    }
}

/// A side at one chunk: a daemon address, or a process address.
enum At {
    /// Daemon memory at this address.
    Local {
        addr: usize,
        /// The mapping, when the chunk made one (unmapped after the move) or took a
        /// region's kept one (held for the move).
        _map: Option<Arc<Mapping>>,
    },
    /// Process memory.
    Remote(i32, u64),
}

fn at(side: &Side, offset: u64, len: u64, write: bool, maps: &RegionMaps) -> Result<At, ChunkError> {
    let what = if write { "destination" } else { "source" };
    Ok(match side {
        Side::Pinned { map, base } => At::Local { addr: map.as_ptr() as usize + (base + offset) as usize, _map: None },
        // A destination region: its kept mapping (made by the first chunk into it).
        Side::File { file, offset: o, writable: true, region, region_len } if write => {
            let m = maps.get(*region, file, *region_len).map_err(|source| ChunkError::Map { what, source })?;
            At::Local { addr: m.addr() + (o + offset) as usize, _map: Some(m) }
        }
        Side::File { file, offset: o, .. } => {
            let m =
                Mapping::new(file, o + offset, len, false, true).map_err(|source| ChunkError::Map { what, source })?;
            At::Local { addr: m.addr(), _map: Some(Arc::new(m)) }
        }
        Side::Process { pid, pidfd, addr } => {
            if !pidfd_alive(pidfd.as_fd()) {
                return Err(ChunkError::ProcessGone(*pid));
            }
            At::Remote(*pid, addr + offset)
        }
    })
}

/// The file behind a daemon-held side and the file offset of its byte 0.
fn file_of(side: &Side) -> Option<(&std::fs::File, u64)> {
    match side {
        Side::Pinned { map, base } => Some((map.file(), map.offset() + base)),
        Side::File { file, offset, .. } => Some((file, *offset)),
        Side::Process { .. } => None,
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
    // Two pinned mappings of memory no one can shrink: no load or store can fault, so the
    // CPU copies, once, at memcpy speed.
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
    let d = at(dst, offset, len, true, maps)?;
    // A source the daemon holds a file of is read from the file's page cache straight
    // into the destination: one copy, and no mapping of the source to make.
    if let (At::Local { addr, .. }, Some((file, off))) = (&d, file_of(src)) {
        return sys::pread_into(file, *addr, off + offset, len).map_err(moved).map(|()| false);
    }
    let s = at(src, offset, len, false, maps)?;
    let r = match (&d, &s) {
        (At::Local { addr: d, .. }, At::Local { addr: s, .. }) => {
            sys::vm_read(sys::own_pid(), *d, *s as u64, len).map_err(moved)
        }
        (At::Local { addr: d, .. }, At::Remote(pid, s)) => sys::vm_read(*pid, *d, *s, len).map_err(moved),
        (At::Remote(pid, d), At::Local { addr: s, .. }) => sys::vm_write(*pid, *s, *d, len).map_err(moved),
        (At::Remote(dpid, d), At::Remote(spid, s)) => {
            bounce.resize(BOUNCE, 0);
            let buf = bounce.as_mut_ptr() as usize;
            let mut done = 0;
            while done < len {
                let n = (len - done).min(BOUNCE as u64);
                sys::vm_read(*spid, buf, s + done, n).map_err(moved)?;
                sys::vm_write(*dpid, buf, d + done, n).map_err(moved)?;
                done += n;
            }
            Ok(())
        }
    };
    r.map(|()| false)
}
