//! Mappings of GFA destinations kept per region, so that a copy into a region by GFA
//! does not map (and populate) the destination range again for every chunk: the first
//! chunk into a region maps the whole region once, unpopulated (pages fault in as the
//! kernel's copies reach them, huge pages where the filesystem gives them), and later
//! chunks and copies reuse it. The kernel still does every copy into it (`pread`), so a
//! region file shrunk under the mapping is an error, never `SIGBUS`.
//!
//! A mapping holds its region's memory until dropped: [`RegionMaps::retain`] drops those of
//! regions that are gone (called on every registry sweep), and the table is bounded.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex};

use super::sys::Mapping;

/// Regions mapped at most at once; past that, a new one replaces an arbitrary one (the
/// replaced mapping lives on while a chunk still uses it).
const MAX_REGIONS: usize = 64;

/// The kept mappings, by region id (ids are never reused within a daemon's life).
#[derive(Debug, Default)]
pub struct RegionMaps {
    maps: Mutex<HashMap<u64, Arc<Mapping>>>,
}

impl RegionMaps {
    /// The writable mapping of bytes `[0, len)` of `file`, region `region`'s memory,
    /// made on first use.
    pub fn get(&self, region: u64, file: &File, len: u64) -> io::Result<Arc<Mapping>> {
        if let Some(m) = super::lock(&self.maps).get(&region) {
            return Ok(m.clone());
        }
        // Mapped outside the lock; two engines racing both map, the first kept.
        let made = Arc::new(Mapping::new(file, 0, len, true, false)?);
        let mut maps = super::lock(&self.maps);
        if maps.len() >= MAX_REGIONS && !maps.contains_key(&region) {
            let victim = maps.keys().next().copied();
            if let Some(v) = victim {
                maps.remove(&v);
            }
        }
        Ok(maps.entry(region).or_insert(made).clone())
    }

    /// Keeps only the mappings of regions for which `keep` holds; returns how many went.
    pub fn retain(&self, keep: impl Fn(u64) -> bool) -> usize {
        let mut maps = super::lock(&self.maps);
        let before = maps.len();
        maps.retain(|id, _| keep(*id));
        before - maps.len()
    }

    /// Regions mapped now.
    #[cfg(test)]
    fn len(&self) -> usize {
        super::lock(&self.maps).len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_region_is_mapped_once_and_dropped_when_gone_and_the_table_is_bounded() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 20).unwrap();
        let maps = RegionMaps::default();
        let a = maps.get(1, &f, 1 << 20).unwrap();
        let b = maps.get(1, &f, 1 << 20).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "the second chunk did not reuse the mapping");
        maps.get(2, &f, 1 << 20).unwrap();
        assert_eq!(maps.retain(|id| id != 1), 1);
        assert_eq!(maps.len(), 1);
        for id in 10..10 + 2 * MAX_REGIONS as u64 {
            maps.get(id, &f, 4096).unwrap();
        }
        assert_eq!(maps.len(), MAX_REGIONS);
    }
}
