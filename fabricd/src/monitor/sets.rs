//! CXL interleave sets on a rescan: the address map's `cxl-region:` sets brought in line
//! with the inventory's CXL regions ([`fabric_addrmap::region_sets`]), as
//! [`fabric_addrmap::open_synced`] does at start. A new region becomes a set; a set whose
//! region is gone while every member device remains (the region was torn down) is removed
//! and its members are mapped directly again; a set whose region changed geometry is
//! rebuilt; a set whose members vanished stays, a hole that translates again when they
//! come back. Sets with other names (made by an operator) are never touched.

use fabric_addrmap::{AddressMap, Change, InterleaveSet, MapError, RegionSet, region_sets};
use fabric_topology::Inventory;

/// The prefix of the sets made from CXL regions.
pub const PREFIX: &str = "cxl-region:";

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

fn same(set: &InterleaveSet, want: &RegionSet) -> bool {
    set.geometry.ways() == want.ways
        && set.geometry.granularity() == want.granularity
        && set.members == want.members
        && set.member_size == want.member_size
}

/// Brings the map's `cxl-region:` sets in line with `inv` (already applied to the map
/// with [`AddressMap::update`]).
pub fn sync_sets(map: &mut AddressMap, inv: &Inventory) -> Result<SetSync, MapError> {
    let want = region_sets(inv);
    let mut out = SetSync::default();
    let stale: Vec<String> = map
        .state()
        .interleaves
        .iter()
        .filter(|s| s.name.starts_with(PREFIX))
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
        out.changes.push(map.update(inv)?);
    }
    for set in want {
        if map.state().interleaves.iter().any(|s| s.name == set.name) {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use fabric_addrmap::{MapConfig, RangeKind};

    fn sim(text: &str) -> Inventory {
        fabric_drivers::sim::parse(text, "test").unwrap()
    }

    fn pool() -> String {
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/sim/cxl-pool.toml")).unwrap()
    }

    fn set_names(map: &AddressMap) -> Vec<String> {
        map.state().interleaves.iter().map(|s| s.name.clone()).collect()
    }

    #[test]
    fn regions_torn_down_and_created_follow_the_inventory() {
        let text = pool();
        let region0 = "[[templates.cxl-host.cxl_region]]\nname = \"region0\"\nmode = \"ram\"\ntargets = [\"mem0\", \"mem1\"]\ngranularity = 4096\nnuma = 1\n";
        assert!(text.contains(region0));
        let full = sim(&text);
        let torn = sim(&text.replace(region0, ""));
        assert_eq!(region_sets(&full).len(), region_sets(&torn).len() + 1);
        let gone = region_sets(&full).into_iter().find(|s| !region_sets(&torn).contains(s)).unwrap();

        let mut map = AddressMap::new(MapConfig::default()).unwrap();
        map.update(&full).unwrap();
        let s = sync_sets(&mut map, &full).unwrap();
        assert_eq!(s.added.len(), region_sets(&full).len(), "{:?}", s.skipped);
        let g0 = map.generation();
        assert!(sync_sets(&mut map, &full).unwrap().changes.is_empty(), "in line: nothing to do");
        assert_eq!(map.generation(), g0);

        // region0 torn down (its memdevs stay): the set goes and mem0/mem1 are direct again.
        map.update(&torn).unwrap();
        let s = sync_sets(&mut map, &torn).unwrap();
        assert_eq!(s.removed, vec![gone.name.clone()]);
        assert!(!set_names(&map).contains(&gone.name));
        let listing = map.snapshot().listing();
        for m in &gone.members {
            let direct =
                listing.ranges.iter().any(|r| r.kind == RangeKind::Direct && r.owner.contains(&m.device.to_string()));
            assert!(direct, "{} is not mapped directly: {listing:?}", m.device);
        }

        // Created again: a set again.
        map.update(&full).unwrap();
        let s = sync_sets(&mut map, &full).unwrap();
        assert_eq!(s.added, vec![gone.name.clone()], "{:?}", s.skipped);
        assert!(set_names(&map).contains(&gone.name));
    }

    #[test]
    fn a_set_whose_members_vanished_stays() {
        let text = pool();
        let full = sim(&text);
        let mut map = AddressMap::new(MapConfig::default()).unwrap();
        map.update(&full).unwrap();
        sync_sets(&mut map, &full).unwrap();
        let before = set_names(&map);
        // Every member device gone (the regions with them): the sets stay, as holes.
        let members: Vec<String> =
            region_sets(&full).into_iter().flat_map(|s| s.members).map(|m| m.device.to_string()).collect();
        assert!(!members.is_empty());
        let mut without = full.clone();
        without.cxl.regions.clear();
        without.devices.retain(|d| !members.contains(&d.id.to_string()));
        without.links.clear();
        without.reindex();
        map.update(&without).unwrap();
        let s = sync_sets(&mut map, &without).unwrap();
        assert!(s.removed.is_empty() && s.added.is_empty(), "{s:?}");
        assert_eq!(set_names(&map), before);
    }
}
