//! The VFIO DMA backend: PCI functions named in `dma.vfio` are bound to `vfio-pci` at
//! start ([`bind`]), their IOMMU group attached to a type-1 v2 container of the daemon and
//! the device opened through the `vfio-ioctls` crate ([`ioctl`]); a registration for such a
//! device maps its pinned memory at its IOVA in that container (`VFIO_IOMMU_MAP_DMA`:
//! the crate's for read-write, raw for read-only), and dropping the registration unmaps it
//! before the memory is unpinned ([`DmaMapping`]). The container is reached through the
//! [`Iommu`] trait, so that the registry's use of it is tested on a fake. A device with an engine driver ([`edu`]) runs
//! the copies between its registrations itself; a fault the IOMMU logs during such a copy
//! fails the copy ([`fault`]).
//!
//! Only memory the daemon maps (a region, an import, a memory object) can be mapped:
//! the container belongs to the daemon's address space, so a client's own memory
//! (`RegisterSource::Process`) is refused for a VFIO device.

pub mod bind;
pub mod edu;
pub mod engine;
pub mod fault;
pub mod ioctl;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::config::DmaConfig;
use crate::dma::sys::Pinned;
use bind::BindError;
use edu::{Bar, Edu, EduError};
use engine::{End, Engine};
use ioctl::IoctlError;

/// Bytes of a device copy moved under one hold of the engine's lock.
pub const STEP: u64 = 64 << 10;

/// Ids of mappings, never reused: a copy names the mappings it runs through.
static NEXT_MAPPING: AtomicU64 = AtomicU64::new(1);

/// An IOVA as the kernel logs it (`0x200000`).
struct Hex(u64);

impl std::fmt::Display for Hex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Why the VFIO backend refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    /// The function could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// A VFIO call failed.
    #[error(transparent)]
    Ioctl(#[from] IoctlError),
    /// The device's engine failed.
    #[error(transparent)]
    Engine(#[from] EduError),
    /// The IOMMU blocked the device's DMA.
    #[error("the IOMMU blocked the device's DMA: {0}")]
    Fault(String),
    /// The kernel log could not be read, so faults cannot be seen.
    #[error("reading the kernel log for DMA faults")]
    Kmsg(#[source] std::io::Error),
    /// The device has no engine driver.
    #[error("{0} has no DMA engine driver")]
    NoEngine(String),
    /// An end of a device copy is no longer mapped (its registration went).
    #[error("IOVA {iova:#x}+{len} is no longer mapped: its registration went")]
    Unmapped {
        /// IOVA.
        iova: u64,
        /// Bytes.
        len: u64,
    },
}

/// What the daemon asks of the IOMMU behind a device: map and unmap ranges of its own
/// address space at IOVAs. A VFIO container in the daemon; a fake in tests.
pub trait Iommu: Send + Sync {
    /// Maps `len` bytes at `vaddr` at `iova`, writable by the device when `write`.
    ///
    /// # Safety
    /// As [`ioctl::map_dma`]: the range stays mapped until [`Iommu::unmap`] of it, and no
    /// Rust reference to its bytes is live meanwhile.
    unsafe fn map(&self, vaddr: *mut u8, iova: u64, len: u64, write: bool) -> Result<(), IoctlError>;

    /// Removes the mapping of `[iova, iova + len)`.
    fn unmap(&self, iova: u64, len: u64) -> Result<(), IoctlError>;
}

impl Iommu for vfio_ioctls::VfioContainer {
    unsafe fn map(&self, vaddr: *mut u8, iova: u64, len: u64, write: bool) -> Result<(), IoctlError> {
        // SAFETY: the caller upholds map_dma's contract (this function's).
        unsafe { ioctl::map_dma(self, vaddr, iova, len, write) }
    }

    fn unmap(&self, iova: u64, len: u64) -> Result<(), IoctlError> {
        ioctl::unmap_dma(self, iova, len)
    }
}

/// BAR 0 of a VFIO device, through its descriptor (`pread`/`pwrite` at the offset the
/// region info gives).
#[derive(Debug)]
struct RegionBar {
    device: Arc<ioctl::Device>,
    offset: u64,
}

impl Bar for RegionBar {
    fn read32(&self, reg: u64) -> std::io::Result<u32> {
        let mut b = [0u8; 4];
        self.device.read_at(&mut b, self.offset + reg)?;
        Ok(u32::from_le_bytes(b))
    }
    fn read64(&self, reg: u64) -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        self.device.read_at(&mut b, self.offset + reg)?;
        Ok(u64::from_le_bytes(b))
    }
    fn write64(&self, reg: u64, v: u64) -> std::io::Result<()> {
        self.device.write_at(&v.to_le_bytes(), self.offset + reg)
    }
}

/// A PCI function fabricd holds through VFIO.
pub struct VfioDevice {
    /// `DDDD:BB:DD.F`.
    pub bdf: String,
    /// Its IOMMU group.
    pub group: u32,
    /// The DMA mask its IOVAs stay below.
    pub mask_bits: Option<u8>,
    // Field order is drop order: the engine (which holds the device too) goes first, then
    // the device (closing it detaches the group), then the container.
    engine: Option<Mutex<Engine<RegionBar, fault::Kmsg>>>,
    _device: Option<Arc<ioctl::Device>>,
    container: Arc<dyn Iommu>,
    verify_unmap: bool,
}

impl std::fmt::Debug for VfioDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioDevice")
            .field("bdf", &self.bdf)
            .field("group", &self.group)
            .field("engine", &self.engine.is_some())
            .finish()
    }
}

impl PartialEq for VfioDevice {
    fn eq(&self, o: &Self) -> bool {
        self.bdf == o.bdf
    }
}
impl Eq for VfioDevice {}

impl VfioDevice {
    /// Binds `bdf` under sysfs root `root` and opens it through `/dev/vfio`.
    pub fn open(root: &Path, bdf: &str, verify_unmap: bool) -> Result<Self, VfioError> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        let f = bind::bind(root, bdf, euid)?;
        let o = ioctl::open_device(&bind::device_dir(root, bdf), f.group, bdf)?;
        ioctl::enable_bus_master(&o.device)?;
        let device = Arc::new(o.device);
        let is_edu = (f.ids.0.as_str(), f.ids.1.as_str()) == edu::IDS;
        let mut mask_bits = f.dma_mask_bits;
        let engine = if is_edu {
            mask_bits = Some(edu::MASK_BITS);
            let bar0 = device.region(0)?;
            if bar0.size < edu::REGISTERS {
                return Err(ioctl::IoctlError::NoRegion { index: 0, size: bar0.size, flags: bar0.flags }.into());
            }
            let edu = Edu::new(RegionBar { device: device.clone(), offset: bar0.offset })?;
            match fault::Kmsg::open(bdf) {
                Ok(kmsg) => Some(Mutex::new(Engine::new(edu, kmsg))),
                Err(e) => {
                    tracing::warn!(bdf, error = %e, "edu engine off: the kernel log (DMA faults) cannot be read; copies run on the CPU");
                    None
                }
            }
        } else {
            None
        };
        tracing::info!(bdf, group = f.group, ?mask_bits, engine = engine.is_some(), "VFIO device open");
        Ok(Self {
            bdf: bdf.to_owned(),
            group: f.group,
            mask_bits,
            engine,
            _device: Some(device),
            container: o.container,
            verify_unmap,
        })
    }

    /// A device without an engine whose registrations are mapped in `iommu` (a fake
    /// container, for tests of the registry).
    #[cfg(test)]
    pub(crate) fn with_iommu(bdf: &str, group: u32, iommu: Arc<dyn Iommu>) -> Self {
        Self {
            bdf: bdf.to_owned(),
            group,
            mask_bits: None,
            engine: None,
            _device: None,
            container: iommu,
            verify_unmap: false,
        }
    }

    /// Whether copies between its registrations run on the device.
    pub fn has_engine(&self) -> bool {
        self.engine.is_some()
    }

    fn engine(&self) -> Option<MutexGuard<'_, Engine<RegionBar, fault::Kmsg>>> {
        self.engine.as_ref().map(|e| e.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Copies `len` bytes from `src` to `dst` on the device (see [`Engine::copy`]), in
    /// steps of [`STEP`] bytes, each under the engine's lock: an unregister (whose unmap
    /// takes that lock) waits for one step at most.
    pub fn copy(&self, src: End, dst: End, len: u64) -> Result<(), VfioError> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(STEP);
            let mut e = self.engine().ok_or_else(|| VfioError::NoEngine(self.bdf.clone()))?;
            e.copy(End { iova: src.iova + done, ..src }, End { iova: dst.iova + done, ..dst }, n)?;
            done += n;
        }
        tracing::info!(bdf = self.bdf, src = %Hex(src.iova), dst = %Hex(dst.iova), len, "device DMA copy done");
        Ok(())
    }

    /// Maps `pinned` at `iova` for the device (writable when `write`); the mapping lasts
    /// as long as the result and holds the pinned memory alive.
    pub fn map(self: &Arc<Self>, iova: u64, pinned: Arc<Pinned>, write: bool) -> Result<DmaMapping, VfioError> {
        // SAFETY: `pinned` stays mapped and locked as long as the returned DmaMapping (it
        // holds the Arc), whose Drop unmaps the range first; the daemon forms no references
        // to registered memory (crate::dma, "Safety of DMA").
        unsafe { self.container.map(pinned.as_ptr(), iova, pinned.len(), write) }?;
        let id = NEXT_MAPPING.fetch_add(1, Ordering::Relaxed);
        if let Some(mut e) = self.engine() {
            e.mapped(id, iova, pinned.len());
        }
        tracing::info!(bdf = self.bdf, iova = %Hex(iova), len = pinned.len(), write, "VFIO DMA mapped");
        Ok(DmaMapping { device: self.clone(), id, iova, pinned, released: false })
    }
}

/// A range mapped in a VFIO container; unmapped on drop, before its memory can go.
pub struct DmaMapping {
    device: Arc<VfioDevice>,
    id: u64,
    iova: u64,
    pinned: Arc<Pinned>,
    /// Unmapped (or tried) already, by [`DmaMapping::unmap`].
    released: bool,
}

impl std::fmt::Debug for DmaMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaMapping").field("bdf", &self.device.bdf).field("iova", &self.iova).finish()
    }
}

impl DmaMapping {
    /// The device.
    pub fn device(&self) -> &Arc<VfioDevice> {
        &self.device
    }

    /// First IOVA of the mapping.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// The mapping's id (never reused), for a device copy through it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Removes the mapping from the IOMMU: whether it is gone. When it is not, its IOVA
    /// range is still the device's way into the pages (the container keeps its own pin
    /// of them) and must not be handed out again.
    pub fn unmap(mut self) -> bool {
        self.release()
    }

    fn release(&mut self) -> bool {
        self.released = true;
        let (d, iova, len) = (&self.device, self.iova, self.pinned.len());
        // Held across the unmap: a device transfer through this mapping in flight ends
        // first, and none starts after (engine.rs).
        let mut engine = d.engine();
        if let Some(e) = engine.as_mut() {
            e.unmapping(self.id);
        }
        if let Err(e) = d.container.unmap(iova, len) {
            // The container keeps its own pin of the pages: nothing is freed under the device.
            tracing::error!(bdf = d.bdf, iova = %Hex(iova), len, error = %crate::error_chain(&e), "VFIO DMA unmap failed");
            return false;
        }
        tracing::info!(bdf = d.bdf, iova = %Hex(iova), len, "VFIO DMA unmapped");
        // The test hook runs here, before the registry frees the IOVA (it does once this
        // drop returns), so that no registration can take it before the probe DMA is over.
        if let (true, Some(e)) = (d.verify_unmap, engine.as_mut()) {
            match e.probe_unmapped(iova) {
                Ok(Some(record)) => {
                    tracing::info!(bdf = d.bdf, iova = %Hex(iova), record, "unmap verified: the IOMMU blocked a DMA to the IOVA")
                }
                Ok(None) => {
                    tracing::error!(bdf = d.bdf, iova = %Hex(iova), "unmap NOT verified: a DMA to the IOVA raised no fault")
                }
                Err(e) => {
                    tracing::error!(bdf = d.bdf, iova = %Hex(iova), error = %crate::error_chain(&e), "unmap check failed")
                }
            }
        }
        true
    }
}

impl Drop for DmaMapping {
    fn drop(&mut self) {
        if !self.released {
            self.release();
        }
    }
}

/// The VFIO devices the daemon holds, by PCI address.
#[derive(Debug, Default)]
pub struct Vfio {
    devices: HashMap<String, Arc<VfioDevice>>,
    refused: Vec<(String, String)>,
}

impl Vfio {
    /// Takes every function of `config.vfio` (sysfs under `root`); a refusal is logged
    /// with its reason and leaves that function to software registrations.
    pub fn start(config: &DmaConfig, root: &Path) -> Self {
        let mut devices = HashMap::new();
        let mut refused = Vec::new();
        for bdf in &config.vfio {
            // The config check parsed it; the key is the canonical spelling.
            let bdf = &bdf.parse::<fabric_topology::PciAddress>().map_or_else(|_| bdf.clone(), |a| a.to_string());
            match VfioDevice::open(root, bdf, config.vfio_verify_unmap) {
                Ok(d) => {
                    devices.insert(bdf.to_owned(), Arc::new(d));
                }
                Err(e) => {
                    let why = crate::error_chain(&e);
                    tracing::warn!(bdf, reason = %why, "not taken for VFIO DMA");
                    refused.push((bdf.to_owned(), why));
                }
            }
        }
        Self { devices, refused }
    }

    /// The functions of `dma.vfio` that were refused, with why (for `Status`).
    pub fn refused(&self) -> &[(String, String)] {
        &self.refused
    }

    /// The device at PCI address `bdf`.
    pub fn get(&self, bdf: &str) -> Option<&Arc<VfioDevice>> {
        self.devices.get(bdf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_function_is_reported_and_left_to_software() {
        let root = tempfile::tempdir().expect("tempdir");
        let config = DmaConfig { vfio: vec!["0:0:4.0".into()], vfio_verify_unmap: false };
        let v = Vfio::start(&config, root.path());
        assert!(v.get("0000:00:04.0").is_none());
        let [(bdf, why)] = v.refused() else { panic!("{:?}", v.refused()) };
        assert_eq!(bdf, "0000:00:04.0", "the canonical spelling");
        // Root or not, the reason is typed and says which.
        assert!(why.contains("needs root") || why.contains("no PCI function 0000:00:04.0"), "{why}");
    }
}
