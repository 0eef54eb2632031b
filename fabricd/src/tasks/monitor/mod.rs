//! Monitoring: rescans every `discovery.rescan_interval_s` seconds and, debounced, when
//! kernel uevents ask for one ([`crate::tasks::uevent`]); the diff of two inventories as device
//! and link events ([`diff()`]). The map side of a rescan (resources and CXL interleave
//! sets) is `fabric_addrmap::sync_inventory`, run by `Daemon::rescan`.

pub mod diff;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_topology::Device;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use diff::diff;

use crate::daemon::Daemon;
use crate::metrics::{RescanResult, RescanTrigger};

/// The device attribute a backend sets (to the reason) when the device reports a failure;
/// a failed device's memory is lost like a vanished device's.
pub const FAILED_ATTR: &str = fabric_topology::FAILED_ATTR;
/// A uevent-triggered rescan waits for this much quiet after the last relevant uevent.
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// ... but no longer than this after the first one of a burst.
pub const DEBOUNCE_MAX: Duration = Duration::from_secs(2);

/// Why a device is failed, when its backend says so.
pub fn failure(d: &Device) -> Option<&str> {
    d.attrs.get(FAILED_ATTR).map(String::as_str)
}

/// Requests for a rescan outside the interval (from the uevent listener).
#[derive(Debug, Default)]
pub struct Trigger {
    notify: Notify,
}

impl Trigger {
    /// Asks for a rescan; requests made while one is pending count once, and one made
    /// during a rescan gets another after it.
    pub fn want(&self) {
        self.notify.notify_one();
    }

    /// Waits for a request, then until [`DEBOUNCE`] passes without another (at most
    /// [`DEBOUNCE_MAX`] from the first). False when `shutdown` came first.
    pub async fn debounced(&self, shutdown: &CancellationToken) -> bool {
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = self.notify.notified() => {}
        }
        let first = Instant::now();
        loop {
            let left = DEBOUNCE_MAX.saturating_sub(first.elapsed());
            if left.is_zero() {
                return true;
            }
            tokio::select! {
                () = shutdown.cancelled() => return false,
                () = tokio::time::sleep(DEBOUNCE.min(left)) => return true,
                () = self.notify.notified() => {}
            }
        }
    }
}

/// Rescans every `discovery.rescan_interval_s` seconds (0: never) and whenever
/// [`Daemon::monitor`] is asked to (debounced), until `shutdown`.
pub async fn run(daemon: Arc<Daemon>, shutdown: CancellationToken) {
    let secs = daemon.config.discovery.rescan_interval_s;
    let mut tick = (secs > 0).then(|| {
        let mut t = tokio::time::interval(Duration::from_secs(secs));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    if let Some(t) = &mut tick {
        t.tick().await;
    }
    loop {
        let interval = async {
            match &mut tick {
                Some(t) => {
                    t.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        let trigger = tokio::select! {
            () = shutdown.cancelled() => return,
            () = interval => RescanTrigger::Interval,
            go = daemon.monitor.debounced(&shutdown) => {
                if !go {
                    return;
                }
                RescanTrigger::Uevent
            }
        };
        let d = daemon.clone();
        let result = match tokio::task::spawn_blocking(move || d.rescan()).await {
            Ok(Ok(events)) if !events.is_empty() => {
                tracing::info!(events = events.len(), ?trigger, "rescan found changes");
                RescanResult::Changed
            }
            Ok(Ok(_)) => {
                tracing::debug!(?trigger, "rescan: no change");
                RescanResult::Unchanged
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %crate::error_chain(&e), "rescan failed; keeping the fabric");
                RescanResult::Failed
            }
            Err(e) => {
                tracing::warn!(error = %e, "rescan panicked; keeping the fabric");
                RescanResult::Failed
            }
        };
        daemon.metrics.rescan(trigger, result);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_burst_of_requests_is_one_rescan_after_the_quiet() {
        let t = Arc::new(Trigger::default());
        let stop = CancellationToken::new();
        let burst = {
            let t = t.clone();
            tokio::spawn(async move {
                for _ in 0..5 {
                    t.want();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        let start = Instant::now();
        assert!(t.debounced(&stop).await);
        // The last request came at about 200 ms; the quiet after it is 200 ms more.
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(390), "{took:?}");
        assert!(took < DEBOUNCE_MAX, "{took:?}");
        burst.await.unwrap();
        // Everything of the burst was absorbed: no request is pending now.
        let pending = tokio::time::timeout(Duration::from_millis(100), t.notify.notified()).await;
        assert!(pending.is_err(), "a request of the burst was left pending");
        // A storm is cut at DEBOUNCE_MAX.
        let storm = {
            let t = t.clone();
            tokio::spawn(async move {
                for _ in 0..60 {
                    t.want();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };
        let start = Instant::now();
        assert!(t.debounced(&stop).await);
        let took = start.elapsed();
        assert!(took >= DEBOUNCE_MAX && took < DEBOUNCE_MAX + Duration::from_millis(500), "{took:?}");
        storm.abort();
        stop.cancel();
        assert!(!t.debounced(&stop).await, "shutdown ends the wait");
    }
}
