//! Regions striped over an interleave set, and where a region sits in the global fabric
//! address space.
//!
//! A set of `ways` members maps set offset `s` to member `(s / g) % ways` at DPA
//! `(s / (g * ways)) * g + s % g` (granularity `g`; the 3/6/12-way families give the same
//! chunk arithmetic). So a set range `[S, S + L)` with `S` and `L` multiples of
//! `ways * g` is exactly the DPA range `[S / ways, (S + L) / ways)` of every member. A set
//! region reserves that DPA range in every member's allocator (2 MiB granules, so `S` and
//! `L` are multiples of `ways * 2 MiB`) and, in the sim, is backed by one file of `L`
//! bytes whose byte `i` is the set's byte `S + i`.

use crate::memory::Identity;
use fabric_topology::{DeviceId, MemoryKind};

use super::alloc::{AllocError, GRANULE};
use super::reserve::Make;
use super::{Granted, Memory, MemoryError};

/// An interleave set as the address map has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetSpec {
    /// Name.
    pub name: String,
    /// Members in position order: device, kind, ordinal.
    pub members: Vec<(DeviceId, MemoryKind, u16)>,
    /// Bytes of each member the set uses (from DPA 0).
    pub member_size: u64,
    /// GFA of the set's first byte.
    pub start: u64,
}

/// A range of a set's members that this node's clients map as another host's memory,
/// held out of the members' allocators ([`Memory::hold_foreign`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ForeignRange {
    /// The members' resources.
    pub(super) resources: Vec<usize>,
    /// The DPA and bytes on each.
    pub(super) offset: u64,
    pub(super) len: u64,
}

#[cfg(test)]
impl ForeignRange {
    /// A range of no resource, which the allocators never held (for other modules' tests).
    pub fn for_tests() -> Self {
        ForeignRange { resources: Vec::new(), offset: 0, len: 0 }
    }
}

impl super::State {
    /// The resource of a set's member `(device, kind, ordinal)`.
    pub(super) fn member(&self, (device, kind, ordinal): &(DeviceId, MemoryKind, u16)) -> Option<usize> {
        self.resources.iter().position(|r| r.device == *device && r.kind == *kind && r.ordinal == *ordinal)
    }

    /// Takes `range`, not held yet, out of its members' allocators with one user; `false`
    /// (nothing taken) when it is not free on every member.
    pub(super) fn take_foreign(&mut self, range: &ForeignRange) -> bool {
        if !self.ledger.space.take(&range.resources, range.offset, range.len) {
            return false;
        }
        self.foreign.insert(range.clone(), 1);
        true
    }

    /// One user of `range` less; the last gives it back to the allocators (`true`).
    pub(super) fn drop_foreign(&mut self, range: &ForeignRange) -> bool {
        let Some(users) = self.foreign.get_mut(range) else { return false };
        *users = users.saturating_sub(1);
        if *users > 0 {
            return false;
        }
        self.foreign.remove(range);
        self.ledger.space.give_back(&range.resources, range.offset);
        true
    }
}

/// A set region's extra state: where in the set it is and the members' reservations.
#[derive(Debug, Clone)]
pub(super) struct SetRegion {
    /// The set's name in the address map.
    pub(super) name: String,
    /// Offset of the region in the set.
    pub(super) set_offset: u64,
    /// Resources (after the first, which the region itself records) reserved at the same
    /// DPA offset.
    pub(super) others: Vec<usize>,
    /// The configured DAX device of the set its bytes are in (`None`: its own sim file),
    /// as journaled; what backs them is the region's [`super::backings::Backing`].
    pub(super) dax: Option<String>,
}

/// Where a region's bytes are, for its GFA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whereabouts {
    /// A range of one resource.
    Resource {
        /// Device.
        device: DeviceId,
        /// Kind.
        kind: MemoryKind,
        /// Ordinal of the resource among the device's of that kind.
        ordinal: u16,
        /// Offset in the resource.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// A range of an interleave set.
    Set {
        /// The set's name.
        name: String,
        /// Offset in the set.
        offset: u64,
        /// Bytes.
        len: u64,
    },
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Least common multiple (`None` on overflow or a zero argument).
fn lcm(a: u64, b: u64) -> Option<u64> {
    (a / gcd(a, b).max(1)).checked_mul(b).filter(|&l| l > 0)
}

/// The set offsets from `base` (a multiple of [`GRANULE`]) on that put a set region's GFA
/// at a multiple of `align` (a power of two; 0 or 1: any): the first, `d = base + k *
/// GRANULE` with `start + d * ways` a multiple of `align`, and the distance to the next
/// ones (its multiples after it). `None` when no such offset exists. Solved, not searched
/// (an alignment comes from the client: a search would be as long as it asks, under the
/// registry's lock): with `step = GRANULE * ways = 2^t * odd`, `k * step` must make up
/// what `start + base * ways` lacks of a multiple of `align`, a linear congruence modulo
/// a power of two.
fn aligned_from(base: u64, ways: u64, start: u64, align: u64) -> Option<(u64, u64)> {
    let step = GRANULE.checked_mul(ways).filter(|&s| s > 0)?;
    if align <= 1 {
        return Some((base, GRANULE));
    }
    let mask = align - 1;
    // Modulo `align`, a power of two that divides 2^64: wrapping arithmetic is exact.
    let lacking = align.wrapping_sub(start.wrapping_add(base.wrapping_mul(ways)) & mask) & mask;
    let t = step.trailing_zeros();
    let g = 1u64 << t;
    if g >= align {
        // Every step is a multiple of `align`: all of them, or none.
        return (lacking == 0).then_some((base, GRANULE));
    }
    if !lacking.is_multiple_of(g) {
        return None;
    }
    let m = align >> t;
    let odd = step >> t;
    // The inverse of an odd number modulo 2^64 by Newton's iteration (each doubles the
    // bits that are right; 3 are right to start with).
    let mut inv = odd;
    for _ in 0..5 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(inv)));
    }
    let k = (lacking >> t).wrapping_mul(inv) & (m - 1);
    let first = base.checked_add(k.checked_mul(GRANULE)?)?;
    Some((first, m.checked_mul(GRANULE)?))
}

impl Memory {
    /// Allocates `size` bytes (rounded up to `ways * 2 MiB`, and to a DAX device's align) striped over `set`, at the
    /// lowest set offset free in every member whose GFA is aligned to `align` (a power of
    /// two, 0 for none). Returns the region and its offset in the set.
    pub fn alloc_set(
        &self,
        owner: &Identity,
        session: u64,
        set: &SetSpec,
        size: u64,
        align: u64,
    ) -> Result<(Granted, u64), MemoryError> {
        let ways = set.members.len() as u64;
        if ways == 0 {
            return Err(MemoryError::NotFound(format!("interleave set {} has no members", set.name)));
        }
        if align != 0 && !align.is_power_of_two() {
            return Err(MemoryError::BadRequest(format!("alignment {align} is not a power of two")));
        }
        let bad = || MemoryError::BadRequest(format!("size {size} is not allocatable"));
        self.ensure_session(session, owner)?;
        let mut st = self.state();
        // A DAX device maps whole multiples of its align: the set region's length is a
        // multiple of both `ways * 2 MiB` and that.
        let unit = match st.set_backings.get(&set.name) {
            Some(b) => lcm(GRANULE * ways, b.align).ok_or_else(bad)?,
            None => GRANULE * ways,
        };
        let len = size.checked_next_multiple_of(unit).filter(|&l| l > 0).ok_or_else(bad)?;
        let per = len / ways;
        self.check(&st, owner.uid, len, 1)?;
        let mut idx = Vec::with_capacity(set.members.len());
        for member in &set.members {
            let i = st.member(member).ok_or_else(|| {
                MemoryError::NotFound(format!("member {} of set {} has no such memory", member.0, set.name))
            })?;
            idx.push(i);
        }
        if let Some(why) = st.lost_among(&idx) {
            return Err(MemoryError::DeviceLost(format!("interleave set {}: {why}", set.name)));
        }
        // Lowest candidates: the start, where regions end, where this node's shares begin.
        let mut cands: Vec<u64> = std::iter::once(0)
            .chain(idx.iter().filter_map(|&i| st.ledger.space.of(i)).flat_map(|a| a.ends()))
            .chain(
                idx.iter()
                    .filter_map(|&i| st.ledger.space.of(i))
                    .flat_map(|a| a.windows().unwrap_or_default().iter().map(|w| w.0)),
            )
            .collect();
        let device = st.set_backings.get(&set.name).cloned();
        if device.is_none()
            && let Some(why) = idx.iter().find_map(|&i| st.resources[i].unserved())
        {
            return Err(MemoryError::NotImplemented(format!("interleave set {}: {why}", set.name)));
        }
        // A DAX device maps at its own alignment, and holds only its part of the set.
        let dev_align = device.as_ref().map_or(0, |b| b.align);
        if let Some(b) = &device {
            cands.push(b.start.div_ceil(ways));
        }
        cands.sort_unstable();
        cands.dedup();
        let gfa_ok = |d: u64| align == 0 || set.start.wrapping_add(d * ways).is_multiple_of(align);
        let dev_ok = |d: u64| {
            device.as_ref().is_none_or(|b| b.file_offset(d * ways, len).is_some_and(|o| o.is_multiple_of(b.align)))
        };
        let fits = |d: u64| {
            d.checked_add(per).is_some_and(|e| e <= set.member_size)
                && dev_ok(d)
                && st.ledger.space.is_allocatable(&idx, d, per)
        };
        // Both alignments are reached within max(align, the device's) / (2 MiB * ways)
        // granules of any candidate; of those offsets, only the ones whose GFA is aligned
        // are tried (`aligned_from`), and none past the members' end.
        let window = (align.max(dev_align) / (GRANULE * ways)).max(1).saturating_mul(GRANULE);
        let found = cands.into_iter().find_map(|c| {
            let base = c.checked_next_multiple_of(GRANULE)?;
            let (first, period) = aligned_from(base, ways, set.start, align)?;
            let end = base.saturating_add(window).min(set.member_size);
            std::iter::successors(Some(first), |d| d.checked_add(period))
                .take_while(|&d| d < end)
                .find(|&d| gfa_ok(d) && fits(d))
        });
        let Some(dpa) = found else {
            return Err(MemoryError::NoSpace(AllocError::NoSpace {
                len,
                align: align.max(GRANULE * ways),
                capacity: set.member_size * ways,
            }));
        };
        if !st.ledger.space.take(&idx, dpa, per) {
            // Checked allocatable just above, under the same lock.
            let align = align.max(GRANULE * ways);
            return Err(MemoryError::NoSpace(AllocError::NoSpace { len, align, capacity: set.member_size * ways }));
        }
        let res = st.reserve(owner, session, idx.clone(), dpa, len)?;
        let path = st.resources[idx[0]].dir.join(format!("r{}", res.id));
        let set_offset = dpa * ways;
        let durable = st.log.is_some();
        drop(st);
        let part = SetRegion {
            name: set.name.clone(),
            set_offset,
            others: idx[1..].to_vec(),
            dax: device.as_ref().map(|b| b.name.clone()),
        };
        let make = Make::File { device, offset: set_offset, path, durable };
        let id = res.id;
        let g = self.make_and_commit(res, &make, Some(part))?;
        tracing::info!(uid = owner.uid, pid = owner.pid, session, region = id, set = %set.name, set_offset, len, "set region allocated");
        Ok((g, set_offset))
    }

    /// Holds the set range `[offset, offset + len)` of `set` out of this node's allocators
    /// for a client's import of another host's region there (shared CXL memory), when it
    /// lies on DPAs no region of this node holds on any member (the range must be whole
    /// granules of every member): this node neither exposes its own memory through
    /// another host's grant nor, while the import lives, places a region of its own on
    /// memory a client maps as another host's. Imports of the same range share one hold;
    /// `None` when the range is not free (or not granules). Given back with
    /// [`Memory::release_foreign`].
    pub fn hold_foreign(&self, set: &SetSpec, offset: u64, len: u64) -> Option<ForeignRange> {
        let ways = set.members.len() as u64;
        let unit = GRANULE * ways;
        if ways == 0 || len == 0 || !offset.is_multiple_of(unit) || !len.is_multiple_of(unit) {
            return None;
        }
        let mut st = self.state();
        let resources = set.members.iter().map(|m| st.member(m)).collect::<Option<Vec<usize>>>()?;
        let key = ForeignRange { resources, offset: offset / ways, len: len / ways };
        if let Some(users) = st.foreign.get_mut(&key) {
            *users += 1;
            return Some(key);
        }
        st.take_foreign(&key).then_some(key)
    }

    /// Keeps `range` out of the allocators until the daemon restarts, whatever its imports
    /// do: memory a client may still map as another host's (a device the kernel would not
    /// delete).
    pub fn keep_foreign(&self, range: &ForeignRange) {
        if let Some(users) = self.state().foreign.get_mut(range) {
            *users = users.saturating_add(1);
        }
    }

    /// One import of `range` less; the last gives the range back to the allocators.
    pub fn release_foreign(&self, range: &ForeignRange) {
        let freed = self.state().drop_foreign(range);
        if freed {
            self.save_foreign_or_log();
        }
    }

    /// Where region `id` is: a range of one resource or of an interleave set.
    pub fn whereabouts(&self, id: u64) -> Option<Whereabouts> {
        Self::whereabouts_in(&self.state(), id)
    }

    /// [`Memory::whereabouts`] under the registry lock.
    pub(super) fn whereabouts_in(st: &super::State, id: u64) -> Option<Whereabouts> {
        let r = st.ledger.regions.get(&id)?;
        if let Some(s) = st.set_regions.get(&id) {
            return Some(Whereabouts::Set { name: s.name.clone(), offset: s.set_offset, len: r.len });
        }
        let res = &st.resources[r.resource];
        Some(Whereabouts::Resource {
            device: res.device.clone(),
            kind: res.kind,
            ordinal: res.ordinal,
            offset: r.offset,
            len: r.len,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::memory::ledger_tests::{inventory, me, open};
    use crate::memory::{Place, Whereabouts};

    const MIB: u64 = 1 << 20;

    /// `aligned_from` against the search it replaces: every offset from `base`, granule
    /// by granule, whose GFA is aligned — the first, and the next one after it.
    #[test]
    fn an_aligned_set_offset_is_solved_as_the_search_found_it() {
        let aligned = |d: u64, ways: u64, start: u64, align: u64| {
            align <= 1 || start.wrapping_add(d * ways).is_multiple_of(align)
        };
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        for _ in 0..4000 {
            let ways = 1 + next(12);
            let align = match next(4) {
                0 => 0,
                _ => 1 << next(34),
            };
            let start = next(1 << 36) & !(next(2).saturating_mul(0xfff));
            let base = next(1 << 10) * GRANULE;
            let found = aligned_from(base, ways, start, align);
            // Every aligned offset recurs within `align` granules; two periods are searched.
            let searched: Vec<u64> = (0..2 * align.max(1) / GRANULE.min(align.max(1)) + 2)
                .map(|k| base + k * GRANULE)
                .filter(|&d| aligned(d, ways, start, align))
                .take(2)
                .collect();
            match (found, searched.as_slice()) {
                (None, []) => {}
                (Some((first, _)), [only]) => assert_eq!(first, *only, "ways {ways} align {align:#x} start {start:#x}"),
                (Some((first, period)), [a, b, ..]) => {
                    assert_eq!((first, first + period), (*a, *b), "ways {ways} align {align:#x} start {start:#x}");
                }
                (found, searched) => {
                    panic!("ways {ways} align {align:#x} start {start:#x}: {found:?} against {searched:?}")
                }
            }
        }
        // A client's alignment of 2^63 is answered at once, not searched for.
        assert_eq!(aligned_from(0, 3, 0, 1 << 63), Some((0, 1 << 63)));
        assert_eq!(aligned_from(GRANULE, 3, 0, 1 << 63), Some((1 << 63, 1 << 63)));
        assert_eq!(aligned_from(GRANULE, 3, 1 << 20, 1 << 63), None);
    }

    /// Where region `id` lies in its resource.
    fn offset_of(m: &Memory, id: u64) -> u64 {
        match m.whereabouts(id) {
            Some(Whereabouts::Resource { offset, .. }) => offset,
            other => panic!("region {id}: {other:?}"),
        }
    }

    /// A one-way "set" over the GPU's HBM (the ranges another host's grants name), the
    /// place of this node's own regions there, and where the next of them would go.
    fn one_way_set(gpu: DeviceId) -> (SetSpec, Place, impl Fn(&Memory) -> u64) {
        let set = SetSpec {
            name: "s".into(),
            members: vec![(gpu.clone(), MemoryKind::Hbm, 0)],
            member_size: 256 * MIB,
            start: 0,
        };
        let place = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
        let next = place.clone();
        let alloc = move |m: &Memory| {
            let g = m.alloc(&me(), 1, &next, 4 * MIB, 0).unwrap();
            let at = offset_of(m, g.region);
            m.free(1, g.region).unwrap();
            at
        };
        (set, place, alloc)
    }

    #[test]
    fn a_set_region_aligned_past_the_set_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory();
        let m = open(dir.path(), &inv);
        let (set, place, _) = one_way_set(gpu);
        // The set's offset 0, where every alignment holds, is taken.
        m.alloc(&me(), 1, &place, 4 * MIB, 0).unwrap();
        let t = std::time::Instant::now();
        // A search granule by granule took 2^42 steps for this under the registry's lock.
        let far = m.alloc_set(&me(), 1, &set, 4 * MIB, 1 << 63);
        assert!(matches!(far, Err(MemoryError::NoSpace(_))), "{far:?}");
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "{:?}", t.elapsed());
        let (g, offset) = m.alloc_set(&me(), 1, &set, 4 * MIB, 8 * MIB).unwrap();
        assert_eq!(offset, 8 * MIB, "the lowest free offset aligned to 8 MiB");
        m.free(1, g.region).unwrap();
    }

    #[test]
    fn a_held_foreign_range_keeps_allocations_off_until_its_last_import_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory();
        let m = open(dir.path(), &inv);
        let (set, place, alloc) = one_way_set(gpu);
        assert_eq!(alloc(&m), 0, "first fit starts at 0");
        // Not whole granules, or past the resource: no hold.
        assert!(m.hold_foreign(&set, MIB, 4 * MIB).is_none());
        assert!(m.hold_foreign(&set, 254 * MIB, 4 * MIB).is_none());
        let first = m.hold_foreign(&set, 0, 4 * MIB).unwrap();
        let second = m.hold_foreign(&set, 0, 4 * MIB).unwrap();
        assert_eq!(first, second, "imports of one range share its hold");
        // An overlapping range of another grant is not free.
        assert!(m.hold_foreign(&set, 2 * MIB, 4 * MIB).is_none());
        assert_eq!(alloc(&m), 4 * MIB, "held DPAs are not allocated");
        m.release_foreign(&first);
        assert_eq!(alloc(&m), 4 * MIB, "still held by the second import");
        m.release_foreign(&second);
        assert_eq!(alloc(&m), 0, "free again after the last");
        // A range whose device would not go stays held past its imports.
        let kept = m.hold_foreign(&set, 0, 4 * MIB).unwrap();
        m.keep_foreign(&kept);
        m.release_foreign(&kept);
        assert_eq!(alloc(&m), 4 * MIB, "kept until a restart");
        // A range some region of this node holds cannot be held.
        let g = m.alloc(&me(), 1, &place, 4 * MIB, 0).unwrap();
        let at = offset_of(&m, g.region);
        assert!(m.hold_foreign(&set, at, 4 * MIB).is_none(), "this node's own region at {at:#x}");
    }

    #[test]
    fn a_held_foreign_range_stays_held_across_a_restart_until_the_grace_period_ends() {
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory();
        let (set, _, alloc) = one_way_set(gpu);
        {
            let m = open(dir.path(), &inv);
            let _held = m.hold_foreign(&set, 0, 4 * MIB).unwrap();
            m.save_foreign().unwrap();
            assert!(!m.has_restored_foreign());
            // A range released before the restart is saved as gone (lazily, at once here).
            let gone = m.hold_foreign(&set, 8 * MIB, 4 * MIB).unwrap();
            m.save_foreign().unwrap();
            m.release_foreign(&gone);
            // The daemon dies here; its client keeps mapping the first range.
        }
        let m = open(dir.path(), &inv);
        assert!(m.has_restored_foreign());
        assert_eq!(alloc(&m), 4 * MIB, "the range a client may still map is not allocated");
        assert_eq!(m.hold_foreign(&set, 8 * MIB, 4 * MIB).map(|r| m.release_foreign(&r)), Some(()), "free again");
        // An import of the same range during the grace period shares the restart's hold.
        let again = m.hold_foreign(&set, 0, 4 * MIB).unwrap();
        assert_eq!(m.lift_restored_foreign(), 1);
        assert!(!m.has_restored_foreign());
        assert_eq!(alloc(&m), 4 * MIB, "still held by the import made since");
        m.release_foreign(&again);
        assert_eq!(alloc(&m), 0, "back to the allocator");
        drop(m);
        let m = open(dir.path(), &inv);
        assert!(!m.has_restored_foreign(), "the lift was saved");
        assert_eq!(alloc(&m), 0);
    }

    #[test]
    fn set_region_units_cover_ways_granules_and_the_dax_align() {
        const M: u64 = 1 << 20;
        assert_eq!(lcm(2 * 2 * M, 2 * M), Some(4 * M));
        assert_eq!(lcm(3 * 2 * M, 2 * M), Some(6 * M));
        assert_eq!(lcm(3 * 2 * M, 1 << 30), Some(3 << 30));
        assert_eq!(lcm(16 * 2 * M, 1 << 30), Some(1 << 30));
        assert_eq!(lcm(u64::MAX, 2), None);
        assert_eq!(lcm(0, 2), None);
    }
}
