//! A copy side's bytes to or from a daemon buffer: what a copy across nodes moves
//! (`crate::peer::copy`), one chunk at a time. Every access goes through the kernel
//! (`process_vm_readv`/`writev` on the daemon's own mapping or a client's memory,
//! `pread`/`pwrite` on a region file), so a file a client shrank under its registration
//! is an error, never a signal — but a region on device memory (a DAX device, a BAR),
//! whose file serves `mmap` only, is reached through its kept mapping
//! ([`RegionMaps`], the engine's), with the recovering CPU copy where there is one.

use std::os::unix::fs::FileExt;

use super::chunk::ChunkError;
use super::fault;
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
        Side::Process { process, addr } => process
            .with(|pid| sys::vm_read(pid, local, addr + offset, len))
            .map_err(|_| ChunkError::ProcessGone(process.pid()))?
            .map_err(moved(offset, len)),
        Side::File { device: true, .. } => on_device(side, offset, local, len, false, maps),
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
        Side::Process { process, addr } => process
            .with(|pid| sys::vm_write(pid, local, addr + offset, len))
            .map_err(|_| ChunkError::ProcessGone(process.pid()))?
            .map_err(moved(offset, len)),
        Side::File { writable: false, .. } => {
            Err(ChunkError::Move { at: offset, len, source: std::io::Error::from_raw_os_error(libc::EBADF) })
        }
        Side::File { device: true, .. } => on_device(side, offset, local, len, true, maps),
        Side::File { file, offset: o, .. } => file.write_all_at(buf, o + offset).map_err(moved(offset, len)),
    }
}

/// Moves `len` bytes between the daemon buffer at `local` and bytes `[offset, offset +
/// len)` of `side`, a region on device memory, through the region's kept mapping:
/// `store` writes the region.
fn on_device(
    side: &Side,
    offset: u64,
    local: usize,
    len: u64,
    store: bool,
    maps: &RegionMaps,
) -> Result<(), ChunkError> {
    let Side::File { file, offset: o, region, base, region_len, .. } = side else {
        return Err(moved(offset, len)(std::io::Error::from_raw_os_error(libc::EINVAL)));
    };
    let what = if store { "destination" } else { "source" };
    let m = maps.get(*region, file, *base, *region_len, store).map_err(|source| ChunkError::Map { what, source })?;
    let at = m.addr() + (o - base + offset) as usize;
    let (dst, src) = if store { (at, local) } else { (local, at) };
    if fault::ready() {
        let n =
            usize::try_from(len).map_err(|_| moved(offset, len)(std::io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
        // SAFETY: `at` lies in the region's mapping, held by `m` across the copy, `len`
        // bytes inside it (the endpoint was checked against the region's length when
        // resolved), mapped writable for a store; `local` is the caller's buffer of `len`
        // bytes, which no other reference reaches during the call; device memory is no
        // Rust object. A fault (the device went) is recovered into the error.
        return unsafe { fault::copy_recovering(dst as *mut u8, src as *const u8, n) }
            .map_err(|source| ChunkError::Fault { at: offset, len, source });
    }
    // Without the recovering copy the kernel moves the bytes (a DAX device's pages; a
    // BAR's are refused with EFAULT).
    sys::vm_read(sys::own_pid(), dst, src as u64, len).map_err(moved(offset, len))
}
