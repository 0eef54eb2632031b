//! Lowest-fit allocation of aligned ranges: node slots in the whole space, device ranges in
//! a node's slots. Deterministic by construction (ordered maps only).

use std::collections::{BTreeMap, HashMap};

use crate::config::align_up;

/// A set of occupied `[start, end)` intervals that hands out the lowest free aligned window.
///
/// Within one planning pass space is only ever taken, never given back, so the lowest fit
/// for a given (size, alignment, lower bound) can only move up: each such query remembers
/// where it last succeeded and resumes from there, which keeps building a map of 100,000
/// devices at O(n log n).
#[derive(Debug, Default)]
pub struct Allocator {
    occupied: BTreeMap<u64, u64>,
    hints: HashMap<(u64, u64, u64), u64>,
}

impl Allocator {
    /// An allocator with these intervals taken.
    pub fn new(taken: impl IntoIterator<Item = (u64, u64)>) -> Self {
        Self { occupied: taken.into_iter().collect(), hints: HashMap::new() }
    }

    /// Whether `[start, end)` overlaps nothing taken.
    pub fn is_free(&self, start: u64, end: u64) -> bool {
        if let Some((_, &e)) = self.occupied.range(..=start).next_back()
            && e > start
        {
            return false;
        }
        self.occupied.range(start..end).next().is_none()
    }

    /// Takes `[start, end)`; the caller checked it is free.
    pub fn take(&mut self, start: u64, end: u64) {
        self.occupied.insert(start, end);
    }

    /// Takes the lowest `align`-aligned window of `size` bytes inside `[lo, hi)`.
    pub fn alloc(&mut self, size: u64, align: u64, lo: u64, hi: u64) -> Option<u64> {
        let key = (size, align, lo);
        let mut cur = self.hints.get(&key).copied().unwrap_or(lo).max(lo);
        loop {
            let cand = align_up(cur, align)?;
            let end = cand.checked_add(size)?;
            if end > hi {
                return None;
            }
            if let Some((_, &e)) = self.occupied.range(..=cand).next_back()
                && e > cand
            {
                cur = e;
                continue;
            }
            if let Some((_, &e)) = self.occupied.range(cand..end).next() {
                cur = e;
                continue;
            }
            self.occupied.insert(cand, end);
            self.hints.insert(key, cand);
            return Some(cand);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_aligned_fit_skips_taken_space() {
        let mut a = Allocator::new([(0, 10), (16, 20)]);
        assert_eq!(a.alloc(4, 4, 0, 100), Some(12));
        assert_eq!(a.alloc(4, 4, 0, 100), Some(20));
        assert_eq!(a.alloc(8, 8, 0, 100), Some(24));
        assert_eq!(a.alloc(64, 64, 0, 100), None);
        assert!(a.is_free(32, 100));
        assert!(!a.is_free(9, 11));
        a.take(40, 48);
        assert_eq!(a.alloc(8, 8, 0, 100), Some(32));
        assert_eq!(a.alloc(8, 8, 0, 100), Some(48));
    }
}
