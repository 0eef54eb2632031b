//! An I/O virtual address allocator for one DMA domain: 4 KiB pages, lowest-address first
//! fit below the asking device's DMA mask, freed ranges coalesced, and IOVA 0 never handed
//! out (a zero IOVA reads as "no address" in too many drivers and descriptors).

use std::collections::BTreeMap;

/// The IOMMU page: every IOVA and length is a multiple of it.
pub const PAGE: u64 = 4096;

/// Why an IOVA range could not be allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IovaError {
    /// A zero-length range was asked for.
    #[error("a registration needs at least one byte")]
    ZeroLength,
    /// The mask is outside 12..=64 bits (below 12 not even one page fits).
    #[error("DMA mask of {0} bits (a device must address 12 to 64 bits)")]
    BadMask(u8),
    /// No free range of that length lies below the mask.
    #[error("no free IOVA range of {len} bytes below 2^{mask_bits} in this DMA domain")]
    Exhausted {
        /// Bytes asked for (rounded to pages).
        len: u64,
        /// The device's DMA mask.
        mask_bits: u8,
    },
}

/// The free and allocated IOVA ranges of one domain. Arithmetic is in `u128` so that the
/// end of a 64-bit space (2^64) is representable.
#[derive(Debug, Clone)]
pub struct IovaAllocator {
    /// Free ranges, start -> end (exclusive), never adjacent (coalesced).
    free: BTreeMap<u128, u128>,
    /// Allocated ranges, start -> length.
    used: BTreeMap<u64, u64>,
}

impl Default for IovaAllocator {
    fn default() -> Self {
        Self::new()
    }
}

/// `len` rounded up to whole pages (`None` for 0 or on overflow).
pub fn page_len(len: u64) -> Option<u64> {
    if len == 0 {
        return None;
    }
    len.checked_next_multiple_of(PAGE)
}

impl IovaAllocator {
    /// The whole 64-bit space but page 0.
    pub fn new() -> Self {
        Self { free: BTreeMap::from([(u128::from(PAGE), 1u128 << 64)]), used: BTreeMap::new() }
    }

    /// Allocates `len` bytes (rounded up to pages) at the lowest IOVA where they fit
    /// entirely below `2^mask_bits`.
    pub fn alloc(&mut self, len: u64, mask_bits: u8) -> Result<u64, IovaError> {
        if !(12..=64).contains(&mask_bits) {
            return Err(IovaError::BadMask(mask_bits));
        }
        let len = page_len(len).ok_or(IovaError::ZeroLength)?;
        let limit = 1u128 << mask_bits;
        let want = u128::from(len);
        let found = self
            .free
            .iter()
            .take_while(|(s, _)| **s < limit)
            .find(|(s, e)| **s + want <= (**e).min(limit))
            .map(|(s, e)| (*s, *e));
        let Some((start, end)) = found else { return Err(IovaError::Exhausted { len, mask_bits }) };
        self.free.remove(&start);
        if start + want < end {
            self.free.insert(start + want, end);
        }
        // start + want <= limit <= 2^64 and start < 2^64, so it fits.
        let iova = u64::try_from(start).map_err(|_| IovaError::Exhausted { len, mask_bits })?;
        self.used.insert(iova, len);
        Ok(iova)
    }

    /// Frees the range allocated at `iova`, merging it with free neighbours; false if
    /// nothing was allocated there.
    pub fn free(&mut self, iova: u64) -> bool {
        let Some(len) = self.used.remove(&iova) else { return false };
        let mut start = u128::from(iova);
        let mut end = start + u128::from(len);
        if let Some((&ps, &pe)) = self.free.range(..start).next_back()
            && pe == start
        {
            self.free.remove(&ps);
            start = ps;
        }
        if let Some(ne) = self.free.remove(&end) {
            end = ne;
        }
        self.free.insert(start, end);
        true
    }

    /// Allocated ranges, `(iova, len)`, by address.
    pub fn allocated(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.used.iter().map(|(s, l)| (*s, *l))
    }

    /// Number of free ranges (1 when everything was freed: coalescing is complete).
    pub fn free_ranges(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lowest_first_fit_never_zero_and_coalesces() {
        let mut a = IovaAllocator::new();
        assert_eq!(a.alloc(1, 32), Ok(PAGE));
        assert_eq!(a.alloc(PAGE + 1, 32), Ok(2 * PAGE));
        assert_eq!(a.alloc(PAGE, 32), Ok(4 * PAGE));
        assert!(a.free(2 * PAGE));
        assert!(!a.free(2 * PAGE));
        assert_eq!(a.alloc(PAGE, 32), Ok(2 * PAGE));
        assert_eq!(a.alloc(2 * PAGE, 32), Ok(5 * PAGE));
        for (s, _) in a.allocated().collect::<Vec<_>>() {
            assert!(a.free(s));
        }
        assert_eq!(a.free_ranges(), 1);
        assert_eq!(a.alloc(0, 32), Err(IovaError::ZeroLength));
        assert_eq!(a.alloc(PAGE, 11), Err(IovaError::BadMask(11)));
        assert_eq!(a.alloc(PAGE, 65), Err(IovaError::BadMask(65)));
    }

    #[test]
    fn the_mask_bounds_every_range_and_the_top_of_64_bits_is_usable() {
        let mut a = IovaAllocator::new();
        // 2^16 bytes below a 16-bit mask: 15 pages (page 0 is never handed out).
        for i in 1..16 {
            assert_eq!(a.alloc(PAGE, 16), Ok(i * PAGE));
        }
        assert_eq!(a.alloc(PAGE, 16), Err(IovaError::Exhausted { len: PAGE, mask_bits: 16 }));
        // A wider device still finds room above.
        assert_eq!(a.alloc(PAGE, 17), Ok(16 * PAGE));
        // Everything from 17 pages to the top of the 64-bit space, 2^64 exclusive.
        let big = 0u64.wrapping_sub(17 * PAGE);
        assert_eq!(a.alloc(big, 63), Err(IovaError::Exhausted { len: big, mask_bits: 63 }));
        assert_eq!(a.alloc(big, 64), Ok(17 * PAGE));
        assert_eq!(a.alloc(PAGE, 64), Err(IovaError::Exhausted { len: PAGE, mask_bits: 64 }));
        assert_eq!(a.alloc(u64::MAX, 64), Err(IovaError::ZeroLength));
    }

    /// The reference: a list of ranges; the lowest fit is at `PAGE` or at the end of some
    /// allocated range, whichever is lowest and free.
    #[derive(Default)]
    struct Model {
        used: Vec<(u64, u64)>,
    }

    impl Model {
        fn alloc(&mut self, len: u64, mask: u8) -> Option<u64> {
            let len = page_len(len)?;
            let limit = 1u128 << mask;
            let mut cands: Vec<u64> = std::iter::once(PAGE).chain(self.used.iter().map(|(s, l)| s + l)).collect();
            cands.sort_unstable();
            let at = cands.into_iter().find(|&c| {
                u128::from(c) + u128::from(len) <= limit && self.used.iter().all(|&(s, l)| c + len <= s || s + l <= c)
            })?;
            self.used.push((at, len));
            Some(at)
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64, u8),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u64..40_000, 14u8..20).prop_map(|(l, m)| Op::Alloc(l, m)),
            2 => any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #[test]
        fn matches_the_reference(ops in proptest::collection::vec(op(), 1..200)) {
            let mut a = IovaAllocator::new();
            let mut m = Model::default();
            for o in ops {
                match o {
                    Op::Alloc(len, mask) => {
                        let got = a.alloc(len, mask);
                        let want = m.alloc(len, mask);
                        match (got, want) {
                            (Ok(g), Some(w)) => prop_assert_eq!(g, w),
                            (Err(IovaError::Exhausted { .. }), None) => {}
                            (g, w) => prop_assert!(false, "allocator {g:?}, reference {w:?}"),
                        }
                        if let Ok(g) = got {
                            prop_assert!(g >= PAGE && g % PAGE == 0);
                            prop_assert!(u128::from(g) + u128::from(page_len(len).unwrap_or(0)) <= 1u128 << mask);
                        }
                    }
                    Op::Free(i) if !m.used.is_empty() => {
                        let (s, _) = m.used.remove(i % m.used.len());
                        prop_assert!(a.free(s));
                    }
                    Op::Free(_) => {}
                }
                let ranges: Vec<(u64, u64)> = a.allocated().collect();
                let mut want = m.used.clone();
                want.sort_unstable();
                prop_assert_eq!(&ranges, &want);
                ranges.windows(2).for_each(|w| assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {w:?}"));
            }
            for (s, _) in m.used.clone() {
                prop_assert!(a.free(s));
            }
            prop_assert_eq!(a.free_ranges(), 1);
        }
    }
}
