//! Immutable snapshots of the map and lock-free translation in both directions.
//!
//! A snapshot holds a flat array of 16-byte `[start, end)` records sorted by start, a
//! parallel array of 32-bit owner words, and a bucket index over the high bits of the
//! address with about two buckets per range (the next power of two, doubled). Each bucket's
//! 32-byte slot carries a copy of the range that covers (or last starts before) the bucket's
//! lower edge and the start of the next range, so a lookup usually ends after reading one
//! slot: one cache miss for a map of any size. Only an address at or past a range start
//! inside its own bucket reads the records (a second miss). The index costs up to 128 bytes
//! per range (64 MiB for a million ranges) to buy that single miss.
//!
//! In front of the slots sits a compact array of one 4-byte word per bucket: for a bucket
//! that one range covers whole, that range's tag, owner index and how many buckets back it
//! starts (when it starts on a bucket edge), else a marker. A translation that lands in such
//! a bucket reads only that word: 8 MiB for a million ranges, small enough to stay in a
//! server's last-level cache where the 64 MiB of slots cannot. The words are kept only when
//! whole buckets hold at least half of the mapped bytes (a dense map, such as fixed node
//! slots filled with equal devices); in a sparse map most lookups would read a word only to
//! be sent on to the slots, so there the array is left empty and costs nothing.

use std::collections::HashMap;
use std::sync::Arc;

use fabric_topology::{DeviceId, MemoryKind};

use crate::interleave::Geometry;
use crate::state::{Presence, ResourceKey, State};

/// A resource of a snapshot (index into [`Snapshot::resource`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ResourceRef(pub u32);

/// An interleave set of a snapshot (index into [`Snapshot::set`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SetRef(pub u32);

/// Who holds a hole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoleOwner {
    /// A vanished resource.
    Resource(ResourceRef),
    /// An interleave set with a vanished member.
    Set(SetRef),
}

/// Where a GFA lands: a resource and a byte offset in it (a DPA offset for CXL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// The resource.
    pub resource: ResourceRef,
    /// Byte offset within the resource.
    pub offset: u64,
    /// The interleave set the GFA went through, if any.
    pub set: Option<SetRef>,
}

/// Why a translation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    /// No range holds the GFA.
    #[error("GFA {gfa:#x} is not mapped")]
    Unmapped {
        /// The address.
        gfa: u64,
    },
    /// The GFA is in a hole left by a vanished resource or set.
    #[error("GFA {gfa:#x} is in a hole reserved for a vanished owner")]
    Hole {
        /// The address.
        gfa: u64,
        /// Who holds the hole.
        owner: HoleOwner,
    },
    /// The GFA is mapped, but not in the partition asked through.
    #[error("GFA {gfa:#x} is not in this partition")]
    NotInPartition {
        /// The address.
        gfa: u64,
    },
    /// The resource is not in the map.
    #[error("resource is not mapped")]
    UnknownResource,
    /// The resource vanished; its range is a hole.
    #[error("resource has vanished; its range is a hole")]
    Vanished,
    /// The offset is past the mapped part of the resource.
    #[error("offset {offset:#x} is past the mapped {size:#x} bytes")]
    OffsetOutOfRange {
        /// Offset asked.
        offset: u64,
        /// Bytes mapped.
        size: u64,
    },
    /// The resource exists but its device is not in the partition asked through.
    #[error("resource is not in this partition")]
    ResourceNotInPartition,
}

// An owner word is `tag << 30 | index`: a resource index for direct ranges and holes, a
// set index for sets.
const TAG_SHIFT: u32 = 30;
const INDEX_MASK: u32 = (1 << TAG_SHIFT) - 1;
const TAG_DIRECT: u32 = 0;
const TAG_HOLE: u32 = 1;
const TAG_SET: u32 = 2;
const TAG_SET_HOLE: u32 = 3;

/// One range.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Rec {
    start: u64,
    end: u64,
}

/// How far ahead [`Snapshot::translate_batch`] prefetches.
const PREFETCH_DISTANCE: usize = 16;

/// One bucket: the range covering (or last starting before) the bucket's lower edge, and
/// where the next range starts. 32 bytes, two to a cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
struct Slot {
    start0: u64,
    end0: u64,
    next: u64,
    w0: u32,
    /// Number of ranges starting at or below the edge.
    a: u32,
}

/// Builds an owner word.
fn owner(tag: u32, index: usize) -> u32 {
    debug_assert!(index <= INDEX_MASK as usize);
    (tag << TAG_SHIFT) | index as u32
}

/// Where a resource's bytes are.
#[derive(Debug, Clone, Copy)]
enum Target {
    Direct { start: u64, size: u64 },
    Hole,
    Member { set: u32, pos: u32 },
}

/// An interleave set, as the snapshot uses it.
#[derive(Debug, Clone)]
pub struct SetInfo {
    /// Name.
    pub name: String,
    /// Geometry.
    pub geometry: Geometry,
    /// First GFA.
    pub start: u64,
    /// Bytes per member.
    pub member_size: u64,
    /// Members in position order.
    pub members: Vec<ResourceRef>,
}

/// An immutable, self-contained view of one generation of the map.
#[derive(Debug)]
pub struct Snapshot {
    state: Arc<State>,
    recs: Vec<Rec>,
    owners: Vec<u32>,
    lo: u64,
    shift: u32,
    slots: Vec<Slot>,
    /// Per bucket, [`fast_word`] or [`SLOW`]; one shorter than `slots`, or empty when
    /// whole buckets hold less than half of the mapped bytes.
    fast: Vec<u32>,
    resources: Vec<ResourceKey>,
    targets: Vec<Target>,
    by_device: HashMap<DeviceId, Vec<u32>>,
    sets: Vec<SetInfo>,
    pub(crate) partitions: Vec<crate::partition::PartitionIndex>,
}

impl Snapshot {
    /// Builds the lookup structures of a (valid) state.
    pub fn build(state: Arc<State>) -> Self {
        let mut resources: Vec<ResourceKey> = Vec::new();
        let mut targets: Vec<Target> = Vec::new();
        let mut ranges: Vec<(Rec, u32)> = Vec::with_capacity(state.placements.len() + state.interleaves.len());
        for p in &state.placements {
            let r = resources.len() as u32;
            resources.push(p.key.clone());
            if p.presence == Presence::Present {
                targets.push(Target::Direct { start: p.start, size: p.size });
                ranges.push((Rec { start: p.start, end: p.start + p.size }, owner(TAG_DIRECT, r as usize)));
            } else {
                targets.push(Target::Hole);
                ranges.push((Rec { start: p.start, end: p.start + p.reserved }, owner(TAG_HOLE, r as usize)));
            }
        }
        let mut sets = Vec::with_capacity(state.interleaves.len());
        for (si, s) in state.interleaves.iter().enumerate() {
            let si = si as u32;
            let present = s.presence == Presence::Present;
            let mut members = Vec::with_capacity(s.members.len());
            for (pos, m) in s.members.iter().enumerate() {
                members.push(ResourceRef(resources.len() as u32));
                resources.push(m.clone());
                targets.push(if present { Target::Member { set: si, pos: pos as u32 } } else { Target::Hole });
            }
            let (end, tag) = if present { (s.start + s.size(), TAG_SET) } else { (s.start + s.reserved, TAG_SET_HOLE) };
            ranges.push((Rec { start: s.start, end }, owner(tag, si as usize)));
            sets.push(SetInfo {
                name: s.name.clone(),
                geometry: s.geometry,
                start: s.start,
                member_size: s.member_size,
                members,
            });
        }
        ranges.sort_unstable_by_key(|r| r.0.start);
        let recs: Vec<Rec> = ranges.iter().map(|r| r.0).collect();
        let owners: Vec<u32> = ranges.iter().map(|r| r.1).collect();
        let mut by_device: HashMap<DeviceId, Vec<u32>> = HashMap::new();
        for (i, k) in resources.iter().enumerate() {
            by_device.entry(k.device.clone()).or_default().push(i as u32);
        }
        let Index { lo, shift, slots, fast } = bucket_index(&recs, &owners);
        let mut snap = Self {
            state,
            recs,
            owners,
            lo,
            shift,
            slots,
            fast,
            resources,
            targets,
            by_device,
            sets,
            partitions: Vec::new(),
        };
        snap.partitions = crate::partition::index(&snap);
        snap
    }

    /// The state this snapshot was built from.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The generation.
    pub fn generation(&self) -> u64 {
        self.state.generation
    }

    /// Number of ranges (direct, sets and holes).
    pub fn len(&self) -> usize {
        self.recs.len()
    }

    /// Whether the map has no ranges.
    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    /// The key of a resource.
    pub fn resource(&self, r: ResourceRef) -> &ResourceKey {
        &self.resources[r.0 as usize]
    }

    /// An interleave set.
    pub fn set(&self, s: SetRef) -> &SetInfo {
        &self.sets[s.0 as usize]
    }

    /// The range holding `gfa`, if any: (index, start, owner word).
    ///
    /// The bucket's slot carries the range that covers its lower edge and the start of the
    /// next range, so most lookups end after reading that one slot; only an address at or
    /// past the first start inside its bucket scans the records.
    #[inline]
    pub(crate) fn find(&self, gfa: u64) -> Option<(usize, u64, u32)> {
        let b = (gfa.wrapping_sub(self.lo) >> self.shift) as usize;
        // `b + 1` could wrap for the highest GFA of a map starting at 0 with one-byte buckets.
        if gfa < self.lo || b >= self.slots.len().saturating_sub(1) {
            return None;
        }
        let s = &self.slots[b];
        // No range starts past the edge (`next` is then `u64::MAX`, which no range can
        // start at): only the one at the edge may hold `gfa`.
        if gfa < s.next || s.a as usize == self.recs.len() {
            // `a == 0` only when no range starts at or below the edge; then `end0` is 0.
            return (gfa < s.end0).then(|| (s.a as usize - 1, s.start0, s.w0));
        }
        let a = s.a as usize;
        let z = self.slots[b + 1].a as usize;
        // recs[a].start == s.next <= gfa, so the answer is in a..z.
        let i = if z - a <= 8 {
            let mut i = a + 1;
            while i < z && self.recs[i].start <= gfa {
                i += 1;
            }
            i - 1
        } else {
            a + self.recs[a..z].partition_point(|r| r.start <= gfa) - 1
        };
        let r = self.recs[i];
        (gfa < r.end).then(|| (i, r.start, self.owners[i]))
    }

    /// Translates `gfa` in the range starting at `start` with owner word `w`.
    #[inline]
    pub(crate) fn resolve(&self, start: u64, w: u32, gfa: u64) -> Result<Location, TranslateError> {
        let aux = w & INDEX_MASK;
        let off = gfa - start;
        match w >> TAG_SHIFT {
            TAG_DIRECT => Ok(Location { resource: ResourceRef(aux), offset: off, set: None }),
            TAG_SET => {
                let s = &self.sets[aux as usize];
                let (pos, dpa) = s.geometry.hpa_to_dpa(off);
                Ok(Location { resource: s.members[pos as usize], offset: dpa, set: Some(SetRef(aux)) })
            }
            TAG_HOLE => Err(TranslateError::Hole { gfa, owner: HoleOwner::Resource(ResourceRef(aux)) }),
            _ => Err(TranslateError::Hole { gfa, owner: HoleOwner::Set(SetRef(aux)) }),
        }
    }

    /// GFA to (resource, offset).
    ///
    /// A GFA in a bucket one range covers whole reads only the bucket's 4-byte word; any
    /// other goes through the slots.
    #[inline]
    pub fn translate(&self, gfa: u64) -> Result<Location, TranslateError> {
        let b = (gfa.wrapping_sub(self.lo) >> self.shift) as usize;
        if gfa >= self.lo
            && let Some(&f) = self.fast.get(b)
            && f != SLOW
        {
            let start = self.lo + (((b - (f & BACK_MASK) as usize) as u64) << self.shift);
            let w = (f & !INDEX_MASK) | (f & INDEX_MASK) >> BACK_BITS;
            if f >> TAG_SHIFT == TAG_DIRECT {
                return Ok(Location { resource: ResourceRef(w), offset: gfa - start, set: None });
            }
            return self.resolve_out_of_line(start, w, gfa);
        }
        self.translate_slots(gfa)
    }

    /// [`Snapshot::resolve`] for sets and holes, out of line for the same reason.
    #[inline(never)]
    fn resolve_out_of_line(&self, start: u64, w: u32, gfa: u64) -> Result<Location, TranslateError> {
        self.resolve(start, w, gfa)
    }

    /// [`Snapshot::translate`] through the slots: kept out of line so that the bucket-word
    /// path stays a handful of instructions wherever it is inlined.
    #[inline(never)]
    fn translate_slots(&self, gfa: u64) -> Result<Location, TranslateError> {
        match self.find(gfa) {
            Some((_, start, w)) => self.resolve(start, w, gfa),
            None => Err(TranslateError::Unmapped { gfa }),
        }
    }

    /// Translates many GFAs; `out` must be at least as long as `gfas`.
    ///
    /// Faster per address than [`Snapshot::translate`] in a loop: the slot of the address
    /// `PREFETCH_DISTANCE` ahead is prefetched, so several cache misses are in flight at once.
    pub fn translate_batch(&self, gfas: &[u64], out: &mut [Result<Location, TranslateError>]) {
        for (k, (g, o)) in gfas.iter().zip(out.iter_mut()).enumerate() {
            if let Some(&ahead) = gfas.get(k + PREFETCH_DISTANCE) {
                self.prefetch(ahead);
            }
            *o = self.translate(*g);
        }
    }

    /// Hints the CPU to fetch what `gfa`'s lookup reads first: its bucket word, or its slot
    /// in a map without bucket words.
    #[inline]
    fn prefetch(&self, gfa: u64) {
        let b = (gfa.wrapping_sub(self.lo) >> self.shift) as usize;
        if let Some(word) = self.fast.get(b) {
            crate::sys::prefetch(word);
        } else if self.fast.is_empty()
            && let Some(slot) = self.slots.get(b)
        {
            crate::sys::prefetch(slot);
        }
    }

    /// The resource index of a key.
    pub fn lookup(&self, device: &DeviceId, kind: MemoryKind, ordinal: u16) -> Option<ResourceRef> {
        let list = self.by_device.get(device)?;
        list.iter()
            .copied()
            .find(|&r| {
                let k = &self.resources[r as usize];
                k.kind == kind && k.ordinal == ordinal
            })
            .map(ResourceRef)
    }

    /// (resource, offset) to GFA.
    #[inline]
    pub fn reverse_ref(&self, r: ResourceRef, offset: u64) -> Result<u64, TranslateError> {
        match self.targets[r.0 as usize] {
            Target::Direct { start, size } if offset < size => Ok(start + offset),
            Target::Direct { size, .. } => Err(TranslateError::OffsetOutOfRange { offset, size }),
            Target::Member { set, pos } => {
                let s = &self.sets[set as usize];
                if offset >= s.member_size {
                    return Err(TranslateError::OffsetOutOfRange { offset, size: s.member_size });
                }
                Ok(s.start + s.geometry.dpa_to_hpa(pos, offset))
            }
            Target::Hole => Err(TranslateError::Vanished),
        }
    }

    /// (device, kind, ordinal, offset) to GFA.
    pub fn reverse(
        &self,
        device: &DeviceId,
        kind: MemoryKind,
        ordinal: u16,
        offset: u64,
    ) -> Result<u64, TranslateError> {
        let r = self.lookup(device, kind, ordinal).ok_or(TranslateError::UnknownResource)?;
        self.reverse_ref(r, offset)
    }

    /// (key, offset) to GFA.
    pub fn reverse_key(&self, key: &ResourceKey, offset: u64) -> Result<u64, TranslateError> {
        self.reverse(&key.device, key.kind, key.ordinal, offset)
    }

    /// Reverses many (resource, offset) pairs.
    pub fn reverse_batch(&self, items: &[(ResourceRef, u64)], out: &mut [Result<u64, TranslateError>]) {
        for (&(r, off), o) in items.iter().zip(out.iter_mut()) {
            *o = self.reverse_ref(r, off);
        }
    }

    /// Whether every resource behind range `i` satisfies `pred` (one for a direct range or
    /// hole, every member for a set).
    pub(crate) fn entry_all(&self, i: usize, pred: impl Fn(ResourceRef) -> bool) -> bool {
        let w = self.owners[i];
        let aux = w & INDEX_MASK;
        match w >> TAG_SHIFT {
            TAG_DIRECT | TAG_HOLE => pred(ResourceRef(aux)),
            _ => self.sets[aux as usize].members.iter().all(|&m| pred(m)),
        }
    }

    /// Number of resources.
    pub fn resource_count(&self) -> usize {
        self.resources.len()
    }
}

/// A bucket word that sends the lookup to the slots.
const SLOW: u32 = u32::MAX;
/// Bits of a bucket word that count the buckets between the range's start and this bucket.
const BACK_BITS: u32 = 4;
const BACK_MASK: u32 = (1 << BACK_BITS) - 1;

/// The bucket word for a bucket that the range with owner word `w` starting `below_edge`
/// bytes below the bucket's edge covers whole: the owner's tag, its index shifted up by
/// [`BACK_BITS`], and the distance in buckets. [`SLOW`] when the range does not start on a
/// bucket edge, starts 16 or more buckets back, or its index needs more than 26 bits.
fn fast_word(w: u32, below_edge: u64, shift: u32) -> u32 {
    let back = below_edge >> shift;
    let index = w & INDEX_MASK;
    if below_edge & ((1u64 << shift) - 1) != 0 || back > u64::from(BACK_MASK) || index >= (INDEX_MASK >> BACK_BITS) {
        return SLOW;
    }
    (w & !INDEX_MASK) | index << BACK_BITS | back as u32
}

/// The bucket index of a snapshot.
struct Index {
    lo: u64,
    shift: u32,
    /// One slot per bucket edge (one more than buckets).
    slots: Vec<Slot>,
    /// One word per bucket.
    fast: Vec<u32>,
}

/// Builds the bucket index over sorted, disjoint ranges.
fn bucket_index(recs: &[Rec], owners: &[u32]) -> Index {
    let Some(lo) = recs.first().map(|r| r.start) else {
        return Index { lo: 0, shift: 0, slots: Vec::new(), fast: Vec::new() };
    };
    let hi = recs.iter().map(|r| r.end).max().unwrap_or(lo);
    let span = hi - lo;
    let target = (recs.len() as u64).next_power_of_two() * 2;
    let mut shift = 0u32;
    while shift < 63 && (span >> shift) >= target {
        shift += 1;
    }
    let nb = (span >> shift) as usize + 1;
    let mut slots = crate::sys::huge_vec(nb + 1);
    let mut fast = crate::sys::huge_vec(nb);
    let mut whole_bytes = 0u128;
    let mut count = 0usize;
    for b in 0..=nb {
        // The last edge may lie past 2^64 (`nb << shift` would wrap): it saturates.
        let edge = u64::try_from(u128::from(lo) + ((b as u128) << shift)).unwrap_or(u64::MAX);
        while count < recs.len() && recs[count].start <= edge {
            count += 1;
        }
        let (start0, end0, w0) = match count.checked_sub(1) {
            Some(i) => (recs[i].start, recs[i].end, owners[i]),
            None => (0, 0, 0),
        };
        let next = recs.get(count).map_or(u64::MAX, |r| r.start);
        slots.push(Slot { start0, end0, next, w0, a: count as u32 });
        if b < nb {
            // Whole when the range at the edge reaches the next edge (ranges are disjoint,
            // so then no other range starts inside the bucket).
            let whole = count > 0 && end0 >= edge.saturating_add(1 << shift);
            let word = if whole { fast_word(w0, edge - start0, shift) } else { SLOW };
            if word != SLOW {
                whole_bytes += 1u128 << shift;
            }
            fast.push(word);
        }
    }
    let mapped: u128 = recs.iter().map(|r| u128::from(r.end - r.start)).sum();
    if whole_bytes * 2 < mapped {
        fast = Vec::new();
    }
    Index { lo, shift, slots, fast }
}

#[cfg(test)]
mod tests {
    use fabric_topology::{Device, DeviceKind, Inventory, MemoryResource};

    use super::*;
    use crate::config::{GIB, MapConfig, NodeSpan};
    use crate::map::AddressMap;

    /// Translation through the slots alone, as before the bucket words existed.
    fn slow(snap: &Snapshot, gfa: u64) -> Result<Location, TranslateError> {
        match snap.find(gfa) {
            Some((_, start, w)) => snap.resolve(start, w, gfa),
            None => Err(TranslateError::Unmapped { gfa }),
        }
    }

    /// Ranges of uneven sizes (some below a bucket, some spanning several): the bucket words
    /// answer exactly what the slots answer, at every bucket edge, next to it, and at
    /// random addresses, and both kinds of bucket occur.
    #[test]
    fn bucket_words_agree_with_the_slots() {
        let mut devices = Vec::new();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        // Miri interprets ~1000x slower than native code: a smaller map and fewer probes.
        let nodes = if cfg!(miri) { 6 } else { 40 };
        for n in 0..nodes {
            let node = format!("node{n:02}");
            for g in 0..(n % 3 + 6) {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let size = match g {
                    3 => (rng >> 40) % (128 * GIB) + 1,
                    5 => 2 * 1024 * 1024 * ((rng >> 50) + 1),
                    _ => 128 * GIB,
                };
                let mut d = Device::new(DeviceId::uuid(&format!("GPU-{n}-{g}")), DeviceKind::Gpu, Some(&node));
                d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size, hpa: None, numa_node: None });
                devices.push(d);
            }
        }
        // Fixed slots just big enough for the largest node: dense, so the words are kept.
        let dense = MapConfig { node_span: NodeSpan::Fixed(1024 * GIB), ..MapConfig::default() };
        // Slots sixteen times that: mostly empty buckets and buckets holding several ranges.
        let sparse = MapConfig { node_span: NodeSpan::Fixed(16 * 1024 * GIB), ..MapConfig::default() };
        for (config, kept) in [(dense, true), (MapConfig::default(), true), (sparse, false)] {
            let mut map = AddressMap::new(config).unwrap();
            map.update(&inventory(&devices, 0)).unwrap();
            let snap = map.snapshot();
            let fast = snap.fast.iter().filter(|&&f| f != SLOW).count();
            assert_eq!(!snap.fast.is_empty(), kept, "{fast} of {} buckets whole", snap.fast.len());
            if kept {
                assert!(fast < snap.fast.len(), "every bucket whole: the slow path is untested");
            }
            check_every_probe(&snap, &mut rng);
            // Every fifth device vanishes: its range is a hole, through either path.
            map.update(&inventory(&devices, 5)).unwrap();
            let snap = map.snapshot();
            let holes = snap.fast.iter().filter(|&&f| f != SLOW && f >> TAG_SHIFT == TAG_HOLE).count();
            assert_eq!(holes > 0, kept, "{holes} hole buckets");
            check_every_probe(&snap, &mut rng);
        }
    }

    /// A map starting at GFA 0 with one-byte buckets: the highest GFA is unmapped, not an
    /// overflow (it once wrapped the bucket number past the end of the slots).
    #[test]
    fn highest_gfa_of_a_map_at_zero_is_unmapped() {
        let mut inv = Inventory::new();
        let mut d = Device::new(DeviceId::uuid("GPU-tiny"), DeviceKind::Gpu, Some("n0"));
        d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size: 1, hpa: None, numa_node: None });
        inv.add_device(d).unwrap();
        let mut map = AddressMap::new(MapConfig::default()).unwrap();
        map.update(&inv).unwrap();
        let snap = map.snapshot();
        assert_eq!((snap.lo, snap.shift), (0, 0), "the case this test is about");
        assert!(snap.translate(0).is_ok());
        for gfa in [1, u64::MAX - 1, u64::MAX] {
            assert_eq!(snap.translate(gfa), Err(TranslateError::Unmapped { gfa }));
            assert_eq!(snap.find(gfa), None);
        }
    }

    /// A 64-bit map of one 1 GiB GPU on node n0 at 0 and one on each further node, each
    /// node pinned at its base.
    fn map_at(bases: &[u64]) -> std::sync::Arc<Snapshot> {
        use crate::config::NodeOverride;
        let mut inv = Inventory::new();
        let mut cfg = MapConfig { address_bits: 64, ..MapConfig::default() };
        for (i, base) in bases.iter().enumerate() {
            let node = format!("n{i}");
            let mut d = Device::new(DeviceId::uuid(&format!("GPU-{i}")), DeviceKind::Gpu, Some(&node));
            d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size: GIB, hpa: None, numa_node: None });
            inv.add_device(d).unwrap();
            cfg.nodes.insert(node, NodeOverride { base: Some(*base), span: Some(GIB) });
        }
        let mut map = AddressMap::new(cfg).unwrap();
        map.update(&inv).unwrap();
        map.snapshot()
    }

    /// The top of a 64-bit space: a lookup past the last range in the last bucket found no
    /// next range and read past the records (a panic any client's translate could
    /// cause); and a bucket edge past 2^64 wrapped to the map's start, hiding the ranges
    /// above the last whole edge. Before, the first panicked and the second answered
    /// `Unmapped` for a placed range.
    #[test]
    fn lookups_at_the_top_of_a_64_bit_space_neither_panic_nor_miss() {
        let snap = map_at(&[0, 0xC000_0000_0000_0000]);
        assert_eq!(snap.recs.len(), 2, "the case this test is about");
        for gfa in [u64::MAX, u64::MAX - 1, 0xC000_0000_4000_0000] {
            assert_eq!(snap.translate(gfa), Err(TranslateError::Unmapped { gfa }));
        }
        assert!(snap.translate(0xC000_0000_3FFF_FFFF).is_ok());
        let e = 0xE000_0000_0000_0000;
        let snap = map_at(&[0, e, e + GIB, e + 2 * GIB]);
        assert_eq!(snap.recs.len(), 4);
        let mut probes = vec![u64::MAX, u64::MAX - 1, e - 1];
        for r in &snap.recs {
            probes.extend([r.start, r.start + 1, r.end - 1, r.end, r.start.wrapping_sub(1)]);
        }
        for gfa in probes {
            let linear = snap.recs.iter().position(|r| r.start <= gfa && gfa < r.end);
            assert_eq!(snap.find(gfa).map(|f| f.0), linear, "{gfa:#x}");
        }
    }

    /// The devices, less every `skip`th one (none for 0).
    fn inventory(devices: &[Device], skip: usize) -> Inventory {
        let mut inv = Inventory::new();
        for (i, d) in devices.iter().enumerate() {
            if skip == 0 || i % skip != 0 {
                inv.add_device(d.clone()).unwrap();
            }
        }
        inv
    }

    fn check_every_probe(snap: &Snapshot, rng: &mut u64) {
        let width = 1u64 << snap.shift;
        let buckets = snap.slots.len().saturating_sub(1) as u64;
        let mut probes = Vec::new();
        for b in 0..=buckets {
            let edge = snap.lo + b * width;
            probes.extend([edge.wrapping_sub(1), edge, edge + 1, edge + width / 2, edge + width - 1]);
        }
        for r in &snap.recs {
            probes.extend([r.start.wrapping_sub(1), r.start, r.end - 1, r.end]);
        }
        for _ in 0..if cfg!(miri) { 200 } else { 20_000 } {
            *rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            probes.push(snap.lo + (*rng >> 11) % (buckets * width + width));
        }
        probes.extend([0, 1, u64::MAX, snap.lo.wrapping_sub(1)]);
        for gfa in probes {
            assert_eq!(snap.translate(gfa), slow(snap, gfa), "gfa {gfa:#x}");
        }
    }
}
