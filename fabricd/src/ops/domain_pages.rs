//! Paged domain listings (protocol 1.7): `NodesPage` and `MapPage` answer the domain's
//! nodes and its map a page of nodes at a time, each page well under the `Domain`
//! answer's 1 MiB, every page of one listing made from one view revision while this
//! node still holds it (`Domain::view_at`). At 12,500 nodes the whole listings pass an
//! answer's limit; pages of them do not.

use std::collections::HashSet;
use std::sync::Arc;

use fabric_domain::{DomainView, NodeEntry};
use fabric_proto::domain::{DOMAIN_SCHEMA, DomainDoc, PageDoc};
use fabric_proto::wire::{Document, ErrorBody, PageRequest};
use fabric_topology::DeviceId;
use serde::Serialize;

use super::json_doc;
use crate::tasks::domain::{Domain, listing};

/// What one page's items may take, as compact JSON: half an answer's limit, leaving
/// room for the document around them.
pub const PAGE_BYTES: usize = 512 << 10;

/// The view a page is made from: the one the earlier pages came from while held, else
/// the current one (its revision tells the client to start again).
fn view_for(domain: &Domain, page: &PageRequest) -> Arc<DomainView> {
    match page.revision {
        0 => domain.view(),
        r => domain.view_at(r).unwrap_or_else(|| domain.view()),
    }
}

/// The nodes after `page.after`, by name.
fn after<'a>(nodes: &'a [NodeEntry<'a>], page: &PageRequest) -> &'a [NodeEntry<'a>] {
    let from = page.after.as_deref().map_or(0, |a| nodes.partition_point(|n| n.name <= a));
    &nodes[from..]
}

/// Takes items into `out`, in order, while their sizes (plus a separator each) stay
/// within `budget` bytes — at least one, so every page moves on.
fn fill<T>(items: impl Iterator<Item = T>, budget: usize, mut size: impl FnMut(&T) -> usize, out: &mut Vec<T>) {
    let mut used = 0;
    for item in items {
        let s = size(&item) + 1;
        if !out.is_empty() && used + s > budget {
            return;
        }
        used += s;
        out.push(item);
    }
}

fn json_len<T: Serialize + ?Sized>(v: &T) -> usize {
    serde_json::to_vec(v).map_or(usize::MAX / 4, |b| b.len())
}

fn page_doc(view: &DomainView, last: Option<&str>, more: bool, total: usize) -> PageDoc {
    PageDoc {
        revision: u64::try_from(view.revision()).unwrap_or(0),
        next: last.filter(|_| more).map(str::to_owned),
        total: total as u64,
    }
}

/// A page of `fabric.domain/v1`'s nodes (`NodesPage`).
pub fn nodes_page(domain: &Domain, page: &PageRequest) -> Result<Document, ErrorBody> {
    let view = view_for(domain, page);
    let leadership = domain.leadership();
    let all = view.nodes();
    let rest = after(&all, page);
    let mut docs = Vec::new();
    let seen = super::domain::Seen::by(domain, &domain.status());
    fill(rest.iter().map(|n| super::domain::node_doc(n, leadership.leader(), seen)), PAGE_BYTES, json_len, &mut docs);
    let more = docs.len() < rest.len();
    let doc = DomainDoc {
        domain: domain.name().to_owned(),
        this: None,
        etcd: None,
        settings: None,
        leader: super::domain::leader(&leadership),
        page: Some(page_doc(&view, docs.last().map(|n| n.name.as_str()), more, all.len())),
        nodes: docs,
        missing: None,
        gc: None,
        summary: None,
        quarantine: None,
    };
    json_doc(DOMAIN_SCHEMA, |w| serde_json::to_writer(w, &doc))
}

/// A page of `fabric.map/v1` (`MapPage`): the listing of a page of nodes, with a `page`
/// field; a bound client's (`members`) only its partitions' ranges, as `Map` answers it.
pub fn map_page(
    domain: &Domain,
    members: Option<&HashSet<DeviceId>>,
    page: &PageRequest,
) -> Result<Document, ErrorBody> {
    #[derive(Serialize)]
    struct MapPage<'a> {
        #[serde(flatten)]
        listing: &'a fabric_addrmap::Listing,
        page: PageDoc,
    }
    let view = view_for(domain, page);
    let span = view.settings().map_or(0, |s| s.node_span);
    let all = view.nodes();
    let rest = after(&all, page);
    let mut parts = Vec::new();
    // Nodes without a slot add nothing to the map but are passed over all the same.
    fill(
        rest.iter().map(|n| (n.name, listing::node_part(n, span))),
        PAGE_BYTES,
        |(_, part)| part.as_ref().map_or(0, |(usage, ranges)| json_len(usage) + json_len(ranges)),
        &mut parts,
    );
    let last = parts.last().map(|(name, _)| *name);
    let more = parts.len() < rest.len();
    let (nodes, ranges): (Vec<_>, Vec<_>) = parts.into_iter().filter_map(|(_, p)| p).unzip();
    let mut l = listing::assemble(&view, nodes, ranges.into_iter().flatten().collect());
    if let Some(m) = members {
        l = super::scope::restrict_listing(l, |r| {
            r.owner.split('#').next().and_then(|id| id.parse().ok()).is_some_and(|id| m.contains(&id))
        });
    }
    let total = all.iter().filter(|n| n.slot.is_some()).count();
    let doc = MapPage { listing: &l, page: page_doc(&view, last, more, total) };
    json_doc("fabric.map/v1", |w| serde_json::to_writer(w, &doc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_takes_items_within_its_budget_and_at_least_one() {
        let mut out = Vec::new();
        fill([10usize, 10, 10, 10].into_iter(), 25, |s| *s, &mut out);
        assert_eq!(out, [10, 10], "11 + 11 fit 25, a third does not");
        let mut one = Vec::new();
        fill([100usize, 1].into_iter(), 25, |s| *s, &mut one);
        assert_eq!(one, [100], "an item larger than the budget still makes a page");
        let mut none = Vec::<usize>::new();
        fill(std::iter::empty(), 25, |s| *s, &mut none);
        assert!(none.is_empty());
    }
}
