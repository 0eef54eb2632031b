//! GPU memory through the driver's virtual memory management: physical allocations
//! (`cuMemCreate`, sized to the allocation granularity), their export as a POSIX descriptor
//! or a fabric handle, their import in another process, and mappings (`cuMemAddressReserve`
//! + `cuMemMap` + `cuMemSetAccess`) that kernels and copy engines load and store through.

use std::ops::Deref;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::context::{Ctx, CudaContext};
use super::sys::{CUdeviceptr, CUmemGenericAllocationHandle};
use super::{CudaError, round_up};

/// How to allocate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocOptions {
    /// Also allow export as a fabric handle (NVSwitch / IMEX systems). Fails on devices
    /// without fabric support: retry without.
    pub fabric: bool,
    /// Ask for GPUDirect RDMA capability (needed for dma-buf export of the range).
    pub gpu_direct_rdma: bool,
}

/// A fabric handle (`CUmemFabricHandle`): 64 opaque bytes another process on the same
/// NVLink fabric (even on another node) imports.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct FabricHandle(pub [u8; 64]);

impl std::fmt::Debug for FabricHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The handle is a capability: never print its bytes.
        f.write_str("FabricHandle(..)")
    }
}

/// Builds the allocation properties for `ordinal`.
fn properties(ordinal: i32, opts: AllocOptions) -> cu::CUmemAllocationProp {
    let mut types = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
    if opts.fabric {
        types |= cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC.0;
    }
    cu::CUmemAllocationProp {
        type_: cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: cu::CUmemAllocationHandleType_enum(types),
        location: cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: cu::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(opts.gpu_direct_rdma),
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Read-write access for one device.
fn access(ordinal: i32) -> cu::CUmemAccessDesc {
    cu::CUmemAccessDesc {
        location: cu::CUmemLocation { type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal },
        flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

impl CudaContext {
    /// The allocation granularity for `opts` on this device: the minimum, and the one the
    /// driver recommends for performance.
    pub fn granularity(&self, opts: AllocOptions) -> Result<(usize, usize), CudaError> {
        let prop = properties(self.ordinal(), opts);
        let drv = self.inner.drv;
        let min = drv.granularity(&prop, cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)?;
        let rec = drv.granularity(&prop, cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?;
        Ok((min, rec.max(min)))
    }

    /// Allocates at least `size` bytes of this GPU's memory, rounded up to the minimum
    /// granularity, exportable as a POSIX descriptor (and as a fabric handle with
    /// `opts.fabric`). The memory is not mapped yet: see [`GpuMemory::map`].
    pub fn allocate(&self, size: usize, opts: AllocOptions) -> Result<GpuMemory, CudaError> {
        let (min, _) = self.granularity(opts)?;
        let size = round_up(size, min)?;
        self.bind()?;
        let handle = self.inner.drv.mem_create(size, &properties(self.ordinal(), opts))?;
        tracing::debug!(ordinal = self.ordinal(), size, "cuMemCreate");
        Ok(GpuMemory { ctx: self.clone(), handle, size, granularity: min, imported: false })
    }

    /// Imports an allocation another process exported as a POSIX descriptor. `size` is the
    /// exporter's allocation size (the descriptor does not carry it). The descriptor stays
    /// the caller's; the driver keeps its own reference.
    pub fn import_fd(&self, fd: BorrowedFd<'_>, size: usize) -> Result<GpuMemory, CudaError> {
        self.import(size, |drv| drv.import_fd(fd.as_raw_fd()))
    }

    /// Imports an allocation exported as a fabric handle.
    pub fn import_fabric(&self, handle: &FabricHandle, size: usize) -> Result<GpuMemory, CudaError> {
        self.import(size, |drv| drv.import_fabric(&handle.0))
    }

    fn import(
        &self,
        size: usize,
        f: impl FnOnce(super::sys::Driver) -> Result<CUmemGenericAllocationHandle, CudaError>,
    ) -> Result<GpuMemory, CudaError> {
        let (min, _) = self.granularity(AllocOptions::default())?;
        if size == 0 || !size.is_multiple_of(min) {
            return Err(CudaError::InvalidArgument(format!("imported size {size} is not a multiple of {min}")));
        }
        self.bind()?;
        let handle = f(self.inner.drv)?;
        Ok(GpuMemory { ctx: self.clone(), handle, size, granularity: min, imported: true })
    }
}

/// A physical GPU allocation (local or imported). Released on drop; the memory itself
/// lives until every process has released its handle and unmapped it.
#[derive(Debug)]
pub struct GpuMemory {
    ctx: CudaContext,
    handle: CUmemGenericAllocationHandle,
    size: usize,
    granularity: usize,
    imported: bool,
}

impl GpuMemory {
    /// Bytes (a multiple of the granularity).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether this came from an import rather than a local `cuMemCreate`.
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// The context (device) the allocation was made or imported in.
    pub fn context(&self) -> &CudaContext {
        &self.ctx
    }

    /// Exports the allocation as a POSIX descriptor, to send to another process
    /// (`SCM_RIGHTS`, see [`super::fdpass`]). Each call makes a new descriptor.
    pub fn export_fd(&self) -> Result<OwnedFd, CudaError> {
        self.ctx.bind()?;
        let fd = self.ctx.inner.drv.export_fd(self.handle)?;
        if fd < 0 {
            return Err(CudaError::Io { op: "cuMemExportToShareableHandle", message: format!("descriptor {fd}") });
        }
        // SAFETY: the driver just created `fd` for this process and hands it over; nothing
        // else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports the allocation as a fabric handle (allocated with `AllocOptions::fabric`).
    pub fn export_fabric(&self) -> Result<FabricHandle, CudaError> {
        self.ctx.bind()?;
        self.ctx.inner.drv.export_fabric(self.handle).map(FabricHandle)
    }

    /// Maps the whole allocation into a newly reserved device range, read-write for this
    /// allocation's device and every context in `peers` (peer mappings across GPUs).
    pub fn map(&self, peers: &[&CudaContext]) -> Result<GpuMapping<'_>, CudaError> {
        Ok(GpuMapping { mem: self, range: MappedRange::new(self, peers)? })
    }
}

impl Drop for GpuMemory {
    fn drop(&mut self) {
        let r = self.ctx.bind().and_then(|()| self.ctx.inner.drv.mem_release(self.handle));
        if let Err(e) = r {
            tracing::warn!(size = self.size, "releasing GPU memory: {e}");
        }
    }
}

/// A device range with a whole [`GpuMemory`] mapped into it, accessible to the contexts
/// given when it was mapped: what [`GpuMapping`] and [`OwnedGpuMapping`] own and dereference
/// to. Unmapped, then the range freed, on drop. The device address is usable by kernels and
/// copies of the contexts given access.
#[derive(Debug)]
pub struct MappedRange {
    ctx: Arc<Ctx>,
    va: CUdeviceptr,
    size: usize,
    mapped: bool,
    /// The ordinals `cuMemSetAccess` granted: the owner first, then each peer once.
    access: Vec<i32>,
}

impl MappedRange {
    /// Reserves a range, maps `mem` into it and grants access to its device and `peers`.
    fn new(mem: &GpuMemory, peers: &[&CudaContext]) -> Result<Self, CudaError> {
        mem.ctx.bind()?;
        let drv = mem.ctx.inner.drv;
        let va = drv.address_reserve(mem.size, mem.granularity)?;
        // Each step's guard undoes it if a later step fails.
        let mut m = MappedRange { ctx: mem.ctx.inner.clone(), va, size: mem.size, mapped: false, access: Vec::new() };
        drv.map(va, mem.size, mem.handle)?;
        m.mapped = true;
        let mut granted = vec![mem.ctx.ordinal()];
        for p in peers {
            if !granted.contains(&p.ordinal()) {
                granted.push(p.ordinal());
            }
        }
        let desc: Vec<_> = granted.iter().map(|&o| access(o)).collect();
        drv.set_access(va, mem.size, &desc)?;
        m.access = granted;
        Ok(m)
    }

    /// The devices (ordinals) this mapping was made accessible to: the memory's own and the
    /// peers given at `map`.
    pub fn granted(&self) -> &[i32] {
        &self.access
    }

    /// Refuses work of device `ordinal` on this range unless it was granted access. The
    /// check is ours, before the driver's: on a GPU a copy engine or kernel touching a
    /// range its device was not granted faults (an error the context keeps), where the
    /// caller's mistake deserves a plain refusal.
    pub(super) fn check_access(&self, ordinal: i32) -> Result<(), CudaError> {
        if self.access.contains(&ordinal) {
            Ok(())
        } else {
            Err(CudaError::NoAccess { device: ordinal, owner: self.ctx.ordinal })
        }
    }

    /// The device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.va
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Always false: allocations are never empty.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// Exports the mapped range as a dma-buf descriptor, for a NIC or another device to
    /// register (`cuMemGetHandleForAddressRange`). Needs GPUDirect RDMA support and an
    /// allocation made with `AllocOptions::gpu_direct_rdma`.
    pub fn dma_buf_fd(&self) -> Result<OwnedFd, CudaError> {
        self.ctx.bind()?;
        let fd = self.ctx.drv.dma_buf_fd(self.va, self.size)?;
        if fd < 0 {
            return Err(CudaError::Io { op: "cuMemGetHandleForAddressRange", message: format!("descriptor {fd}") });
        }
        // SAFETY: the driver just created `fd` for this process and hands it over.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Copies `dst.len()` bytes at `offset` to host memory (synchronous).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check(offset, dst.len())?;
        self.ctx.bind()?;
        // SAFETY: `check` keeps the range inside this live mapping, which the current
        // context can access; the copy is synchronous.
        unsafe { self.ctx.drv.memcpy_dtoh(dst, self.va + offset as u64) }
    }

    /// Copies `src` into the mapping at `offset`, and waits until it is there (from
    /// pageable memory the driver returns once the bytes are staged, before its DMA ends).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        self.check(offset, src.len())?;
        self.ctx.bind()?;
        // SAFETY: as for `read`.
        unsafe { self.ctx.drv.memcpy_htod(self.va + offset as u64, src)? };
        self.ctx.drv.ctx_synchronize()
    }

    /// Copies `len` bytes from `src` into this mapping with `cuMemcpyDtoD`, then waits for
    /// the context (the driver returns before a device-to-device copy is done; seen on an
    /// H200: timed without the wait, 1 GiB "copied" at 126 TB/s). The baseline the stream
    /// copies are measured against.
    pub fn copy_from(&self, src: &MappedRange, len: usize) -> Result<(), CudaError> {
        self.copy_range(0, src, 0, len)
    }

    /// [`MappedRange::copy_from`] between offsets: `len` bytes from `src` at `src_offset` to
    /// this mapping at `offset`. The copy runs in this mapping's context, so its device must
    /// have been granted `src` (its own memory, or a peer given when `src` was mapped):
    /// otherwise [`CudaError::NoAccess`], before any driver call.
    pub fn copy_range(&self, offset: usize, src: &MappedRange, src_offset: usize, len: usize) -> Result<(), CudaError> {
        self.check(offset, len)?;
        src.check(src_offset, len)?;
        src.check_access(self.ctx.ordinal)?;
        self.ctx.bind()?;
        // SAFETY: both ranges lie inside live mappings (checked above; access was granted
        // at `map`); `memcpy_dtod` waits for the copy.
        unsafe { self.ctx.drv.memcpy_dtod(self.va + offset as u64, src.va + src_offset as u64, len) }
    }

    pub(super) fn check(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(CudaError::InvalidArgument(format!("{offset}+{len} outside a {}-byte mapping", self.size))),
        }
    }
}

impl Drop for MappedRange {
    fn drop(&mut self) {
        let drv = self.ctx.drv;
        if let Err(e) = self.ctx.bind() {
            tracing::warn!("unmapping GPU memory: {e}");
            return;
        }
        if self.mapped
            && let Err(e) = drv.unmap(self.va, self.size)
        {
            // A range still mapped cannot be freed.
            tracing::warn!("cuMemUnmap: {e}");
            return;
        }
        if let Err(e) = drv.address_free(self.va, self.size) {
            tracing::warn!("cuMemAddressFree: {e}");
        }
    }
}

/// A mapping of a [`GpuMemory`] this borrows ([`GpuMemory::map`]); its accessors are
/// [`MappedRange`]'s.
#[derive(Debug)]
pub struct GpuMapping<'a> {
    mem: &'a GpuMemory,
    range: MappedRange,
}

impl GpuMapping<'_> {
    /// The memory mapped.
    pub fn memory(&self) -> &GpuMemory {
        self.mem
    }
}

impl Deref for GpuMapping<'_> {
    type Target = MappedRange;
    fn deref(&self) -> &MappedRange {
        &self.range
    }
}

/// A mapping that keeps what it maps alive: the [`GpuMemory`] itself or an owner of one (a
/// [`super::GpuImport`]), shared by an `Arc`. For callers that cannot hold a borrow, such as
/// the C ABI. Its accessors are [`MappedRange`]'s.
pub struct OwnedGpuMapping {
    // Fields drop in order: the range is unmapped before the memory can be released.
    range: MappedRange,
    owner: Arc<dyn AsRef<GpuMemory> + Send + Sync>,
}

impl OwnedGpuMapping {
    /// Maps the whole of the memory `owner` holds, as [`GpuMemory::map`] does, and keeps
    /// `owner` until the mapping is dropped.
    pub fn new<T: AsRef<GpuMemory> + Send + Sync + 'static>(
        owner: Arc<T>,
        peers: &[&CudaContext],
    ) -> Result<Self, CudaError> {
        let range = MappedRange::new((*owner).as_ref(), peers)?;
        Ok(Self { range, owner })
    }

    /// The memory mapped.
    pub fn memory(&self) -> &GpuMemory {
        (*self.owner).as_ref()
    }
}

impl Deref for OwnedGpuMapping {
    type Target = MappedRange;
    fn deref(&self) -> &MappedRange {
        &self.range
    }
}

impl std::fmt::Debug for OwnedGpuMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedGpuMapping").field("range", &self.range).field("memory", self.memory()).finish()
    }
}

impl AsRef<GpuMemory> for GpuMemory {
    fn as_ref(&self) -> &GpuMemory {
        self
    }
}

impl AsRef<GpuMemory> for super::GpuImport {
    fn as_ref(&self) -> &GpuMemory {
        self.memory()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_properties_ask_for_the_handles_and_device_given() {
        let p = properties(3, AllocOptions { fabric: true, gpu_direct_rdma: true });
        assert_eq!(p.requestedHandleTypes.0, 1 | 8, "POSIX fd and fabric, one bit each");
        assert_eq!((p.location.id, p.allocFlags.gpuDirectRDMACapable), (3, 1));
        assert_eq!(p.type_, cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED);
        let p = properties(0, AllocOptions::default());
        assert_eq!((p.requestedHandleTypes.0, p.allocFlags.gpuDirectRDMACapable), (1, 0));
        // The layout the driver reads (CUDA 12.x CUmemAllocationProp): 32 bytes.
        assert_eq!(std::mem::size_of::<cu::CUmemAllocationProp>(), 32);
        assert_eq!(access(2).location.id, 2);
    }

    #[test]
    fn fabric_handles_never_print_their_bytes() {
        assert_eq!(format!("{:?}", FabricHandle([0xab; 64])), "FabricHandle(..)");
    }
}
