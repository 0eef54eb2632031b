//! Where regions lie, as part of the ledger: each resource's range allocator (indexed as
//! the registry's resources), and the ranges of freed regions parked out of them while
//! another node may still map them (quarantine, `quarantine.rs`). Plain values: no I/O,
//! no lock. A region, a set region (the same offset in every member), a restored region,
//! a foreign range and a quarantined one all take and give back their range here, all or
//! nothing over the resources they span.

use std::collections::BTreeMap;

use super::alloc::{AllocError, RangeAllocator};

/// The resources' allocators and the parked ranges (see the module doc).
#[derive(Debug, Default)]
pub(super) struct Space {
    allocators: Vec<RangeAllocator>,
    parked: Vec<Parked>,
}

/// A freed region's range, held out of the allocators.
#[derive(Debug)]
pub(super) struct Parked {
    pub(super) region: u64,
    /// The nodes that may still map it, each with the acknowledgements still awaited from
    /// it: one per import of the region it held when the region was freed (each is told
    /// apart, and a node's imports may share one mapping device, so the first
    /// acknowledgement says nothing of the others), plus one that never comes for a node
    /// that had left (it lets go by rejoining or being collected).
    pub(super) nodes: BTreeMap<String, u32>,
    /// The resources its range is taken in.
    pub(super) resources: Vec<usize>,
    pub(super) offset: u64,
    pub(super) len: u64,
}

impl Space {
    /// A space over resources of these capacities, in resource order.
    #[cfg(test)]
    pub(super) fn new(capacities: impl IntoIterator<Item = u64>) -> Self {
        Space { allocators: capacities.into_iter().map(RangeAllocator::new).collect(), parked: Vec::new() }
    }

    /// Adds a resource of `capacity` bytes; its index.
    pub(super) fn add(&mut self, capacity: u64) -> usize {
        self.allocators.push(RangeAllocator::new(capacity));
        self.allocators.len() - 1
    }

    /// Resource `i`'s allocator.
    pub(super) fn of(&self, i: usize) -> Option<&RangeAllocator> {
        self.allocators.get(i)
    }

    /// Resource `i`'s allocator, to resize (a BAR's file) or confine (a node's share)
    /// before anything is placed in it.
    pub(super) fn of_mut(&mut self, i: usize) -> Option<&mut RangeAllocator> {
        self.allocators.get_mut(i)
    }

    /// The bytes of the resources `pick` selects.
    pub(super) fn capacity_where(&self, pick: impl Fn(usize) -> bool) -> u64 {
        let sized = self.allocators.iter().enumerate().filter(|(i, _)| pick(*i));
        sized.map(|(_, a)| a.capacity()).fold(0, u64::saturating_add)
    }

    /// Places `len` bytes in the first of `candidates` (each with its alignment) where
    /// they fit, lowest offset first, and takes them; the resource and offset, or why none
    /// had room (`None`: no candidates).
    pub(super) fn place(
        &mut self,
        candidates: impl IntoIterator<Item = (usize, u64)>,
        len: u64,
    ) -> Result<(usize, u64), Option<AllocError>> {
        let mut last = None;
        for (i, align) in candidates {
            let Some(a) = self.allocators.get_mut(i) else { continue };
            match a.alloc(len, align) {
                Ok(offset) => return Ok((i, offset)),
                Err(e) => last = Some(e),
            }
        }
        Err(last)
    }

    /// Whether `[offset, offset + len)` is free in every one of `members`.
    pub(super) fn is_free(&self, members: &[usize], offset: u64, len: u64) -> bool {
        members.iter().all(|&i| self.allocators.get(i).is_some_and(|a| a.is_free(offset, len)))
    }

    /// Whether a new allocation may take `[offset, offset + len)` in every one of
    /// `members`: free, and inside each one's share.
    pub(super) fn is_allocatable(&self, members: &[usize], offset: u64, len: u64) -> bool {
        members.iter().all(|&i| self.allocators.get(i).is_some_and(|a| a.is_allocatable(offset, len)))
    }

    /// Takes `[offset, offset + len)` in every one of `members`, or nothing (`false`)
    /// when it is not free in all of them.
    pub(super) fn take(&mut self, members: &[usize], offset: u64, len: u64) -> bool {
        if len == 0 || !self.is_free(members, offset, len) {
            return false;
        }
        for &i in members {
            // Every member was checked free just above.
            self.allocators[i].reserve(offset, len);
        }
        true
    }

    /// [`Space::take`] of a range that runs past a member's size (its device shrank) but
    /// overlaps nothing: taken in every member, all or nothing. False when it overlaps, or
    /// lies inside every member (that is `take`'s).
    pub(super) fn take_past_end(&mut self, members: &[usize], offset: u64, len: u64) -> bool {
        let Some(end) = offset.checked_add(len) else { return false };
        let fits = |a: &RangeAllocator| a.overlaps_nothing(offset, len);
        let all = members.iter().all(|&i| self.allocators.get(i).is_some_and(fits));
        let past = members.iter().any(|&i| self.allocators.get(i).is_some_and(|a| end > a.capacity()));
        if len == 0 || !all || !past {
            return false;
        }
        for &i in members {
            let a = &mut self.allocators[i];
            // Every member was checked just above.
            if end <= a.capacity() {
                a.reserve(offset, len);
            } else {
                a.reserve_past_end(offset, len);
            }
        }
        true
    }

    /// Gives back the range at `offset` in every one of `members` (a member without one
    /// there is left as it is).
    pub(super) fn give_back(&mut self, members: &[usize], offset: u64) {
        for &i in members {
            if let Some(a) = self.allocators.get_mut(i) {
                a.free(offset);
            }
        }
    }

    /// Takes every free part of `[offset, offset + len)` of resource `i` for good (what
    /// another driver holds); the bytes taken.
    pub(super) fn take_free_parts(&mut self, i: usize, offset: u64, len: u64) -> u64 {
        self.allocators.get_mut(i).map_or(0, |a| a.reserve_free(offset, len))
    }

    /// Freed region `region`'s range (`offset` in each of `members`) is free again when no
    /// node holds it (`holders` empty), else parked until every one of them lets go.
    pub(super) fn release(
        &mut self,
        region: u64,
        holders: BTreeMap<String, u32>,
        members: Vec<usize>,
        offset: u64,
        len: u64,
    ) {
        if holders.is_empty() {
            self.give_back(&members, offset);
        } else {
            self.parked.push(Parked { region, nodes: holders, resources: members, offset, len });
        }
    }

    /// Parks a range again at start (`holds.rs`): taken out of `members` unless something
    /// else holds part of it now (`false`, nothing parked).
    pub(super) fn park_restored(&mut self, p: Parked) -> bool {
        let per = p.len / (p.resources.len().max(1) as u64);
        if !self.take(&p.resources, p.offset, per) {
            return false;
        }
        self.parked.push(p);
        true
    }

    /// The parked ranges.
    pub(super) fn parked(&self) -> &[Parked] {
        &self.parked
    }

    /// Bytes parked (each range once).
    pub(super) fn parked_bytes(&self) -> u64 {
        self.parked.iter().map(|p| p.len).sum()
    }

    /// Takes `node` off what it holds: one acknowledgement of `region`'s end, or all of it
    /// (`None`); ranges no node holds any more are given back. Those ranges.
    pub(super) fn unpark(&mut self, node: &str, region: Option<u64>) -> Vec<Parked> {
        let mut back = Vec::new();
        let mut keep = Vec::with_capacity(self.parked.len());
        for mut p in std::mem::take(&mut self.parked) {
            match region {
                None => {
                    p.nodes.remove(node);
                }
                Some(r) if r == p.region => {
                    if let Some(awaited) = p.nodes.get_mut(node) {
                        *awaited = awaited.saturating_sub(1);
                        if *awaited == 0 {
                            p.nodes.remove(node);
                        }
                    }
                }
                Some(_) => {}
            }
            if p.nodes.is_empty() {
                self.give_back(&p.resources, p.offset);
                back.push(p);
            } else {
                keep.push(p);
            }
        }
        self.parked = keep;
        back
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::memory::alloc::GRANULE;

    const G: u64 = GRANULE;

    fn holders(nodes: &[(&str, u32)]) -> BTreeMap<String, u32> {
        nodes.iter().map(|&(n, k)| (n.to_owned(), k)).collect()
    }

    #[test]
    fn a_range_is_taken_in_every_member_or_in_none() {
        let mut s = Space::new([8 * G, 8 * G, 4 * G]);
        assert!(s.of(1).unwrap().is_free(2 * G, G));
        assert!(s.take(&[1], 2 * G, G));
        // Member 1 holds part of it: nothing is taken in member 0 either.
        assert!(!s.take(&[0, 1], G, 2 * G));
        assert!(s.of(0).unwrap().is_free(0, 8 * G));
        // Past the end of the smallest member: refused alike.
        assert!(!s.take(&[0, 2], 4 * G, G));
        assert!(s.take(&[0, 2], 0, 2 * G));
        assert!(!s.is_free(&[0], G, G) && !s.is_free(&[2], 0, G) && s.is_free(&[1], 0, 2 * G));
        s.give_back(&[0, 2], 0);
        assert!(s.is_free(&[0, 2], 0, 4 * G));
        // An unknown resource is never free and never taken.
        assert!(!s.is_free(&[7], 0, G) && !s.take(&[0, 7], 0, G) && s.is_free(&[0], 0, G));
        assert!(!s.take(&[0], 0, 0), "an empty range is no range");
    }

    #[test]
    fn placing_takes_the_first_candidate_with_room_and_says_why_none_had() {
        let mut s = Space::new([2 * G, 8 * G]);
        assert_eq!(s.place([(0, 0), (1, 0)], 2 * G), Ok((0, 0)));
        assert_eq!(s.place([(0, 0), (1, 0)], 2 * G), Ok((1, 0)));
        // The candidate's alignment holds.
        assert_eq!(s.place([(1, 4 * G)], G), Ok((1, 4 * G)));
        assert!(matches!(s.place([(0, 0)], G), Err(Some(AllocError::NoSpace { .. }))));
        assert_eq!(s.place([(1, 3 * G)], G), Err(Some(AllocError::BadAlign(3 * G))));
        assert_eq!(s.place([], G), Err(None));
        assert_eq!(s.place([(9, 0)], G), Err(None), "an unknown resource is no candidate");
    }

    #[test]
    fn a_released_range_is_free_at_once_or_parked_until_every_holder_lets_go() {
        let mut s = Space::new([8 * G, 8 * G]);
        assert!(s.take(&[0, 1], 0, 2 * G) && s.take(&[0, 1], 2 * G, 2 * G));
        s.release(1, BTreeMap::new(), vec![0, 1], 0, 4 * G);
        assert!(s.is_free(&[0, 1], 0, 2 * G) && s.parked().is_empty());
        s.release(2, holders(&[("b", 2), ("c", 1)]), vec![0, 1], 2 * G, 4 * G);
        assert_eq!(s.parked_bytes(), 4 * G);
        assert!(!s.is_free(&[0], 2 * G, 2 * G), "a parked range is not handed out");
        // One of b's two acknowledgements, then another region's: still parked.
        assert!(s.unpark("b", Some(2)).is_empty());
        assert!(s.unpark("b", Some(9)).is_empty());
        // b lets go of everything (a new incarnation); c still holds it.
        assert!(s.unpark("b", None).is_empty());
        assert!(!s.is_free(&[0, 1], 2 * G, 2 * G));
        let back = s.unpark("c", Some(2));
        assert_eq!(back.len(), 1);
        assert_eq!((back[0].region, back[0].len), (2, 4 * G));
        assert!(s.is_free(&[0, 1], 0, 8 * G) && s.parked().is_empty() && s.parked_bytes() == 0);
    }

    #[test]
    fn a_range_parked_again_at_start_is_taken_unless_another_holds_it() {
        let mut s = Space::new([8 * G, 8 * G]);
        let parked =
            |offset| Parked { region: 4, nodes: holders(&[("b", 1)]), resources: vec![0, 1], offset, len: 4 * G };
        assert!(s.park_restored(parked(0)));
        assert!(!s.is_free(&[0], 0, 2 * G) && !s.is_free(&[1], 0, 2 * G) && s.is_free(&[0, 1], 2 * G, 6 * G));
        assert!(s.take(&[1], 4 * G, G));
        assert!(!s.park_restored(parked(4 * G)), "member 1 holds part of it");
        assert!(s.is_free(&[0], 4 * G, 2 * G), "nothing taken in member 0 either");
        assert_eq!(s.parked().len(), 1);
    }

    #[test]
    fn foreign_parts_are_taken_around_what_is_held() {
        let mut s = Space::new([8 * G]);
        assert!(s.take(&[0], 2 * G, G));
        assert_eq!(s.take_free_parts(0, G, 4 * G), 3 * G);
        assert!(!s.is_free(&[0], G, 4 * G));
        // The region's range is still its own.
        s.give_back(&[0], 2 * G);
        assert!(s.is_free(&[0], 2 * G, G));
        assert_eq!(s.take_free_parts(5, 0, G), 0);
        assert_eq!(s.capacity_where(|_| true), 8 * G);
    }
}
