//! This node's records: its placements (`placements/<node>`), made from a snapshot of its
//! map, and its topology (`topology/<node>`, made by `Domain::fabric_changed`); their
//! writes are fenced by the node's membership (`fabric_domain::fence`): a node whose lease
//! ended, or whose member key is another daemon's, writes nothing.

use fabric_addrmap::Snapshot;
use fabric_addrmap::state::Presence;
use fabric_domain::records::{self, RECORD_VERSION, Record};
use fabric_domain::{DomainClient, EtcdError, Fence, PlacedKind, PlacedRange, PlacementsRecord};

/// The ranges of `node` in `snap`, by start.
pub fn record(snap: &Snapshot, node: &str, incarnation: u64, slot: u32, span: u64) -> PlacementsRecord {
    let st = snap.state();
    let mut ranges: Vec<PlacedRange> = Vec::new();
    for p in st.placements.iter().filter(|p| p.node == node) {
        let (kind, size) = match p.presence {
            Presence::Present => (PlacedKind::Direct, p.size),
            Presence::Vanished { .. } => (PlacedKind::Hole, 0),
        };
        let memory = serde_json::to_value(p.key.kind).ok().and_then(|v| v.as_str().map(str::to_owned));
        ranges.push(PlacedRange {
            start: p.start,
            reserved: p.reserved,
            size,
            kind,
            owner: p.key.device.to_string(),
            memory,
            ordinal: p.key.ordinal,
        });
    }
    for s in st.interleaves.iter().filter(|s| s.node == node) {
        let (kind, size) = match s.presence {
            Presence::Present => (PlacedKind::Interleave, s.size()),
            Presence::Vanished { .. } => (PlacedKind::Hole, 0),
        };
        ranges.push(PlacedRange {
            start: s.start,
            reserved: s.reserved,
            size,
            kind,
            owner: format!("set:{}", s.name),
            memory: None,
            ordinal: 0,
        });
    }
    ranges.sort_by_key(|r| r.start);
    PlacementsRecord {
        version: RECORD_VERSION,
        node: node.to_owned(),
        incarnation,
        generation: st.generation,
        slot,
        span,
        ranges,
    }
}

/// Writes `record` at `key` while `fence`'s membership holds. `Ok(false)`: it does not
/// (the lease ended, or the member key is another membership's): nothing was written.
pub async fn write<R: Record>(
    client: &DomainClient,
    fence: &Fence,
    key: String,
    record: &R,
) -> Result<bool, EtcdError> {
    fenced(client.put_fenced(fence, key.clone(), records::encode(record)).await, &key)
}

/// Deletes this node's record at `key` under `fence`, as [`write()`] writes one.
pub async fn remove(client: &DomainClient, fence: &Fence, key: String) -> Result<bool, EtcdError> {
    fenced(client.delete_fenced(fence, key.clone()).await, &key)
}

/// A fenced write's result: `Ok(false)` when the membership no longer holds.
fn fenced(result: Result<i64, EtcdError>, key: &str) -> Result<bool, EtcdError> {
    match result {
        Ok(_) => Ok(true),
        Err(EtcdError::Fenced { reason, .. }) => {
            tracing::warn!(%key, %reason, "record not written: this membership no longer holds");
            Ok(false)
        }
        Err(e) => Err(e),
    }
}
