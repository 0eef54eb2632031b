//! A copy side's bytes to or from a daemon buffer: what a copy across nodes moves
//! (`crate::peer::copy`), one chunk at a time. Every access goes through the kernel
//! (`process_vm_readv`/`writev` on the daemon's own mapping or a client's memory,
//! `pread`/`pwrite` on a region file), so a file a client shrank under its registration
//! is an error, never a signal — but a region on device memory (a DAX device, a BAR),
//! whose file serves `mmap` only, is reached through its kept mapping
//! ([`RegionMaps`], the engine's), with the recovering CPU copy where there is one.
//! A client's memory is reached under its registration's gate
//! ([`crate::dma::ClientGate`]), which the caller then need not cover with its own.

use std::os::unix::fs::FileExt;

use super::chunk::{self, ChunkError};
use super::regionmap::RegionMaps;
use super::sys;
use crate::memory::Side;

fn moved(at: u64, len: u64) -> impl FnOnce(std::io::Error) -> ChunkError {
    move |source| ChunkError::Move { at, len, source }
}

/// Reads bytes `[offset, offset + buf.len())` of `side` into `buf`.
pub fn read(side: &Side, offset: u64, buf: &mut [u8], maps: &RegionMaps) -> Result<(), ChunkError> {
    let len = buf.len() as u64;
    let local = buf.as_mut_ptr() as usize;
    match side {
        Side::Pinned { map, base } => {
            let addr = map.as_ptr() as u64 + base + offset;
            sys::vm_read(sys::own_pid(), local, addr, len).map_err(moved(offset, len))
        }
        Side::Process { process, addr, gate } => {
            chunk::remote(process, gate, |pid| sys::vm_read(pid, local, addr + offset, len))?
                .map_err(moved(offset, len))
        }
        Side::File { device: true, .. } => chunk::with_buffer(side, offset, local, len, false, maps),
        Side::File { file, offset: o, .. } => file.read_exact_at(buf, o + offset).map_err(moved(offset, len)),
    }
}

/// Writes `buf` to bytes `[offset, offset + buf.len())` of `side`.
pub fn write(side: &Side, offset: u64, buf: &[u8], maps: &RegionMaps) -> Result<(), ChunkError> {
    let len = buf.len() as u64;
    let local = buf.as_ptr() as usize;
    match side {
        Side::Pinned { map, base } => {
            if !map.writable() {
                return Err(ChunkError::Move {
                    at: offset,
                    len,
                    source: std::io::Error::from_raw_os_error(libc::EBADF),
                });
            }
            let addr = map.as_ptr() as u64 + base + offset;
            sys::vm_write(sys::own_pid(), local, addr, len).map_err(moved(offset, len))
        }
        Side::Process { process, addr, gate } => {
            chunk::remote(process, gate, |pid| sys::vm_write(pid, local, addr + offset, len))?
                .map_err(moved(offset, len))
        }
        Side::File { writable: false, .. } => {
            Err(ChunkError::Move { at: offset, len, source: std::io::Error::from_raw_os_error(libc::EBADF) })
        }
        Side::File { device: true, .. } => chunk::with_buffer(side, offset, local, len, true, maps),
        Side::File { file, offset: o, .. } => file.write_all_at(buf, o + offset).map_err(moved(offset, len)),
    }
}
