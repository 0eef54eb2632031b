//! The memory registry's journal records: what each acknowledged change writes, its byte
//! encoding, the snapshot that compaction writes, and [`Replayed`], the pure model that
//! replay rebuilds from them (no files, no clock: the fuzz target drives it).
//!
//! Every payload is one format byte ([`RECORD_VERSION`]) followed by the postcard encoding
//! of the record's struct; the journal's record kind says which struct. Bounded strings and
//! lists reuse the wire protocol's bounded types, so a hostile payload is refused before
//! anything large is allocated. docs/journal.md lists the kinds.

use std::collections::BTreeMap;

use fabric_proto::wire::{AccessMode, BoundedVec, DeviceName, MemoryClass, Name, ct_eq};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::journal::KIND_SNAPSHOT;

/// A region was allocated (and its backing file created) for a session.
pub const KIND_REGION_ALLOCATED: u16 = 0x0101;
/// A region was freed by its owner.
pub const KIND_REGION_FREED: u16 = 0x0102;
/// A region was exported.
pub const KIND_EXPORT_CREATED: u16 = 0x0103;
/// An export was revoked.
pub const KIND_EXPORT_REVOKED: u16 = 0x0104;
/// A session ended (its client went): every region it owned is freed.
pub const KIND_SESSION_ENDED: u16 = 0x0105;
/// A client took a session back after a daemon restart: its owner is updated.
pub const KIND_SESSION_RESUMED: u16 = 0x0106;
/// A region striped over an interleave set was allocated (freed by [`KIND_REGION_FREED`]
/// and [`KIND_SESSION_ENDED`] like any region).
pub const KIND_SET_REGION_ALLOCATED: u16 = 0x0107;
/// A region was lost with its device (it stays until freed; its exports are revoked),
/// so that a restart with the device back keeps it lost.
pub const KIND_REGION_LOST: u16 = 0x0108;

/// The format byte every payload starts with.
pub const RECORD_VERSION: u8 = 1;
/// The format byte of a snapshot that holds regions striped over interleave sets (it has
/// one more list, `set_regions`); a snapshot without any is written as version 1, so a
/// registry that never striped a region keeps the format older builds read.
pub const SNAPSHOT_SETS_VERSION: u8 = 2;
/// The format byte of a snapshot that holds lost regions (version 2's lists, then `lost`);
/// written only while a region is lost.
pub const SNAPSHOT_LOST_VERSION: u8 = 3;

/// Why a journal payload does not decode into a registry record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurableError {
    /// A record kind the memory registry does not write.
    #[error("record kind {0:#06x} is not a memory registry record")]
    UnknownKind(u16),
    /// A payload without its format byte.
    #[error("record kind {0:#06x} has an empty payload")]
    Empty(u16),
    /// Written by another format version.
    #[error("record kind {kind:#06x} has format version {version}, which this build does not read")]
    Version {
        /// The record kind.
        kind: u16,
        /// The version byte found.
        version: u8,
    },
    /// The bytes are not a valid record of the kind.
    #[error("record kind {kind:#06x} does not decode")]
    Decode {
        /// The record kind.
        kind: u16,
        /// What postcard found.
        #[source]
        source: postcard::Error,
    },
    /// A valid record followed by more bytes.
    #[error("record kind {kind:#06x} has {extra} trailing bytes")]
    Trailing {
        /// The record kind.
        kind: u16,
        /// Bytes left over.
        extra: usize,
    },
    /// A record could not be encoded.
    #[error("record does not encode")]
    Encode(#[source] postcard::Error),
    /// A snapshot whose ids reach past what this registry hands out ([`MAX_ID`]).
    #[error("snapshot names id {0}, past the registry's ids")]
    IdOutOfRange(u64),
}

/// Ids a registry hands out stay below this (the ids of other nodes' imports and copies
/// across nodes are marked by bit 62): a journal that names one at or above it was not
/// written by a registry, and taking ids on from there could wrap and reuse one.
pub const MAX_ID: u64 = 1 << 62;

/// Who owns a session's regions: the credentials of the connecting process, and the
/// start time of that process (field 22 of `/proc/<pid>/stat`, clock ticks since boot),
/// so that a recycled pid is not taken for the owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Process id (0: unknown, e.g. a peer in another pid namespace).
    pub pid: i32,
    /// The process's start time, when it could be read.
    pub pid_start: Option<u64>,
}

/// A device memory resource by identity: the `ordinal`-th resource of `kind` of `device`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceKey {
    /// Device identity, text form.
    pub device: DeviceName,
    /// Kind of memory.
    pub kind: MemoryClass,
    /// Which resource of that kind.
    pub ordinal: u16,
}

/// A live region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionRecord {
    /// Region id (also its file name, `r<id>`).
    pub id: u64,
    /// Generation.
    pub generation: u64,
    /// The owning session's token.
    pub token: [u8; 16],
    /// The owning process.
    pub owner: Owner,
    /// Where it lives.
    pub resource: ResourceKey,
    /// Offset in the resource.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// An export of a live region (revoked ones are kept, so that their handles are refused
/// as revoked rather than unknown).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportRecord {
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// The handle's secret.
    pub secret: [u8; 16],
    /// The exporter's uid.
    pub owner_uid: u32,
    /// Policy: allowed uids.
    pub uids: BoundedVec<u32, 64>,
    /// Policy: allowed gids.
    pub gids: BoundedVec<u32, 64>,
    /// Policy: partition.
    pub partition: Option<Name>,
    /// Policy: most access granted.
    pub access: AccessMode,
    /// Revoked.
    pub revoked: bool,
}

/// Where a region striped over an interleave set lies: the set, its offset in it, the
/// set's other members (the region's own `resource` is the first member; each member holds
/// the range `[offset, offset + len / ways)` of the region's record) and the DAX device
/// its bytes are in, when the set was backed by one at allocation (`None`: a sim file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetPlacement {
    /// The address map's name of the set.
    pub set: Name,
    /// Offset of the region in the set.
    pub set_offset: u64,
    /// The members after the first, in position order (CXL sets have at most 16 ways).
    pub others: BoundedVec<ResourceKey, 16>,
    /// The DAX device backing the set (`dax0.0`), when there was one.
    pub dax: Option<Name>,
}

/// A live region striped over an interleave set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetRegionRecord {
    /// The region as any region records it (`resource`: the first member; `offset`: the
    /// DPA offset in every member; `len`: bytes of the whole region).
    pub region: RegionRecord,
    /// Where in the set.
    pub placement: SetPlacement,
}

/// One acknowledged change to the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// See [`KIND_REGION_ALLOCATED`].
    RegionAllocated(RegionRecord),
    /// See [`KIND_REGION_FREED`].
    RegionFreed {
        /// Region id.
        id: u64,
    },
    /// See [`KIND_EXPORT_CREATED`] (`revoked` is false).
    ExportCreated(ExportRecord),
    /// See [`KIND_EXPORT_REVOKED`].
    ExportRevoked {
        /// Region id.
        region: u64,
        /// Region generation.
        generation: u64,
        /// The handle's secret.
        secret: [u8; 16],
    },
    /// See [`KIND_SESSION_ENDED`].
    SessionEnded {
        /// The session's token.
        token: [u8; 16],
    },
    /// See [`KIND_SESSION_RESUMED`].
    SessionResumed {
        /// The session's token.
        token: [u8; 16],
        /// The process that took it back.
        owner: Owner,
    },
    /// See [`KIND_SET_REGION_ALLOCATED`].
    SetRegionAllocated(SetRegionRecord),
    /// See [`KIND_REGION_LOST`].
    RegionLost {
        /// Region id.
        id: u64,
    },
}

#[derive(Serialize, Deserialize)]
struct Freed {
    id: u64,
}

#[derive(Serialize, Deserialize)]
struct Revoked {
    region: u64,
    generation: u64,
    secret: [u8; 16],
}

#[derive(Serialize, Deserialize)]
struct Ended {
    token: [u8; 16],
}

#[derive(Serialize, Deserialize)]
struct Resumed {
    token: [u8; 16],
    owner: Owner,
}

/// The whole registry, as compaction writes it: everything acknowledged up to then.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The next region id to hand out (ids are never reused).
    pub next_id: u64,
    /// Live regions on one resource, by id.
    pub regions: Vec<RegionRecord>,
    /// Exports of live regions (of both lists).
    pub exports: Vec<ExportRecord>,
    /// Live regions striped over interleave sets, by id (format version 2 and 3).
    pub set_regions: Vec<SetRegionRecord>,
    /// Live regions (of both lists) lost with their device, by id (format version 3 only).
    pub lost: Vec<u64>,
}

/// A version 2 snapshot: one without lost regions.
#[derive(Deserialize)]
struct SnapshotV2 {
    next_id: u64,
    regions: Vec<RegionRecord>,
    exports: Vec<ExportRecord>,
    set_regions: Vec<SetRegionRecord>,
}

/// [`SnapshotV2`] as it is written (the same encoding, borrowed).
#[derive(Serialize)]
struct SnapshotV2Ref<'a> {
    next_id: u64,
    regions: &'a [RegionRecord],
    exports: &'a [ExportRecord],
    set_regions: &'a [SetRegionRecord],
}

/// A version 1 snapshot: one without set regions.
#[derive(Deserialize)]
struct SnapshotV1 {
    next_id: u64,
    regions: Vec<RegionRecord>,
    exports: Vec<ExportRecord>,
}

/// [`SnapshotV1`] as it is written (the same encoding, borrowed).
#[derive(Serialize)]
struct SnapshotV1Ref<'a> {
    next_id: u64,
    regions: &'a [RegionRecord],
    exports: &'a [ExportRecord],
}

fn payload<T: Serialize>(value: &T) -> Result<Vec<u8>, DurableError> {
    payload_as(RECORD_VERSION, value)
}

fn payload_as<T: Serialize>(version: u8, value: &T) -> Result<Vec<u8>, DurableError> {
    let mut out = vec![version];
    postcard::to_io(value, &mut out).map_err(DurableError::Encode)?;
    Ok(out)
}

fn parse<T: DeserializeOwned>(kind: u16, bytes: &[u8]) -> Result<T, DurableError> {
    let (&version, body) = bytes.split_first().ok_or(DurableError::Empty(kind))?;
    if version != RECORD_VERSION {
        return Err(DurableError::Version { kind, version });
    }
    parse_body(kind, body)
}

fn parse_body<T: DeserializeOwned>(kind: u16, body: &[u8]) -> Result<T, DurableError> {
    let (value, rest) = postcard::take_from_bytes::<T>(body).map_err(|source| DurableError::Decode { kind, source })?;
    if !rest.is_empty() {
        return Err(DurableError::Trailing { kind, extra: rest.len() });
    }
    Ok(value)
}

impl Change {
    /// The journal record kind and payload.
    pub fn encode(&self) -> Result<(u16, Vec<u8>), DurableError> {
        Ok(match self {
            Change::RegionAllocated(r) => (KIND_REGION_ALLOCATED, payload(r)?),
            Change::RegionFreed { id } => (KIND_REGION_FREED, payload(&Freed { id: *id })?),
            Change::ExportCreated(e) => (KIND_EXPORT_CREATED, payload(e)?),
            Change::ExportRevoked { region, generation, secret } => {
                (KIND_EXPORT_REVOKED, payload(&Revoked { region: *region, generation: *generation, secret: *secret })?)
            }
            Change::SessionEnded { token } => (KIND_SESSION_ENDED, payload(&Ended { token: *token })?),
            Change::SessionResumed { token, owner } => {
                (KIND_SESSION_RESUMED, payload(&Resumed { token: *token, owner: *owner })?)
            }
            Change::SetRegionAllocated(r) => (KIND_SET_REGION_ALLOCATED, payload(r)?),
            Change::RegionLost { id } => (KIND_REGION_LOST, payload(&Freed { id: *id })?),
        })
    }

    /// The change a journal record holds; a typed error for anything else.
    pub fn decode(kind: u16, bytes: &[u8]) -> Result<Self, DurableError> {
        Ok(match kind {
            KIND_REGION_ALLOCATED => Change::RegionAllocated(parse(kind, bytes)?),
            KIND_REGION_FREED => Change::RegionFreed { id: parse::<Freed>(kind, bytes)?.id },
            KIND_EXPORT_CREATED => Change::ExportCreated(parse(kind, bytes)?),
            KIND_EXPORT_REVOKED => {
                let r: Revoked = parse(kind, bytes)?;
                Change::ExportRevoked { region: r.region, generation: r.generation, secret: r.secret }
            }
            KIND_SESSION_ENDED => Change::SessionEnded { token: parse::<Ended>(kind, bytes)?.token },
            KIND_SESSION_RESUMED => {
                let r: Resumed = parse(kind, bytes)?;
                Change::SessionResumed { token: r.token, owner: r.owner }
            }
            KIND_SET_REGION_ALLOCATED => Change::SetRegionAllocated(parse(kind, bytes)?),
            KIND_REGION_LOST => Change::RegionLost { id: parse::<Freed>(kind, bytes)?.id },
            other => return Err(DurableError::UnknownKind(other)),
        })
    }
}

impl Snapshot {
    /// The snapshot record's payload in the oldest format that holds it: version 1 when
    /// it holds no set region and no lost one, version 2 with set regions, version 3 with
    /// lost regions.
    pub fn encode(&self) -> Result<Vec<u8>, DurableError> {
        let (next_id, regions, exports, set_regions) = (self.next_id, &self.regions, &self.exports, &self.set_regions);
        if !self.lost.is_empty() {
            payload_as(SNAPSHOT_LOST_VERSION, self)
        } else if !set_regions.is_empty() {
            payload_as(SNAPSHOT_SETS_VERSION, &SnapshotV2Ref { next_id, regions, exports, set_regions })
        } else {
            payload(&SnapshotV1Ref { next_id, regions, exports })
        }
    }

    /// A snapshot record's payload (version 1, 2 or 3), decoded.
    pub fn decode(bytes: &[u8]) -> Result<Self, DurableError> {
        let kind = KIND_SNAPSHOT;
        let (&version, body) = bytes.split_first().ok_or(DurableError::Empty(kind))?;
        match version {
            RECORD_VERSION => {
                let v1: SnapshotV1 = parse_body(kind, body)?;
                Ok(Self { next_id: v1.next_id, regions: v1.regions, exports: v1.exports, ..Self::default() })
            }
            SNAPSHOT_SETS_VERSION => {
                let v2: SnapshotV2 = parse_body(kind, body)?;
                let SnapshotV2 { next_id, regions, exports, set_regions } = v2;
                Ok(Self { next_id, regions, exports, set_regions, lost: Vec::new() })
            }
            SNAPSHOT_LOST_VERSION => parse_body(kind, body),
            version => Err(DurableError::Version { kind, version }),
        }
        .and_then(|s: Self| {
            let ids = s.regions.iter().chain(s.set_regions.iter().map(|r| &r.region)).map(|r| r.id);
            match std::iter::once(s.next_id).chain(ids).find(|&id| id >= MAX_ID) {
                Some(id) => Err(DurableError::IdOutOfRange(id)),
                None => Ok(s),
            }
        })
    }
}

/// A record that does not fit the state it is applied to (a journal written by a buggy
/// build, or hand-edited): it is skipped with a warning.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Inconsistency {
    /// An allocation of an id that is live.
    #[error("region {0} allocated twice")]
    DuplicateRegion(u64),
    /// An id no registry hands out ([`MAX_ID`]).
    #[error("region id {0} is past the registry's ids")]
    IdOutOfRange(u64),
    /// A change to a region that is not live.
    #[error("region {0} is not live")]
    NoRegion(u64),
    /// A revocation of an export that does not exist.
    #[error("no export of region {0} with that handle")]
    NoExport(u64),
}

/// The registry as the journal describes it, before it is reconciled with the files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replayed {
    /// The next region id to hand out.
    pub next_id: u64,
    /// Live regions (those striped over a set too).
    pub regions: BTreeMap<u64, RegionRecord>,
    /// Where each live region striped over an interleave set lies, by region id.
    pub sets: BTreeMap<u64, SetPlacement>,
    /// Exports of live regions, by region id, each region's in the order they were made.
    pub exports: BTreeMap<u64, Vec<ExportRecord>>,
    /// Live regions lost with their device (their exports are revoked).
    pub lost: std::collections::BTreeSet<u64>,
}

impl Replayed {
    /// The state a snapshot describes (later duplicates of an id replace earlier ones).
    pub fn from_snapshot(s: Snapshot) -> Self {
        let mut out = Self { next_id: s.next_id, ..Self::default() };
        for r in s.regions {
            out.next_id = out.next_id.max(r.id.saturating_add(1));
            out.sets.remove(&r.id);
            out.regions.insert(r.id, r);
        }
        for SetRegionRecord { region: r, placement } in s.set_regions {
            out.next_id = out.next_id.max(r.id.saturating_add(1));
            out.sets.insert(r.id, placement);
            out.regions.insert(r.id, r);
        }
        out.lost = s.lost.into_iter().filter(|id| out.regions.contains_key(id)).collect();
        for mut e in s.exports.into_iter().filter(|e| out.regions.contains_key(&e.region)) {
            // A lost region's exports are revoked, whatever a damaged snapshot says.
            e.revoked |= out.lost.contains(&e.region);
            out.exports.entry(e.region).or_default().push(e);
        }
        out
    }

    /// The snapshot of this state.
    pub fn snapshot(&self) -> Snapshot {
        let (mut regions, mut set_regions) = (Vec::new(), Vec::new());
        for (id, r) in &self.regions {
            match self.sets.get(id) {
                Some(p) => set_regions.push(SetRegionRecord { region: r.clone(), placement: p.clone() }),
                None => regions.push(r.clone()),
            }
        }
        let lost = self.lost.iter().copied().collect();
        Snapshot { next_id: self.next_id, regions, exports: self.exports().cloned().collect(), set_regions, lost }
    }

    /// Every export, by region id.
    pub fn exports(&self) -> impl Iterator<Item = &ExportRecord> {
        self.exports.values().flatten()
    }

    /// Applies one change; an inconsistent one changes nothing.
    pub fn apply(&mut self, change: Change) -> Result<(), Inconsistency> {
        let id = match &change {
            Change::RegionAllocated(r) => Some(r.id),
            Change::SetRegionAllocated(s) => Some(s.region.id),
            Change::RegionFreed { id } => Some(*id),
            _ => None,
        };
        if let Some(id) = id.filter(|&id| id >= MAX_ID) {
            return Err(Inconsistency::IdOutOfRange(id));
        }
        match change {
            Change::RegionAllocated(r) => {
                self.next_id = self.next_id.max(r.id.saturating_add(1));
                if self.regions.contains_key(&r.id) {
                    return Err(Inconsistency::DuplicateRegion(r.id));
                }
                self.regions.insert(r.id, r);
            }
            Change::SetRegionAllocated(SetRegionRecord { region: r, placement }) => {
                self.next_id = self.next_id.max(r.id.saturating_add(1));
                if self.regions.contains_key(&r.id) {
                    return Err(Inconsistency::DuplicateRegion(r.id));
                }
                self.sets.insert(r.id, placement);
                self.regions.insert(r.id, r);
            }
            Change::RegionFreed { id } => {
                self.next_id = self.next_id.max(id.saturating_add(1));
                if self.regions.remove(&id).is_none() {
                    return Err(Inconsistency::NoRegion(id));
                }
                self.sets.remove(&id);
                self.lost.remove(&id);
                self.exports.remove(&id);
            }
            Change::ExportCreated(e) => {
                if self.regions.get(&e.region).is_none_or(|r| r.generation != e.generation) {
                    return Err(Inconsistency::NoRegion(e.region));
                }
                self.exports.entry(e.region).or_default().push(e);
            }
            Change::ExportRevoked { region, generation, secret } => {
                let e = self
                    .exports
                    .get_mut(&region)
                    .into_iter()
                    .flatten()
                    .find(|e| e.generation == generation && ct_eq(&e.secret, &secret))
                    .ok_or(Inconsistency::NoExport(region))?;
                e.revoked = true;
            }
            Change::SessionEnded { token } => {
                let gone: Vec<u64> = self.regions.values().filter(|r| r.token == token).map(|r| r.id).collect();
                for id in &gone {
                    self.regions.remove(id);
                    self.sets.remove(id);
                    self.lost.remove(id);
                    self.exports.remove(id);
                }
            }
            Change::SessionResumed { token, owner } => {
                for r in self.regions.values_mut().filter(|r| r.token == token) {
                    r.owner = owner;
                }
            }
            Change::RegionLost { id } => {
                // A region freed while its device went: its free was journaled first.
                if !self.regions.contains_key(&id) {
                    return Ok(());
                }
                self.lost.insert(id);
                for e in self.exports.get_mut(&id).into_iter().flatten() {
                    e.revoked = true;
                }
            }
        }
        Ok(())
    }
}

/// [`Replayed`] kept by the journal's writer (`journal::Image`): each record it writes
/// folded in by recovery's rules, so that a compaction writes what a replay of the
/// records would rebuild and the registry captures nothing for it under its lock.
#[derive(Debug)]
pub struct RegistryImage {
    model: Replayed,
    /// A record that does not decode (never one this daemon wrote) or a snapshot that does
    /// not: no compaction until the journal is reopened.
    spoiled: Option<String>,
}

impl RegistryImage {
    /// The image of a journal just compacted to `snapshot`.
    pub fn of(snapshot: &[u8]) -> Self {
        let mut image = Self { model: Replayed::default(), spoiled: None };
        crate::journal::Image::reset(&mut image, snapshot);
        image
    }
}

impl crate::journal::Image for RegistryImage {
    fn apply(&mut self, kind: u16, payload: &[u8]) {
        match Change::decode(kind, payload) {
            // As at replay: another subsystem's record and a change that does not fit are
            // skipped.
            Ok(change) => {
                if let Err(e) = self.model.apply(change) {
                    tracing::warn!(kind, "journal record does not fit the registry's image; skipped: {e}");
                }
            }
            Err(DurableError::UnknownKind(_)) => {}
            Err(e) => self.spoiled = Some(format!("a record of kind {kind:#06x} does not decode: {e}")),
        }
    }

    fn encode(&self) -> Result<Vec<u8>, String> {
        if let Some(why) = &self.spoiled {
            return Err(why.clone());
        }
        self.model.snapshot().encode().map_err(|e| e.to_string())
    }

    fn reset(&mut self, snapshot: &[u8]) {
        match Snapshot::decode(snapshot) {
            Ok(s) => (self.model, self.spoiled) = (Replayed::from_snapshot(s), None),
            Err(e) => self.spoiled = Some(format!("the snapshot does not decode: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner() -> Owner {
        Owner { uid: 1000, gid: 100, pid: 4242, pid_start: Some(123_456) }
    }

    /// Ids at or past `MAX_ID` are no registry's: a snapshot naming one is refused, a
    /// change skipped, so that the ids handed out on from it never wrap.
    #[test]
    fn ids_past_the_registrys_are_refused_not_taken_on_from() {
        let far = Snapshot { next_id: u64::MAX, ..Snapshot::default() };
        assert!(matches!(Snapshot::decode(&far.encode().unwrap()), Err(DurableError::IdOutOfRange(u64::MAX))));
        let far = Snapshot { next_id: 1, regions: vec![region(MAX_ID, 1)], ..Snapshot::default() };
        assert!(matches!(Snapshot::decode(&far.encode().unwrap()), Err(DurableError::IdOutOfRange(MAX_ID))));
        let mut r = Replayed::default();
        assert_eq!(r.apply(Change::RegionAllocated(region(u64::MAX, 1))), Err(Inconsistency::IdOutOfRange(u64::MAX)));
        assert_eq!(r.apply(Change::RegionFreed { id: MAX_ID }), Err(Inconsistency::IdOutOfRange(MAX_ID)));
        assert_eq!(r.next_id, 0, "nothing taken on from them");
        r.apply(Change::RegionAllocated(region(MAX_ID - 1, 1))).unwrap();
        assert_eq!(r.next_id, MAX_ID);
    }

    fn region(id: u64, token: u8) -> RegionRecord {
        RegionRecord {
            id,
            generation: id,
            token: [token; 16],
            owner: owner(),
            resource: ResourceKey { device: DeviceName::truncated("uuid:GPU-1"), kind: MemoryClass::Hbm, ordinal: 0 },
            offset: (id - 1) << 21,
            len: 2 << 20,
        }
    }

    fn export(region: u64, secret: u8) -> ExportRecord {
        ExportRecord {
            region,
            generation: region,
            secret: [secret; 16],
            owner_uid: 1000,
            uids: BoundedVec::new(vec![1001]).unwrap_or_default(),
            gids: BoundedVec::default(),
            partition: Some(Name::truncated("p")),
            access: AccessMode::ReadOnly,
            revoked: false,
        }
    }

    fn member(n: u8) -> ResourceKey {
        ResourceKey {
            device: DeviceName::truncated(&format!("serial:MEM-{n}")),
            kind: MemoryClass::CxlVolatile,
            ordinal: 0,
        }
    }

    fn set_region(id: u64, token: u8, dax: Option<&str>) -> SetRegionRecord {
        SetRegionRecord {
            region: RegionRecord { resource: member(0), offset: 2 << 20, len: 4 << 20, ..region(id, token) },
            placement: SetPlacement {
                set: Name::truncated("cxl-region:hpa-0x1000000000"),
                set_offset: 4 << 20,
                others: BoundedVec::new(vec![member(1)]).unwrap_or_default(),
                dax: dax.map(Name::truncated),
            },
        }
    }

    fn all() -> Vec<Change> {
        vec![
            Change::RegionAllocated(region(1, 1)),
            Change::RegionAllocated(region(2, 1)),
            Change::RegionAllocated(region(3, 2)),
            Change::SetRegionAllocated(set_region(4, 2, None)),
            Change::SetRegionAllocated(set_region(5, 1, Some("dax0.0"))),
            Change::SetRegionAllocated(set_region(6, 2, Some("dax0.0"))),
            Change::ExportCreated(export(1, 9)),
            Change::ExportCreated(export(3, 8)),
            Change::ExportCreated(export(4, 7)),
            Change::ExportCreated(export(5, 6)),
            Change::ExportRevoked { region: 1, generation: 1, secret: [9; 16] },
            Change::RegionFreed { id: 2 },
            Change::RegionFreed { id: 6 },
            Change::SessionResumed { token: [2; 16], owner: Owner { pid: 7, ..owner() } },
            Change::SessionEnded { token: [1; 16] },
        ]
    }

    #[test]
    fn every_change_round_trips_and_a_damaged_payload_is_a_typed_error() {
        for c in all() {
            let (kind, bytes) = c.encode().unwrap();
            assert_eq!(Change::decode(kind, &bytes).unwrap(), c);
            assert_eq!(Change::decode(kind, &[]), Err(DurableError::Empty(kind)));
            let mut v2 = bytes.clone();
            v2[0] = 2;
            assert_eq!(Change::decode(kind, &v2), Err(DurableError::Version { kind, version: 2 }));
            let mut long = bytes.clone();
            long.push(0);
            assert_eq!(Change::decode(kind, &long), Err(DurableError::Trailing { kind, extra: 1 }));
            assert!(matches!(Change::decode(kind, &bytes[..bytes.len() - 1]), Err(DurableError::Decode { .. })));
        }
        assert_eq!(Change::decode(0x0200, &[1]), Err(DurableError::UnknownKind(0x0200)));
        // A bounded list longer than its bound is refused, not allocated.
        let mut e = Change::ExportCreated(export(1, 1)).encode().unwrap().1;
        let uids_at = 1 + 1 + 1 + 16 + 2; // version, region, generation, secret, owner_uid (varint 1000)
        e[uids_at] = 65;
        assert!(matches!(Change::decode(KIND_EXPORT_CREATED, &e), Err(DurableError::Decode { .. })));
    }

    /// The fuzz seeds were written by a script straight from the table in
    /// docs/journal.md ("Memory registry records"): kind (2 bytes, LE), then the payload.
    #[test]
    fn the_documented_encoding_decodes() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/registry_records");
        let seed = |name: &str| {
            let b = std::fs::read(dir.join(name)).unwrap();
            (u16::from_le_bytes([b[0], b[1]]), b[2..].to_vec())
        };
        let token: [u8; 16] = std::array::from_fn(|i| i as u8);
        let region = RegionRecord { id: 7, generation: 7, token, offset: 0, ..region(1, 0) };
        let export = ExportRecord { region: 7, generation: 7, ..export(1, 9) };
        let want = [
            ("region_allocated", Change::RegionAllocated(region.clone())),
            ("region_freed", Change::RegionFreed { id: 7 }),
            ("export_created", Change::ExportCreated(export.clone())),
            ("export_revoked", Change::ExportRevoked { region: 7, generation: 7, secret: [9; 16] }),
            ("session_ended", Change::SessionEnded { token }),
            ("session_resumed", Change::SessionResumed { token, owner: Owner { pid: 77, pid_start: None, ..owner() } }),
            ("region_lost", Change::RegionLost { id: 7 }),
        ];
        for (name, change) in want {
            let (kind, payload) = seed(name);
            assert_eq!(Change::decode(kind, &payload).unwrap(), change, "{name}");
            assert_eq!(change.encode().unwrap(), (kind, payload), "{name} encodes to the same bytes");
        }
        let set = SetRegionRecord {
            region: RegionRecord { id: 7, generation: 7, token, ..set_region(7, 0, None).region },
            ..set_region(7, 0, Some("dax0.0"))
        };
        let (kind, payload) = seed("set_region_allocated");
        let change = Change::SetRegionAllocated(set.clone());
        assert_eq!(Change::decode(kind, &payload).unwrap(), change);
        assert_eq!(change.encode().unwrap(), (kind, payload), "set_region_allocated encodes to the same bytes");
        let (kind, payload) = seed("snapshot");
        assert_eq!(kind, KIND_SNAPSHOT);
        let snap = Snapshot {
            next_id: 8,
            regions: vec![region],
            exports: vec![ExportRecord { revoked: true, ..export }],
            ..Snapshot::default()
        };
        assert_eq!(Snapshot::decode(&payload).unwrap(), snap);
        assert_eq!(snap.encode().unwrap(), payload, "a snapshot without set regions is written as version 1");
        let (kind, payload) = seed("snapshot_lost");
        assert_eq!(kind, KIND_SNAPSHOT);
        let lost = Snapshot { lost: vec![7], ..snap };
        assert_eq!(Snapshot::decode(&payload).unwrap(), lost);
        assert_eq!(lost.encode().unwrap(), payload, "a snapshot with a lost region is written as version 3");
        let (kind, payload) = seed("snapshot_sets");
        assert_eq!(kind, KIND_SNAPSHOT);
        let snap = Snapshot { next_id: 8, set_regions: vec![set], ..Snapshot::default() };
        assert_eq!(Snapshot::decode(&payload).unwrap(), snap);
        assert_eq!(snap.encode().unwrap(), payload);
    }

    /// The writer's image is what a replay of the same records rebuilds: a compaction
    /// written from it changes nothing a restart finds.
    #[test]
    fn the_journals_image_is_what_a_replay_of_its_records_rebuilds() {
        use crate::journal::Image as _;
        let start = Snapshot { next_id: 3, regions: vec![region(1, 1), region(2, 2)], ..Snapshot::default() };
        let mut replay = Replayed::from_snapshot(Snapshot::decode(&start.encode().unwrap()).unwrap());
        let mut image = RegistryImage::of(&start.encode().unwrap());
        for c in all() {
            let (kind, payload) = c.encode().unwrap();
            image.apply(kind, &payload);
            let _ = replay.apply(c);
            let written = Snapshot::decode(&image.encode().unwrap()).unwrap();
            assert_eq!(Replayed::from_snapshot(written), replay);
        }
        // Another subsystem's record is skipped, as at replay.
        image.apply(0x0200, &[1]);
        assert_eq!(Replayed::from_snapshot(Snapshot::decode(&image.encode().unwrap()).unwrap()), replay);
        // A record that does not decode: no compaction from this image until a reset.
        image.apply(KIND_REGION_FREED, &[1]);
        assert!(image.encode().is_err());
        image.reset(&start.encode().unwrap());
        assert_eq!(Snapshot::decode(&image.encode().unwrap()).unwrap(), start);
        image.reset(b"garbage");
        assert!(image.encode().is_err());
    }

    #[test]
    fn replay_rebuilds_the_state_and_a_snapshot_stands_for_it() {
        let mut m = Replayed::default();
        for c in all() {
            m.apply(c).unwrap();
        }
        // Region 4 is striped over a set: it is resumed with its session (owner updated),
        // 5 ended with session 1, 6 was freed.
        assert_eq!(m.regions.keys().copied().collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(m.sets.keys().copied().collect::<Vec<_>>(), vec![4]);
        assert_eq!(m.sets[&4], set_region(4, 2, None).placement);
        assert_eq!(m.regions[&3].owner.pid, 7);
        assert_eq!(m.regions[&4].owner.pid, 7);
        assert_eq!(m.exports().cloned().collect::<Vec<_>>(), vec![export(3, 8), export(4, 7)]);
        assert_eq!(m.next_id, 7);
        let snap = m.snapshot();
        assert_eq!(snap.regions.len(), 1);
        assert_eq!(snap.set_regions.len(), 1, "a set region is in the snapshot's own list");
        let bytes = snap.encode().unwrap();
        assert_eq!(bytes[0], SNAPSHOT_SETS_VERSION, "a snapshot with set regions is version 2");
        let back = Replayed::from_snapshot(Snapshot::decode(&bytes).unwrap());
        assert_eq!(back, m);
        // Inconsistent records change nothing.
        assert_eq!(m.apply(Change::RegionFreed { id: 1 }), Err(Inconsistency::NoRegion(1)));
        assert_eq!(m.apply(Change::RegionAllocated(region(3, 5))), Err(Inconsistency::DuplicateRegion(3)));
        assert_eq!(
            m.apply(Change::ExportRevoked { region: 3, generation: 3, secret: [1; 16] }),
            Err(Inconsistency::NoExport(3))
        );
        assert_eq!(m.apply(Change::SetRegionAllocated(set_region(4, 5, None))), Err(Inconsistency::DuplicateRegion(4)));
        assert_eq!(m, back);
    }

    #[test]
    fn a_snapshot_without_set_regions_keeps_version_1_and_a_version_1_snapshot_still_reads() {
        let mut m = Replayed::default();
        for c in all().into_iter().filter(|c| !matches!(c, Change::SetRegionAllocated(_))) {
            let _ = m.apply(c);
        }
        let bytes = m.snapshot().encode().unwrap();
        assert_eq!(bytes[0], RECORD_VERSION);
        // The bytes a build without set regions wrote for this state: the same three lists.
        let old = SnapshotV1Ref {
            next_id: m.next_id,
            regions: &m.regions.values().cloned().collect::<Vec<_>>(),
            exports: &m.exports().cloned().collect::<Vec<_>>(),
        };
        assert_eq!(payload(&old).unwrap(), bytes);
        assert_eq!(Replayed::from_snapshot(Snapshot::decode(&bytes).unwrap()), m);
        let mut v4 = bytes.clone();
        v4[0] = 4;
        assert_eq!(Snapshot::decode(&v4), Err(DurableError::Version { kind: KIND_SNAPSHOT, version: 4 }));
        // A version 2 body behind a version 1 byte (or the reverse) does not decode.
        let mut with_sets = m.snapshot();
        with_sets.set_regions.push(set_region(9, 1, None));
        let mut v2 = with_sets.encode().unwrap();
        assert_eq!(Snapshot::decode(&v2).unwrap(), with_sets);
        v2[0] = RECORD_VERSION;
        assert!(Snapshot::decode(&v2).is_err());
    }

    /// A region lost with its device stays lost, its exports revoked, through replay and a
    /// snapshot (version 3 while one is lost, the older formats again once it is freed).
    #[test]
    fn a_lost_region_stays_lost_through_replay_and_snapshot() {
        let mut m = Replayed::default();
        for c in all() {
            m.apply(c).unwrap();
        }
        m.apply(Change::ExportCreated(export(3, 5))).unwrap();
        m.apply(Change::RegionLost { id: 3 }).unwrap();
        assert_eq!(m.lost.iter().copied().collect::<Vec<_>>(), vec![3]);
        assert!(m.exports[&3].iter().all(|e| e.revoked));
        assert!(m.exports[&4].iter().all(|e| !e.revoked), "another region's exports live on");
        // A loss recorded after the region's free (both at once) changes nothing.
        let before = m.clone();
        assert_eq!(m.apply(Change::RegionLost { id: 2 }), Ok(()));
        assert_eq!(m, before);
        let bytes = m.snapshot().encode().unwrap();
        assert_eq!(bytes[0], SNAPSHOT_LOST_VERSION);
        let back = Replayed::from_snapshot(Snapshot::decode(&bytes).unwrap());
        assert_eq!(back, m);
        // A lost region that is not live in the snapshot is not carried, and a lost
        // region's export is revoked even where the snapshot says otherwise.
        let mut stray = Snapshot { lost: vec![3, 99], ..m.snapshot() };
        stray.exports.iter_mut().for_each(|e| e.revoked = false);
        let back = Replayed::from_snapshot(stray);
        assert!(back.exports().all(|e| e.revoked == (e.region == 3)), "{:?}", back.exports);
        assert_eq!(back.lost, m.lost);
        // Freed (or its session ended): no longer lost, and the snapshot drops back to the
        // format older builds read.
        m.apply(Change::RegionFreed { id: 3 }).unwrap();
        assert!(m.lost.is_empty());
        assert_eq!(m.snapshot().encode().unwrap()[0], SNAPSHOT_SETS_VERSION);
        m.apply(Change::RegionLost { id: 4 }).unwrap();
        m.apply(Change::SessionEnded { token: [2; 16] }).unwrap();
        assert!(m.lost.is_empty() && m.regions.is_empty());
        // A version 3 body behind a version 2 byte does not decode.
        let mut v2 = bytes;
        v2[0] = SNAPSHOT_SETS_VERSION;
        assert!(Snapshot::decode(&v2).is_err());
    }
}
