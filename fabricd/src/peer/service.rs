//! What this node answers over the node link: the daemon's side of the cross-node
//! operations. Until the daemon is attached (it is built after the domain joins), every
//! request is refused as unavailable.

use std::sync::{OnceLock, Weak};

use fabric_nodelink::{Peer, PeerError, PeerRequest, PeerService, Served};

use crate::daemon::Daemon;

/// The daemon's peer service.
#[derive(Debug, Default)]
pub struct Service {
    daemon: OnceLock<Weak<Daemon>>,
}

impl Service {
    /// Hands it the daemon (once; later calls are ignored).
    pub fn attach(&self, daemon: Weak<Daemon>) {
        let _ = self.daemon.set(daemon);
    }
}

impl PeerService for Service {
    fn serve(&self, peer: &Peer, request: PeerRequest) -> Served {
        let op = request.op;
        let attached = self.daemon.get().and_then(Weak::upgrade).is_some();
        tracing::debug!(peer = %peer.identity, ?op, attached, "node link: request not served yet");
        Box::pin(async move {
            if attached {
                Err(PeerError::Unsupported(op))
            } else {
                Err(PeerError::Refused("the daemon is starting".into()))
            }
        })
    }
}
