//! Members that leave or restart void what crossed the link with them: on each new domain
//! view, an importer node that is gone or has a new incarnation loses the imports this
//! node granted it (released from the registry), and this node's clients holding imports
//! of an owner that is gone or restarted get the `Revocation` event (`OwnerExited`) a local
//! import's holder gets when its owner leaves. A node's death is seen when its member key
//! goes, one lease TTL after its last renewal; a node that left is collected (its slot
//! gone from the view after an admin's `domain gc` on any node) lifts its quarantine.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};

use tokio::sync::Notify;

use crate::daemon::Daemon;

/// Follows the domain view until the daemon goes.
pub async fn follow(daemon: Weak<Daemon>, changed: Arc<Notify>) {
    loop {
        changed.notified().await;
        let Some(d) = daemon.upgrade() else { return };
        let (Some(domain), Some(link)) = (d.domain.as_ref(), d.domain.as_ref().and_then(|x| x.link())) else {
            return;
        };
        let view = domain.view();
        let live: HashMap<&str, u64> = view.members().map(|m| (m.name.as_str(), m.incarnation)).collect();
        let known: HashSet<&str> = view.nodes().into_iter().map(|n| n.name).collect();
        link.service().owner().void_departed(&d, &live, &known);
        link.service().importer().void_departed(&d, &live);
    }
}
