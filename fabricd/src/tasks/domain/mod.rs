//! fabricd as a node of a domain (`docs/domain.md`): it joins at start ([`join`]), then a
//! task on a small runtime of its own publishes this node's placements and topology
//! ([`publish`]),
//! watches the domain into a [`DomainView`] (`watch.rs`), campaigns for the domain's
//! leader on each join's lease ([`Domain::leadership`]) and rejoins after a lost lease.
//! Requests read the published state lock-free ([`Domain::status`], [`Domain::view`],
//! [`listing`]) and never wait for etcd.

mod duties;
pub mod join;
pub mod listing;
pub mod publish;
mod watch;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use fabric_domain::{
    DomainClient, DomainConfig, DomainSettings, DomainView, EtcdError, Fence, Leadership, PartitionRecord,
    RecordLimits, TopologyRecord,
};
use tokio::runtime::Runtime;
use tokio::sync::Notify;

pub use join::{JoinError, Starting};

/// Views kept after they were replaced, for paged listings: a view costs a reference
/// per shard of the one after it, plus the shards that changed.
const RECENT_VIEWS: usize = 16;

/// Why an admin's domain request (a slot gc, a partition change) was not done.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    /// This node holds no membership now: its lease was lost (etcd unreachable past a
    /// renewal, or the lease expired), or etcd has not answered since start. It has no
    /// client to ask etcd with, nor a fence to write under: a domain change waits until
    /// the node rejoins.
    #[error("etcd unavailable to this node ({standing}): domain changes wait until it rejoins")]
    NotJoined {
        /// The node's standing, with why (`fenced: lease lost: …`, `etcd unreachable: …`).
        standing: String,
    },
    /// etcd refused or did not answer.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// The gc is queued for the leader, which did not carry it out in time (no leader
    /// now, or it is slow); it stays queued and the leader will.
    #[error("the gc is queued for the leader ({}), which has not carried it out within {after:?}; it stays queued", leader.as_deref().unwrap_or("none known now"))]
    NotCarriedOut {
        /// The leader as this node knows it.
        leader: Option<String>,
        /// How long this node waited.
        after: Duration,
    },
    /// A partition change was written to etcd, but this node's view had not caught up with
    /// it within the wait: it is not yet in force here (it will be once the view holds it).
    #[error(
        "written to etcd (revision {revision}) but not yet in this node's view after {after:?}: not in force here yet"
    )]
    NotInForce {
        /// The write's revision.
        revision: i64,
        /// How long this node waited.
        after: Duration,
    },
}

/// How this node stands in its domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// Joined: its member key lives on its lease; domain writes go ahead.
    Joined,
    /// Its lease was lost (etcd unreachable past a renewal, or expired): no domain writes
    /// until it rejoins with a new lease and incarnation. Local service goes on.
    Fenced(String),
    /// etcd could not be reached to (re)join; local service goes on with the slot the node
    /// held before.
    Unreachable(String),
}

impl std::fmt::Display for Standing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Joined => f.write_str("joined"),
            Self::Fenced(why) => write!(f, "fenced: {why}"),
            Self::Unreachable(why) => write!(f, "etcd unreachable: {why}"),
        }
    }
}

/// A node's membership as this node can state it. Only a joined node follows the domain:
/// while it is fenced or cannot reach etcd, its view is the last one it read, and the
/// others' leases may have ended (or nodes come back) since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Membership {
    /// Its lease lives.
    Live,
    /// Its lease ended; its slot is kept as a hole.
    Gone,
    /// This node, while it is not joined.
    Fenced,
    /// Another node, while this one is not joined: its last view said `live` or `gone`,
    /// which nothing confirms now.
    Unknown {
        /// What the last view said.
        was_live: bool,
    },
}

impl Membership {
    /// Of `n`, as node `me` states it, joined or not.
    pub fn of(n: &fabric_domain::NodeEntry<'_>, me: &str, joined: bool) -> Self {
        let live = n.member.is_some();
        match (joined, n.name == me, live) {
            (true, _, true) => Self::Live,
            (true, _, false) => Self::Gone,
            (false, true, _) => Self::Fenced,
            (false, false, was_live) => Self::Unknown { was_live },
        }
    }

    /// Its name in `fabric.domain/v1` and the metrics: `live`, `gone`, `fenced`, `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Gone => "gone",
            Self::Fenced => "fenced",
            Self::Unknown { .. } => "unknown",
        }
    }

    /// What the last view said of a node whose state is unknown.
    pub fn last_seen(self) -> Option<&'static str> {
        match self {
            Self::Unknown { was_live } => Some(if was_live { "live" } else { "gone" }),
            _ => None,
        }
    }
}

/// A view's nodes counted by [`Membership`], as node `me` states them: what `domain
/// status` sums up and the metrics show.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MemberCounts {
    /// Nodes the view lists.
    pub nodes: u64,
    /// Live.
    pub live: u64,
    /// Gone, keeping their slot.
    pub gone: u64,
    /// Fenced (this node) or unknown: neither live nor gone while this node is not joined.
    pub unknown: u64,
    /// Members that published no placements yet.
    pub unplaced: u64,
}

impl MemberCounts {
    /// Of `view`, as node `me` states them, joined or not.
    pub fn of(view: &DomainView, me: &str, joined: bool) -> Self {
        let mut c = Self::default();
        for n in view.nodes() {
            c.nodes += 1;
            match Membership::of(&n, me, joined) {
                Membership::Live => c.live += 1,
                Membership::Gone if n.slot.is_some() => c.gone += 1,
                Membership::Gone => {}
                Membership::Fenced | Membership::Unknown { .. } => c.unknown += 1,
            }
            if n.member.is_some() && n.placements.is_none() {
                c.unplaced += 1;
            }
        }
        c
    }
}

/// What `fabricctl domain status` shows of this node; replaced as a whole.
#[derive(Debug, Clone)]
pub struct DomainStatus {
    /// Joined, fenced or unreachable.
    pub standing: Standing,
    /// The incarnation of the current (or last) join; 0 before the first.
    pub incarnation: u64,
    /// Whether the last etcd request answered.
    pub etcd_reachable: bool,
    /// Round trip of the last probe that answered.
    pub round_trip: Option<Duration>,
}

/// The domain side of the daemon, shared by requests and the domain task.
#[derive(Debug)]
pub struct Domain {
    config: DomainConfig,
    settings: DomainSettings,
    slot: u32,
    /// The member record this node joins with (its incarnation is fresh for each join):
    /// its peer address, capabilities, groups and node id.
    member: fabric_domain::MemberRecord,
    status: ArcSwap<DomainStatus>,
    view: ArcSwap<DomainView>,
    /// The views published before the current one, newest last ([`RECENT_VIEWS`]), so
    /// that the pages of one listing come from one revision while the domain changes.
    recent: std::sync::Mutex<std::collections::VecDeque<Arc<DomainView>>>,
    /// The client of the current join, for admin requests (gc, partitions).
    client: ArcSwap<Option<DomainClient>>,
    /// The fence of the current join, for admin writes (partitions); none while not joined.
    fence: ArcSwap<Option<Fence>>,
    /// The current join's election (`fabric_domain::Election`); none while not joined.
    leadership: ArcSwap<Option<tokio::sync::watch::Receiver<Leadership>>>,
    /// Told after each committed change of this node's map, and after each rescan.
    map_changed: Notify,
    /// What this node publishes of its fabric (`topology/<node>`), made at start and at
    /// each rescan; the task writes it with the join's incarnation.
    topology: ArcSwapOption<TopologyRecord>,
    /// The domain's fabric as last merged, for the view revision and own record it was
    /// merged from ([`Domain::fabric`]).
    merged: ArcSwapOption<Merged>,
    /// Held by the one request that merges the domain's fabric: the others that find it
    /// out of date wait for that merge rather than each make their own (a 12,500-node
    /// domain's merge and index take seconds and gigabytes).
    merging: std::sync::Mutex<()>,
    /// Fabrics of this node and one other ([`Domain::pair_fabric`]), by the other's name.
    pairs: std::sync::Mutex<Pairs>,
    /// Merges of the domain's fabric made since start ([`Domain::fabric`]).
    merges: AtomicU64,
    etcd_errors: AtomicU64,
    /// The lease the member key lives on while joined; 0 when not joined.
    lease: AtomicI64,
    /// Set by [`Domain::leave`]: the domain task ends instead of rejoining (a revoked
    /// lease reads as lost, and a rejoin would put a member key that outlives the daemon
    /// by a TTL, refusing a quick restart `NameTaken`).
    left: std::sync::atomic::AtomicBool,
    /// The node link (`crate::peer`), when `[peer]` names its credentials.
    link: Option<crate::peer::NodeLink>,
    /// This node's shares of memory other hosts reach too, as claimed at start (and
    /// claimed back where they are at each rejoin).
    shares: Vec<join::KnownShare>,
    /// The daemon, once it serves ([`Domain::attach`]): what the task tells of a share lost.
    daemon: std::sync::OnceLock<std::sync::Weak<crate::daemon::Daemon>>,
    runtime: RuntimeGuard,
}

impl Domain {
    /// This node's name in the domain.
    pub fn node(&self) -> &str {
        &self.config.node
    }

    /// This node's shares of memory other hosts reach too (`[[memory.shares]]`).
    pub fn shares(&self) -> Vec<fabric_proto::domain::ShareDoc> {
        self.shares.iter().map(join::KnownShare::doc).collect()
    }

    /// The NVLink cliques (and CXL pools) this node's member record lists.
    pub fn groups(&self) -> &[fabric_domain::FabricGroup] {
        &self.member.groups
    }

    /// The domain's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The slot this node holds.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The settings this node brought: address bits and node span are the domain's (the
    /// join checks them); for the data paths, see [`Domain::allows`].
    pub fn settings(&self) -> &DomainSettings {
        &self.settings
    }

    /// Whether the domain's settings allow nodes to reach each other's memory by `kind`:
    /// its `data_paths` as the view last read them (a node that configures none takes the
    /// domain's), else as this node brought them.
    pub fn allows(&self, kind: fabric_domain::DataPathKind) -> bool {
        self.with_data_paths(|paths| paths.contains(&kind))
    }

    /// The domain's data paths by name (`shared_file`, `cxl`, ...), as [`Domain::allows`]
    /// reads them.
    pub fn data_paths(&self) -> Vec<String> {
        self.with_data_paths(|paths| {
            let names = paths.iter().filter_map(|p| serde_json::to_value(p).ok());
            names.filter_map(|v| v.as_str().map(str::to_owned)).collect()
        })
    }

    fn with_data_paths<T>(&self, f: impl FnOnce(&[fabric_domain::DataPathKind]) -> T) -> T {
        let view = self.view();
        f(view.settings().map_or(&self.settings.data_paths, |s| &s.data_paths))
    }

    /// The daemon serves from now on: the domain task tells it when this node's shares were
    /// taken by another host while it was away, and when they are its own again.
    pub fn attach(&self, daemon: std::sync::Weak<crate::daemon::Daemon>) {
        let _ = self.daemon.set(daemon);
    }

    /// Tells the daemon's memory registry that this node's shares are another host's
    /// (`why`) or its own again (`None`); whether it was told (a daemon not serving yet
    /// holds no region to refuse).
    pub(super) fn shares_withdrawn(&self, why: Option<&str>) -> bool {
        let Some(d) = self.daemon.get().and_then(std::sync::Weak::upgrade) else { return false };
        let resources = d.memory.withdraw_shares(why);
        match why {
            Some(why) => {
                tracing::error!(resources, %why, "this node's shares were collected and another host holds one: new regions on them are refused")
            }
            None => tracing::info!(resources, "this node's shares are its own again: new regions on them are served"),
        }
        true
    }

    /// The node link, when this node has one.
    pub fn link(&self) -> Option<&crate::peer::NodeLink> {
        self.link.as_ref()
    }

    /// The domain's runtime, where link I/O runs.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.runtime.get()
    }

    /// This node's standing, etcd reachability and round trip.
    pub fn status(&self) -> Arc<DomainStatus> {
        self.status.load_full()
    }

    /// The domain as last seen through the watch.
    pub fn view(&self) -> Arc<DomainView> {
        self.view.load_full()
    }

    /// The view of etcd revision `revision`, while this node still holds it (the current
    /// one or one of the few recent ones before it).
    pub fn view_at(&self, revision: u64) -> Option<Arc<DomainView>> {
        let current = self.view();
        let at = |v: &DomainView| u64::try_from(v.revision()).ok() == Some(revision);
        if at(&current) {
            return Some(current);
        }
        let recent = self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        recent.iter().rev().find(|v| at(v)).cloned()
    }

    /// Who leads the domain, as this node knows it: `Unknown` while not joined. The
    /// leader is where domain-wide duties will run; none runs on its own yet (slot gc
    /// stays an admin's request, answered by any node).
    pub fn leadership(&self) -> Leadership {
        match &**self.leadership.load() {
            Some(rx) => rx.borrow().clone(),
            None => Leadership::Unknown,
        }
    }

    /// What the metrics page shows.
    pub fn gauges(&self) -> crate::metrics::DomainGauges {
        let view = self.view();
        let status = self.status();
        let leadership = self.leadership();
        let joined = status.standing == Standing::Joined;
        let counts = MemberCounts::of(&view, self.node(), joined);
        crate::metrics::DomainGauges {
            live: counts.live,
            gone: counts.gone,
            unknown: counts.unknown,
            joined,
            round_trip_s: status.round_trip.map(|t| t.as_secs_f64()),
            etcd_errors: self.etcd_errors(),
            topology_merges: self.merges.load(Ordering::Relaxed),
            leader: leadership.is_leader(),
            leader_term: leadership.term(),
            link: self
                .link()
                .filter(|l| l.local_addr().is_some())
                .map(|l| crate::metrics::LinkGauges { stats: l.stats(), member_sources: l.member_sources() as u64 }),
        }
    }

    /// etcd requests that failed since start.
    pub fn etcd_errors(&self) -> u64 {
        self.etcd_errors.load(Ordering::Relaxed)
    }

    /// Tells the domain task that this node's map changed (after the change was saved and
    /// published); it writes the placements record. Never blocks.
    pub fn map_changed(&self) {
        self.map_changed.notify_one();
    }

    /// Tells the domain task that this node's fabric is `fabric` now (at start, and after
    /// a rescan that changed it); it writes the topology record. Never blocks.
    pub fn fabric_changed(&self, fabric: &fabric_topology::Fabric) {
        let record = TopologyRecord::from_fabric(fabric, &self.config.node, 0, Self::limits().max_bytes());
        let listed: std::collections::HashSet<&fabric_topology::DeviceId> =
            record.devices.iter().map(|d| &d.id).collect();
        let switches: Vec<_> =
            fabric.inventory().devices.iter().filter(|d| fabric_domain::topology::is_shared_switch(d)).collect();
        let left_out = switches.iter().filter(|d| !listed.contains(&d.id)).count();
        if left_out > 0 {
            // The rings of switches around this node that fit the record (docs/domain.md,
            // "Records"); the other nodes' records carry the rest.
            tracing::info!(
                left_out,
                switches = switches.len(),
                "topology record: the fabric-level switches near this node only"
            );
        }
        self.topology.store(Some(Arc::new(record)));
        self.map_changed.notify_one();
    }

    /// The domain's fabric — every node's topology record as this node's view holds them,
    /// this node's own as it made it, merged (`fabric_domain::domain_fabric::merge_with`: the
    /// same on every node that saw the same records, and never without this node's own
    /// devices, so a client asking at start finds them before the record went round) and
    /// indexed as a [`crate::daemon::View`]. Merged once per change of what it is made of
    /// (`DomainView::fabric_revision`: slots, topology records, members coming and going)
    /// and per record of this node's own, by one request at a time, and shared by every
    /// request until either changes — a request of a 12,500-node domain does not merge its
    /// topology again, nor after a partition, share or election record is written, nor
    /// while another request merges it (`fabricd_domain_topology_merges_total` counts the
    /// merges).
    pub fn fabric(&self) -> Result<Arc<crate::daemon::View>, crate::daemon::StartError> {
        let current = |view: &DomainView, own: &Option<Arc<TopologyRecord>>| {
            let merged = self.merged.load_full()?;
            merged.from.is(view.fabric_revision(), own).then(|| merged.fabric.clone())
        };
        if let Some(fabric) = current(&self.view(), &self.topology.load_full()) {
            return Ok(fabric);
        }
        let _merging = self.merging.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Read again under the lock: the request that held it may have merged what this
        // one would.
        let (view, own) = (self.view(), self.topology.load_full());
        if let Some(fabric) = current(&view, &own) {
            return Ok(fabric);
        }
        let mine = own.as_deref().map(|r| (self.config.node.as_str(), r));
        let fabric = Arc::new(crate::daemon::View::build(fabric_domain::domain_fabric::merge_with(&view, mine))?);
        self.merges.fetch_add(1, Ordering::Relaxed);
        let from = Source { revision: view.fabric_revision(), own };
        self.merged.store(Some(Arc::new(Merged { from, fabric: fabric.clone() })));
        Ok(fabric)
    }

    /// [`Self::pair_fabric`] when it is kept for the view and topology of now: `None`
    /// when it would have to be merged (CPU work that grows with the two nodes).
    pub fn pair_fabric_cached(&self, other: &str) -> Option<Arc<fabric_topology::Fabric>> {
        let (view, own) = (self.view(), self.topology.load_full());
        self.cached_pair(other, view.fabric_revision(), &own)
    }

    fn cached_pair(
        &self,
        other: &str,
        revision: i64,
        own: &Option<Arc<TopologyRecord>>,
    ) -> Option<Arc<fabric_topology::Fabric>> {
        let pairs = self.pairs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        pairs.by_node.get(other).filter(|_| pairs.from.is(revision, own)).cloned()
    }

    /// The fabric of this node and node `other` alone — their two topology records merged
    /// (`fabric_domain::domain_fabric::merge_nodes`; this node's own as it made it) and
    /// indexed — for a question about the two (whether `other` reaches a device of this
    /// node by a scale-up fabric), without merging the whole domain: two records of at most
    /// the record bound each, where the domain's may be 12,500. Kept for the next question
    /// until the view's topology changes anywhere (a slot, a record, a member's liveness)
    /// or this node's record does (a pair of supernode trays
    /// takes ~40 µs to merge and index, more than a request's own work); not counted as a
    /// merge of the domain.
    pub fn pair_fabric(
        &self,
        other: &str,
    ) -> Result<Arc<fabric_topology::Fabric>, fabric_topology::inventory::InventoryError> {
        let (view, own) = (self.view(), self.topology.load_full());
        let revision = view.fabric_revision();
        if let Some(f) = self.cached_pair(other, revision, &own) {
            return Ok(f);
        }
        let me = self.config.node.as_str();
        let mine = own.as_deref().map(|r| (me, r));
        let inv = fabric_domain::domain_fabric::merge_nodes(&view, mine, &[me, other]);
        let fabric = Arc::new(fabric_topology::Fabric::build(inv)?);
        let mut pairs = self.pairs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let stale = (!pairs.from.is(revision, &own) || pairs.by_node.len() >= Pairs::MAX).then(|| {
            std::mem::replace(&mut *pairs, Pairs { from: Source { revision, own }, by_node: Default::default() })
        });
        pairs.by_node.insert(other.to_owned(), fabric.clone());
        drop(pairs);
        // Up to `Pairs::MAX` fabrics freed after the lock.
        drop(stale);
        Ok(fabric)
    }

    /// Admin: frees the slot of `node`, which must not be live. The leader does it
    /// (`DomainClient::gc_led`, fenced by its leader key), collecting the node's
    /// placements, topology and partition memberships: on the leader at once, elsewhere
    /// by queueing the request (`gc/<node>`) and waiting, at most one lease TTL, for the
    /// leader to carry it out.
    pub fn gc(&self, node: &str) -> Result<Option<u32>, GcError> {
        let (Some(client), Some(fence)) = ((*self.client.load_full()).clone(), (*self.fence.load_full()).clone())
        else {
            return Err(self.not_joined());
        };
        let owned = node.to_owned();
        if let Leadership::Leader { term, .. } = self.leadership() {
            let leader = fabric_domain::LeaderFence::new(&client, self.lease.load(Ordering::Relaxed), term);
            return self.ask("leader gc", async move { client.gc_led(&leader, &owned).await });
        }
        // A live node is refused by etcd's answer, before anything is queued.
        let (c, n) = (client.clone(), owned.clone());
        if self.ask("member read", async move { c.is_live(&n).await })? {
            return Err(GcError::Etcd(EtcdError::GcLive { node: owned }));
        }
        let slot = self.view().nodes().iter().find(|n| n.name == node).and_then(|n| n.slot);
        let (c, f) = (client.clone(), owned.clone());
        self.ask("gc request", async move { c.request_gc(&fence, &f).await })?;
        // Long enough for a leader's handover (one TTL).
        let wait = Duration::from_secs(self.config.lease_ttl_secs).max(self.config.request_timeout() * 2);
        let deadline = std::time::Instant::now() + wait;
        // Looked at often while a live leader takes it at once, then less and less (up to
        // a twelfth of the TTL): with no leader, one request is not thousands of reads.
        let (mut poll, most) = (Duration::from_millis(20), (wait / 12).max(Duration::from_millis(20)));
        loop {
            let (c, n) = (client.clone(), owned.clone());
            if !self.ask("gc queue read", async move { c.gc_pending(&n).await })? {
                break;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                let leader = self.leadership().leader().map(str::to_owned);
                return Err(GcError::NotCarriedOut { leader, after: wait });
            }
            std::thread::sleep(poll.min(deadline - now));
            poll = (poll * 2).min(most);
        }
        // The leader took the request: done, unless the node was live.
        let (c, n) = (client.clone(), owned.clone());
        let held = self.ask("slot read", async move { c.held_slot(&n).await })?;
        match held {
            None => Ok(slot),
            Some(_) => Err(GcError::Etcd(EtcdError::GcLive { node: owned })),
        }
    }

    /// Admin: writes the domain's partition `name` (`Some`) or deletes it (`None`) under
    /// this node's fence, then waits (at most one request timeout) until this node's view
    /// holds the change, so that the admin's next request sees it here; a view that did
    /// not catch up by then is [`GcError::NotInForce`] (the change was written all the same).
    pub fn set_partition(&self, name: &str, record: Option<&PartitionRecord>) -> Result<(), GcError> {
        let (Some(client), Some(fence)) = ((*self.client.load_full()).clone(), (*self.fence.load_full()).clone())
        else {
            return Err(self.not_joined());
        };
        let key = client.keys().partition(name);
        let value = record.map(fabric_domain::records::encode);
        let revision = self.ask("partition write", async move {
            match value {
                Some(v) => client.put_fenced(&fence, key, v).await,
                None => client.delete_fenced(&fence, key).await,
            }
        })?;
        let wait = self.config.request_timeout();
        let deadline = std::time::Instant::now() + wait;
        while self.view().revision() < revision {
            if std::time::Instant::now() >= deadline {
                return Err(GcError::NotInForce { revision, after: wait });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    fn not_joined(&self) -> GcError {
        GcError::NotJoined { standing: self.status().standing.to_string() }
    }

    /// Runs `op` on the domain's runtime and waits for it at most two request timeouts.
    fn ask<T: Send + 'static>(
        &self,
        what: &'static str,
        op: impl Future<Output = Result<T, EtcdError>> + Send + 'static,
    ) -> Result<T, GcError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.runtime.get().spawn(async move {
            let _ = tx.send(op.await);
        });
        let wait = self.config.request_timeout() * 2;
        let r = rx.recv_timeout(wait).unwrap_or(Err(EtcdError::Timeout { op: what, after: wait }));
        if r.is_err() {
            self.etcd_errors.fetch_add(1, Ordering::Relaxed);
        }
        Ok(r?)
    }

    /// Leaves the domain at shutdown: revokes the lease, so the member key goes at once
    /// (the slot stays). Waits for etcd at most one request timeout.
    pub fn leave(&self) {
        self.left.store(true, Ordering::SeqCst);
        let lease = self.lease.swap(0, Ordering::SeqCst);
        let Some(client) = (*self.client.load_full()).clone().filter(|_| lease != 0) else { return };
        let (tx, rx) = std::sync::mpsc::channel();
        self.runtime.get().spawn(async move {
            let mut raw = client.raw();
            let _ = tx.send(client.call("lease revoke", raw.lease_revoke(lease)).await.map(drop));
        });
        match rx.recv_timeout(self.config.request_timeout()) {
            Ok(Ok(())) => tracing::info!(node = %self.config.node, "left the domain"),
            Ok(Err(e)) => {
                tracing::warn!(error = %crate::error_chain(&e), "cannot leave the domain; it ends with the lease")
            }
            Err(_) => tracing::warn!("etcd did not answer the leave; the node goes with its lease"),
        }
    }

    /// Whether the node left the domain ([`Domain::leave`]): nothing joins again.
    pub(super) fn has_left(&self) -> bool {
        self.left.load(Ordering::SeqCst)
    }

    /// Publishes a new view; the node link hears of it (members that left or restarted
    /// void what was granted to or by them).
    fn publish_view(&self, view: DomainView) {
        let old = self.view.swap(Arc::new(view));
        // The oldest view is freed after the lock is let go.
        let _dropped = {
            let mut recent = self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            recent.push_back(old);
            (recent.len() > RECENT_VIEWS).then(|| recent.pop_front())
        };
        if let Some(link) = &self.link {
            link.members_changed();
        }
    }

    fn set_status(&self, f: impl FnOnce(&mut DomainStatus)) {
        let mut s = (*self.status.load_full()).clone();
        f(&mut s);
        self.status.store(Arc::new(s));
    }

    fn etcd_failed(&self) {
        self.etcd_errors.fetch_add(1, Ordering::Relaxed);
        self.set_status(|s| s.etcd_reachable = false);
    }

    fn limits() -> RecordLimits {
        RecordLimits::default()
    }
}

/// What a merged fabric was made from: a view's fabric revision and this node's own
/// record (by identity).
#[derive(Debug, Default)]
struct Source {
    /// `DomainView::fabric_revision` of the view merged.
    revision: i64,
    own: Option<Arc<TopologyRecord>>,
}

impl Source {
    /// Whether it is `revision` and `own`: a fabric made from it is still current.
    fn is(&self, revision: i64, own: &Option<Arc<TopologyRecord>>) -> bool {
        self.revision == revision && self.own.as_ref().map(Arc::as_ptr) == own.as_ref().map(Arc::as_ptr)
    }
}

/// The domain's fabric merged from one view's fabric revision and this node's own record.
#[derive(Debug)]
struct Merged {
    from: Source,
    fabric: Arc<crate::daemon::View>,
}

/// The fabrics of this node and one other, each merged from the two records of one
/// [`Source`]: all dropped together when it changes, and at most [`Pairs::MAX`] of them.
#[derive(Debug, Default)]
pub(super) struct Pairs {
    from: Source,
    by_node: std::collections::HashMap<String, Arc<fabric_topology::Fabric>>,
}

impl Pairs {
    /// How many pairs are kept (each a few dozen devices to a few thousand).
    const MAX: usize = 256;
}

/// The domain's runtime, shut down without waiting when the daemon goes (dropping a
/// runtime may not block inside the daemon's own runtime).
#[derive(Debug)]
struct RuntimeGuard {
    handle: tokio::runtime::Handle,
    runtime: Option<Runtime>,
}

impl RuntimeGuard {
    fn new(runtime: Runtime) -> Self {
        Self { handle: runtime.handle().clone(), runtime: Some(runtime) }
    }

    fn get(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for RuntimeGuard {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}
