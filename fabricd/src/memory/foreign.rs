//! Another host's memory this node's clients map, across restarts of this daemon: the set
//! ranges held out of the allocators for imports of shared CXL memory
//! ([`Memory::hold_foreign`]) saved in `foreign.record` (the checksummed whole-file frame of
//! [`fabric_addrmap::durable`], magic `FBRCFRGN`, JSON) before the client is handed the
//! range. A client keeps its mapping of a whole DAX device when its fabricd restarts, so at
//! start (`restore`) each saved range is held again, for `memory.resume_grace_s` — as long
//! as this node's own orphaned regions wait for their clients — and then given back
//! ([`Memory::lift_restored_foreign`]). Removing a range is saved lazily: a record behind
//! only keeps a range out of use longer. Decoding is total: a value or a typed
//! [`HoldsError`].

use std::path::Path;

use fabric_addrmap::durable;
use serde::{Deserialize, Serialize};

use super::durable::ResourceKey;
use super::holds::HoldsError;
use super::set::ForeignRange;
use super::{Memory, MemoryError, State};

/// File magic (format version 1, JSON, as `quarantine.record`).
pub const MAGIC: [u8; 8] = *b"FBRCFRGN";
/// Largest payload accepted.
pub const MAX_PAYLOAD: u64 = 16 << 20;
/// Most ranges a record may list.
pub const MAX_RANGES: usize = 1 << 16;
/// Most members of a set a range may name.
pub const MAX_MEMBERS: usize = 64;
/// The file's name in the memory root.
pub const FILE: &str = "foreign.record";

/// One range of a set's members this node's clients map as another host's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedRange {
    /// The members' resources, in position order.
    pub resources: Vec<ResourceKey>,
    /// The DPA offset of the range in each.
    pub offset: u64,
    /// Bytes of it in each.
    pub len: u64,
}

/// The record's bytes.
pub fn encode(generation: u64, ranges: &[SavedRange]) -> Vec<u8> {
    super::holds::encode_json(&MAGIC, generation, ranges)
}

/// The ranges in `bytes`, checked.
pub fn decode(bytes: &[u8]) -> Result<Vec<SavedRange>, HoldsError> {
    let ranges: Vec<SavedRange> = super::holds::decode_json(&MAGIC, MAX_PAYLOAD, bytes)?;
    if ranges.len() > MAX_RANGES {
        return Err(HoldsError::Invalid(format!("{} ranges, more than {MAX_RANGES}", ranges.len())));
    }
    for r in &ranges {
        let ways = r.resources.len();
        if ways == 0 || ways > MAX_MEMBERS || r.len == 0 || r.offset.checked_add(r.len).is_none() {
            return Err(HoldsError::Invalid(format!("the range at {:#x}+{:#x} is malformed", r.offset, r.len)));
        }
    }
    Ok(ranges)
}

impl State {
    /// The set ranges held for imports now, as saved (in one order, to compare).
    fn foreign_saved(&self) -> Vec<SavedRange> {
        let mut held: Vec<&ForeignRange> = self.foreign.keys().collect();
        held.sort_by_key(|f| (f.offset, f.len, &f.resources));
        (held.into_iter())
            .map(|f| SavedRange {
                resources: f.resources.iter().map(|&i| self.resource_key(i)).collect(),
                offset: f.offset,
                len: f.len,
            })
            .collect()
    }
}

/// Reads the record at `path` (none: nothing held) and holds each range again in `st`,
/// whose regions were restored, as one restart's user; returns the ranges held.
pub(super) fn restore(st: &mut State, path: &Path) -> Vec<ForeignRange> {
    let Some(bytes) = super::holds::read_record(path, "the foreign-range record") else { return Vec::new() };
    let ranges = match decode(&bytes) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(path = %path.display(), error = %crate::error_chain(&e), "the foreign-range record is unreadable; what clients here may still map of other hosts' memory is not known");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for r in ranges {
        let Some(resources) = r.resources.iter().map(|k| st.find_resource(k)).collect::<Option<Vec<usize>>>() else {
            tracing::warn!(
                offset = r.offset,
                len = r.len,
                "a range of another host's memory lies on a resource that is gone; dropped"
            );
            continue;
        };
        let range = ForeignRange { resources, offset: r.offset, len: r.len };
        if st.foreign.contains_key(&range) {
            continue;
        }
        if !st.take_foreign(&range) {
            tracing::info!(
                offset = r.offset,
                len = r.len,
                "a range of another host's memory is this node's region now (the record was behind)"
            );
            continue;
        }
        tracing::info!(
            offset = r.offset,
            len = r.len,
            ways = range.resources.len(),
            "a range of another host's memory a client here may still map stays held across the restart"
        );
        out.push(range);
    }
    out
}

impl Memory {
    /// Saves the set ranges held for imports in `foreign.record` when they changed since
    /// the last save (a whole-file replace, fsynced), so that a restart of this daemon
    /// keeps them out of its allocators while a client may map them.
    pub fn save_foreign(&self) -> Result<(), MemoryError> {
        let mut saved = self.foreign_saved.lock().unwrap_or_else(|p| p.into_inner());
        let ranges = self.state().foreign_saved();
        if saved.1.as_ref() == Some(&ranges) {
            return Ok(());
        }
        let path = self.root.join(FILE);
        let bytes = encode(saved.0 + 1, &ranges);
        durable::write_whole(&path, &bytes).map_err(|e| MemoryError::Io { path: e.path, source: e.source })?;
        *saved = (saved.0 + 1, Some(ranges));
        Ok(())
    }

    /// [`Memory::save_foreign`] where a failure only keeps a range out of use longer:
    /// logged.
    pub(super) fn save_foreign_or_log(&self) {
        if let Err(e) = self.save_foreign() {
            tracing::warn!(error = %crate::error_chain(&e), "the foreign-range record was not updated; it keeps ranges that went");
        }
    }

    /// Whether ranges of other hosts' memory held across the restart wait for
    /// [`Memory::lift_restored_foreign`].
    pub fn has_restored_foreign(&self) -> bool {
        !self.state().foreign_restored.is_empty()
    }

    /// Gives back the ranges held across the restart (the resume grace period is over:
    /// the clients that mapped them had that long to come back and release them); a range
    /// an import made since still holds stays held. Returns how many ranges the restart
    /// held.
    pub fn lift_restored_foreign(&self) -> usize {
        let (held, freed) = {
            let mut st = self.state();
            let restored = std::mem::take(&mut st.foreign_restored);
            (restored.len(), restored.iter().filter(|r| st.drop_foreign(r)).count())
        };
        // Saved once for the whole lift.
        if freed > 0 {
            self.save_foreign_or_log();
        }
        held
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use fabric_proto::wire::MemoryClass;

    use super::*;

    fn range(offset: u64) -> SavedRange {
        let key = |o| ResourceKey {
            device: "serial:cxl/0x5eed".try_into().unwrap(),
            kind: MemoryClass::CxlVolatile,
            ordinal: o,
        };
        SavedRange { resources: vec![key(0), key(1)], offset, len: 2 << 20 }
    }

    #[test]
    fn a_record_round_trips_and_damage_is_a_typed_error() {
        let ranges = vec![range(0), range(4 << 20)];
        let bytes = encode(3, &ranges);
        assert_eq!(decode(&bytes).unwrap(), ranges);
        let mut torn = bytes.clone();
        torn.truncate(bytes.len() - 1);
        assert!(matches!(decode(&torn), Err(HoldsError::Frame(_))));
        assert!(matches!(decode(&crate::memory::holds::encode(1, &[])), Err(HoldsError::Frame(_))), "another record");
        let empty = SavedRange { resources: Vec::new(), ..range(0) };
        assert!(matches!(decode(&encode(1, &[empty])), Err(HoldsError::Invalid(_))));
        let wrap = SavedRange { offset: u64::MAX, ..range(0) };
        assert!(matches!(decode(&encode(1, &[wrap])), Err(HoldsError::Invalid(_))));
        let nothing = SavedRange { len: 0, ..range(0) };
        assert!(matches!(decode(&encode(1, &[nothing])), Err(HoldsError::Invalid(_))));
    }
}
