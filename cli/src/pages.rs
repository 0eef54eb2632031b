//! The domain's listings a page at a time (protocol 1.7): `fabricctl domain status|nodes`
//! and `map --daemon` fetch every page of `NodesPage` / `MapPage` and print them as one
//! table or document. All pages of one listing come from one view revision; a page of
//! another revision (the daemon no longer holds the first one) starts the listing again,
//! at most [`MAX_ATTEMPTS`] times.

use fabric_addrmap::{Listing, RangeKind};
use fabric_proto::domain::{DOMAIN_SCHEMA, DomainDoc, PageDoc};
use fabric_proto::wire::{CodecError, DomainAction, DomainRequest, ErrorCode, Name, PageRequest, Request, Response};
use serde::Deserialize;

use crate::daemon::{Client, DaemonError};

/// Listings begun again when the domain changed under them, at most.
pub const MAX_ATTEMPTS: usize = 8;

/// Every page of one listing, in order, of one revision.
fn pages<T>(
    client: &mut Client,
    schema: &'static str,
    action: fn(PageRequest) -> DomainAction,
    mut parse: impl FnMut(&str) -> Result<(T, PageDoc), String>,
) -> Result<Vec<T>, DaemonError> {
    let bad =
        |client: &Client, message: String| DaemonError::Document { path: client.path().to_owned(), schema, message };
    for _ in 0..MAX_ATTEMPTS {
        let mut req = PageRequest::default();
        let mut out = Vec::new();
        let done = loop {
            let doc = match client.call(Request::Domain(DomainRequest { action: action(req.clone()) }))? {
                Response::Domain(d) => d,
                _ => return Err(DaemonError::Unexpected(client.path().to_owned())),
            };
            let (item, page) = parse(&doc.json).map_err(|m| bad(client, m))?;
            if req.revision != 0 && page.revision != req.revision {
                break false;
            }
            out.push(item);
            let Some(next) = page.next else { break true };
            // Pages move forward by name: a daemon that answers otherwise is not followed.
            if req.after.as_deref().is_some_and(|a| next.as_str() <= a)
                || out.len() as u64 > page.total.saturating_add(1)
            {
                return Err(bad(client, format!("page after {next:?} does not move the listing on")));
            }
            let after = Name::new(next.as_str()).map_err(|_| bad(client, format!("node name {next:?} is too long")))?;
            req = PageRequest { revision: page.revision, after: Some(after) };
        };
        if done {
            return Ok(out);
        }
    }
    Err(DaemonError::Document {
        path: client.path().to_owned(),
        schema,
        message: format!("the domain changed under each of {MAX_ATTEMPTS} listings; try again"),
    })
}

/// The domain's nodes, every page, with the leader the pages name.
pub fn nodes(client: &mut Client) -> Result<DomainDoc, DaemonError> {
    let docs = pages(client, DOMAIN_SCHEMA, DomainAction::NodesPage, |json| {
        let doc: DomainDoc = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let page = doc.page.clone().ok_or("a page without its `page` field")?;
        Ok((doc, page))
    })?;
    let mut docs = docs.into_iter();
    let Some(mut first) = docs.next() else { return Err(DaemonError::Unexpected(client.path().to_owned())) };
    for d in docs {
        first.nodes.extend(d.nodes);
    }
    first.page = None;
    Ok(first)
}

/// The domain's map, every page merged into one listing; `None` when the daemon is in no
/// domain (its own map fits one answer).
pub fn map(client: &mut Client) -> Result<Option<Listing>, DaemonError> {
    #[derive(Deserialize)]
    struct Paged {
        page: PageDoc,
    }
    let r = pages(client, "fabric.map/v1", DomainAction::MapPage, |json| {
        let l: Listing = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let p: Paged = serde_json::from_str(json).map_err(|e| e.to_string())?;
        Ok((l, p.page))
    });
    match r {
        Ok(pages) => Ok(merge(pages)),
        Err(DaemonError::Call { source: CodecError::Refused { body, .. }, .. }) if body.code == ErrorCode::NotFound => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// One listing of the pages' nodes and ranges, totals recounted as the daemon counts them.
fn merge(pages: Vec<Listing>) -> Option<Listing> {
    let mut pages = pages.into_iter();
    let mut l = pages.next()?;
    for p in pages {
        l.nodes.extend(p.nodes);
        l.ranges.extend(p.ranges);
    }
    l.nodes.sort_by_key(|n| n.start);
    l.ranges.sort_by_key(|r| r.start);
    l.mapped_bytes = l.ranges.iter().map(|r| r.size).sum();
    l.hole_bytes = l.ranges.iter().filter(|r| r.kind == RangeKind::Hole).map(|r| r.reserved).sum();
    l.high_water = l.ranges.iter().map(|r| r.start.saturating_add(r.reserved)).max().unwrap_or(0);
    Some(l)
}
