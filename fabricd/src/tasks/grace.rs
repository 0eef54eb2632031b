//! The resume grace period: sessions found in the journal at start whose owners are alive
//! get `memory.resume_grace_s` to come back; then what they still hold is reclaimed, and
//! the ranges of other hosts' memory held across the restart for clients that may still
//! map them (`memory/foreign.rs`) go back to the allocators.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::daemon::Daemon;

/// Waits `memory.resume_grace_s` (or until `shutdown`), then reclaims the orphaned
/// sessions no client took back: their regions are freed and their exports revoked, and
/// importers that subscribed are told; and lifts the ranges of other hosts' memory held
/// across the restart.
pub async fn run(daemon: Arc<Daemon>, shutdown: CancellationToken) {
    if daemon.memory.orphans() == 0 && !daemon.memory.has_restored_foreign() {
        return;
    }
    let grace = Duration::from_secs(daemon.config.memory.resume_grace_s);
    tokio::select! {
        () = shutdown.cancelled() => return,
        () = tokio::time::sleep(grace) => {}
    }
    let d = daemon.clone();
    match tokio::task::spawn_blocking(move || d.memory.lift_restored_foreign()).await {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            ranges = n,
            "resume grace period over; ranges of other hosts' memory held across the restart lifted"
        ),
        Err(e) => tracing::warn!(error = %e, "lifting the ranges held across the restart panicked"),
    }
    let d = daemon.clone();
    match tokio::task::spawn_blocking(move || d.memory.reclaim_orphans()).await {
        Ok(r) if r.regions > 0 => {
            tracing::info!(
                regions = r.regions,
                exports = r.exports,
                imports = r.imports,
                "resume grace period over; reclaimed"
            );
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "reclaiming orphaned sessions panicked"),
    }
}
