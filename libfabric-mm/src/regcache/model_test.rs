//! The cache as the library drives it, against a plain reference model: random sequences
//! of register (exact or sub-range), unregister, free and reallocate at the same place,
//! and giving back unused entries. Values stand for daemon registrations: one is
//! "unregistered" (dropped) exactly when neither the cache nor a user holds it.

use std::cell::Cell;
use std::rc::Rc;

use proptest::prelude::*;

use super::{CacheLimits, Owner, RegCache, RegKey};

/// A daemon registration: what it covers; counts itself in `live` while it exists.
#[derive(Debug)]
struct Reg {
    id: u64,
    key: RegKey,
    live: Rc<Cell<u64>>,
}

impl Drop for Reg {
    fn drop(&mut self) {
        self.live.set(self.live.get() - 1);
    }
}

/// An allocation at one place (a slot: the same GFA or address every time).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Slot {
    Empty,
    /// Allocated, generation `g`.
    Live(u64),
    /// Freed by its user, kept alive by registrations still held.
    Dropped(u64),
}

#[derive(Debug, Clone)]
enum Op {
    Register { slot: usize, device: u32, writable: bool, offset: u64, len: u64 },
    Unregister(usize),
    Free(usize),
    Alloc(usize),
    EvictUnused,
}

const SIZE: u64 = 64;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..3, 0u32..2, any::<bool>(), 0u64..SIZE, 1u64..SIZE).prop_map(|(slot, device, writable, offset, len)| {
            Op::Register { slot, device, writable, offset, len: len.min(SIZE - offset) }
        }),
        3 => (0usize..64).prop_map(Op::Unregister),
        1 => (0usize..3).prop_map(Op::Free),
        1 => (0usize..3).prop_map(Op::Alloc),
        1 => Just(Op::EvictUnused),
    ]
}

/// The model: entries in recency order (least recent first), and the counters.
#[derive(Default)]
struct Model {
    entries: Vec<(RegKey, u64)>,
    hits: u64,
    range_hits: u64,
    misses: u64,
}

impl Model {
    /// Exact entry, else the containing entry that starts last (longest on a tie); made
    /// most recent. Its id and the offset in it.
    fn get(&mut self, q: &RegKey) -> Option<(u64, u64)> {
        let same = |k: &RegKey| k.owner == q.owner && k.device == q.device && k.writable == q.writable;
        let i = self.entries.iter().position(|(k, _)| k == q).or_else(|| {
            self.entries
                .iter()
                .enumerate()
                .filter(|(_, (k, _))| same(k) && k.offset <= q.offset && k.offset + k.len >= q.offset + q.len)
                .max_by_key(|(_, (k, _))| (k.offset, k.len))
                .map(|(i, _)| i)
        });
        let Some(i) = i else {
            self.misses += 1;
            return None;
        };
        let e = self.entries.remove(i);
        self.entries.push(e);
        self.hits += 1;
        if e.0 != *q {
            self.range_hits += 1;
        }
        Some((e.1, q.offset - e.0.offset))
    }

    /// Ids that leave when `key` goes in under `limits`.
    fn insert(&mut self, key: RegKey, id: u64, limits: CacheLimits) -> Vec<u64> {
        if limits.entries == 0 || key.len > limits.bytes {
            return vec![id];
        }
        let mut out = Vec::new();
        while self.entries.len() >= limits.entries
            || self.entries.iter().map(|(k, _)| k.len).sum::<u64>() + key.len > limits.bytes
        {
            out.push(self.entries.remove(0).1);
        }
        self.entries.push((key, id));
        out
    }

    fn remove(&mut self, keep: impl Fn(&(RegKey, u64)) -> bool) -> Vec<u64> {
        let (gone, kept): (Vec<_>, Vec<_>) = self.entries.drain(..).partition(|e| !keep(e));
        self.entries = kept;
        gone.into_iter().map(|e| e.1).collect()
    }
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 6 } else { 512 }, ..ProptestConfig::default() })]
    /// Every answer is the model's (hit, range hit or miss; which registration; the offset
    /// in it); an answer always covers the range asked for, of the owner's current
    /// generation, device and access — never a freed allocation's, even at the same place;
    /// the counters and limits hold; and a registration is dropped exactly when neither
    /// the cache nor a user holds it.
    #[test]
    fn the_library_sequence_matches_a_reference_model(
        ops in proptest::collection::vec(op(), 1..if cfg!(miri) { 40 } else { 300 }),
        entries in 1usize..8,
        bytes in 16u64..256,
    ) {
        let limits = CacheLimits { entries, bytes };
        let mut c: RegCache<Rc<Reg>> = RegCache::new(limits);
        let mut m = Model::default();
        let live = Rc::new(Cell::new(0u64));
        let mut slots = [Slot::Live(1), Slot::Live(2), Slot::Live(3)];
        let mut generation = 3u64;
        let mut held: Vec<Rc<Reg>> = Vec::new();
        let mut next_id = 0u64;
        let owner = |slot: usize, g: u64| Owner::Fabric { node: 0, region: slot as u64, generation: g };

        for op in ops {
            match op {
                Op::Register { slot, device, writable, offset, len } => {
                    let Slot::Live(g) = slots[slot] else { continue };
                    let key = RegKey { owner: owner(slot, g), device, writable, offset, len };
                    let want = m.get(&key);
                    match c.get(&key) {
                        Some((reg, at)) => {
                            prop_assert_eq!(Some((reg.id, at)), want);
                            let k = reg.key;
                            prop_assert_eq!((k.owner, k.device, k.writable), (key.owner, key.device, key.writable));
                            prop_assert!(k.offset + at == key.offset && key.offset + key.len <= k.offset + k.len);
                            held.push(reg);
                        }
                        None => {
                            prop_assert_eq!(want, None);
                            next_id += 1;
                            live.set(live.get() + 1);
                            let reg = Rc::new(Reg { id: next_id, key, live: live.clone() });
                            let out: Vec<u64> = c.insert(key, reg.clone()).iter().map(|r| r.id).collect();
                            prop_assert_eq!(sorted(out), sorted(m.insert(key, next_id, limits)));
                            held.push(reg);
                        }
                    }
                }
                Op::Unregister(i) => {
                    if held.is_empty() {
                        continue;
                    }
                    let reg = held.remove(i % held.len());
                    let Owner::Fabric { region, generation: g, .. } = reg.key.owner else { unreachable!() };
                    drop(reg);
                    let slot = region as usize;
                    // The last registration of a freed allocation lets it go: invalidate.
                    if slots[slot] == Slot::Dropped(g) && !held.iter().any(|r| r.key.owner == owner(slot, g)) {
                        let out: Vec<u64> = c.invalidate(owner(slot, g)).iter().map(|r| r.id).collect();
                        prop_assert_eq!(sorted(out), sorted(m.remove(|(k, _)| k.owner != owner(slot, g))));
                        slots[slot] = Slot::Empty;
                    }
                }
                Op::Free(slot) => {
                    let Slot::Live(g) = slots[slot] else { continue };
                    if held.iter().any(|r| r.key.owner == owner(slot, g)) {
                        slots[slot] = Slot::Dropped(g);
                    } else {
                        let out: Vec<u64> = c.invalidate(owner(slot, g)).iter().map(|r| r.id).collect();
                        prop_assert_eq!(sorted(out), sorted(m.remove(|(k, _)| k.owner != owner(slot, g))));
                        slots[slot] = Slot::Empty;
                    }
                }
                Op::Alloc(slot) => {
                    // Reallocation at the same place: a new generation.
                    if slots[slot] == Slot::Empty {
                        generation += 1;
                        slots[slot] = Slot::Live(generation);
                    }
                }
                Op::EvictUnused => {
                    let out: Vec<u64> = c.evict_unused(|r| Rc::strong_count(r) == 1).iter().map(|r| r.id).collect();
                    let in_use = |id: u64| held.iter().any(|r| r.id == id);
                    prop_assert_eq!(sorted(out), sorted(m.remove(|(_, id)| in_use(*id))));
                }
            }
            let s = c.stats();
            prop_assert_eq!((s.hits, s.range_hits, s.misses), (m.hits, m.range_hits, m.misses));
            prop_assert_eq!(s.entries as usize, m.entries.len());
            prop_assert_eq!(s.bytes, m.entries.iter().map(|(k, _)| k.len).sum::<u64>());
            prop_assert!(s.entries as usize <= entries && s.bytes <= bytes);
            // Live registrations: exactly those the cache or a user holds.
            let mut ids: Vec<u64> = m.entries.iter().map(|e| e.1).chain(held.iter().map(|r| r.id)).collect();
            ids.sort_unstable();
            ids.dedup();
            prop_assert_eq!(live.get(), ids.len() as u64);
        }
        drop(held);
        drop(c.clear());
        prop_assert_eq!(live.get(), 0);
    }
}
