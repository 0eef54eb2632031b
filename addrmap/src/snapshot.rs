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
        let (lo, shift, slots) = bucket_index(&recs, &owners);
        let mut snap =
            Self { state, recs, owners, lo, shift, slots, resources, targets, by_device, sets, partitions: Vec::new() };
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
        if gfa < self.lo || b + 1 >= self.slots.len() {
            return None;
        }
        let s = &self.slots[b];
        if gfa < s.next {
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
    #[inline]
    pub fn translate(&self, gfa: u64) -> Result<Location, TranslateError> {
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

    /// Hints the CPU to fetch the slot `gfa` will read.
    #[inline]
    fn prefetch(&self, gfa: u64) {
        let b = (gfa.wrapping_sub(self.lo) >> self.shift) as usize;
        if let Some(slot) = self.slots.get(b) {
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

/// Builds the bucket index: `(lo, shift, slots)`, one slot per bucket edge.
fn bucket_index(recs: &[Rec], owners: &[u32]) -> (u64, u32, Vec<Slot>) {
    let Some(lo) = recs.first().map(|r| r.start) else {
        return (0, 0, Vec::new());
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
    let mut count = 0usize;
    for b in 0..=nb {
        let edge = lo.saturating_add((b as u64) << shift);
        while count < recs.len() && recs[count].start <= edge {
            count += 1;
        }
        let (start0, end0, w0) = match count.checked_sub(1) {
            Some(i) => (recs[i].start, recs[i].end, owners[i]),
            None => (0, 0, 0),
        };
        let next = recs.get(count).map_or(u64::MAX, |r| r.start);
        slots.push(Slot { start0, end0, next, w0, a: count as u32 });
    }
    (lo, shift, slots)
}
