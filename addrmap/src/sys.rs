//! The CPU hint the lookup structures use: a cache prefetch. A hint only; without it
//! everything still works.

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
