//! Who a request comes from: the [`Principal`], computed once per connection when it is
//! accepted, and what it stands as for this daemon's policy ([`Client`]: an admin or not).
//!
//! A principal is a local process today (uid, gids and the process, as the kernel
//! recorded them at connect: see [`crate::transport::peer`]). A domain of several nodes adds a peer
//! node as a second kind (`Peer { node, incarnation }`): every decision below the
//! transport matches on the kind, so adding one is a compile error at each place that
//! must decide what a node may do, not a silent default.
//!
//! What a principal *reaches* (its partitions) is not fixed with it: bindings change
//! while a connection lives, so [`crate::ops::scope::Caller::resolve`] resolves the scope from
//! the bindings current when each request is authorized. Admin standing is fixed at
//! connect, like the groups it derives from.

use fabric_proto::wire::PeerCred;

use crate::transport::peer::{Peer, Process, ProcessGone};

/// A process on this host, as the kernel recorded it when it connected.
#[derive(Debug, Clone)]
pub struct LocalProcess {
    /// Uid, primary gid and pid at connect (`SO_PEERCRED`).
    pub cred: PeerCred,
    /// Supplementary groups at connect (`SO_PEERGROUPS`).
    pub groups: Vec<u32>,
    /// The process that connected, followed by its pidfd; `None` when it had exited by
    /// the accept.
    pub process: Option<Process>,
}

/// Who a request comes from.
#[derive(Debug, Clone)]
pub enum Principal {
    /// A process on this host.
    Local(LocalProcess),
}

impl Principal {
    /// The principal at the other end of an accepted connection.
    pub fn of_peer(peer: &Peer) -> Self {
        Self::Local(LocalProcess {
            cred: peer.cred,
            groups: peer.groups().to_vec(),
            process: peer.process().ok().cloned(),
        })
    }

    /// The uid the registry charges and lists its objects under.
    pub fn uid(&self) -> u32 {
        match self {
            Self::Local(p) => p.cred.uid,
        }
    }

    /// The pid, for log lines only (a pid alone names nothing: [`Process::with`]).
    pub fn pid(&self) -> i32 {
        match self {
            Self::Local(p) => p.cred.pid,
        }
    }

    /// The owner record the memory registry keeps for what this principal creates.
    pub fn owner(&self) -> PeerCred {
        match self {
            Self::Local(p) => p.cred,
        }
    }

    /// Every group a binding may name it by: the primary gid, then the supplementary ones.
    pub fn groups(&self) -> Vec<u32> {
        match self {
            Self::Local(p) => std::iter::once(p.cred.gid).chain(p.groups.iter().copied()).collect(),
        }
    }

    /// The process whose memory a `Register` from process memory reaches.
    pub fn process(&self) -> Result<&Process, ProcessGone> {
        match self {
            Self::Local(p) => p.process.as_ref().ok_or(ProcessGone),
        }
    }

    /// Whether it may run admin operations: uid 0, or `admin_gid` as its primary group
    /// or among its supplementary groups (those of the connection, fixed at connect).
    pub fn is_admin(&self, admin_gid: Option<u32>) -> bool {
        match self {
            Self::Local(p) => crate::ops::auth::is_admin(&p.cred, admin_gid, &p.groups),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_principal_keeps_the_credentials_and_groups_of_its_connection() {
        let peer = Peer::new(PeerCred { pid: 7, uid: 1000, gid: 100 }, vec![27, 4242], None);
        let c = Client::accept(&peer, Some(4242));
        assert!(c.admin, "admin by a supplementary group");
        assert_eq!(c.principal.uid(), 1000);
        assert_eq!(c.principal.groups(), vec![100, 27, 4242]);
        assert!(c.principal.process().is_err(), "no process was recorded");
        assert!(!Client::accept(&peer, Some(5)).admin);
    }
}
