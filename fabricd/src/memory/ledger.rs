//! The ledger: who holds what in the registry — regions and where they lie (`space.rs`),
//! exports, imports, DMA registrations and each uid's usage — as a plain value. Its operations decide
//! (ownership, an export's policy, admission) and account (usage charged and given back,
//! revocations queued); they do no I/O, take no lock, and return what their caller carries
//! out (the region, exports and imports a removal ended; the registrations an ending
//! detached, queued like revocations for the shell to unpin).
//! The registry's shell (`mod.rs`: the lock, the journal, resources' files and backings, effects)
//! stays the one place where anything happens, and the ledger's rules are tested alone
//! (`ledger_model_tests.rs`, against the journal's replay model).

use std::collections::HashMap;

use crate::memory::Identity;
use fabric_proto::wire::{AccessMode, ExportHandle, ExportPolicy, Revocation, RevocationReason, Secret, SessionToken};

use super::backings::Backing;
use super::durable::{ExportRecord, Owner};
use super::{MemoryError, Reclaimed};
use crate::dma::{Covers, Registration};

/// Who holds what (see the module doc).
#[derive(Debug, Default)]
pub(super) struct Ledger {
    /// Live regions (and reserved ones once published), by id.
    pub(super) regions: HashMap<u64, Region>,
    /// Where they lie: each resource's taken ranges, and freed ones parked (`space.rs`).
    pub(super) space: super::space::Space,
    /// Exports of live regions, revoked ones included.
    pub(super) exports: Vec<Export>,
    /// Live imports, by id.
    pub(super) imports: HashMap<u64, Import>,
    /// What each uid holds, reservations included.
    pub(super) usage: HashMap<u32, Usage>,
    /// The next id of a region, import or registration (ids are never reused).
    pub(super) next_id: u64,
    /// DMA registrations and the IOVA space of each domain (their pins are handles: an
    /// ended registration is detached here and unpinned as an effect, outside the lock).
    pub(super) dma: crate::dma::Registry,
    /// Revocations to tell importers: (importing session, what ended).
    pub(super) revocations: Vec<(u64, Revocation)>,
    /// Registrations detached since the last [`super::Memory::finish`], by id: no copy
    /// resolves them; the shell unmaps and unpins them outside the lock and gives their
    /// usage back then.
    pub(super) unregistered: Vec<(u64, Registration)>,
    /// Regions with registrations detached whose IOMMU mapping is not undone yet, with
    /// their count: a region freed meanwhile keeps its range until they are (a device may
    /// still reach it; `State::release_range`).
    pub(super) unmapping: HashMap<u64, u32>,
    /// Something a copy may depend on ended since the last [`super::Memory::finish`].
    pub(super) ended: bool,
}

/// A region: who owns it, where it lies, what backs it.
#[derive(Debug)]
pub(super) struct Region {
    pub(super) generation: u64,
    pub(super) owner: Identity,
    /// The owner process's start time (see [`super::pid_start_time`]).
    pub(super) pid_start: Option<u64>,
    /// The owning session's token, journaled with the region.
    pub(super) token: SessionToken,
    pub(super) session: u64,
    pub(super) resource: usize,
    pub(super) offset: u64,
    pub(super) len: u64,
    /// What holds its bytes.
    pub(super) backing: Backing,
    /// Its device vanished or failed: exports revoked, no new ones.
    pub(super) lost: bool,
}

impl Region {
    pub(super) fn durable_owner(&self) -> Owner {
        Owner { uid: self.owner.uid, gid: self.owner.gid, pid: self.owner.pid, pid_start: self.pid_start }
    }

    /// The vendor object it is, for an adopted region (not journaled).
    pub(super) fn object(&self) -> Option<&super::adopt::Object> {
        self.backing.object()
    }
}

/// An export: a capability to a region (its handle's secret) and who it admits.
#[derive(Debug)]
pub(super) struct Export {
    pub(super) handle: ExportHandle,
    pub(super) owner_uid: u32,
    pub(super) policy: ExportPolicy,
    pub(super) revoked: bool,
}

impl Export {
    /// Its journal record.
    pub(super) fn record(&self) -> ExportRecord {
        ExportRecord {
            region: self.handle.region,
            generation: self.handle.generation,
            secret: *self.handle.secret.expose(),
            owner_uid: self.owner_uid,
            uids: self.policy.uids.clone(),
            gids: self.policy.gids.clone(),
            partition: self.policy.partition.clone(),
            access: self.policy.access,
            revoked: self.revoked,
        }
    }
}

/// An import of a region through an export, by a session of this node or of an
/// importer node.
#[derive(Debug)]
pub(super) struct Import {
    pub(super) region: u64,
    pub(super) generation: u64,
    /// The export it came through.
    pub(super) via: ExportHandle,
    pub(super) uid: u32,
    pub(super) session: u64,
    /// Access granted (bounds what a registration of the import may allow).
    pub(super) access: AccessMode,
    /// Counted in its uid's usage (false for an importer node's import where the domain
    /// does not share identities: `limits::Holder`).
    pub(super) per_uid: bool,
}

/// What a uid holds, against its limits (also the share one object adds).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Usage {
    pub(super) bytes: u64,
    pub(super) objects: u64,
    /// Bytes pinned by registrations.
    pub(super) pinned: u64,
    /// Descriptors its objects keep open (`held.rs`).
    pub(super) fds: u64,
}

impl Usage {
    /// A region's share: its bytes, one object, and a descriptor when it keeps one.
    pub(super) fn region(len: u64, fds: u64) -> Self {
        Usage { bytes: len, objects: 1, pinned: 0, fds }
    }

    /// One object (an export, an import counted in its uid's usage).
    pub(super) const OBJECT: Usage = Usage { bytes: 0, objects: 1, pinned: 0, fds: 0 };

    /// A registration's share: its pinned bytes, one object and the descriptor it keeps.
    pub(super) fn registration(span: u64) -> Self {
        Usage { bytes: 0, objects: 1, pinned: span, fds: 1 }
    }
}

/// What [`Ledger::remove_region`] took out.
#[derive(Debug)]
pub(super) struct Removed {
    /// The region.
    pub(super) region: Region,
    /// Its exports that were live (not revoked) when it went.
    pub(super) exports: u64,
    /// Its imports, each told with a revocation.
    pub(super) imports: Vec<(u64, Import)>,
    /// Registrations detached with it: of the region and of its imports.
    pub(super) registrations: u64,
}

impl Ledger {
    /// A fresh id for a region, an import or a registration (never reused).
    pub(super) fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// What `uid` holds.
    pub(super) fn usage_of(&self, uid: u32) -> Usage {
        self.usage.get(&uid).copied().unwrap_or_default()
    }

    /// Counts `held` in `uid`'s usage.
    pub(super) fn charge(&mut self, uid: u32, held: Usage) {
        let u = self.usage.entry(uid).or_default();
        u.bytes += held.bytes;
        u.objects += held.objects;
        u.pinned += held.pinned;
        u.fds += held.fds;
    }

    /// Gives `held` back from `uid`'s usage.
    pub(super) fn discharge(&mut self, uid: u32, held: Usage) {
        let u = self.usage.entry(uid).or_default();
        u.bytes = u.bytes.saturating_sub(held.bytes);
        u.objects = u.objects.saturating_sub(held.objects);
        u.pinned = u.pinned.saturating_sub(held.pinned);
        u.fds = u.fds.saturating_sub(held.fds);
    }

    /// Publishes a region whose share the caller charged when it reserved the id.
    pub(super) fn publish_region(&mut self, id: u64, region: Region) {
        self.regions.insert(id, region);
    }

    /// Takes out a region restored a moment ago that has no exports or imports yet, its
    /// share given back.
    pub(super) fn unpublish_region(&mut self, id: u64) -> Option<Region> {
        let r = self.regions.remove(&id)?;
        let fds = u64::from(r.object().is_some_and(|o| o.holds_fd()));
        self.discharge(r.owner.uid, Usage::region(r.len, fds));
        Some(r)
    }

    /// A region `session` owns.
    pub(super) fn owned(&self, region: u64, session: u64) -> Result<&Region, MemoryError> {
        let r = self.regions.get(&region).ok_or_else(|| MemoryError::NotFound(format!("no region {region}")))?;
        if r.session != session {
            return Err(MemoryError::PermissionDenied(format!("region {region} belongs to another session")));
        }
        Ok(r)
    }

    /// The regions `session` owns.
    pub(super) fn regions_of(&self, session: u64) -> Vec<u64> {
        self.regions.iter().filter(|(_, r)| r.session == session).map(|(k, _)| *k).collect()
    }

    /// The imports `session` holds.
    pub(super) fn imports_of(&self, session: u64) -> Vec<u64> {
        self.imports.iter().filter(|(_, i)| i.session == session).map(|(k, _)| *k).collect()
    }

    /// The export `handle` names, its secret compared in constant time with every
    /// export's, with no early exit.
    pub(super) fn find_export(&mut self, handle: &ExportHandle) -> Option<&mut Export> {
        let mut found = None;
        for (i, e) in self.exports.iter().enumerate() {
            if e.handle.verify(handle) {
                found = Some(i);
            }
        }
        found.map(|i| &mut self.exports[i])
    }

    /// A new export of a region `session` owns, not yet counted or published: refused for
    /// a lost region, and read-only for a vendor object (its importers' drivers map it
    /// read-write).
    pub(super) fn plan_export(
        &self,
        owner: &Identity,
        session: u64,
        region: u64,
        policy: ExportPolicy,
        secret: Secret,
    ) -> Result<Export, MemoryError> {
        let r = self.owned(region, session)?;
        if r.lost {
            return Err(MemoryError::DeviceLost(format!("region {region}'s device vanished or failed")));
        }
        if policy.access == AccessMode::ReadOnly && r.object().is_some() {
            return Err(MemoryError::BadRequest(format!(
                "region {region} is a vendor object: its importers' drivers map it read-write, so it cannot be exported read-only"
            )));
        }
        let handle = ExportHandle { node: None, region, generation: r.generation, secret };
        Ok(Export { handle, owner_uid: owner.uid, policy, revoked: false })
    }

    /// Publishes an export planned by [`Ledger::plan_export`] whose object the caller
    /// charged while its record was written; refused (and the object given back) when
    /// the region was freed meanwhile, published revoked when it was lost meanwhile.
    pub(super) fn publish_export(&mut self, mut export: Export) -> Result<(), MemoryError> {
        let region = export.handle.region;
        let Some(r) = self.regions.get(&region).filter(|r| r.generation == export.handle.generation) else {
            self.discharge(export.owner_uid, Usage::OBJECT);
            return Err(MemoryError::NotFound(format!("region {region} was freed meanwhile")));
        };
        // Lost while its record was written (after it, in the journal): revoked, as the
        // journal's replay makes it.
        export.revoked |= r.lost;
        self.exports.push(export);
        Ok(())
    }

    /// The export `handle` names, when `session` owns its region and may revoke it.
    pub(super) fn revocable(&mut self, session: u64, handle: &ExportHandle) -> Result<ExportHandle, MemoryError> {
        let owner_session = self.regions.get(&handle.region).map(|r| r.session);
        let e = self.find_export(handle).ok_or(MemoryError::InvalidHandle)?;
        if owner_session != Some(session) {
            return Err(MemoryError::PermissionDenied("only the region's owner may revoke its exports".into()));
        }
        Ok(e.handle)
    }

    /// Marks export `via` revoked and tells every import made through it (the imports
    /// stay: their holders release them, but DMA through them ends now: their
    /// registrations are detached). Returns how many registrations were.
    pub(super) fn revoke(&mut self, via: &ExportHandle) -> u64 {
        if let Some(e) = self.find_export(via) {
            e.revoked = true;
        }
        self.ended = true;
        let told: Vec<(u64, Revocation)> = self
            .imports
            .iter()
            .filter(|(_, i)| i.via.verify(via))
            .map(|(k, i)| {
                let r = Revocation {
                    region: i.region,
                    generation: i.generation,
                    import: *k,
                    reason: RevocationReason::Revoked,
                };
                (i.session, r)
            })
            .collect();
        let ids: Vec<u64> = told.iter().map(|(_, r)| r.import).collect();
        self.revocations.extend(told);
        self.detach_registrations(|g| matches!(g.covers, Covers::Import(k) if ids.contains(&k)))
    }

    /// Detaches the registrations of region `region` and of `imports` (see `unregistered`).
    /// Returns how many.
    fn detach_covering(&mut self, region: u64, imports: &[u64]) -> u64 {
        self.detach_registrations(|g| match g.covers {
            Covers::Region(k) => k == region,
            Covers::Import(k) => imports.contains(&k),
            Covers::Fd | Covers::Process => false,
        })
    }

    /// Detaches every registration that matches (see `unregistered`). Returns how many.
    pub(super) fn detach_registrations(&mut self, pred: impl Fn(&Registration) -> bool) -> u64 {
        let ids = self.dma.ids_where(pred);
        ids.into_iter().filter(|&id| self.detach_registration(id)).count() as u64
    }

    /// Detaches registration `id` (see `unregistered`): whether it was there.
    pub(super) fn detach_registration(&mut self, id: u64) -> bool {
        let Some(r) = self.dma.detach(id) else { return false };
        // A copy through it ends too.
        self.ended = true;
        if let Some(region) = r.iommu_region() {
            *self.unmapping.entry(region).or_default() += 1;
        }
        self.unregistered.push((id, r));
        true
    }

    /// The checks of an import by handle: the secret and generation name a live export,
    /// it is not revoked, its policy admits `who` and the access. Returns the export.
    pub(super) fn admit(
        &mut self,
        who: &Identity,
        handle: &ExportHandle,
        access: AccessMode,
    ) -> Result<ExportHandle, MemoryError> {
        let e = self.find_export(handle).ok_or(MemoryError::InvalidHandle)?;
        if e.revoked {
            return Err(MemoryError::Revoked);
        }
        let policy = &e.policy;
        // A policy naming a partition and no uids or gids admits the partition's clients:
        // the caller (`scope::check_import`) has checked that the importer is bound to it.
        let admitted = if policy.uids.is_empty() && policy.gids.is_empty() {
            who.uid == e.owner_uid || policy.partition.is_some()
        } else {
            policy.uids.contains(&who.uid) || policy.gids.contains(&who.gid)
        };
        if !admitted {
            return Err(MemoryError::PermissionDenied(format!("the export's policy does not admit uid {}", who.uid)));
        }
        if access == AccessMode::ReadWrite && policy.access == AccessMode::ReadOnly {
            return Err(MemoryError::PermissionDenied("the export is read-only".into()));
        }
        Ok(e.handle)
    }

    /// Records an admitted import of `handle`'s region through export `via`, counted in
    /// the importer's uid's usage when `per_uid`: its id and the region's generation.
    pub(super) fn record_import(
        &mut self,
        who: &Identity,
        session: u64,
        (handle, via): (&ExportHandle, ExportHandle),
        access: AccessMode,
        per_uid: bool,
    ) -> Result<(u64, u64), MemoryError> {
        let generation = self.regions.get(&handle.region).ok_or(MemoryError::InvalidHandle)?.generation;
        let id = self.take_id();
        let import = Import { region: handle.region, generation, via, uid: who.uid, session, access, per_uid };
        self.imports.insert(id, import);
        if per_uid {
            self.charge(who.uid, Usage::OBJECT);
        }
        Ok((id, generation))
    }

    /// Whether the export import `i` came through was revoked (the import stays until its
    /// holder releases it, but no data moves through it).
    pub(super) fn import_revoked(&self, i: &Import) -> bool {
        self.exports.iter().any(|e| e.revoked && i.via.verify(&e.handle))
    }

    /// An import `session` holds, checked before it is released.
    pub(super) fn releasable(&self, session: u64, import: u64) -> Result<(), MemoryError> {
        match self.imports.get(&import) {
            None => Err(MemoryError::NotFound(format!("no import {import}"))),
            Some(i) if i.session != session => {
                Err(MemoryError::PermissionDenied(format!("import {import} belongs to another session")))
            }
            Some(_) => Ok(()),
        }
    }

    /// Takes import `id` out, its object given back and its registrations detached.
    pub(super) fn remove_import(&mut self, id: u64) -> Option<Import> {
        let i = self.imports.remove(&id)?;
        self.ended = true;
        self.detach_registrations(|g| g.covers == Covers::Import(id));
        if i.per_uid {
            self.discharge(i.uid, Usage::OBJECT);
        }
        Some(i)
    }

    /// Takes region `id` out with its exports and imports, their usage given back, each
    /// import told with a revocation for `reason`, the registrations of the region and of
    /// its imports detached.
    pub(super) fn remove_region(&mut self, id: u64, reason: RevocationReason) -> Option<Removed> {
        let region = self.regions.remove(&id)?;
        self.ended = true;
        let fds = u64::from(region.object().is_some_and(|o| o.holds_fd()));
        self.discharge(region.owner.uid, Usage::region(region.len, fds));
        let mut exports = 0;
        let mut released = Vec::new();
        self.exports.retain(|e| {
            if e.handle.region != id {
                return true;
            }
            exports += u64::from(!e.revoked);
            released.push(e.owner_uid);
            false
        });
        for uid in released {
            self.discharge(uid, Usage::OBJECT);
        }
        let ids: Vec<u64> = self.imports.iter().filter(|(_, i)| i.region == id).map(|(k, _)| *k).collect();
        let registrations = self.detach_covering(id, &ids);
        let mut imports = Vec::with_capacity(ids.len());
        for k in ids {
            if let Some(i) = self.remove_import(k) {
                let r = Revocation { region: id, generation: i.generation, import: k, reason };
                self.revocations.push((i.session, r));
                imports.push((k, i));
            }
        }
        Some(Removed { region, exports, imports, registrations })
    }

    /// Regions `ids` are lost with their device: each marked lost, its live exports
    /// revoked, each importer told and its owner too (a revocation with import 0), DMA
    /// through it or its imports ended (their registrations detached); the regions and
    /// imports stay until freed or released (a mapping cannot be taken back). What was
    /// lost now (regions, exports revoked, imports told, registrations detached), and each
    /// region with its generation.
    pub(super) fn lose(&mut self, mut ids: Vec<u64>) -> (Reclaimed, Vec<(u64, u64)>) {
        ids.sort_unstable();
        let mut out = Reclaimed::default();
        let mut lost = Vec::with_capacity(ids.len());
        for region in ids {
            let Some(r) = self.regions.get_mut(&region).filter(|r| !r.lost) else { continue };
            r.lost = true;
            let (generation, owner) = (r.generation, r.session);
            out.regions += 1;
            for e in self.exports.iter_mut().filter(|e| e.handle.region == region && !e.revoked) {
                e.revoked = true;
                out.exports += 1;
            }
            let mut told: Vec<(u64, Revocation)> = self
                .imports
                .iter()
                .filter(|(_, i)| i.region == region)
                .map(|(k, i)| {
                    (i.session, Revocation { region, generation, import: *k, reason: RevocationReason::DeviceLost })
                })
                .collect();
            told.sort_unstable_by_key(|(_, r)| r.import);
            out.imports += told.len() as u64;
            let imports: Vec<u64> = told.iter().map(|(_, r)| r.import).collect();
            out.registrations += self.detach_covering(region, &imports);
            self.revocations.extend(told);
            let own = Revocation { region, generation, import: 0, reason: RevocationReason::DeviceLost };
            self.revocations.push((owner, own));
            lost.push((region, generation));
        }
        self.ended |= out.regions > 0;
        (out, lost)
    }
}
