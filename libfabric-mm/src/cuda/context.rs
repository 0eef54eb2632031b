//! One GPU's primary context: the handle every other CUDA object of this backend hangs
//! off, and peer access between two GPUs.

use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute as A;

use super::sys::{CUcontext, CUdevice, Driver};
use super::{CudaError, driver};

/// The retained primary context of one device. Shared (`Arc`) by every object made in it,
/// so that the context outlives them.
#[derive(Debug)]
pub(super) struct Ctx {
    pub(super) drv: Driver,
    pub(super) dev: CUdevice,
    pub(super) ctx: CUcontext,
    pub(super) ordinal: i32,
}

// SAFETY: a CUDA context handle may be used from any thread (the driver API is thread
// safe; each call first makes the context current on the calling thread, see `bind`).
unsafe impl Send for Ctx {}
// SAFETY: as above; `Ctx` has no interior mutability of its own.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Makes the context current on the calling thread; every call that works in a
    /// context does this first, so objects can move between threads.
    pub(super) fn bind(&self) -> Result<(), CudaError> {
        self.drv.set_current(self.ctx)
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        if let Err(e) = self.drv.primary_ctx_release(self.dev) {
            tracing::warn!(ordinal = self.ordinal, "releasing the primary context: {e}");
        }
    }
}

/// A GPU, ready for memory operations: its primary context, retained.
#[derive(Debug, Clone)]
pub struct CudaContext {
    pub(super) inner: Arc<Ctx>,
}

/// What the memory paths need to know about a device.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceProperties {
    /// CUDA ordinal.
    pub ordinal: i32,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// VMM (`cuMemCreate`/`cuMemMap`) supported.
    pub virtual_memory_management: bool,
    /// POSIX-fd export supported.
    pub posix_fd_handles: bool,
    /// Fabric-handle export supported (NVSwitch / IMEX systems).
    pub fabric_handles: bool,
    /// GPUDirect RDMA with VMM allocations (needed for dma-buf export of them).
    pub gpu_direct_rdma_with_vmm: bool,
}

impl CudaContext {
    /// Opens device `ordinal`: checks presence, initialises the driver once, retains the
    /// primary context. Without a driver: [`CudaError::NotPresent`].
    pub fn new(ordinal: i32) -> Result<Self, CudaError> {
        let drv = driver()?;
        let count = drv.device_count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let dev = drv.device(ordinal)?;
        let ctx = drv.primary_ctx_retain(dev)?;
        let inner = Arc::new(Ctx { drv, dev, ctx, ordinal });
        inner.bind()?;
        Ok(Self { inner })
    }

    /// The CUDA ordinal.
    pub fn ordinal(&self) -> i32 {
        self.inner.ordinal
    }

    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.inner.bind()
    }

    fn flag(&self, attr: A) -> bool {
        self.inner.drv.attribute(self.inner.dev, attr).is_ok_and(|v| v != 0)
    }

    /// The GPU's UUID as NVML and `nvidia-smi -L` print it: `GPU-` and 32 hex digits in
    /// 8-4-4-4-12 groups.
    pub fn uuid(&self) -> Result<String, CudaError> {
        Ok(format_uuid(&self.inner.drv.uuid(self.inner.dev)?))
    }

    /// The GPU's identity in the fabric (`uuid:GPU-…`, as fabricd's NVML and CUDA discovery
    /// name it): the device to adopt its memory on.
    pub fn fabric_device(&self) -> Result<String, CudaError> {
        Ok(format!("uuid:{}", self.uuid()?))
    }

    /// The device's memory features.
    pub fn properties(&self) -> Result<DeviceProperties, CudaError> {
        let drv = self.inner.drv;
        let major = drv.attribute(self.inner.dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = drv.attribute(self.inner.dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok(DeviceProperties {
            ordinal: self.inner.ordinal,
            compute_capability: (major, minor),
            virtual_memory_management: self.flag(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
            posix_fd_handles: self.flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
            fabric_handles: self.flag(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED),
            gpu_direct_rdma_with_vmm: self.flag(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED),
        })
    }

    /// Whether this GPU can access `peer`'s memory directly (NVLink or PCIe P2P).
    pub fn can_access_peer(&self, peer: &CudaContext) -> Result<bool, CudaError> {
        self.inner.drv.can_access_peer(self.inner.dev, peer.inner.dev)
    }

    /// Lets kernels and copies of this context reach `peer`'s ordinary (`cuMemAlloc`)
    /// allocations. VMM allocations do not need it: their access is granted per mapping
    /// ([`super::GpuMemory::map`] with several contexts). Undone when the guard drops.
    pub fn enable_peer_access(&self, peer: &CudaContext) -> Result<PeerAccess, CudaError> {
        if !self.can_access_peer(peer)? {
            return Err(CudaError::InvalidArgument(format!(
                "device {} cannot access device {}",
                self.ordinal(),
                peer.ordinal()
            )));
        }
        self.bind()?;
        self.inner.drv.enable_peer_access(peer.inner.ctx)?;
        Ok(PeerAccess { from: self.clone(), to: peer.clone() })
    }
}

/// Peer access from one context to another; disabled on drop.
#[derive(Debug)]
pub struct PeerAccess {
    from: CudaContext,
    to: CudaContext,
}

impl Drop for PeerAccess {
    fn drop(&mut self) {
        let r = self.from.bind().and_then(|()| self.from.inner.drv.disable_peer_access(self.to.inner.ctx));
        if let Err(e) = r {
            tracing::warn!("disabling peer access {} -> {}: {e}", self.from.ordinal(), self.to.ordinal());
        }
    }
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` from the 16 bytes `cuDeviceGetUuid` gives.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}
