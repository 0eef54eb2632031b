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
//! (made by an operator) are never touched.

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
    /// `cxl-region:UUID` or `cxl-region:hpa-0x…`.
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
/// unknown or inconsistent are left out.
pub fn region_sets(inv: &Inventory) -> Vec<RegionSet> {
    let mut sets = Vec::new();
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
        let members = r.targets.iter().map(|d| ResourceKey::new(d.clone(), kind, 0)).collect();
        sets.push(RegionSet { name, ways, granularity: u64::from(gran), members, member_size: size / u64::from(ways) });
    }
    sets
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
    let mut skipped = Vec::new();
    for set in region_sets(inv) {
        if let Some(taken) = mapped_as(&map, inv, &set) {
            skipped.extend(taken);
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

/// Whether a set named like `want` is mapped already: `Some(None)` when it is `want`'s own
/// (or the same memory seen from another node: a shared device), `Some(Some(why))` when
/// it is another node's region of the same name — a region without a UUID is named by its
/// host address, which another host of a domain may use too — so `want` cannot be mapped
/// under it; `None` when no set has the name.
fn mapped_as(map: &AddressMap, inv: &Inventory, want: &RegionSet) -> Option<Option<String>> {
    let s = map.state().interleaves.iter().find(|s| s.name == want.name)?;
    let node = set_node(inv, want);
    if s.node == node || same(s, want) {
        return Some(None);
    }
    Some(Some(format!(
        "{}: node {node}'s CXL region is not mapped: node {}'s set has that name (a region without a UUID is named by its host address, which another host of a domain may use too)",
        want.name, s.node
    )))
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
    let want: Vec<RegionSet> = region_sets(inv).into_iter().filter(|s| scope.covers(&set_node(inv, s))).collect();
    let mut out = SetSync::default();
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
        if let Some(taken) = mapped_as(map, inv, &set) {
            out.skipped.extend(taken);
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
    Ok(InventorySync { change, sets })
}
