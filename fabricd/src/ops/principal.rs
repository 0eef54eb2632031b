//! Who a request comes from: the [`Principal`], computed once per connection when it is
//! accepted, and what it stands as for this daemon's policy ([`Client`]: an admin or not).
//!
//! A principal is a local process (uid, gids and the process, as the kernel recorded them
//! at connect: see [`crate::transport::peer`]) or another node of the domain asking over
//! the node link ([`PeerNode`]: its certified name, the incarnation its Hello stated, and
//! what it vouches for its client). Every decision below the transport matches on the
//! kind: a node is never an admin, has no process here, and is recorded under a uid only
//! where the domain shares identities.
//!
//! What a principal *reaches* (its partitions) is not fixed with it: bindings change
//! while a connection lives, so [`crate::ops::scope::Caller::resolve`] resolves the scope from
//! the bindings current when each request is authorized. Admin standing is fixed at
//! connect, like the groups it derives from.

use crate::memory::Identity;
use crate::transport::peer::{Peer, Process, ProcessGone};

/// A process on this host, as the kernel recorded it when it connected.
#[derive(Debug, Clone)]
pub struct LocalProcess {
    /// Uid, primary gid and pid at connect (`SO_PEERCRED`).
    pub id: Identity,
    /// Supplementary groups at connect (`SO_PEERGROUPS`).
    pub groups: Vec<u32>,
    /// The process that connected, followed by its pidfd; `None` when it had exited by
    /// the accept.
    pub process: Option<Process>,
}

/// The uid an importer node's client is recorded under where identities are not shared
/// across the domain: no local user's (the limits per uid count it apart).
pub const NOBODY_UID: u32 = 65534;

/// Another node of the domain, asking for its client over the node link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerNode {
    /// Its name, as its certificate names it.
    pub node: String,
    /// The incarnation its Hello stated (checked live against the domain's view).
    pub incarnation: u64,
    /// The domain's partitions (tenants) its client is bound to there, as the node vouches.
    pub claims: Vec<String>,
    /// Its client's uid and gid there, which mean something here only where the domain
    /// says identities are shared (`peer.shared_identities`).
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// Whether they do.
    pub shared_identities: bool,
}

impl PeerNode {
    /// Whether its client is bound to the domain's partition `name`.
    pub fn claims(&self, name: &str) -> bool {
        self.claims.iter().any(|c| c == name)
    }
}

/// Who a request comes from.
#[derive(Debug, Clone)]
pub enum Principal {
    /// A process on this host.
    Local(LocalProcess),
    /// Another node of the domain.
    Peer(PeerNode),
}

impl Principal {
    /// The principal at the other end of an accepted connection.
    pub fn of_peer(peer: &Peer) -> Self {
        Self::Local(LocalProcess {
            id: Identity { pid: peer.cred.pid, uid: peer.cred.uid, gid: peer.cred.gid },
            groups: peer.groups().to_vec(),
            process: peer.process().ok().cloned(),
        })
    }

    /// The uid the registry charges and lists its objects under.
    pub fn uid(&self) -> u32 {
        match self {
            Self::Local(p) => p.id.uid,
            Self::Peer(n) if n.shared_identities => n.uid,
            Self::Peer(_) => NOBODY_UID,
        }
    }

    /// The pid, for log lines only (a pid alone names nothing: [`Process::with`]).
    pub fn pid(&self) -> i32 {
        match self {
            Self::Local(p) => p.id.pid,
            Self::Peer(_) => 0,
        }
    }

    /// The owner record the memory registry keeps for what this principal creates.
    pub fn owner(&self) -> Identity {
        match self {
            Self::Local(p) => p.id,
            Self::Peer(n) if n.shared_identities => Identity { pid: 0, uid: n.uid, gid: n.gid },
            Self::Peer(_) => Identity { pid: 0, uid: NOBODY_UID, gid: NOBODY_UID },
        }
    }

    /// Every group a binding may name it by: the primary gid, then the supplementary ones.
    pub fn groups(&self) -> Vec<u32> {
        match self {
            Self::Local(p) => std::iter::once(p.id.gid).chain(p.groups.iter().copied()).collect(),
            Self::Peer(n) if n.shared_identities => vec![n.gid],
            Self::Peer(_) => Vec::new(),
        }
    }

    /// The process whose memory a `Register` from process memory reaches.
    pub fn process(&self) -> Result<&Process, ProcessGone> {
        match self {
            Self::Local(p) => p.process.as_ref().ok_or(ProcessGone),
            Self::Peer(_) => Err(ProcessGone),
        }
    }

    /// Whether it may run admin operations: uid 0, or `admin_gid` as its primary group
    /// or among its supplementary groups (those of the connection, fixed at connect).
    pub fn is_admin(&self, admin_gid: Option<u32>) -> bool {
        match self {
            Self::Local(p) => crate::ops::auth::is_admin(&p.id, admin_gid, &p.groups),
            Self::Peer(_) => false,
        }
    }
}

/// A principal with its standing, fixed for the life of its connection.
#[derive(Debug, Clone)]
pub struct Client {
    /// Who.
    pub principal: Principal,
    /// Root or a member of `socket.admin_group`.
    pub admin: bool,
}

impl Client {
    /// The client behind `peer`, judged against the daemon's admin group.
    pub fn accept(peer: &Peer, admin_gid: Option<u32>) -> Self {
        let principal = Principal::of_peer(peer);
        let admin = principal.is_admin(admin_gid);
        Self { principal, admin }
    }

    /// Another node of the domain, asking for its client: never an admin.
    pub fn node(node: PeerNode) -> Self {
        Self { principal: Principal::Peer(node), admin: false }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_principal_keeps_the_credentials_and_groups_of_its_connection() {
        let peer = Peer::new(fabric_proto::wire::PeerCred { pid: 7, uid: 1000, gid: 100 }, vec![27, 4242], None);
        let c = Client::accept(&peer, Some(4242));
        assert!(c.admin, "admin by a supplementary group");
        assert_eq!(c.principal.uid(), 1000);
        assert_eq!(c.principal.groups(), vec![100, 27, 4242]);
        assert!(c.principal.process().is_err(), "no process was recorded");
        assert!(!Client::accept(&peer, Some(5)).admin);
    }

    #[test]
    fn a_peer_node_is_never_an_admin_and_has_a_uid_only_where_identities_are_shared() {
        let node = |shared_identities| PeerNode {
            node: "tray1".into(),
            incarnation: 3,
            claims: vec!["tenant-a".into()],
            uid: 0,
            gid: 0,
            shared_identities,
        };
        let apart = Client::node(node(false));
        assert!(!apart.admin && !apart.principal.is_admin(Some(0)), "uid 0 elsewhere is no admin here");
        assert_eq!(apart.principal.uid(), NOBODY_UID);
        assert_eq!(apart.principal.owner(), Identity { pid: 0, uid: NOBODY_UID, gid: NOBODY_UID });
        assert!(apart.principal.groups().is_empty());
        assert!(apart.principal.process().is_err(), "no process of this host");
        let shared = Client::node(node(true));
        assert_eq!((shared.principal.uid(), shared.principal.groups()), (0, vec![0]));
        assert!(!shared.admin, "a shared uid 0 is still no admin of this node");
        let Principal::Peer(p) = &shared.principal else { unreachable!() };
        assert!(p.claims("tenant-a") && !p.claims("tenant-b"));
    }
}
