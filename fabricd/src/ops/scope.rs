//! What one client may see and touch: its [`Scope`], from its credentials and the
//! partition bindings, and the fabric, map and translations seen through it.
//!
//! The rules (`docs/fabricd.md`, "Security and partitions"):
//! - root and members of `socket.admin_group` are admins and see everything;
//! - any other client is bound to every partition whose binding names its uid, its
//!   primary gid or one of its supplementary groups; bound to several, it sees their union;
//! - a client no partition binds sees the whole fabric, unless
//!   `security.require_partition` is set: then fabric and memory operations refuse it.

use std::collections::HashSet;
use std::sync::Arc;

use fabric_addrmap::{Listing, NodeUsage, RangeInfo, RangeKind, Snapshot, TranslateError};
use fabric_domain::PartitionRecord;
use fabric_proto::wire::{BoundedVec, ErrorBody, ErrorCode, TranslateQuery, TranslateResponse, Translation};
use fabric_topology::{DeviceId, DeviceIdx, DeviceKind, Fabric, Inventory};

use crate::daemon::{Daemon, View};
use crate::events::Reach;
use crate::ops::dispatch::errors::refusal;
use crate::ops::principal::{Client, Principal};
use crate::store::MapView;

/// What a client's requests reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Everything: an admin, or an unbound client while partitions are not required.
    All,
    /// The union of these partitions (names, sorted).
    Bound(Vec<String>),
    /// Nothing: bound to no partition while `security.require_partition` is set.
    Unbound,
}

/// A client as one request sees it: its principal and standing (fixed at connect), the
/// map and bindings published when the request began, and the scope those bindings give it.
///
/// The rule for a connection that lives across binding changes: its scope is resolved
/// anew for each request ([`Caller::resolve`]), from the bindings current when that
/// request is authorized, so a client bound or unbound by an admin is treated so from
/// its next request on; a request already authorized finishes under the scope it was
/// authorized with (the partition change waits for it: [`crate::ops::dispatch::gate`]).
/// The scope and the partitions' device sets come from one [`MapView`], so a request
/// never pairs new bindings with an old map or the other way round.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Who, and whether an admin.
    pub client: Arc<Client>,
    /// What it reaches.
    pub scope: Scope,
    /// The map and bindings the scope was resolved against.
    pub map: Arc<MapView>,
    /// The domain's partitions that bind the caller (a domain node; see
    /// [`Caller::bind_domain`]): their names are in `scope` too.
    pub domain_partitions: Vec<PartitionRecord>,
}

impl Caller {
    /// `client` with the scope the current map view gives it.
    pub fn resolve(d: &Daemon, client: Arc<Client>) -> Self {
        let mut caller = Self::resolve_in(d.map_view(), d.config.security.require_partition, client);
        if let Some(domain) = &d.domain {
            caller.bind_domain(domain.view().partitions());
        }
        caller
    }

    /// Adds the domain's partitions that bind a client who is no admin (`partitions/<name>`
    /// records, defined in etcd for devices of any nodes): the client is bound to their
    /// union with its node's own partitions.
    pub fn bind_domain<'a>(&mut self, partitions: impl Iterator<Item = &'a PartitionRecord>) {
        if self.client.admin {
            return;
        }
        let p = &self.client.principal;
        let groups = p.groups();
        self.domain_partitions = partitions.filter(|r| r.binds(p.uid(), &groups)).cloned().collect();
        if self.domain_partitions.is_empty() {
            return;
        }
        let mut names: Vec<String> = match &self.scope {
            Scope::Bound(b) => b.clone(),
            _ => Vec::new(),
        };
        names.extend(self.domain_partitions.iter().map(|r| r.name.clone()));
        names.sort_unstable();
        names.dedup();
        self.scope = Scope::Bound(names);
    }

    /// Another node asking for its client (`client`'s principal is a
    /// [`Principal::Peer`]): bound by name to the domain's partitions the node vouches its
    /// client is bound to, or, claiming none, to no partition in particular (the peer table,
    /// [`crate::ops::dispatch::authz`], decides by the claims, not by this scope).
    pub fn of_node(d: &Daemon, client: Arc<Client>) -> Self {
        let scope = match &client.principal {
            Principal::Peer(n) if !n.claims.is_empty() => {
                let mut names = n.claims.clone();
                names.sort_unstable();
                names.dedup();
                Scope::Bound(names)
            }
            _ => Scope::All,
        };
        Self { client, scope, map: d.map_view(), domain_partitions: Vec::new() }
    }

    /// `client` with the scope `map`'s bindings give it (`require_partition`: whether a
    /// client bound to nothing is refused, `security.require_partition`).
    pub fn resolve_in(map: Arc<MapView>, require_partition: bool, client: Arc<Client>) -> Self {
        let scope = if client.admin {
            Scope::All
        } else {
            let p = &client.principal;
            let bound = map.bound(p.uid(), &p.groups());
            if !bound.is_empty() {
                Scope::Bound(bound)
            } else if require_partition {
                Scope::Unbound
            } else {
                Scope::All
            }
        };
        Self { client, scope, map, domain_partitions: Vec::new() }
    }

    /// The address map this request sees.
    pub fn snapshot(&self) -> &Arc<Snapshot> {
        &self.map.map
    }

    /// Whether it is an admin.
    pub fn admin(&self) -> bool {
        self.client.admin
    }

    /// Its uid, for messages and listings.
    pub fn uid(&self) -> u32 {
        self.client.principal.uid()
    }

    /// Its principal.
    pub fn principal(&self) -> &Principal {
        &self.client.principal
    }

    /// Refuses a client bound to nothing while partitions are required.
    pub fn require_scope(&self) -> Result<(), ErrorBody> {
        match self.scope {
            Scope::Unbound => Err(refusal(
                ErrorCode::PermissionDenied,
                format!(
                    "uid {} is bound to no partition and security.require_partition is set; ask an admin to bind it",
                    self.uid()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Whether the caller is bound to partition `name` (admins count as bound to all).
    pub fn in_partition(&self, name: &str) -> bool {
        self.admin() || matches!(&self.scope, Scope::Bound(b) if b.iter().any(|n| n == name))
    }

    /// Which device and link events the caller may receive.
    pub fn event_reach(&self) -> Reach {
        match &self.scope {
            Scope::All => Reach::All,
            Scope::Bound(names) => Reach::Partitions(names.clone()),
            Scope::Unbound => Reach::Partitions(Vec::new()),
        }
    }

    /// The member devices of the caller's partitions (`None`: no restriction).
    pub fn members(&self) -> Result<Option<HashSet<DeviceId>>, ErrorBody> {
        self.require_scope()?;
        let Scope::Bound(names) = &self.scope else { return Ok(None) };
        Ok(Some(
            self.snapshot()
                .state()
                .partitions
                .iter()
                .filter(|p| names.contains(&p.name))
                .flat_map(|p| p.devices.iter().cloned())
                .chain(self.domain_partitions.iter().flat_map(|p| p.devices.iter().cloned()))
                .collect(),
        ))
    }

    /// The fabric `Status` reports to the caller: its view, or for a client bound to
    /// nothing (status stays open to it) no devices, only the backend reports.
    pub fn status_view(&self, d: &Daemon) -> Result<Arc<View>, ErrorBody> {
        if self.scope != Scope::Unbound {
            return self.view(d);
        }
        let mut inv = Inventory::new();
        inv.backends = d.view().fabric.inventory().backends.clone();
        View::build(inv).map(Arc::new).map_err(|e| refusal(ErrorCode::Internal, format!("status view: {e}")))
    }

    /// The vanished devices the caller may know of (none for a client bound to nothing).
    pub fn vanished(&self, d: &Daemon) -> Result<Vec<String>, ErrorBody> {
        if self.scope == Scope::Unbound {
            return Ok(Vec::new());
        }
        let all = d.vanished();
        Ok(match self.members()? {
            None => all,
            Some(m) => {
                let m: HashSet<String> = m.iter().map(ToString::to_string).collect();
                all.into_iter().filter(|id| m.contains(id)).collect()
            }
        })
    }

    /// The caller's partitions, comma-separated, for messages.
    pub fn partition_names(&self) -> String {
        match &self.scope {
            Scope::Bound(b) => b.join(", "),
            Scope::All => "all".to_owned(),
            Scope::Unbound => "none".to_owned(),
        }
    }

    /// The fabric as the caller sees it: the whole view, or the view rebuilt from the
    /// devices its partitions reach (see [`scoped_inventory`]).
    pub fn view(&self, d: &Daemon) -> Result<Arc<View>, ErrorBody> {
        let Some(members) = self.members()? else { return Ok(d.view()) };
        let full = d.view();
        let inv = scoped_inventory(&full.fabric, &members);
        View::build(inv).map(Arc::new).map_err(|e| refusal(ErrorCode::Internal, format!("partition view: {e}")))
    }
}

fn is_switch(k: DeviceKind) -> bool {
    matches!(k, DeviceKind::NvSwitch | DeviceKind::CxlSwitch | DeviceKind::UalinkSwitch | DeviceKind::NetworkSwitch)
}

/// The member devices of partitions `names`, as identities in text form (for events).
pub fn partition_members(snap: &Snapshot, names: &[String]) -> HashSet<String> {
    snap.state()
        .partitions
        .iter()
        .filter(|p| names.contains(&p.name))
        .flat_map(|p| p.devices.iter().map(ToString::to_string))
        .collect()
}

/// The part of a fabric a partition reaches: its member devices, their ancestors in the
/// PCI/CXL hierarchy (CPU, host bridge, bridges: so the tree and the matrix classes stay
/// what they are), the switches a member links to directly (so NVLink/UALink classes
/// stay), and the ancestors of those switches; the links among them; the CXL decoders
/// they own (and root decoders) and the CXL regions whose targets they all are. Backend
/// reports are kept whole. Device order is the fabric's.
pub fn scoped_inventory(fabric: &Fabric, members: &HashSet<DeviceId>) -> Inventory {
    let inv = fabric.inventory();
    let mut keep = vec![false; inv.devices.len()];
    let mark = |keep: &mut Vec<bool>, idx: DeviceIdx| {
        for a in fabric.ancestors(idx) {
            keep[a.get()] = true;
        }
    };
    for (i, dev) in inv.devices.iter().enumerate() {
        if !members.contains(&dev.id) {
            continue;
        }
        let idx = DeviceIdx(i as u32);
        mark(&mut keep, idx);
        for (n, _) in fabric.neighbors(idx) {
            if is_switch(fabric.device(n).kind) {
                mark(&mut keep, n);
            }
        }
    }
    let mut out = Inventory::new();
    let mut remap = vec![None; inv.devices.len()];
    for (i, dev) in inv.devices.iter().enumerate() {
        if keep[i] {
            // Ids are unique in an indexed fabric, so this never dedupes.
            remap[i] = out.add_device(dev.clone()).ok();
        }
    }
    for l in &inv.links {
        if let (Some(a), Some(b)) = (remap[l.a.get()], remap[l.b.get()]) {
            let mut l = l.clone();
            l.a = a;
            l.b = b;
            out.add_link(l);
        }
    }
    let kept = |id: &DeviceId| inv.find(id).is_some_and(|i| keep[i.get()]);
    out.cxl.decoders = inv.cxl.decoders.iter().filter(|dcd| dcd.owner.as_ref().is_none_or(kept)).cloned().collect();
    out.cxl.regions = inv.cxl.regions.iter().filter(|r| r.targets.iter().all(kept)).cloned().collect();
    out.backends = inv.backends.clone();
    out
}

/// The map listing restricted to ranges whose devices are all members: direct ranges and
/// holes of member resources, interleave sets of member resources only. Totals and node
/// usage are recomputed over what is left.
pub fn scoped_listing(snap: &Snapshot, members: &HashSet<DeviceId>) -> Listing {
    let st = snap.state();
    let mut owners: HashSet<String> =
        st.placements.iter().filter(|p| members.contains(&p.key.device)).map(|p| p.key.to_string()).collect();
    owners.extend(
        st.interleaves
            .iter()
            .filter(|s| s.members.iter().all(|m| members.contains(&m.device)))
            .map(|s| format!("set:{}", s.name)),
    );
    restrict_listing(snap.listing(), |r| owners.contains(&r.owner))
}

/// `l` with only the ranges `keep` accepts; totals and node usage are recomputed over
/// what is left, and nodes with nothing left are dropped.
pub fn restrict_listing(mut l: Listing, keep: impl Fn(&RangeInfo) -> bool) -> Listing {
    l.ranges.retain(|r| keep(r));
    let mut nodes: Vec<NodeUsage> = Vec::new();
    for n in &l.nodes {
        let inside: Vec<_> = l.ranges.iter().filter(|r| r.start >= n.start && r.start - n.start < n.span).collect();
        if inside.is_empty() {
            continue;
        }
        let reserved: u64 = inside.iter().map(|r| r.reserved).sum();
        let mapped: u64 = inside.iter().map(|r| r.size).sum();
        nodes.push(NodeUsage {
            node: n.node.clone(),
            start: n.start,
            span: n.span,
            reserved,
            mapped,
            utilisation: reserved as f64 / n.span as f64,
            state: n.state.clone(),
        });
    }
    l.nodes = nodes;
    l.mapped_bytes = l.ranges.iter().map(|r| r.size).sum();
    l.hole_bytes = l.ranges.iter().filter(|r| r.kind == RangeKind::Hole).map(|r| r.reserved).sum();
    l.high_water = l.ranges.iter().map(|r| r.start + r.reserved).max().unwrap_or(0);
    l
}

/// Whether a translation answer may be shown to a client whose partitions hold the
/// devices `members` (identities as text): it names a member's resource (or the query
/// named one), or says nothing is mapped there. Interleave sets and holes are not.
pub fn visible(query: &TranslateQuery, t: &Translation, members: &HashSet<String>) -> bool {
    let member = |device: &str| members.contains(device.split('#').next().unwrap_or(device));
    match t {
        Translation::Unmapped | Translation::NotInPartition | Translation::UnknownResource => true,
        Translation::Resource { resource, set: None, .. } => member(resource.device.as_str()),
        Translation::Remote { resource: Some(resource), set: None, .. } => member(resource.device.as_str()),
        Translation::Gfa(_) => {
            matches!(query, TranslateQuery::Resource { resource, .. } if member(resource.device.as_str()))
        }
        Translation::Hole { owner } => member(owner.as_str()),
        Translation::Resource { .. } | Translation::Remote { .. } => false,
    }
}

/// Answers translation queries through the views of `partitions` (their union): a GFA or
/// resource of another partition is `NotInPartition`, never its owner.
pub fn translate_in(snap: &Snapshot, partitions: &[String], queries: &[TranslateQuery]) -> TranslateResponse {
    let views: Vec<_> = partitions.iter().filter_map(|p| snap.partition(p)).collect();
    let results = queries
        .iter()
        .map(|q| match q {
            TranslateQuery::Gfa(g) => {
                let mut hole = None;
                for v in &views {
                    match v.translate(*g) {
                        Ok(loc) => return crate::ops::located(snap, &loc),
                        Err(e @ TranslateError::Hole { .. }) => hole = Some(e),
                        Err(_) => {}
                    }
                }
                match (hole, snap.translate(*g)) {
                    (Some(e), _) => crate::ops::failed(snap, e),
                    (None, Err(TranslateError::Unmapped { .. })) => Translation::Unmapped,
                    (None, _) => Translation::NotInPartition,
                }
            }
            TranslateQuery::Resource { resource, offset } => {
                let Ok(device) = resource.device.parse::<DeviceId>() else { return Translation::UnknownResource };
                let mut other = None;
                for v in &views {
                    match v.reverse(&device, resource.memory.into(), resource.ordinal, *offset) {
                        Ok(g) => return Translation::Gfa(g),
                        Err(TranslateError::ResourceNotInPartition) => {}
                        Err(e) => other = Some(e),
                    }
                }
                match other {
                    Some(e) => crate::ops::failed(snap, e),
                    None => Translation::NotInPartition,
                }
            }
        })
        .collect();
    TranslateResponse { results: BoundedVec::new(results).unwrap_or_default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_addrmap::AddressMap;

    fn hgx() -> Fabric {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
        Fabric::build(fabric_drivers::sim::load(&p).unwrap()).unwrap()
    }

    #[test]
    fn a_partition_sees_its_devices_their_ancestors_and_switches_only() {
        let f = hgx();
        let gpus: Vec<DeviceId> =
            f.inventory().devices.iter().filter(|d| d.gpu.is_some()).map(|d| d.id.clone()).collect();
        assert!(gpus.len() >= 4);
        let members: HashSet<DeviceId> = gpus[..2].iter().cloned().collect();
        let inv = scoped_inventory(&f, &members);
        let scoped = Fabric::build(inv).unwrap();
        let seen: Vec<&DeviceId> =
            scoped.inventory().devices.iter().filter(|d| d.gpu.is_some()).map(|d| &d.id).collect();
        assert_eq!(seen, gpus[..2].iter().collect::<Vec<_>>());
        for g in &gpus[2..] {
            assert!(scoped.inventory().find(g).is_none(), "{g} leaked into the view");
        }
        // The two GPUs still reach each other as in the whole fabric.
        let (a, b) = (scoped.inventory().find(&gpus[0]).unwrap(), scoped.inventory().find(&gpus[1]).unwrap());
        let (fa, fb) = (f.inventory().find(&gpus[0]).unwrap(), f.inventory().find(&gpus[1]).unwrap());
        assert_eq!(scoped.classify(a, b), f.classify(fa, fb));
        assert!(scoped.inventory().devices.len() < f.inventory().devices.len());
    }

    #[test]
    fn translation_through_partitions_hides_the_others() {
        let f = hgx();
        let mut map = AddressMap::new(Default::default()).unwrap();
        map.update(f.inventory()).unwrap();
        let gpus: Vec<DeviceId> =
            f.inventory().devices.iter().filter(|d| d.gpu.is_some()).map(|d| d.id.clone()).collect();
        map.partition("a", &gpus[..1]);
        map.partition("b", &gpus[1..2]);
        let snap = map.snapshot();
        let listing = snap.listing();
        let start_of =
            |id: &DeviceId| listing.ranges.iter().find(|r| r.owner.starts_with(&format!("{id}#"))).unwrap().start;
        let (ga, gb) = (start_of(&gpus[0]), start_of(&gpus[1]));
        let q = [TranslateQuery::Gfa(ga), TranslateQuery::Gfa(gb), TranslateQuery::Gfa(u64::MAX >> 8)];
        let r = translate_in(&snap, &["a".to_owned()], &q);
        assert!(matches!(r.results[0], Translation::Resource { .. }));
        assert_eq!(r.results[1], Translation::NotInPartition);
        assert_eq!(r.results[2], Translation::Unmapped);
        let both = translate_in(&snap, &["a".to_owned(), "b".to_owned()], &q);
        assert!(matches!(both.results[1], Translation::Resource { .. }), "bound to both: the union");
        let members: HashSet<DeviceId> = gpus[..1].iter().cloned().collect();
        let l = scoped_listing(&snap, &members);
        assert!(!l.ranges.is_empty());
        assert!(l.ranges.iter().all(|r| r.owner.starts_with(&format!("{}#", gpus[0]))));
        assert_eq!(l.mapped_bytes, l.ranges.iter().map(|r| r.size).sum::<u64>());
    }
}
