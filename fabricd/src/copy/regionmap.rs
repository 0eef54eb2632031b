//! Mappings of regions kept for the copy engine, so that a copy from or into a region by
//! GFA does not map (and populate) the range again for every chunk: the first chunk that
//! reaches a region maps the whole region once, unpopulated (pages fault in as copies
//! reach them, huge pages where the filesystem gives them), and later chunks and copies
//! reuse it — writable for a destination (a writable mapping serves a source too),
//! read-only for a source reached through a read-only descriptor. Copies through these
//! mappings recover from faults ([`super::fault`]) or are the kernel's, so a region file
//! shrunk under its mapping is an error, never `SIGBUS`.
//!
//! A mapping holds its region's memory until dropped: [`RegionMaps::forget`] drops those of
//! regions that are gone (called on every registry sweep), and the table is bounded.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex};

use super::sys::Mapping;

/// Regions mapped at most at once; past that, a new one replaces an arbitrary one (the
/// replaced mapping lives on while a chunk still uses it).
const MAX_REGIONS: usize = 64;

/// The kept mappings, by region id (ids are never reused within a daemon's life) and
/// whether writable.
#[derive(Debug, Default)]
pub struct RegionMaps {
    maps: Mutex<HashMap<(u64, bool), Arc<Mapping>>>,
}

impl RegionMaps {
    /// A mapping of bytes `[base, base + len)` of `file`, region `region`'s memory,
    /// writable when `writable` (then `file` must be open for writing), made on first use;
    /// a reader gets the writable one when there is one. [`Mapping::addr`] is byte `base`.
    pub fn get(&self, region: u64, file: &File, base: u64, len: u64, writable: bool) -> io::Result<Arc<Mapping>> {
        {
            let maps = super::lock(&self.maps);
            if let Some(m) = maps.get(&(region, true)).or_else(|| maps.get(&(region, false)).filter(|_| !writable)) {
                return Ok(m.clone());
            }
        }
        // Mapped outside the lock; two engines racing both map, the first kept.
        let made = Arc::new(Mapping::new(file, base, len, writable, false)?);
        let key = (region, writable);
        let mut maps = super::lock(&self.maps);
        // What leaves the table is unmapped after the lock.
        let mut evicted = None;
        if maps.len() >= MAX_REGIONS && !maps.contains_key(&key) {
            let victim = maps.keys().next().copied();
            evicted = victim.and_then(|v| maps.remove(&v));
        }
        let (kept, unused) = match maps.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => (e.get().clone(), Some(made)),
            std::collections::hash_map::Entry::Vacant(e) => (e.insert(made).clone(), None),
        };
        drop(maps);
        drop((evicted, unused));
        Ok(kept)
    }

    /// The regions mapped now.
    pub fn regions(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = super::lock(&self.maps).keys().map(|(id, _)| *id).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Drops the mappings of regions `gone` (unmapped after the lock, unless a chunk still
    /// holds one); returns how many went.
    pub fn forget(&self, gone: impl IntoIterator<Item = u64>) -> usize {
        let gone: std::collections::HashSet<u64> = gone.into_iter().collect();
        if gone.is_empty() {
            return 0;
        }
        let taken: Vec<Arc<Mapping>> =
            super::lock(&self.maps).extract_if(|(id, _), _| gone.contains(id)).map(|(_, m)| m).collect();
        taken.len()
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
        let a = maps.get(1, &f, 0, 1 << 20, true).unwrap();
        let b = maps.get(1, &f, 0, 1 << 20, true).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "the second chunk did not reuse the mapping");
        // A reader takes the writable mapping; a reader of another region gets its own,
        // and a writer of that region then another.
        assert!(Arc::ptr_eq(&a, &maps.get(1, &f, 0, 1 << 20, false).unwrap()));
        let r = maps.get(2, &f, 0, 1 << 20, false).unwrap();
        assert!(Arc::ptr_eq(&r, &maps.get(2, &f, 0, 1 << 20, false).unwrap()));
        assert!(!Arc::ptr_eq(&r, &maps.get(2, &f, 0, 1 << 20, true).unwrap()));
        assert_eq!(maps.len(), 3);
        assert_eq!(maps.regions().len(), 2);
        assert_eq!(maps.forget([2, 7]), 2);
        assert_eq!(maps.regions(), vec![1]);
        assert_eq!(maps.len(), 1);
        for id in 10..10 + 2 * MAX_REGIONS as u64 {
            maps.get(id, &f, 0, 4096, id % 2 == 0).unwrap();
        }
        assert_eq!(maps.len(), MAX_REGIONS);
    }
}
