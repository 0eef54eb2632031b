//! The state file: round trips, the kept previous copy, and corrupt or truncated files that
//! are reported with a typed error naming the file and are never overwritten silently.
#![allow(clippy::unwrap_used, reason = "test helpers panic on failure by design")]

mod common;

use std::fs;

use common::{device, inventory};
use fabric_addrmap::durable::FrameError;
use fabric_addrmap::persist::{HEADER_LEN, prev_path};
use fabric_addrmap::{
    AddressMap, DecodeError, GIB, MapConfig, MapError, PersistError, RebuildFrom, decode_state, encode_state,
};
use fabric_topology::{Device, MemoryKind};

fn devs(n: usize) -> Vec<Device> {
    (0..n).map(|i| device(Some("n0"), &format!("GPU-{i}"), &[(MemoryKind::Hbm, GIB + i as u64)])).collect()
}

fn small_map() -> AddressMap {
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    map.update(&inventory(devs(2))).unwrap();
    map
}

#[test]
fn save_load_round_trip_keeps_previous_copy() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("map.state");
    let mut map = small_map();
    map.save(&path).unwrap();
    assert!(!prev_path(&path).exists());
    let first = fs::read(&path).unwrap();
    map.update(&inventory(devs(3))).unwrap();
    map.save(&path).unwrap();
    assert_eq!(fs::read(prev_path(&path)).unwrap(), first);
    let loaded = AddressMap::load(&path).unwrap();
    assert_eq!(loaded.state(), map.state());
    assert_eq!(loaded.generation(), 2);
    assert_eq!(decode_state(&first).unwrap().generation, 1);
    // No temp files left behind.
    let names: Vec<String> =
        fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn header_is_as_documented() {
    let map = small_map();
    let b = encode_state(map.state());
    assert_eq!(&b[..8], b"\x89GFA\r\n\x1a\n");
    assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 1);
    assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), 1);
    assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), map.generation());
    assert_eq!(u64::from_le_bytes(b[24..32].try_into().unwrap()) as usize, b.len() - HEADER_LEN);
    assert_eq!(u32::from_le_bytes(b[32..36].try_into().unwrap()), crc32c::crc32c(&b[HEADER_LEN..]));
    assert_eq!(u32::from_le_bytes(b[36..40].try_into().unwrap()), crc32c::crc32c(&b[..36]));
    assert_eq!(b[HEADER_LEN], b'{', "JSON payload");
}

#[test]
fn every_truncation_and_every_bit_flip_is_an_error() {
    let map = small_map();
    let good = encode_state(map.state());
    for len in 0..good.len() {
        let e = decode_state(&good[..len]).unwrap_err();
        assert!(
            matches!(e, DecodeError::Frame(FrameError::Truncated { .. } | FrameError::BadMagic)),
            "len {len}: {e:?}"
        );
    }
    for i in 0..good.len() {
        for bit in [0x01u8, 0x80] {
            let mut bad = good.clone();
            bad[i] ^= bit;
            assert!(decode_state(&bad).is_err(), "flip {bit:#x} at {i}");
        }
    }
    let mut long = good.clone();
    long.push(0);
    assert_eq!(decode_state(&long).unwrap_err(), DecodeError::Frame(FrameError::TrailingBytes { extra: 1 }));
}

#[test]
fn semantically_bad_payload_with_good_checksums_is_rejected() {
    let map = small_map();
    let mut st = map.state().clone();
    st.placements[1].start = st.placements[0].start; // overlap
    let e = decode_state(&encode_state(&st)).unwrap_err();
    assert!(matches!(e, DecodeError::Invalid(_)), "{e:?}");
    // Header generation differs from the payload's.
    let mut b = encode_state(map.state());
    b[16] ^= 1;
    let crc = crc32c::crc32c(&b[..36]);
    b[36..40].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(decode_state(&b), Err(DecodeError::Generation { .. })));
    // A future version.
    let mut b = encode_state(map.state());
    b[8] = 2;
    let crc = crc32c::crc32c(&b[..36]);
    b[36..40].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(decode_state(&b).unwrap_err(), DecodeError::Frame(FrameError::Version(2)));
}

#[test]
fn corrupt_file_is_reported_left_untouched_and_not_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("map.state");
    let map = small_map();
    map.save(&path).unwrap();
    let good = fs::read(&path).unwrap();
    // Every truncation and a flip in each region, as files.
    let mut cases: Vec<Vec<u8>> = (0..good.len()).step_by(7).map(|n| good[..n].to_vec()).collect();
    for i in [0, 9, 20, 30, 38, HEADER_LEN + 3, good.len() - 1] {
        let mut b = good.clone();
        b[i] ^= 0x40;
        cases.push(b);
    }
    for bad in cases {
        fs::write(&path, &bad).unwrap();
        match AddressMap::load(&path) {
            Err(MapError::Persist(PersistError::Corrupt { path: p, .. })) => assert_eq!(p, path),
            other => panic!("expected Corrupt, got {other:?}"),
        }
        let msg = format!(
            "{}",
            PersistError::Corrupt { path: path.clone(), source: DecodeError::Frame(FrameError::BadMagic) }
        );
        assert!(msg.contains("map.state"), "{msg}");
        match map.save(&path) {
            Err(MapError::Persist(PersistError::RefuseOverwrite { .. })) => {}
            other => panic!("expected RefuseOverwrite, got {other:?}"),
        }
        assert!(matches!(AddressMap::open(&path, MapConfig::default()), Err(MapError::Persist(_))));
        assert_eq!(fs::read(&path).unwrap(), bad, "file was modified");
    }
}

#[test]
fn rebuild_moves_the_bad_file_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("map.state");
    let mut map = small_map();
    map.save(&path).unwrap();
    map.update(&inventory(devs(3))).unwrap();
    map.save(&path).unwrap();
    let mut bad = fs::read(&path).unwrap();
    let n = bad.len();
    bad[n - 2] ^= 0xff; // payload damage, header intact: generation 2 is readable
    fs::write(&path, &bad).unwrap();

    let inv = inventory(devs(3));
    let r = AddressMap::rebuild(&path, MapConfig::default(), &inv, RebuildFrom::Previous).unwrap();
    let aside = r.moved_aside.unwrap();
    assert!(aside.to_string_lossy().ends_with("map.state.corrupt-2"), "{aside:?}");
    assert_eq!(fs::read(&aside).unwrap(), bad);
    // From the previous copy: the two old devices keep their ranges.
    let loaded = AddressMap::load(&path).unwrap();
    assert_eq!(loaded.state(), r.map.state());
    assert_eq!(r.change.added.len(), 1);

    // From the inventory alone, with garbage that has no readable header.
    fs::write(&path, b"garbage").unwrap();
    let r = AddressMap::rebuild(&path, MapConfig::default(), &inv, RebuildFrom::Inventory).unwrap();
    let aside = r.moved_aside.unwrap();
    assert!(aside.to_string_lossy().contains("map.state.corrupt-t"), "{aside:?}");
    assert_eq!(r.map.generation(), 1);
    assert!(AddressMap::load(&path).is_ok());
}

#[test]
fn missing_state_with_previous_copy_is_an_error_and_absent_state_starts_empty() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("map.state");
    let map = AddressMap::open(&path, MapConfig::default()).unwrap();
    assert_eq!(map.generation(), 0);
    fs::write(prev_path(&path), encode_state(small_map().state())).unwrap();
    assert!(matches!(
        AddressMap::open(&path, MapConfig::default()),
        Err(MapError::Persist(PersistError::MissingWithPrevious { .. }))
    ));
}

/// Commit, then publish: a change made inside `commit` reaches readers only once it is
/// saved; a save that fails leaves the map and its readers where they were.
#[test]
fn commit_publishes_only_what_was_saved() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("map.state");
    let mut map = small_map();
    map.save(&path).unwrap();
    let reader = map.reader();
    assert_eq!(reader.snapshot().generation(), 1);

    // Inside the commit, before the save: readers still see generation 1.
    let seen_inside = map
        .commit(&path, |m| {
            m.update(&inventory(devs(3)))?;
            Ok::<_, MapError>(reader.snapshot().generation())
        })
        .unwrap();
    assert_eq!(seen_inside, 1, "a change was visible before it was saved");
    assert_eq!(reader.snapshot().generation(), 2);
    assert_eq!(AddressMap::load(&path).unwrap().generation(), 2, "published and saved are the same generation");

    // A save that fails (a directory where the new file goes): nothing is published and the
    // map is back at generation 2, its devices as before.
    fs::create_dir(dir.path().join("map.state.tmp")).unwrap();
    let before = map.state().clone();
    let r = map.commit(&path, |m| m.update(&inventory(devs(4))).map(|_| ()));
    assert!(r.is_err(), "the save cannot succeed");
    assert_eq!(reader.snapshot().generation(), 2);
    assert_eq!(map.state(), &before);
    assert_eq!(AddressMap::load(&path).unwrap().generation(), 2);

    // An unchanged commit writes nothing and publishes nothing new.
    fs::remove_dir(dir.path().join("map.state.tmp")).unwrap();
    let saved = fs::read(&path).unwrap();
    map.commit(&path, |m| m.update(&inventory(devs(3))).map(|_| ())).unwrap();
    assert_eq!(fs::read(&path).unwrap(), saved);
    assert_eq!(reader.snapshot().generation(), 2);
}
