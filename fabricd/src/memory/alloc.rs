//! A deterministic first-fit range allocator over one memory resource: the lowest aligned
//! offset where the (rounded) length fits wins. New allocations may be confined to windows
//! of the resource (this node's share of memory other hosts reach too); what is restored
//! or reserved at a known offset is not.

use std::collections::BTreeMap;

/// The allocation granule and default alignment: 2 MiB (a huge page).
pub const GRANULE: u64 = 2 << 20;

/// Why a range could not be allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// No free range is large enough.
    #[error("no free range of {len} bytes aligned to {align} in {capacity} bytes")]
    NoSpace {
        /// Bytes asked for (rounded).
        len: u64,
        /// Alignment.
        align: u64,
        /// The resource's size.
        capacity: u64,
    },
    /// The alignment is not a power of two.
    #[error("alignment {0} is not a power of two")]
    BadAlign(u64),
}

/// Allocated ranges of one resource, by offset.
#[derive(Debug, Clone)]
pub struct RangeAllocator {
    capacity: u64,
    used: BTreeMap<u64, u64>,
    /// Where new allocations may go, sorted and disjoint; `None`: anywhere.
    windows: Option<Vec<(u64, u64)>>,
}

/// Rounds `len` up to whole granules (`None` on overflow or zero).
pub fn round_len(len: u64) -> Option<u64> {
    if len == 0 {
        return None;
    }
    len.checked_add(GRANULE - 1).map(|l| l / GRANULE * GRANULE)
}

impl RangeAllocator {
    /// An empty allocator over `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        Self { capacity, used: BTreeMap::new(), windows: None }
    }

    /// Confines new allocations to `[offset, offset + len)` of the resource (clipped to
    /// it). Ranges already taken stay where they are.
    pub fn confine(&mut self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.capacity);
        self.windows = Some(if offset < end { vec![(offset, end)] } else { Vec::new() });
    }

    /// Where new allocations may go, when confined.
    pub fn windows(&self) -> Option<&[(u64, u64)]> {
        self.windows.as_deref()
    }

    /// Whether `[offset, offset + len)` lies in a window (always, unconfined).
    pub fn in_window(&self, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else { return false };
        self.windows.as_ref().is_none_or(|w| w.iter().any(|&(a, b)| a <= offset && end <= b))
    }

    /// Whether a new allocation may take `[offset, offset + len)`: free and in a window.
    pub fn is_allocatable(&self, offset: u64, len: u64) -> bool {
        self.in_window(offset, len) && self.is_free(offset, len)
    }

    /// The resource's size.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Sets the resource's size: its device's memory was resized (a CXL partition
    /// changed). New allocations fit the new size, and windows are clipped to it; ranges
    /// already taken stay where they are, even past a smaller size ([`Self::past_end`]).
    pub fn resize(&mut self, capacity: u64) {
        self.capacity = capacity;
        if let Some(w) = &mut self.windows {
            for (_, end) in w.iter_mut() {
                *end = (*end).min(capacity);
            }
            w.retain(|&(start, end)| start < end);
        }
    }

    /// Takes `[offset, offset + len)`, which runs past the resource's size, if it overlaps
    /// no range taken: a region restored after its device shrank keeps its range, as it
    /// does when the device shrinks under it ([`Self::resize`]). False otherwise, or when
    /// the range lies inside the size (that is [`Self::reserve`]'s).
    pub fn reserve_past_end(&mut self, offset: u64, len: u64) -> bool {
        let past = offset.checked_add(len).is_some_and(|end| end > self.capacity);
        if len == 0 || !past || !self.overlaps_nothing(offset, len) {
            return false;
        }
        self.used.insert(offset, len);
        true
    }

    /// Whether `[offset, offset + len)` overlaps no range taken, wherever it lies.
    pub fn overlaps_nothing(&self, offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else { return false };
        self.used.range(..end).next_back().is_none_or(|(&o, &l)| o + l <= offset)
    }

    /// The ranges taken that end past the resource's size, `(offset, len)`, in order.
    pub fn past_end(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.used.iter().map(|(&o, &l)| (o, l)).filter(|&(o, l)| o.saturating_add(l) > self.capacity)
    }

    /// Allocates `len` bytes (a multiple of [`GRANULE`]) at the lowest offset aligned to
    /// `align` (0: [`GRANULE`]; smaller ones are raised to it) where they fit.
    pub fn alloc(&mut self, len: u64, align: u64) -> Result<u64, AllocError> {
        if align != 0 && !align.is_power_of_two() {
            return Err(AllocError::BadAlign(align));
        }
        let align = align.max(GRANULE);
        let no_space = AllocError::NoSpace { len, align, capacity: self.capacity };
        let whole = [(0, self.capacity)];
        let windows = self.windows.as_deref().unwrap_or(&whole);
        // The free gaps between allocations, in order, each cut by the windows.
        let ends = std::iter::once(0).chain(self.used.iter().map(|(&o, &l)| o + l));
        let starts = self.used.keys().copied().chain(std::iter::once(self.capacity));
        for (gap_start, gap_end) in ends.zip(starts) {
            for &(w_start, w_end) in windows {
                let (lo, hi) = (gap_start.max(w_start), gap_end.min(w_end));
                let Some(start) = lo.checked_next_multiple_of(align) else { continue };
                if start.checked_add(len).is_some_and(|end| end <= hi) {
                    self.used.insert(start, len);
                    return Ok(start);
                }
            }
        }
        Err(no_space)
    }

    /// Whether `[offset, offset + len)` lies in the resource and overlaps no allocation.
    pub fn is_free(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|e| e <= self.capacity) && self.overlaps_nothing(offset, len)
    }

    /// Takes `[offset, offset + len)` if it is free; false otherwise.
    pub fn reserve(&mut self, offset: u64, len: u64) -> bool {
        if len == 0 || !self.is_free(offset, len) {
            return false;
        }
        self.used.insert(offset, len);
        true
    }

    /// Takes every free part of `[offset, offset + len)` that lies in the resource, each
    /// part a range of its own (never freed by a region's end); the bytes taken.
    pub fn reserve_free(&mut self, offset: u64, len: u64) -> u64 {
        let end = offset.saturating_add(len).min(self.capacity);
        if offset >= end {
            return 0;
        }
        // What a range starting before `offset` covers of it.
        let mut at = self.used.range(..offset).next_back().map_or(offset, |(&o, &l)| offset.max(o + l));
        let mut gaps = Vec::new();
        for (&o, &l) in self.used.range(offset..end) {
            if o > at {
                gaps.push((at, o - at));
            }
            at = at.max(o + l);
        }
        if at < end {
            gaps.push((at, end - at));
        }
        for &(o, l) in &gaps {
            self.used.insert(o, l);
        }
        gaps.iter().map(|g| g.1).sum()
    }

    /// Where allocations end, in order: the candidates for the lowest common free offset.
    pub fn ends(&self) -> impl Iterator<Item = u64> + '_ {
        self.used.iter().map(|(o, l)| o + l)
    }

    /// Frees the range at `offset`; false if none starts there.
    pub fn free(&mut self, offset: u64) -> bool {
        self.used.remove(&offset).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_reuses_the_lowest_hole_and_respects_alignment() {
        let mut a = RangeAllocator::new(16 * GRANULE);
        assert_eq!(a.alloc(GRANULE, 0), Ok(0));
        assert_eq!(a.alloc(2 * GRANULE, 0), Ok(GRANULE));
        assert_eq!(a.alloc(GRANULE, 4 * GRANULE), Ok(4 * GRANULE));
        assert!(a.free(GRANULE));
        assert!(!a.free(GRANULE));
        // The hole at 1..3 granules is reused first.
        assert_eq!(a.alloc(GRANULE, 0), Ok(GRANULE));
        assert_eq!(a.alloc(GRANULE, 0), Ok(2 * GRANULE));
        assert_eq!(a.alloc(GRANULE, 0), Ok(3 * GRANULE));
        assert_eq!(a.alloc(GRANULE, 0), Ok(5 * GRANULE));
        assert_eq!(a.alloc(GRANULE, 3), Err(AllocError::BadAlign(3)));
    }

    #[test]
    fn a_resized_resource_allocates_within_its_new_size_and_keeps_what_it_gave() {
        let mut a = RangeAllocator::new(8 * GRANULE);
        assert_eq!(a.alloc(2 * GRANULE, 0), Ok(0));
        assert_eq!(a.alloc(4 * GRANULE, 0), Ok(2 * GRANULE));
        a.resize(4 * GRANULE);
        assert_eq!(a.past_end().collect::<Vec<_>>(), [(2 * GRANULE, 4 * GRANULE)], "taken past the new end");
        assert!(a.alloc(GRANULE, 0).is_err(), "nothing free below the new end");
        assert!(!a.reserve(6 * GRANULE, GRANULE), "past the new end");
        assert!(a.free(2 * GRANULE));
        assert_eq!(a.past_end().count(), 0);
        assert_eq!(a.alloc(2 * GRANULE, 0), Ok(2 * GRANULE));
        assert!(a.alloc(GRANULE, 0).is_err());
        // Grown: the new bytes are free; a window is clipped, never widened.
        a.resize(16 * GRANULE);
        assert_eq!(a.alloc(4 * GRANULE, 0), Ok(4 * GRANULE));
        a.confine(8 * GRANULE, 8 * GRANULE);
        a.resize(10 * GRANULE);
        assert_eq!(a.windows(), Some(&[(8 * GRANULE, 10 * GRANULE)][..]));
        a.resize(6 * GRANULE);
        assert_eq!(a.windows(), Some(&[][..]), "a window wholly past the end is gone");
        assert!(a.alloc(GRANULE, 0).is_err());
        // Restored past the end: taken if it overlaps nothing.
        let mut a = RangeAllocator::new(4 * GRANULE);
        assert!(!a.reserve_past_end(0, GRANULE), "inside the size: reserve's");
        assert!(a.reserve_past_end(3 * GRANULE, 2 * GRANULE));
        assert!(!a.reserve_past_end(4 * GRANULE, 2 * GRANULE), "overlaps the first");
        assert!(!a.reserve_past_end(u64::MAX, 2), "overflows");
        assert_eq!(a.past_end().collect::<Vec<_>>(), [(3 * GRANULE, 2 * GRANULE)]);
        assert_eq!(a.alloc(3 * GRANULE, 0), Ok(0));
        assert!(a.alloc(GRANULE, 0).is_err());
    }

    #[test]
    fn reserve_takes_free_ranges_only() {
        let mut a = RangeAllocator::new(8 * GRANULE);
        assert!(a.reserve(2 * GRANULE, 2 * GRANULE));
        assert!(!a.reserve(3 * GRANULE, GRANULE), "overlaps the end of the first");
        assert!(!a.reserve(GRANULE, 2 * GRANULE), "overlaps its start");
        assert!(!a.reserve(7 * GRANULE, 2 * GRANULE), "past the capacity");
        assert!(!a.reserve(u64::MAX, 2), "overflows");
        assert!(a.reserve(4 * GRANULE, GRANULE), "adjacent is fine");
        assert_eq!(a.alloc(GRANULE, 0), Ok(0));
        assert_eq!(a.alloc(GRANULE, 0), Ok(GRANULE));
        assert_eq!(a.alloc(GRANULE, 0), Ok(5 * GRANULE));
    }

    #[test]
    fn reservations_respect_neighbours_and_capacity() {
        let mut a = RangeAllocator::new(8 * GRANULE);
        assert_eq!(a.alloc(2 * GRANULE, 0), Ok(0));
        assert!(!a.is_free(GRANULE, GRANULE));
        assert!(a.is_free(2 * GRANULE, 6 * GRANULE));
        assert!(!a.is_free(2 * GRANULE, 7 * GRANULE));
        assert!(a.reserve(4 * GRANULE, GRANULE));
        assert!(!a.reserve(3 * GRANULE, 2 * GRANULE));
        assert!(!a.reserve(4 * GRANULE, 0));
        assert_eq!(a.ends().collect::<Vec<_>>(), vec![2 * GRANULE, 5 * GRANULE]);
        assert_eq!(a.alloc(2 * GRANULE, 0), Ok(2 * GRANULE));
        assert_eq!(a.alloc(GRANULE, 0), Ok(5 * GRANULE));
        assert!(a.free(4 * GRANULE));
    }

    #[test]
    fn reserve_free_takes_the_gaps_around_what_is_taken_and_nothing_past_the_end() {
        let mut a = RangeAllocator::new(10 * GRANULE);
        assert!(a.reserve(0, 2 * GRANULE));
        assert!(a.reserve(4 * GRANULE, GRANULE));
        // [1, 9) over [0, 2) and [4, 5): [2, 4) and [5, 9) taken.
        assert_eq!(a.reserve_free(GRANULE, 8 * GRANULE), 6 * GRANULE);
        assert!(!a.is_free(2 * GRANULE, GRANULE) && !a.is_free(8 * GRANULE, GRANULE));
        assert!(a.is_free(9 * GRANULE, GRANULE));
        assert_eq!(a.reserve_free(GRANULE, 8 * GRANULE), 0, "nothing left there");
        // Clipped to the capacity.
        assert_eq!(a.reserve_free(9 * GRANULE, 4 * GRANULE), GRANULE);
        assert_eq!(a.reserve_free(20 * GRANULE, GRANULE), 0);
        assert!(matches!(a.alloc(GRANULE, 0), Err(AllocError::NoSpace { .. })));
        // A region's end frees its own range only.
        assert!(a.free(4 * GRANULE));
        assert_eq!(a.alloc(GRANULE, 0), Ok(4 * GRANULE));
    }

    #[test]
    fn a_confined_allocator_places_new_ranges_only_in_its_window() {
        let mut a = RangeAllocator::new(16 * GRANULE);
        // Restored before the share was known: stays, though outside the window.
        assert!(a.reserve(GRANULE, GRANULE));
        a.confine(4 * GRANULE, 4 * GRANULE);
        assert_eq!(a.windows(), Some(&[(4 * GRANULE, 8 * GRANULE)][..]));
        assert_eq!(a.alloc(GRANULE, 0), Ok(4 * GRANULE));
        assert_eq!(a.alloc(2 * GRANULE, 2 * GRANULE), Ok(6 * GRANULE));
        assert_eq!(a.alloc(GRANULE, 0), Ok(5 * GRANULE));
        assert!(matches!(a.alloc(GRANULE, 0), Err(AllocError::NoSpace { .. })), "the window is full");
        assert!(a.is_free(8 * GRANULE, GRANULE) && !a.is_allocatable(8 * GRANULE, GRANULE));
        assert!(!a.in_window(3 * GRANULE, 2 * GRANULE) && a.in_window(5 * GRANULE, 0));
        // Reservations at a known offset (a restore) are not confined.
        assert!(a.reserve(10 * GRANULE, GRANULE));
        assert!(a.free(5 * GRANULE));
        assert_eq!(a.alloc(GRANULE, 0), Ok(5 * GRANULE));
        a.confine(20 * GRANULE, GRANULE);
        assert_eq!(a.windows(), Some(&[][..]), "a window past the resource is empty");
        assert!(matches!(a.alloc(GRANULE, 0), Err(AllocError::NoSpace { .. })));
    }

    #[test]
    fn full_and_oversized_requests_are_refused() {
        let mut a = RangeAllocator::new(4 * GRANULE);
        assert!(matches!(a.alloc(8 * GRANULE, 0), Err(AllocError::NoSpace { .. })));
        assert_eq!(a.alloc(4 * GRANULE, 0), Ok(0));
        assert!(matches!(a.alloc(GRANULE, 0), Err(AllocError::NoSpace { .. })));
        assert!(matches!(
            a.alloc(round_len(u64::MAX - 5).unwrap_or(GRANULE), 1 << 63),
            Err(AllocError::NoSpace { .. })
        ));
        assert_eq!(round_len(0), None);
        assert_eq!(round_len(1), Some(GRANULE));
        assert_eq!(round_len(u64::MAX), None);
    }
}
