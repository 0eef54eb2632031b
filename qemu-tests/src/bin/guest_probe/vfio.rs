//! `fabric-guest-probe edu-dma BDF GROUP`: the VFIO type-1 path of QEMU's `edu` device behind
//! the emulated intel-iommu, driven directly: container, group, device, two buffers mapped
//! at IOVAs inside edu's 28-bit DMA mask, a DMA round trip RAM → edu → RAM, then the second
//! buffer unmapped and a DMA to its IOVA, which the IOMMU must block (the kernel logs the
//! fault; the guest script checks dmesg). Every ioctl goes through this module.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

const VFIO_GET_API_VERSION: libc::c_ulong = 0x3b64;
const VFIO_CHECK_EXTENSION: libc::c_ulong = 0x3b65;
const VFIO_SET_IOMMU: libc::c_ulong = 0x3b66;
const VFIO_GROUP_GET_STATUS: libc::c_ulong = 0x3b67;
const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = 0x3b68;
const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = 0x3b6a;
const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = 0x3b6c;
const VFIO_IOMMU_MAP_DMA: libc::c_ulong = 0x3b71;
const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = 0x3b72;
const VFIO_TYPE1_IOMMU: libc::c_ulong = 1;
const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;

/// edu's registers (QEMU docs/specs/edu.rst) and its DMA buffer.
const EDU_DMA_SRC: u64 = 0x80;
const EDU_DMA_DST: u64 = 0x88;
const EDU_DMA_COUNT: u64 = 0x90;
const EDU_DMA_CMD: u64 = 0x98;
const EDU_BUFFER: u64 = 0x40000;
const CMD_START: u64 = 1;
const CMD_TO_RAM: u64 = 2;

/// IOVAs of the two buffers, well inside edu's 28-bit DMA mask.
pub const IOVA_SRC: u64 = 0x10_0000;
/// See [`IOVA_SRC`].
pub const IOVA_DST: u64 = 0x20_0000;
const LEN: usize = 4096;

#[repr(C)]
#[derive(Default)]
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

fn ioctl(fd: &File, req: libc::c_ulong, arg: libc::c_ulong, what: &str) -> Result<libc::c_int, String> {
    // SAFETY: each caller passes a VFIO request with the argument it defines: an integer,
    // or the address of a live, correctly laid out #[repr(C)] struct with argsz set.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req, arg) };
    if r < 0 { Err(format!("{what}: {}", std::io::Error::last_os_error())) } else { Ok(r) }
}

/// An anonymous, page-aligned buffer the device reaches by DMA.
struct DmaBuffer {
    ptr: *mut u8,
}

impl DmaBuffer {
    fn new() -> Result<Self, String> {
        // SAFETY: a fresh anonymous private mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(DmaBuffer { ptr: p.cast() })
    }

    fn fill(&self, f: impl Fn(usize) -> u8) {
        for i in 0..LEN {
            // SAFETY: i < LEN, inside the mapping; the device is idle (no DMA in flight).
            unsafe { self.ptr.add(i).write_volatile(f(i)) };
        }
    }

    fn get(&self, i: usize) -> u8 {
        // SAFETY: as in fill; read while no DMA is in flight.
        unsafe { self.ptr.add(i).read_volatile() }
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in new(); nothing refers to it any more.
        unsafe { libc::munmap(self.ptr.cast(), LEN) };
    }
}

struct Edu {
    dev: File,
    bar0: u64,
}

impl Edu {
    fn write(&self, reg: u64, v: u64) -> Result<(), String> {
        self.dev.write_all_at(&v.to_le_bytes(), self.bar0 + reg).map_err(|e| format!("edu write {reg:#x}: {e}"))
    }

    fn read(&self, reg: u64) -> Result<u64, String> {
        let mut b = [0u8; 8];
        self.dev.read_exact_at(&mut b, self.bar0 + reg).map_err(|e| format!("edu read {reg:#x}: {e}"))?;
        Ok(u64::from_le_bytes(b))
    }

    /// Runs one DMA and waits for edu to clear its busy bit.
    fn dma(&self, src: u64, dst: u64, cmd: u64) -> Result<(), String> {
        self.write(EDU_DMA_SRC, src)?;
        self.write(EDU_DMA_DST, dst)?;
        self.write(EDU_DMA_COUNT, LEN as u64)?;
        self.write(EDU_DMA_CMD, cmd | CMD_START)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.read(EDU_DMA_CMD)? & CMD_START != 0 {
            if Instant::now() > deadline {
                return Err("edu DMA did not finish in 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

fn open(path: &str) -> Result<File, String> {
    OpenOptions::new().read(true).write(true).open(path).map_err(|e| format!("open {path}: {e}"))
}

fn map(container: &File, buf: &DmaBuffer, iova: u64) -> Result<(), String> {
    let m = DmaMap { argsz: size_of::<DmaMap>() as u32, flags: 3, vaddr: buf.ptr as u64, iova, size: LEN as u64 };
    ioctl(container, VFIO_IOMMU_MAP_DMA, &m as *const DmaMap as libc::c_ulong, "VFIO_IOMMU_MAP_DMA").map(drop)
}

/// The whole sequence; each step prints one line for the guest script.
#[allow(clippy::print_stdout)] // The probe's report, read by the guest script.
pub fn edu_dma(bdf: &str, group: &str) -> Result<(), String> {
    let container = open("/dev/vfio/vfio")?;
    if ioctl(&container, VFIO_GET_API_VERSION, 0, "VFIO_GET_API_VERSION")? != 0 {
        return Err("unexpected VFIO API version".into());
    }
    if ioctl(&container, VFIO_CHECK_EXTENSION, VFIO_TYPE1_IOMMU, "VFIO_CHECK_EXTENSION")? != 1 {
        return Err("no type-1 IOMMU support".into());
    }
    let group = open(&format!("/dev/vfio/{group}"))?;
    let mut status = GroupStatus { argsz: size_of::<GroupStatus>() as u32, flags: 0 };
    ioctl(&group, VFIO_GROUP_GET_STATUS, &mut status as *mut GroupStatus as libc::c_ulong, "VFIO_GROUP_GET_STATUS")?;
    if status.flags & 1 == 0 {
        return Err("the group is not viable (a member is bound to a host driver)".into());
    }
    let cfd = container.as_raw_fd();
    ioctl(&group, VFIO_GROUP_SET_CONTAINER, &cfd as *const i32 as libc::c_ulong, "VFIO_GROUP_SET_CONTAINER")?;
    ioctl(&container, VFIO_SET_IOMMU, VFIO_TYPE1_IOMMU, "VFIO_SET_IOMMU")?;
    let name = std::ffi::CString::new(bdf).map_err(|_| "bad BDF".to_owned())?;
    let fd = ioctl(&group, VFIO_GROUP_GET_DEVICE_FD, name.as_ptr() as libc::c_ulong, "VFIO_GROUP_GET_DEVICE_FD")?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    let dev = unsafe { File::from_raw_fd(fd) };
    let region = |index: u32| -> Result<RegionInfo, String> {
        let mut r = RegionInfo { argsz: size_of::<RegionInfo>() as u32, index, ..Default::default() };
        ioctl(
            &dev,
            VFIO_DEVICE_GET_REGION_INFO,
            &mut r as *mut RegionInfo as libc::c_ulong,
            "VFIO_DEVICE_GET_REGION_INFO",
        )?;
        Ok(r)
    };
    let bar0 = region(0)?.offset;
    // Bus mastering on, through the config-space region (vfio-pci leaves it off).
    let cfg = region(VFIO_PCI_CONFIG_REGION_INDEX)?.offset;
    let mut cmd = [0u8; 2];
    dev.read_exact_at(&mut cmd, cfg + 4).map_err(|e| format!("config read: {e}"))?;
    let v = u16::from_le_bytes(cmd) | 0x6;
    dev.write_all_at(&v.to_le_bytes(), cfg + 4).map_err(|e| format!("config write: {e}"))?;
    let edu = Edu { dev, bar0 };
    println!("vfio: container, group and device open; BAR0 at region offset {bar0:#x}");

    let src = DmaBuffer::new()?;
    let dst = DmaBuffer::new()?;
    src.fill(|i| (i as u8).wrapping_mul(7).wrapping_add(3));
    dst.fill(|_| 0);
    map(&container, &src, IOVA_SRC)?;
    map(&container, &dst, IOVA_DST)?;
    edu.dma(IOVA_SRC, EDU_BUFFER, 0)?;
    edu.dma(EDU_BUFFER, IOVA_DST, CMD_TO_RAM)?;
    if let Some(i) = (0..LEN).find(|&i| dst.get(i) != src.get(i)) {
        return Err(format!("round trip: byte {i} is {:#x}, sent {:#x}", dst.get(i), src.get(i)));
    }
    println!(
        "FABRIC-TEST-RESULT vfio-dma-round-trip ok {LEN} bytes RAM -> edu -> RAM via IOVA {IOVA_SRC:#x} / {IOVA_DST:#x}"
    );

    let u = DmaUnmap { argsz: size_of::<DmaUnmap>() as u32, flags: 0, iova: IOVA_DST, size: LEN as u64 };
    ioctl(&container, VFIO_IOMMU_UNMAP_DMA, &u as *const DmaUnmap as libc::c_ulong, "VFIO_IOMMU_UNMAP_DMA")?;
    dst.fill(|_| 0);
    edu.dma(EDU_BUFFER, IOVA_DST, CMD_TO_RAM)?;
    if (0..LEN).any(|i| dst.get(i) != 0) {
        return Err("a DMA to the unmapped IOVA reached the buffer".into());
    }
    println!(
        "FABRIC-TEST-RESULT vfio-unmapped-blocked ok the DMA to {IOVA_DST:#x} after unmap left the buffer untouched"
    );
    Ok(())
}
