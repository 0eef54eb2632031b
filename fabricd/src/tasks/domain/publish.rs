//! This node's placements record (`placements/<node>`), made from a snapshot of its map,
//! and its write, guarded by the node's own member key: the put happens only while the
//! member key lives on this node's lease, so a node whose lease ended writes nothing.

use fabric_addrmap::Snapshot;
use fabric_addrmap::state::Presence;
use fabric_domain::etcd_client::{Compare, CompareOp, Txn, TxnOp};
use fabric_domain::records::{self, RECORD_VERSION};
use fabric_domain::{DomainClient, EtcdError, PlacedKind, PlacedRange, PlacementsRecord};

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

/// Writes `record` if this node's member key still lives on `lease`. `Ok(false)`: it does
/// not (the lease ended, or another daemon holds the name): nothing was written.
pub async fn write(client: &DomainClient, lease: i64, record: &PlacementsRecord) -> Result<bool, EtcdError> {
    let keys = client.keys();
    let member = keys.member(client.node());
    let txn = Txn::new().when([Compare::lease(member, CompareOp::Equal, lease)]).and_then([TxnOp::put(
        keys.placements(client.node()),
        records::encode(record),
        None,
    )]);
    let mut kv = client.raw();
    Ok(client.call("placements write", kv.txn(txn)).await?.succeeded())
}
