//! The view's storage: a map split into [`SHARDS`] shared shards, so that cloning it costs
//! one reference count per shard and a change copies at most the one shard it touches
//! (when a published clone still holds it). The domain task publishes its view after each
//! watch event: with one map per record kind, each event would copy the whole domain
//! (about 30 ms at 12,500 nodes, docs/BENCHMARKS.md); with shards it copies 1/64th of it.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

/// Shards per map: the copy a change makes is a 64th of the map.
pub(super) const SHARDS: usize = 64;

/// A map of `K` to `V` in shards by the key's hash; iteration is by shard, not by key
/// ([`Shards::sorted`] sorts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Shards<K, V> {
    shards: Vec<Arc<BTreeMap<K, V>>>,
}

impl<K, V> Default for Shards<K, V> {
    fn default() -> Self {
        Self { shards: (0..SHARDS).map(|_| Arc::new(BTreeMap::new())).collect() }
    }
}

/// The shard of `key`: a fixed hash (the same for `String` and `str`), never a seeded one.
fn shard_of<Q: Hash + ?Sized>(key: &Q) -> usize {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    // The modulo keeps the value below SHARDS, so the conversion never truncates.
    (h.finish() % SHARDS as u64) as usize
}

impl<K: Ord + Hash + Clone, V: Clone> Shards<K, V> {
    fn shard<Q: Hash + ?Sized>(&self, key: &Q) -> &BTreeMap<K, V> {
        &self.shards[shard_of(key)]
    }

    /// The value of `key`.
    pub(super) fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Ord + Hash + ?Sized,
    {
        self.shard(key).get(key)
    }

    /// Whether `key` has a value.
    pub(super) fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Ord + Hash + ?Sized,
    {
        self.shard(key).contains_key(key)
    }

    /// Sets `key`'s value; copies its shard first if a clone shares it.
    pub(super) fn insert(&mut self, key: K, value: V) -> Option<V> {
        let i = shard_of(&key);
        Arc::make_mut(&mut self.shards[i]).insert(key, value)
    }

    /// Removes `key`; copies its shard first if a clone shares it and the key is there.
    pub(super) fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Ord + Hash + ?Sized,
    {
        let i = shard_of(key);
        if !self.shards[i].contains_key(key) {
            return None;
        }
        Arc::make_mut(&mut self.shards[i]).remove(key)
    }

    /// Every entry, shard by shard.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.shards.iter().flat_map(|s| s.iter())
    }

    /// Every entry, by key.
    pub(super) fn sorted(&self) -> Vec<(&K, &V)> {
        let mut all: Vec<(&K, &V)> = self.iter().collect();
        all.sort_unstable_by(|a, b| a.0.cmp(b.0));
        all
    }

    /// Entries.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clone_shares_every_shard_and_a_change_copies_only_its_own() {
        let mut a: Shards<String, u32> = Shards::default();
        for i in 0..1_000 {
            a.insert(format!("node{i}"), i);
        }
        let b = a.clone();
        assert!(a.shards.iter().zip(&b.shards).all(|(x, y)| Arc::ptr_eq(x, y)));
        a.insert("node7".to_owned(), 70);
        let copied = a.shards.iter().zip(&b.shards).filter(|(x, y)| !Arc::ptr_eq(x, y)).count();
        assert_eq!(copied, 1);
        assert_eq!((a.get("node7"), b.get("node7")), (Some(&70), Some(&7)));
        // Removing an absent key copies nothing.
        let c = a.clone();
        assert_eq!(a.remove("absent"), None);
        assert!(a.shards.iter().zip(&c.shards).all(|(x, y)| Arc::ptr_eq(x, y)));
        assert_eq!(a.remove("node7"), Some(70));
        assert!(!a.contains_key("node7") && c.contains_key("node7"));
        assert_eq!((a.len(), c.len()), (999, 1_000));
        let sorted: Vec<&String> = c.sorted().into_iter().map(|(k, _)| k).collect();
        assert!(sorted.windows(2).all(|w| w[0] < w[1]) && sorted.len() == 1_000);
    }
}
