//! The quarantine across restarts: which other nodes may map which regions of this node,
//! saved in `quarantine.record` (the checksummed whole-file frame of
//! [`fabric_addrmap::durable`], magic `FBRCHOLD`, JSON) before an import across nodes is
//! granted, so that a restart of this daemon never hands out a range another node may
//! still store to. At start (`restore`) a hold of a live region marks it mapped by that
//! node (quarantined when freed); a hold of a region that is gone (freed, or reclaimed at
//! start) parks its range again, unless a live region took it — then the hold had been
//! lifted and the record was behind. Removing a hold is saved lazily: a record behind
//! only keeps a range out of use longer. Decoding is total: a value or a typed
//! [`HoldsError`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use fabric_addrmap::durable::{self, FrameError};
use serde::{Deserialize, Serialize};

use super::State;
use super::durable::ResourceKey;
use super::space::Parked;

/// File magic.
pub const MAGIC: [u8; 8] = *b"FBRCHOLD";
/// Format version.
pub const VERSION: u32 = 1;
/// Payload encoding: JSON.
const ENCODING_JSON: u32 = 1;
/// Largest payload accepted.
pub const MAX_PAYLOAD: u64 = 64 << 20;
/// Most holds a record may list.
pub const MAX_HOLDS: usize = 1 << 18;
/// The file's name in the memory root.
pub const FILE: &str = "quarantine.record";

/// One node that may map one region, with the region's range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hold {
    /// The node.
    pub node: String,
    /// Its incarnation when it imported (or left).
    pub incarnation: u64,
    /// The region (ids are never reused).
    pub region: u64,
    /// The resources its range is taken in.
    pub resources: Vec<ResourceKey>,
    /// Offset of the range in each.
    pub offset: u64,
    /// Bytes of the region (the range in each resource is an equal share).
    pub len: u64,
}

/// Why a record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HoldsError {
    /// The frame is damaged or of another kind.
    #[error("frame: {0}")]
    Frame(#[from] FrameError),
    /// The payload is no list of holds.
    #[error("payload: {0}")]
    Payload(#[from] serde_json::Error),
    /// A value out of bounds.
    #[error("{0}")]
    Invalid(String),
}

/// The bytes of a record of `values`: a version 1 frame with `magic`, JSON inside (also
/// `foreign.rs`'s).
pub(super) fn encode_json<T: Serialize>(magic: &[u8; 8], generation: u64, values: &[T]) -> Vec<u8> {
    // Serializing plain data into a Vec cannot fail.
    let payload = serde_json::to_vec(values).unwrap_or_default();
    durable::encode_frame(magic, VERSION, ENCODING_JSON, generation, &payload)
}

/// The values of a record [`encode_json`] made with `magic`, unchecked.
pub(super) fn decode_json<T: serde::de::DeserializeOwned>(
    magic: &[u8; 8],
    max_payload: u64,
    bytes: &[u8],
) -> Result<Vec<T>, HoldsError> {
    let (_, payload) = durable::decode_frame(magic, VERSION, ENCODING_JSON, max_payload, bytes)?;
    Ok(serde_json::from_slice(payload)?)
}

/// The record's bytes.
pub fn encode(generation: u64, holds: &[Hold]) -> Vec<u8> {
    encode_json(&MAGIC, generation, holds)
}

/// The holds in `bytes`, checked.
pub fn decode(bytes: &[u8]) -> Result<Vec<Hold>, HoldsError> {
    let holds: Vec<Hold> = decode_json(&MAGIC, MAX_PAYLOAD, bytes)?;
    if holds.len() > MAX_HOLDS {
        return Err(HoldsError::Invalid(format!("{} holds, more than {MAX_HOLDS}", holds.len())));
    }
    for h in &holds {
        let ways = h.resources.len() as u64;
        let name = fabric_domain::config::is_valid_name(&h.node);
        if !name || ways == 0 || ways > 64 || h.len == 0 || h.len % ways != 0 {
            return Err(HoldsError::Invalid(format!("hold of region {} by {:?} is malformed", h.region, h.node)));
        }
        if h.offset.checked_add(h.len / ways).is_none() {
            return Err(HoldsError::Invalid(format!("range of region {} overflows", h.region)));
        }
    }
    Ok(holds)
}

impl State {
    /// Every hold this state needs saved: parked ranges, live regions that nodes which
    /// left had imported, and the live imports of importer nodes' sessions.
    pub(super) fn holds(&self) -> Vec<Hold> {
        let mut out: BTreeMap<(String, u64), Hold> = BTreeMap::new();
        let mut add = |st: &State, node: &str, region: u64, resources: &[usize], offset: u64, len: u64| {
            let incarnation = st.incarnations.get(node).copied().unwrap_or(0);
            let resources = resources.iter().map(|&i| st.resource_key(i)).collect();
            out.entry((node.to_owned(), region)).or_insert_with(|| Hold {
                node: node.to_owned(),
                incarnation,
                region,
                resources,
                offset,
                len,
            });
        };
        for p in self.ledger.space.parked() {
            for n in p.nodes.keys() {
                add(self, n, p.region, &p.resources, p.offset, p.len);
            }
        }
        let live = self.mapped_by.iter().flat_map(|(r, nodes)| nodes.iter().map(move |n| (n.as_str(), *r))).chain(
            self.ledger
                .imports
                .values()
                .filter_map(|i| self.remote.get(&i.session).map(|r| (r.node.as_str(), i.region))),
        );
        for (node, region) in live {
            if let Some(r) = self.ledger.regions.get(&region) {
                add(self, node, region, &self.members(region, r.resource), r.offset, r.len);
            }
        }
        out.into_values().collect()
    }

    /// The resources region `id` (on `resource`) takes its range in.
    fn members(&self, id: u64, resource: usize) -> Vec<usize> {
        let mut m = vec![resource];
        m.extend(self.set_regions.get(&id).map(|s| s.others.clone()).unwrap_or_default());
        m
    }
}

/// The bytes of the record `what` at `path`; `None` when there is none, or (logged) when
/// it cannot be read.
pub(super) fn read_record(path: &Path, what: &str) -> Option<Vec<u8>> {
    match crate::sys::privdir::read_private(path) {
        Ok(bytes) => Some(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "{what} cannot be read");
            None
        }
    }
}

/// Reads the record at `path` (none: nothing held) and applies it to `st`, whose regions
/// were restored; returns the nodes restored with their incarnations.
pub(super) fn restore(st: &mut State, path: &Path) -> Vec<(String, u64)> {
    let Some(bytes) = read_record(path, "the quarantine record") else { return Vec::new() };
    let holds = match decode(&bytes) {
        Ok(h) => h,
        Err(e) => {
            // Nothing better to do than say so: the ranges are unknown.
            tracing::error!(path = %path.display(), error = %crate::error_chain(&e), "the quarantine record is unreadable; what other nodes may map is not known");
            return Vec::new();
        }
    };
    let mut nodes: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_region: BTreeMap<u64, (BTreeSet<String>, &Hold)> = BTreeMap::new();
    for h in &holds {
        nodes.insert(h.node.clone(), h.incarnation);
        by_region.entry(h.region).or_insert_with(|| (BTreeSet::new(), h)).0.insert(h.node.clone());
    }
    for (region, (holders, h)) in by_region {
        if st.ledger.regions.contains_key(&region) {
            st.mapped_by.entry(region).or_default().extend(holders);
            continue;
        }
        let Some(members) = h.resources.iter().map(|k| st.find_resource(k)).collect::<Option<Vec<usize>>>() else {
            tracing::warn!(region, "a quarantined range lies on a resource that is gone; dropped");
            continue;
        };
        // Each node lets go of a range kept across the restart as a whole: it rejoins
        // (or, at the latest, first asks this incarnation anything) holding nothing of it.
        let nodes = holders.iter().map(|n| (n.clone(), 1)).collect();
        if !st.ledger.space.park_restored(Parked { region, nodes, resources: members, offset: h.offset, len: h.len }) {
            tracing::info!(region, "a quarantined range is another region's now (its quarantine had been lifted)");
            continue;
        }
        tracing::info!(region, len = h.len, nodes = ?holders, "a freed region's range stays quarantined across the restart");
    }
    for (node, incarnation) in &nodes {
        st.incarnations.insert(node.clone(), *incarnation);
    }
    nodes.into_iter().collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use fabric_proto::wire::MemoryClass;

    use super::*;

    fn hold(node: &str, region: u64) -> Hold {
        let key = ResourceKey { device: "uuid:GPU-0".try_into().unwrap(), kind: MemoryClass::Hbm, ordinal: 0 };
        Hold { node: node.into(), incarnation: 3, region, resources: vec![key], offset: 2 << 20, len: 4 << 20 }
    }

    #[test]
    fn a_record_round_trips_and_damage_is_a_typed_error() {
        let holds = vec![hold("b", 1), hold("c", 1)];
        let bytes = encode(7, &holds);
        assert_eq!(decode(&bytes).unwrap(), holds);
        let mut torn = bytes.clone();
        torn.truncate(bytes.len() - 3);
        assert!(matches!(decode(&torn), Err(HoldsError::Frame(_))));
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(decode(&flipped).is_err());
        let odd = Hold { len: 3, resources: vec![hold("b", 1).resources[0].clone(); 2], ..hold("b", 1) };
        assert!(matches!(decode(&encode(1, &[odd])), Err(HoldsError::Invalid(_))));
        let wrap = Hold { offset: u64::MAX, ..hold("b", 1) };
        assert!(matches!(decode(&encode(1, &[wrap])), Err(HoldsError::Invalid(_))));
        assert!(matches!(
            decode(&encode(1, &[Hold { node: String::new(), ..hold("b", 1) }])),
            Err(HoldsError::Invalid(_))
        ));
    }
}
