//! `fabric.domain/v1`: the domain a daemon's node belongs to, as the `Domain` request
//! answers it (protocol 1.6) and `fabricctl domain -o json` prints it. fabricd fills it
//! from its domain view; fields a request did not ask for are absent. Fields added after
//! the first release (`leader`, a node's `leader` mark, `summary`, `page`) are optional,
//! so older documents still decode.

use serde::{Deserialize, Serialize};

/// Schema name and version of [`DomainDoc`].
pub const DOMAIN_SCHEMA: &str = "fabric.domain/v1";

/// The document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DomainDoc {
    /// The domain's name.
    pub domain: String,
    /// This node's standing (`status`).
    #[serde(rename = "self", default, skip_serializing_if = "Option::is_none")]
    pub this: Option<SelfDoc>,
    /// etcd as this node sees it (`status`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdDoc>,
    /// The domain settings (`status`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<SettingsDoc>,
    /// Who leads the domain, as the answering node knows it (`status`, `nodes`); absent
    /// while not known (not yet observed, no leader, or this node's lease lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<LeaderDoc>,
    /// Every node holding a slot or live, by name (`status` up to 1,024 of them, `nodes`;
    /// a page of them in a `NodesPage` answer; empty in a `gc` answer).
    pub nodes: Vec<NodeDoc>,
    /// What is missing and why (`status`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing: Option<Vec<String>>,
    /// What an admin's gc freed (`gc`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gc: Option<GcDoc>,
    /// Freed memory of this node held out of reuse because another node may still map
    /// it, by that node (`status`; absent when none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine: Option<Vec<QuarantineDoc>>,
    /// The nodes counted (`status`; a status of more than 1,024 nodes lists none: clients
    /// page them with `NodesPage`, 1.7).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<SummaryDoc>,
    /// Which page `nodes` is (`NodesPage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page: Option<PageDoc>,
}

/// The domain's nodes counted, as a status answer states them without listing them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SummaryDoc {
    /// Nodes listed by `nodes` (live, or holding a slot).
    pub nodes: u64,
    /// Live members.
    pub live: u64,
    /// Nodes gone that keep their slot.
    pub gone: u64,
    /// Nodes whose state the answering node cannot confirm while it is not joined (itself
    /// included); counted in neither `live` nor `gone`.
    #[serde(default)]
    pub unknown: u64,
    /// Live members that published no placements yet.
    pub unplaced: u64,
    /// Records refused.
    pub refused: u64,
}

/// One page of a paged listing (`NodesPage`, and the `page` field of a `MapPage`'s
/// `fabric.map/v1` document).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageDoc {
    /// The view revision the page was made from: pages of one listing share it.
    pub revision: u64,
    /// The node to ask the next page after; none on the last page.
    pub next: Option<String>,
    /// Nodes in the whole listing (at that revision).
    pub total: u64,
}

/// Freed memory one node may still map, held out of reuse on the answering node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantineDoc {
    /// The node that imported it and left (or has not acknowledged its end).
    pub node: String,
    /// Freed regions.
    pub regions: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// One node of the domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDoc {
    /// Its name.
    pub name: String,
    /// `live` (its lease lives) or `gone` (its slot kept as a hole); while the answering
    /// node is not joined (fenced, or etcd unreachable) it cannot confirm either: it says
    /// `fenced` of itself and `unknown` of the others, with `last_seen`.
    pub state: String,
    /// What the answering node's last view said (`live` or `gone`) of a node whose state
    /// is `unknown`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<String>,
    /// Its slot.
    pub slot: Option<u32>,
    /// Its incarnation, while live.
    pub incarnation: Option<u64>,
    /// Its peer address, while live.
    pub peer_address: Option<String>,
    /// Ranges it published.
    pub ranges: usize,
    /// Bytes of them that translate.
    pub mapped_bytes: u64,
    /// Whether it leads the domain, as the answering node knows it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub leader: bool,
    /// The fabric groups its member record lists, while live:
    /// `nvlink-clique:<cluster uuid>.<clique id>`, `cxl-pool:<name>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The domain's leader: the node where domain-wide duties run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderDoc {
    /// The leading node.
    pub node: String,
    /// Its term (the leader key's create revision in etcd): it grows with every new leader.
    pub term: i64,
    /// Whether the answering node leads.
    pub this_node: bool,
}

/// The answering node's standing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelfDoc {
    /// Its name.
    pub node: String,
    /// Its slot.
    pub slot: u32,
    /// `joined`, `fenced` (lease lost: no domain writes until it rejoins) or
    /// `etcd unreachable` (not joined since start).
    pub standing: String,
    /// Why, when not joined.
    pub reason: Option<String>,
    /// Incarnation of the current (or last) join; 0 before the first.
    pub incarnation: u64,
    /// Its shares of memory other hosts reach too (`[[memory.shares]]`); absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shares: Vec<ShareDoc>,
}

/// A node's share of a memory resource several hosts reach: new regions on the resource go
/// only in `[offset, offset + len)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareDoc {
    /// `<device id>/<kind><ordinal>`.
    pub resource: String,
    /// First byte of the share in the resource.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// etcd as the answering node sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdDoc {
    /// Whether its last request answered.
    pub reachable: bool,
    /// Round trip of the last probe, in microseconds.
    pub round_trip_us: Option<u64>,
    /// Failed requests since start.
    pub errors: u64,
}

/// The domain-wide settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettingsDoc {
    /// Significant bits of a GFA.
    pub address_bits: u8,
    /// Every slot's size: slot n starts at n × node_span.
    pub node_span: u64,
    /// Data paths between nodes (`shared_file`, `nvlink`, `cxl`, `rdma`).
    pub data_paths: Vec<String>,
}

/// What a gc freed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcDoc {
    /// The node.
    pub node: String,
    /// The slot freed; none when the node held none.
    pub slot: Option<u32>,
    /// Bytes of the answering node's memory the node held in quarantine, free again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifted_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_without_leader_fields_still_decodes() {
        let old = r#"{"domain":"d","nodes":[{"name":"tray0","state":"live","slot":0,"incarnation":1,
            "peer_address":"tray0:7471","ranges":2,"mapped_bytes":4096}]}"#;
        let doc: DomainDoc = serde_json::from_str(old).unwrap();
        assert_eq!(doc.leader, None);
        assert!(!doc.nodes[0].leader);
    }

    #[test]
    fn the_leader_round_trips_and_is_marked_only_on_its_node() {
        let node = |name: &str, leader| NodeDoc {
            name: name.into(),
            state: "live".into(),
            last_seen: None,
            slot: Some(0),
            incarnation: Some(1),
            peer_address: None,
            ranges: 0,
            mapped_bytes: 0,
            leader,
            groups: if leader { vec!["cxl-pool:p0".into()] } else { vec![] },
        };
        let doc = DomainDoc {
            domain: "d".into(),
            this: None,
            etcd: None,
            settings: None,
            leader: Some(LeaderDoc { node: "tray1".into(), term: 42, this_node: false }),
            nodes: vec![node("tray0", false), node("tray1", true)],
            missing: None,
            gc: None,
            summary: None,
            page: None,
            quarantine: None,
        };
        let json = serde_json::to_value(&doc).unwrap();
        assert_eq!(json["leader"], serde_json::json!({"node": "tray1", "term": 42, "this_node": false}));
        assert_eq!(json["nodes"][0].get("leader"), None, "a follower carries no mark");
        assert_eq!(json["nodes"][1]["leader"], true);
        assert_eq!(json["nodes"][0].get("groups"), None, "no groups, no field");
        assert_eq!(json["nodes"][1]["groups"], serde_json::json!(["cxl-pool:p0"]));
        assert_eq!(serde_json::from_value::<DomainDoc>(json).unwrap(), doc);
    }
}
