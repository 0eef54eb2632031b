//! The domain as one node sees it: a pure value built from the records under
//! `/fabric/<domain>/` (an initial read, then the watch's events). A hostile or
//! inconsistent record is refused with a reason and never enters the view; nothing here
//! does I/O. Its storage is shared in shards (`shards.rs`): a clone — published after
//! every watch event — costs a reference count per shard, and a change copies one shard.

mod shards;

use std::collections::BTreeMap;
use std::sync::Arc;

use shards::Shards;

use crate::partition::PartitionRecord;
use crate::records::{
    self, DomainSettings, Keys, MemberRecord, PlacedRange, PlacementsRecord, Record, RecordLimits, SlotClaim,
};
use crate::topology::TopologyRecord;

/// One node of the domain: its slot and, when it published them, its placements; `member`
/// is its live member record (absent once its lease ended: the node is gone, its slot a
/// hole that keeps its GFAs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEntry<'a> {
    /// The node's name.
    pub name: &'a str,
    /// Its slot, when it holds one.
    pub slot: Option<u32>,
    /// Its member record while it is live.
    pub member: Option<&'a MemberRecord>,
    /// Its placements, when published and consistent with its slot.
    pub placements: Option<&'a PlacementsRecord>,
}

/// Where a GFA of the domain lands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainLocation<'a> {
    /// The node whose slot holds it.
    pub node: &'a str,
    /// Whether that node is live.
    pub live: bool,
    /// The range holding it, when the node placed one there.
    pub range: Option<&'a PlacedRange>,
    /// Byte offset in that range.
    pub offset: u64,
}

/// The domain's records, checked against each other.
#[derive(Debug, Clone, Default)]
pub struct DomainView {
    keys: Option<Keys>,
    limits: RecordLimits,
    settings: Option<DomainSettings>,
    members: Shards<String, Arc<MemberRecord>>,
    /// `slots/<n>` → the claim, the authority on who holds a slot.
    slots: Shards<u32, String>,
    /// The reverse of `slots`: the slot each node holds.
    slot_of: Shards<String, u32>,
    /// Placements consistent with the node's slot and the settings.
    placements: Shards<String, Arc<PlacementsRecord>>,
    /// The domain's partitions, by name ([`DomainView::partitions`]).
    partitions: Shards<String, Arc<PartitionRecord>>,
    /// Topology records of nodes that hold a slot ([`DomainView::topology`]).
    topology: Shards<String, Arc<TopologyRecord>>,
    /// Keys whose value was refused, with why (cleared when the key is rewritten well or
    /// deleted). Sharded like the records: a node writing many bad keys makes each watch
    /// event's published view copy one shard of them, not all.
    refused: Shards<String, String>,
    revision: i64,
    /// The revision of the last change to what the domain's merged fabric is made of
    /// ([`DomainView::fabric_revision`]).
    fabric_revision: i64,
}

impl DomainView {
    /// An empty view of the domain whose keys are `keys`.
    pub fn new(keys: Keys, limits: RecordLimits) -> Self {
        Self { keys: Some(keys), limits, ..Self::default() }
    }

    /// Applies a batch read at one revision (the initial read, or a re-read after the
    /// watch was lost), in an order where every record's dependencies come first
    /// (settings, slots, members, placements), whatever order the keys came in.
    pub fn load<'a>(
        keys: Keys,
        limits: RecordLimits,
        entries: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
        revision: i64,
    ) -> Self {
        Self::load_over(keys, limits, None, entries, revision)
    }

    /// [`DomainView::load`] for a domain whose settings are known (`settings`: a view read
    /// before, when the domain is read again after its watch was lost): settings are
    /// written once, so a settings record that differs is refused and one missing keeps
    /// them, as on the watch, rather than a re-read taking what the key holds now.
    pub fn load_over<'a>(
        keys: Keys,
        limits: RecordLimits,
        settings: Option<DomainSettings>,
        entries: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
        revision: i64,
    ) -> Self {
        let mut view = Self::new(keys, limits);
        view.settings = settings;
        let mut sorted: Vec<(&[u8], &[u8])> = entries.into_iter().collect();
        sorted.sort_by_key(|(key, _)| view.rank(key));
        for (key, value) in sorted {
            if let Err(reason) = view.apply(key, Some(value), revision) {
                tracing::warn!(key = %String::from_utf8_lossy(key), %reason, "refused an etcd record");
            }
        }
        view.revision = revision;
        view
    }

    /// The etcd revision the view reflects.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The revision of the last accepted change to what `crate::domain_fabric` merges:
    /// a slot, a topology record, or a member's coming or going (not a member record's
    /// rewrite, a placements write or a partition). Two views of one domain with the same
    /// value merge to the same fabric, so a cache of the merge keys on it: a partition,
    /// share, gc request or election key written does not make the next request merge again.
    pub fn fabric_revision(&self) -> i64 {
        self.fabric_revision
    }

    fn rank(&self, key: &[u8]) -> u8 {
        let Some(rest) = self.keys.as_ref().and_then(|k| key.strip_prefix(k.prefix().as_bytes())) else { return 9 };
        match rest {
            r if r == b"settings" => 0,
            r if r.starts_with(b"slots/") => 1,
            r if r.starts_with(b"members/") => 2,
            r if r.starts_with(b"placements/") || r.starts_with(b"topology/") => 3,
            _ => 4,
        }
    }

    /// Applies one put (`Some(value)`) or delete (`None`) at `revision`. A refused value
    /// leaves the view as it was for that key's record and is listed in
    /// [`DomainView::refused`]; the reason is also returned, for the log.
    pub fn apply(&mut self, key: &[u8], value: Option<&[u8]>, revision: i64) -> Result<(), String> {
        self.revision = self.revision.max(revision);
        let Some(keys) = self.keys.clone() else { return Err("the view has no domain".to_owned()) };
        let text = String::from_utf8_lossy(key).into_owned();
        let Some(rest) = text.strip_prefix(keys.prefix()) else { return Ok(()) };
        let member = rest.strip_prefix("members/");
        let was_live = member.map(|name| self.members.contains_key(name));
        let result = match (rest, value) {
            ("settings", Some(v)) => self.put_settings(v),
            // Settings are written once: with slots claimed under them, a deleted key keeps
            // them here (the GFAs placed under them stand), so that no other can replace them.
            ("settings", None) if self.settings.is_some() && self.slots.iter().next().is_some() => {
                Err("deleted while slots are claimed; the settings read before are kept".to_owned())
            }
            ("settings", None) => {
                self.settings = None;
                Ok(())
            }
            (r, v) if r.starts_with("slots/") => match (keys.parse_slot_key(key), v) {
                (Some(slot), v) => self.slot(slot, v),
                // A junk key's delete: it is no longer refused (its refusal goes below).
                (None, None) => Ok(()),
                (None, Some(_)) => Err(format!("{r:?} is not a slot key")),
            },
            (r, v) if r.starts_with("members/") => self.member(&r["members/".len()..], v),
            (r, v) if r.starts_with("placements/") => self.put_placements(&r["placements/".len()..], v),
            (r, v) if r.starts_with("topology/") => self.put_topology(&r["topology/".len()..], v),
            (r, v) if r.starts_with("partitions/") => self.put_partition(&r["partitions/".len()..], v),
            // slot-of/<node> repeats slots/<n> for the claim's transaction; the view reads
            // the slot keys, which say who holds a slot.
            _ => Ok(()),
        };
        let fabric = rest.starts_with("slots/")
            || rest.starts_with("topology/")
            || member.zip(was_live).is_some_and(|(name, was)| was != self.members.contains_key(name));
        if result.is_ok() && fabric {
            self.fabric_revision = self.fabric_revision.max(revision);
        }
        match &result {
            Ok(()) => self.refused.remove(&text),
            Err(why) => self.refused.insert(text, why.clone()),
        };
        result
    }

    fn put_settings(&mut self, value: &[u8]) -> Result<(), String> {
        let settings: DomainSettings = records::decode(value, self.limits).map_err(|e| e.to_string())?;
        if let Some(old) = &self.settings
            && let Some((field, was, now)) = old.difference(&settings)
        {
            return Err(format!("settings are written once: {field} was {was}, the new value says {now}"));
        }
        self.settings = Some(settings);
        Ok(())
    }

    fn slot(&mut self, slot: u32, value: Option<&[u8]>) -> Result<(), String> {
        let Some(value) = value else {
            // Freed by the admin's gc: the node's placements go with it.
            if let Some(node) = self.slots.remove(&slot) {
                self.slot_of.remove(&node);
                self.placements.remove(&node);
                self.topology.remove(&node);
            }
            return Ok(());
        };
        let claim: SlotClaim = records::decode(value, self.limits).map_err(|e| e.to_string())?;
        if claim.slot != slot {
            return Err(format!("names slot {}, its key slot {slot}", claim.slot));
        }
        if let Some(count) = self.settings.as_ref().map(DomainSettings::slot_count)
            && slot >= count
        {
            return Err(format!("slot {slot} is beyond the domain's {count} slots"));
        }
        if let Some(other) = self.slot_of.get(&claim.node)
            && *other != slot
        {
            return Err(format!("{} already holds slot {other}: a node holds one slot", claim.node));
        }
        if let Some(holder) = self.slots.get(&slot)
            && *holder != claim.node
        {
            return Err(format!("slot {slot} is held by {holder}: a claim never changes hands"));
        }
        self.slot_of.insert(claim.node.clone(), slot);
        self.slots.insert(slot, claim.node);
        Ok(())
    }

    fn member(&mut self, name: &str, value: Option<&[u8]>) -> Result<(), String> {
        let Some(value) = value else {
            self.members.remove(name);
            return Ok(());
        };
        let record: MemberRecord = records::decode(value, self.limits).map_err(|e| e.to_string())?;
        if record.name != name {
            return Err(format!("{:?} under the key of {name:?}", record.name));
        }
        self.members.insert(name.to_owned(), Arc::new(record));
        Ok(())
    }

    fn put_placements(&mut self, name: &str, value: Option<&[u8]>) -> Result<(), String> {
        let Some(value) = value else {
            self.placements.remove(name);
            return Ok(());
        };
        let record: PlacementsRecord = records::decode(value, self.limits).map_err(|e| e.to_string())?;
        if record.node != name {
            return Err(format!("{:?} under the key of {name:?}", record.node));
        }
        match self.slot_of(name) {
            Some(slot) if slot == record.slot => {}
            Some(slot) => return Err(format!("names slot {}, but {name} holds slot {slot}", record.slot)),
            None => return Err(format!("{name} holds no slot")),
        }
        if let Some(settings) = &self.settings
            && settings.node_span != record.span
        {
            return Err(format!("span {:#x}, the domain's node span is {:#x}", record.span, settings.node_span));
        }
        self.placements.insert(name.to_owned(), Arc::new(record));
        Ok(())
    }

    fn put_topology(&mut self, name: &str, value: Option<&[u8]>) -> Result<(), String> {
        let holds_slot = self.slot_of(name).is_some();
        put_named(&mut self.topology, self.limits, name, value, |r: &TopologyRecord| {
            if r.node != name {
                return Err(format!("{:?} under the key of {name:?}", r.node));
            }
            if holds_slot { Ok(()) } else { Err(format!("{name} holds no slot")) }
        })
    }

    fn put_partition(&mut self, name: &str, value: Option<&[u8]>) -> Result<(), String> {
        put_named(&mut self.partitions, self.limits, name, value, |r: &PartitionRecord| {
            if r.name == name { Ok(()) } else { Err(format!("{:?} under the key of {name:?}", r.name)) }
        })
    }

    /// The domain's partitions, by name.
    pub fn partitions(&self) -> impl Iterator<Item = &PartitionRecord> {
        self.partitions.sorted().into_iter().map(|(_, p)| &**p)
    }

    /// The placements record `node` published, when it was accepted.
    pub fn placements_of(&self, node: &str) -> Option<&PlacementsRecord> {
        self.placements.get(node).map(|p| &**p)
    }

    /// The topology record `node` published, when it holds a slot and the record was
    /// accepted (`crate::domain_fabric` merges them).
    pub fn topology(&self, node: &str) -> Option<&TopologyRecord> {
        self.topology.get(node).map(|t| &**t)
    }

    /// The domain settings, once read.
    pub fn settings(&self) -> Option<&DomainSettings> {
        self.settings.as_ref()
    }

    /// The live member record of `node`, if it is live.
    pub fn live_member(&self, node: &str) -> Option<&MemberRecord> {
        self.members.get(node).map(|m| &**m)
    }

    /// The slot `node` holds.
    pub fn slot_of(&self, node: &str) -> Option<u32> {
        self.slot_of.get(node).copied()
    }

    /// Live members, by name.
    pub fn members(&self) -> impl Iterator<Item = &MemberRecord> {
        self.members.sorted().into_iter().map(|(_, m)| &**m)
    }

    /// Live members whose record carries node id `id`, by name: one scan, no sort of the
    /// whole membership (an import asks this of a domain of thousands).
    pub fn members_with_node_id(&self, id: &str) -> Vec<&MemberRecord> {
        let mut found: Vec<&MemberRecord> =
            self.members.iter().map(|(_, m)| &**m).filter(|m| m.node_id.as_deref() == Some(id)).collect();
        found.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        found
    }

    /// Every node the view knows of (holding a slot, or live without one), by name.
    pub fn nodes(&self) -> Vec<NodeEntry<'_>> {
        let mut names: Vec<&str> =
            self.slots.iter().map(|(_, n)| n.as_str()).chain(self.members.iter().map(|(n, _)| n.as_str())).collect();
        names.sort_unstable();
        names.dedup();
        names
            .into_iter()
            .map(|name| NodeEntry {
                name,
                slot: self.slot_of(name),
                member: self.members.get(name).map(|m| &**m),
                placements: self.placements.get(name).map(|p| &**p),
            })
            .collect()
    }

    /// Keys whose last value was refused, with why, by key.
    pub fn refused(&self) -> BTreeMap<&str, &str> {
        self.refused.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    /// Where `gfa` lands: the node whose slot holds it and the range there, if any; `None`
    /// when no node holds that slot or the settings are not known yet.
    pub fn locate(&self, gfa: u64) -> Option<DomainLocation<'_>> {
        let span = self.settings.as_ref()?.node_span;
        let slot = u32::try_from(gfa / span).ok()?;
        let node = self.slots.get(&slot)?;
        let range = self.placements.get(node.as_str()).and_then(|p| p.range_at(gfa));
        Some(DomainLocation {
            node,
            live: self.members.contains_key(node.as_str()),
            range,
            offset: range.map_or(0, |r| gfa - r.start),
        })
    }
}

/// A put (`Some`) or delete (`None`) of the record `held` keeps under `name`: a delete
/// removes it; a put replaces it once it decodes and `check` accepts it.
fn put_named<R: Record + Clone>(
    held: &mut Shards<String, Arc<R>>,
    limits: RecordLimits,
    name: &str,
    value: Option<&[u8]>,
    check: impl FnOnce(&R) -> Result<(), String>,
) -> Result<(), String> {
    let Some(value) = value else {
        held.remove(name);
        return Ok(());
    };
    let record: R = records::decode(value, limits).map_err(|e| e.to_string())?;
    check(&record)?;
    held.insert(name.to_owned(), Arc::new(record));
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::records::{DataPathKind, PlacedKind, RECORD_VERSION, encode};

    const GIB: u64 = 1 << 30;
    const SPAN: u64 = 64 * GIB;

    fn keys() -> Keys {
        Keys::new("d")
    }

    fn settings() -> Vec<u8> {
        encode(&DomainSettings::new(57, SPAN, vec![DataPathKind::SharedFile]))
    }

    fn member(name: &str) -> Vec<u8> {
        encode(&MemberRecord {
            version: RECORD_VERSION,
            name: name.into(),
            incarnation: 5,
            peer_address: "127.0.0.1:7400".into(),
            capabilities: vec![],
            groups: vec![],
            software: "0.1.0".into(),
            node_id: None,
        })
    }

    fn placements(node: &str, slot: u32) -> PlacementsRecord {
        let start = u64::from(slot) * SPAN;
        PlacementsRecord {
            version: RECORD_VERSION,
            node: node.into(),
            incarnation: 5,
            generation: 1,
            slot,
            span: SPAN,
            ranges: vec![PlacedRange {
                start,
                reserved: 2 * GIB,
                size: 2 * GIB,
                kind: PlacedKind::Direct,
                owner: format!("name:{node}/gpu0"),
                memory: Some("hbm".into()),
                ordinal: 0,
            }],
        }
    }

    fn put(view: &mut DomainView, key: String, value: &[u8]) -> Result<(), String> {
        view.apply(key.as_bytes(), Some(value), 1)
    }

    /// A domain of two nodes, loaded in key order (placements before slots).
    fn two_nodes() -> DomainView {
        let k = keys();
        let entries = [
            (k.member("a"), member("a")),
            (k.placements("a"), encode(&placements("a", 3))),
            (k.placements("b"), encode(&placements("b", 1))),
            (k.settings(), settings()),
            (k.slot(1), encode(&SlotClaim::new(1, "b"))),
            (k.slot(3), encode(&SlotClaim::new(3, "a"))),
        ];
        DomainView::load(k, RecordLimits::default(), entries.iter().map(|(key, v)| (key.as_bytes(), v.as_slice())), 7)
    }

    #[test]
    fn a_load_in_any_key_order_sees_every_node() {
        let view = two_nodes();
        assert!(view.refused().is_empty(), "{:?}", view.refused());
        let nodes = view.nodes();
        assert_eq!(
            nodes.iter().map(|n| (n.name, n.slot, n.member.is_some())).collect::<Vec<_>>(),
            [("a", Some(3), true), ("b", Some(1), false)]
        );
        let at = view.locate(3 * SPAN + GIB + 7).unwrap();
        assert_eq!((at.node, at.live, at.offset), ("a", true, GIB + 7));
        assert_eq!(at.range.unwrap().owner, "name:a/gpu0");
        let gone = view.locate(SPAN).unwrap();
        assert_eq!((gone.node, gone.live), ("b", false));
        let beyond = view.locate(3 * SPAN + 2 * GIB).unwrap();
        assert_eq!((beyond.node, beyond.range), ("a", None));
        assert_eq!(view.locate(2 * SPAN), None);
    }

    #[test]
    fn a_junk_key_under_slots_is_refused_until_deleted() {
        let mut view = two_nodes();
        let junk = format!("{}slots/abc", keys().prefix());
        assert!(put(&mut view, junk.clone(), b"x").unwrap_err().contains("not a slot key"));
        assert_eq!(view.refused().len(), 1);
        // Its delete ends the refusal (before, it was refused again and kept for good).
        view.apply(junk.as_bytes(), None, 2).unwrap();
        assert!(view.refused().is_empty(), "{:?}", view.refused());
    }

    #[test]
    fn a_placement_outside_its_slot_is_refused() {
        let mut view = two_nodes();
        let before = view.placements.clone();
        // Consistent in itself, but names slot 2 while the node holds slot 3.
        let err = put(&mut view, keys().placements("a"), &encode(&placements("a", 2))).unwrap_err();
        assert!(err.contains("holds slot 3"), "{err}");
        // Its ranges lie outside the slot it names.
        let mut outside = placements("a", 3);
        outside.ranges[0].start = 2 * SPAN;
        let err = put(&mut view, keys().placements("a"), &encode(&outside)).unwrap_err();
        assert!(err.contains("ranges.start"), "{err}");
        // Under another node's key.
        let err = put(&mut view, keys().placements("b"), &encode(&placements("a", 3))).unwrap_err();
        assert!(err.contains("under the key"), "{err}");
        // Another span than the domain's.
        let mut span = placements("a", 3);
        span.span = 2 * SPAN;
        span.ranges.clear();
        let err = put(&mut view, keys().placements("a"), &encode(&span)).unwrap_err();
        assert!(err.contains("node span"), "{err}");
        assert_eq!(view.placements, before, "refusals leave the view as it was");
        assert_eq!(view.refused().len(), 2);
    }

    #[test]
    fn a_slot_claimed_twice_is_refused() {
        let mut view = two_nodes();
        // A second slot for node a, written by hand.
        let err = put(&mut view, keys().slot(5), &encode(&SlotClaim::new(5, "a"))).unwrap_err();
        assert!(err.contains("already holds slot 3"), "{err}");
        // Slot 3 handed to another node.
        let err = put(&mut view, keys().slot(3), &encode(&SlotClaim::new(3, "c"))).unwrap_err();
        assert!(err.contains("held by a"), "{err}");
        // A claim naming another slot than its key.
        let err = put(&mut view, keys().slot(6), &encode(&SlotClaim::new(7, "c"))).unwrap_err();
        assert!(err.contains("its key slot 6"), "{err}");
        assert_eq!(view.slot_of("a"), Some(3));
        assert_eq!(view.slot_of("c"), None);
        assert_eq!(view.locate(5 * SPAN), None);
    }

    /// A re-read keeps the settings a view had: a settings record rewritten or deleted
    /// behind the watch is refused (named in `refused`), not taken.
    #[test]
    fn a_reread_keeps_the_settings_the_domain_was_joined_with() {
        let k = keys();
        let known = DomainSettings::new(57, SPAN, vec![DataPathKind::SharedFile]);
        let other = encode(&DomainSettings::new(57, 2 * SPAN, vec![DataPathKind::SharedFile]));
        let claim = encode(&SlotClaim::new(3, "a"));
        let entries = [(k.settings(), other.clone()), (k.slot(3), claim.clone())];
        let entries = entries.iter().map(|(key, v)| (key.as_bytes(), v.as_slice()));
        let view = DomainView::load_over(k.clone(), RecordLimits::default(), Some(known.clone()), entries, 9);
        assert_eq!(view.settings(), Some(&known), "a rewritten record is refused");
        assert!(view.refused().contains_key(k.settings().as_str()), "{:?}", view.refused());
        assert_eq!(view.locate(3 * SPAN).map(|l| l.node), Some("a"), "the known span places the slot");
        let entries = [(k.slot(3), claim)];
        let entries = entries.iter().map(|(key, v)| (key.as_bytes(), v.as_slice()));
        let view = DomainView::load_over(k.clone(), RecordLimits::default(), Some(known.clone()), entries, 10);
        assert_eq!(view.settings(), Some(&known), "a deleted record keeps them");
        // A first read takes what the key holds.
        let entries = [(k.settings(), other)];
        let view = DomainView::load(
            k,
            RecordLimits::default(),
            entries.iter().map(|(key, v)| (key.as_bytes(), v.as_slice())),
            1,
        );
        assert_eq!(view.settings().map(|s| s.node_span), Some(2 * SPAN));
    }

    #[test]
    fn a_freed_slot_takes_its_placements_and_settings_never_change() {
        let mut view = two_nodes();
        view.apply(keys().slot(1).as_bytes(), None, 9).unwrap();
        assert_eq!(view.slot_of("b"), None);
        assert_eq!(view.locate(SPAN), None);
        assert!(view.nodes().iter().all(|n| n.name != "b"));
        let other = encode(&DomainSettings::new(52, SPAN, vec![DataPathKind::SharedFile]));
        let err = put(&mut view, keys().settings(), &other).unwrap_err();
        assert!(err.contains("address_bits"), "{err}");
        assert_eq!(view.settings().unwrap().address_bits, 57);
        assert_eq!(view.revision(), 9);
        // A deleted settings key, with slot 3 still claimed, keeps them: no other replaces them.
        let err = view.apply(keys().settings().as_bytes(), None, 10).unwrap_err();
        assert!(err.contains("deleted while slots are claimed"), "{err}");
        assert_eq!(view.settings().unwrap().address_bits, 57);
        assert!(put(&mut view, keys().settings(), &other).is_err());
        assert_eq!(view.settings().unwrap().address_bits, 57);
        // With no slot claimed, the domain is empty again: the key goes.
        view.apply(keys().slot(3).as_bytes(), None, 11).unwrap();
        view.apply(keys().settings().as_bytes(), None, 12).unwrap();
        assert_eq!(view.settings(), None);
    }

    #[test]
    fn a_member_gone_and_back() {
        let mut view = two_nodes();
        view.apply(keys().member("a").as_bytes(), None, 8).unwrap();
        assert!(!view.locate(3 * SPAN).unwrap().live);
        assert!(view.nodes()[0].placements.is_some(), "a gone node's placements stay: its slot is a hole");
        put(&mut view, keys().member("a"), &member("a")).unwrap();
        assert!(view.locate(3 * SPAN).unwrap().live);
        let err = put(&mut view, keys().member("b"), &member("a")).unwrap_err();
        assert!(err.contains("under the key"), "{err}");
    }

    #[test]
    fn the_fabric_revision_moves_with_slots_topology_and_liveness_only() {
        let mut view = two_nodes();
        assert_eq!(view.fabric_revision(), 7, "a load is one change at its revision");
        put(&mut view, keys().placements("a"), &encode(&placements("a", 3))).unwrap();
        view.apply(keys().member("a").as_bytes(), Some(&member("a")), 8).unwrap();
        view.apply(keys().placements("b").as_bytes(), None, 9).unwrap();
        assert_eq!((view.revision(), view.fabric_revision()), (9, 7), "placements and a member's rewrite");
        view.apply(keys().member("a").as_bytes(), None, 10).unwrap();
        assert_eq!(view.fabric_revision(), 10, "a member gone");
        view.apply(keys().member("a").as_bytes(), Some(&member("a")), 11).unwrap();
        assert_eq!(view.fabric_revision(), 11, "a member back");
        let topology = crate::topology::TopologyRecord {
            version: RECORD_VERSION,
            node: "a".into(),
            incarnation: 5,
            devices: vec![],
            links: vec![],
        };
        view.apply(keys().topology("a").as_bytes(), Some(&encode(&topology)), 12).unwrap();
        assert_eq!(view.fabric_revision(), 12, "a topology record");
        assert!(view.apply(keys().topology("a").as_bytes(), Some(b"junk"), 13).is_err());
        assert_eq!(view.fabric_revision(), 12, "a refused record changes nothing");
        view.apply(keys().slot(1).as_bytes(), None, 14).unwrap();
        assert_eq!(view.fabric_revision(), 14, "a slot freed");
    }

    proptest! {
        /// Any bytes under any of the domain's keys are applied or refused, never panic,
        /// and never change what the view says about the records already in it.
        #[test]
        fn hostile_values_never_poison_the_view(
            which in 0usize..5,
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let mut view = two_nodes();
            let key = [keys().settings(), keys().slot(3), keys().member("a"), keys().placements("a"), keys().placements("b")][which].clone();
            if view.apply(key.as_bytes(), Some(&bytes), 9).is_err() {
                prop_assert_eq!(view.slot_of("a"), Some(3));
                prop_assert_eq!(view.settings().map(|s| s.node_span), Some(SPAN));
                prop_assert!(view.members().any(|m| m.name == "a"));
                prop_assert_eq!(view.locate(3 * SPAN).and_then(|l| l.range).map(|r| r.owner.as_str()), Some("name:a/gpu0"));
                prop_assert!(view.refused().contains_key(key.as_str()));
            }
        }
    }
}
