//! Interleave sets and partitions in a live map: every legal ways/granularity pair stripes
//! exactly like the reference, both ways, including 3/6/12 ways; partitions resolve only
//! their own ranges with distinct errors.
#![allow(clippy::unwrap_used, reason = "test helpers panic on failure by design")]

mod common;

use common::{Naive, device, inventory, naive_translate, snap_translate};
use fabric_addrmap::interleave::{GRANULARITIES, WAYS};
use fabric_addrmap::{AddressMap, GIB, MapConfig, MapError, ResourceKey, TranslateError};
use fabric_topology::{Device, DeviceId, MemoryKind};
use proptest::prelude::*;

fn cxl(node: &str, i: usize, size: u64) -> Device {
    device(Some(node), &format!("CXL-{i}"), &[(MemoryKind::CxlVolatile, size)])
}

fn key(i: usize) -> ResourceKey {
    ResourceKey::new(DeviceId::uuid(&format!("CXL-{i}")), MemoryKind::CxlVolatile, 0)
}

#[test]
fn every_legal_geometry_matches_the_reference_both_ways() {
    for &ways in &WAYS {
        for &gran in &GRANULARITIES {
            let ways = u32::from(ways);
            let gran = u64::from(gran);
            let devs: Vec<Device> = (0..ways as usize).map(|i| cxl("n0", i, 2 * GIB + 4096 * i as u64)).collect();
            let mut map = AddressMap::new(MapConfig::default()).unwrap();
            map.update(&inventory(devs.clone())).unwrap();
            let members: Vec<ResourceKey> = (0..ways as usize).map(key).collect();
            let c = map.add_interleave("set", ways, gran, &members, None).unwrap();
            assert_eq!(c.absorbed.len(), ways as usize);
            let snap = map.snapshot();
            let set = &snap.state().interleaves[0];
            assert_eq!(set.member_size, 2 * GIB, "smallest member, rounded to the granularity");
            let total = set.size();
            let mut x = 0x9e37_79b9u64 ^ (u64::from(ways) << 20) ^ gran;
            let mut probes: Vec<u64> = vec![0, 1, gran - 1, gran, total - 1, total, total / 3];
            for _ in 0..500 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                probes.push((x >> 11) % (total + GIB));
            }
            for off in probes {
                let gfa = set.start + off;
                let want = naive_translate(snap.state(), gfa);
                assert_eq!(snap_translate(&snap, gfa), want, "ways {ways} gran {gran} off {off:#x}");
                if let Naive::Member(k, dpa) = want {
                    assert_eq!(snap.reverse_key(&k, dpa).unwrap(), gfa);
                }
            }
            // Each member's first and last byte.
            for m in &members {
                for dpa in [0, set.member_size - 1] {
                    let gfa = snap.reverse_key(m, dpa).unwrap();
                    assert_eq!(snap_translate(&snap, gfa), Naive::Member(m.clone(), dpa));
                }
                assert!(matches!(snap.reverse_key(m, set.member_size), Err(TranslateError::OffsetOutOfRange { .. })));
            }
        }
    }
}

proptest! {
    #[test]
    fn batch_translation_equals_single(addrs in proptest::collection::vec(0u64..(16 * GIB), 1..300)) {
        let devs: Vec<Device> = (0..6).map(|i| cxl("n0", i, GIB)).collect();
        let mut map = AddressMap::new(MapConfig::default()).unwrap();
        map.update(&inventory(devs)).unwrap();
        let members: Vec<ResourceKey> = (0..3).map(key).collect();
        map.add_interleave("three", 3, 4096, &members, None).unwrap();
        let snap = map.snapshot();
        let mut out = vec![Err(TranslateError::UnknownResource); addrs.len()];
        snap.translate_batch(&addrs, &mut out);
        for (a, o) in addrs.iter().zip(&out) {
            prop_assert_eq!(*o, snap.translate(*a));
        }
    }
}

#[test]
fn interleave_errors_and_presence() {
    let devs: Vec<Device> = (0..4).map(|i| cxl("n0", i, GIB)).collect();
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    map.update(&inventory(devs.clone())).unwrap();
    let m: Vec<ResourceKey> = (0..4).map(key).collect();
    assert!(matches!(map.add_interleave("x", 5, 256, &m, None), Err(MapError::Interleave(_))));
    assert!(matches!(map.add_interleave("x", 2, 256, &m, None), Err(MapError::Layout(_))));
    assert!(matches!(map.add_interleave("x", 2, 256, &[m[0].clone(), m[0].clone()], None), Err(MapError::Layout(_))));
    assert!(matches!(map.add_interleave("x", 2, 256, &m[..2], Some(GIB + 256)), Err(MapError::Layout(_))));
    map.add_interleave("x", 2, 256, &m[..2], None).unwrap();
    assert!(matches!(map.add_interleave("x", 2, 256, &m[2..], None), Err(MapError::Layout(_))));
    // Members are no longer directly mapped.
    assert!(matches!(map.add_interleave("y", 2, 256, &m[1..3], None), Err(MapError::Layout(_))));
    let start = map.state().interleaves[0].start;

    // A member vanishes: the set is a hole; it comes back at the same place.
    map.update(&inventory([devs[1].clone(), devs[2].clone(), devs[3].clone()])).unwrap();
    let snap = map.snapshot();
    assert!(matches!(snap.translate(start), Err(TranslateError::Hole { .. })));
    assert_eq!(snap.reverse_key(&m[1], 0), Err(TranslateError::Vanished));
    map.update(&inventory(devs.clone())).unwrap();
    assert_eq!(map.state().interleaves[0].start, start);
    assert!(map.snapshot().translate(start).is_ok());

    // Removing the set puts members back as direct ranges on the next update.
    map.remove_interleave("x").unwrap();
    let c = map.update(&inventory(devs)).unwrap();
    assert_eq!(c.added.len(), 2);
}

#[test]
fn partitions_see_only_their_own_ranges() {
    let a = device(Some("n0"), "GPU-a", &[(MemoryKind::Hbm, GIB)]);
    let b = device(Some("n0"), "GPU-b", &[(MemoryKind::Hbm, GIB)]);
    let c = device(Some("n0"), "GPU-c", &[(MemoryKind::Hbm, GIB)]);
    let x: Vec<Device> = (0..2).map(|i| cxl("n1", i, GIB)).collect();
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    let all = [a.clone(), b.clone(), c.clone(), x[0].clone(), x[1].clone()];
    map.update(&inventory(all.clone())).unwrap();
    map.add_interleave("pair", 2, 256, &[key(0), key(1)], None).unwrap();
    map.partition("tenant", &[a.id.clone(), c.id.clone(), x[0].id.clone(), x[1].id.clone()]);
    map.partition("half", &[b.id.clone(), x[0].id.clone()]);
    // c vanishes: a hole inside the tenant's partition.
    map.update(&inventory([a.clone(), b.clone(), x[0].clone(), x[1].clone()])).unwrap();
    let snap = map.snapshot();
    let t = snap.partition("tenant").unwrap();
    let h = snap.partition("half").unwrap();
    assert!(snap.partition("nobody").is_none());
    let ga = snap.reverse(&a.id, MemoryKind::Hbm, 0, 7).unwrap();
    let gb = snap.reverse(&b.id, MemoryKind::Hbm, 0, 7).unwrap();
    let gc_ = snap.state().placements.iter().find(|p| p.key.device == c.id).unwrap().start;
    let gset = snap.state().interleaves[0].start;
    assert_eq!(t.translate(ga).unwrap().offset, 7);
    assert_eq!(t.translate(gb), Err(TranslateError::NotInPartition { gfa: gb }));
    assert!(matches!(t.translate(gc_), Err(TranslateError::Hole { .. })));
    assert_eq!(h.translate(gc_), Err(TranslateError::NotInPartition { gfa: gc_ }));
    assert_eq!(t.translate(1 << 50), Err(TranslateError::Unmapped { gfa: 1 << 50 }));
    assert!(t.translate(gset).is_ok());
    // A set is visible only when all its members are in the partition.
    assert_eq!(h.translate(gset), Err(TranslateError::NotInPartition { gfa: gset }));
    assert_eq!(h.reverse(&x[0].id, MemoryKind::CxlVolatile, 0, 0), Err(TranslateError::ResourceNotInPartition));
    assert_eq!(t.reverse(&b.id, MemoryKind::Hbm, 0, 0), Err(TranslateError::ResourceNotInPartition));
    assert_eq!(t.reverse(&a.id, MemoryKind::Hbm, 0, 7), Ok(ga));
    // Unknown devices do not leak existence through a view.
    assert_eq!(t.reverse(&DeviceId::uuid("nope"), MemoryKind::Hbm, 0, 0), Err(TranslateError::ResourceNotInPartition));
    assert_eq!(snap.reverse(&DeviceId::uuid("nope"), MemoryKind::Hbm, 0, 0), Err(TranslateError::UnknownResource));
    assert!(map.remove_partition("half").is_ok());
    assert!(map.snapshot().partition("half").is_none());
}
