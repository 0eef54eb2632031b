//! The CPU and kernel hints the lookup structures use: a cache prefetch, and transparent
//! huge pages for the large lookup tables (hints only; without them everything still
//! works); and the process's euid, which the files it writes must belong to.

/// Asks the CPU to bring the cache line holding `*r` closer. No effect on other targets.
#[inline(always)]
pub fn prefetch<T>(r: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch never faults and reads nothing architecturally; the pointer
        // comes from a live reference, and SSE is part of the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(r).cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = r;
}

/// Size of a transparent huge page on x86-64 (and the common arm64 configuration).
const HUGE_PAGE: usize = 2 << 20;

/// A vector with room for `n` elements whose untouched capacity the kernel is asked to back
/// with transparent huge pages (`MADV_HUGEPAGE`), so random lookups over a table of tens of
/// MiB take one TLB entry per 2 MiB instead of one per 4 KiB. Small tables get a plain
/// vector. The advice is best effort: a kernel with THP disabled just ignores it.
pub fn huge_vec<T>(n: usize) -> Vec<T> {
    let v: Vec<T> = Vec::with_capacity(n);
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    if bytes < 2 * HUGE_PAGE {
        return v;
    }
    let start = v.as_ptr() as usize;
    let first = start.div_ceil(HUGE_PAGE) * HUGE_PAGE;
    let last = (start + bytes) / HUGE_PAGE * HUGE_PAGE;
    if last > first {
        // SAFETY: [first, last) lies inside the vector's own allocation (capacity `n`, not yet
        // written), aligned to the huge page size; MADV_HUGEPAGE only changes how the kernel
        // backs those pages, never their contents or validity, and its failure is harmless.
        let rc = unsafe { libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            tracing::debug!("madvise(MADV_HUGEPAGE) refused; lookups use 4 KiB pages");
        }
    }
    v
}

/// The process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and cannot fail.
    unsafe { libc::geteuid() }
}
