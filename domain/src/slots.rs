//! Slot claims: one etcd key per slot, claimed by compare-and-swap, never freed but by an
//! admin.
//!
//! A claim is one transaction: if neither `slots/<n>` nor `slot-of/<node>` was ever
//! created, put both (without a lease, so the slot outlives the daemon). A node that
//! already holds a slot gets it back. Each node starts its search at a hash of its name, so
//! nodes starting together mostly try different slots; a lost race means another node
//! took a slot, so the retries are bounded by the number of claimers, not a storm.

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use tracing::info;

use crate::etcd::{DomainClient, EtcdError};
use crate::records::{self, DomainSettings, SlotClaim};

/// Most claim transactions one call tries before it gives up.
pub const MAX_CLAIM_ATTEMPTS: u32 = 64;

impl DomainClient {
    /// The slot this node holds, claiming the first free one (from a hash of its name) if it
    /// holds none.
    pub async fn claim_slot(&self, settings: &DomainSettings) -> Result<u32, EtcdError> {
        self.claim_slot_counted(settings).await.map(|(slot, _)| slot)
    }

    /// [`DomainClient::claim_slot`], also answering how many claim transactions it sent
    /// (0 when the node already held a slot): what a test of concurrent starts counts.
    pub async fn claim_slot_counted(&self, settings: &DomainSettings) -> Result<(u32, u32), EtcdError> {
        let node = self.node().to_owned();
        let count = settings.slot_count();
        let reverse = self.keys().slot_of(&node);
        for attempt in 0..MAX_CLAIM_ATTEMPTS {
            if let Some(slot) = self.held_slot(&node).await? {
                return Ok((slot, attempt));
            }
            let taken = self.taken_slots().await?;
            let start = name_hash(&node) % u64::from(count);
            let free = (0..u64::from(count))
                .map(|i| (start + i) % u64::from(count))
                .filter_map(|s| u32::try_from(s).ok())
                .find(|s| taken.binary_search(s).is_err());
            let Some(slot) = free else {
                return Err(EtcdError::DomainFull { count });
            };
            let key = self.keys().slot(slot);
            let claim = records::encode(&SlotClaim::new(slot, &node));
            let txn = Txn::new()
                .when([
                    Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                    Compare::create_revision(reverse.clone(), CompareOp::Equal, 0),
                ])
                .and_then([TxnOp::put(key, claim.clone(), None), TxnOp::put(reverse.clone(), claim, None)]);
            let mut kv = self.raw();
            if self.call("slot claim", kv.txn(txn)).await?.succeeded() {
                info!(%node, slot, attempts = attempt + 1, "claimed a slot");
                return Ok((slot, attempt + 1));
            }
        }
        Err(EtcdError::Contention { node, attempts: MAX_CLAIM_ATTEMPTS })
    }

    /// Claims exactly `slot` for this node, which served it (a rejoin: its memory lies
    /// there): the slot it holds if that is the one; else `slot` again if an admin's gc
    /// freed it and nobody took it since; else [`EtcdError::SlotCollected`] saying who
    /// holds it now.
    pub async fn claim_slot_at(&self, slot: u32) -> Result<u32, EtcdError> {
        let node = self.node().to_owned();
        let collected = |now: String| EtcdError::SlotCollected { node: node.clone(), slot, now };
        if let Some(held) = self.held_slot(&node).await? {
            return if held == slot { Ok(slot) } else { Err(collected(format!("this node holds slot {held} now"))) };
        }
        let key = self.keys().slot(slot);
        let reverse = self.keys().slot_of(&node);
        let claim = records::encode(&SlotClaim::new(slot, &node));
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                Compare::create_revision(reverse.clone(), CompareOp::Equal, 0),
            ])
            .and_then([TxnOp::put(key.clone(), claim.clone(), None), TxnOp::put(reverse, claim, None)]);
        let mut kv = self.raw();
        if self.call("slot claim", kv.txn(txn)).await?.succeeded() {
            info!(%node, slot, "claimed the slot it served back after a gc");
            return Ok(slot);
        }
        let holder = match self.get_raw(&key).await? {
            Some((value, _)) => {
                self.decode::<SlotClaim>(&key, &value).map_or_else(|_| "an unreadable claim".to_owned(), |c| c.node)
            }
            None => "nobody, after a race".to_owned(),
        };
        Err(collected(format!("now held by {holder}")))
    }

    /// The slot `node` holds, checked against the slot's own key; `None` when it holds none.
    pub async fn held_slot(&self, node: &str) -> Result<Option<u32>, EtcdError> {
        let reverse = self.keys().slot_of(node);
        let (Some((value, _)), at) = self.get_raw_at(&reverse, None).await? else {
            return Ok(None);
        };
        let claim: SlotClaim = self.decode(&reverse, &value)?;
        self.check_claim(node, &claim, at).await?;
        Ok(Some(claim.slot))
    }

    /// Admin: frees the slot of `node`, which must not be a live member. Its GFAs may then
    /// be given to another node, and the shares of shared memory it held to other hosts.
    /// Returns the slot freed, `None` when it held none.
    pub async fn gc_slot(&self, node: &str) -> Result<Option<u32>, EtcdError> {
        let reverse = self.keys().slot_of(node);
        let (Some((value, revision)), at) = self.get_raw_at(&reverse, None).await? else {
            return Ok(None);
        };
        let claim: SlotClaim = self.decode(&reverse, &value)?;
        let slot_revision = self.check_claim(node, &claim, at).await?;
        let member = self.keys().member(node);
        let slot_key = self.keys().slot(claim.slot);
        // Its shares of shared memory are released in the same transaction.
        let (share_compares, share_ops) = crate::shares::release_ops(self.shares_without(node).await?);
        let txn = Txn::new()
            .when(
                [
                    Compare::create_revision(member.clone(), CompareOp::Equal, 0),
                    Compare::mod_revision(reverse.clone(), CompareOp::Equal, revision),
                    // The slot key as checked: one changed since (by hand) is not deleted.
                    Compare::mod_revision(slot_key.clone(), CompareOp::Equal, slot_revision),
                ]
                .into_iter()
                .chain(share_compares)
                .collect::<Vec<_>>(),
            )
            .and_then(
                [
                    TxnOp::delete(slot_key, None),
                    TxnOp::delete(reverse, None),
                    // Its placements lay in the slot: they go with it.
                    TxnOp::delete(self.keys().placements(node), None),
                ]
                .into_iter()
                .chain(share_ops)
                .collect::<Vec<_>>(),
            );
        let mut kv = self.raw();
        if self.call("slot gc", kv.txn(txn)).await?.succeeded() {
            info!(%node, slot = claim.slot, "freed a slot");
            return Ok(Some(claim.slot));
        }
        // Either the node is live, or its claim changed under us (another gc): say which.
        if self.get_raw(&member).await?.is_some() {
            Err(EtcdError::GcLive { node: node.to_owned() })
        } else {
            Err(EtcdError::Contention { node: node.to_owned(), attempts: 1 })
        }
    }

    /// Checks that `slot-of/<node>`'s claim, read at revision `at`, names `node` and that
    /// `slots/<n>` agrees at that same revision (a gc between two reads at different
    /// revisions would read as `Inconsistent`, which stops a start). Answers the slot
    /// key's mod revision.
    async fn check_claim(&self, node: &str, claim: &SlotClaim, at: i64) -> Result<i64, EtcdError> {
        let inconsistent = |holder: String| EtcdError::Inconsistent { node: node.to_owned(), slot: claim.slot, holder };
        if claim.node != node {
            return Err(inconsistent(format!("{} (by slot-of/{node} itself)", claim.node)));
        }
        let key = self.keys().slot(claim.slot);
        match self.get_raw_at(&key, Some(at)).await?.0 {
            None => Err(inconsistent("nobody".to_owned())),
            Some((value, revision)) => {
                let holder: SlotClaim = self.decode(&key, &value)?;
                if holder.node == node && holder.slot == claim.slot {
                    Ok(revision)
                } else {
                    Err(inconsistent(holder.node))
                }
            }
        }
    }

    /// Every claimed slot number, sorted (keys that are not slot keys are ignored: the
    /// claim transaction compares the real key anyway).
    async fn taken_slots(&self) -> Result<Vec<u32>, EtcdError> {
        let keys = self.list_keys("slots read", &self.keys().slots()).await?;
        let mut taken: Vec<u32> = keys.iter().filter_map(|k| self.keys().parse_slot_key(k.as_bytes())).collect();
        taken.sort_unstable();
        Ok(taken)
    }
}

/// FNV-1a of a node name: stable across builds and platforms (unlike `DefaultHasher`).
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::name_hash;
    use crate::records::{DataPathKind, DomainSettings, RecordLimits, SlotClaim};
    use crate::{DomainClient, testing};

    /// A gc that lands between the read of `slot-of/<node>` and that of `slots/<n>` does
    /// not make the claim read as inconsistent (which stops a start): the second read is
    /// at the first one's revision. Before, it read `slots/<n>` now: gone, "nobody".
    #[tokio::test]
    async fn a_claim_is_checked_at_the_revision_it_was_read() {
        let Some(etcd) = testing::etcd_or_skip().await else { return };
        let c = DomainClient::connect(&testing::config(etcd.endpoint(), "tray-r", 6), RecordLimits::default())
            .await
            .unwrap();
        let settings = DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile]);
        let slot = c.claim_slot(&settings).await.unwrap();
        let reverse = c.keys().slot_of("tray-r");
        let (Some((value, _)), at) = c.get_raw_at(&reverse, None).await.unwrap() else { panic!("no claim") };
        let claim: SlotClaim = c.decode(&reverse, &value).unwrap();
        assert_eq!(claim.slot, slot);
        assert_eq!(c.gc_slot("tray-r").await.unwrap(), Some(slot));
        assert!(c.check_claim("tray-r", &claim, at).await.unwrap() > 0);
        assert_eq!(c.held_slot("tray-r").await.unwrap(), None, "held no more, as read now");
    }

    #[test]
    fn the_name_hash_is_fnv1a() {
        assert_eq!(name_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(name_hash("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
