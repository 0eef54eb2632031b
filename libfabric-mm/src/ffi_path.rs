//! The C ABI of the topology queries (`fmm_path`, `fmm_alloc_nearest`), over `path.rs`;
//! the conventions are ffi.rs's (same header, same error handling).

use std::ffi::{c_char, c_int};

use crate::ffi::{FmmRegion, FmmSession, arg_err, fail, get, guard, opt_str, put};

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

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn device<'a>(p: *const c_char, what: &str) -> Result<&'a str, c_int> {
    // SAFETY: forwarded caller contract.
    unsafe { opt_str(p, what) }?.ok_or_else(|| arg_err(&format!("{what} is NULL")))
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
        let (a, b) = unsafe { (device(a, "a")?, device(b, "b")?) };
        if out.is_null() {
            return Err(arg_err("out is NULL"));
        }
        let p = s.0.path(a, b).map_err(|e| fail(&e))?;
        let mut class = [0 as c_char; 16];
        for (dst, src) in class.iter_mut().zip(p.class.bytes().take(15)) {
            *dst = src as c_char;
        }
        let r = FmmPath {
            class,
            bandwidth_mbps: p.bandwidth_mbps.unwrap_or(0),
            max_bandwidth_mbps: p.max_bandwidth_mbps.unwrap_or(0),
            latency_ns: p.latency_ns.unwrap_or(0),
            hops: u32::try_from(p.route.len()).unwrap_or(u32::MAX),
            degraded_links: u32::try_from(p.degraded_links).unwrap_or(u32::MAX),
        };
        // SAFETY: out is non-NULL (checked) and writable (caller contract).
        unsafe { out.write(r) };
        Ok(())
    })
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
        let d = unsafe { device(device_id, "device") }?;
        let r = s.0.alloc_nearest(d, size).map_err(|e| fail(&e))?;
        put(out, FmmRegion(r))
    })
}
