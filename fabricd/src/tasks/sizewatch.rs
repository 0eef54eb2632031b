//! The periodic check that region files keep their size ([`crate::memory::Memory::restore_sizes`]).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::daemon::Daemon;

/// Checks every `memory.size_check_s` (a `stat` per region each time) until `shutdown`;
/// never when it is 0.
pub async fn run(daemon: Arc<Daemon>, shutdown: CancellationToken) {
    let secs = daemon.config.memory.size_check_s;
    if secs == 0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_secs(secs));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let d = daemon.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || d.memory.restore_sizes()).await {
            tracing::warn!(error = %e, "checking region file sizes panicked");
        }
    }
}
