//! Domain-wide duties the leader carries out. An admin's slot gc asked of any node is
//! queued as `gc/<node>` (a [`GcRequest`], written under the asking node's fence); the
//! leader carries it out in one transaction fenced by its leader key — the key's create
//! revision must still be the leader's term ([`LeaderFence`]), so a deposed leader's gc
//! is refused by etcd itself — which frees the slot and collects what the node left
//! behind: its placements, its topology, its shares of shared memory, its devices in the
//! domain's partitions (a partition left with no device is removed), and the request
//! (more than one transaction takes: in batches under the same fence, partitions that
//! keep other devices rewritten before the slot is freed, emptied ones deleted after).
//! Never a live node's. The leader also sweeps the records of nodes that hold no slot
//! ([`DomainClient::sweep_orphans`]: left by a gc of an older version, or put by hand).

use std::collections::HashSet;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::election::election_name;
use crate::etcd::{DomainClient, EtcdError};
use crate::fence::Fence;
use crate::partition::PartitionRecord;
use crate::records::{self, RECORD_VERSION, Record, RecordError, SlotClaim, check_node_name, invalid};
use crate::topology::TopologyRecord;

/// An admin's gc of `node`, queued for the leader at `gc/<node>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// Format version.
    pub version: u32,
    /// The node whose slot is to be freed (the key's last part).
    pub node: String,
    /// The node that took the admin's request.
    pub by: String,
}

impl GcRequest {
    /// A request of the current version.
    pub fn new(node: &str, by: &str) -> Self {
        Self { version: RECORD_VERSION, node: node.to_owned(), by: by.to_owned() }
    }
}

impl Record for GcRequest {
    fn validate(&self) -> Result<(), RecordError> {
        if self.version != RECORD_VERSION {
            return Err(invalid("version", format!("must be {RECORD_VERSION}")));
        }
        check_node_name("node", &self.node)?;
        check_node_name("by", &self.by)
    }
}

/// What makes a write the leader's: its leader key (`leader/<lease id in hex>`, as etcd's
/// election names it) still exists with the create revision of its term.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderFence {
    key: String,
    term: i64,
}

impl LeaderFence {
    /// The fence of the leader that campaigned on `lease` and won at `term`.
    pub fn new(client: &DomainClient, lease: i64, term: i64) -> Self {
        Self { key: format!("{}/{lease:x}", election_name(client.keys())), term }
    }

    /// The term it guards.
    pub fn term(&self) -> i64 {
        self.term
    }

    fn compare(&self) -> Compare {
        Compare::create_revision(self.key.clone(), CompareOp::Equal, self.term)
    }
}

/// Operations a gc puts in one transaction, compares and writes alike: below etcd's
/// default `--max-txn-ops` (128) with room for the compares every one of them carries.
pub const GC_TXN_OPS: usize = 100;

/// Bytes of keys and values a gc puts in one transaction: below etcd's default
/// `--max-request-bytes` (1.5 MiB) with room for the rest of the request. A record is at
/// most [`records::MAX_RECORD_BYTES`] (1 MiB), so one always fits alone.
pub const GC_TXN_BYTES: usize = 1 << 20;

/// One write of a gc: the compare that the record it writes is as read (none for a
/// delete that needs none), the write, and its size (keys and values) in a request.
struct Edit {
    compare: Option<Compare>,
    op: TxnOp,
    bytes: usize,
}

/// Writes of a gc, in order.
#[derive(Default)]
struct Edits(Vec<Edit>);

impl Edits {
    fn push(&mut self, compare: Option<Compare>, op: TxnOp, bytes: usize) {
        self.0.push(Edit { compare, op, bytes });
    }

    fn ops(&self) -> usize {
        self.0.len()
    }

    fn bytes(&self) -> usize {
        self.0.iter().map(|e| e.bytes).sum()
    }

    /// The transaction of these writes, while `standing` and each write's compare hold.
    fn txn(self, standing: &[Compare]) -> Txn {
        let (compares, ops): (Vec<_>, Vec<_>) = self.0.into_iter().map(|e| (e.compare, e.op)).unzip();
        Txn::new()
            .when(standing.iter().cloned().chain(compares.into_iter().flatten()).collect::<Vec<_>>())
            .and_then(ops)
    }

    /// These writes in batches of at most `ops` writes and `bytes` bytes (a write larger
    /// than `bytes` alone in its own), in order.
    fn split(self, ops: usize, bytes: usize) -> Vec<Edits> {
        let mut batches = Vec::new();
        let mut current = Edits::default();
        for edit in self.0 {
            if current.ops() > 0 && (current.ops() + 1 > ops || current.bytes() + edit.bytes > bytes) {
                batches.push(std::mem::take(&mut current));
            }
            current.0.push(edit);
        }
        if current.ops() > 0 {
            batches.push(current);
        }
        batches
    }
}

impl DomainClient {
    /// The gc `fence`'s node queues for the leader (`gc/<node>`); its revision.
    pub async fn request_gc(&self, fence: &Fence, node: &str) -> Result<i64, EtcdError> {
        let record = GcRequest::new(node, self.node());
        self.put_fenced(fence, self.keys().gc_request(node), records::encode(&record)).await
    }

    /// Whether `node` is a live member (its member key exists), as etcd answers now.
    pub async fn is_live(&self, node: &str) -> Result<bool, EtcdError> {
        Ok(self.get_raw(&self.keys().member(node)).await?.is_some())
    }

    /// Whether a gc of `node` is still queued.
    pub async fn gc_pending(&self, node: &str) -> Result<bool, EtcdError> {
        Ok(self.get_raw(&self.keys().gc_request(node)).await?.is_some())
    }

    /// The nodes whose gc is queued (keys only; a key that is no node name is listed as
    /// is, and refused when carried out).
    pub async fn gc_queue(&self) -> Result<Vec<String>, EtcdError> {
        let prefix = self.keys().gc_requests();
        let keys = self.list_keys("gc queue read", &prefix).await?;
        Ok(keys.iter().filter_map(|k| k.strip_prefix(prefix.as_str()).map(str::to_owned)).collect())
    }

    /// The leader's gc of `node`, fenced by `leader`: frees its slot and collects its
    /// placements, topology, shares, partition memberships and queued request, only while
    /// `node` is no live member. One transaction when that fits etcd's limits on one
    /// ([`GC_TXN_OPS`], [`GC_TXN_BYTES`]); otherwise, in transactions that fit: the
    /// partitions that keep other devices rewritten without its devices, while the node
    /// is still no live member and holds the slot as read; then, under the same guard, its
    /// slot and placements; then, while it is still no member and claims no slot, its
    /// shares given back (in batches), the partitions left with no device deleted, and
    /// last its topology and the request (so that a leader taking up an interrupted gc
    /// again still finds its devices). Answers the
    /// slot freed (none when the node held none). `NotLeader` when `leader` no longer
    /// leads, `GcLive` when the node is live (its queued request is then dropped, under
    /// the same fence).
    pub async fn gc_led(&self, leader: &LeaderFence, node: &str) -> Result<Option<u32>, EtcdError> {
        let keys = self.keys().clone();
        let member = keys.member(node);
        let reverse = keys.slot_of(node);
        let no_member = Compare::create_revision(member.clone(), CompareOp::Equal, 0);
        // The node as read: no live member, and its slot claim unchanged.
        let mut standing = vec![leader.compare(), no_member.clone()];
        // Once its slot is freed: still no member, and no slot claimed again.
        let gone = [leader.compare(), no_member, Compare::create_revision(reverse.clone(), CompareOp::Equal, 0)];
        let mut core = Edits::default();
        let placements = keys.placements(node);
        core.push(None, TxnOp::delete(placements.clone(), None), placements.len());
        let slot = match self.get_raw(&reverse).await? {
            Some((value, revision)) => {
                let claim: SlotClaim = self.decode(&reverse, &value)?;
                standing.push(Compare::mod_revision(reverse.clone(), CompareOp::Equal, revision));
                core.push(None, TxnOp::delete(reverse.clone(), None), reverse.len());
                // Only the slot key that names this node (a slot claimed twice by hand
                // stays its holder's).
                let slot_key = keys.slot(claim.slot);
                if let Some((v, r)) = self.get_raw(&slot_key).await?
                    && self.decode::<SlotClaim>(&slot_key, &v).is_ok_and(|c| c.node == node)
                {
                    let compare = Compare::mod_revision(slot_key.clone(), CompareOp::Equal, r);
                    core.push(Some(compare), TxnOp::delete(slot_key.clone(), None), slot_key.len() * 2);
                }
                Some(claim.slot)
            }
            None => {
                standing.push(Compare::create_revision(reverse.clone(), CompareOp::Equal, 0));
                None
            }
        };
        // Its shares go with the slot when one transaction takes them all, else after
        // it. A node that comes back before they went (its member key or a slot claim
        // put: the later batches fail) still holds them; one that comes back after claims
        // the shares it remembers back where they were, or is refused (`ShareLost`) where
        // another host took the range meanwhile: it never serves memory another host was
        // given.
        let shares = self.gc_shares(node).await?;
        // Its topology (which names its devices, for the partitions) and the request go last.
        let mut tail = Edits::default();
        for key in [keys.topology(node), keys.gc_request(node)] {
            tail.push(None, TxnOp::delete(key.clone(), None), key.len());
        }
        let (rewrites, deletes) = self.gc_partitions(node).await?;
        let all = [&core, &shares, &tail, &rewrites, &deletes];
        let mut kv = self.raw();
        if all.iter().map(|e| e.ops()).sum::<usize>() <= GC_TXN_OPS
            && all.iter().map(|e| e.bytes()).sum::<usize>() <= GC_TXN_BYTES
        {
            let mut one = core;
            one.0.extend(shares.0.into_iter().chain(rewrites.0).chain(deletes.0).chain(tail.0));
            if self.call("leader gc", kv.txn(one.txn(&standing))).await?.succeeded() {
                info!(%node, ?slot, term = leader.term, "leader freed a slot and collected the node's records");
                return Ok(slot);
            }
            return Err(self.gc_refused(leader, node).await);
        }
        // More than one transaction takes. A partition that keeps other devices only
        // narrows who may use the node's: rewritten first, while the node is as read (one
        // that comes back meanwhile is in fewer partitions). One left with no device is
        // deleted only once the slot is freed: a client bound to nothing else would
        // otherwise be bound to nothing, which may reach more.
        info!(%node, shares = shares.ops(), rewrites = rewrites.ops(), deletes = deletes.ops(), term = leader.term, "leader gc: more records than one transaction takes; in batches");
        // Its shares go back only once its slot is freed (under `gone`): a node that
        // came back between two share batches would otherwise hold its slot, and serve
        // its regions, in ranges another host was already given.
        let steps = rewrites
            .split(GC_TXN_OPS, GC_TXN_BYTES)
            .into_iter()
            .map(|b| (b, standing.as_slice()))
            .chain(std::iter::once((core, standing.as_slice())))
            .chain(shares.split(GC_TXN_OPS, GC_TXN_BYTES).into_iter().map(|b| (b, gone.as_slice())))
            .chain(deletes.split(GC_TXN_OPS, GC_TXN_BYTES).into_iter().map(|b| (b, gone.as_slice())))
            .chain(std::iter::once((tail, gone.as_slice())));
        for (batch, guard) in steps {
            if !self.call("leader gc", kv.txn(batch.txn(guard))).await?.succeeded() {
                return Err(self.gc_refused(leader, node).await);
            }
        }
        info!(%node, ?slot, term = leader.term, "leader freed a slot and collected the node's records");
        Ok(slot)
    }

    /// Why a transaction of the leader's gc of `node` did not go through: `NotLeader`,
    /// `GcLive` (the queued request dropped under the leader's fence), or `Contention` (a
    /// record changed since it was read; the next probe tries again).
    async fn gc_refused(&self, leader: &LeaderFence, node: &str) -> EtcdError {
        let keys = self.keys();
        match self.leads(leader).await {
            Err(e) => return e,
            Ok(false) => return EtcdError::NotLeader { node: self.node().to_owned(), term: leader.term },
            Ok(true) => {}
        }
        match self.get_raw(&keys.member(node)).await {
            Err(e) => e,
            Ok(Some(_)) => {
                let drop_request =
                    Txn::new().when([leader.compare()]).and_then([TxnOp::delete(keys.gc_request(node), None)]);
                match self.call("leader gc", self.raw().txn(drop_request)).await {
                    Err(e) => e,
                    Ok(_) => EtcdError::GcLive { node: node.to_owned() },
                }
            }
            Ok(None) => EtcdError::Contention { node: node.to_owned(), attempts: 1 },
        }
    }

    /// The share tables `node` holds shares in, rewritten without them (they go back to
    /// the other hosts), each only while it is as read.
    async fn gc_shares(&self, node: &str) -> Result<Edits, EtcdError> {
        let mut edits = Edits::default();
        for (compare, put, bytes) in self.shares_without(node).await?.into_iter().map(crate::shares::release_edit) {
            edits.push(Some(compare), put, bytes);
        }
        Ok(edits)
    }

    /// The partitions naming `node`'s devices, each only while it is as read: those that
    /// keep other devices rewritten without them, then those left with none removed.
    async fn gc_partitions(&self, node: &str) -> Result<(Edits, Edits), EtcdError> {
        let (mut edits, mut deletes) = (Edits::default(), Edits::default());
        let devices = self.node_devices(node).await?;
        if devices.is_empty() {
            return Ok((edits, deletes));
        }
        for (key, record, revision) in self.partitions_naming(&devices).await? {
            let compare = Compare::mod_revision(key.clone(), CompareOp::Equal, revision);
            let kept: Vec<_> = record.devices.iter().filter(|d| !devices.contains(&d.to_string())).cloned().collect();
            if kept.is_empty() {
                deletes.push(Some(compare), TxnOp::delete(key.clone(), None), key.len() * 2);
            } else {
                let value = records::encode(&PartitionRecord { devices: kept, ..record });
                let bytes = key.len() * 2 + value.len();
                edits.push(Some(compare), TxnOp::put(key.clone(), value, None), bytes);
            }
        }
        Ok((edits, deletes))
    }

    /// The leader's sweep of orphans: records (placements, topology, shares) of nodes that
    /// hold no slot and are no live member — left by a gc before it collected them, or put
    /// by hand. Each node's in one transaction fenced by `leader` (in batches that fit
    /// etcd's limits when its shares are many: them first, its placements and topology
    /// last), and only while it still holds no slot and no member key (a node that claims
    /// a slot meanwhile keeps them). A node whose gc is queued is left to that gc.
    /// At most `max` nodes per call; answers the nodes swept. `NotLeader` when `leader` no
    /// longer leads.
    pub async fn sweep_orphans(&self, leader: &LeaderFence, max: usize) -> Result<Vec<String>, EtcdError> {
        let keys = self.keys().clone();
        let slotted = self.node_names(&keys.slot_of("")).await?;
        let live = self.node_names(&keys.members()).await?;
        let mut candidates = self.node_names(&keys.placements("")).await?;
        candidates.extend(self.node_names(&keys.topology("")).await?);
        let (shares, _) = self.read_prefix("shares read", &keys.shares()).await?;
        for e in &shares {
            if let Ok(table) = records::decode::<crate::shares::ShareTable>(e.value(), self.limits()) {
                candidates.extend(table.shares.into_iter().map(|s| s.node));
            }
        }
        // A node whose gc is queued is that gc's to collect: an interrupted one finds its
        // devices in its topology record, which a sweep would take away.
        let queued: std::collections::BTreeSet<String> = self.gc_queue().await?.into_iter().collect();
        let (mut kv, mut swept) = (self.raw(), Vec::new());
        let orphans = candidates.difference(&slotted).filter(|n| !live.contains(*n) && !queued.contains(*n));
        for node in orphans.take(max) {
            let guard = [
                leader.compare(),
                Compare::create_revision(keys.slot_of(node), CompareOp::Equal, 0),
                Compare::create_revision(keys.member(node), CompareOp::Equal, 0),
                Compare::create_revision(keys.gc_request(node), CompareOp::Equal, 0),
            ];
            // Its shares go back first, in batches that fit a transaction; its placements
            // and topology last, so that a sweep cut short finds the node again.
            let shares = self.gc_shares(node).await?;
            let mut tail = Edits::default();
            for key in [keys.placements(node), keys.topology(node)] {
                tail.push(None, TxnOp::delete(key.clone(), None), key.len());
            }
            // One transaction when they all fit (`split` packs them in order).
            let mut all = shares;
            all.0.extend(tail.0);
            let mut done = true;
            for batch in all.split(GC_TXN_OPS, GC_TXN_BYTES) {
                if !self.call("leader sweep", kv.txn(batch.txn(&guard))).await?.succeeded() {
                    done = false;
                    break;
                }
            }
            if done {
                info!(%node, term = leader.term, "leader swept the records of a node that holds no slot");
                swept.push(node.clone());
            } else if !self.leads(leader).await? {
                return Err(EtcdError::NotLeader { node: self.node().to_owned(), term: leader.term });
            }
            // Otherwise the node claimed a slot or joined meanwhile, or its shares changed:
            // left for the next sweep to look at again.
        }
        Ok(swept)
    }

    /// The valid node names under `prefix` (the last part of each key, keys only).
    async fn node_names(&self, prefix: &str) -> Result<std::collections::BTreeSet<String>, EtcdError> {
        let keys = self.list_keys("names read", prefix).await?;
        Ok(keys
            .iter()
            .filter_map(|k| k.strip_prefix(prefix).map(str::to_owned))
            .filter(|n| crate::config::is_valid_name(n))
            .collect())
    }

    /// Drops a queued request by its key's last part (one that names no node), under
    /// `leader`'s fence; whether it was dropped.
    pub async fn drop_gc_request(&self, leader: &LeaderFence, name: &str) -> Result<bool, EtcdError> {
        let txn = Txn::new().when([leader.compare()]).and_then([TxnOp::delete(self.keys().gc_request(name), None)]);
        let mut kv = self.raw();
        Ok(self.call("gc request drop", kv.txn(txn)).await?.succeeded())
    }

    /// Whether `leader`'s key still has its term's create revision.
    async fn leads(&self, leader: &LeaderFence) -> Result<bool, EtcdError> {
        let mut kv = self.raw();
        let response = self.call("leader read", kv.get(leader.key.as_str(), None)).await?;
        Ok(response.kvs().first().is_some_and(|e| e.create_revision() == leader.term))
    }

    /// The devices `node`'s topology record names as its own: not the shared switches, nor
    /// the CXL devices of a pool (other hosts of the pool still serve them), nor a device
    /// another node's topology record names too (a GPU moved to a live node keeps its
    /// partitions: taking it out would unbind, and so widen, that node's tenants).
    /// `Record` when `node`'s own record has a newer build's format: its devices are not
    /// known here, and the gc, which deletes that record last, would leave them in every
    /// partition for good; it waits for a leader that reads the record (or an admin who
    /// removes it by hand). Any other refused record (junk, or one naming another node)
    /// names no devices, as no build would read it either.
    async fn node_devices(&self, node: &str) -> Result<HashSet<String>, EtcdError> {
        let keys = self.keys();
        let (entries, _) = self.read_prefix("topology read", &keys.topologies()).await?;
        let own_key = keys.topology(node);
        let (mut own, mut elsewhere) = (HashSet::new(), HashSet::new());
        for e in &entries {
            if e.key() == own_key.as_bytes() {
                match records::decode::<TopologyRecord>(e.value(), self.limits()) {
                    // A record under its key that names another node names none of its devices.
                    Ok(record) if record.node == node => {
                        own.extend(record.devices.iter().filter(|d| owned(d)).map(|d| d.id.to_string()));
                    }
                    Ok(_) => {}
                    Err(source @ RecordError::WrongVersion { found }) if found > RECORD_VERSION => {
                        return Err(EtcdError::Record { key: own_key, source });
                    }
                    // Not a record any build wrote: it names no devices anyone can know.
                    Err(error) => {
                        warn!(key = %own_key, %error, "gc: the node's topology record is refused; it names no devices")
                    }
                }
                continue;
            }
            // Another node's refused record names no devices that matter here.
            let Ok(record) = records::decode::<TopologyRecord>(e.value(), self.limits()) else { continue };
            elsewhere.extend(record.devices.iter().filter(|d| owned(d)).map(|d| d.id.to_string()));
        }
        own.retain(|d| !elsewhere.contains(d));
        Ok(own)
    }

    /// The partitions that name any of `devices`, with their keys and mod revisions.
    async fn partitions_naming(
        &self,
        devices: &HashSet<String>,
    ) -> Result<Vec<(String, PartitionRecord, i64)>, EtcdError> {
        let (entries, _) = self.read_prefix("partitions read", &self.keys().partitions()).await?;
        Ok(entries
            .iter()
            .filter_map(|e| {
                let record = records::decode::<PartitionRecord>(e.value(), self.limits()).ok()?;
                let key = std::str::from_utf8(e.key()).ok()?.to_owned();
                record.devices.iter().any(|d| devices.contains(&d.to_string())).then_some((
                    key,
                    record,
                    e.mod_revision(),
                ))
            })
            .collect())
    }
}

/// Whether a topology record's device is its node's own: not a shared switch, nor a CXL
/// device of a pool (other hosts of the pool still serve it).
fn owned(device: &crate::topology::TopologyDevice) -> bool {
    !device.fabric && !crate::domain_fabric::pooled(device)
}
