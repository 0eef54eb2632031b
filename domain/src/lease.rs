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

use std::future::Future;
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
    task: JoinHandle<()>,
}

impl Lease {
    /// Starts renewing lease `id` every `ttl / 3`, each renewal bounded by `timeout`. `asked`
    /// is when the grant was sent: etcd may start the TTL as soon as it gets it, so the
    /// lease counts as renewed then, not when the answer came.
    pub(crate) fn start(client: Client, id: i64, ttl: Duration, timeout: Duration, asked: Instant) -> Self {
        let (tx, state) = watch::channel(LeaseState::Alive);
        let (renewed_tx, renewed) = watch::channel(asked);
        let task = tokio::spawn(renew(client, id, ttl / 3, timeout, tx, renewed_tx));
        Self { id, ttl, state, renewed, task }
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

    /// `Ok` while the lease is alive, the typed refusal once it is lost.
    pub fn check(&self) -> Result<(), EtcdError> {
        match &*self.state.borrow() {
            LeaseState::Alive => Ok(()),
            LeaseState::Lost(reason) => Err(EtcdError::LeaseLost { id: self.id, reason: reason.clone() }),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The renewal loop: one keepalive request and its answer per tick; failures retried
/// until two thirds of the TTL passed since the last acknowledged renewal.
async fn renew(
    mut client: Client,
    id: i64,
    every: Duration,
    timeout: Duration,
    state: watch::Sender<LeaseState>,
    renewed: watch::Sender<Instant>,
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
        tokio::time::sleep_until(next).await;
        if state.is_closed() {
            info!(lease = id, "lease dropped");
            return;
        }
        let sent = Instant::now();
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
