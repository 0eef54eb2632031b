//! Leader election for domain-wide duties (slot gc now, cross-node sets later) on etcd's
//! election API.
//!
//! Every member campaigns under `/fabric/<domain>/leader` with its own member lease, so
//! leadership ends with membership: a leader that stops renewing is replaced about one TTL
//! later, one that leaves (lease revoked) at once. One task per node campaigns (the
//! blocking `campaign` runs without a request timeout while the lease task keeps the lease
//! alive), observes the leader and checks it once per TTL, and publishes a [`Leadership`].
//! Leaders follow one another with growing terms (the leader key's create revision), so a
//! late report of an older leader is ignored. Losing leadership, or etcd, never panics and
//! never stops anything: the state turns `Unknown` (at once when the lease is lost, so a
//! node cut off from etcd stops acting as leader before its TTL ends).

use std::future::Future;
use std::pin::Pin;

use etcd_client::{Client, ElectionClient, KeyValue, ObserveStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::etcd::DomainClient;
use crate::lease::{Lease, LeaseState, unless_lost};
use crate::records::Keys;

/// Who leads the domain, as this node knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leadership {
    /// Not known: not yet observed, no leader, or this node's lease is lost.
    Unknown,
    /// This node leads.
    Leader {
        /// This node.
        node: String,
        /// The leader key's create revision: it grows with every new leader.
        term: i64,
    },
    /// Another node leads.
    Follower {
        /// The leader.
        leader: String,
        /// The leader key's create revision.
        term: i64,
    },
}

impl Leadership {
    /// Whether this node leads.
    pub fn is_leader(&self) -> bool {
        matches!(self, Self::Leader { .. })
    }

    /// The leader's name, when known.
    pub fn leader(&self) -> Option<&str> {
        match self {
            Self::Unknown => None,
            Self::Leader { node, .. } => Some(node),
            Self::Follower { leader, .. } => Some(leader),
        }
    }

    /// The leader's term, when known.
    pub fn term(&self) -> Option<i64> {
        match self {
            Self::Unknown => None,
            Self::Leader { term, .. } | Self::Follower { term, .. } => Some(*term),
        }
    }
}

/// The election's name under the domain's prefix.
pub fn election_name(keys: &Keys) -> String {
    format!("{}leader", keys.prefix())
}

/// This node's part in the election: a task that campaigns and observes while this value
/// lives (dropping it stops the task; the lease's end hands leadership over).
#[derive(Debug)]
pub struct Election {
    state: watch::Receiver<Leadership>,
    task: JoinHandle<()>,
}

impl Election {
    /// Starts campaigning for `client`'s node on `lease` (the node's member lease).
    pub fn start(client: &DomainClient, lease: &Lease) -> Self {
        let (tx, state) = watch::channel(Leadership::Unknown);
        let me =
            Me { node: client.node().to_owned(), lease: lease.id(), name: election_name(client.keys()), state: tx };
        let task = tokio::spawn(run(client.raw(), me, lease.watch(), lease.ttl()));
        Self { state, task }
    }

    /// Who leads now.
    pub fn current(&self) -> Leadership {
        self.state.borrow().clone()
    }

    /// A receiver that sees every change.
    pub fn watch(&self) -> watch::Receiver<Leadership> {
        self.state.clone()
    }
}

impl Drop for Election {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the task knows of this node.
struct Me {
    node: String,
    lease: i64,
    name: String,
    state: watch::Sender<Leadership>,
}

impl Me {
    /// Publishes what `kv` (the leader key) says, unless an equal or newer term is known.
    /// This node is published as leader only once its campaign returned (`won`): etcd may
    /// show its key first while the campaign still waits, and a campaign cancelled then
    /// resigns. Answers whether this node still leads as far as `kv` tells.
    fn observed(&self, kv: &KeyValue, won: bool) -> bool {
        let term = kv.create_revision();
        let leader = match std::str::from_utf8(kv.value()) {
            Ok(name) if !name.is_empty() && name.len() <= 63 => name.to_owned(),
            _ => {
                warn!(key = %String::from_utf8_lossy(kv.key()), "refused a leader value that is not a node name");
                return false;
            }
        };
        if leader == self.node && kv.lease() == self.lease {
            if won {
                self.publish(Leadership::Leader { node: leader, term });
            }
            true
        } else {
            // A late report of an older leader changes nothing.
            let stale = term < self.state.borrow().term().unwrap_or(0);
            self.publish(Leadership::Follower { leader, term });
            won && stale
        }
    }

    fn publish(&self, next: Leadership) {
        self.state.send_if_modified(|now| {
            let newer = matches!(next, Leadership::Unknown) || next.term() >= now.term();
            if newer && *now != next {
                info!(node = %self.node, from = ?now, to = ?next, "leadership changed");
                *now = next;
                true
            } else {
                false
            }
        });
    }

    fn unknown(&self) {
        self.state.send_if_modified(|now| {
            let changed = *now != Leadership::Unknown;
            *now = Leadership::Unknown;
            changed
        });
    }
}

type Campaign = Pin<Box<dyn Future<Output = Result<etcd_client::CampaignResponse, etcd_client::Error>> + Send>>;

fn campaign(client: &Client, me: &Me) -> Campaign {
    let mut election: ElectionClient = client.election_client();
    let (name, value, lease) = (me.name.clone(), me.node.clone(), me.lease);
    // No timeout here: the campaign blocks until this node leads, for as long as that takes.
    Box::pin(async move { election.campaign(name, value, lease).await })
}

async fn next_observed(stream: &mut Option<ObserveStream>) -> Option<Result<Option<KeyValue>, etcd_client::Error>> {
    match stream {
        Some(s) => Some(s.message().await.map(|m| m.and_then(|mut r| r.take_kv()))),
        None => std::future::pending().await,
    }
}

/// The election task: campaign, observe, check once per TTL; `Unknown` and stop once the
/// lease is lost.
async fn run(client: Client, me: Me, mut lease: watch::Receiver<LeaseState>, ttl: std::time::Duration) {
    let mut campaigning = Some(campaign(&client, &me));
    // Whether this node's campaign returned (it leads until its lease ends).
    let mut won = false;
    let mut observer: Option<ObserveStream> = None;
    let mut tick = tokio::time::interval(ttl);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if let LeaseState::Lost(reason) = &*lease.borrow() {
            warn!(node = %me.node, %reason, "lease lost: no longer campaigning");
            me.unknown();
            return;
        }
        tokio::select! {
            result = async {
                match campaigning.as_mut() {
                    Some(c) => c.await,
                    None => std::future::pending().await,
                }
            }, if campaigning.is_some() => {
                campaigning = None;
                match result {
                    Ok(response) => match response.leader() {
                        Some(key) => {
                            won = true;
                            me.publish(Leadership::Leader { node: me.node.clone(), term: key.rev() });
                        }
                        None => warn!(node = %me.node, "campaign answered without a leader key"),
                    },
                    // Retried at the next tick.
                    Err(error) => warn!(node = %me.node, %error, "etcd campaign failed"),
                }
            }
            message = next_observed(&mut observer) => match message {
                Some(Ok(Some(kv))) => won &= me.observed(&kv, won),
                Some(Ok(None)) | None => observer = None,
                Some(Err(error)) => {
                    warn!(node = %me.node, %error, "etcd observe failed");
                    observer = None;
                }
            },
            _ = tick.tick() => {
                let mut election = client.election_client();
                // A loss while etcd is asked: the loop's top (or the lease arm, for a
                // renewal that stopped) ends the task.
                let read = unless_lost(&mut lease, tokio::time::timeout(ttl / 3, election.leader(me.name.clone())));
                let Some(read) = read.await else { continue };
                match read {
                    Ok(Ok(mut response)) => match response.take_kv() {
                        Some(kv) => won &= me.observed(&kv, won),
                        None => {
                            won = false;
                            me.unknown();
                        }
                    },
                    Ok(Err(error)) if error.to_string().contains("no leader") => {
                        won = false;
                        me.unknown();
                    }
                    Ok(Err(error)) => warn!(node = %me.node, %error, "etcd leader read failed"),
                    Err(_) => warn!(node = %me.node, "etcd leader read: no answer in time"),
                }
                if observer.is_none() {
                    let opened = unless_lost(&mut lease, tokio::time::timeout(ttl / 3, election.observe(me.name.clone())));
                    let Some(opened) = opened.await else { continue };
                    match opened {
                        Ok(Ok(stream)) => observer = Some(stream),
                        Ok(Err(error)) => warn!(node = %me.node, %error, "etcd observe failed"),
                        Err(_) => warn!(node = %me.node, "etcd observe: no answer in time"),
                    }
                }
                if campaigning.is_none() && !won {
                    campaigning = Some(campaign(&client, &me));
                }
            }
            changed = lease.changed() => if changed.is_err() {
                // The lease value was dropped: nothing renews it any more.
                warn!(node = %me.node, "lease dropped: no longer campaigning");
                me.unknown();
                return;
            }
        }
    }
}
