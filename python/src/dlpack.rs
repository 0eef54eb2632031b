//! DLPack export of host memory (a mapping): `__dlpack__` hands out a capsule whose tensor
//! is the mapping's bytes as a 1-D `uint8` array on the CPU, without a copy. The tensor's
//! manager context holds a [`Pin`], so the memory stays mapped until the consumer calls the
//! deleter (or, unconsumed, the capsule is collected). A read-only mapping is only handed
//! to consumers that understand DLPack 1.0's read-only flag: a legacy consumer (which has no
//! way to know) could store into `PROT_READ` pages and crash the process.

use std::ffi::{CStr, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::memory::Pin;

/// `(kDLCPU, 0)`.
pub(crate) const CPU_DEVICE: (i32, i32) = (1, 0);
const KDL_UINT: u8 = 1;
const FLAG_READ_ONLY: u64 = 1;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DlManagedTensorVersioned {
    version: DlPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

/// What one capsule owns. `managed` comes first, so a pointer to it is a pointer to the
/// whole (`repr(C)`), which is how the deleter finds the box again.
#[repr(C)]
struct Owned<M> {
    managed: M,
    shape: [i64; 1],
    strides: [i64; 1],
    _pin: Pin,
}

/// The two managed-tensor layouts: DLPack 1.0's versioned one and the legacy one.
trait Managed: Sized {
    /// The capsule's name.
    const NAME: &'static CStr;
    fn tensor(&mut self) -> &mut DlTensor;
    fn context(&mut self) -> &mut *mut c_void;
}

impl Managed for DlManagedTensor {
    const NAME: &'static CStr = c"dltensor";
    fn tensor(&mut self) -> &mut DlTensor {
        &mut self.dl_tensor
    }
    fn context(&mut self) -> &mut *mut c_void {
        &mut self.manager_ctx
    }
}

impl Managed for DlManagedTensorVersioned {
    const NAME: &'static CStr = c"dltensor_versioned";
    fn tensor(&mut self) -> &mut DlTensor {
        &mut self.dl_tensor
    }
    fn context(&mut self) -> &mut *mut c_void {
        &mut self.manager_ctx
    }
}

fn tensor(address: usize) -> DlTensor {
    DlTensor {
        data: address as *mut c_void,
        device: DlDevice { device_type: CPU_DEVICE.0, device_id: CPU_DEVICE.1 },
        ndim: 1,
        dtype: DlDataType { code: KDL_UINT, bits: 8, lanes: 1 },
        // Set to the box's own arrays once it is on the heap (they do not move after).
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// The deleter of both layouts.
///
/// # Safety
/// `m` is null or a pointer [`capsule`] made (the `managed` field of a boxed `Owned<M>`),
/// not deleted before.
unsafe extern "C" fn delete<M: Managed>(m: *mut M) {
    if m.is_null() {
        return;
    }
    // SAFETY: per the contract, `m` is the first field of a live `Box<Owned<M>>` (repr(C)).
    let owned = unsafe { Box::from_raw(m.cast::<Owned<M>>()) };
    // A panic must not unwind into the consumer's C code.
    let _ = catch_unwind(AssertUnwindSafe(|| drop(owned)));
}

/// The capsule's destructor.
///
/// # Safety
/// Called by Python with a capsule [`capsule`] made (GIL held), once, when it is collected.
unsafe extern "C" fn destroy<M: Managed>(capsule: *mut ffi::PyObject) {
    // SAFETY: a consumer renames the capsule when it takes the tensor (then the deleter is
    // its to call); still under our name, the pointer is ours and was never handed over.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, M::NAME.as_ptr()) == 1 {
            delete::<M>(ffi::PyCapsule_GetPointer(capsule, M::NAME.as_ptr()).cast());
        }
    }
}

/// Boxes `managed` with its shape, strides and pin, and hands the box to a capsule.
fn capsule<'py, M: Managed>(py: Python<'py>, managed: M, len: i64, pin: Pin) -> PyResult<Bound<'py, PyAny>> {
    let mut b = Box::new(Owned { managed, shape: [len], strides: [1], _pin: pin });
    let (shape, strides) = (b.shape.as_mut_ptr(), b.strides.as_mut_ptr());
    let t = b.managed.tensor();
    t.shape = shape;
    t.strides = strides;
    let raw = Box::into_raw(b);
    // SAFETY: raw is a live box, ours alone; its address is the context consumers may see.
    unsafe { *(*raw).managed.context() = raw.cast() };
    // SAFETY: raw (its first field) is the capsule's pointer under the layout's name; the
    // destructor deletes it unless a consumer took it.
    let cap = unsafe { ffi::PyCapsule_New(raw.cast(), M::NAME.as_ptr(), Some(destroy::<M>)) };
    // SAFETY: an owned reference, or NULL with an exception set.
    let made = unsafe { Bound::from_owned_ptr_or_err(py, cap) };
    if made.is_err() {
        // SAFETY: no capsule holds raw: it is still ours alone.
        unsafe { delete::<M>(raw.cast()) };
    }
    made
}

/// The capsule for `__dlpack__`, after checking what the consumer asked for.
pub(crate) fn export<'py>(
    py: Python<'py>,
    pin: Pin,
    stream: bool,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    if stream {
        return Err(PyBufferError::new_err("a mapping is host memory: stream must be None"));
    }
    if dl_device.is_some_and(|d| d != CPU_DEVICE) {
        return Err(PyBufferError::new_err("a mapping is host memory: only dl_device (1, 0) (kDLCPU)"));
    }
    if copy == Some(true) {
        return Err(PyBufferError::new_err("a mapping is exported without copies (copy=True refused)"));
    }
    let (address, size, writable) = pin.parts();
    let len = i64::try_from(size).map_err(|_| PyBufferError::new_err("mapping larger than DLPack's shape"))?;
    if max_version.is_some_and(|(major, _)| major >= 1) {
        let managed = DlManagedTensorVersioned {
            version: DlPackVersion { major: 1, minor: 0 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete::<DlManagedTensorVersioned>),
            flags: if writable { 0 } else { FLAG_READ_ONLY },
            dl_tensor: tensor(address),
        };
        return capsule(py, managed, len, pin);
    }
    if !writable {
        return Err(PyBufferError::new_err(
            "a read-only mapping needs a DLPack ≥ 1.0 consumer (max_version), which honours its read-only flag",
        ));
    }
    let managed =
        DlManagedTensor { dl_tensor: tensor(address), manager_ctx: std::ptr::null_mut(), deleter: Some(delete) };
    capsule(py, managed, len, pin)
}
