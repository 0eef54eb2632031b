//! Work queues on a GPU: streams that run copies on the copy engines, events that time
//! them, and host memory registered (pinned) for the GPU's DMA.

use std::ffi::c_void;
use std::sync::Arc;

use super::CudaError;
use super::context::{Ctx, CudaContext};
use super::sys::{CUevent, CUstream};
use super::vmm::GpuMapping;

/// A non-blocking stream; destroyed on drop (after the work queued on it).
#[derive(Debug)]
pub struct Stream {
    ctx: Arc<Ctx>,
    pub(super) raw: CUstream,
}

// SAFETY: a stream handle may be used from any thread; every use binds its context first.
unsafe impl Send for Stream {}

impl CudaContext {
    /// A new stream in this context.
    pub fn stream(&self) -> Result<Stream, CudaError> {
        self.bind()?;
        let raw = self.inner.drv.stream_create()?;
        Ok(Stream { ctx: self.inner.clone(), raw })
    }

    /// A new event (timing enabled).
    pub fn event(&self) -> Result<Event, CudaError> {
        self.bind()?;
        let raw = self.inner.drv.event_create()?;
        Ok(Event { ctx: self.inner.clone(), raw })
    }

    /// Registers (pins) `len` bytes of host memory at `ptr` for the GPU's DMA; unregistered
    /// on drop.
    ///
    /// # Safety
    /// The range must be memory this process owns, stays allocated and is not unmapped
    /// until the registration drops; while the GPU reads or writes it no Rust reference to
    /// it may be live.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<HostRegistration, CudaError> {
        if ptr.is_null() || len == 0 {
            return Err(CudaError::InvalidArgument("empty host range".into()));
        }
        self.bind()?;
        // SAFETY: the caller guarantees the range (this function's contract).
        unsafe { self.inner.drv.host_register(ptr.cast::<c_void>(), len)? };
        Ok(HostRegistration { ctx: self.inner.clone(), ptr: ptr.cast(), len })
    }
}

impl Stream {
    /// Queues a copy of `len` bytes from `src` to `dst` on the copy engines.
    ///
    /// Both mappings are borrowed only for the call: the caller must keep them alive until
    /// [`Stream::synchronize`] (dropping a mapping with a copy in flight unmaps memory the
    /// copy engine is still using), which is why this is `unsafe`.
    ///
    /// # Safety
    /// `src` and `dst` must outlive the copy (call `synchronize` before dropping them).
    pub unsafe fn copy_async(&self, dst: &GpuMapping<'_>, src: &GpuMapping<'_>, len: usize) -> Result<(), CudaError> {
        dst.check(0, len)?;
        src.check(0, len)?;
        dst.check_access(self.ctx.ordinal)?;
        src.check_access(self.ctx.ordinal)?;
        self.ctx.bind()?;
        // SAFETY: both ranges lie inside live mappings this stream's device was granted
        // (checked above); the caller keeps them alive until the copy ends.
        unsafe { self.ctx.drv.memcpy_dtod_async(dst.device_ptr(), src.device_ptr(), len, self.raw) }
    }

    /// Records `event` on this stream.
    pub fn record(&self, event: &Event) -> Result<(), CudaError> {
        self.ctx.bind()?;
        self.ctx.drv.event_record(event.raw, self.raw)
    }

    /// Waits for everything queued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.ctx.bind()?;
        self.ctx.drv.stream_synchronize(self.raw)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let r = self.ctx.bind().and_then(|()| self.ctx.drv.stream_destroy(self.raw));
        if let Err(e) = r {
            tracing::warn!("destroying a stream: {e}");
        }
    }
}

/// A CUDA event, for GPU-side timing.
#[derive(Debug)]
pub struct Event {
    ctx: Arc<Ctx>,
    raw: CUevent,
}

// SAFETY: an event handle may be used from any thread; every use binds its context first.
unsafe impl Send for Event {}

impl Event {
    /// Milliseconds between `self` (recorded earlier) and `end`, once `end` has completed.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32, CudaError> {
        self.ctx.bind()?;
        self.ctx.drv.event_synchronize(end.raw)?;
        self.ctx.drv.event_elapsed_ms(self.raw, end.raw)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let r = self.ctx.bind().and_then(|()| self.ctx.drv.event_destroy(self.raw));
        if let Err(e) = r {
            tracing::warn!("destroying an event: {e}");
        }
    }
}

/// Host memory pinned for the GPU's DMA; unregistered on drop.
#[derive(Debug)]
pub struct HostRegistration {
    ctx: Arc<Ctx>,
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: the registration is a driver-side record keyed by address; it may be dropped on
// any thread (the drop binds the context first).
unsafe impl Send for HostRegistration {}

impl HostRegistration {
    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty ranges are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let r = self.ctx.bind().and_then(|()| self.ctx.drv.host_unregister(self.ptr));
        if let Err(e) = r {
            tracing::warn!("unregistering host memory: {e}");
        }
    }
}
