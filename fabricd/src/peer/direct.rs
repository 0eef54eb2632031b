//! Calls made on the caller's own thread over a blocking link (nodelink's
//! [`BlockingLink`]): a request thread that asks another node for an import sleeps in the
//! socket's read, and the kernel wakes it with the answer — no runtime worker between the
//! answer and the thread that waits for it. At most [`LINKS_PER_NODE`] such links to one
//! peer node are open at once (with the async link and its data lanes they stay within
//! what the peer admits of one node, `LinkLimits::max_links_per_node`): a call takes an
//! idle one out, or dials one while fewer are open, or waits for one to come back until
//! its deadline — so no lock is held across a link's I/O, and concurrent imports from one
//! node share the links instead of queueing on one. A link is made anew as
//! [`super::dial`]'s are: when the peer's or this node's incarnation changed, when it
//! broke, or when it sat idle long enough that the peer may close it.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fabric_nodelink::{BlockingLink, LinkError, NodeIdentity, PeerRequest, PeerResponse, Stage};

use super::NodeLink;
use super::dial::{DialError, Freshness, REQUEST_TIMEOUT, target};
use crate::tasks::domain::Domain;

/// A link and what it was made for.
#[derive(Debug)]
struct Kept {
    link: BlockingLink,
    made: Freshness,
}

/// Blocking links open to one peer node at most.
pub const LINKS_PER_NODE: usize = 4;

/// One peer node's blocking links.
#[derive(Debug, Default)]
struct Pool {
    /// Open and not in a call, the most recently used last.
    idle: Vec<Kept>,
    /// Open (idle, in a call, or being dialled).
    open: usize,
}

/// What a call gets from the pool.
enum Got {
    /// An idle link that serves the call.
    Link(Box<Kept>),
    /// Room to dial one.
    Dial,
}

/// The blocking links, by peer node.
#[derive(Debug, Default)]
pub struct Direct {
    pools: std::sync::Arc<Pools>,
    /// Links whose call gave up waiting, read for their late answer ([`Late`]).
    late: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// Every node's pool, and its wake-ups; shared with the threads that read late answers,
/// whose links stay counted open until they end.
#[derive(Debug, Default)]
struct Pools {
    /// Held only to take a link out, count one, or put one back; never across I/O.
    map: Mutex<HashMap<String, Pool>>,
    /// Told when a link came back or closed, to any node: every waiter looks again at
    /// its own node's pool.
    freed: Condvar,
}

impl Pools {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Pool>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `count` links to `node` closed: room for as many more.
    fn closed(&self, node: &str, count: usize) {
        if let Some(pool) = self.lock().get_mut(node) {
            pool.open = pool.open.saturating_sub(count);
        }
        self.freed.notify_all();
    }
}

/// A link a late answer is read on, counted open to its node until it closes: the peer
/// counts it against this node's links until then.
struct LateLink {
    pools: std::sync::Arc<Pools>,
    node: String,
}

impl Drop for LateLink {
    fn drop(&mut self) {
        self.pools.closed(&self.node, 1);
    }
}

/// One of [`MAX_LATE`], given back when dropped.
struct LateSlot(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Drop for LateSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// What a caller does with an answer that came after it gave up (an import the owner
/// granted meanwhile, given back): run on a thread of its own.
pub type Late = Box<dyn FnOnce(PeerResponse) + Send>;

/// How long a late answer is waited for after its call gave up.
const LATE_WAIT: Duration = Duration::from_secs(10);

/// Links read for a late answer at once (each a thread and a socket); past that, one
/// more is dropped as before.
const MAX_LATE: usize = 16;

/// One link counted open to a node, held by one call (being dialled or in use). Dropped,
/// it gives its count back and wakes the waiters — on every path out of a call, an error
/// or a panic included; [`Claim::put_back`] keeps the link for a later call instead.
struct Claim<'a> {
    direct: &'a Direct,
    node: &'a str,
    kept: bool,
}

impl Claim<'_> {
    /// Puts `link` back for a later call, this claim's count with it.
    fn put_back(mut self, link: Kept) {
        self.kept = true;
        self.direct.pools().entry(self.node.to_owned()).or_default().idle.push(link);
        self.direct.pools.freed.notify_all();
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.direct.closed(self.node, 1);
        }
    }
}

impl Direct {
    fn pools(&self) -> MutexGuard<'_, HashMap<String, Pool>> {
        self.pools.lock()
    }

    /// Reads `link`'s late answer on a thread of its own and hands it to `late`; the
    /// link is closed after, and counted open to its node until then (`claim`'s count
    /// goes with it). Past [`MAX_LATE`] such reads, the link is closed at once.
    fn read_late(&self, claim: Claim<'_>, mut link: BlockingLink, late: Late) {
        use std::sync::atomic::Ordering;
        let node = claim.node;
        if self.late.fetch_add(1, Ordering::AcqRel) >= MAX_LATE {
            self.late.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(peer = node, "node link: too many late answers awaited; one is not");
            return;
        }
        let (slot, node) = (LateSlot(self.late.clone()), node.to_owned());
        // The claim's count, now the late read's: given back when the thread ends (or is
        // not spawned: the closure is dropped with it).
        let mut claim = claim;
        claim.kept = true;
        let open = LateLink { pools: self.pools.clone(), node: node.clone() };
        let spawned = std::thread::Builder::new().name("fabricd-late".into()).spawn(move || {
            let (_slot, _open) = (slot, open);
            match link.late_answer(Instant::now() + LATE_WAIT) {
                Ok(answer) => late(answer),
                Err(e) => tracing::debug!(peer = %node, error = %e, "node link: no late answer"),
            }
        });
        // Not spawned: the closure, its slot and the link with it, are dropped.
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "node link: cannot wait for a late answer");
        }
    }

    /// An idle link to `node` that serves `now`, or room to dial one, waiting for either
    /// until `deadline` (`None`: it passed). Idle links that no longer serve are closed
    /// (after the lock).
    fn get<'a>(
        &'a self,
        node: &'a str,
        now: &Freshness,
        idle_limit: Duration,
        deadline: Instant,
    ) -> Option<(Claim<'a>, Got)> {
        let mut stale = Vec::new();
        let mut pools = self.pools();
        let got = loop {
            let pool = pools.entry(node.to_owned()).or_default();
            let (serving, old): (Vec<Kept>, Vec<Kept>) =
                std::mem::take(&mut pool.idle).into_iter().partition(|k| k.made.serves(now, idle_limit));
            pool.open = pool.open.saturating_sub(old.len());
            stale.extend(old);
            pool.idle = serving;
            if let Some(k) = pool.idle.pop() {
                break Some(Got::Link(Box::new(k)));
            }
            if pool.open < LINKS_PER_NODE {
                pool.open += 1;
                break Some(Got::Dial);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break None;
            }
            pools = self.pools.freed.wait_timeout(pools, left).unwrap_or_else(|p| p.into_inner()).0;
        };
        drop(pools);
        // Claimed before the stale links close (a drop that panicked would lose the count).
        let claimed = got.map(|g| (Claim { direct: self, node, kept: false }, g));
        if stale.len() > usize::from(matches!(claimed, Some((_, Got::Dial)))) {
            // Room freed beyond what this call took: others may dial.
            self.pools.freed.notify_all();
        }
        drop(stale);
        claimed
    }

    /// `count` links to `node` counted open are gone.
    fn closed(&self, node: &str, count: usize) {
        self.pools.closed(node, count);
    }

    /// Closes the idle links to nodes not in `live` (they left the domain): nothing would
    /// take them out again, and the peer closed its end long ago. Links in a call end
    /// with it.
    pub fn forget_departed(&self, live: &dyn Fn(&str) -> bool) {
        let mut gone = Vec::new();
        let mut pools = self.pools();
        pools.retain(|node, pool| {
            if live(node) {
                return true;
            }
            pool.open = pool.open.saturating_sub(pool.idle.len());
            gone.append(&mut pool.idle);
            pool.open > 0
        });
        drop(pools);
        drop(gone);
    }

    /// How many links are open to `node` (idle, in a call, or being dialled).
    pub fn open(&self, node: &str) -> usize {
        self.pools().get(node).map_or(0, |p| p.open)
    }
}

/// `address` (`host:port`) resolved by `deadline`: an address as is, a name on a thread
/// of its own (the resolver has no timeout), given up when the deadline passes.
fn resolve(address: &str, deadline: Instant) -> Result<SocketAddr, Option<std::io::Error>> {
    if let Ok(addr) = address.parse() {
        return Ok(addr);
    }
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Some(std::io::ErrorKind::TimedOut.into()));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = address.to_owned();
    std::thread::Builder::new()
        .name("fabricd-resolve".into())
        .spawn(move || {
            let _ = tx.send(name.to_socket_addrs().map(|mut a| a.next()));
        })
        .map_err(Some)?;
    match rx.recv_timeout(left) {
        Ok(Ok(Some(addr))) => Ok(addr),
        Ok(Ok(None)) => Err(None),
        Ok(Err(e)) => Err(Some(e)),
        Err(_) => Err(Some(std::io::ErrorKind::TimedOut.into())),
    }
}

impl NodeLink {
    /// Sends `request` to `node` and waits for its answer on this thread, at most `within`
    /// (a wait for a free link and the handshake of a new one included). Blocks: for a
    /// request's thread, never one of the domain runtime's workers. With `granted`, only
    /// while `node` is that incarnation ([`DialError::Restarted`] otherwise): what it
    /// answers is then that incarnation's.
    ///
    /// When the call gives up waiting for the answer to a request it sent, `late` (if
    /// any) gets that answer should it come within `LATE_WAIT` (10 s): the peer may have acted
    /// on it (an owner records an import before it answers).
    pub fn call_here(
        &self,
        domain: &Domain,
        (node, granted): (&str, Option<u64>),
        request: PeerRequest,
        within: Duration,
        late: Option<Late>,
    ) -> Result<PeerResponse, DialError> {
        let asked = Instant::now();
        let deadline = asked + within;
        let (wanted, address) = target(domain, node)?;
        super::dial::still_granting(node, granted, &wanted)?;
        // The time since the ask began, to the millisecond (what an operator reads).
        let timeout = |by: Instant| {
            let after = Duration::from_millis(u64::try_from(by.duration_since(asked).as_millis()).unwrap_or(u64::MAX));
            DialError::Timeout { node: node.to_owned(), after }
        };
        let Some((claim, got)) = self.direct().get(node, &wanted, self.limits().idle_timeout, deadline) else {
            return Err(timeout(deadline));
        };
        let mut kept = match got {
            Got::Link(k) => *k,
            Got::Dial => self.dial_here(domain, node, &address, wanted, deadline)?,
        };
        // The wait for a link, or the dial, may have used all the time: the link is
        // kept for a later call rather than broken by a call with none left.
        if Instant::now() >= deadline {
            claim.put_back(kept);
            return Err(timeout(deadline));
        }
        // As on the async links: a peer cut off by the network is given up after
        // `REQUEST_TIMEOUT` of waiting for the answer (and the link with it).
        let answer_by = deadline.min(Instant::now() + REQUEST_TIMEOUT);
        match kept.link.call(request, answer_by) {
            Ok(answer) => {
                kept.made.used = Instant::now();
                claim.put_back(kept);
                Ok(answer)
            }
            // The link is sound; the peer said no.
            Err(LinkError::Peer(source)) => {
                kept.made.used = Instant::now();
                claim.put_back(kept);
                Err(DialError::Peer { node: node.to_owned(), source })
            }
            // Given up or broken mid-way: the link is dropped (closed) with its claim; a
            // later call dials. One whose answer may still come is read for it first.
            Err(LinkError::Timeout(_)) if Instant::now() >= answer_by => {
                if let Some(late) = late.filter(|_| kept.link.answer_pending()) {
                    self.direct().read_late(claim, kept.link, late);
                }
                Err(timeout(answer_by))
            }
            Err(source) => Err(DialError::Link { node: node.to_owned(), source }),
        }
    }

    /// A new blocking link to `node` at `address`, checked against the incarnation its
    /// member record states, by `deadline`; what an earlier incarnation of it granted is
    /// void here first.
    fn dial_here(
        &self,
        domain: &Domain,
        node: &str,
        address: &str,
        made: Freshness,
        deadline: Instant,
    ) -> Result<Kept, DialError> {
        let addr = resolve(address, deadline).map_err(|source| DialError::Resolve {
            node: node.to_owned(),
            address: address.to_owned(),
            source,
        })?;
        let link_err = |source| DialError::Link { node: node.to_owned(), source };
        let expected = NodeIdentity::new(domain.name(), node).map_err(|e| link_err(LinkError::Identity(e)))?;
        // The handshake ends by the call's deadline too.
        let mut limits = self.limits();
        limits.handshake_timeout = limits.handshake_timeout.min(deadline.saturating_duration_since(Instant::now()));
        if limits.handshake_timeout.is_zero() {
            return Err(link_err(LinkError::Timeout(Stage::Handshake)));
        }
        let mut link =
            BlockingLink::connect(addr, self.credentials(), &expected, made.ours, limits).map_err(link_err)?;
        link.set_answer_poll(self.answer_poll);
        made.welcomed_by(node, link.peer_incarnation())?;
        tracing::info!(peer = node, %addr, incarnation = made.incarnation, "node link: linked (direct)");
        // As for every new link (`dial.rs`): before anything is asked of this incarnation.
        if let Some(d) = self.service().daemon().and_then(|w| w.upgrade()) {
            self.service().importer().void_owner(&d, node, made.incarnation);
        }
        Ok(Kept { link, made })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_resolves_at_once_and_a_name_by_the_deadline() {
        let soon = Instant::now() + Duration::from_secs(5);
        assert_eq!(resolve("10.77.0.11:7470", soon).unwrap(), "10.77.0.11:7470".parse().unwrap());
        assert_eq!(resolve("[fd00::1]:7470", soon).unwrap(), "[fd00::1]:7470".parse().unwrap());
        assert!(resolve("localhost:7470", soon).unwrap().ip().is_loopback());
        assert!(resolve("no port here", soon).is_err());
        // A deadline that passed: a name is not waited for.
        let past = Instant::now();
        let Err(Some(e)) = resolve("localhost:7470", past) else { panic!("resolved past its deadline") };
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    }

    /// Takes a claim on `node` by `within` and forgets it without giving its count back
    /// (as a call in progress holds it), answering what the pool gave.
    fn hold(direct: &Direct, node: &str, now: &Freshness, within: Duration) -> Option<bool> {
        let (claim, got) = direct.get(node, now, Duration::from_secs(60), Instant::now() + within)?;
        std::mem::forget(claim);
        Some(matches!(got, Got::Dial))
    }

    #[test]
    fn the_pool_dials_up_to_its_bound_then_waits_for_a_link_until_the_deadline() {
        let direct = Direct::default();
        let now = Freshness { incarnation: 1, ours: 1, used: Instant::now() };
        let soon = Duration::from_millis(200);
        for _ in 0..LINKS_PER_NODE {
            assert_eq!(hold(&direct, "n1", &now, soon), Some(true));
        }
        assert_eq!(direct.open("n1"), LINKS_PER_NODE);
        // Full: waits, then gives up at the deadline.
        let start = Instant::now();
        assert!(hold(&direct, "n1", &now, soon).is_none());
        assert!(start.elapsed() >= Duration::from_millis(190), "{:?}", start.elapsed());
        // Another node has its own bound.
        assert_eq!(hold(&direct, "n2", &now, soon), Some(true));
        // A link that closes lets a waiting call dial.
        std::thread::scope(|s| {
            let waiter = s.spawn(|| hold(&direct, "n1", &now, Duration::from_secs(5)));
            std::thread::sleep(Duration::from_millis(50));
            direct.closed("n1", 1);
            assert_eq!(waiter.join().unwrap(), Some(true));
        });
        assert_eq!(direct.open("n1"), LINKS_PER_NODE);
        direct.closed("n3", 1);
        assert_eq!(direct.open("n3"), 0, "an unknown node's count stays at zero");
    }

    #[test]
    fn a_link_freed_to_one_node_wakes_its_waiter_though_another_nodes_wait_too() {
        let direct = Direct::default();
        let now = Freshness { incarnation: 1, ours: 1, used: Instant::now() };
        for node in ["n1", "n2"] {
            for _ in 0..LINKS_PER_NODE {
                assert_eq!(hold(&direct, node, &now, Duration::from_millis(100)), Some(true));
            }
        }
        std::thread::scope(|s| {
            // Waiters on both nodes; the one freed link is n1's. With one wake-up for
            // one waiter, n2's could take it and n1's sleep to its deadline.
            let others: Vec<_> =
                (0..3).map(|_| s.spawn(|| hold(&direct, "n2", &now, Duration::from_millis(1500)))).collect();
            let waiter = s.spawn(|| {
                let start = Instant::now();
                (hold(&direct, "n1", &now, Duration::from_secs(5)), start.elapsed())
            });
            std::thread::sleep(Duration::from_millis(100));
            direct.closed("n1", 1);
            let (got, waited) = waiter.join().unwrap();
            assert_eq!(got, Some(true));
            assert!(waited < Duration::from_secs(1), "n1's waiter slept {waited:?}");
            for o in others {
                assert!(o.join().unwrap().is_none(), "n2 had no room");
            }
        });
    }

    /// Admits everyone; answers each request after 300 ms.
    struct Slow;

    impl fabric_nodelink::PeerPolicy for Slow {
        fn admit(&self, _: &NodeIdentity, _: u64) -> Result<(), fabric_nodelink::Refusal> {
            Ok(())
        }
    }

    impl fabric_nodelink::PeerService for Slow {
        fn serve(&self, _: &fabric_nodelink::Peer, request: fabric_nodelink::PeerRequest) -> fabric_nodelink::Served {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(PeerResponse { op: request.op, body: request.body })
            })
        }
    }

    /// A link whose call gave up, read on for its late answer, stays counted open to its
    /// node until it closes: the peer counts it against this node's links until then, so
    /// a call does not dial past the bound meanwhile. Before, it was counted closed at
    /// once, and slow answers let one node hold more links than the peer admits.
    #[test]
    fn a_link_read_for_its_late_answer_stays_counted_until_it_closes() {
        use fabric_nodelink::{Credentials, DomainCa, PeerOp, PeerRequest, San, Server};
        let rt = tokio::runtime::Runtime::new().unwrap();
        let ca = DomainCa::generate("lab").unwrap();
        let creds = |node: &str| {
            let pem = ca.issue(node, &[San::Dns("localhost".into())]).unwrap();
            Credentials::from_pem(&ca.pem().cert, &pem).unwrap()
        };
        let (server, me) = (creds("n1"), creds("n2"));
        let limits = fabric_nodelink::LinkLimits::default();
        let any = "127.0.0.1:0".parse().unwrap();
        let server = rt
            .block_on(Server::bind_serving(
                any,
                &server,
                7,
                std::sync::Arc::new(Slow),
                std::sync::Arc::new(Slow),
                limits,
            ))
            .unwrap();
        let mut link =
            BlockingLink::connect(server.local_addr(), &me, &creds("n1").identity().clone(), 1, limits).unwrap();
        let direct = Direct::default();
        let now = Freshness { incarnation: 7, ours: 1, used: Instant::now() };
        let (claim, got) =
            direct.get("n1", &now, Duration::from_secs(60), Instant::now() + Duration::from_secs(1)).unwrap();
        assert!(matches!(got, Got::Dial));
        let gave_up =
            link.call(PeerRequest { op: PeerOp::Import, body: vec![1] }, Instant::now() + Duration::from_millis(50));
        assert!(gave_up.is_err() && link.answer_pending(), "{gave_up:?}");
        let (tx, rx) = std::sync::mpsc::channel();
        direct.read_late(claim, link, Box::new(move |answer| drop(tx.send(answer.body))));
        assert_eq!(direct.open("n1"), 1, "counted open while its late answer is read");
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), vec![1]);
        let deadline = Instant::now() + Duration::from_secs(2);
        while direct.open("n1") != 0 {
            assert!(Instant::now() < deadline, "still counted after the late read ended");
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(server);
    }

    #[test]
    fn a_call_that_panics_gives_its_link_back() {
        let direct = Direct::default();
        let now = Freshness { incarnation: 1, ours: 1, used: Instant::now() };
        let soon = Instant::now() + Duration::from_millis(100);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _claim = direct.get("n1", &now, Duration::from_secs(60), soon);
            assert_eq!(direct.open("n1"), 1);
            panic!("a dial that panics");
        }));
        assert!(panicked.is_err());
        assert_eq!(direct.open("n1"), 0);
    }

    #[test]
    fn idle_links_to_departed_nodes_are_forgotten_but_not_those_in_a_call() {
        let direct = Direct::default();
        let now = Freshness { incarnation: 1, ours: 1, used: Instant::now() };
        assert_eq!(hold(&direct, "gone", &now, Duration::from_millis(100)), Some(true));
        assert_eq!(hold(&direct, "here", &now, Duration::from_millis(100)), Some(true));
        direct.forget_departed(&|n| n == "here");
        assert_eq!(direct.open("gone"), 1, "the link in a call still counts");
        assert_eq!(direct.open("here"), 1);
        direct.closed("gone", 1);
        direct.forget_departed(&|n| n == "here");
        assert!(!direct.pools().contains_key("gone"));
    }
}
