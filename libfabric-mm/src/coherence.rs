//! Flush and invalidate of a mapped range, for fabrics whose memory the CPU's caches do
//! not keep coherent across hosts (CXL.mem type-3 memory shared by several hosts without
//! back-invalidate): [`flush`] writes the range's dirty cache lines back to memory
//! (`clwb`, else `clflushopt`, else `clflush`, then `sfence`), so another host's next load
//! sees this host's stores; [`invalidate`] writes back and drops the lines (`clflushopt`,
//! else `clflush`, then `mfence`), so this host's next load reads memory. On other
//! architectures both are a full fence only (documented as not enough without coherence).

use crate::error::{Error, Result};

/// Bytes of a cache line on x86-64.
pub(crate) const LINE: usize = 64;

/// What the CPU offers, from CPUID leaf 7 (EBX bit 23 `clflushopt`, bit 24 `clwb`).
#[cfg(target_arch = "x86_64")]
fn features() -> (bool, bool) {
    use std::sync::OnceLock;
    static F: OnceLock<(bool, bool)> = OnceLock::new();
    *F.get_or_init(|| {
        // CPUID is on every x86-64 CPU; leaf 0 says whether leaf 7 is.
        let max = std::arch::x86_64::__cpuid(0).eax;
        if max < 7 {
            return (false, false);
        }
        let ebx = std::arch::x86_64::__cpuid_count(7, 0).ebx;
        (ebx & (1 << 23) != 0, ebx & (1 << 24) != 0)
    })
}

/// The lines `[offset, offset + len)` of a mapping of `size` bytes cover, checked: the
/// first line's address and how many lines.
pub(crate) fn lines(base: *const u8, size: usize, offset: u64, len: u64) -> Result<(usize, usize)> {
    let end = offset.checked_add(len);
    if len == 0 || end.is_none_or(|e| e > size as u64) {
        return Err(Error::InvalidArgument(format!(
            "range of {len} bytes at offset {offset} is not inside the mapping of {size} bytes"
        )));
    }
    let start = base as usize + offset as usize;
    let first = start & !(LINE - 1);
    let last = (start + len as usize - 1) & !(LINE - 1);
    Ok((first, (last - first) / LINE + 1))
}

/// Writes the lines back to memory and orders that before later stores.
pub(crate) fn flush(first: usize, count: usize) {
    each_line(first, count, false);
}

/// Writes back and drops the lines, so that later loads read memory.
pub(crate) fn invalidate(first: usize, count: usize) {
    each_line(first, count, true);
}

/// Writes back each line (`clwb` where it may stay cached, unless `drop`), then fences:
/// `sfence` after a write-back, `mfence` after dropping (later loads come after it).
fn each_line(first: usize, count: usize, drop: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let (opt, clwb) = features();
        for i in 0..count {
            let p = first + i * LINE;
            // SAFETY: `p` is inside a live mapping (checked by `lines`); the instructions
            // only write back (and may evict) its cache line.
            unsafe {
                if clwb && !drop {
                    std::arch::asm!("clwb [{}]", in(reg) p, options(nostack, preserves_flags));
                } else if opt {
                    std::arch::asm!("clflushopt [{}]", in(reg) p, options(nostack, preserves_flags));
                } else {
                    std::arch::x86_64::_mm_clflush(p as *const u8);
                }
            }
        }
        // SAFETY: fences have no preconditions.
        unsafe {
            if drop {
                std::arch::x86_64::_mm_mfence();
            } else {
                std::arch::x86_64::_mm_sfence();
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (first, count, drop);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ranges_outside_the_mapping_are_refused_and_lines_cover_the_range() {
        let buf = vec![0u8; 4096];
        let base = buf.as_ptr();
        for (offset, len) in [(0, 0), (0, 4097), (4096, 1), (4000, 97), (u64::MAX, 2)] {
            assert!(matches!(lines(base, 4096, offset, len), Err(Error::InvalidArgument(_))), "{offset}+{len}");
        }
        let (first, count) = lines(base, 4096, 0, 4096).unwrap();
        assert!(first <= base as usize && (4096 / LINE..=4096 / LINE + 1).contains(&count));
        let (_, one) = lines(base, 4096, 63, 1).unwrap();
        assert_eq!(one, 1);
        let (_, two) = lines(base, 4096, 60, 8).unwrap();
        assert!(two <= 2);
    }

    #[test]
    fn flush_and_invalidate_keep_the_bytes() {
        let mut buf = vec![0u8; 8192];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = i as u8;
        }
        let (first, count) = lines(buf.as_ptr(), buf.len(), 1, 8000).unwrap();
        flush(first, count);
        invalidate(first, count);
        assert!(buf.iter().enumerate().all(|(i, b)| *b == i as u8));
    }
}
