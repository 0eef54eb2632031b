//! The domain's requests: the domain's map, translations that land in other nodes' slots,
//! `domain status`, `domain nodes` (a `fabric.domain/v1` document, with the leader as this
//! node knows it; paged from 1.7, `domain_pages`) and the admin's slot gc.
//! All but gc read what the domain task published, lock-free; gc waits for etcd, bounded.

use fabric_domain::{DomainView, Leadership, PlacedKind};
use fabric_proto::domain::{
    DOMAIN_SCHEMA, DomainDoc, EtcdDoc, GcDoc, LeaderDoc, NodeDoc, QuarantineDoc, SelfDoc, SettingsDoc, SummaryDoc,
};
use fabric_proto::wire::{
    DOMAIN, DeviceName, DomainAction, ErrorBody, ErrorCode, Name, ResourceName, TranslateQuery, Translation, Version,
};

use super::scope::Caller;
use super::{domain_pages, json_doc, refusal};
use crate::daemon::Daemon;
use crate::tasks::domain::{Domain, DomainStatus, GcError, MemberCounts, Membership, Standing, listing};

/// Answers what translation of this node's map left `Unmapped` (or `UnknownResource`)
/// from the domain's view: a GFA in another node's slot, or a resource of another node.
/// A connection older than 1.6 gets the answer in the shapes it knows.
pub fn translate(domain: &Domain, queries: &[TranslateQuery], results: &mut [Translation], version: Version) {
    let view = domain.view();
    for (q, r) in queries.iter().zip(results.iter_mut()) {
        match (q, &*r) {
            (TranslateQuery::Gfa(gfa), Translation::Unmapped) => {
                if let Some(t) = remote(&view, domain.node(), *gfa) {
                    *r = if version >= DOMAIN { t } else { downgrade(t) };
                }
            }
            (TranslateQuery::Resource { resource, offset }, Translation::UnknownResource) => {
                if let Some(gfa) = reverse(&view, resource, *offset) {
                    *r = Translation::Gfa(gfa);
                }
            }
            _ => {}
        }
    }
}

/// Where `gfa` lands in another node's slot.
fn remote(view: &DomainView, me: &str, gfa: u64) -> Option<Translation> {
    let at = view.locate(gfa)?;
    if at.node == me {
        return None;
    }
    let range = at.range.filter(|r| r.kind != PlacedKind::Hole && at.offset < r.size);
    let resource = range.filter(|r| r.kind == PlacedKind::Direct).and_then(|r| {
        let memory = listing::memory_kind(r.memory.as_deref())?;
        Some(ResourceName { device: DeviceName::truncated(&r.owner), memory: memory.into(), ordinal: r.ordinal })
    });
    let set = range
        .filter(|r| r.kind == PlacedKind::Interleave)
        .map(|r| Name::truncated(r.owner.strip_prefix("set:").unwrap_or(&r.owner)));
    Some(Translation::Remote {
        node: Name::truncated(at.node),
        live: at.live,
        offset: if resource.is_some() || set.is_some() { at.offset } else { 0 },
        resource,
        set,
    })
}

/// The answer a connection before 1.6 gets: the resource when the node is live, else a
/// hole named after the node.
fn downgrade(t: Translation) -> Translation {
    match t {
        Translation::Remote { live: true, resource: Some(resource), offset, .. } => {
            Translation::Resource { resource, offset, set: None }
        }
        Translation::Remote { live: true, set: Some(set), offset, .. } => {
            Translation::Hole { owner: DeviceName::truncated(&format!("set:{set}@{offset}")) }
        }
        Translation::Remote { node, .. } => Translation::Hole { owner: DeviceName::truncated(&format!("node:{node}")) },
        other => other,
    }
}

/// The GFA of `offset` in a resource another node placed.
fn reverse(view: &DomainView, resource: &ResourceName, offset: u64) -> Option<u64> {
    let kind = serde_json::to_value(fabric_topology::MemoryKind::from(resource.memory)).ok()?;
    let kind = kind.as_str()?;
    view.nodes().into_iter().filter(|n| n.member.is_some()).find_map(|n| {
        n.placements?
            .ranges
            .iter()
            .find(|r| {
                r.kind == PlacedKind::Direct
                    && r.owner == resource.device.as_str()
                    && r.memory.as_deref() == Some(kind)
                    && r.ordinal == resource.ordinal
            })
            .filter(|r| offset < r.size)
            .map(|r| r.start + offset)
    })
}

/// What a status answer lists of what is missing, at most; the rest is counted.
const MAX_MISSING: usize = 256;

/// A status lists the nodes while there are at most this many (an answer stays well under
/// its 1 MiB); beyond, it only counts them (`summary`) and clients page them.
pub const STATUS_NODES: usize = 1024;

/// Answers a `Domain` request: `NodesPage` and `MapPage` (1.7) a page each.
pub fn request(d: &Daemon, caller: &Caller, action: &DomainAction) -> Result<fabric_proto::wire::Document, ErrorBody> {
    let Some(domain) = &d.domain else {
        return Err(refusal(ErrorCode::NotFound, "this daemon is in no domain (no [domain] in its configuration)"));
    };
    match action {
        DomainAction::NodesPage(page) => return domain_pages::nodes_page(domain, page),
        DomainAction::MapPage(page) => return domain_pages::map_page(domain, caller.members()?.as_ref(), page),
        _ => {}
    }
    let view = domain.view();
    let leadership = domain.leadership();
    let status = domain.status();
    let seen = Seen::by(domain, &status);
    let mut doc = DomainDoc {
        domain: domain.name().to_owned(),
        this: None,
        etcd: None,
        settings: None,
        leader: leader(&leadership),
        // A gc's answer names the slot freed, not the domain: at 12,500 nodes the listing
        // alone passes an answer's size limit, and the gc would seem to have failed.
        nodes: match action {
            DomainAction::Gc { .. } => Vec::new(),
            DomainAction::Status => match nodes(&view, leadership.leader(), seen) {
                n if n.len() > STATUS_NODES => Vec::new(),
                n => n,
            },
            _ => nodes(&view, leadership.leader(), seen),
        },
        missing: None,
        gc: None,
        summary: None,
        page: None,
        quarantine: None,
    };
    match action {
        DomainAction::Nodes | DomainAction::NodesPage(_) | DomainAction::MapPage(_) => {}
        DomainAction::Status => {
            let (standing, reason) = match &status.standing {
                Standing::Joined => ("joined", None),
                Standing::Fenced(why) => ("fenced", Some(why.clone())),
                Standing::Unreachable(why) => ("etcd unreachable", Some(why.clone())),
            };
            doc.this = Some(SelfDoc {
                node: domain.node().to_owned(),
                slot: domain.slot(),
                standing: standing.to_owned(),
                reason,
                incarnation: status.incarnation,
                shares: domain.shares(),
            });
            doc.etcd = Some(EtcdDoc {
                reachable: status.etcd_reachable,
                round_trip_us: status.round_trip.map(|t| u64::try_from(t.as_micros()).unwrap_or(u64::MAX)),
                errors: domain.etcd_errors(),
            });
            let s = domain.settings();
            doc.settings = Some(SettingsDoc {
                address_bits: s.address_bits,
                node_span: s.node_span,
                data_paths: domain.data_paths(),
            });
            doc.missing = Some(missing(&view, &status.standing));
            doc.summary = Some(summary(&view, seen));
            let q = d.memory.quarantine();
            if !q.is_empty() {
                let docs = q.into_iter().map(|q| QuarantineDoc { node: q.node, regions: q.regions, bytes: q.bytes });
                doc.quarantine = Some(docs.collect());
            }
        }
        DomainAction::Gc { node } => {
            let node = node.as_str();
            let slot = domain.gc(node).map_err(|e| {
                let code = match &e {
                    GcError::Etcd(fabric_domain::EtcdError::GcLive { .. }) => ErrorCode::BadRequest,
                    _ => ErrorCode::Unavailable,
                };
                refusal(code, format!("domain gc {node}: {}", crate::error_chain(&e)))
            })?;
            // The node is collected: whatever of this node's memory it held in quarantine
            // is free again (other nodes lift theirs when an admin collects it there).
            let lifted = d.memory.lift_quarantine(node, None);
            tracing::info!(%node, ?slot, lifted, "domain slot freed by an admin");
            doc.gc = Some(GcDoc { node: node.to_owned(), slot, lifted_bytes: Some(lifted) });
        }
    }
    json_doc(DOMAIN_SCHEMA, |w| serde_json::to_writer_pretty(w, &doc))
}

pub(super) fn leader(l: &Leadership) -> Option<LeaderDoc> {
    Some(LeaderDoc { node: l.leader()?.to_owned(), term: l.term()?, this_node: l.is_leader() })
}

/// Who states the nodes' membership ([`Membership::of`]): this node, and whether it is
/// joined.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seen<'a> {
    pub(super) me: &'a str,
    pub(super) joined: bool,
}

impl<'a> Seen<'a> {
    /// As `domain` states it, standing as `status` says.
    pub(super) fn by(domain: &'a Domain, status: &DomainStatus) -> Self {
        Seen { me: domain.node(), joined: status.standing == Standing::Joined }
    }

    fn of(self, n: &fabric_domain::NodeEntry<'_>) -> Membership {
        Membership::of(n, self.me, self.joined)
    }
}

/// The domain's nodes; `leader`'s is marked.
fn nodes(view: &DomainView, leader: Option<&str>, seen: Seen<'_>) -> Vec<NodeDoc> {
    view.nodes().iter().map(|n| node_doc(n, leader, seen)).collect()
}

/// One node's entry; marked when it is `leader`.
pub(super) fn node_doc(n: &fabric_domain::NodeEntry<'_>, leader: Option<&str>, seen: Seen<'_>) -> NodeDoc {
    let membership = seen.of(n);
    NodeDoc {
        name: n.name.to_owned(),
        state: membership.as_str().to_owned(),
        last_seen: membership.last_seen().map(str::to_owned),
        slot: n.slot,
        incarnation: n.member.map(|m| m.incarnation),
        peer_address: n.member.map(|m| m.peer_address.clone()),
        ranges: n.placements.map_or(0, |p| p.ranges.len()),
        mapped_bytes: n.placements.map_or(0, |p| p.ranges.iter().map(|r| r.size).sum()),
        leader: leader == Some(n.name),
        groups: n.member.map(|m| m.groups.iter().map(ToString::to_string).collect()).unwrap_or_default(),
    }
}

/// The nodes counted.
fn summary(view: &DomainView, seen: Seen<'_>) -> SummaryDoc {
    let MemberCounts { nodes, live, gone, unknown, unplaced } = MemberCounts::of(view, seen.me, seen.joined);
    SummaryDoc { nodes, live, gone, unknown, unplaced, refused: view.refused().len() as u64 }
}

/// What is missing and why: first, while this node is not joined, that the states are its
/// last view's; then gone nodes, live nodes without a slot or placements, refused records;
/// at most [`MAX_MISSING`] lines, then how many more.
fn missing(view: &DomainView, standing: &Standing) -> Vec<String> {
    let mut out = Vec::new();
    if *standing != Standing::Joined {
        out.push(format!(
            "this node is {standing}: the nodes' states are unknown, the last view's (etcd revision {}) is shown as last_seen",
            view.revision()
        ));
    }
    out.append(&mut all_missing(view));
    if out.len() > MAX_MISSING {
        let more = out.len() - MAX_MISSING;
        out.truncate(MAX_MISSING);
        out.push(format!("… and {more} more (`fabricctl domain nodes` lists every node)"));
    }
    out
}

fn all_missing(view: &DomainView) -> Vec<String> {
    let mut out = Vec::new();
    for n in view.nodes() {
        match (n.member.is_some(), n.slot, n.placements.is_some()) {
            (false, Some(slot), _) => {
                out.push(format!("{}: gone (its lease ended); slot {slot} kept as a hole, its GFAs reserved", n.name));
            }
            (true, None, _) => out.push(format!("{}: live but holds no slot yet", n.name)),
            (true, Some(_), false) => out.push(format!("{}: live, placements not published yet", n.name)),
            _ => {}
        }
    }
    for (key, why) in view.refused() {
        out.push(format!("{key}: refused: {why}"));
    }
    if view.settings().is_none() {
        out.push("settings: not read from etcd yet".to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use fabric_domain::records::{RECORD_VERSION, encode};
    use fabric_domain::{DataPathKind, DomainSettings, Keys, MemberRecord, PlacedRange, PlacementsRecord, SlotClaim};
    use fabric_proto::wire::MemoryClass;

    use super::*;

    const SPAN: u64 = 1 << 40;

    fn view(live: bool) -> DomainView {
        let k = Keys::new("d");
        let member = MemberRecord {
            version: RECORD_VERSION,
            name: "tray1".into(),
            incarnation: 3,
            peer_address: "tray1:7471".into(),
            capabilities: vec![],
            groups: vec![],
            software: "0.1.0".into(),
            node_id: None,
        };
        let range = |start, kind, owner: &str, memory: Option<&str>| PlacedRange {
            start,
            reserved: 1 << 30,
            size: 1 << 30,
            kind,
            owner: owner.into(),
            memory: memory.map(str::to_owned),
            ordinal: 0,
        };
        let placements = PlacementsRecord {
            version: RECORD_VERSION,
            node: "tray1".into(),
            incarnation: 3,
            generation: 1,
            slot: 2,
            span: SPAN,
            ranges: vec![
                range(2 * SPAN, PlacedKind::Direct, "uuid:GPU-1", Some("hbm")),
                range(2 * SPAN + (1 << 30), PlacedKind::Interleave, "set:s", None),
            ],
        };
        let mut entries = vec![
            (k.settings(), encode(&DomainSettings::new(57, SPAN, vec![DataPathKind::SharedFile]))),
            (k.slot(2), encode(&SlotClaim::new(2, "tray1"))),
            (k.slot(0), encode(&SlotClaim::new(0, "tray0"))),
            (k.placements("tray1"), encode(&placements)),
        ];
        if live {
            entries.push((k.member("tray1"), encode(&member)));
        }
        DomainView::load(k, Default::default(), entries.iter().map(|(a, b)| (a.as_bytes(), b.as_slice())), 1)
    }

    #[test]
    fn another_nodes_gfa_names_the_node_resource_and_offset() {
        let v = view(true);
        let t = remote(&v, "tray0", 2 * SPAN + 7).unwrap();
        let Translation::Remote { node, live: true, resource: Some(r), set: None, offset: 7 } = &t else {
            panic!("{t:?}")
        };
        assert_eq!((node.as_str(), r.device.as_str(), r.memory), ("tray1", "uuid:GPU-1", MemoryClass::Hbm));
        assert!(matches!(downgrade(t), Translation::Resource { offset: 7, .. }), "a 1.5 client gets the resource");
        let set = remote(&v, "tray0", 2 * SPAN + (1 << 30) + 9).unwrap();
        assert!(matches!(&set, Translation::Remote { set: Some(s), offset: 9, .. } if s.as_str() == "s"), "{set:?}");
        let hole = remote(&v, "tray0", 3 * SPAN - 1).unwrap();
        assert!(matches!(hole, Translation::Remote { resource: None, set: None, offset: 0, .. }), "{hole:?}");
        assert_eq!(remote(&v, "tray1", 2 * SPAN), None, "its own slot is answered by its own map");
        assert_eq!(remote(&v, "tray0", 5 * SPAN), None, "nobody's slot");
        let resource =
            ResourceName { device: DeviceName::truncated("uuid:GPU-1"), memory: MemoryClass::Hbm, ordinal: 0 };
        assert_eq!(reverse(&v, &resource, 5), Some(2 * SPAN + 5));
        assert_eq!(reverse(&v, &resource, 1 << 30), None, "past its size");
    }

    #[test]
    fn a_gone_nodes_gfa_is_named_as_gone() {
        let v = view(false);
        let t = remote(&v, "tray0", 2 * SPAN + 7).unwrap();
        assert!(matches!(&t, Translation::Remote { live: false, .. }), "{t:?}");
        assert!(matches!(downgrade(t), Translation::Hole { owner } if owner.as_str() == "node:tray1"));
        let resource =
            ResourceName { device: DeviceName::truncated("uuid:GPU-1"), memory: MemoryClass::Hbm, ordinal: 0 };
        assert_eq!(reverse(&v, &resource, 5), None, "a gone node's memory has no GFA to reach");
        assert_eq!(
            missing(&v, &Standing::Joined)[1],
            "tray1: gone (its lease ended); slot 2 kept as a hole, its GFAs reserved"
        );
        let listing = listing::listing(&v);
        assert_eq!(listing.nodes.iter().map(|n| n.state.as_deref()).collect::<Vec<_>>(), [Some("gone"), Some("gone")]);
        assert!(listing.ranges.iter().all(|r| r.kind == fabric_addrmap::RangeKind::Hole && r.size == 0));
    }

    #[test]
    fn the_leader_is_named_and_marked_only_when_known() {
        let v = view(true);
        let follower = Leadership::Follower { leader: "tray1".into(), term: 9 };
        assert_eq!(leader(&follower), Some(LeaderDoc { node: "tray1".into(), term: 9, this_node: false }));
        let marked = nodes(&v, follower.leader(), Seen { me: "tray0", joined: true });
        assert_eq!(
            marked.iter().map(|n| (n.name.as_str(), n.leader)).collect::<Vec<_>>(),
            [("tray0", false), ("tray1", true)]
        );
        let me = Leadership::Leader { node: "tray0".into(), term: 11 };
        assert_eq!(leader(&me).map(|l| l.this_node), Some(true));
        assert_eq!(leader(&Leadership::Unknown), None);
        assert!(nodes(&v, None, Seen { me: "tray0", joined: true }).iter().all(|n| !n.leader));
    }

    #[test]
    fn a_node_that_is_not_joined_states_itself_fenced_and_the_others_unknown() {
        let state = |v: &DomainView, joined| {
            let docs = nodes(v, None, Seen { me: "tray0", joined });
            docs.into_iter().map(|n| (n.name, n.state, n.last_seen)).collect::<Vec<_>>()
        };
        let s = |a: &str| a.to_owned();
        let live = view(true);
        assert_eq!(state(&live, true), [(s("tray0"), s("gone"), None), (s("tray1"), s("live"), None)]);
        assert_eq!(
            state(&live, false),
            [(s("tray0"), s("fenced"), None), (s("tray1"), s("unknown"), Some(s("live")))],
            "its last view said tray1 was live: nothing confirms it now"
        );
        assert_eq!(state(&view(false), false)[1], (s("tray1"), s("unknown"), Some(s("gone"))));

        let counted = summary(&live, Seen { me: "tray0", joined: false });
        assert_eq!((counted.nodes, counted.live, counted.gone, counted.unknown), (2, 0, 0, 2));
        let counted = summary(&live, Seen { me: "tray0", joined: true });
        assert_eq!((counted.nodes, counted.live, counted.gone, counted.unknown), (2, 1, 1, 0));

        let fenced = Standing::Fenced("lease lost: etcd keepalive: no answer".into());
        let lines = missing(&live, &fenced);
        assert_eq!(
            lines[0],
            "this node is fenced: lease lost: etcd keepalive: no answer: the nodes' states are unknown, the last view's (etcd revision 1) is shown as last_seen"
        );
        assert!(!missing(&live, &Standing::Joined)[0].starts_with("this node"), "joined: no such line");
    }
}
