//! Calls made on the caller's own thread over a blocking link (nodelink's
//! [`BlockingLink`]): a request thread that asks another node for an import sleeps in the
//! socket's read, and the kernel wakes it with the answer — no runtime worker between the
//! answer and the thread that waits for it. Up to [`KEPT_PER_NODE`] such links per peer
//! node are kept; a call takes one out (a call that finds none dials one of its own, kept
//! afterwards while there is room), so no lock is held across a link's I/O and concurrent
//! imports from one node do not wait for each other. A link is made anew as
//! [`super::dial`]'s are: when the peer's or this node's incarnation changed, when it
//! broke, or when it sat idle long enough that the peer may close it.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fabric_nodelink::{BlockingLink, LinkError, NodeIdentity, PeerRequest, PeerResponse};

use super::NodeLink;
use super::dial::{DialError, Freshness, REQUEST_TIMEOUT, target};
use crate::tasks::domain::Domain;

/// A kept link and what it was made for.
#[derive(Debug)]
struct Kept {
    link: BlockingLink,
    made: Freshness,
}

/// How many idle blocking links to one peer node are kept (each counts among the links
/// the peer admits from this node, `LinkLimits::max_links_per_node`).
pub const KEPT_PER_NODE: usize = 4;

/// The blocking links kept, by peer node.
#[derive(Debug, Default)]
pub struct Direct {
    /// Held only to take a link out or put one back.
    links: Mutex<HashMap<String, Vec<Kept>>>,
}

impl Direct {
    /// A kept link to `node` that serves `now`; those that no longer do are closed (after
    /// the lock).
    fn take(&self, node: &str, now: &Freshness, idle: Duration) -> Option<Kept> {
        let mut stale = Vec::new();
        let found = {
            let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
            let kept = links.get_mut(node)?;
            let mut found = None;
            while let Some(k) = kept.pop() {
                if k.made.serves(now, idle) {
                    found = Some(k);
                    break;
                }
                stale.push(k);
            }
            found
        };
        drop(stale);
        found
    }

    /// Keeps `kept` for a later call while there is room.
    fn put_back(&self, node: &str, kept: Kept) {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        let to_node = links.entry(node.to_owned()).or_default();
        if to_node.len() < KEPT_PER_NODE {
            to_node.push(kept);
            return;
        }
        drop(links);
        drop(kept);
    }

    /// How many links are kept to `node`.
    pub fn kept(&self, node: &str) -> usize {
        self.links.lock().unwrap_or_else(|p| p.into_inner()).get(node).map_or(0, Vec::len)
    }
}

impl NodeLink {
    /// Sends `request` to `node` and waits for its answer on this thread, at most `within`
    /// (the handshake of a new link included). Blocks: for a request's thread, never one
    /// of the domain runtime's workers.
    pub fn call_here(
        &self,
        domain: &Domain,
        node: &str,
        request: PeerRequest,
        within: Duration,
    ) -> Result<PeerResponse, DialError> {
        let deadline = Instant::now() + within;
        let (wanted, address) = target(domain, node)?;
        let idle = self.limits().idle_timeout;
        let mut kept = match self.direct().take(node, &wanted, idle) {
            Some(k) => k,
            None => self.dial_here(domain, node, &address, wanted, deadline)?,
        };
        // As on the async links: a peer cut off by the network is given up after
        // `REQUEST_TIMEOUT` of waiting for the answer (and the link with it).
        let answer_by = deadline.min(Instant::now() + REQUEST_TIMEOUT);
        let after = REQUEST_TIMEOUT.min(within);
        match kept.link.call(request, answer_by) {
            Ok(answer) => {
                kept.made.used = Instant::now();
                self.direct().put_back(node, kept);
                Ok(answer)
            }
            // The link is sound; the peer said no.
            Err(LinkError::Peer(source)) => {
                kept.made.used = Instant::now();
                self.direct().put_back(node, kept);
                Err(DialError::Peer { node: node.to_owned(), source })
            }
            // Given up mid-way: the link is dropped (closed), the next call dials anew.
            Err(LinkError::Timeout(_)) if Instant::now() >= answer_by => {
                Err(DialError::Timeout { node: node.to_owned(), after })
            }
            Err(source) => Err(DialError::Link { node: node.to_owned(), source }),
        }
    }

    /// A new blocking link to `node` at `address`, checked against the incarnation its
    /// member record states; what an earlier incarnation of it granted is void here first.
    fn dial_here(
        &self,
        domain: &Domain,
        node: &str,
        address: &str,
        made: Freshness,
        deadline: Instant,
    ) -> Result<Kept, DialError> {
        let resolve = |source| DialError::Resolve { node: node.to_owned(), address: address.to_owned(), source };
        let addr = address.to_socket_addrs().map_err(|e| resolve(Some(e)))?.next().ok_or_else(|| resolve(None))?;
        let link_err = |source| DialError::Link { node: node.to_owned(), source };
        let expected = NodeIdentity::new(domain.name(), node).map_err(|e| link_err(LinkError::Identity(e)))?;
        // The handshake ends by the call's deadline too.
        let mut limits = self.limits();
        limits.handshake_timeout = limits.handshake_timeout.min(deadline.saturating_duration_since(Instant::now()));
        if limits.handshake_timeout.is_zero() {
            return Err(link_err(LinkError::Timeout(fabric_nodelink::Stage::Handshake)));
        }
        let link = BlockingLink::connect(addr, self.credentials(), &expected, made.ours, limits).map_err(link_err)?;
        if link.peer_incarnation() != made.incarnation {
            return Err(DialError::Incarnation {
                node: node.to_owned(),
                member: made.incarnation,
                welcomed: link.peer_incarnation(),
            });
        }
        tracing::info!(peer = node, %addr, incarnation = made.incarnation, "node link: linked (direct)");
        // As for every new link (`dial.rs`): before anything is asked of this incarnation.
        if let Some(d) = self.service().daemon().and_then(|w| w.upgrade()) {
            self.service().importer().void_owner(&d, node, made.incarnation);
        }
        Ok(Kept { link, made })
    }
}
