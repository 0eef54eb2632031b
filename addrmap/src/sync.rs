//! Bringing a persisted map in line with a discovered inventory: open the state file,
//! apply the inventory (stable placement), add interleave sets for CXL regions not yet
//! mapped, and save when anything changed. Shared by `fabricctl map` and `fabricd`.

use std::path::Path;

use fabric_topology::cxl::CxlMode;
use fabric_topology::{Inventory, MemoryKind};

use crate::config::MapConfig;
use crate::layout::Change;
use crate::map::{AddressMap, MapError};
use crate::persist::PersistError;
use crate::state::ResourceKey;

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
        if map.state().interleaves.iter().any(|s| s.name == set.name) {
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
