//! A node's etcd lease and the task that renews it every third of its TTL.
//!
//! The task reports through a watch channel: `Alive` while renewals succeed, `Lost` from
//! the first renewal that fails, times out, or finds the lease expired. A renewal waits at
//! most the request timeout (a third of the TTL), so a node cut off from etcd sees `Lost`
//! at most two thirds of a TTL after its last renewal: before etcd expires its member key,
//! which leaves it time to fence itself. A lost lease is never renewed again: the node
//! rejoins with a new lease (and a new incarnation). Dropping the [`Lease`] stops the task;
//! the lease then runs out in etcd after its TTL (use `DomainClient::leave` to end it now).

use std::time::Duration;

use etcd_client::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

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
    task: JoinHandle<()>,
}

impl Lease {
    /// Starts renewing lease `id` every `ttl / 3`, each renewal bounded by `timeout`.
    pub(crate) fn start(client: Client, id: i64, ttl: Duration, timeout: Duration) -> Self {
        let (tx, state) = watch::channel(LeaseState::Alive);
        let task = tokio::spawn(renew(client, id, ttl / 3, timeout, tx));
        Self { id, ttl, state, task }
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

/// The renewal loop: one keepalive request and its answer per tick.
async fn renew(mut client: Client, id: i64, every: Duration, timeout: Duration, state: watch::Sender<LeaseState>) {
    let lost = |reason: String| {
        warn!(lease = id, %reason, "lease lost");
        state.send_replace(LeaseState::Lost(reason));
    };
    let (mut keeper, mut stream) = match tokio::time::timeout(timeout, client.lease_keep_alive(id)).await {
        Ok(Ok(pair)) => pair,
        Ok(Err(e)) => return lost(format!("etcd keepalive stream: {e}")),
        Err(_) => return lost(format!("etcd keepalive stream: no answer within {timeout:?}")),
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let renewal = async {
            keeper.keep_alive().await?;
            stream.message().await
        };
        match tokio::time::timeout(timeout, renewal).await {
            Ok(Ok(Some(answer))) if answer.ttl() > 0 => {}
            Ok(Ok(Some(_))) => return lost("expired in etcd".to_owned()),
            Ok(Ok(None)) => return lost("etcd closed the keepalive stream".to_owned()),
            Ok(Err(e)) => return lost(format!("etcd keepalive: {e}")),
            Err(_) => return lost(format!("etcd keepalive: no answer within {timeout:?}")),
        }
        if state.is_closed() {
            info!(lease = id, "lease dropped");
            return;
        }
    }
}
