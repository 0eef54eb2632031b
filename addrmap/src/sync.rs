//! Bringing a map in line with a discovered inventory: the devices' resources (stable
//! placement) and the interleave sets the inventory's CXL regions call for, for the whole
//! domain or for one node ([`SyncScope`]) — [`sync_inventory`], a pure function over the
//! map that `fabricd` runs at start and on every rescan — and [`open_synced`], which
//! opens a state file, adds the sets not yet mapped and saves (`fabricctl map`).
//!
//! CXL region sets: a new region becomes a set; a set whose region is gone while every
//! member device remains (the region was torn down) is removed and its members are mapped
//! directly again; a set whose region changed geometry is rebuilt; a set whose members
//! vanished stays, a hole that translates again when they come back. Sets with other names
//! (made by an operator) are never touched. A region without a UUID whose name another
//! node's set over other memory holds is mapped under its node's name (`resolve`).

use std::path::Path;

use fabric_topology::cxl::CxlMode;
use fabric_topology::{Inventory, MemoryKind};

use crate::config::MapConfig;
use crate::layout::Change;
use crate::map::{AddressMap, MapError};
use crate::persist::PersistError;
use crate::state::{FABRIC_NODE, InterleaveSet, ResourceKey};

/// An interleave set a CXL region calls for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSet {
    /// `cxl-region:UUID` or `cxl-region:hpa-0x…` (a sync may map it as
    /// `cxl-region:hpa-0x…@NODE`: see the module doc).
    pub name: String,
    /// Interleave ways.
    pub ways: u32,
    /// Interleave granularity in bytes.
    pub granularity: u64,
    /// Members in position order.
    pub members: Vec<ResourceKey>,
    /// Bytes per member.
    pub member_size: u64,
}

/// The name of the interleave set a CXL region becomes: `cxl-region:UUID`, else
/// `cxl-region:hpa-0x…` (`None` when the region has neither).
pub fn set_name(r: &fabric_topology::cxl::CxlRegion) -> Option<String> {
    match (&r.uuid, r.resource) {
        (Some(u), _) => Some(format!("cxl-region:{u}")),
        (None, Some(hpa)) => Some(format!("cxl-region:hpa-{hpa:#x}")),
        (None, None) => None,
    }
}

/// The interleave sets the inventory's CXL regions call for. Regions whose geometry is
/// unknown or inconsistent are left out, and so are those whose part on a member does not
/// start at its partition's first byte (a set covers its members from there).
pub fn region_sets(inv: &Inventory) -> Vec<RegionSet> {
    region_sets_checked(inv).0
}

/// [`region_sets`], with the regions left out because a member's part of them does not
/// start its memory resource, as `name: reason` (for the sync's report).
fn region_sets_checked(inv: &Inventory) -> (Vec<RegionSet>, Vec<String>) {
    let (mut sets, mut skipped) = (Vec::new(), Vec::new());
    for r in &inv.cxl.regions {
        let (Some(ways), Some(gran), Some(size)) = (r.ways, r.granularity, r.size) else { continue };
        if r.targets.is_empty() || r.targets.len() != ways as usize || ways == 0 || size % u64::from(ways) != 0 {
            continue;
        }
        let kind = match r.mode {
            Some(CxlMode::Pmem) => MemoryKind::CxlPersistent,
            Some(CxlMode::DynamicRam) => MemoryKind::CxlDynamic,
            _ => MemoryKind::CxlVolatile,
        };
        let Some(name) = set_name(r) else { continue };
        if let Some(why) = misplaced(inv, r, kind) {
            skipped.push(format!("{name}: {why}"));
            continue;
        }
        let members = r.targets.iter().map(|d| ResourceKey::new(d.clone(), kind, 0)).collect();
        sets.push(RegionSet { name, ways, granularity: u64::from(gran), members, member_size: size / u64::from(ways) });
    }
    (sets, skipped)
}

/// Why a set of region `r` would put its members' bytes at the wrong device addresses, if
/// it would: a set covers each member's memory resource from its first byte (DPA offset
/// 0 of the partition), so a region whose endpoint decoder on a member starts later in
/// that partition (a second region of the device, the first torn down) is not mapped
/// rather than translated to the wrong bytes. Dynamic-capacity partitions, and members
/// whose decoder is not listed, are not checked.
fn misplaced(inv: &Inventory, r: &fabric_topology::cxl::CxlRegion, kind: MemoryKind) -> Option<String> {
    let keys = [r.uuid.clone(), r.resource.map(|h| format!("hpa:{h:#x}")), Some(r.kernel_name.clone())];
    for t in &r.targets {
        let endpoint = inv.cxl.decoders.iter().find(|d| {
            d.level == fabric_topology::cxl::CxlDecoderLevel::Endpoint
                && d.owner.as_ref() == Some(t)
                && d.region.as_ref().is_some_and(|k| keys.iter().flatten().any(|key| key == k))
        });
        let Some(dpa) = endpoint.and_then(|d| d.dpa_start) else { continue };
        let info = inv.find(t).and_then(|i| inv.device(i).cxl.as_ref());
        let base = match kind {
            MemoryKind::CxlVolatile => 0,
            MemoryKind::CxlPersistent => info.and_then(|c| c.ram_size).unwrap_or(0),
            _ => continue,
        };
        if dpa != base {
            return Some(format!(
                "not mapped: its part on {t} starts at device address {dpa:#x}, not at the start of the partition ({base:#x}); a set covers its members from their first byte"
            ));
        }
    }
    None
}

/// What [`open_synced`] did.
#[derive(Debug)]
pub struct Synced {
    /// The map, up to date with the inventory.
    pub map: AddressMap,
    /// What the inventory changed.
    pub change: Change,
    /// CXL regions that could not become interleave sets, as `name: reason`.
    pub skipped: Vec<String>,
}

/// Opens the map state at `path` (creating its directory), brings it up to date with
/// `inv` and saves it if it changed or did not exist. `config`, when given, steers new
/// placements from now on (placed ranges never move).
pub fn open_synced(inv: &Inventory, path: &Path, config: Option<&MapConfig>) -> Result<Synced, MapError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|source| MapError::Persist(PersistError::Write { path: dir.to_owned(), source }))?;
    }
    let mut map = AddressMap::open(path, config.cloned().unwrap_or_default())?;
    let before = map.generation();
    if let Some(c) = config {
        map.set_config(c.clone())?;
    }
    let change = map.update(inv)?;
    let (sets, misplaced) = region_sets_checked(inv);
    let (want, mut skipped) = resolve(&map, inv, sets);
    skipped.extend(misplaced);
    for set in want {
        if is_mapped(&map, &set.name) {
            continue;
        }
        if let Err(e) = map.add_interleave(&set.name, set.ways, set.granularity, &set.members, Some(set.member_size)) {
            tracing::warn!(set = %set.name, error = %e, "CXL region not mapped as an interleave set");
            skipped.push(format!("{}: {e}", set.name));
        }
    }
    if map.generation() != before || !path.exists() {
        map.save(path)?;
    }
    Ok(Synced { map, change, skipped })
}

/// The prefix of the sets made from CXL regions.
pub const REGION_SET_PREFIX: &str = "cxl-region:";

/// What a sync covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncScope<'a> {
    /// The whole domain: the inventory is all of it.
    Domain,
    /// One node: only its placements and sets change ([`crate::layout::apply_node_inventory`]);
    /// the inventory need only hold that node's devices.
    Node(&'a str),
}

impl SyncScope<'_> {
    fn covers(&self, node: &str) -> bool {
        match self {
            Self::Domain => true,
            Self::Node(n) => *n == node,
        }
    }
}

/// What [`sync_sets`] did.
#[derive(Debug, Default)]
pub struct SetSync {
    /// Sets added (new regions, or rebuilt ones).
    pub added: Vec<String>,
    /// Sets removed (regions torn down, or rebuilt ones).
    pub removed: Vec<String>,
    /// Regions that could not become sets, as `name: reason`.
    pub skipped: Vec<String>,
    /// The map changes, in order.
    pub changes: Vec<Change>,
}

/// What [`sync_inventory`] did.
#[derive(Debug, Default)]
pub struct InventorySync {
    /// The devices' resources.
    pub change: Change,
    /// The CXL region sets.
    pub sets: SetSync,
}

fn same(set: &InterleaveSet, want: &RegionSet) -> bool {
    set.geometry.ways() == want.ways
        && set.geometry.granularity() == want.granularity
        && set.members == want.members
        && set.member_size == want.member_size
}

/// The prefix of the names of sets made from regions without a UUID (named by host
/// address, which other hosts of a domain may use too).
const HPA_PREFIX: &str = "cxl-region:hpa-";

/// The longest name a set made from a region gets: what the wire and the journal carry of
/// a set's name (`fabric_proto::wire::Name`); a longer one could not be asked for.
pub const MAX_REGION_SET_NAME: usize = 64;

/// Whether two region sets are over the same memory, striped alike.
fn same_memory(a: &RegionSet, b: &RegionSet) -> bool {
    a.ways == b.ways && a.granularity == b.granularity && a.members == b.members && a.member_size == b.member_size
}

fn is_mapped(map: &AddressMap, name: &str) -> bool {
    map.state().interleaves.iter().any(|s| s.name == name)
}

/// Who holds the set name `name` against `want`: the node of the map's set of that name,
/// else of a set claimed earlier in this sync, and whether it is over `want`'s memory.
fn holder(map: &AddressMap, claimed: &[(String, RegionSet)], name: &str, want: &RegionSet) -> Option<(String, bool)> {
    if let Some(s) = map.state().interleaves.iter().find(|s| s.name == name) {
        return Some((s.node.clone(), same(s, want)));
    }
    claimed.iter().find(|(_, c)| c.name == name).map(|(node, c)| (node.clone(), same_memory(c, want)))
}

/// The names `want`'s sets are (or are to be) mapped under, in order, and the regions
/// that cannot be mapped, as `name: reason`. A set keeps its region's name unless another
/// node's set over other memory holds it (a region without a UUID is named by its host
/// address, which another host of a domain may use too): then it is named for its node,
/// `cxl-region:hpa-0x…@NODE`, and keeps that name while it lives (names never move a set).
/// The same memory seen from two nodes (a device both share) is one set, under the name
/// the first gave it. Regions named by UUID are never renamed: two regions of one UUID over
/// different memory are reported.
fn resolve(map: &AddressMap, inv: &Inventory, want: Vec<RegionSet>) -> (Vec<RegionSet>, Vec<String>) {
    let mut claimed: Vec<(String, RegionSet)> = Vec::new();
    let mut skipped = Vec::new();
    for w in want {
        let node = set_node(inv, &w);
        let qualified = (w.name.starts_with(HPA_PREFIX) && node != FABRIC_NODE).then(|| format!("{}@{node}", w.name));
        let name = match &qualified {
            Some(q) if holder(map, &claimed, q, &w).is_some() => q.clone(),
            _ => match holder(map, &claimed, &w.name, &w) {
                Some((other, false)) if other != node => match qualified {
                    Some(q) if q.len() <= MAX_REGION_SET_NAME => q,
                    Some(q) => {
                        skipped.push(format!(
                            "{}: node {node}'s CXL region is not mapped: node {other}'s set has that name over other memory, and {q:?} is longer than {MAX_REGION_SET_NAME} bytes",
                            w.name
                        ));
                        continue;
                    }
                    None => {
                        skipped.push(format!(
                            "{}: node {node}'s CXL region is not mapped: node {other}'s set has that name over other memory (two regions of one UUID)",
                            w.name
                        ));
                        continue;
                    }
                },
                _ => w.name.clone(),
            },
        };
        claimed.push((node, RegionSet { name, ..w }));
    }
    (claimed.into_iter().map(|(_, w)| w).collect(), skipped)
}

fn update(map: &mut AddressMap, inv: &Inventory, scope: SyncScope<'_>) -> Result<Change, MapError> {
    match scope {
        SyncScope::Domain => map.update(inv),
        SyncScope::Node(n) => map.update_node(n, inv),
    }
}

/// The node a region set's range goes to: its members' node when they share one, else
/// [`FABRIC_NODE`] (as [`crate::layout::add_interleave`] decides).
fn set_node(inv: &Inventory, set: &RegionSet) -> String {
    let node_of = |k: &ResourceKey| inv.find(&k.device).and_then(|i| inv.device(i).node.clone());
    match set.members.first().map(node_of) {
        Some(Some(n)) if set.members.iter().all(|m| node_of(m).as_deref() == Some(n.as_str())) => n,
        _ => FABRIC_NODE.to_owned(),
    }
}

/// Brings the map's `cxl-region:` sets in `scope` in line with `inv` (already applied to
/// the map, as [`sync_inventory`] does first).
pub fn sync_sets(map: &mut AddressMap, inv: &Inventory, scope: SyncScope<'_>) -> Result<SetSync, MapError> {
    let (sets, misplaced) = region_sets_checked(inv);
    let in_scope = sets.into_iter().filter(|s| scope.covers(&set_node(inv, s))).collect();
    let (want, mut skipped) = resolve(map, inv, in_scope);
    skipped.extend(misplaced);
    let mut out = SetSync { skipped, ..SetSync::default() };
    let stale: Vec<String> = map
        .state()
        .interleaves
        .iter()
        .filter(|s| s.name.starts_with(REGION_SET_PREFIX) && scope.covers(&s.node))
        .filter(|s| match want.iter().find(|w| w.name == s.name) {
            Some(w) => !same(s, w),
            None => s.members.iter().all(|m| inv.find(&m.device).is_some()),
        })
        .map(|s| s.name.clone())
        .collect();
    for name in stale {
        out.changes.push(map.remove_interleave(&name)?);
        tracing::info!(set = %name, "CXL region gone or changed; interleave set removed");
        out.removed.push(name);
    }
    if !out.removed.is_empty() {
        // The members of removed sets are placed directly again.
        out.changes.push(update(map, inv, scope)?);
    }
    for set in want {
        if is_mapped(map, &set.name) {
            continue;
        }
        match map.add_interleave(&set.name, set.ways, set.granularity, &set.members, Some(set.member_size)) {
            Ok(c) => {
                tracing::info!(set = %set.name, ways = set.ways, "CXL region mapped as an interleave set");
                out.changes.push(c);
                out.added.push(set.name);
            }
            Err(e) => {
                tracing::warn!(set = %set.name, error = %e, "CXL region not mapped as an interleave set");
                out.skipped.push(format!("{}: {e}", set.name));
            }
        }
    }
    Ok(out)
}

/// Brings the map in line with `inv` in `scope`: the devices' resources, then the CXL
/// region sets. Pure apart from the map (no I/O): the caller saves and publishes, e.g.
/// inside [`AddressMap::commit_with`]. With [`SyncScope::Node`], every placement and set of
/// other nodes stays byte for byte as it was.
pub fn sync_inventory(map: &mut AddressMap, inv: &Inventory, scope: SyncScope<'_>) -> Result<InventorySync, MapError> {
    let change = update(map, inv, scope)?;
    let sets = sync_sets(map, inv, scope)?;
    for u in std::iter::once(&change).chain(&sets.changes).flat_map(|c| &c.unplaced) {
        tracing::warn!(resource = %u.key, node = %u.node, size = u.size, "memory resource fits nowhere in the map; not mapped");
    }
    Ok(InventorySync { change, sets })
}
