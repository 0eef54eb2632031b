//! A node's etcd lease and the task that renews it every third of its TTL.
//!
//! The task reports through a watch channel: `Alive` while renewals succeed, `Lost` once
//! the lease is found expired, or once two thirds of a TTL passed since the last renewal
//! etcd acknowledged (counted from when it was sent). A failed renewal is retried, on a
//! new keepalive stream, every twelfth of the TTL until that deadline, each attempt cut at
//! the deadline: a short etcd outage (a restart, which refreshes every lease) costs no
//! lease, while a node cut off from etcd sees `Lost` a third of a TTL before etcd expires
//! its member key, which leaves it time to fence itself. A lost lease is never renewed
//! again: the node rejoins with a new lease (and a new incarnation). Dropping the [`Lease`] stops the task;
//! the lease then runs out in etcd after its TTL (use `DomainClient::leave` to end it now).
//!
//! The deadline is also kept on `CLOCK_BOOTTIME`, which counts a suspended machine's (or
//! a paused VM's) sleep while `CLOCK_MONOTONIC` and tokio's timers do not: etcd's clock
//! went on, so a node that wakes past its deadline refuses at once ([`Lease::check`], a
//! [`crate::Fence`]'s check) and reports `Lost` within a twelfth of the TTL.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::etcd::EtcdError;

/// What the renewal task knows of the lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// The last renewal succeeded.
    Alive,
    /// The lease is lost (or may be): the reason.
    Lost(String),
}

/// A granted lease, renewed by a task while this value lives.
#[derive(Debug)]
pub struct Lease {
    id: i64,
    ttl: Duration,
    state: watch::Receiver<LeaseState>,
    renewed: watch::Receiver<Instant>,
    acked: Acked,
    task: JoinHandle<()>,
}

/// Time since boot, a suspend's sleep included (`CLOCK_BOOTTIME`); `None` where the
/// clock cannot be read, and only the monotonic deadline holds then.
pub(crate) type BootClock = fn() -> Option<Duration>;

/// `CLOCK_BOOTTIME` now.
fn boot_time() -> Option<Duration> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `ts`, which lives across the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return None;
    }
    Some(Duration::new(u64::try_from(ts.tv_sec).ok()?, u32::try_from(ts.tv_nsec).ok()?))
}

/// When a lease grant was sent, on both clocks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Asked {
    at: Instant,
    boot: Option<Duration>,
    clock: BootClock,
}

impl Asked {
    /// Now, on the monotonic clock and the machine's boot clock.
    pub(crate) fn now() -> Self {
        Self::now_on(boot_time)
    }

    /// Now, with the boot clock `clock` (tests make one that jumps, as a resumed
    /// machine's does).
    pub(crate) fn now_on(clock: BootClock) -> Self {
        Self { at: Instant::now(), boot: clock(), clock }
    }
}

/// The last acknowledged renewal on the boot clock, shared by the renewal task, the
/// [`Lease`] and every fence on it: past the budget, the lease is lost whatever the
/// monotonic clock says.
#[derive(Debug, Clone)]
pub(crate) struct Acked {
    /// Nanoseconds since boot when the last acknowledged renewal was sent; `u64::MAX`
    /// while the boot clock could not be read.
    at: Arc<AtomicU64>,
    budget: Duration,
    clock: BootClock,
}

impl Acked {
    fn new(clock: BootClock, budget: Duration, at: Option<Duration>) -> Self {
        let acked = Self { at: Arc::new(AtomicU64::new(u64::MAX)), budget, clock };
        acked.record(at);
        acked
    }

    fn record(&self, at: Option<Duration>) {
        let nanos = at.and_then(|d| u64::try_from(d.as_nanos()).ok()).unwrap_or(u64::MAX);
        self.at.store(nanos, Ordering::Release);
    }

    /// The boot-clock time since the last acknowledged renewal, once it reached the
    /// budget; `None` before, or while either reading is missing.
    pub(crate) fn overdue(&self) -> Option<Duration> {
        let at = self.at.load(Ordering::Acquire);
        if at == u64::MAX {
            return None;
        }
        let since = (self.clock)()?.checked_sub(Duration::from_nanos(at))?;
        (since >= self.budget).then_some(since)
    }

    /// The refusal reason of an overdue lease.
    pub(crate) fn overdue_reason(&self) -> Option<String> {
        self.overdue().map(|since| format!("no renewal acknowledged for {since:?} on the boot clock (a suspend?)"))
    }
}

impl Lease {
    /// Starts renewing lease `id` every `ttl / 3`, each renewal bounded by `timeout`. `asked`
    /// is when the grant was sent: etcd may start the TTL as soon as it gets it, so the
    /// lease counts as renewed then, not when the answer came.
    pub(crate) fn start(client: Client, id: i64, ttl: Duration, timeout: Duration, asked: Asked) -> Self {
        let (tx, state) = watch::channel(LeaseState::Alive);
        let (renewed_tx, renewed) = watch::channel(asked.at);
        let every = ttl / 3;
        let acked = Acked::new(asked.clock, every * 2, asked.boot);
        let task = tokio::spawn(renew(client, id, every, timeout, tx, renewed_tx, acked.clone()));
        Self { id, ttl, state, renewed, acked, task }
    }

    /// The lease's etcd id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The lease's TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// What the renewal task knows now.
    pub fn state(&self) -> LeaseState {
        self.state.borrow().clone()
    }

    /// When the last renewal etcd acknowledged was sent (the grant, before the first):
    /// the lease is given up two thirds of a TTL after it.
    pub fn renewed(&self) -> Instant {
        *self.renewed.borrow()
    }

    /// A receiver that sees every acknowledged renewal.
    pub fn watch_renewals(&self) -> watch::Receiver<Instant> {
        self.renewed.clone()
    }

    /// A receiver that sees every change of state (to fence on `Lost`).
    pub fn watch(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }

    /// `Ok` while the lease is alive, the typed refusal once it is lost, or once its
    /// deadline passed on the boot clock (before the renewal task wakes to say so).
    pub fn check(&self) -> Result<(), EtcdError> {
        match &*self.state.borrow() {
            LeaseState::Alive => match self.acked.overdue_reason() {
                None => Ok(()),
                Some(reason) => Err(EtcdError::LeaseLost { id: self.id, reason }),
            },
            LeaseState::Lost(reason) => Err(EtcdError::LeaseLost { id: self.id, reason: reason.clone() }),
        }
    }

    /// The boot-clock deadline, for the fences on this lease.
    pub(crate) fn acked(&self) -> Acked {
        self.acked.clone()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The renewal loop: one keepalive request and its answer per tick; failures retried
/// until two thirds of the TTL passed since the last acknowledged renewal, on either
/// clock. Between ticks it wakes every twelfth of the TTL to look at the boot clock.
async fn renew(
    mut client: Client,
    id: i64,
    every: Duration,
    timeout: Duration,
    state: watch::Sender<LeaseState>,
    renewed: watch::Sender<Instant>,
    acked: Acked,
) {
    let lost = |reason: String| {
        warn!(lease = id, %reason, "lease lost");
        state.send_replace(LeaseState::Lost(reason));
    };
    // `every` is a third of the TTL. The lease was granted just before this task started.
    let budget = every * 2;
    let retry = every / 4;
    let mut last_good = *renewed.borrow();
    let mut next = last_good + every;
    let mut keepalive: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    loop {
        tokio::time::sleep_until(next.min(Instant::now() + retry)).await;
        if state.is_closed() {
            info!(lease = id, "lease dropped");
            return;
        }
        if let Some(reason) = acked.overdue_reason() {
            return lost(reason);
        }
        if Instant::now() < next {
            continue;
        }
        let sent = Instant::now();
        let sent_boot = (acked.clock)();
        let deadline = last_good + budget;
        let Some(left) = deadline.checked_duration_since(sent).filter(|d| !d.is_zero()) else {
            return lost(format!("no renewal acknowledged for {budget:?}"));
        };
        let renewal = async {
            if keepalive.is_none() {
                keepalive = Some(client.lease_keep_alive(id).await?);
            }
            match keepalive.as_mut() {
                Some((keeper, stream)) => {
                    keeper.keep_alive().await?;
                    stream.message().await
                }
                None => Ok(None),
            }
        };
        let failure = match tokio::time::timeout(timeout.min(left), renewal).await {
            Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                last_good = sent;
                acked.record(sent_boot);
                renewed.send_replace(sent);
                next = sent + every;
                continue;
            }
            Ok(Ok(Some(_))) => return lost("expired in etcd".to_owned()),
            Ok(Ok(None)) => "etcd closed the keepalive stream".to_owned(),
            Ok(Err(e)) => format!("etcd keepalive: {e}"),
            Err(_) => format!("etcd keepalive: no answer within {:?}", timeout.min(left)),
        };
        keepalive = None;
        if Instant::now() >= deadline {
            return lost(format!("{failure}; no renewal acknowledged for {budget:?}"));
        }
        debug!(lease = id, %failure, "lease renewal failed; retrying");
        next = (Instant::now() + retry).min(deadline);
    }
}

/// `work` (a wait on etcd: a probe, a write, a leader read), or `None` once the lease
/// `lease` reports is lost, or its renewal stopped (the sender gone), before `work` ends:
/// a loop that awaits such a wait inside one of its arms does not look at the lease
/// meanwhile, and a node cut off from etcd must act on the loss at once, not when etcd
/// answers or the wait times out.
pub async fn unless_lost<T>(lease: &mut watch::Receiver<LeaseState>, work: impl Future<Output = T>) -> Option<T> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            changed = lease.changed() => {
                if changed.is_err() || matches!(&*lease.borrow(), LeaseState::Lost(_)) {
                    return None;
                }
            }
            out = &mut work => return Some(out),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use super::{Asked, LeaseState, boot_time};
    use crate::etcd::{DomainClient, EtcdError};
    use crate::records::RecordLimits;
    use crate::testing;

    /// How long the machine "slept": added to the boot clock, never to the monotonic one.
    static SLEPT: AtomicU64 = AtomicU64::new(0);

    fn resumed_clock() -> Option<Duration> {
        boot_time().map(|t| t + Duration::from_nanos(SLEPT.load(Ordering::Relaxed)))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_that_wakes_past_its_deadline_refuses_at_once_and_reports_the_loss() {
        let Some(etcd) = testing::etcd_or_skip().await else { return };
        // Renewals every 2 s; given up 4 s after the last acknowledged one.
        let c = DomainClient::connect(&testing::config(etcd.endpoint(), "tray-0", 6), RecordLimits::default())
            .await
            .unwrap();
        let lease = c.grant_lease_asked(Asked::now_on(resumed_clock)).await.unwrap();
        let record = testing::member("tray-0");
        let fence = c.join_fenced(&lease, &record).await.unwrap();
        let key = c.keys().placements("tray-0");
        c.put_fenced(&fence, key.clone(), "before").await.unwrap();

        // The machine sleeps 5 s: past the budget on the boot clock, not on the monotonic
        // one (nor in etcd, whose clock is this one here).
        SLEPT.store(5_000_000_000, Ordering::Relaxed);
        let refused = lease.check().unwrap_err();
        assert!(matches!(&refused, EtcdError::LeaseLost { .. }), "{refused:?}");
        assert!(refused.to_string().contains("boot clock"), "{refused}");
        let fenced = c.put_fenced(&fence, key.clone(), "after the sleep").await.unwrap_err();
        assert!(matches!(&fenced, EtcdError::Fenced { .. }), "{fenced:?}");
        assert!(fence.check().is_err());
        // The renewal task says so within a twelfth of the TTL (and some slack), not at
        // its next renewal.
        let mut state = lease.watch();
        let lost =
            tokio::time::timeout(Duration::from_millis(1500), state.wait_for(|s| matches!(s, LeaseState::Lost(_))))
                .await;
        assert!(lost.is_ok(), "the renewal task did not report the loss: {:?}", lease.state());
        // The write was refused by the node itself: etcd still holds the old value.
        let held = c.raw().get(key, None).await.unwrap();
        assert_eq!(held.kvs().first().map(|kv| kv.value().to_vec()), Some(b"before".to_vec()));
    }
}
