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
/// The first wait before a gc that failed is tried again, and the longest: a gc that
/// keeps failing (etcd refusing it, a record it cannot read) is not retried, and logged,
/// at every probe.
const GC_RETRY_FIRST: Duration = Duration::from_secs(1);
const GC_RETRY_MAX: Duration = Duration::from_secs(60);

/// One session's duties: whether a round runs, and when (in which term) the last sweep ran.
#[derive(Debug, Default)]
pub struct Duties {
    busy: AtomicBool,
    swept: std::sync::Mutex<Option<(i64, Instant)>>,
    /// Queued gcs that failed: how many times in a row, and when to try next.
    failing: std::sync::Mutex<std::collections::HashMap<String, (u32, Instant)>>,
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

    fn failing(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, (u32, Instant)>> {
        self.failing.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets the failures of nodes no longer `queued` (once per round).
    fn gc_queued(&self, queued: &[String]) {
        let queued: std::collections::HashSet<&str> = queued.iter().map(String::as_str).collect();
        self.failing().retain(|n, _| queued.contains(n.as_str()));
    }

    /// Whether the queued gc of `node` is due: never failed, or its backoff is over.
    fn gc_due(&self, node: &str) -> bool {
        self.failing().get(node).is_none_or(|(_, next)| Instant::now() >= *next)
    }

    /// The gc of `node` failed (again): its next try waits twice as long as the last, up
    /// to [`GC_RETRY_MAX`]. Answers that wait.
    fn gc_failed(&self, node: &str) -> Duration {
        let mut failing = self.failing();
        let tries = failing.get(node).map_or(0, |(n, _)| *n);
        let wait = GC_RETRY_FIRST.saturating_mul(1 << tries.min(6)).min(GC_RETRY_MAX);
        failing.insert(node.to_owned(), (tries + 1, Instant::now() + wait));
        wait
    }

    /// The gc of `node` is done or dropped.
    fn gc_over(&self, node: &str) {
        self.failing().remove(node);
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
        if round(&client, &fence, &duties).await && duties.sweep_due(fence.term()) {
            sweep(&client, &fence).await;
            duties.swept(fence.term());
        }
        duties.busy.store(false, Ordering::Release);
    });
}

/// Carries out every queued gc that is due; false when this node no longer leads or etcd
/// failed.
async fn round(client: &DomainClient, fence: &LeaderFence, duties: &Duties) -> bool {
    let queue = match client.gc_queue().await {
        Ok(q) => q,
        Err(e) => {
            tracing::debug!(error = %crate::error_chain(&e), "leader: cannot read the gc queue");
            return false;
        }
    };
    duties.gc_queued(&queue);
    for node in &queue {
        if !duties.gc_due(node) {
            continue;
        }
        let node = node.clone();
        if !fabric_domain::config::is_valid_name(&node) {
            let dropped = client.drop_gc_request(fence, &node).await;
            tracing::warn!(key = %node, ?dropped, "leader: a queued gc names no node; dropped");
            continue;
        }
        match client.gc_led(fence, &node).await {
            Ok(slot) => {
                duties.gc_over(&node);
                tracing::info!(%node, ?slot, term = fence.term(), "leader: carried out the gc of a gone node")
            }
            Err(EtcdError::GcLive { .. }) => {
                duties.gc_over(&node);
                tracing::info!(%node, "leader: refused the gc of a live node (request dropped)")
            }
            Err(e @ EtcdError::NotLeader { .. }) => {
                tracing::warn!(error = %e, "leader: no longer leads; gc left to the next leader");
                return false;
            }
            Err(e) => {
                let retry_in = duties.gc_failed(&node);
                tracing::warn!(%node, error = %crate::error_chain(&e), ?retry_in, "leader: gc failed; retried later")
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A queued gc that keeps failing waits longer each time, up to a minute, instead of
    /// being tried (and logged) at every probe; one that succeeds or is dropped, or is no
    /// longer queued, starts over.
    #[test]
    fn a_failing_gc_backs_off() {
        let d = Duties::default();
        let queued = vec!["tray1".to_owned(), "tray2".to_owned()];
        d.gc_queued(&queued);
        assert!(d.gc_due("tray1"));
        let waits: Vec<Duration> = (0..9).map(|_| d.gc_failed("tray1")).collect();
        assert_eq!(waits[..3], [GC_RETRY_FIRST, 2 * GC_RETRY_FIRST, 4 * GC_RETRY_FIRST]);
        assert_eq!(waits[8], GC_RETRY_MAX);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
        assert!(!d.gc_due("tray1"), "waits");
        assert!(d.gc_due("tray2"), "another node's gc does not wait");
        d.gc_over("tray1");
        assert!(d.gc_due("tray1"));
        d.gc_failed("tray1");
        d.gc_queued(&queued);
        assert!(!d.gc_due("tray1"), "still queued: still waits");
        // No longer queued: forgotten (a request queued again starts over).
        d.gc_queued(&queued[1..]);
        assert!(d.gc_due("tray1"));
    }
}
