//! The leader's duties on a domain node: while this node leads, it carries out the gc
//! requests queued under `gc/` (by any node that took an admin's `domain gc`), each in a
//! transaction fenced by its leader key (`fabric_domain::duties`), and sweeps the records
//! of nodes that hold no slot at the start of each term and every [`SWEEP_EVERY`]. Run on a task of their
//! own, one round at a time, when this node becomes leader, when a request is queued, and
//! at each probe tick; nothing here can delay the session's fence, and a deposed leader's
//! writes are refused by etcd.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fabric_domain::{DomainClient, EtcdError, LeaderFence, Leadership};

/// How often a leader sweeps the records of nodes that hold no slot (and once at the
/// start of each term).
pub const SWEEP_EVERY: Duration = Duration::from_secs(600);
/// Most nodes one sweep collects (the rest go in the next).
pub const SWEEP_MAX: usize = 64;

/// One session's duties: whether a round runs, and when (in which term) the last sweep ran.
#[derive(Debug, Default)]
pub struct Duties {
    busy: AtomicBool,
    swept: std::sync::Mutex<Option<(i64, Instant)>>,
}

impl Duties {
    /// Whether a sweep is due in `term`: never yet in it, or [`SWEEP_EVERY`] ago.
    fn sweep_due(&self, term: i64) -> bool {
        let last = *self.swept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        last.is_none_or(|(t, at)| t != term || at.elapsed() >= SWEEP_EVERY)
    }

    fn swept(&self, term: i64) {
        *self.swept.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((term, Instant::now()));
    }
}

/// Starts one round of duties when this node leads and none is running.
pub fn spawn(client: &DomainClient, lease: i64, leadership: &Leadership, duties: &Arc<Duties>) {
    let Leadership::Leader { term, .. } = leadership else { return };
    if duties.busy.swap(true, Ordering::AcqRel) {
        return;
    }
    let fence = LeaderFence::new(client, lease, *term);
    let (client, duties) = (client.clone(), duties.clone());
    tokio::spawn(async move {
        if round(&client, &fence).await && duties.sweep_due(fence.term()) {
            sweep(&client, &fence).await;
            duties.swept(fence.term());
        }
        duties.busy.store(false, Ordering::Release);
    });
}

/// Carries out every queued gc; false when this node no longer leads or etcd failed.
async fn round(client: &DomainClient, fence: &LeaderFence) -> bool {
    let queue = match client.gc_queue().await {
        Ok(q) => q,
        Err(e) => {
            tracing::debug!(error = %crate::error_chain(&e), "leader: cannot read the gc queue");
            return false;
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
                return false;
            }
            Err(e) => tracing::warn!(%node, error = %crate::error_chain(&e), "leader: gc failed; retried later"),
        }
    }
    true
}

/// Sweeps the records of nodes that hold no slot.
async fn sweep(client: &DomainClient, fence: &LeaderFence) {
    match client.sweep_orphans(fence, SWEEP_MAX).await {
        Ok(swept) if swept.is_empty() => tracing::debug!(term = fence.term(), "leader: no orphaned records"),
        Ok(swept) => {
            tracing::info!(nodes = ?swept, term = fence.term(), "leader: swept records of nodes without a slot")
        }
        Err(e) => tracing::warn!(error = %crate::error_chain(&e), "leader: sweep failed; tried again later"),
    }
}
