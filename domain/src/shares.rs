//! Shares of memory that several hosts reach (a CXL device of a pool, a multi-headed one):
//! one etcd table per shared resource lists which node may allocate which DPA range of it.
//!
//! Each host commits its own regions over the same device, so without a division two hosts
//! could hand out the same DPAs. A node claims its share once, by compare-and-swap on the
//! table's revision (the first free aligned range that fits), without a lease: like a slot,
//! a share outlives restarts and deaths (the regions in it keep their DPAs) and is released
//! only with the node's slot by an admin's gc. A node that already holds a share gets it
//! back whatever it asks now, grown in place where it asks more and the room after it is
//! free (never moved or shrunk); a table whose capacity differs from the node's is refused
//! with both values.

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::etcd::{DomainClient, EtcdError};
use crate::fence::Fence;
use crate::records::{
    self, MAX_OWNER_LEN, RECORD_VERSION, Record, RecordError, check_node_name, invalid, is_token_byte,
};
use crate::slots::MAX_CLAIM_ATTEMPTS;

/// Most shares one resource's table lists (heads of a multi-headed device, hosts of a pool).
pub const MAX_SHARES: usize = 256;

/// Most shares claimed in one transaction when each names its offset: a compare and a
/// write each, well below etcd's default `--max-txn-ops` (128).
pub const CLAIM_BATCH: usize = 60;

/// One node's share of a resource: `[offset, offset + len)` of its DPAs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Share {
    /// The node.
    pub node: String,
    /// First DPA of the share in the resource.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A share to claim: `len` bytes of `resource`, which has `capacity` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareWant {
    /// `<device id>/<kind><ordinal>`.
    pub resource: String,
    /// The resource's bytes as this node sees them.
    pub capacity: u64,
    /// The share's bytes.
    pub len: u64,
    /// Where this node held the share before (remembered across its restarts and
    /// rejoins): the share is claimed back there or refused ([`EtcdError::ShareLost`]),
    /// never moved, since the node's regions lie in it. `None`: anywhere free.
    pub at: Option<u64>,
    /// Bytes the node would rather hold than `len` (its configuration now asks more than
    /// the share it holds): the share grows in place to them where the range right after
    /// it is free, else it keeps `len` bytes (logged with who holds the room). Never moves
    /// or shrinks a share. `None`: `len`.
    pub grow_to: Option<u64>,
}

/// The lowest offset aligned to `align` where each table has room for its length.
fn lowest_common_fit(tables: &[(&ShareTable, u64)], align: u64) -> Option<u64> {
    let mut candidates: Vec<u64> = std::iter::once(0)
        .chain(tables.iter().flat_map(|(t, _)| t.ends()))
        .filter_map(|c| c.checked_next_multiple_of(align))
        .collect();
    candidates.sort_unstable();
    candidates.into_iter().find(|&o| tables.iter().all(|(t, len)| t.fits_at(o, *len)))
}

/// Where the shares of `open` (each table with the bytes wanted of it) start together: a
/// held share's offset (`held`) where it fits each, else the lowest common fit; `None`
/// when `open` is empty; [`EtcdError::ShareFull`] when no offset fits.
fn common_offset(open: &[(&ShareTable, u64)], held: &[u64], align: u64) -> Result<Option<u64>, EtcdError> {
    let Some(&(first, first_len)) = open.first() else { return Ok(None) };
    let fits = |o: u64| open.iter().all(|(t, len)| t.fits_at(o, *len));
    if let Some(o) =
        held.iter().copied().find(|&o| o.is_multiple_of(align) && fits(o)).or_else(|| lowest_common_fit(open, align))
    {
        return Ok(Some(o));
    }
    let (t, len) =
        open.iter().copied().find(|(t, len)| t.first_fit(*len, align).is_none()).unwrap_or((first, first_len));
    let free = t.capacity - t.shares.iter().map(|s| s.len).sum::<u64>();
    Err(EtcdError::ShareFull { resource: t.resource.clone(), len, free })
}

/// The shares of one resource, at `shares/<resource>`, sorted by offset and disjoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareTable {
    /// Format version ([`RECORD_VERSION`]).
    pub version: u32,
    /// The resource: `<device id>/<kind><ordinal>` (`serial:cxl/0x…/cxl_volatile0`).
    pub resource: String,
    /// Its bytes, as the first claimer saw them.
    pub capacity: u64,
    /// The shares, by offset.
    pub shares: Vec<Share>,
}

impl ShareTable {
    /// An empty table.
    pub fn new(resource: &str, capacity: u64) -> Self {
        Self { version: RECORD_VERSION, resource: resource.to_owned(), capacity, shares: Vec::new() }
    }

    /// The share `node` holds.
    pub fn of(&self, node: &str) -> Option<&Share> {
        self.shares.iter().find(|s| s.node == node)
    }

    /// Whether `[offset, offset + len)` lies in the resource and overlaps no share.
    pub fn fits_at(&self, offset: u64, len: u64) -> bool {
        self.fits_besides(None, offset, len)
    }

    /// Who holds (part of) `[offset, offset + len)`: the nodes, or why nobody does.
    pub fn holders(&self, offset: u64, len: u64) -> String {
        let end = offset.saturating_add(len);
        let nodes: Vec<&str> = self
            .shares
            .iter()
            .filter(|s| s.offset < end && offset < s.offset.saturating_add(s.len))
            .map(|s| s.node.as_str())
            .collect();
        if nodes.is_empty() {
            format!("nobody (the range is not within the resource's {:#x} bytes)", self.capacity)
        } else {
            nodes.join(", ")
        }
    }

    /// Where shares end: with 0, the candidates for the lowest offset that fits.
    fn ends(&self) -> impl Iterator<Item = u64> + '_ {
        self.shares.iter().map(|s| s.offset + s.len)
    }

    /// The lowest offset aligned to `align` (a power of two) where `len` bytes fit between
    /// the shares.
    pub fn first_fit(&self, len: u64, align: u64) -> Option<u64> {
        lowest_common_fit(&[(self, len)], align)
    }

    /// Whether `node`'s share could be `len` bytes at `offset`: in the resource and
    /// overlapping no other node's share.
    pub fn fits_for(&self, node: &str, offset: u64, len: u64) -> bool {
        self.fits_besides(Some(node), offset, len)
    }

    /// Whether `[offset, offset + len)` lies in the resource and overlaps no share but
    /// `except`'s.
    fn fits_besides(&self, except: Option<&str>, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| len > 0 && end <= self.capacity)
            && self
                .shares
                .iter()
                .filter(|s| Some(s.node.as_str()) != except)
                .all(|s| s.offset + s.len <= offset || offset + len <= s.offset)
    }

    /// Makes `node`'s share `len` bytes long, where it starts (checked with
    /// [`ShareTable::fits_for`]).
    fn resize(&mut self, node: &str, len: u64) {
        if let Some(s) = self.shares.iter_mut().find(|s| s.node == node) {
            s.len = len;
        }
    }

    /// Adds `node`'s share at `offset` (found by [`ShareTable::first_fit`]), keeping the order.
    pub fn insert(&mut self, node: &str, offset: u64, len: u64) {
        let at = self.shares.partition_point(|s| s.offset < offset);
        self.shares.insert(at, Share { node: node.to_owned(), offset, len });
    }

    fn check(&self) -> Result<(), RecordError> {
        check_resource(&self.resource)?;
        if self.capacity == 0 {
            return Err(invalid("capacity", "is zero".into()));
        }
        if self.shares.len() > MAX_SHARES {
            return Err(invalid("shares", format!("{} entries, more than {MAX_SHARES}", self.shares.len())));
        }
        let mut end = 0u64;
        for (i, s) in self.shares.iter().enumerate() {
            check_node_name("shares.node", &s.node)?;
            let stop = s.offset.checked_add(s.len).filter(|&e| s.len > 0 && e <= self.capacity).ok_or_else(|| {
                invalid(
                    "shares",
                    format!("{}'s share {:#x}+{:#x} is empty or outside the capacity", s.node, s.offset, s.len),
                )
            })?;
            if s.offset < end {
                return Err(invalid(
                    "shares",
                    format!("{}'s share overlaps the one before it or is out of order", s.node),
                ));
            }
            if self.shares[..i].iter().any(|o| o.node == s.node) {
                return Err(invalid("shares", format!("{} holds two shares", s.node)));
            }
            end = stop;
        }
        Ok(())
    }
}

impl Record for ShareTable {
    fn validate(&self) -> Result<(), RecordError> {
        self.check()
    }
}

/// Checks a resource name: 1 to [`MAX_OWNER_LEN`] of `[A-Za-z0-9._:-/]`, no empty path
/// component and no `.`/`..` one.
pub fn check_resource(resource: &str) -> Result<(), RecordError> {
    let ok = !resource.is_empty()
        && resource.len() <= MAX_OWNER_LEN
        && resource.bytes().all(|b| is_token_byte(b) || b == b'/')
        && resource.split('/').all(|c| !c.is_empty() && c != "." && c != "..");
    if ok {
        Ok(())
    } else {
        Err(invalid("resource", format!("{:?} is not a resource name", resource.chars().take(80).collect::<String>())))
    }
}

impl DomainClient {
    /// The share of `resource` (of `capacity` bytes) this node holds, claiming the first
    /// free range of `len` bytes aligned to `align` (a power of two) when it holds none.
    pub async fn claim_share(&self, resource: &str, capacity: u64, len: u64, align: u64) -> Result<Share, EtcdError> {
        let wants = [ShareWant { resource: resource.to_owned(), capacity, len, at: None, grow_to: None }];
        let mut shares = self.claim_shares(&wants, align).await?;
        shares.pop().ok_or_else(|| EtcdError::Contention { node: self.node().to_owned(), attempts: 0 })
    }

    /// This node's shares of several resources (the members of an interleave set stripe
    /// at one DPA on each, so their shares must start alike): the ones it holds are kept;
    /// the others are claimed together, in one transaction: each one with an
    /// [`at`](ShareWant::at) there, the rest at the lowest offset aligned to `align` that
    /// is free in each of their tables (a held share's offset first). A held share, or
    /// one claimed back, grows in place to its [`grow_to`](ShareWant::grow_to) where the
    /// room after it is free. A share held or wanted back elsewhere than its `at`, or
    /// whose range another node took meanwhile, is [`EtcdError::ShareLost`]. Answers in
    /// the order of `wants`. Wants that each name their offset (a node claiming back what
    /// it held) need no common one: more than [`CLAIM_BATCH`] of them are claimed in
    /// batches of that many, within etcd's limits on one transaction (an earlier batch
    /// stays claimed when a later one is refused).
    pub async fn claim_shares(&self, wants: &[ShareWant], align: u64) -> Result<Vec<Share>, EtcdError> {
        self.claim_shares_as(None, wants, align).await
    }

    /// [`DomainClient::claim_shares`] while `fence`'s membership holds: each transaction
    /// compares the member key too, so a node whose lease ran out meanwhile (and whose
    /// slot and shares a gc may have given back) claims nothing — `Fenced` instead of
    /// shares held by a node with no slot.
    pub async fn claim_shares_fenced(
        &self,
        fence: &Fence,
        wants: &[ShareWant],
        align: u64,
    ) -> Result<Vec<Share>, EtcdError> {
        self.claim_shares_as(Some(fence), wants, align).await
    }

    async fn claim_shares_as(
        &self,
        fence: Option<&Fence>,
        wants: &[ShareWant],
        align: u64,
    ) -> Result<Vec<Share>, EtcdError> {
        // Checked whole, before any batch: a resource asked for twice is refused even
        // when its two asks would fall in different batches.
        for (i, w) in wants.iter().enumerate() {
            let refused = |source| EtcdError::Record { key: w.resource.clone(), source };
            check_resource(&w.resource).map_err(refused)?;
            if wants[..i].iter().any(|o| o.resource == w.resource) {
                return Err(refused(invalid("resource", "asked for twice".into())));
            }
        }
        if wants.len() <= CLAIM_BATCH || wants.iter().any(|w| w.at.is_none()) {
            return self.claim_shares_at_once(fence, wants, align).await;
        }
        let mut shares = Vec::with_capacity(wants.len());
        for batch in wants.chunks(CLAIM_BATCH) {
            shares.extend(self.claim_shares_at_once(fence, batch, align).await?);
        }
        Ok(shares)
    }

    /// [`DomainClient::claim_shares`] in one transaction (`wants` checked).
    async fn claim_shares_at_once(
        &self,
        fence: Option<&Fence>,
        wants: &[ShareWant],
        align: u64,
    ) -> Result<Vec<Share>, EtcdError> {
        let node = self.node().to_owned();
        let align = align.max(1).next_power_of_two();
        for attempt in 0..MAX_CLAIM_ATTEMPTS {
            let mut tables = Vec::with_capacity(wants.len());
            // Per want: the length a held share grows to, or a share claimed back takes.
            let mut lens: Vec<Option<u64>> = Vec::with_capacity(wants.len());
            for w in wants {
                let key = self.keys().share(&w.resource);
                let (table, compare) = match self.get_raw(&key).await? {
                    Some((value, revision)) => {
                        let table: ShareTable = self.decode(&key, &value)?;
                        (table, Compare::mod_revision(key.clone(), CompareOp::Equal, revision))
                    }
                    None => (
                        ShareTable::new(&w.resource, w.capacity),
                        Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                    ),
                };
                if table.resource != w.resource || table.capacity != w.capacity {
                    return Err(EtcdError::ShareMismatch {
                        resource: w.resource.clone(),
                        domain: format!("{} of {} bytes", table.resource, table.capacity),
                        local: format!("{} bytes", w.capacity),
                    });
                }
                let len = match table.of(&node) {
                    Some(held) => {
                        if let Some(at) = w.at.filter(|&at| at != held.offset) {
                            return Err(lost(w, at, format!("this node's share at {:#x}", held.offset)));
                        }
                        grown(&table, &node, held, w)
                    }
                    None => match w.at {
                        Some(at) => match w.grow_to.filter(|&g| g > w.len && table.fits_at(at, g)) {
                            Some(g) => Some(g),
                            None if table.fits_at(at, w.len) => Some(w.len),
                            None => return Err(lost(w, at, table.holders(at, w.len))),
                        },
                        None => None,
                    },
                };
                lens.push(len);
                tables.push((key, table, compare));
            }
            let mine = |tables: &[(String, ShareTable, Compare)]| -> Vec<Share> {
                tables.iter().filter_map(|(_, t, _)| t.of(&node).cloned()).collect()
            };
            let grows = tables.iter().zip(&lens).any(|((_, t, _), len)| t.of(&node).is_some() && len.is_some());
            if !grows && tables.iter().all(|(_, t, _)| t.of(&node).is_some()) {
                return Ok(mine(&tables));
            }
            let held: Vec<u64> = tables.iter().filter_map(|(_, t, _)| t.of(&node).map(|s| s.offset)).collect();
            let open: Vec<(&ShareTable, u64)> = tables
                .iter()
                .zip(wants)
                .filter(|((_, t, _), w)| t.of(&node).is_none() && w.at.is_none())
                .map(|((_, t, _), w)| (t, w.len))
                .collect();
            // Where the shares without an `at` go (none: every share claimed is claimed back).
            let common = common_offset(&open, &held, align)?;
            let mut compares = Vec::new();
            let mut puts = Vec::new();
            for (((key, table, compare), w), len) in tables.iter_mut().zip(wants).zip(&lens) {
                if table.of(&node).is_some() {
                    // Held: written only when it grows.
                    let Some(len) = *len else { continue };
                    table.resize(&node, len);
                } else {
                    // Not held: claimed back at its `at`, or one of `open`, which has `common`.
                    let Some(at) = w.at.or(common) else { continue };
                    table.insert(&node, at, len.unwrap_or(w.len));
                }
                if table.validate().is_err() {
                    // Too many shares: the table would not decode on any node.
                    return Err(EtcdError::ShareFull { resource: w.resource.clone(), len: w.len, free: 0 });
                }
                compares.push(compare.clone());
                puts.push(TxnOp::put(key.clone(), records::encode(table), None));
            }
            if let Some(fence) = fence {
                fence.check()?;
                compares.extend(fence.compares());
            }
            let mut kv = self.raw();
            if !self.call("share claim", kv.txn(Txn::new().when(compares).and_then(puts))).await?.succeeded() {
                if let Some(fence) = fence {
                    self.membership_holds(fence).await?;
                }
                continue;
            }
            info!(%node, resources = wants.len(), offset = ?common, back = wants.iter().any(|w| w.at.is_some()), grown = grows, attempts = attempt + 1, "claimed shares");
            return Ok(mine(&tables));
        }
        Err(EtcdError::Contention { node, attempts: MAX_CLAIM_ATTEMPTS })
    }

    /// The share tables that list `node`, with `node`'s share taken out, their keys and
    /// mod revisions: what a gc of the node puts back, in its own transaction (tables
    /// refused by the decoder are logged and left alone).
    pub(crate) async fn shares_without(&self, node: &str) -> Result<Vec<(String, ShareTable, i64)>, EtcdError> {
        let (entries, _) = self.read_prefix("shares read", &self.keys().shares()).await?;
        Ok(entries
            .iter()
            .filter_map(|e| {
                let key = std::str::from_utf8(e.key()).ok()?.to_owned();
                let mut table: ShareTable = self.decode(&key, e.value()).ok()?;
                let before = table.shares.len();
                table.shares.retain(|s| s.node != node);
                (table.shares.len() < before).then_some((key, table, e.mod_revision()))
            })
            .collect())
    }
}

/// The length `held` grows to for `want` (its [`grow_to`](ShareWant::grow_to), where the
/// room after it is free in `table`), or `None`: it stays as it is (logged when it was
/// asked to grow, or asked another size than it has).
fn grown(table: &ShareTable, node: &str, held: &Share, want: &ShareWant) -> Option<u64> {
    let resource = &want.resource;
    match want.grow_to.filter(|&g| g > held.len) {
        Some(to) if table.fits_for(node, held.offset, to) => Some(to),
        Some(to) => {
            let room = table.holders(held.offset + held.len, to - held.len);
            warn!(%node, %resource, held = held.len, asked = to, holder = %room, "the share cannot grow in place: keeping its size");
            None
        }
        None => {
            if held.len != want.len {
                warn!(%node, %resource, held = held.len, asked = want.len, "keeping the share held; a smaller size needs a gc of the node");
            }
            None
        }
    }
}

/// [`EtcdError::ShareLost`] for `want`, wanted back at `at`, where `holder` is now.
fn lost(want: &ShareWant, at: u64, holder: String) -> EtcdError {
    EtcdError::ShareLost { resource: want.resource.clone(), offset: at, len: want.len, holder }
}

/// The compares and puts that take a node's shares out of `tables` ([`DomainClient::shares_without`]),
/// for a gc's transaction.
pub(crate) fn release_ops(tables: Vec<(String, ShareTable, i64)>) -> (Vec<Compare>, Vec<TxnOp>) {
    tables.into_iter().map(release_edit).map(|(compare, put, _)| (compare, put)).unzip()
}

/// One table of [`release_ops`]: that it is as read, its put, and the bytes of its key
/// and value in a request.
pub(crate) fn release_edit((key, table, revision): (String, ShareTable, i64)) -> (Compare, TxnOp, usize) {
    let value = records::encode(&table);
    let bytes = key.len() * 2 + value.len();
    (Compare::mod_revision(key.clone(), CompareOp::Equal, revision), TxnOp::put(key, value, None), bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    #[test]
    fn first_fit_fills_holes_in_order_and_respects_alignment() {
        let mut t = ShareTable::new("serial:cxl/0x1/cxl_volatile0", 8 * G);
        assert_eq!(t.first_fit(2 * G, G), Some(0));
        t.insert("a", 0, 2 * G);
        assert_eq!(t.first_fit(G, G), Some(2 * G));
        t.insert("c", 4 * G, G);
        assert_eq!(t.first_fit(2 * G, G), Some(2 * G));
        assert_eq!(t.first_fit(3 * G, G), Some(5 * G));
        assert_eq!(t.first_fit(4 * G, G), None);
        assert_eq!(t.first_fit(G, 4 * G), None, "no 4 GiB-aligned hole of 1 GiB but at 4 GiB, taken");
        t.insert("b", 2 * G, G);
        assert_eq!(t.shares.iter().map(|s| s.node.as_str()).collect::<Vec<_>>(), ["a", "b", "c"]);
        assert!(t.validate().is_ok());
        assert_eq!(t.of("b").map(|s| s.offset), Some(2 * G));
    }

    #[test]
    fn hostile_tables_are_refused() {
        let table = |shares: Vec<(&str, u64, u64)>| ShareTable {
            shares: shares.into_iter().map(|(n, o, l)| Share { node: n.into(), offset: o, len: l }).collect(),
            ..ShareTable::new("serial:cxl/0x1/cxl_volatile0", 8 * G)
        };
        assert!(table(vec![("a", 0, G), ("b", G, G)]).validate().is_ok());
        for (bad, why) in [
            (table(vec![("a", 0, 2 * G), ("b", G, G)]), "overlap"),
            (table(vec![("b", G, G), ("a", 0, G)]), "order"),
            (table(vec![("a", 0, G), ("a", G, G)]), "twice"),
            (table(vec![("a", 0, 0)]), "empty"),
            (table(vec![("a", 7 * G, 2 * G)]), "past the capacity"),
            (table(vec![("a", u64::MAX, 2)]), "overflow"),
            (table(vec![("a/b", 0, G)]), "node name"),
            (ShareTable { capacity: 0, ..table(vec![]) }, "capacity"),
            (ShareTable { resource: "../x".into(), ..table(vec![]) }, "resource"),
            (ShareTable { resource: "a//b".into(), ..table(vec![]) }, "resource"),
        ] {
            assert!(bad.validate().is_err(), "{why}: {bad:?}");
        }
        let many = table((0..=MAX_SHARES as u64).map(|i| ("n", i, 1)).collect());
        assert!(many.validate().is_err());
    }
}
