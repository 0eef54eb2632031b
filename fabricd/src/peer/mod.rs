//! The node link in fabricd (`docs/domain.md`, "Node link"): the listener at this node's
//! peer address, which admits the domain's live members at their current incarnation
//! ([`policy`]), and the links this node dials to ask other nodes ([`dial`]), made on first
//! use and made again when a peer's incarnation changes. Link I/O runs on the domain's
//! runtime, except an import's ask, which a request's thread makes itself on a blocking
//! link ([`direct`]); nothing here holds a daemon lock across it.

pub mod addresses;
mod carving;
pub mod clique;
pub mod copy;
pub mod creds;
pub mod cxl;
pub mod dial;
pub mod direct;
pub mod importer;
pub mod members;
pub mod owner;
pub mod policy;
pub mod revokes;
pub mod service;
pub mod wire;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use fabric_nodelink::{Credentials, LinkError, LinkLimits, LinkStats, Server};

pub use creds::CredentialsError;
pub use dial::{DialError, Peers};
pub use policy::MemberPolicy;

use crate::tasks::domain::Domain;

/// Why the node link could not listen.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// The peer address names no address this host can bind.
    #[error("peer.address {address:?} does not resolve to an address")]
    Resolve {
        /// The address.
        address: String,
        /// Why, when the resolver said.
        #[source]
        source: Option<std::io::Error>,
    },
    /// The listener could not be bound (the address is another host's, or taken).
    #[error("listening on {addr}")]
    Bind {
        /// Where.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: LinkError,
    },
    /// The domain's runtime stopped before it answered.
    #[error("the domain's runtime stopped")]
    Stopped,
}

/// This node's side of the node link: its credentials, its listener and the links it
/// dialled.
#[derive(Debug)]
pub struct NodeLink {
    creds: Credentials,
    limits: LinkLimits,
    /// How long a request's thread polls a blocking link for its answer (`peer.answer_poll_us`).
    answer_poll: Duration,
    server: OnceLock<Server>,
    peers: Peers,
    /// The blocking links that requests' threads call on.
    direct: direct::Direct,
    service: Arc<service::Service>,
    /// Told when the domain view changed: [`members::follow`] voids what members that
    /// left or restarted held.
    members: Arc<tokio::sync::Notify>,
}

impl NodeLink {
    /// A link with these credentials, not listening yet, whose blocking links poll for an
    /// answer for `answer_poll` before they sleep.
    pub fn new(creds: Credentials, answer_poll: Duration) -> Self {
        let service = Arc::new(service::Service::default());
        Self {
            creds,
            limits: LinkLimits::default(),
            answer_poll,
            server: OnceLock::new(),
            peers: Peers::default(),
            direct: direct::Direct::default(),
            service,
            members: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// The domain view changed (never blocks).
    pub fn members_changed(&self) {
        self.members.notify_one();
    }

    /// Hands the daemon to the service that answers peers' requests (until then they are
    /// refused as unavailable).
    pub fn attach(&self, daemon: Weak<crate::daemon::Daemon>) {
        let Some(d) = daemon.upgrade() else { return };
        self.service.owner().adopt_restored(&d);
        self.service.attach(daemon.clone());
        if let Some(domain) = &d.domain {
            let (advertised, followed) = tokio::sync::watch::channel(Vec::new());
            let resolver = addresses::Resolver::new(addresses::system_lookup());
            domain.runtime().spawn(addresses::follow(daemon.clone(), followed, resolver));
            domain.runtime().spawn(members::follow(daemon, self.members.clone(), advertised));
            // The view published before the daemon was attached (the one read at start)
            // is followed too.
            self.members.notify_one();
        }
    }

    /// Listens at `address` (`host:port`) on `runtime`, admitting peers through
    /// [`MemberPolicy`] over `domain` and answering their requests with the daemon's
    /// [`service::Service`]; at `incarnation` until [`NodeLink::set_incarnation`]. Blocks
    /// until bound.
    pub fn listen(
        &self,
        runtime: &tokio::runtime::Handle,
        address: &str,
        domain: Weak<Domain>,
        incarnation: u64,
    ) -> Result<SocketAddr, ListenError> {
        let resolve = |source| ListenError::Resolve { address: address.to_owned(), source };
        let addr = address.to_socket_addrs().map_err(|e| resolve(Some(e)))?.next().ok_or_else(|| resolve(None))?;
        let (tx, rx) = std::sync::mpsc::channel();
        let (creds, limits) = (self.creds.clone(), self.limits);
        let service: Arc<dyn fabric_nodelink::PeerService> = self.service.clone();
        runtime.spawn(async move {
            let policy = Arc::new(MemberPolicy::new(domain));
            let _ = tx.send(Server::bind_serving(addr, &creds, incarnation, policy, service, limits).await);
        });
        let server =
            rx.recv().map_err(|_| ListenError::Stopped)?.map_err(|source| ListenError::Bind { addr, source })?;
        let bound = server.local_addr();
        tracing::info!(%bound, node = %self.creds.identity(), "node link listening");
        // A second listen keeps the first listener.
        let _ = self.server.set(server);
        Ok(bound)
    }

    /// The incarnation this node's Welcome states from now on (after a rejoin).
    pub fn set_incarnation(&self, incarnation: u64) {
        if let Some(s) = self.server.get() {
            s.set_incarnation(incarnation);
        }
    }

    /// The addresses the domain's members advertise: the listener admits their
    /// connections before any other address's (a no-op until it listens).
    pub fn set_member_addresses(&self, addrs: Vec<std::net::IpAddr>) {
        if let Some(s) = self.server.get() {
            s.set_member_addresses(addrs);
        }
    }

    /// How many member sources the listener admits first (0 until it listens).
    pub fn member_sources(&self) -> usize {
        self.server.get().map_or(0, Server::member_sources)
    }

    /// Where the listener is bound, once it is.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.server.get().map(Server::local_addr)
    }

    /// What the listener did with the connections it accepted.
    pub fn stats(&self) -> LinkStats {
        self.server.get().map(Server::stats).unwrap_or_default()
    }

    /// The links this node dials.
    pub fn peers(&self) -> &Peers {
        &self.peers
    }

    /// The blocking links requests' threads call on ([`NodeLink::call_here`]).
    pub fn direct(&self) -> &direct::Direct {
        &self.direct
    }

    /// What peers' requests reach, and the imports of other nodes' regions held here.
    pub fn service(&self) -> &service::Service {
        &self.service
    }

    /// This node's credentials.
    pub fn credentials(&self) -> &Credentials {
        &self.creds
    }

    /// The limits of its links.
    pub fn limits(&self) -> LinkLimits {
        self.limits
    }
}
