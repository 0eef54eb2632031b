//! The owner's revocations on their way to one importer node: the registry's revocations
//! of that node's session are taken by a sink of the event bus (never dropped, unlike a
//! client's bounded queue) into an outbox that keeps one per import (a region's end
//! supersedes its export's revocation), so it never holds more than the node's imports.
//! One task per importer node session tells them one at a time, in turn (so one the node
//! keeps refusing holds up no other), and keeps a revocation it could not tell, retrying
//! with backoff, until the node acknowledged it or its session ended (the node left or
//! restarted: it then holds nothing of this node's). An acknowledged end of a region lifts
//! that node's quarantine of the region's range.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use fabric_nodelink::PeerOp;
use fabric_proto::wire::{Event, Revocation, RevocationReason};
use tokio::sync::Notify;

use super::wire::{self, RevokeNotice};
use crate::daemon::Daemon;

/// The first wait before a revocation that could not be told is tried again.
const RETRY_FIRST: Duration = Duration::from_millis(100);
/// The longest wait between tries.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// One importer node session's revocations not yet told, by the owner's import id.
#[derive(Debug, Default)]
pub struct Outbox {
    pending: Mutex<BTreeMap<u64, Revocation>>,
    wake: Notify,
    closed: AtomicBool,
}

impl Outbox {
    /// Queues `r` (called under the event bus's lock: no I/O). A revocation of an import
    /// already queued replaces it unless the queued one ended the import and this one
    /// only revoked its export.
    pub fn push(&self, r: Revocation) {
        self.queue(r);
        self.wake.notify_one();
    }

    fn queue(&self, r: Revocation) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        match pending.get(&r.import) {
            Some(q) if !matches!(q.reason, RevocationReason::Revoked) => {}
            _ => {
                pending.insert(r.import, r);
            }
        }
    }

    /// How many revocations wait.
    pub fn len(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The session ended: the task stops, what was not told is dropped.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// The next revocation to tell: the first after import `after` (the one last tried),
    /// round the ids, so that a revocation the node keeps refusing takes its turn and
    /// no more.
    fn take(&self, after: Option<u64>) -> Option<Revocation> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let next = after
            .and_then(|a| pending.range((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded)).next())
            .or_else(|| pending.first_key_value())
            .map(|(&k, _)| k)?;
        pending.remove(&next)
    }

    /// Puts back `r`, which could not be told (by the same rule as [`Outbox::push`]).
    fn put_back(&self, r: Revocation) {
        self.queue(r);
    }
}

/// The sink that feeds `outbox` from the event bus.
pub fn sink(outbox: Arc<Outbox>) -> crate::events::Sink {
    Arc::new(move |ev| {
        if let Event::Revocation(r) = ev {
            outbox.push(r);
        }
    })
}

/// Tells `node` what `outbox` holds until the outbox is closed or the daemon goes.
pub async fn forward(d: Weak<Daemon>, node: String, outbox: Arc<Outbox>) {
    let mut retry = RETRY_FIRST;
    // Quarantine lifted since the record was last saved.
    let mut lifted = false;
    // The import last tried, and how many were refused in a row (a whole round refused:
    // the task backs off).
    let (mut after, mut refused) = (None, 0usize);
    loop {
        if outbox.closed.load(Ordering::Acquire) {
            return;
        }
        let Some(r) = outbox.take(after) else {
            // The outbox is drained: what its acknowledgements lifted is saved once, off
            // the runtime's worker.
            if std::mem::take(&mut lifted)
                && let Some(d) = d.upgrade()
            {
                let _ = tokio::task::spawn_blocking(move || d.memory.save_holds_or_log()).await;
            }
            outbox.wake.notified().await;
            continue;
        };
        let Some(d) = d.upgrade() else { return };
        let (Some(domain), Some(link)) = (d.domain.clone(), d.domain.as_ref().and_then(|x| x.link())) else { return };
        // Truncating a freed region's file (and closing it, which may free its blocks)
        // and the registry's lock are for the blocking pool, not this runtime's worker.
        let truncated = {
            let (d, import, reason) = (d.clone(), r.import, r.reason);
            tokio::task::spawn_blocking(move || {
                if let Some(link) = d.domain.as_ref().and_then(|x| x.link()) {
                    link.service().owner().ended(import, reason);
                }
            })
        };
        if let Err(e) = truncated.await {
            tracing::warn!(peer = %node, import = r.import, error = %e, "node link: truncating a freed region's file failed");
        }
        let told = link.call(&domain, &node, wire::request(PeerOp::Revoke, &RevokeNotice { revocation: r })).await;
        after = Some(r.import);
        match told {
            Ok(_) => {
                (retry, refused) = (RETRY_FIRST, 0);
                tracing::info!(peer = %node, import = r.import, reason = ?r.reason, "node link: importer told of a revocation");
                if !matches!(r.reason, RevocationReason::Revoked) {
                    let (d, node, region) = (d.clone(), node.clone(), r.region);
                    let _ = tokio::task::spawn_blocking(move || d.memory.acknowledged(&node, region)).await;
                    lifted = true;
                }
            }
            // The node answered, and refused this one (it is recording an import it may be
            // about): the next takes its turn at once, unless every one was refused in a row.
            Err(super::DialError::Peer { .. }) if refused < outbox.len() => {
                refused += 1;
                tracing::debug!(peer = %node, import = r.import, "node link: the importer asked to be told of a revocation again; the next one first");
                outbox.put_back(r);
            }
            Err(e) => {
                // Every one refused in a row (an importer whose client still maps a whole
                // DAX device refuses its end until released) is no failure of the link.
                let refusal = matches!(e, super::DialError::Peer { .. });
                if refusal {
                    tracing::debug!(peer = %node, import = r.import, error = %crate::error_chain(&e), retry_in = ?retry, "node link: the importer refused every revocation waiting; told again later");
                } else {
                    tracing::warn!(peer = %node, import = r.import, error = %crate::error_chain(&e), retry_in = ?retry, "node link: cannot tell the importer of a revocation; kept to try again");
                }
                refused = 0;
                outbox.put_back(r);
                drop(d);
                // After refusals, a new revocation (or the session's end, seen at the top
                // of the loop) cuts the wait short: one refused for good holds up no later
                // one. A link that failed is waited out (the session's end still ends it).
                let woken = async {
                    loop {
                        outbox.wake.notified().await;
                        if refusal || outbox.closed.load(Ordering::Acquire) {
                            return;
                        }
                    }
                };
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    () = woken => {}
                }
                retry = (retry * 2).min(RETRY_MAX);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rev(import: u64, reason: RevocationReason) -> Revocation {
        Revocation { region: 1, generation: 1, import, reason }
    }

    #[test]
    fn the_outbox_keeps_one_per_import_and_an_end_over_a_revocation() {
        let o = Outbox::default();
        for i in 0..1000 {
            o.push(rev(i, RevocationReason::Revoked));
        }
        o.push(rev(5, RevocationReason::Freed));
        o.push(rev(5, RevocationReason::Revoked));
        assert_eq!(o.len(), 1000, "nothing is dropped past any bound");
        let all: Vec<Revocation> = std::iter::from_fn(|| o.take(None)).collect();
        assert_eq!(all.len(), 1000);
        assert_eq!(all[5].reason, RevocationReason::Freed);
        o.put_back(rev(7, RevocationReason::Revoked));
        o.push(rev(7, RevocationReason::Freed));
        o.put_back(rev(7, RevocationReason::Revoked));
        assert_eq!(o.take(None).map(|r| r.reason), Some(RevocationReason::Freed));
    }

    /// A revocation put back after a refusal takes its turn after the others: before, the
    /// smallest id was always taken first, so one the node kept refusing held up every
    /// later one to that node.
    #[test]
    fn a_revocation_put_back_lets_the_others_go_first() {
        let o = Outbox::default();
        for i in [3, 5, 9] {
            o.push(rev(i, RevocationReason::Freed));
        }
        let first = o.take(None).unwrap();
        assert_eq!(first.import, 3);
        o.put_back(first);
        assert_eq!(o.take(Some(3)).map(|r| r.import), Some(5));
        assert_eq!(o.take(Some(5)).map(|r| r.import), Some(9));
        assert_eq!(o.take(Some(9)).map(|r| r.import), Some(3), "round the ids");
        assert_eq!(o.take(Some(3)), None);
    }
}
