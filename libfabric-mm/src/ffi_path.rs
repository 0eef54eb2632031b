//! The C ABI of the topology queries (`fmm_path`, `fmm_nearest_memory`,
//! `fmm_alloc_nearest`, each on a fresh snapshot, and the same on one kept snapshot,
//! `fmm_view_*`), over `path.rs`; the conventions are ffi.rs's (same header, same error
//! handling).

use std::ffi::{c_char, c_int};

use crate::ffi::{
    FMM_E_BUFFER, FmmRegion, FmmSession, arg_err, class, class_code, fail, get, guard, put, req_str, set_error,
};
use crate::path::{FabricView, PathInfo};

/// The path between two devices (`fmm_path`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FmmPath {
    /// The hop class as `nvidia-smi topo -m` writes it (`X`, `NV18`, `PIX`, `SYS`, `CXL`,
    /// …), NUL-terminated.
    pub class: [c_char; 16],
    /// Bottleneck bandwidth now, per direction, MB/s; 0 when unknown.
    pub bandwidth_mbps: u64,
    /// Bottleneck bandwidth the route is built for, MB/s; 0 when unknown.
    pub max_bandwidth_mbps: u64,
    /// Sum of the known link latencies, ns; 0 when unknown.
    pub latency_ns: u64,
    /// Devices on the route, both ends included.
    pub hops: u32,
    /// Links on the route running below their capability.
    pub degraded_links: u32,
}

/// `fmm_nearest_memory`: memory of every class.
pub const FMM_MEM_ANY: c_int = -1;

/// One memory resource ranked by `fmm_nearest_memory`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FmmNearMemory {
    /// The identity of the device that holds it, NUL-terminated.
    pub device: [c_char; 256],
    /// Its class (`FMM_MEM_*`).
    pub memory_class: c_int,
    /// Its size, bytes.
    pub size: u64,
    /// The path from the device asked about to it.
    pub path: FmmPath,
}

/// Copies `text` into a fixed C string field, NUL-terminated; `FMM_E_BUFFER` when it does
/// not fit.
pub(crate) fn fill(dst: &mut [c_char], text: &str) -> Result<(), c_int> {
    if text.len() >= dst.len() {
        set_error(&format!("{text:?} is longer than the {} bytes of its field", dst.len() - 1));
        return Err(FMM_E_BUFFER);
    }
    for (d, b) in dst.iter_mut().zip(text.bytes().chain(std::iter::once(0))) {
        *d = b as c_char;
    }
    Ok(())
}

fn c_path(p: &PathInfo) -> FmmPath {
    let mut class = [0 as c_char; 16];
    for (dst, src) in class.iter_mut().zip(p.class.bytes().take(15)) {
        *dst = src as c_char;
    }
    FmmPath {
        class,
        bandwidth_mbps: p.bandwidth_mbps.unwrap_or(0),
        max_bandwidth_mbps: p.max_bandwidth_mbps.unwrap_or(0),
        latency_ns: p.latency_ns.unwrap_or(0),
        hops: u32::try_from(p.route.len()).unwrap_or(u32::MAX),
        degraded_links: u32::try_from(p.degraded_links).unwrap_or(u32::MAX),
    }
}

/// Writes the widest path from device `a` to device `b` (identities in text form) to `out`.
///
/// # Safety
/// `s` is a live session; `a` and `b` NUL-terminated strings; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_path(
    s: *const FmmSession,
    a: *const c_char,
    b: *const c_char,
    out: *mut FmmPath,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        // SAFETY: forwarded caller contract.
        let (a, b) = unsafe { (req_str(a, "a")?, req_str(b, "b")?) };
        let view = s.0.fabric_view().map_err(|e| fail(&e))?;
        path_into(&view, a, b, out)
    })
}

/// [`fmm_path`]'s answer from `view` into `out` (checked non-NULL).
fn path_into(view: &FabricView, a: &str, b: &str, out: *mut FmmPath) -> Result<(), c_int> {
    if out.is_null() {
        return Err(arg_err("out is NULL"));
    }
    let p = view.path(a, b).map_err(|e| fail(&e))?;
    // SAFETY: out is non-NULL (checked) and writable (the callers' contract).
    unsafe { out.write(c_path(&p)) };
    Ok(())
}

/// Allocates `size` bytes on the memory nearest to `device` that has room (its own
/// memory first, then by path bandwidth).
///
/// # Safety
/// `s` is a live session; `device` a NUL-terminated string; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_alloc_nearest(
    s: *const FmmSession,
    device_id: *const c_char,
    size: u64,
    out: *mut *mut FmmRegion,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        // SAFETY: forwarded caller contract.
        let d = unsafe { req_str(device_id, "device") }?;
        let r = s.0.alloc_nearest(d, size).map_err(|e| fail(&e))?;
        put(out, FmmRegion(r))
    })
}

/// Every memory resource reachable from `device` (of class `memory_class`, or of every
/// class for `FMM_MEM_ANY`), nearest first: the device's own memory, then by bottleneck
/// bandwidth (highest first), then latency, then hops. Writes the first `cap` of them to
/// `out` (which may be NULL when `cap` is 0) and how many there are in all to `*count`:
/// call with `cap` 0 to size the array.
///
/// # Safety
/// `s` is a live session; `device` a NUL-terminated string; `out` has room for `cap`
/// entries; `count` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_nearest_memory(
    s: *const FmmSession,
    device: *const c_char,
    memory_class: c_int,
    out: *mut FmmNearMemory,
    cap: usize,
    count: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (s, d) = unsafe { (get(s, "session")?, req_str(device, "device")?) };
        let view = s.0.fabric_view().map_err(|e| fail(&e))?;
        // SAFETY: forwarded caller contract.
        unsafe { nearest_into(&view, d, memory_class, out, cap, count) }
    })
}

/// [`fmm_nearest_memory`]'s answer from `view`.
///
/// # Safety
/// As [`fmm_nearest_memory`]: `out` has room for `cap` entries; `count` is writable.
unsafe fn nearest_into(
    view: &FabricView,
    d: &str,
    memory_class: c_int,
    out: *mut FmmNearMemory,
    cap: usize,
    count: *mut usize,
) -> Result<(), c_int> {
    if count.is_null() || (out.is_null() && cap > 0) {
        return Err(arg_err("count is NULL, or out is NULL with a non-zero cap"));
    }
    let only = if memory_class == FMM_MEM_ANY { None } else { Some(class(memory_class)?) };
    let near = view.nearest_memory(d, only).map_err(|e| fail(&e))?;
    for (i, m) in near.iter().take(cap).enumerate() {
        let mut e =
            FmmNearMemory { device: [0; 256], memory_class: class_code(m.memory), size: m.size, path: c_path(&m.path) };
        fill(&mut e.device, &m.device)?;
        // SAFETY: out has room for cap > i entries (caller contract), non-NULL as cap > 0.
        unsafe { out.add(i).write(e) };
    }
    // SAFETY: count is non-NULL (checked) and writable (caller contract).
    unsafe { count.write(near.len()) };
    Ok(())
}

/// One snapshot of the fabric a session sees (`fmm_view_open`): path and nearest-memory
/// queries on it answer without a round trip to fabricd, and agree with each other.
#[derive(Debug)]
pub struct FmmView(FabricView);

/// One device of a view (`fmm_view_device`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FmmDeviceInfo {
    /// Its identity (`uuid:GPU-…`, `pci:…`, `serial:…`, `name:…`), NUL-terminated.
    pub id: [c_char; 256],
    /// Its kind as the topology JSON writes it (`gpu`, `nvswitch`, `cxl_memdev`, `cpu`,
    /// …), NUL-terminated.
    pub kind: [c_char; 32],
    /// Bytes of memory it holds, every class together.
    pub memory_bytes: u64,
}

/// Takes one snapshot of the fabric session `s` sees (one round trip), for any number of
/// `fmm_view_*` queries; free it with `fmm_view_close`. A new snapshot sees later changes
/// (devices gone, links degraded); this one does not.
///
/// # Safety
/// `s` is a live session; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_view_open(s: *const FmmSession, out: *mut *mut FmmView) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let s = unsafe { get(s, "session") }?;
        let view = s.0.fabric_view().map_err(|e| fail(&e))?;
        put(out, FmmView(view))
    })
}

/// Frees a view.
///
/// # Safety
/// `v` is NULL or a live view, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_view_close(v: *mut FmmView) {
    if !v.is_null() {
        // SAFETY: the caller's contract: v came from Box::into_raw in fmm_view_open.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(unsafe { Box::from_raw(v) })));
    }
}

/// How many devices the view holds (0 for NULL).
///
/// # Safety
/// `v` is NULL or a live view.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_view_device_count(v: *const FmmView) -> usize {
    // SAFETY: the caller's contract.
    unsafe { v.as_ref() }.map_or(0, |v| v.0.fabric().inventory().devices.len())
}

/// Writes device `index` (from 0, below `fmm_view_device_count`) of the view to `out`.
///
/// # Safety
/// `v` is a live view; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_view_device(v: *const FmmView, index: usize, out: *mut FmmDeviceInfo) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let v = unsafe { get(v, "view") }?;
        if out.is_null() {
            return Err(arg_err("out is NULL"));
        }
        let devices = &v.0.fabric().inventory().devices;
        let d = devices
            .get(index)
            .ok_or_else(|| arg_err(&format!("device {index} of a view of {} devices", devices.len())))?;
        let kind = serde_json::to_value(d.kind).ok().and_then(|k| k.as_str().map(str::to_owned)).unwrap_or_default();
        let mut info = FmmDeviceInfo {
            id: [0; 256],
            kind: [0; 32],
            memory_bytes: d.memory.iter().fold(0u64, |a, m| a.saturating_add(m.size)),
        };
        fill(&mut info.id, &d.id.to_string())?;
        fill(&mut info.kind, &kind)?;
        // SAFETY: out is non-NULL (checked) and writable (caller contract).
        unsafe { out.write(info) };
        Ok(())
    })
}

/// [`fmm_path`] on the view's snapshot.
///
/// # Safety
/// `v` is a live view; `a` and `b` NUL-terminated strings; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_view_path(
    v: *const FmmView,
    a: *const c_char,
    b: *const c_char,
    out: *mut FmmPath,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (v, a, b) = unsafe { (get(v, "view")?, req_str(a, "a")?, req_str(b, "b")?) };
        path_into(&v.0, a, b, out)
    })
}

/// [`fmm_nearest_memory`] on the view's snapshot.
///
/// # Safety
/// `v` is a live view; `device` a NUL-terminated string; `out` has room for `cap` entries;
/// `count` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fmm_view_nearest_memory(
    v: *const FmmView,
    device: *const c_char,
    memory_class: c_int,
    out: *mut FmmNearMemory,
    cap: usize,
    count: *mut usize,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded caller contract.
        let (v, d) = unsafe { (get(v, "view")?, req_str(device, "device")?) };
        // SAFETY: forwarded caller contract.
        unsafe { nearest_into(&v.0, d, memory_class, out, cap, count) }
    })
}
