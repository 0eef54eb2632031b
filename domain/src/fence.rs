//! Fenced writes: every etcd write of a node is guarded by its own member key, so a node
//! whose membership expired (a zombie: hung past its TTL, or cut off from etcd) cannot
//! write.
//!
//! A [`Fence`] pins one membership: the member key, the lease it lives on and the key's
//! create revision (which a rejoin, even under the same lease, changes). A fenced write is
//! one transaction: if the member key still has that create revision and that lease, do
//! the write; otherwise read the member key to say why. A fence whose lease is already
//! known lost refuses locally, without asking etcd: the node fences itself before its TTL
//! ends.

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use tokio::sync::watch;

use crate::etcd::{DomainClient, EtcdError};
use crate::lease::{Acked, Lease, LeaseState};
use crate::records::{self, MemberRecord};

/// One membership of this node: what its writes are guarded by.
#[derive(Debug, Clone)]
pub struct Fence {
    node: String,
    member_key: String,
    lease: i64,
    incarnation: u64,
    create_revision: i64,
    state: watch::Receiver<LeaseState>,
    acked: Acked,
}

impl Fence {
    /// The node.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The lease the member key lives on.
    pub fn lease(&self) -> i64 {
        self.lease
    }

    /// The membership's incarnation.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The member key's create revision: the fencing token (it grows with every join).
    pub fn token(&self) -> i64 {
        self.create_revision
    }

    /// `Ok` unless the lease is already known lost, or its deadline passed on the boot
    /// clock (no request to etcd).
    pub fn check(&self) -> Result<(), EtcdError> {
        match &*self.state.borrow() {
            LeaseState::Alive => match self.acked.overdue_reason() {
                None => Ok(()),
                Some(why) => Err(self.fenced(format!("lease {:#x}: {why}", self.lease))),
            },
            LeaseState::Lost(reason) => Err(self.fenced(format!("lease {:#x} is lost: {reason}", self.lease))),
        }
    }

    pub(crate) fn fenced(&self, reason: String) -> EtcdError {
        EtcdError::Fenced { node: self.node.clone(), incarnation: self.incarnation, reason }
    }

    /// The compares that hold while this membership does.
    pub(crate) fn compares(&self) -> [Compare; 2] {
        [
            Compare::create_revision(self.member_key.clone(), CompareOp::Equal, self.create_revision),
            Compare::lease(self.member_key.clone(), CompareOp::Equal, self.lease),
        ]
    }
}

impl DomainClient {
    /// Joins the domain (see [`DomainClient::join`]) and returns the fence of this
    /// membership.
    pub async fn join_fenced(&self, lease: &Lease, record: &MemberRecord) -> Result<Fence, EtcdError> {
        self.join(lease, record).await?;
        self.fence(lease, record).await
    }

    /// [`DomainClient::join_in_slot`], and the fence of this membership.
    pub async fn join_fenced_in_slot(
        &self,
        lease: &Lease,
        record: &MemberRecord,
        slot: u32,
    ) -> Result<Fence, EtcdError> {
        self.join_in_slot(lease, record, slot).await?;
        self.fence(lease, record).await
    }

    /// The fence of this node's current membership: its member key must hold `record`'s
    /// incarnation on `lease` (else `Fenced`).
    pub async fn fence(&self, lease: &Lease, record: &MemberRecord) -> Result<Fence, EtcdError> {
        let key = self.keys().member(self.node());
        let mut kv = self.raw();
        let response = self.call("member read", kv.get(key.clone(), None)).await?;
        let mut fence = Fence {
            node: self.node().to_owned(),
            member_key: key.clone(),
            lease: lease.id(),
            incarnation: record.incarnation,
            create_revision: 0,
            state: lease.watch(),
            acked: lease.acked(),
        };
        let Some(entry) = response.kvs().first() else {
            return Err(fence.fenced("the member key is absent".to_owned()));
        };
        let held: MemberRecord = self.decode(&key, entry.value())?;
        if held.incarnation != record.incarnation || entry.lease() != lease.id() {
            let reason = format!("the member key holds incarnation {} on lease {:#x}", held.incarnation, entry.lease());
            return Err(fence.fenced(reason));
        }
        fence.create_revision = entry.create_revision();
        fence.check()?;
        Ok(fence)
    }

    /// Puts `value` at `key` (no lease) if `fence`'s membership still holds; returns the
    /// write's revision.
    pub async fn put_fenced(
        &self,
        fence: &Fence,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
    ) -> Result<i64, EtcdError> {
        self.fenced_txn(fence, "fenced put", TxnOp::put(key, value, None)).await
    }

    /// Deletes `key` if `fence`'s membership still holds; returns the write's revision.
    pub async fn delete_fenced(&self, fence: &Fence, key: impl Into<Vec<u8>>) -> Result<i64, EtcdError> {
        self.fenced_txn(fence, "fenced delete", TxnOp::delete(key, None)).await
    }

    /// `Ok` while `fence`'s membership holds in etcd (its member key, with its create
    /// revision and lease), else `Fenced` saying why: what tells a transaction that failed
    /// on its fence from one that met contention.
    pub(crate) async fn membership_holds(&self, fence: &Fence) -> Result<(), EtcdError> {
        let mut kv = self.raw();
        let response = self.call("member read", kv.get(fence.member_key.clone(), None)).await?;
        match response.kvs().first() {
            None => Err(fence.fenced("the member key is gone (the lease expired or was revoked)".to_owned())),
            Some(e) if e.create_revision() == fence.create_revision && e.lease() == fence.lease => Ok(()),
            Some(e) => Err(fence.fenced(format!("the member key was put again, on lease {:#x}", e.lease()))),
        }
    }

    async fn fenced_txn(&self, fence: &Fence, op: &'static str, write: TxnOp) -> Result<i64, EtcdError> {
        fence.check()?;
        let txn =
            Txn::new().when(fence.compares()).and_then([write]).or_else([TxnOp::get(fence.member_key.clone(), None)]);
        let mut kv = self.raw();
        let response = self.call(op, kv.txn(txn)).await?;
        let revision = response.header().map_or(0, |h| h.revision());
        if response.succeeded() {
            return Ok(revision);
        }
        let held = response.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(get) => get.kvs().first().map(|e| (e.value().to_vec(), e.lease())),
            _ => None,
        });
        let reason = match held {
            None => "the member key is gone (the lease expired or was revoked)".to_owned(),
            Some((value, lease)) => match records::decode::<MemberRecord>(&value, self.limits()) {
                Ok(record) => format!("the member key holds incarnation {} on lease {lease:#x}", record.incarnation),
                Err(error) => format!("the member key holds a refused record: {error}"),
            },
        };
        Err(fence.fenced(reason))
    }
}
