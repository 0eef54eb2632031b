//! fabricd's VFIO system interface (`linux/vfio.h`, type-1 v2 IOMMU): the container, the
//! group and the device through the `vfio-ioctls` crate, the device's regions, and
//! `VFIO_IOMMU_MAP_DMA`/`UNMAP_DMA`. Every `unsafe` block of the VFIO backend is here.
//!
//! What goes through `vfio-ioctls` (0.10, without its `kvm` feature):
//! - `VfioContainer::new` opens `/dev/vfio/vfio` and checks the API version and the type-1
//!   v2 extension; `VfioDevice::new` opens `/dev/vfio/N`, checks that the group is viable,
//!   attaches it to the container, sets the IOMMU type, takes the device descriptor
//!   (`VFIO_GROUP_GET_DEVICE_FD`) and reads every region's info
//!   (`VFIO_DEVICE_GET_REGION_INFO`), which [`Device::region`] hands out.
//! - Read-write DMA maps (`VfioContainer::vfio_dma_map`) and every unmap
//!   (`vfio_dma_unmap`, which also fails when the kernel unmapped fewer bytes than asked).
//!
//! What stays raw, and why:
//! - **Read-only maps.** `vfio_dma_map` always maps `READ | WRITE`: a registration the
//!   client made `ReadOnly` would be writable by the device. [`map_dma`] with `write`
//!   false issues `VFIO_IOMMU_MAP_DMA` with `READ` alone on the crate container's
//!   descriptor (`AsRawFd`); it is undone by the crate's unmap like any other mapping.
//! - **Region reads and writes.** `VfioDevice::region_read`/`region_write` return nothing:
//!   a failed or out-of-range access is a `log` warning and the buffer is left as it was,
//!   so a failed read of edu's busy bit would look like "done". [`Device::read_at`] and
//!   [`Device::write_at`] `pread`/`pwrite` the crate device's descriptor at the offsets its
//!   region info gives, and return the error.
//! - **Teardown.** The crate's `VfioDevice` drop closes the device, then reads the
//!   function's `iommu_group` link again and unwraps it (and the group lookup) to detach
//!   the group; a function removed meanwhile would panic there. [`Device`]'s drop runs it
//!   under `catch_unwind`, so that costs a warning, not the daemon (the group and the
//!   container close with their descriptors either way).
//!
//! The crate's panics on input were checked: its other `unwrap`s are integer widenings
//! (`usize`/pointer to `u64`) and lock poisoning; its device-name `CString::new(..)
//! .expect` cannot fail because [`open_device`] refuses a name with a NUL first. It
//! trusts the kernel's region capability chain (kernel data, not input).
//!
//! Differences from the raw calls this replaced: the container is type-1 v2 (the crate's
//! only choice; fabricd unmaps whole mappings, which is all v2 allows); the crate keeps the
//! region infos in a list by position and answers 0 for an index it lacks, so
//! [`Device::region`] requires a read-write region of non-zero size and the config region
//! must be 256 or 4096 bytes (edu's BAR 0 is then checked by its id register); the crate
//! logs through `log` (`main.rs` keeps its records below `error` out of fabricd's log:
//! it warns that a conventional PCI function has no error IRQ).
//!
//! One device per container: the crate's `put_group` assumes one device per group (it
//! detaches the group when the first device of it is dropped), so fabricd gives every taken
//! function a container of its own, as before; a second function of a group is refused
//! (its group is already open: `EBUSY`).

use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;

use vfio_ioctls::{VfioContainer, VfioDevice};

const VFIO_IOMMU_MAP_DMA: libc::c_ulong = 0x3b71;
const VFIO_DMA_MAP_FLAG_READ: u32 = 1;
/// `VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE`.
const REGION_READ_WRITE: u32 = 0x3;
/// Index of the PCI config space region.
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;
/// Sizes of PCI config space (conventional, extended).
const CONFIG_SIZES: [u64; 2] = [256, 4096];

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
    /// An ioctl (or the crate's call around it) failed.
    #[error("{call}")]
    Call {
        /// The request.
        call: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The kernel speaks another VFIO API or lacks the type-1 v2 IOMMU.
    #[error("{0}")]
    Unsupported(&'static str),
    /// A member of the group is bound to a host driver.
    #[error("IOMMU group {0} is not viable: another member is bound to a host driver")]
    NotViable(u32),
    /// The device has no such region, or not one that is read-write and large enough.
    #[error("device region {index} is missing, not read-write or too small (size {size:#x}, flags {flags:#x})")]
    NoRegion {
        /// The region index.
        index: u32,
        /// Its size as the kernel gave it (0: absent).
        size: u64,
        /// Its flags.
        flags: u32,
    },
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

/// Our error for the crate's, naming the operation.
fn from_crate(e: vfio_ioctls::VfioError) -> IoctlError {
    use vfio_ioctls::VfioError as E;
    let sys = |call, errno: i32| IoctlError::Call { call, source: io::Error::from_raw_os_error(errno) };
    let other = |call, e: E| IoctlError::Call { call, source: io::Error::other(e) };
    match e {
        E::OpenContainer(source) => IoctlError::Open { path: "/dev/vfio/vfio".into(), source },
        E::OpenGroup(source, n) => IoctlError::Open { path: format!("/dev/vfio/{n}"), source },
        E::VfioApiVersion => IoctlError::Unsupported("the kernel speaks another VFIO API version"),
        E::VfioExtension | E::VfioType1V2 | E::VfioInvalidType => {
            IoctlError::Unsupported("the kernel has no VFIO type-1 v2 IOMMU")
        }
        E::ContainerSetIOMMU(s) => sys("VFIO_SET_IOMMU", s.errno()),
        E::GroupGetDeviceFD(s) => sys("VFIO_GROUP_GET_DEVICE_FD", s.errno()),
        E::VfioDeviceGetInfo(s) => sys("VFIO_DEVICE_GET_INFO", s.errno()),
        E::VfioDeviceGetRegionInfo(s) => sys("VFIO_DEVICE_GET_REGION_INFO", s.errno()),
        E::IommuDmaMap(s) => sys("VFIO_IOMMU_MAP_DMA", s.errno()),
        E::IommuDmaUnmap(s) => sys("VFIO_IOMMU_UNMAP_DMA", s.errno()),
        e @ E::GetGroupStatus => other("VFIO_GROUP_GET_STATUS", e),
        e @ (E::GroupSetContainer | E::UnsetContainer) => other("VFIO_GROUP_SET_CONTAINER", e),
        e @ (E::VfioDeviceGetInfoPCI | E::VfioDeviceGetInfoOther) => other("VFIO_DEVICE_GET_INFO", e),
        e @ E::InvalidPath => other("reading the function's iommu_group link", e),
        e @ E::InvalidDmaUnmapSize => other("VFIO_IOMMU_UNMAP_DMA", e),
        e => other("VFIO", e),
    }
}

/// [`from_crate`] for opening group `group`: the crate's "not viable" names no group.
fn from_crate_open(e: vfio_ioctls::VfioError, group: u32) -> IoctlError {
    match e {
        vfio_ioctls::VfioError::GroupViable => IoctlError::NotViable(group),
        e => from_crate(e),
    }
}

#[repr(C)]
struct DmaMap {
    argsz: u32,
    flags: u32,
    vaddr: u64,
    iova: u64,
    size: u64,
}

/// A region of a device: where it is in the device descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Offset in the device descriptor.
    pub offset: u64,
    /// Bytes.
    pub size: u64,
    /// `VFIO_REGION_INFO_FLAG_*`.
    pub flags: u32,
}

/// A VFIO device descriptor: the crate's `VfioDevice`, whose regions it read when opened.
pub struct Device {
    inner: ManuallyDrop<VfioDevice>,
    bdf: String,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("bdf", &self.bdf).field("fd", &self.inner.as_raw_fd()).finish()
    }
}

impl Device {
    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the crate's VfioDevice owns this descriptor and closes it only when it is
        // dropped, in `Device::drop`, after every borrow of `self` has ended.
        unsafe { BorrowedFd::borrow_raw(self.inner.as_raw_fd()) }
    }

    /// Region `index`, from the region info the crate read; it must be readable and
    /// writable and not empty.
    pub fn region(&self, index: u32) -> Result<Region, IoctlError> {
        let flags = self.inner.get_region_flags(index);
        // The crate logs a warning for the size of a region it does not have: ask only for
        // one it has (flags 0 is what it answers for an index it has not).
        let size = if flags == 0 { 0 } else { self.inner.get_region_size(index) };
        if flags & REGION_READ_WRITE != REGION_READ_WRITE || size == 0 {
            return Err(IoctlError::NoRegion { index, size, flags });
        }
        Ok(Region { offset: self.inner.get_region_offset(index), size, flags })
    }

    /// Reads `buf.len()` bytes at `offset` in the device descriptor.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let n = nix::sys::uio::pread(self.fd(), buf, off(offset)?)?;
        if n == buf.len() { Ok(()) } else { Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short region read")) }
    }

    /// Writes `buf` at `offset` in the device descriptor.
    pub fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let n = nix::sys::uio::pwrite(self.fd(), buf, off(offset)?)?;
        if n == buf.len() { Ok(()) } else { Err(io::Error::new(io::ErrorKind::WriteZero, "short region write")) }
    }
}

fn off(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and never used again.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        // The crate's drop closes the device, then unwraps a read of the function's
        // `iommu_group` link to detach the group (module docs).
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(inner))).is_err() {
            tracing::warn!(
                bdf = self.bdf,
                "VFIO device closed, but vfio-ioctls panicked detaching its group (was the function removed?); the group is released with its descriptor"
            );
        }
    }
}

/// A type-1 v2 container holding one group, and the device taken from it.
pub struct Opened {
    /// The container (the device holds it too, and detaches its group on drop).
    pub container: Arc<VfioContainer>,
    /// The device.
    pub device: Device,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened").field("container", &self.container.as_raw_fd()).field("device", &self.device).finish()
    }
}

/// Opens `/dev/vfio/vfio` and the group of the function whose sysfs directory is
/// `sysfs_dir` (its `iommu_group` link names the group, `group` as the bind found it),
/// attaches the group to a new type-1 v2 container and takes the device `bdf`.
pub fn open_device(sysfs_dir: &Path, group: u32, bdf: &str) -> Result<Opened, IoctlError> {
    // The crate names the device by the directory's name and `expect`s it to have no NUL.
    if bdf.contains('\0') {
        return Err(IoctlError::Unsupported("a PCI address with a NUL byte"));
    }
    if sysfs_dir.file_name() != Some(bdf.as_ref()) {
        return Err(IoctlError::Unsupported("the function's sysfs directory is not named for it"));
    }
    let container = Arc::new(VfioContainer::new(None).map_err(|e| from_crate_open(e, group))?);
    let inner = VfioDevice::new(sysfs_dir, container.clone(), false).map_err(|e| from_crate_open(e, group))?;
    Ok(Opened { container, device: Device { inner: ManuallyDrop::new(inner), bdf: bdf.to_owned() } })
}

/// Turns bus mastering (and memory decoding) on through the config region: `vfio-pci`
/// leaves it off, and a device without it issues no DMA.
pub fn enable_bus_master(device: &Device) -> Result<(), IoctlError> {
    let cfg = device.region(VFIO_PCI_CONFIG_REGION_INDEX)?;
    // The crate keeps the regions in a list by position, leaving out any whose info the
    // kernel refused: a "config region" of another size would be another region.
    if !CONFIG_SIZES.contains(&cfg.size) {
        return Err(IoctlError::NoRegion { index: VFIO_PCI_CONFIG_REGION_INDEX, size: cfg.size, flags: cfg.flags });
    }
    let at = cfg.offset + 4;
    let mut cmd = [0u8; 2];
    device.read_at(&mut cmd, at).map_err(|source| IoctlError::Region { offset: at, source })?;
    let v = u16::from_le_bytes(cmd) | 0x6;
    device.write_at(&v.to_le_bytes(), at).map_err(|source| IoctlError::Region { offset: at, source })
}

/// Maps `size` bytes of this process at `vaddr` at `iova` for the device: read-write
/// through the crate when `write`, else read-only (raw: the crate maps only read-write).
///
/// # Safety
/// `[vaddr, vaddr + size)` must stay mapped (and, being pinned by the kernel, resident)
/// until [`unmap_dma`] of the same range; while mapped the device may read it and, when
/// `write`, write it at any time, so no Rust reference to those bytes may be live (the
/// contract of `VfioContainer::vfio_dma_map`).
pub unsafe fn map_dma(
    container: &VfioContainer,
    vaddr: *mut u8,
    iova: u64,
    size: u64,
    write: bool,
) -> Result<(), IoctlError> {
    if write {
        let len = usize::try_from(size).map_err(|_| IoctlError::Unsupported("a DMA range beyond usize"))?;
        // SAFETY: the caller upholds vfio_dma_map's contract (this function's).
        return unsafe { container.vfio_dma_map(iova, len, vaddr) }.map_err(from_crate);
    }
    let m =
        DmaMap { argsz: size_of::<DmaMap>() as u32, flags: VFIO_DMA_MAP_FLAG_READ, vaddr: vaddr as u64, iova, size };
    // SAFETY: `m` is a live vfio_iommu_type1_dma_map (argsz set) for the whole call, which
    // only reads it; the descriptor is the crate container's, open while `container` is
    // borrowed. The range's validity is the caller's; mapped READ alone, the device can
    // read it and never write it.
    let r = unsafe { libc::ioctl(container.as_raw_fd(), VFIO_IOMMU_MAP_DMA, &raw const m) };
    if r < 0 {
        return Err(IoctlError::Call { call: "VFIO_IOMMU_MAP_DMA", source: io::Error::last_os_error() });
    }
    Ok(())
}

/// Removes the mapping of `[iova, iova + size)` (read-write or read-only alike); fails
/// when the kernel removed fewer bytes.
pub fn unmap_dma(container: &VfioContainer, iova: u64, size: u64) -> Result<(), IoctlError> {
    let len = usize::try_from(size).map_err(|_| IoctlError::Unsupported("a DMA range beyond usize"))?;
    container.vfio_dma_unmap(iova, len).map_err(from_crate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vfio_ioctls::VfioError as E;

    fn chain(e: &IoctlError) -> String {
        crate::error_chain(e)
    }

    #[test]
    fn crate_errors_become_typed_errors_that_name_the_operation() {
        let busy = E::OpenGroup(io::Error::from_raw_os_error(libc::EBUSY), "5".into());
        let e = from_crate_open(busy, 5);
        assert!(matches!(&e, IoctlError::Open { path, .. } if path == "/dev/vfio/5"), "{e:?}");
        assert!(chain(&e).contains("Device or resource busy"), "{}", chain(&e));
        assert!(matches!(from_crate_open(E::GroupViable, 7), IoctlError::NotViable(7)));
        let e = from_crate_open(E::OpenContainer(io::Error::from_raw_os_error(libc::ENOENT)), 1);
        assert!(matches!(&e, IoctlError::Open { path, .. } if path == "/dev/vfio/vfio"), "{e:?}");
        assert!(matches!(from_crate_open(E::VfioApiVersion, 1), IoctlError::Unsupported(_)));
        assert!(matches!(from_crate_open(E::VfioExtension, 1), IoctlError::Unsupported(m) if m.contains("type-1 v2")));
        let e = from_crate(E::GetGroupStatus);
        assert!(matches!(e, IoctlError::Call { call: "VFIO_GROUP_GET_STATUS", .. }));
        let e = from_crate(E::InvalidDmaUnmapSize);
        assert!(matches!(&e, IoctlError::Call { call: "VFIO_IOMMU_UNMAP_DMA", .. }), "{e:?}");
        assert!(chain(&e).contains("invalid dma unmap size"), "{}", chain(&e));
    }

    #[test]
    fn a_name_the_crate_would_panic_on_is_refused_before_it() {
        let dir = Path::new("/nonexistent/sys/bus/pci/devices/0000:00:04.0");
        let e = open_device(dir, 3, "0000:00\0:04.0").expect_err("NUL");
        assert!(matches!(e, IoctlError::Unsupported(m) if m.contains("NUL")));
        let e = open_device(dir, 3, "0000:00:05.0").expect_err("another name");
        assert!(matches!(e, IoctlError::Unsupported(_)));
    }
}
