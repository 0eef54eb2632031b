//! The VFIO ioctls fabricd uses (`linux/vfio.h`, type-1 IOMMU): the container, the
//! group, the device descriptor with its regions, and `VFIO_IOMMU_MAP_DMA`/`UNMAP_DMA`.
//! Every `unsafe` block of the VFIO backend is here.
//!
//! Raw ioctls rather than the `vfio-ioctls` crate (0.10): its `VfioContainer::vfio_dma_map`
//! always maps `READ | WRITE`, which would let the device write a registration the client
//! made `ReadOnly`; here the flags follow the registration's access. (Its `kvm` default
//! feature would be turned off with `default-features = false`; that is not the obstacle.)

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

const VFIO_GET_API_VERSION: libc::c_ulong = 0x3b64;
const VFIO_CHECK_EXTENSION: libc::c_ulong = 0x3b65;
const VFIO_SET_IOMMU: libc::c_ulong = 0x3b66;
const VFIO_GROUP_GET_STATUS: libc::c_ulong = 0x3b67;
const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = 0x3b68;
const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = 0x3b6a;
const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = 0x3b6c;
const VFIO_IOMMU_MAP_DMA: libc::c_ulong = 0x3b71;
const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = 0x3b72;
const VFIO_API_VERSION: i32 = 0;
const VFIO_TYPE1_IOMMU: libc::c_ulong = 1;
const VFIO_GROUP_FLAGS_VIABLE: u32 = 1;
const VFIO_DMA_MAP_FLAG_READ: u32 = 1;
const VFIO_DMA_MAP_FLAG_WRITE: u32 = 2;
/// Index of the PCI config space region.
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;

/// Why a VFIO call failed.
#[derive(Debug, thiserror::Error)]
pub enum IoctlError {
    /// A VFIO node could not be opened.
    #[error("open {path}")]
    Open {
        /// The node.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An ioctl failed.
    #[error("{call}")]
    Call {
        /// The request.
        call: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The kernel speaks another VFIO API or lacks the type-1 IOMMU.
    #[error("{0}")]
    Unsupported(&'static str),
    /// A member of the group is bound to a host driver.
    #[error("IOMMU group {0} is not viable: another member is bound to a host driver")]
    NotViable(u32),
    /// A region access failed.
    #[error("device region access at {offset:#x}")]
    Region {
        /// Offset in the device descriptor.
        offset: u64,
        /// Why.
        #[source]
        source: io::Error,
    },
}

#[repr(C)]
struct GroupStatus {
    argsz: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct RegionInfo {
    argsz: u32,
    flags: u32,
    index: u32,
    cap_offset: u32,
    size: u64,
    offset: u64,
}

#[repr(C)]
struct DmaMap {
    argsz: u32,
    flags: u32,
    vaddr: u64,
    iova: u64,
    size: u64,
}

#[repr(C)]
struct DmaUnmap {
    argsz: u32,
    flags: u32,
    iova: u64,
    size: u64,
}

/// Issues `req` on `fd`.
///
/// # Safety
/// `arg` must be what `req` defines: an integer, or the address of a live, correctly laid
/// out `#[repr(C)]` struct (with `argsz` set) that outlives the call.
unsafe fn ioctl(fd: &File, req: libc::c_ulong, arg: libc::c_ulong, call: &'static str) -> Result<i32, IoctlError> {
    // SAFETY: the caller guarantees `arg` matches `req` (this function's contract).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req, arg) };
    if r < 0 { Err(IoctlError::Call { call, source: io::Error::last_os_error() }) } else { Ok(r) }
}

fn open(path: &Path) -> Result<File, IoctlError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| IoctlError::Open { path: path.display().to_string(), source })
}

/// A type-1 container holding one group, and the device taken from it.
#[derive(Debug)]
pub struct Opened {
    /// `/dev/vfio/vfio`, set to the type-1 IOMMU.
    pub container: File,
    /// `/dev/vfio/N` (kept open: closing it detaches the container).
    pub group: File,
    /// The device descriptor.
    pub device: File,
}

/// Opens `/dev/vfio/vfio` and `dev_root/N`, attaches the group to a type-1 container and
/// takes the device `bdf`.
pub fn open_device(dev_root: &Path, group_no: u32, bdf: &str) -> Result<Opened, IoctlError> {
    let container = open(&dev_root.join("vfio"))?;
    // SAFETY: VFIO_GET_API_VERSION takes no argument.
    if unsafe { ioctl(&container, VFIO_GET_API_VERSION, 0, "VFIO_GET_API_VERSION") }? != VFIO_API_VERSION {
        return Err(IoctlError::Unsupported("the kernel speaks another VFIO API version"));
    }
    // SAFETY: VFIO_CHECK_EXTENSION takes the extension number by value.
    if unsafe { ioctl(&container, VFIO_CHECK_EXTENSION, VFIO_TYPE1_IOMMU, "VFIO_CHECK_EXTENSION") }? != 1 {
        return Err(IoctlError::Unsupported("the kernel has no VFIO type-1 IOMMU"));
    }
    let group = open(&dev_root.join(group_no.to_string()))?;
    let mut status = GroupStatus { argsz: size_of::<GroupStatus>() as u32, flags: 0 };
    // SAFETY: `status` is a live vfio_group_status with argsz set; the kernel writes flags.
    unsafe {
        ioctl(&group, VFIO_GROUP_GET_STATUS, &raw mut status as libc::c_ulong, "VFIO_GROUP_GET_STATUS")?;
    }
    if status.flags & VFIO_GROUP_FLAGS_VIABLE == 0 {
        return Err(IoctlError::NotViable(group_no));
    }
    let cfd: i32 = container.as_raw_fd();
    // SAFETY: VFIO_GROUP_SET_CONTAINER reads an int (the container descriptor) at the address.
    unsafe {
        ioctl(&group, VFIO_GROUP_SET_CONTAINER, &raw const cfd as libc::c_ulong, "VFIO_GROUP_SET_CONTAINER")?;
    }
    // SAFETY: VFIO_SET_IOMMU takes the IOMMU type by value.
    unsafe { ioctl(&container, VFIO_SET_IOMMU, VFIO_TYPE1_IOMMU, "VFIO_SET_IOMMU") }?;
    let name = CString::new(bdf).map_err(|_| IoctlError::Unsupported("a PCI address with a NUL byte"))?;
    // SAFETY: VFIO_GROUP_GET_DEVICE_FD reads a NUL-terminated name, alive for the call.
    let fd =
        unsafe { ioctl(&group, VFIO_GROUP_GET_DEVICE_FD, name.as_ptr() as libc::c_ulong, "VFIO_GROUP_GET_DEVICE_FD") }?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    let device = unsafe { File::from_raw_fd(fd) };
    Ok(Opened { container, group, device })
}

/// Offset and size of region `index` in the device descriptor.
pub fn region(device: &File, index: u32) -> Result<(u64, u64), IoctlError> {
    let mut r = RegionInfo { argsz: size_of::<RegionInfo>() as u32, index, ..Default::default() };
    // SAFETY: `r` is a live vfio_region_info with argsz and index set; the kernel fills it.
    unsafe {
        ioctl(device, VFIO_DEVICE_GET_REGION_INFO, &raw mut r as libc::c_ulong, "VFIO_DEVICE_GET_REGION_INFO")?;
    }
    Ok((r.offset, r.size))
}

/// Turns bus mastering (and memory decoding) on through the config region: `vfio-pci`
/// leaves it off, and a device without it issues no DMA.
pub fn enable_bus_master(device: &File) -> Result<(), IoctlError> {
    let (cfg, _) = region(device, VFIO_PCI_CONFIG_REGION_INDEX)?;
    let mut cmd = [0u8; 2];
    device.read_exact_at(&mut cmd, cfg + 4).map_err(|source| IoctlError::Region { offset: cfg + 4, source })?;
    let v = u16::from_le_bytes(cmd) | 0x6;
    device.write_all_at(&v.to_le_bytes(), cfg + 4).map_err(|source| IoctlError::Region { offset: cfg + 4, source })
}

/// Maps `size` bytes of this process at `vaddr` at `iova` for the device (read, and write
/// when `write`).
///
/// # Safety
/// `[vaddr, vaddr + size)` must stay mapped (and, being pinned by the kernel, resident)
/// until [`unmap_dma`] of the same range; while mapped the device may read it and, when
/// `write`, write it at any time, so no Rust reference to those bytes may be live.
pub unsafe fn map_dma(container: &File, vaddr: u64, iova: u64, size: u64, write: bool) -> Result<(), IoctlError> {
    let flags = VFIO_DMA_MAP_FLAG_READ | if write { VFIO_DMA_MAP_FLAG_WRITE } else { 0 };
    let m = DmaMap { argsz: size_of::<DmaMap>() as u32, flags, vaddr, iova, size };
    // SAFETY: `m` is a live vfio_iommu_type1_dma_map; the range's validity is the caller's.
    unsafe { ioctl(container, VFIO_IOMMU_MAP_DMA, &raw const m as libc::c_ulong, "VFIO_IOMMU_MAP_DMA") }.map(drop)
}

/// Removes the mapping of `[iova, iova + size)`.
pub fn unmap_dma(container: &File, iova: u64, size: u64) -> Result<(), IoctlError> {
    let mut u = DmaUnmap { argsz: size_of::<DmaUnmap>() as u32, flags: 0, iova, size };
    // SAFETY: `u` is a live vfio_iommu_type1_dma_unmap; the kernel writes back the size.
    unsafe { ioctl(container, VFIO_IOMMU_UNMAP_DMA, &raw mut u as libc::c_ulong, "VFIO_IOMMU_UNMAP_DMA") }.map(drop)
}
