//! Members that leave or restart void what crossed the link with them: on each new domain
//! view, an importer node that is gone or has a new incarnation loses the imports this
//! node granted it (released from the registry), and this node's clients holding imports
//! of an owner that is gone or restarted get the `Revocation` event (`OwnerExited`) a local
//! import's holder gets when its owner leaves. A node's death is seen when its member key
//! goes, one lease TTL after its last renewal; a node that left is collected (its slot
//! gone from the view after an admin's `domain gc` on any node) lifts its quarantine. The
//! members' advertised addresses go to [`super::addresses::follow`], which hands their IPs
//! to the node link's listener, which admits their connections first.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};

use tokio::sync::{Notify, watch};

use crate::daemon::Daemon;

/// Follows the domain view until the daemon goes.
pub async fn follow(daemon: Weak<Daemon>, changed: Arc<Notify>, advertised: watch::Sender<Vec<String>>) {
    loop {
        changed.notified().await;
        let Some(d) = daemon.upgrade() else { return };
        let Some(domain) = d.domain.as_ref() else { return };
        let view = domain.view();
        // A view never read from etcd (a start while etcd does not answer) says nothing of
        // who left: on it every importer node would look collected and its quarantine
        // lift while that node may still map the memory. The first view read is followed.
        if view.revision() == 0 {
            continue;
        }
        let live: HashMap<String, u64> = view.members().map(|m| (m.name.clone(), m.incarnation)).collect();
        let known: HashSet<String> = view.nodes().into_iter().map(|n| n.name.to_owned()).collect();
        // Members' own addresses come first for the listener's handshake slots; names are
        // looked up by `addresses::follow`, told only when the set changed.
        let mut addresses: Vec<String> = view.members().map(|m| m.peer_address.clone()).collect();
        drop(view);
        addresses.sort();
        addresses.dedup();
        advertised.send_if_modified(|was| {
            let changed = *was != addresses;
            if changed {
                *was = addresses;
            }
            changed
        });
        // Ending sessions and lifting quarantine take the registry's lock and save the
        // quarantine record (an fsync): off the domain runtime's worker, one view at a time.
        let voided = tokio::task::spawn_blocking(move || {
            let Some(link) = d.domain.as_ref().and_then(|x| x.link()) else { return false };
            let live: HashMap<&str, u64> = live.iter().map(|(n, i)| (n.as_str(), *i)).collect();
            let known: HashSet<&str> = known.iter().map(String::as_str).collect();
            link.service().owner().void_departed(&d, &live, &known);
            link.service().importer().void_departed(&d, &live);
            link.direct().forget_departed(&|node| live.contains_key(node));
            link.peers().forget_departed(&|node| live.contains_key(node));
            true
        })
        .await;
        if !matches!(voided, Ok(true)) {
            return;
        }
    }
}

/// Whether `view` lists `node` as a live member at `incarnation`.
pub(super) fn listed(view: &fabric_domain::DomainView, node: &str, incarnation: u64) -> bool {
    view.members().any(|m| m.name == node && m.incarnation == incarnation)
}
