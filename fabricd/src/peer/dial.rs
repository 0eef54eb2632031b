//! The links this node dials on the domain's runtime (an import's ask goes on a blocking
//! link of the request's own thread instead: [`super::direct`]): at most one per peer node
//! and one per data lane, made on first use from the peer's member record (its address
//! and incarnation), made again when the record states
//! another incarnation (the peer restarted: what the old link carried is void), when the
//! link broke, or when it sat idle long enough that the peer may close it. One request at
//! a time per link, so a request waits only for others to the same node. Copy chunks go
//! on other links to the peer (its data lanes: [`NodeLink::call_data`]), so a long copy
//! never holds a ping, an import or a revocation back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fabric_nodelink::{Link, LinkError, NodeIdentity, PeerError, PeerRequest, PeerResponse};

use super::NodeLink;

/// How long a request waits for its answer on a link before the link is given up (a peer
/// cut off by the network answers nothing; the next request dials anew, which takes at
/// most the link's handshake timeout).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
use crate::tasks::domain::{Domain, Standing};

/// Why a request to another node got no answer from it.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// This node has no node link (`[peer]` without credentials).
    #[error("this node has no node link ([peer] ca, cert and key are not set)")]
    NoLink,
    /// This node is not joined: it has no incarnation to present.
    #[error("this node is not joined to its domain ({0})")]
    NotJoined(String),
    /// The node is no live member of the domain now.
    #[error("node {0} is not a live member of the domain")]
    NotMember(String),
    /// Its peer address does not resolve.
    #[error("peer address {address:?} of node {node} does not resolve")]
    Resolve {
        /// The node.
        node: String,
        /// Its address.
        address: String,
        /// The resolver's answer, when it gave one.
        #[source]
        source: Option<std::io::Error>,
    },
    /// The link could not be made, or broke (refused, timed out, closed).
    #[error("node link to {node}")]
    Link {
        /// The node.
        node: String,
        /// Why.
        #[source]
        source: LinkError,
    },
    /// The peer answered as another incarnation than its member record states (the view or
    /// the peer is behind): nothing is asked of it until they agree.
    #[error("node {node} answered as incarnation {welcomed}, its member record states {member}")]
    Incarnation {
        /// The node.
        node: String,
        /// The record's.
        member: u64,
        /// The Welcome's.
        welcomed: u64,
    },
    /// The request is about what an earlier incarnation of the peer granted (an import id),
    /// and the peer is another one now: its ids name other things, so it is not asked.
    #[error("node {node} restarted (incarnation {now}, not {granted}): what it granted is gone")]
    Restarted {
        /// The node.
        node: String,
        /// The incarnation the request is about.
        granted: u64,
        /// The member record's now.
        now: u64,
    },
    /// The peer did not answer within [`REQUEST_TIMEOUT`] (cut off, or hung): the link is
    /// dropped.
    #[error("node {node} did not answer within {after:?}")]
    Timeout {
        /// The node.
        node: String,
        /// How long it was given.
        after: Duration,
    },
    /// The peer answered the request with a failure.
    #[error("node {node} refused")]
    Peer {
        /// The node.
        node: String,
        /// Its answer.
        #[source]
        source: PeerError,
    },
}

/// One dialled link and what it was made for.
#[derive(Debug)]
struct Held {
    link: Link,
    made: Freshness,
}

/// What a link was made for, and when it was last used.
#[derive(Debug, Clone, Copy)]
pub(super) struct Freshness {
    /// The peer's incarnation, and this node's, when the link was made.
    pub(super) incarnation: u64,
    pub(super) ours: u64,
    pub(super) used: Instant,
}

/// What a link to `node` must be made for now (its member record's incarnation and this
/// node's), and where it listens; refused while this node is not joined or `node` is no
/// live member.
pub(super) fn target(domain: &Domain, node: &str) -> Result<(Freshness, String), DialError> {
    let status = domain.status();
    if status.standing != Standing::Joined {
        return Err(DialError::NotJoined(status.standing.to_string()));
    }
    let view = domain.view();
    let m = view.members().find(|m| m.name == node).ok_or_else(|| DialError::NotMember(node.to_owned()))?;
    Ok((
        Freshness { incarnation: m.incarnation, ours: status.incarnation, used: Instant::now() },
        m.peer_address.clone(),
    ))
}

/// Refuses an ask about what incarnation `granted` of `node` granted once the member
/// record states another one, `now` (its ids then name other things).
pub(super) fn still_granting(node: &str, granted: Option<u64>, now: &Freshness) -> Result<(), DialError> {
    match granted {
        Some(granted) if granted != now.incarnation => {
            Err(DialError::Restarted { node: node.to_owned(), granted, now: now.incarnation })
        }
        _ => Ok(()),
    }
}

impl Freshness {
    /// Whether a link made as `self` may carry a request now, when the peer's record and
    /// this node state `now`: a link idle past half the peer's idle timeout (`idle`) may
    /// be closed under us, so a request on it could be lost mid-way (it is made anew
    /// rather than retried); a link made by an earlier incarnation of this node, or to an
    /// earlier one of the peer, is not used again either (the peer would serve it as that
    /// incarnation).
    pub(super) fn serves(&self, now: &Freshness, idle: Duration) -> bool {
        self.incarnation == now.incarnation && self.ours == now.ours && self.used.elapsed() < idle / 2
    }

    /// A new link to `node`, made for `self`, whose Welcome stated `welcomed`: refused when
    /// that is not the incarnation the member record states (the peer restarted between
    /// the record and the dial).
    pub(super) fn welcomed_by(&self, node: &str, welcomed: u64) -> Result<(), DialError> {
        if welcomed == self.incarnation {
            return Ok(());
        }
        Err(DialError::Incarnation { node: node.to_owned(), member: self.incarnation, welcomed })
    }
}

/// The links this node dialled, by peer node.
#[derive(Debug, Default)]
pub struct Peers {
    /// A std mutex held only to find or add a node's slot; the slot's own async mutex is
    /// held across that link's I/O.
    links: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<Held>>>>>,
}

impl Peers {
    fn slot(&self, node: &str) -> Arc<tokio::sync::Mutex<Option<Held>>> {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.entry(node.to_owned()).or_default().clone()
    }

    /// Closes the links (data lanes included) to nodes not in `live` (they left the
    /// domain) that no call holds: nothing would take them out again. A slot a call holds
    /// stays; its link ends with the call's error, and the next view drops the slot.
    pub fn forget_departed(&self, live: &dyn Fn(&str) -> bool) -> usize {
        let gone: Vec<_> = {
            let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
            links
                .extract_if(|lane, slot| {
                    let node = lane.split('/').next().unwrap_or(lane);
                    !live(node) && Arc::strong_count(slot) == 1
                })
                .collect()
        };
        // Closed after the lock.
        gone.len()
    }

    /// How many peers have a link now.
    pub fn linked(&self) -> usize {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        // Data lanes (`node/dataN`) are not peers of their own.
        links.iter().filter(|(k, s)| !k.contains('/') && s.try_lock().map_or(true, |h| h.is_some())).count()
    }
}

/// What is asked of a peer.
enum Ask {
    Ping,
    Request(PeerRequest),
}

/// What it answered.
enum Answer {
    Pong(Duration),
    Response(PeerResponse),
}

impl NodeLink {
    /// Sends `request` to `node` and waits for its answer (on the domain's runtime).
    pub async fn call(&self, domain: &Domain, node: &str, request: PeerRequest) -> Result<PeerResponse, DialError> {
        match self.ask(domain, node, node, None, Ask::Request(request)).await? {
            Answer::Response(r) => Ok(r),
            Answer::Pong(_) => Err(DialError::Link { node: node.to_owned(), source: LinkError::Closed }),
        }
    }

    /// [`NodeLink::call`] of a request about what incarnation `granted` of `node` granted
    /// (an import id): refused, [`DialError::Restarted`], once `node` is another incarnation,
    /// whose ids name other things (another node's, or another client's, import).
    pub async fn call_granted(
        &self,
        domain: &Domain,
        node: &str,
        granted: u64,
        request: PeerRequest,
    ) -> Result<PeerResponse, DialError> {
        match self.ask(domain, node, node, Some(granted), Ask::Request(request)).await? {
            Answer::Response(r) => Ok(r),
            Answer::Pong(_) => Err(DialError::Link { node: node.to_owned(), source: LinkError::Closed }),
        }
    }

    /// [`NodeLink::call_granted`] on `node`'s data lane `lane`: a link of its own, for copy
    /// chunks.
    pub async fn call_data(
        &self,
        domain: &Domain,
        node: &str,
        granted: u64,
        lane: u64,
        request: PeerRequest,
    ) -> Result<PeerResponse, DialError> {
        // `/` is in no node name: the lane's slot is no node's.
        let lane = format!("{node}/data{lane}");
        match self.ask(domain, node, &lane, Some(granted), Ask::Request(request)).await? {
            Answer::Response(r) => Ok(r),
            Answer::Pong(_) => Err(DialError::Link { node: node.to_owned(), source: LinkError::Closed }),
        }
    }

    /// Pings `node`; the round trip (a new link's handshake not counted).
    pub async fn ping(&self, domain: &Domain, node: &str) -> Result<Duration, DialError> {
        match self.ask(domain, node, node, None, Ask::Ping).await? {
            Answer::Pong(rtt) => Ok(rtt),
            Answer::Response(_) => Err(DialError::Link { node: node.to_owned(), source: LinkError::Closed }),
        }
    }

    /// Asks `node` on `lane`'s link (made anew when the one held no longer serves); `granted`:
    /// the incarnation of `node` the ask is about, refused once it is another.
    async fn ask(
        &self,
        domain: &Domain,
        node: &str,
        lane: &str,
        granted: Option<u64>,
        ask: Ask,
    ) -> Result<Answer, DialError> {
        let (wanted, address) = target(domain, node)?;
        still_granting(node, granted, &wanted)?;
        let slot = self.peers().slot(lane);
        let mut held = slot.lock().await;
        let mut h = match held.take() {
            Some(h) if h.made.serves(&wanted, self.limits().idle_timeout) => h,
            _ => self.dial(domain, node, &address, wanted).await?,
        };
        let link_err = |source| DialError::Link { node: node.to_owned(), source };
        let asked = async {
            match ask {
                Ask::Ping => h.link.ping().await.map(Answer::Pong),
                Ask::Request(r) => h.link.call(r).await.map(Answer::Response),
            }
        };
        let Ok(answer) = tokio::time::timeout(REQUEST_TIMEOUT, asked).await else {
            return Err(DialError::Timeout { node: node.to_owned(), after: REQUEST_TIMEOUT });
        };
        match answer {
            Ok(a) => {
                h.made.used = Instant::now();
                *held = Some(h);
                Ok(a)
            }
            // The link is sound; the peer said no.
            Err(LinkError::Peer(source)) => {
                h.made.used = Instant::now();
                *held = Some(h);
                Err(DialError::Peer { node: node.to_owned(), source })
            }
            Err(e) => Err(link_err(e)),
        }
    }

    async fn dial(&self, domain: &Domain, node: &str, address: &str, made: Freshness) -> Result<Held, DialError> {
        let Freshness { incarnation, ours, .. } = made;
        let resolve = |source| DialError::Resolve { node: node.to_owned(), address: address.to_owned(), source };
        // Bounded: the address is the peer's own record's, and a name that resolves slowly
        // would hold this node's slot (every call to it waits there) for the resolver's
        // whole timeout.
        let looked = tokio::time::timeout(self.limits().handshake_timeout, tokio::net::lookup_host(address)).await;
        let addr = looked
            .map_err(|_| resolve(Some(std::io::ErrorKind::TimedOut.into())))?
            .map_err(|e| resolve(Some(e)))?
            .next()
            .ok_or_else(|| resolve(None))?;
        let link_err = |source| DialError::Link { node: node.to_owned(), source };
        let expected = NodeIdentity::new(domain.name(), node).map_err(|e| link_err(LinkError::Identity(e)))?;
        let link = Link::connect(addr, self.credentials(), &expected, ours, self.limits()).await.map_err(link_err)?;
        made.welcomed_by(node, link.peer_incarnation())?;
        tracing::info!(peer = node, %addr, incarnation, "node link: linked");
        // Before anything is asked of this incarnation: what an earlier one granted is
        // void here (its quarantine on the peer lifts once this node reaches it). Off the
        // runtime's worker: voiding deletes the DAX devices carved for those imports.
        if let Some(d) = self.service().daemon().and_then(|w| w.upgrade()) {
            let owner = node.to_owned();
            let voided = tokio::task::spawn_blocking(move || {
                if let Some(link) = d.domain.as_ref().and_then(|x| x.link()) {
                    link.service().importer().void_owner(&d, &owner, incarnation);
                }
            });
            if let Err(e) = voided.await {
                tracing::warn!(peer = node, error = %e, "voiding an earlier incarnation's imports failed");
            }
        }
        Ok(Held { link, made })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ask_about_an_earlier_incarnations_grant_is_refused() {
        let now = Freshness { incarnation: 2, ours: 5, used: Instant::now() };
        assert!(still_granting("a", None, &now).is_ok());
        assert!(still_granting("a", Some(2), &now).is_ok());
        let e = still_granting("a", Some(1), &now).unwrap_err();
        assert!(matches!(e, DialError::Restarted { granted: 1, now: 2, .. }), "{e}");
    }

    #[test]
    fn departed_nodes_slots_go_with_their_lanes_unless_a_call_holds_them() {
        let peers = Peers::default();
        for lane in ["tray1", "tray1/data0", "tray2", "tray2/data1", "tray3"] {
            let _ = peers.slot(lane);
        }
        // A call on tray3's slot holds it.
        let busy = peers.slot("tray3");
        assert_eq!(peers.forget_departed(&|node| node == "tray1"), 2, "tray2 and its lane");
        let left: Vec<String> = {
            let mut l: Vec<String> = peers.links.lock().unwrap().keys().cloned().collect();
            l.sort();
            l
        };
        assert_eq!(left, ["tray1", "tray1/data0", "tray3"]);
        drop(busy);
        assert_eq!(peers.forget_departed(&|node| node == "tray1"), 1, "tray3 once its call ended");
    }

    #[test]
    fn a_link_serves_only_the_incarnations_it_was_made_for_and_only_while_fresh() {
        let idle = Duration::from_secs(60);
        let made = Freshness { incarnation: 7, ours: 3, used: Instant::now() };
        let now = Freshness { incarnation: 7, ours: 3, used: Instant::now() };
        assert!(made.serves(&now, idle));
        // The peer restarted, or this node did.
        assert!(!made.serves(&Freshness { incarnation: 8, ..now }, idle));
        assert!(!made.serves(&Freshness { ours: 4, ..now }, idle));
        // Idle for half the peer's idle timeout: it may be closed under a request.
        let Some(long_ago) = Instant::now().checked_sub(Duration::from_secs(31)) else { return };
        assert!(!Freshness { used: long_ago, ..made }.serves(&now, idle));
        assert!(Freshness { used: long_ago, ..made }.serves(&now, Duration::from_secs(90)));
    }
}
