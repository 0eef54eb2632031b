//! Immutable snapshots of the map and lock-free translation in both directions.
//!
//! A snapshot holds a flat array of range starts (sorted) beside a parallel array of
//! 16-byte entries, and a bucket index over the high bits of the address: bucket `b` of
//! width `2^shift` stores how many starts lie at or below its lower edge, so a lookup is one
//! bucket read, a scan of the (few) starts between two bucket counts, and one entry read.
//! Buckets number about twice the ranges, so a bucket holds one or two starts on average.

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

const TAG_DIRECT: u32 = 0;
const TAG_HOLE: u32 = 1;
const TAG_SET: u32 = 2;
const TAG_SET_HOLE: u32 = 3;

/// One range: `[start, end)` with `start` in the parallel `starts` array.
#[derive(Debug, Clone, Copy)]
struct Entry {
    end: u64,
    /// Resource index for direct ranges and holes; set index for sets.
    aux: u32,
    tag: u32,
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
    starts: Vec<u64>,
    entries: Vec<Entry>,
    lo: u64,
    shift: u32,
    buckets: Vec<u32>,
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
        let mut ranges: Vec<(u64, Entry)> = Vec::with_capacity(state.placements.len() + state.interleaves.len());
        for p in &state.placements {
            let r = resources.len() as u32;
            resources.push(p.key.clone());
            if p.presence == Presence::Present {
                targets.push(Target::Direct { start: p.start, size: p.size });
                ranges.push((p.start, Entry { end: p.start + p.size, aux: r, tag: TAG_DIRECT }));
            } else {
                targets.push(Target::Hole);
                ranges.push((p.start, Entry { end: p.start + p.reserved, aux: r, tag: TAG_HOLE }));
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
            ranges.push((s.start, Entry { end, aux: si, tag }));
            sets.push(SetInfo {
                name: s.name.clone(),
                geometry: s.geometry,
                start: s.start,
                member_size: s.member_size,
                members,
            });
        }
        ranges.sort_unstable_by_key(|r| r.0);
        let starts: Vec<u64> = ranges.iter().map(|r| r.0).collect();
        let entries: Vec<Entry> = ranges.iter().map(|r| r.1).collect();
        let mut by_device: HashMap<DeviceId, Vec<u32>> = HashMap::new();
        for (i, k) in resources.iter().enumerate() {
            by_device.entry(k.device.clone()).or_default().push(i as u32);
        }
        let (lo, shift, buckets) = bucket_index(&starts, &entries);
        let mut snap = Self {
            state,
            starts,
            entries,
            lo,
            shift,
            buckets,
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
        self.starts.len()
    }

    /// Whether the map has no ranges.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// The key of a resource.
    pub fn resource(&self, r: ResourceRef) -> &ResourceKey {
        &self.resources[r.0 as usize]
    }

    /// An interleave set.
    pub fn set(&self, s: SetRef) -> &SetInfo {
        &self.sets[s.0 as usize]
    }

    /// Index of the range holding `gfa`, if any.
    #[inline]
    pub(crate) fn find(&self, gfa: u64) -> Option<usize> {
        let b = (gfa.wrapping_sub(self.lo) >> self.shift) as usize;
        if gfa < self.lo || b + 1 >= self.buckets.len() {
            return None;
        }
        let a = self.buckets[b] as usize;
        let z = self.buckets[b + 1] as usize;
        let i = if z - a <= 8 {
            let mut i = a;
            while i < z && self.starts[i] <= gfa {
                i += 1;
            }
            i
        } else {
            a + self.starts[a..z].partition_point(|&s| s <= gfa)
        };
        let i = i.checked_sub(1)?;
        (gfa < self.entries[i].end).then_some(i)
    }

    /// Translates the range at `i` (which holds `gfa`).
    #[inline]
    pub(crate) fn resolve(&self, i: usize, gfa: u64) -> Result<Location, TranslateError> {
        let e = self.entries[i];
        let off = gfa - self.starts[i];
        match e.tag {
            TAG_DIRECT => Ok(Location { resource: ResourceRef(e.aux), offset: off, set: None }),
            TAG_SET => {
                let s = &self.sets[e.aux as usize];
                let (pos, dpa) = s.geometry.hpa_to_dpa(off);
                Ok(Location { resource: s.members[pos as usize], offset: dpa, set: Some(SetRef(e.aux)) })
            }
            TAG_HOLE => Err(TranslateError::Hole { gfa, owner: HoleOwner::Resource(ResourceRef(e.aux)) }),
            _ => Err(TranslateError::Hole { gfa, owner: HoleOwner::Set(SetRef(e.aux)) }),
        }
    }

    /// GFA to (resource, offset).
    #[inline]
    pub fn translate(&self, gfa: u64) -> Result<Location, TranslateError> {
        match self.find(gfa) {
            Some(i) => self.resolve(i, gfa),
            None => Err(TranslateError::Unmapped { gfa }),
        }
    }

    /// Translates many GFAs; `out` must be at least as long as `gfas`.
    pub fn translate_batch(&self, gfas: &[u64], out: &mut [Result<Location, TranslateError>]) {
        for (g, o) in gfas.iter().zip(out.iter_mut()) {
            *o = self.translate(*g);
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
        let e = self.entries[i];
        match e.tag {
            TAG_DIRECT | TAG_HOLE => pred(ResourceRef(e.aux)),
            _ => self.sets[e.aux as usize].members.iter().all(|&m| pred(m)),
        }
    }

    /// Number of resources.
    pub fn resource_count(&self) -> usize {
        self.resources.len()
    }
}

/// Builds the bucket index: `(lo, shift, counts)`.
fn bucket_index(starts: &[u64], entries: &[Entry]) -> (u64, u32, Vec<u32>) {
    let Some(&lo) = starts.first() else {
        return (0, 0, Vec::new());
    };
    let hi = entries.iter().map(|e| e.end).max().unwrap_or(lo);
    let span = hi - lo;
    let target = (starts.len() as u64 * 2).next_power_of_two();
    let mut shift = 0u32;
    while shift < 63 && (span >> shift) >= target {
        shift += 1;
    }
    let nb = (span >> shift) as usize + 1;
    let mut buckets = Vec::with_capacity(nb + 1);
    let mut count = 0usize;
    for b in 0..=nb {
        let edge = lo.saturating_add((b as u64) << shift);
        while count < starts.len() && starts[count] <= edge {
            count += 1;
        }
        buckets.push(count as u32);
    }
    (lo, shift, buckets)
}
