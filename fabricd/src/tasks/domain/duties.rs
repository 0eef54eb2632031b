//! The leader's duties on a domain node: while this node leads, it carries out the gc
//! requests queued under `gc/` (by any node that took an admin's `domain gc`), each in a
//! transaction fenced by its leader key (`fabric_domain::duties`). Run on a task of their
//! own, one round at a time, when this node becomes leader, when a request is queued, and
//! at each probe tick; nothing here can delay the session's fence, and a deposed leader's
//! writes are refused by etcd.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use fabric_domain::{DomainClient, EtcdError, LeaderFence, Leadership};

/// Starts one round of duties when this node leads and none is running.
pub fn spawn(client: &DomainClient, lease: i64, leadership: &Leadership, busy: &Arc<AtomicBool>) {
    let Leadership::Leader { term, .. } = leadership else { return };
    if busy.swap(true, Ordering::AcqRel) {
        return;
    }
    let fence = LeaderFence::new(client, lease, *term);
    let (client, busy) = (client.clone(), busy.clone());
    tokio::spawn(async move {
        round(&client, &fence).await;
        busy.store(false, Ordering::Release);
    });
}

/// Carries out every queued gc.
async fn round(client: &DomainClient, fence: &LeaderFence) {
    let queue = match client.gc_queue().await {
        Ok(q) => q,
        Err(e) => {
            tracing::debug!(error = %crate::error_chain(&e), "leader: cannot read the gc queue");
            return;
        }
    };
    for node in queue {
        if !fabric_domain::config::is_valid_name(&node) {
            let dropped = client.drop_gc_request(fence, &node).await;
            tracing::warn!(key = %node, ?dropped, "leader: a queued gc names no node; dropped");
            continue;
        }
        match client.gc_led(fence, &node).await {
            Ok(slot) => tracing::info!(%node, ?slot, term = fence.term(), "leader: carried out the gc of a gone node"),
            Err(EtcdError::GcLive { .. }) => {
                tracing::info!(%node, "leader: refused the gc of a live node (request dropped)")
            }
            Err(e @ EtcdError::NotLeader { .. }) => {
                tracing::warn!(error = %e, "leader: no longer leads; gc left to the next leader");
                return;
            }
            Err(e) => tracing::warn!(%node, error = %crate::error_chain(&e), "leader: gc failed; retried later"),
        }
    }
}
