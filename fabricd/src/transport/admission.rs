//! Who gets a client slot at accept: `limits.clients` for all users together and
//! `limits.clients_per_uid` for each uid (from the new connection's `SO_PEERCRED`), held
//! for as long as the connection is open.
//!
//! A connection that has not started a frame is never timed out (a subscriber may wait for
//! events for days), so without a per-uid count one user could hold every slot with idle
//! connections and deny the daemon to everyone else.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use fabric_proto::wire::{ErrorBody, ErrorCode, ErrorDetail, Name};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::ClientLimit;
use crate::ops::refusal;

/// Open connections per limited uid; a uid with none has no entry.
type OpenByUid = Arc<Mutex<HashMap<u32, u32>>>;

/// The slots of a server: a global count and one per uid.
#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    clients: u32,
    per_uid: u32,
    /// The daemon's own effective uid: like root's, its connections count only against
    /// `clients` (it can stop the daemon anyway, so a cap would protect nothing).
    own_uid: u32,
    open: OpenByUid,
}

/// A connection's slots; dropping it (however the connection ended) gives them back.
#[derive(Debug)]
pub struct Admitted {
    _slot: OwnedSemaphorePermit,
    _uid: Option<UidSlot>,
}

#[derive(Debug)]
struct UidSlot {
    uid: u32,
    open: OpenByUid,
}

impl Drop for UidSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.uid);
            }
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// The limit it hit.
    pub limit: ClientLimit,
    /// The connecting uid.
    pub uid: u32,
    /// Connections open (of that uid, or of everyone) when it came.
    pub used: u32,
    /// The limit's value.
    pub max: u32,
}

impl Refused {
    /// The error frame's body: `LimitExceeded` with the numbers.
    pub fn body(&self) -> ErrorBody {
        let message = match self.limit {
            ClientLimit::Clients => format!("the daemon serves {} clients already (limits.clients)", self.used),
            ClientLimit::ClientsPerUid => {
                format!("uid {} has {} connections open, limits.clients_per_uid is {}", self.uid, self.used, self.max)
            }
        };
        let mut body = refusal(ErrorCode::LimitExceeded, message);
        body.detail = Some(ErrorDetail::Limit {
            what: Name::truncated(self.limit.name()),
            used: u64::from(self.used),
            requested: 1,
            max: u64::from(self.max),
        });
        body
    }
}

impl Admission {
    /// `clients` slots in all (after the open-file limit: `fdbudget::budget`), at most
    /// `per_uid` of them for any uid but root and `own_uid`.
    pub fn new(clients: u32, per_uid: u32, own_uid: u32) -> Self {
        Self { slots: Arc::new(Semaphore::new(clients as usize)), clients, per_uid, own_uid, open: Arc::default() }
    }

    /// Whether `uid`'s connections are counted against `limits.clients_per_uid`.
    pub fn limits(&self, uid: u32) -> bool {
        uid != 0 && uid != self.own_uid
    }

    /// Takes a slot for a new connection of `uid`, or says which limit it hits. The uid's
    /// own limit is checked first, so that a uid at its limit is told so even when the
    /// daemon is full too.
    pub fn admit(&self, uid: u32) -> Result<Admitted, Refused> {
        let uid_slot = if self.limits(uid) {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            let n = open.entry(uid).or_insert(0);
            if *n >= self.per_uid {
                return Err(Refused { limit: ClientLimit::ClientsPerUid, uid, used: *n, max: self.per_uid });
            }
            *n += 1;
            Some(UidSlot { uid, open: self.open.clone() })
        } else {
            None
        };
        // A uid slot taken above is given back when this fails (dropped on return).
        let slot = self.slots.clone().try_acquire_owned().map_err(|_| Refused {
            limit: ClientLimit::Clients,
            uid,
            used: self.clients,
            max: self.clients,
        })?;
        Ok(Admitted { _slot: slot, _uid: uid_slot })
    }

    /// Connections `uid` has open that count against its limit (0 for an exempt uid).
    pub fn open(&self, uid: u32) -> u32 {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).get(&uid).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uid_gets_its_limit_others_and_exempt_uids_go_on_and_closing_gives_slots_back() {
        let a = Admission::new(8, 2, 1000);
        let first = a.admit(61001).unwrap();
        let second = a.admit(61001).unwrap();
        let refused = a.admit(61001).unwrap_err();
        assert_eq!(refused, Refused { limit: ClientLimit::ClientsPerUid, uid: 61001, used: 2, max: 2 });
        let body = refused.body();
        assert_eq!(body.code, ErrorCode::LimitExceeded);
        assert!(body.message.as_str().contains("uid 61001"), "{}", body.message.as_str());
        assert!(matches!(
            body.detail,
            Some(ErrorDetail::Limit { ref what, used: 2, requested: 1, max: 2 }) if what.as_str() == "clients_per_uid"
        ));
        // Another uid, root and the daemon's own uid are served.
        let other = a.admit(61002).unwrap();
        let root = [a.admit(0).unwrap(), a.admit(0).unwrap(), a.admit(0).unwrap()];
        let own = a.admit(1000).unwrap();
        assert_eq!((a.open(61001), a.open(61002), a.open(0), a.open(1000)), (2, 1, 0, 0));
        // A closed connection gives its uid slot back; the last one removes the entry.
        drop(first);
        let again = a.admit(61001).unwrap();
        drop((second, again));
        assert_eq!(a.open(61001), 0);
        assert!(a.open.lock().unwrap().get(&61001).is_none());
        drop((other, root, own));
    }

    #[test]
    fn a_full_daemon_refuses_by_the_global_limit_without_keeping_the_uid_slot() {
        let a = Admission::new(2, 4, 1000);
        let held = [a.admit(0).unwrap(), a.admit(61001).unwrap()];
        let refused = a.admit(61001).unwrap_err();
        assert_eq!(refused.limit, ClientLimit::Clients);
        assert_eq!(refused.body().code, ErrorCode::LimitExceeded);
        assert_eq!(a.open(61001), 1, "the refused connection's uid slot was given back");
        drop(held);
        assert_eq!(a.open(61001), 0);
        let _back = a.admit(61001).unwrap();
    }
}
