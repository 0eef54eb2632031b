//! Direct mappings of device memory that the kernel exposes as a file: a CXL region's
//! device-DAX node (`/dev/daxX.Y`) or a PCI BAR (`/sys/bus/pci/devices/BDF/resourceN`).
//!
//! The mapping is shared, so stores reach the device (and whoever else maps the same
//! memory: another process, another guest on an ivshmem BAR, the host behind an emulated
//! device). Device memory is only reached through [`DeviceMapping::read`] and
//! [`DeviceMapping::write`], which use volatile accesses; no Rust reference to it is handed
//! out. The mapping is undone on drop.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// Why a device mapping failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceMapError {
    /// The device file could not be opened.
    #[error("opening {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `mmap` refused (length not a multiple of the device's alignment, beyond its end...).
    #[error("mapping {len:#x} bytes of {path}")]
    Map {
        /// The file.
        path: PathBuf,
        /// Bytes asked for.
        len: usize,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An access beyond the mapping.
    #[error("{len:#x} bytes at {offset:#x} run past the {size:#x}-byte mapping")]
    OutOfRange {
        /// Start of the access.
        offset: usize,
        /// Its length.
        len: usize,
        /// The mapping's length.
        size: usize,
    },
}

/// A shared, read-write mapping of `len` bytes of a device file.
#[derive(Debug)]
pub struct DeviceMapping {
    ptr: NonNull<u8>,
    len: usize,
    path: PathBuf,
}

// SAFETY: the mapping is plain shared memory owned by this value; every access is a bounded
// volatile read or write through a raw pointer, which any thread may do.
unsafe impl Send for DeviceMapping {}
// SAFETY: as above: &self methods only do volatile accesses, racing stores are the caller's
// protocol (as with any shared memory), never undefined behaviour of a Rust reference.
unsafe impl Sync for DeviceMapping {}

impl DeviceMapping {
    /// Maps the first `len` bytes of `path` (a DAX device wants `len` aligned to its
    /// `align`, usually 2 MiB; a BAR at most the BAR's size).
    pub fn open(path: &Path, len: usize) -> Result<Self, DeviceMapError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| DeviceMapError::Open { path: path.to_path_buf(), source })?;
        // SAFETY: a new shared mapping chosen by the kernel (no address hint), over a file we
        // hold open for the call; it replaces no existing mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(DeviceMapError::Map { path: path.to_path_buf(), len, source: std::io::Error::last_os_error() });
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| DeviceMapError::Map {
            path: path.to_path_buf(),
            len,
            source: std::io::Error::other("mmap returned NULL"),
        })?;
        tracing::debug!(path = %path.display(), len, "device memory mapped");
        Ok(DeviceMapping { ptr, len, path: path.to_path_buf() })
    }

    /// Maps a CXL region's device-DAX node by its name (`dax0.0`, as fabricd's topology
    /// lists it under the region), under `dev` (`/dev` on a live host).
    pub fn cxl_dax(dev: &Path, name: &str, len: usize) -> Result<Self, DeviceMapError> {
        Self::open(&dev.join(name), len)
    }

    /// Maps BAR `bar` of the PCI function `address` (`0000:00:01.0`) through its sysfs
    /// `resourceN` file under `sysfs_root` (`/` on a live host).
    pub fn pci_bar(sysfs_root: &Path, address: &str, bar: u8, len: usize) -> Result<Self, DeviceMapError> {
        Self::open(&sysfs_root.join("sys/bus/pci/devices").join(address).join(format!("resource{bar}")), len)
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is mapped (never: `mmap` refuses a zero length).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file mapped.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mapping's base, for callers that hand it to their own volatile or DMA code.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), DeviceMapError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(DeviceMapError::OutOfRange { offset, len, size: self.len }),
        }
    }

    /// Stores `src` at `offset`: aligned 8-byte volatile stores where possible, bytes
    /// elsewhere (devices behind PCI or CXL see whole words, never torn ones).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), DeviceMapError> {
        self.check(offset, src.len())?;
        let mut i = 0;
        while i < src.len() {
            // SAFETY: offset + i < offset + src.len() <= self.len (checked above).
            let p = unsafe { self.ptr.as_ptr().add(offset + i) };
            if (p as usize).is_multiple_of(8) && src.len() - i >= 8 {
                let mut w = [0u8; 8];
                w.copy_from_slice(&src[i..i + 8]);
                // SAFETY: p is 8-byte aligned and p..p+8 lies inside the mapping.
                unsafe { p.cast::<u64>().write_volatile(u64::from_ne_bytes(w)) };
                i += 8;
            } else {
                // SAFETY: p lies inside the mapping.
                unsafe { p.write_volatile(src[i]) };
                i += 1;
            }
        }
        Ok(())
    }

    /// Loads `dst.len()` bytes from `offset`, with the same access sizes as [`Self::write`].
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), DeviceMapError> {
        self.check(offset, dst.len())?;
        let mut i = 0;
        while i < dst.len() {
            // SAFETY: offset + i < offset + dst.len() <= self.len (checked above).
            let p = unsafe { self.ptr.as_ptr().add(offset + i) };
            if (p as usize).is_multiple_of(8) && dst.len() - i >= 8 {
                // SAFETY: p is 8-byte aligned and p..p+8 lies inside the mapping.
                let w = unsafe { p.cast::<u64>().read_volatile() };
                dst[i..i + 8].copy_from_slice(&w.to_ne_bytes());
                i += 8;
            } else {
                // SAFETY: p lies inside the mapping.
                dst[i] = unsafe { p.read_volatile() };
                i += 1;
            }
        }
        Ok(())
    }
}

impl Drop for DeviceMapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in open(); no reference into it exists
        // (accesses only ever went through raw pointers inside &self methods).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_reach_the_file_and_loads_see_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bar");
        std::fs::write(&path, vec![0u8; 8192]).expect("file");
        let m = DeviceMapping::open(&path, 8192).expect("map");
        let data: Vec<u8> = (0..100u8).collect();
        m.write(4093, &data).expect("write");
        let mut back = vec![0u8; 100];
        m.read(4093, &mut back).expect("read");
        assert_eq!(back, data);
        drop(m);
        let file = std::fs::read(&path).expect("read file");
        assert_eq!(&file[4093..4193], &data[..]);
        assert!(file[..4093].iter().all(|&b| b == 0));
    }

    #[test]
    fn out_of_range_and_missing_files_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("bar");
        std::fs::write(&path, vec![0u8; 4096]).expect("file");
        let m = DeviceMapping::open(&path, 4096).expect("map");
        assert!(matches!(m.write(4090, &[0; 8]), Err(DeviceMapError::OutOfRange { .. })));
        assert!(matches!(m.read(usize::MAX, &mut [0; 2]), Err(DeviceMapError::OutOfRange { .. })));
        assert!(matches!(
            DeviceMapping::pci_bar(dir.path(), "0000:00:01.0", 2, 4096),
            Err(DeviceMapError::Open { .. })
        ));
    }
}
