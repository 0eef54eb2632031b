//! Scale and concurrency: a 100,000-GPU domain (12,500 nodes x 8 x 141 GB, 14.1 PB) fits in
//! 57 bits with every GPU's first and last byte translating both ways; readers keep
//! translating correctly while a writer publishes new generations.
#![allow(clippy::unwrap_used, reason = "test helpers panic on failure by design")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use fabric_addrmap::{MapConfig, TranslateError, bench};
use fabric_topology::MemoryKind;

const HBM: u64 = 141_000_000_000;

#[test]
fn hundred_thousand_gpus_fit_in_57_bits() {
    let inv = bench::gpu_cluster(12_500, 8, HBM);
    let (map, b) = bench::build_map(&inv, MapConfig::default()).unwrap();
    assert_eq!(b.ranges, 100_000);
    assert_eq!(b.node_slots, 12_500);
    assert_eq!(b.mapped_bytes, 100_000 * HBM);
    assert!(b.mapped_bytes > 1 << 50, "more than 1 PiB");
    assert!(b.high_water <= 1 << 57 && b.bits_used <= 57, "{b:?}");
    let snap = map.snapshot();
    for d in &inv.devices {
        for off in [0, HBM - 1] {
            let gfa = snap.reverse(&d.id, MemoryKind::Hbm, 0, off).unwrap();
            assert!(gfa < 1 << 57);
            let l = snap.translate(gfa).unwrap();
            assert_eq!((&snap.resource(l.resource).device, l.offset), (&d.id, off));
        }
    }
    // Node slots are 2 TiB (8 x 132 GiB rounded up) and the map is dense from 0.
    assert!(snap.state().nodes.iter().all(|n| n.span == 2 << 40));
    assert_eq!(b.high_water, 12_500 * (2u64 << 40) - (2 << 40) + 8 * 132 * (1 << 30));
}

#[test]
fn readers_stay_correct_while_a_writer_publishes() {
    let inv = bench::gpu_cluster(64, 8, 80 << 30);
    let (mut map, _) = bench::build_map(&inv, MapConfig::default()).unwrap();
    let reader = map.reader();
    let stop = Arc::new(AtomicBool::new(false));
    let ids: Vec<_> = inv.devices.iter().map(|d| d.id.clone()).collect();
    let readers: Vec<_> = (0..2)
        .map(|t| {
            let reader = reader.clone();
            let stop = stop.clone();
            let ids = ids.clone();
            std::thread::spawn(move || {
                let mut checked = 0u64;
                let mut seen = std::collections::BTreeSet::new();
                let mut i = t;
                while !stop.load(Ordering::Relaxed) || checked < 1000 {
                    let snap = reader.snapshot();
                    seen.insert(snap.generation());
                    let id = &ids[i % ids.len()];
                    i += 7;
                    // Within one snapshot, reverse and forward agree, or the device is a hole.
                    match snap.reverse(id, MemoryKind::Hbm, 0, 12345) {
                        Ok(gfa) => {
                            let l = snap.translate(gfa).unwrap();
                            assert_eq!((&snap.resource(l.resource).device, l.offset), (id, 12345));
                        }
                        Err(TranslateError::Vanished) => {
                            let p = snap.state().placements.iter().find(|p| &p.key.device == id).unwrap();
                            assert!(matches!(snap.translate(p.start), Err(TranslateError::Hole { .. })));
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                    checked += 1;
                }
                seen.len()
            })
        })
        .collect();
    let mut smaller = inv.clone();
    for round in 0..40 {
        smaller.devices.truncate(inv.devices.len() - 1 - round % 5);
        map.update(&smaller).unwrap();
        map.update(&inv).unwrap();
        smaller = inv.clone();
    }
    stop.store(true, Ordering::Relaxed);
    let generations: Vec<usize> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    assert_eq!(map.generation(), 81);
    assert!(generations.iter().all(|&g| g >= 1));
}

#[test]
fn translate_bench_runs_and_reports_consistent_figures() {
    let t = bench::translate(4000, 20_000).unwrap();
    assert_eq!(t.ranges, 4000);
    assert!(t.ns_per_lookup > 0.0 && t.btreemap_ns_per_lookup > 0.0);
    assert!((t.ratio - t.btreemap_ns_per_lookup / t.ns_per_lookup).abs() < 1e-9);
    assert!(t.batch_lookups_per_sec > 0.0);
    assert!(t.generations_published >= 1 || t.ns_per_lookup_while_publishing > 0.0);
}
