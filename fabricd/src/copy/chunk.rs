//! One chunk of a copy: from a side's memory to the other's, by the kernel (see the
//! module above for which call moves which pair of sides).

use std::os::fd::AsFd;

use fabric_proto::wire::ErrorCode;

use super::BOUNCE;
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
        /// The chunk's own mapping, when it made one: unmapped after the move.
        _map: Option<Mapping>,
    },
    /// Process memory.
    Remote(i32, u64),
}

fn at(side: &Side, offset: u64, len: u64, write: bool) -> Result<At, ChunkError> {
    let what = if write { "destination" } else { "source" };
    Ok(match side {
        Side::Pinned { map, base } => At::Local { addr: map.as_ptr() as usize + (base + offset) as usize, _map: None },
        Side::File { file, offset: o, writable } => {
            let m = Mapping::new(file, o + offset, len, *writable && write)
                .map_err(|source| ChunkError::Map { what, source })?;
            At::Local { addr: m.addr(), _map: Some(m) }
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
/// is the engine's buffer for process-to-process copies.
pub fn copy(dst: &Side, src: &Side, offset: u64, len: u64, bounce: &mut Vec<u8>) -> Result<(), ChunkError> {
    let moved = |source| ChunkError::Move { at: offset, len, source };
    let d = at(dst, offset, len, true)?;
    // A source the daemon holds a file of is read from the file's page cache straight
    // into the destination: one copy, and no mapping of the source to make.
    if let (At::Local { addr, .. }, Some((file, off))) = (&d, file_of(src)) {
        return sys::pread_into(file, *addr, off + offset, len).map_err(moved);
    }
    let s = at(src, offset, len, false)?;
    match (&d, &s) {
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
    }
}
