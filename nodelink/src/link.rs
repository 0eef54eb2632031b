//! The node link over TCP: a [`Server`] that admits peers whose certificate, Hello and
//! incarnation agree, and a client [`Link`]. Bounded: at most
//! [`LinkLimits::max_handshakes`] connections are being admitted and at most
//! [`LinkLimits::max_links`] links are held at once, [`LinkLimits::max_links_per_node`]
//! of them by one node (more are closed at once, or refused `Busy` or `NodeBusy`; when
//! every handshake slot is taken, an address holding two fewer takes the oldest of the
//! address holding the most, `admitting.rs`); every wait has a deadline. A misbehaving peer
//! loses its own connection and nothing else.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::admitting::{Admitting, Slot, Taken};
use crate::error::{LinkError, Stage};
use crate::framed::Framed;
use crate::identity::NodeIdentity;
use crate::message::{
    HELLO_DECODER, Hello, PEER_DECODER, PEER_PROTOCOL, PEER_PROTOCOL_MIN, PeerError, PeerFailure, PeerMessage, PeerOp,
    PeerRequest, PeerResponse, Refusal, Welcome, agree,
};
use crate::tls::{Credentials, peer_identity, server_name};

/// The bounds of a node's links.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkLimits {
    /// Connections being admitted (TLS handshake and Hello) at once; more are closed on
    /// accept, unless they come from an address holding at least two fewer of these slots
    /// than another (that address's oldest handshake is ended for them).
    pub max_handshakes: usize,
    /// Admitted links at once; more are refused [`Refusal::Busy`].
    pub max_links: usize,
    /// Admitted links of one node at once (fabricd holds one to each peer, plus its data
    /// lanes); more are refused [`Refusal::NodeBusy`], so that one node, misbehaving or
    /// compromised, cannot take the links every other node needs.
    pub max_links_per_node: usize,
    /// From TCP accept (or connect) to Welcome.
    pub handshake_timeout: Duration,
    /// A begun frame must end, and a write finish, within this.
    pub frame_timeout: Duration,
    /// A link with no frame for this long is closed (peers ping more often); a client
    /// waits this long for an answer.
    pub idle_timeout: Duration,
}

impl Default for LinkLimits {
    fn default() -> Self {
        Self {
            max_handshakes: 32,
            max_links: 256,
            max_links_per_node: 16,
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Who may link: asked for every peer whose certificate and Hello agree. The domain answers
/// from etcd's member records: a node that is no member, or an incarnation that is not its
/// current one, is refused. Called on the connection's task: it must answer from memory
/// (the daemon's view of the member records), never wait on etcd.
pub trait PeerPolicy: Send + Sync + 'static {
    /// Whether `node` at `incarnation` may link now.
    fn admit(&self, node: &NodeIdentity, incarnation: u64) -> Result<(), Refusal>;
}

/// The answer a [`PeerService`] gives, as a future that owns what it needs.
pub type Served = Pin<Box<dyn Future<Output = Result<PeerResponse, PeerError>> + Send + 'static>>;

/// What an admitted peer's requests reach: the daemon's cross-node operations. Each
/// request is answered on the link's own task, one at a time per link, so a slow answer
/// delays only the peer that asked.
pub trait PeerService: Send + Sync + 'static {
    /// The answer to `request` from `peer`.
    fn serve(&self, peer: &Peer, request: PeerRequest) -> Served;
}

/// A service that serves nothing: every request is answered [`PeerError::Unsupported`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Unserved;

impl PeerService for Unserved {
    fn serve(&self, _peer: &Peer, request: PeerRequest) -> Served {
        let op = request.op;
        Box::pin(async move { Err(PeerError::Unsupported(op)) })
    }
}

/// An admitted peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its identity, from its certificate.
    pub identity: NodeIdentity,
    /// Its incarnation, from its Hello (admitted by the policy).
    pub incarnation: u64,
    /// Its address.
    pub addr: SocketAddr,
    /// The peer protocol the link speaks (the newest both ends do).
    pub version: u16,
}

/// What a server did with the connections it accepted, since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Closed at accept: too many were being admitted, none of them from an address
    /// holding more handshake slots than this one's.
    pub closed_at_accept: u64,
    /// Handshakes ended to give their slot to a connection from an address holding fewer.
    pub ended_for_another: u64,
    /// Admitted (Welcome sent).
    pub admitted: u64,
    /// Refused with a [`Refusal`] (a Hello that disagrees, the policy, `Busy`).
    pub refused: u64,
    /// Dropped before a Hello could be answered: no or a bad certificate, not TLS, garbage
    /// or nothing instead of a Hello.
    pub failed: u64,
}

#[derive(Debug, Default)]
struct Counters {
    closed_at_accept: AtomicU64,
    ended_for_another: AtomicU64,
    admitted: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
}

impl Counters {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> LinkStats {
        LinkStats {
            closed_at_accept: self.closed_at_accept.load(Ordering::Relaxed),
            ended_for_another: self.ended_for_another.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

struct Shared {
    counters: Arc<Counters>,
    acceptor: TlsAcceptor,
    identity: NodeIdentity,
    incarnation: Arc<AtomicU64>,
    policy: Arc<dyn PeerPolicy>,
    service: Arc<dyn PeerService>,
    limits: LinkLimits,
    handshakes: Arc<Admitting>,
    links: Arc<Semaphore>,
    by_node: Arc<NodeLinks>,
    /// Refusals of peers with a valid certificate, logged at most once per
    /// [`REPORT_EVERY`] (a refused node that reconnects in a loop must not flood the log).
    refusals: Throttle,
}

/// Counts events and says when to report them: at most once per [`REPORT_EVERY`], with
/// how many came since the last report.
#[derive(Debug, Default)]
struct Throttle(Mutex<(Option<Instant>, u64)>);

impl Throttle {
    /// One more event: `Some(events since the last report, this one included)` when it
    /// is to be reported now.
    fn tick(&self) -> Option<u64> {
        let mut st = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        st.1 += 1;
        if st.0.is_some_and(|at| at.elapsed() < REPORT_EVERY) {
            return None;
        }
        let n = std::mem::take(&mut st.1);
        st.0 = Some(Instant::now());
        Some(n)
    }

    /// The events held back at the end of a burst, once a period passed since the last
    /// report (else they would wait for the next event, which may never come).
    fn held_back(&self) -> Option<u64> {
        let mut st = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if st.1 == 0 || st.0.is_some_and(|at| at.elapsed() < REPORT_EVERY) {
            return None;
        }
        st.0 = Some(Instant::now());
        Some(std::mem::take(&mut st.1))
    }
}

/// Links held by each node.
#[derive(Debug, Default)]
struct NodeLinks(Mutex<HashMap<String, usize>>);

impl NodeLinks {
    /// One more link of `node`, unless it holds `max`.
    fn take(self: &Arc<Self>, node: &str, max: usize) -> Result<NodeLink, Refusal> {
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held.entry(node.to_owned()).or_default();
        if *n >= max {
            return Err(Refusal::NodeBusy { node: node.to_owned(), max: u32::try_from(max).unwrap_or(u32::MAX) });
        }
        *n += 1;
        Ok(NodeLink { links: self.clone(), node: node.to_owned() })
    }
}

/// A node's hold of one of its links, given back when dropped.
#[derive(Debug)]
struct NodeLink {
    links: Arc<NodeLinks>,
    node: String,
}

impl Drop for NodeLink {
    fn drop(&mut self) {
        let mut held = self.links.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.node) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.node);
            }
        }
    }
}

/// An admitted link's place: among all links and among its node's.
#[derive(Debug)]
struct Admitted {
    _all: OwnedSemaphorePermit,
    _node: NodeLink,
}

/// A listening node-link server. Dropping it stops it and closes every link it holds.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    counters: Arc<Counters>,
    incarnation: Arc<AtomicU64>,
    handshakes: Arc<Admitting>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Listens on `addr` as the node `creds` names, at `incarnation`; serves no request
    /// ([`Unserved`]).
    pub async fn bind(
        addr: SocketAddr,
        creds: &Credentials,
        incarnation: u64,
        policy: Arc<dyn PeerPolicy>,
        limits: LinkLimits,
    ) -> Result<Self, LinkError> {
        Self::bind_serving(addr, creds, incarnation, policy, Arc::new(Unserved), limits).await
    }

    /// Listens on `addr` as the node `creds` names, at `incarnation`; admitted peers'
    /// requests go to `service`.
    pub async fn bind_serving(
        addr: SocketAddr,
        creds: &Credentials,
        incarnation: u64,
        policy: Arc<dyn PeerPolicy>,
        service: Arc<dyn PeerService>,
        limits: LinkLimits,
    ) -> Result<Self, LinkError> {
        let acceptor = TlsAcceptor::from(creds.server_config()?);
        let listener = TcpListener::bind(addr).await.map_err(LinkError::Io)?;
        let addr = listener.local_addr().map_err(LinkError::Io)?;
        let counters = Arc::new(Counters::default());
        let incarnation = Arc::new(AtomicU64::new(incarnation));
        let handshakes = Admitting::new(limits.max_handshakes);
        let shared = Arc::new(Shared {
            counters: counters.clone(),
            acceptor,
            identity: creds.identity().clone(),
            incarnation: incarnation.clone(),
            policy,
            service,
            limits,
            handshakes: handshakes.clone(),
            links: Arc::new(Semaphore::new(limits.max_links)),
            by_node: Arc::default(),
            refusals: Throttle::default(),
        });
        let task = tokio::spawn(accept_loop(listener, shared));
        Ok(Self { addr, counters, incarnation, handshakes, task })
    }

    /// The addresses the domain's members advertise (each call replaces the last): their
    /// connections come first for a handshake slot, so a flood of silent connections from
    /// any number of other addresses cannot keep a member out (`admitting.rs`).
    pub fn set_member_addresses(&self, addrs: impl IntoIterator<Item = std::net::IpAddr>) {
        self.handshakes.set_members(addrs);
    }

    /// How many member sources the listener knows (the last [`Server::set_member_addresses`],
    /// an IPv6 /64 counted once).
    pub fn member_sources(&self) -> usize {
        self.handshakes.members()
    }

    /// The incarnation later Welcomes state: a node that rejoined its domain keeps its
    /// listener. Links admitted before keep running; their peers see the new incarnation
    /// in the member records.
    pub fn set_incarnation(&self, incarnation: u64) {
        self.incarnation.store(incarnation, Ordering::Relaxed);
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it did with the connections it accepted.
    pub fn stats(&self) -> LinkStats {
        self.counters.snapshot()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How often what a flood causes is reported (a flood must not flood the log too):
/// connections closed at accept for want of a handshake slot, peers refused.
const REPORT_EVERY: Duration = Duration::from_secs(1);

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut conns = JoinSet::new();
    let dropped = Throttle::default();
    let mut report = tokio::time::interval(REPORT_EVERY);
    report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = report.tick() => {
                if let Some(dropped) = dropped.held_back() {
                    tracing::warn!(dropped, "node link: too many connections being admitted; closed at accept (the last of a burst)");
                }
                if let Some(refused) = shared.refusals.held_back() {
                    tracing::warn!(refused, "node link: peers refused (the last of a burst)");
                }
            }
            accepted = listener.accept() => {
                let (tcp, addr) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors or a connection reset before accept: wait a
                        // little rather than spin.
                        tracing::warn!(error = %e, "node link: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let slot = match shared.handshakes.take(addr.ip()) {
                    Taken::Free(slot) => slot,
                    Taken::FromAnother(slot, from) => {
                        Counters::bump(&shared.counters.ended_for_another);
                        tracing::debug!(%addr, %from, "node link: a handshake slot taken from an address holding more");
                        slot
                    }
                    Taken::Full => {
                        drop(tcp);
                        Counters::bump(&shared.counters.closed_at_accept);
                        if let Some(dropped) = dropped.tick() {
                            tracing::warn!(%addr, dropped, "node link: too many connections being admitted; closed at accept");
                        }
                        continue;
                    }
                };
                conns.spawn(serve(tcp, addr, shared.clone(), slot));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn serve(tcp: TcpStream, addr: SocketAddr, shared: Arc<Shared>, mut handshake: Slot) {
    let limits = shared.limits;
    let admitted = tokio::select! {
        r = tokio::time::timeout(limits.handshake_timeout, admit(tcp, addr, &shared)) => match r {
            Err(_) => Err(LinkError::Timeout(Stage::Handshake)),
            Ok(r) => r,
        },
        _ = &mut handshake.ended => {
            // Counted when its slot was taken.
            tracing::debug!(%addr, "node link: handshake ended for a connection from an address holding fewer");
            return;
        }
    };
    drop(handshake);
    let counters = &shared.counters;
    let (mut framed, peer, _link) = match admitted {
        Ok(a) => {
            Counters::bump(&counters.admitted);
            a
        }
        Err(LinkError::Refused(refusal)) => {
            // Only a node with a valid certificate gets this far: worth a warning.
            Counters::bump(&counters.refused);
            if let Some(refused) = shared.refusals.tick() {
                tracing::warn!(%addr, %refusal, refused, "node link: peer refused (refused: how many since the last such line)");
            }
            return;
        }
        Err(e) => {
            // Anyone can cause these, as fast as they can connect: counted, logged quietly.
            Counters::bump(&counters.failed);
            tracing::debug!(%addr, error = %e, "node link: connection dropped before admission");
            return;
        }
    };
    tracing::info!(%addr, peer = %peer.identity, incarnation = peer.incarnation, "node link: peer admitted");
    let end = serve_link(&mut framed, &peer, &*shared.service, limits).await;
    tracing::info!(%addr, peer = %peer.identity, error = %end, "node link: closed");
    framed.close().await;
}

type ServerStream = tokio_rustls::server::TlsStream<TcpStream>;

/// TLS, then the Hello: the identity is the certificate's, and the Hello must agree with
/// it; then the policy and the link limits (the node's, then all links').
async fn admit(
    tcp: TcpStream,
    addr: SocketAddr,
    shared: &Shared,
) -> Result<(Framed<ServerStream>, Peer, Admitted), LinkError> {
    let _ = tcp.set_nodelay(true);
    let tls = shared.acceptor.accept(tcp).await.map_err(LinkError::Io)?;
    let identity = peer_identity(tls.get_ref().1.peer_certificates())?;
    // Until it is admitted, the peer's frames are a Hello's size at most.
    let mut framed = Framed::with_limits(tls, shared.limits.frame_timeout, HELLO_DECODER);
    let (id, message) = framed.recv(shared.limits.handshake_timeout).await?;
    let PeerMessage::Hello(hello) = message else {
        return Err(LinkError::unexpected("a hello", &message));
    };
    framed.set_limits(PEER_DECODER);
    let verdict = check_hello(shared, &identity, &hello).and_then(|version| {
        shared.policy.admit(&identity, hello.incarnation)?;
        // The node's share first: a node at its share never takes a link of all.
        let node = shared.by_node.take(&identity.node, shared.limits.max_links_per_node)?;
        let all = shared.links.clone().try_acquire_owned().map_err(|_| Refusal::Busy)?;
        Ok((version, Admitted { _all: all, _node: node }))
    });
    match verdict {
        Ok((version, link)) => {
            let welcome = Welcome {
                node: shared.identity.node.clone(),
                incarnation: shared.incarnation.load(Ordering::Relaxed),
                version,
            };
            framed.send(id, &PeerMessage::Welcome(welcome)).await?;
            Ok((framed, Peer { identity, incarnation: hello.incarnation, addr, version }, link))
        }
        Err(refusal) => {
            framed.send(id, &PeerMessage::Refused(refusal.clone())).await?;
            framed.close().await;
            Err(LinkError::Refused(refusal))
        }
    }
}

/// The peer protocol agreed with `hello`'s node, if it is admitted so far.
fn check_hello(shared: &Shared, certified: &NodeIdentity, hello: &Hello) -> Result<u16, Refusal> {
    let version =
        agree(hello.version).ok_or(Refusal::Version { offered: hello.version, supported: PEER_PROTOCOL_MIN })?;
    let ours = &shared.identity.domain;
    for claimed in [&hello.domain, &certified.domain] {
        if claimed != ours {
            return Err(Refusal::WrongDomain { ours: ours.clone(), claimed: claimed.clone() });
        }
    }
    if hello.node != certified.node {
        return Err(Refusal::NotCertified { certified: certified.node.clone(), claimed: hello.node.clone() });
    }
    Ok(version)
}

/// Answers an admitted peer until it leaves, stalls or misbehaves: pings here, requests by
/// the service.
async fn serve_link(
    framed: &mut Framed<ServerStream>,
    peer: &Peer,
    service: &dyn PeerService,
    limits: LinkLimits,
) -> LinkError {
    loop {
        let (id, message) = match framed.recv(limits.idle_timeout).await {
            Ok(m) => m,
            Err(e) => return e,
        };
        let answer = match message {
            PeerMessage::Ping => PeerMessage::Pong,
            PeerMessage::Request(request) => {
                let op = request.op;
                match service.serve(peer, request).await {
                    Ok(response) if response.op == op => PeerMessage::Response(response),
                    Ok(response) => {
                        tracing::warn!(peer = %peer.identity, ?op, answered = ?response.op, "node link: service answered another operation");
                        PeerMessage::Failure(PeerFailure { op, error: PeerError::Unsupported(op) })
                    }
                    Err(error) => PeerMessage::Failure(PeerFailure { op, error }),
                }
            }
            other => return LinkError::unexpected("a ping or a request", &other),
        };
        if let Err(e) = framed.send(id, &answer).await {
            return e;
        }
    }
}

type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;

/// A link to another node, as its client.
#[derive(Debug)]
pub struct Link {
    framed: Framed<ClientStream>,
    peer: NodeIdentity,
    peer_incarnation: u64,
    version: u16,
    next_id: u64,
    limits: LinkLimits,
}

impl Link {
    /// Links to `expected` at `addr` as the node `creds` names, at `incarnation`.
    pub async fn connect(
        addr: SocketAddr,
        creds: &Credentials,
        expected: &NodeIdentity,
        incarnation: u64,
        limits: LinkLimits,
    ) -> Result<Self, LinkError> {
        Self::connect_with(addr, creds, expected, hello_of(creds, incarnation), limits).await
    }

    /// [`Link::connect`] with the Hello given (tests: a Hello that lies).
    pub async fn connect_with(
        addr: SocketAddr,
        creds: &Credentials,
        expected: &NodeIdentity,
        hello: Hello,
        limits: LinkLimits,
    ) -> Result<Self, LinkError> {
        let connector = TlsConnector::from(creds.client_config(expected)?);
        let name = server_name(expected)?;
        let handshake = async {
            let tcp = TcpStream::connect(addr).await.map_err(LinkError::Io)?;
            let _ = tcp.set_nodelay(true);
            let tls = connector.connect(name, tcp).await.map_err(LinkError::Io)?;
            let mut framed = Framed::new(tls, limits.frame_timeout);
            framed.send(0, &PeerMessage::Hello(hello)).await?;
            let welcome = welcomed(expected, framed.recv(limits.handshake_timeout).await?)?;
            Ok::<_, LinkError>((framed, welcome))
        };
        let (framed, welcome) = match tokio::time::timeout(limits.handshake_timeout, handshake).await {
            Err(_) => return Err(LinkError::Timeout(Stage::Handshake)),
            Ok(r) => r?,
        };
        let (peer, peer_incarnation, version) = (expected.clone(), welcome.incarnation, welcome.version);
        Ok(Self { framed, peer, peer_incarnation, version, next_id: 1, limits })
    }

    /// The peer, as its certificate names it.
    pub fn peer(&self) -> &NodeIdentity {
        &self.peer
    }

    /// The peer's incarnation, from its Welcome.
    pub fn peer_incarnation(&self) -> u64 {
        self.peer_incarnation
    }

    /// The peer protocol the link speaks, from the Welcome.
    pub fn version(&self) -> u16 {
        self.version
    }

    /// Pings the peer; the round trip.
    pub async fn ping(&mut self) -> Result<Duration, LinkError> {
        let start = Instant::now();
        match self.exchange(PeerMessage::Ping).await? {
            PeerMessage::Pong => Ok(start.elapsed()),
            other => Err(LinkError::unexpected("a pong", &other)),
        }
    }

    /// Sends a request and waits for its answer.
    pub async fn call(&mut self, request: PeerRequest) -> Result<PeerResponse, LinkError> {
        let op = request.op;
        answer_to(op, self.exchange(PeerMessage::Request(request)).await?)
    }

    async fn exchange(&mut self, message: PeerMessage) -> Result<PeerMessage, LinkError> {
        let id = self.next_id;
        self.next_id += 1;
        self.framed.send(id, &message).await?;
        match self.framed.recv(self.limits.idle_timeout).await? {
            (got, answer) if got == id => Ok(answer),
            (_, other) => Err(LinkError::unexpected("an answer with the request's id", &other)),
        }
    }
}

/// The Hello of the node `creds` names, at `incarnation`.
pub(crate) fn hello_of(creds: &Credentials, incarnation: u64) -> Hello {
    let me = creds.identity();
    Hello { domain: me.domain.clone(), node: me.node.clone(), incarnation, version: PEER_PROTOCOL }
}

/// The server's Welcome, when the first message it sent is one from `expected` at a
/// protocol this build speaks (at most the [`PEER_PROTOCOL`] its Hello offered).
pub(crate) fn welcomed(expected: &NodeIdentity, (id, message): (u64, PeerMessage)) -> Result<Welcome, LinkError> {
    let spoken = PEER_PROTOCOL_MIN..=PEER_PROTOCOL;
    match (id, message) {
        (0, PeerMessage::Welcome(w)) if w.node == expected.node && spoken.contains(&w.version) => Ok(w),
        (_, PeerMessage::Refused(r)) => Err(LinkError::Refused(r)),
        (_, other) => Err(LinkError::unexpected("a welcome from the expected node", &other)),
    }
}

/// What the peer's answer to a request for `op` says.
pub(crate) fn answer_to(op: PeerOp, answer: PeerMessage) -> Result<PeerResponse, LinkError> {
    match answer {
        PeerMessage::Response(r) if r.op == op => Ok(r),
        PeerMessage::Failure(f) if f.op == op => Err(LinkError::Peer(f.error)),
        other => Err(LinkError::unexpected("the answer to the request", &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_reports_the_first_event_then_once_per_period_with_the_count() {
        let t = Throttle::default();
        assert_eq!(t.tick(), Some(1), "the first is reported at once");
        assert_eq!((t.tick(), t.tick()), (None, None), "within the period: counted only");
        // The period passed.
        let past = Instant::now().checked_sub(REPORT_EVERY * 2);
        t.0.lock().unwrap_or_else(PoisonError::into_inner).0 = past;
        assert_eq!(t.tick(), Some(3), "the two held back and this one");
        assert_eq!(t.tick(), None);
        // The end of a burst: what was held back is reported once the period passed,
        // without waiting for another event. Before, it waited for the next one.
        assert_eq!(t.held_back(), None, "within the period");
        t.0.lock().unwrap_or_else(PoisonError::into_inner).0 = Instant::now().checked_sub(REPORT_EVERY * 2);
        assert_eq!(t.held_back(), Some(1));
        assert_eq!(t.held_back(), None, "nothing more held back");
        assert_eq!(t.tick(), None, "a report was just made");
    }
}
