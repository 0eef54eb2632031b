//! The registration cache, as pure logic (no system calls, no `unsafe`, no daemon) so that
//! it can be tested exhaustively — and run under Miri where a nightly toolchain exists.
//!
//! Entries are keyed by *what was allocated*, never by a bare address: an [`Owner`] (a
//! fabric region's owner node, id and generation, or a library host buffer's never-reused
//! id), plus
//! device, access and byte range. A region freed and another allocated at the same GFA or
//! the same virtual address has another id or generation, so it can never hit the old
//! entry; the library also drops an owner's entries ([`RegCache::invalidate`]) when the
//! owner goes, so that the registration they hold is undone at once.
//!
//! A lookup that finds no entry of exactly its range is answered from an entry of the same
//! owner, device and access whose range contains it (a *range hit*): the caller uses the
//! cached registration at the returned offset. The exact lookup is one hash probe (the hit
//! path stays as fast as before); only a lookup that misses it searches an ordered index
//! of the same keys, among the entries of that owner, device and access.
//!
//! The cache is bounded by entries and by bytes; the least recently used entry goes first.
//! Evicting or invalidating hands the values back to the caller, which drops them (for the
//! library: unregisters, unless a user still holds the registration).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// A small multiplicative hasher (the Fx hash of rustc) for keys the process makes itself:
/// a cache hit is one hash of a few words, far cheaper than SipHash, and there is no
/// untrusted input to defend against.
#[derive(Debug, Default, Clone, Copy)]
pub struct FxHasher(u64);

impl FxHasher {
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(b));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A `HashMap` with [`FxHasher`].
pub type FxHashMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// The allocation a registration covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Owner {
    /// A fabric region this session allocated: the node that owns it, and its region id
    /// and generation there (each node counts its own ids).
    Fabric {
        /// The owner node's id (its 8 bytes, big-endian); 0 when the daemon did not say
        /// (before protocol 1.5: no domain, one node).
        node: u64,
        /// Region id.
        region: u64,
        /// Region generation: a new allocation never reuses an id and generation pair.
        generation: u64,
    },
    /// An import this session holds, by its id (the daemon's, never reused): each import
    /// has registrations of its own, which end with it (its release, its revocation), not
    /// with another import of the same region.
    Import {
        /// Import id.
        import: u64,
    },
    /// A library host buffer: its process-wide id, never reused.
    Host {
        /// Buffer id.
        buffer: u64,
    },
}

/// A cache key: owner, device (interned by the caller), access and byte range. Ordered by
/// those fields in that order, so that the entries of one owner, device and access are
/// adjacent and sorted by offset (what a range lookup walks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegKey {
    /// The allocation.
    pub owner: Owner,
    /// The device, as a small integer the caller interns.
    pub device: u32,
    /// Whether the device may write.
    pub writable: bool,
    /// First byte, in the owner.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// How big the cache may grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLimits {
    /// Entries at most (0: caching off).
    pub entries: usize,
    /// Bytes registered through cached entries at most.
    pub bytes: u64,
}

impl Default for CacheLimits {
    /// 1,024 entries and 4 GiB.
    fn default() -> Self {
        Self { entries: 1024, bytes: 4 << 30 }
    }
}

/// What the cache has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered from the cache (range hits included).
    pub hits: u64,
    /// Of the hits, those answered by an entry of a larger range that contains the one
    /// asked for.
    pub range_hits: u64,
    /// Lookups that found nothing.
    pub misses: u64,
    /// Entries dropped to stay within the limits.
    pub evictions: u64,
    /// Entries dropped because their owner went (freed, released, revoked).
    pub invalidations: u64,
    /// Entries now.
    pub entries: u64,
    /// Bytes of the entries now.
    pub bytes: u64,
}

#[derive(Debug)]
struct Slot<V> {
    value: V,
    tick: u64,
}

/// A bounded LRU map from [`RegKey`] to `V`. An exact hit is one hash lookup and a tick
/// store; a range hit also walks the ordered index over the entries of the key's owner,
/// device and access that start at or before it. Finding the least recently used entry
/// scans the entries, which only a miss does (and a miss costs a daemon round trip, far
/// more than a scan of the default 1,024).
#[derive(Debug)]
pub struct RegCache<V> {
    limits: CacheLimits,
    map: FxHashMap<RegKey, Slot<V>>,
    /// The keys of `map`, ordered: for range lookups and per-owner invalidation.
    ranges: BTreeSet<RegKey>,
    tick: u64,
    stats: CacheStats,
}

impl<V> RegCache<V> {
    /// An empty cache with these limits.
    pub fn new(limits: CacheLimits) -> Self {
        Self { limits, map: FxHashMap::default(), ranges: BTreeSet::new(), tick: 0, stats: CacheStats::default() }
    }

    /// The limits.
    pub fn limits(&self) -> CacheLimits {
        self.limits
    }

    /// The statistics.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The value for `key` (a clone) and the offset of `key`'s first byte in the value's
    /// range: 0 for an entry of exactly that range; else, from the entries of the same
    /// owner, device and access whose range contains `key`'s, the one that starts last
    /// (the longest of those). The entry is made most recently used; counts a hit (and a
    /// range hit) or a miss.
    #[inline]
    pub fn get(&mut self, key: &RegKey) -> Option<(V, u64)>
    where
        V: Clone,
    {
        let tick = self.tick + 1;
        // The exact probe alone on the common path: one hash lookup.
        if let Some(slot) = self.map.get_mut(key) {
            slot.tick = tick;
            self.tick = tick;
            self.stats.hits += 1;
            return Some((slot.value.clone(), 0));
        }
        self.get_range(key, tick)
    }

    /// [`RegCache::get`] past the exact probe: an entry whose range contains `key`'s, or a
    /// miss. Kept out of line so that the exact hit stays a small function (the ordered
    /// walk would otherwise grow its frame and cost every hit).
    #[cold]
    #[inline(never)]
    fn get_range(&mut self, key: &RegKey, tick: u64) -> Option<(V, u64)>
    where
        V: Clone,
    {
        let Some(found) = self.containing(key) else {
            self.stats.misses += 1;
            return None;
        };
        let slot = self.map.get_mut(&found)?;
        slot.tick = tick;
        self.tick = tick;
        self.stats.hits += 1;
        self.stats.range_hits += 1;
        Some((slot.value.clone(), key.offset - found.offset))
    }

    /// The key of the entry that answers a range lookup of `key` (see [`RegCache::get`]).
    fn containing(&self, key: &RegKey) -> Option<RegKey> {
        let end = key.offset.checked_add(key.len)?;
        let first = RegKey { offset: 0, len: 0, ..*key };
        let last = RegKey { len: u64::MAX, ..*key };
        self.ranges.range(first..=last).rev().find(|k| k.offset.saturating_add(k.len) >= end).copied()
    }

    fn remove_key(&mut self, key: &RegKey) -> Option<V> {
        let slot = self.map.remove(key)?;
        self.ranges.remove(key);
        self.stats.entries -= 1;
        self.stats.bytes -= key.len;
        Some(slot.value)
    }

    /// Evicts the least recently used entry into `out`; false when empty.
    fn evict_one(&mut self, out: &mut Vec<V>) -> bool {
        let Some(lru) = self.map.iter().min_by_key(|(_, s)| s.tick).map(|(k, _)| *k) else { return false };
        if let Some(v) = self.remove_key(&lru) {
            self.stats.evictions += 1;
            out.push(v);
        }
        true
    }

    /// Caches `value` under `key` (replacing an entry with the same key), then evicts the
    /// least recently used entries until the limits hold. Returns what left the cache:
    /// the replaced value and the evicted ones, or `value` itself when it can never fit
    /// (caching off, or larger than the byte limit).
    pub fn insert(&mut self, key: RegKey, value: V) -> Vec<V> {
        if self.limits.entries == 0 || key.len > self.limits.bytes {
            return vec![value];
        }
        let mut out: Vec<V> = self.remove_key(&key).into_iter().collect();
        while (self.stats.entries as usize >= self.limits.entries
            || self.stats.bytes.saturating_add(key.len) > self.limits.bytes)
            && self.evict_one(&mut out)
        {}
        let tick = self.next_tick();
        self.map.insert(key, Slot { value, tick });
        self.ranges.insert(key);
        self.stats.entries += 1;
        self.stats.bytes += key.len;
        out
    }

    /// Drops every entry of `owner`; returns their values.
    pub fn invalidate(&mut self, owner: Owner) -> Vec<V> {
        let first = RegKey { owner, device: 0, writable: false, offset: 0, len: 0 };
        let last = RegKey { owner, device: u32::MAX, writable: true, offset: u64::MAX, len: u64::MAX };
        let keys: Vec<RegKey> = self.ranges.range(first..=last).copied().collect();
        let out: Vec<V> = keys.iter().filter_map(|k| self.remove_key(k)).collect();
        self.stats.invalidations += out.len() as u64;
        out
    }

    /// Evicts every entry whose value `unused` says no one else holds (to make room for a
    /// registration the daemon refused for lack of pinned bytes); returns them.
    pub fn evict_unused(&mut self, unused: impl Fn(&V) -> bool) -> Vec<V> {
        let keys: Vec<RegKey> = self.map.iter().filter(|(_, s)| unused(&s.value)).map(|(k, _)| *k).collect();
        let out: Vec<V> = keys.iter().filter_map(|k| self.remove_key(k)).collect();
        self.stats.evictions += out.len() as u64;
        out
    }

    /// Drops every entry (e.g. before the limits change); returns their values. Not
    /// counted as invalidations or evictions.
    pub fn clear(&mut self) -> Vec<V> {
        self.stats.entries = 0;
        self.stats.bytes = 0;
        self.ranges.clear();
        self.map.drain().map(|(_, s)| s.value).collect()
    }

    /// New limits; returns what had to be evicted to meet them.
    pub fn set_limits(&mut self, limits: CacheLimits) -> Vec<V> {
        self.limits = limits;
        let mut out = Vec::new();
        while (self.stats.entries as usize > limits.entries || self.stats.bytes > limits.bytes)
            && self.evict_one(&mut out)
        {}
        out
    }

    /// Entries now.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Reference counts of locked pages, so that overlapping registrations of a process's own
/// memory lock a page once and unlock it only when the last of them goes (`mlock` does
/// not nest: one `munlock` undoes every lock of a page). Pure bookkeeping: the caller
/// makes the system calls for the runs it is handed. Kept as runs of pages with one count,
/// so a registration of a gigabyte costs a few map operations, not one per page.
#[derive(Debug, Default)]
pub struct PageCounts {
    /// Disjoint runs: first page → (end page, holders), never a count of 0, and two
    /// touching runs never have the same count.
    runs: BTreeMap<u64, (u64, u32)>,
    pages: u64,
}

/// Consecutive pages: first page number and how many.
pub type PageRun = (u64, u64);

/// Appends pages `first..end` to `runs`, joining the last run when they touch.
fn push_pages(runs: &mut Vec<PageRun>, first: u64, end: u64) {
    match runs.last_mut() {
        Some((f, n)) if *f + *n == first => *n += end - first,
        _ => runs.push((first, end - first)),
    }
}

impl PageCounts {
    /// No pages held.
    pub const fn new() -> Self {
        Self { runs: BTreeMap::new(), pages: 0 }
    }

    /// Cuts the run that holds `page` (not at its start) in two there.
    fn split(&mut self, page: u64) {
        let Some((&first, &(end, count))) = self.runs.range(..page).next_back() else { return };
        if first < page && page < end {
            self.runs.insert(first, (page, count));
            self.runs.insert(page, (end, count));
        }
    }

    /// Joins touching runs of one count from the run before `first` to the one at `end`.
    fn join(&mut self, first: u64, end: u64) {
        let from = self.runs.range(..first).next_back().map_or(first, |(&k, _)| k);
        let keys: Vec<u64> = self.runs.range(from..=end).map(|(&k, _)| k).collect();
        let mut last: Option<u64> = None;
        for k in keys {
            let Some(&(e, c)) = self.runs.get(&k) else { continue };
            if let Some(prev) = last
                && let Some(&(pe, pc)) = self.runs.get(&prev)
                && pe == k
                && pc == c
            {
                self.runs.remove(&k);
                self.runs.insert(prev, (e, c));
                continue;
            }
            last = Some(k);
        }
    }

    /// Counts one more holder of pages `first..first + n`; returns the runs that had no
    /// holder before (the ones to lock now).
    pub fn acquire(&mut self, first: u64, n: u64) -> Vec<PageRun> {
        let end = first.saturating_add(n);
        let mut fresh = Vec::new();
        if first >= end {
            return fresh;
        }
        self.split(first);
        self.split(end);
        let held: Vec<(u64, u64)> = self.runs.range(first..end).map(|(&k, &(e, _))| (k, e)).collect();
        let mut at = first;
        for (k, e) in held {
            if k > at {
                push_pages(&mut fresh, at, k);
            }
            if let Some(run) = self.runs.get_mut(&k) {
                run.1 = run.1.saturating_add(1);
            }
            at = e;
        }
        if at < end {
            push_pages(&mut fresh, at, end);
        }
        for &(f, n) in &fresh {
            self.runs.insert(f, (f + n, 1));
            self.pages += n;
        }
        self.join(first, end);
        fresh
    }

    /// Counts one holder fewer of pages `first..first + n`; returns the runs that have no
    /// holder left (the ones to unlock now). Pages never acquired are ignored.
    pub fn release(&mut self, first: u64, n: u64) -> Vec<PageRun> {
        let end = first.saturating_add(n);
        let mut freed = Vec::new();
        if first >= end {
            return freed;
        }
        self.split(first);
        self.split(end);
        let held: Vec<(u64, u64, u32)> = self.runs.range(first..end).map(|(&k, &(e, c))| (k, e, c)).collect();
        for (k, e, c) in held {
            if c <= 1 {
                self.runs.remove(&k);
                push_pages(&mut freed, k, e);
                self.pages -= e - k;
            } else {
                self.runs.insert(k, (e, c - 1));
            }
        }
        self.join(first, end);
        freed
    }

    /// Pages held now.
    pub fn pages(&self) -> usize {
        usize::try_from(self.pages).unwrap_or(usize::MAX)
    }
}

#[cfg(test)]
mod model_test;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(region: u64, generation: u64, offset: u64, len: u64) -> RegKey {
        RegKey { owner: Owner::Fabric { node: 0, region, generation }, device: 0, writable: true, offset, len }
    }

    #[test]
    fn hits_need_the_same_owner_generation_device_access_and_range() {
        let mut c = RegCache::new(CacheLimits::default());
        let k = key(1, 1, 0, 4096);
        assert!(c.insert(k, "a").is_empty());
        assert_eq!(c.get(&k), Some(("a", 0)));
        // Same region id, next generation (freed and reallocated): a miss.
        assert_eq!(c.get(&key(1, 2, 0, 4096)), None);
        assert_eq!(c.get(&RegKey { device: 1, ..k }), None);
        assert_eq!(c.get(&RegKey { writable: false, ..k }), None);
        assert_eq!(c.get(&key(1, 1, 4096, 4096)), None);
        assert_eq!(c.get(&key(1, 1, 0, 8192)), None);
        assert_eq!(c.get(&RegKey { owner: Owner::Host { buffer: 1 }, ..k }), None);
        assert_eq!((c.stats().hits, c.stats().misses, c.stats().range_hits), (1, 6, 0));
    }

    #[test]
    fn a_sub_range_is_answered_by_a_cached_range_that_contains_it() {
        let mut c = RegCache::new(CacheLimits::default());
        c.insert(key(1, 1, 0, 8192), "whole");
        // Inside: the same entry, at the sub-range's offset in it.
        assert_eq!(c.get(&key(1, 1, 4096, 4096)), Some(("whole", 4096)));
        assert_eq!(c.get(&key(1, 1, 100, 1)), Some(("whole", 100)));
        // Reaching past its end, another generation, device or access: misses.
        assert_eq!(c.get(&key(1, 1, 4096, 4097)), None);
        assert_eq!(c.get(&key(1, 2, 4096, 10)), None);
        assert_eq!(c.get(&RegKey { device: 1, ..key(1, 1, 0, 10) }), None);
        assert_eq!(c.get(&RegKey { writable: false, ..key(1, 1, 0, 10) }), None);
        let st = c.stats();
        assert_eq!((st.hits, st.range_hits, st.misses), (2, 2, 4));
        // Of two containing entries, the one that starts last answers.
        c.insert(key(1, 1, 4000, 200), "late");
        assert_eq!(c.get(&key(1, 1, 4100, 10)), Some(("late", 100)));
        assert_eq!(c.get(&key(1, 1, 3990, 20)), Some(("whole", 3990)));
        // An exact entry beats a containing one.
        assert_eq!(c.get(&key(1, 1, 0, 8192)), Some(("whole", 0)));
        // Freed: no entry of the owner answers any range any more.
        let mut gone = c.invalidate(Owner::Fabric { node: 0, region: 1, generation: 1 });
        gone.sort_unstable();
        assert_eq!(gone, vec!["late", "whole"]);
        assert_eq!(c.get(&key(1, 1, 4100, 10)), None);
        assert!(c.is_empty());
    }

    #[test]
    fn invalidation_drops_only_that_owner() {
        let mut c = RegCache::new(CacheLimits::default());
        c.insert(key(1, 1, 0, 10), 1);
        c.insert(key(1, 1, 10, 10), 2);
        c.insert(key(2, 1, 0, 10), 3);
        let mut gone = c.invalidate(Owner::Fabric { node: 0, region: 1, generation: 1 });
        gone.sort();
        assert_eq!(gone, vec![1, 2]);
        assert_eq!(c.stats().invalidations, 2);
        assert_eq!((c.stats().entries, c.stats().bytes), (1, 10));
        assert_eq!(c.get(&key(1, 1, 0, 10)), None);
        assert_eq!(c.get(&key(2, 1, 0, 10)), Some((3, 0)));
    }

    #[test]
    fn least_recently_used_goes_first_by_count_and_by_bytes() {
        let mut c = RegCache::new(CacheLimits { entries: 2, bytes: 100 });
        c.insert(key(1, 1, 0, 10), 1);
        c.insert(key(2, 1, 0, 10), 2);
        c.get(&key(1, 1, 0, 10));
        assert_eq!(c.insert(key(3, 1, 0, 10), 3), vec![2]);
        assert_eq!(c.stats().evictions, 1);
        // 95 bytes need both others out.
        let mut out = c.insert(key(4, 1, 0, 95), 4);
        out.sort();
        assert_eq!(out, vec![1, 3]);
        assert_eq!((c.stats().entries, c.stats().bytes), (1, 95));
        // Larger than the byte limit: never cached, handed straight back.
        assert_eq!(c.insert(key(5, 1, 0, 101), 5), vec![5]);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn evicting_unused_entries_keeps_the_ones_in_use() {
        let mut c = RegCache::new(CacheLimits::default());
        c.insert(key(1, 1, 0, 10), 1);
        c.insert(key(2, 1, 0, 10), 2);
        c.insert(key(3, 1, 0, 10), 3);
        let mut out = c.evict_unused(|v| v % 2 == 1);
        out.sort();
        assert_eq!(out, vec![1, 3]);
        assert_eq!((c.stats().evictions, c.stats().entries, c.stats().bytes), (2, 1, 10));
        assert_eq!(c.get(&key(2, 1, 0, 10)), Some((2, 0)));
    }

    #[test]
    fn replacing_a_key_returns_the_old_value_and_caching_off_caches_nothing() {
        let mut c = RegCache::new(CacheLimits::default());
        c.insert(key(1, 1, 0, 10), 1);
        assert_eq!(c.insert(key(1, 1, 0, 10), 2), vec![1]);
        assert_eq!((c.stats().entries, c.stats().bytes), (1, 10));
        assert_eq!(c.set_limits(CacheLimits { entries: 0, bytes: 0 }), vec![2]);
        assert_eq!(c.insert(key(1, 1, 0, 10), 3), vec![3]);
        assert!(c.is_empty());
    }

    #[test]
    fn overlapping_page_holders_lock_once_and_unlock_last() {
        let mut p = PageCounts::default();
        assert_eq!(p.acquire(10, 3), vec![(10, 3)]);
        assert_eq!(p.acquire(11, 4), vec![(13, 2)]);
        assert_eq!(p.release(10, 3), vec![(10, 1)]);
        assert_eq!(p.pages(), 4);
        assert_eq!(p.release(11, 4), vec![(11, 4)]);
        assert_eq!(p.pages(), 0);
        assert_eq!(p.release(1, 2), vec![]);
    }

    proptest! {
        /// Against a count per page (what it was before): the same runs to lock and to
        /// unlock, the same pages held, whatever the overlaps.
        #[test]
        fn page_runs_count_as_pages_do(ops in proptest::collection::vec((any::<bool>(), 0u64..40, 0u64..20), 1..if cfg!(miri) { 30 } else { 200 })) {
            let mut p = PageCounts::new();
            let mut model: BTreeMap<u64, u32> = BTreeMap::new();
            for (take, first, n) in ops {
                let mut want = Vec::new();
                for page in first..first + n {
                    if take {
                        let c = model.entry(page).or_insert(0);
                        *c += 1;
                        if *c == 1 { push_pages(&mut want, page, page + 1); }
                    } else if let Some(c) = model.get_mut(&page) {
                        *c -= 1;
                        if *c == 0 { model.remove(&page); push_pages(&mut want, page, page + 1); }
                    }
                }
                let got = if take { p.acquire(first, n) } else { p.release(first, n) };
                prop_assert_eq!(got, want);
                prop_assert_eq!(p.pages(), model.len());
                // The runs stay few: no two touching runs of one count.
                let runs: Vec<_> = p.runs.iter().map(|(&k, &v)| (k, v)).collect();
                for w in runs.windows(2) {
                    prop_assert!(!(w[0].1.0 == w[1].0 && w[0].1.1 == w[1].1.1), "{:?}", runs);
                }
            }
        }
    }

    #[test]
    fn a_gigabyte_of_pages_is_a_few_runs() {
        let mut p = PageCounts::new();
        assert_eq!(p.acquire(1 << 20, 1 << 18), vec![(1 << 20, 1 << 18)]);
        assert_eq!(p.acquire((1 << 20) + 10, 5), vec![]);
        assert_eq!(p.runs.len(), 3);
        assert_eq!(p.release(1 << 20, 1 << 18), vec![(1 << 20, 10), ((1 << 20) + 15, (1 << 18) - 15)]);
        assert_eq!((p.pages(), p.runs.len()), (5, 1));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u8, u8),
        Get(u8, u8, u8),
        Invalidate(u8, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..4, 0u8..3, 1u8..40).prop_map(|(r, g, l)| Op::Insert(r, g, l)),
            (0u8..4, 0u8..3, 1u8..40).prop_map(|(r, g, l)| Op::Get(r, g, l)),
            (0u8..4, 0u8..3).prop_map(|(r, g)| Op::Invalidate(r, g)),
        ]
    }

    proptest! {
        /// Against a model (a recency-ordered list): every value inserted comes back out
        /// exactly once (by get-and-replace, eviction, invalidation or clear), the limits
        /// always hold, a key of another generation never hits, a shorter range hits the
        /// longest entry, and the LRU victim is the model's.
        #[test]
        fn behaves_like_a_recency_list(ops in proptest::collection::vec(op(), 1..if cfg!(miri) { 40 } else { 200 }), entries in 1usize..6, bytes in 20u64..120) {
            let mut c = RegCache::new(CacheLimits { entries, bytes });
            let mut model: Vec<(RegKey, u64)> = Vec::new(); // least recent first
            let mut out_count = 0u64;
            let mut next = 0u64;
            for op in ops {
                match op {
                    Op::Insert(r, g, l) => {
                        let k = key(u64::from(r), u64::from(g), 0, u64::from(l));
                        next += 1;
                        let out = c.insert(k, next);
                        out_count += out.len() as u64;
                        if u64::from(l) > bytes {
                            prop_assert_eq!(out, vec![next]);
                            continue;
                        }
                        let mut expect: Vec<u64> = Vec::new();
                        if let Some(i) = model.iter().position(|(mk, _)| *mk == k) {
                            expect.push(model.remove(i).1);
                        }
                        while model.len() >= entries || model.iter().map(|(k, _)| k.len).sum::<u64>() + k.len > bytes {
                            expect.push(model.remove(0).1);
                        }
                        model.push((k, next));
                        prop_assert_eq!(out, expect);
                    }
                    Op::Get(r, g, l) => {
                        let k = key(u64::from(r), u64::from(g), 0, u64::from(l));
                        let got = c.get(&k).map(|(v, _)| v);
                        // Exact, else the longest entry of the owner (all start at 0).
                        let i = model.iter().position(|(mk, _)| *mk == k).or_else(|| {
                            model
                                .iter()
                                .enumerate()
                                .filter(|(_, (mk, _))| mk.owner == k.owner && mk.len >= k.len)
                                .max_by_key(|(_, (mk, _))| mk.len)
                                .map(|(i, _)| i)
                        });
                        prop_assert_eq!(got, i.map(|i| model[i].1));
                        if let Some(i) = i {
                            let e = model.remove(i);
                            model.push(e);
                        }
                    }
                    Op::Invalidate(r, g) => {
                        let owner = Owner::Fabric { node: 0, region: u64::from(r), generation: u64::from(g) };
                        let mut out = c.invalidate(owner);
                        out_count += out.len() as u64;
                        out.sort_unstable();
                        let mut expect: Vec<u64> = model.iter().filter(|(k, _)| k.owner == owner).map(|e| e.1).collect();
                        expect.sort_unstable();
                        model.retain(|(k, _)| k.owner != owner);
                        prop_assert_eq!(out, expect);
                    }
                }
                let s = c.stats();
                prop_assert!(s.entries as usize <= entries && s.bytes <= bytes);
                prop_assert_eq!(s.entries as usize, model.len());
                prop_assert_eq!(s.bytes, model.iter().map(|(k, _)| k.len).sum::<u64>());
            }
            out_count += c.clear().len() as u64;
            prop_assert_eq!(out_count, next);
        }
    }
}
