//! Partition views: a tenant's window on a snapshot that resolves only ranges whose devices
//! all belong to the partition. Anything else is `NotInPartition`, distinct from `Unmapped`
//! and `Hole`, and the view never says what lies behind a range it does not own.

use std::collections::HashSet;

use fabric_topology::{DeviceId, MemoryKind};

use crate::snapshot::{Location, ResourceRef, Snapshot, TranslateError};

/// Per-partition bitsets over a snapshot's ranges and resources.
#[derive(Debug, Clone)]
pub(crate) struct PartitionIndex {
    name: String,
    ranges: Vec<u64>,
    resources: Vec<u64>,
}

fn bit(set: &[u64], i: usize) -> bool {
    set[i >> 6] & (1 << (i & 63)) != 0
}

fn set_bit(set: &mut [u64], i: usize) {
    set[i >> 6] |= 1 << (i & 63);
}

/// Builds the index of every partition in the snapshot's state.
pub(crate) fn index(snap: &Snapshot) -> Vec<PartitionIndex> {
    snap.state()
        .partitions
        .iter()
        .map(|p| {
            let devices: HashSet<&DeviceId> = p.devices.iter().collect();
            let mut resources = vec![0u64; snap.resource_count().div_ceil(64)];
            for r in 0..snap.resource_count() {
                if devices.contains(&snap.resource(ResourceRef(r as u32)).device) {
                    set_bit(&mut resources, r);
                }
            }
            let mut ranges = vec![0u64; snap.len().div_ceil(64)];
            for i in 0..snap.len() {
                if snap.entry_all(i, |r| bit(&resources, r.0 as usize)) {
                    set_bit(&mut ranges, i);
                }
            }
            PartitionIndex { name: p.name.clone(), ranges, resources }
        })
        .collect()
}

/// A snapshot seen through one partition.
#[derive(Debug, Clone, Copy)]
pub struct PartitionView<'a> {
    snap: &'a Snapshot,
    index: &'a PartitionIndex,
}

impl Snapshot {
    /// The view of a partition, if it exists.
    pub fn partition(&self, name: &str) -> Option<PartitionView<'_>> {
        self.partitions.iter().find(|p| p.name == name).map(|index| PartitionView { snap: self, index })
    }
}

impl<'a> PartitionView<'a> {
    /// The partition's name.
    pub fn name(&self) -> &str {
        &self.index.name
    }

    /// The snapshot behind the view.
    pub fn snapshot(&self) -> &'a Snapshot {
        self.snap
    }

    /// GFA to (resource, offset), for the partition's own ranges only.
    #[inline]
    pub fn translate(&self, gfa: u64) -> Result<Location, TranslateError> {
        match self.snap.find(gfa) {
            Some((i, start, w)) if bit(&self.index.ranges, i) => self.snap.resolve(start, w, gfa),
            Some(_) => Err(TranslateError::NotInPartition { gfa }),
            None => Err(TranslateError::Unmapped { gfa }),
        }
    }

    /// Translates many GFAs.
    pub fn translate_batch(&self, gfas: &[u64], out: &mut [Result<Location, TranslateError>]) {
        for (g, o) in gfas.iter().zip(out.iter_mut()) {
            *o = self.translate(*g);
        }
    }

    /// (resource, offset) to GFA, for the partition's own resources only.
    pub fn reverse_ref(&self, r: ResourceRef, offset: u64) -> Result<u64, TranslateError> {
        if !bit(&self.index.resources, r.0 as usize) {
            return Err(TranslateError::ResourceNotInPartition);
        }
        let gfa = self.snap.reverse_ref(r, offset)?;
        // A member of a set that reaches outside the partition has no GFA in this view.
        self.translate(gfa).map(|_| gfa).map_err(|_| TranslateError::ResourceNotInPartition)
    }

    /// (device, kind, ordinal, offset) to GFA.
    pub fn reverse(
        &self,
        device: &DeviceId,
        kind: MemoryKind,
        ordinal: u16,
        offset: u64,
    ) -> Result<u64, TranslateError> {
        let r = self.snap.lookup(device, kind, ordinal).ok_or(TranslateError::ResourceNotInPartition)?;
        self.reverse_ref(r, offset)
    }
}
