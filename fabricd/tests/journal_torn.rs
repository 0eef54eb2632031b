//! Crash-safety at the byte level: a segment cut at every offset recovers exactly the
//! records written before the cut; damage anywhere but the tail is a hard error that
//! leaves the files untouched.

use std::fs;
use std::path::{Path, PathBuf};

use fabricd::journal::format::{FRAME_LEN, FormatError, HEADER_LEN};
use fabricd::journal::{Journal, JournalError, JournalOptions, Replay, segment_path};

const SIZES: [usize; 8] = [0, 1, 7, 100, 3, 600, 20, 50];

fn payload(i: usize) -> Vec<u8> {
    (0..SIZES[i]).map(|b| (b * 31 + i * 7 + 1) as u8).collect()
}

/// A one-segment journal with the records above; returns the segment's bytes and the
/// offset where each record ends.
fn reference() -> (Vec<u8>, Vec<usize>) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (mut j, _) = Journal::open(tmp.path(), JournalOptions::default()).expect("open");
    for i in 0..SIZES.len() {
        j.append(i as u16 + 1, &payload(i)).expect("append");
    }
    drop(j);
    let bytes = fs::read(segment_path(tmp.path(), 1)).expect("read");
    let mut ends = Vec::new();
    let mut end = HEADER_LEN;
    for size in SIZES {
        end += FRAME_LEN + size;
        ends.push(end);
    }
    assert_eq!(bytes.len(), end);
    (bytes, ends)
}

fn open(dir: &Path) -> Result<(Journal, Replay), JournalError> {
    Journal::open(dir, JournalOptions::default())
}

fn fresh(dir: &Path, bytes: &[u8]) -> PathBuf {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).expect("mkdir");
    let path = segment_path(dir, 1);
    fs::write(&path, bytes).expect("write");
    path
}

fn check_prefix(replay: &Replay, k: usize) {
    assert_eq!(replay.records.len(), k);
    for (i, r) in replay.records.iter().enumerate() {
        assert_eq!((r.seq, r.kind), (i as u64 + 1, i as u16 + 1));
        assert_eq!(r.payload, payload(i));
    }
}

#[test]
fn cut_at_every_offset_recovers_the_written_prefix() {
    let (bytes, ends) = reference();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    for cut in 0..=bytes.len() {
        let path = fresh(&dir, &bytes[..cut]);
        if cut < HEADER_LEN {
            // Segments appear whole (written aside, renamed), so a crash cannot cut a
            // header: a short one is damage, and is left as it is.
            match open(&dir) {
                Err(JournalError::Corrupt { source: FormatError::ShortHeader { .. }, offset: 0, .. }) => {}
                other => panic!("cut {cut}: expected a short-header error, got {other:?}"),
            }
            assert_eq!(fs::read(&path).expect("read"), &bytes[..cut], "cut {cut}: file changed");
            continue;
        }
        let k = ends.iter().filter(|&&e| e <= cut).count();
        let good = if k == 0 { HEADER_LEN } else { ends[k - 1] };
        let (mut j, replay) = open(&dir).unwrap_or_else(|e| panic!("cut {cut}: {e}"));
        check_prefix(&replay, k);
        assert_eq!(replay.dropped_bytes(), (cut - good) as u64, "cut {cut}");
        assert_eq!(replay.truncated.is_some(), cut != good, "cut {cut}");
        assert_eq!(fs::metadata(&path).expect("stat").len(), good as u64, "cut {cut}: torn tail cut off");
        assert_eq!(j.append(99, b"after the crash").expect("append"), k as u64 + 1);
        drop(j);
        let (_, replay) = open(&dir).expect("reopen");
        assert_eq!(replay.records.len(), k + 1);
        assert_eq!(replay.records[k].payload, b"after the crash");
        assert_eq!(replay.truncated, None);
    }
}

#[test]
fn zero_filled_tail_at_every_offset_is_torn() {
    // A file whose size reached the disk before its data (preallocation, or a crash of
    // the file system) reads as zeros past the last durable byte.
    let (bytes, ends) = reference();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    for cut in HEADER_LEN..bytes.len() {
        let mut image = bytes[..cut].to_vec();
        image.resize(bytes.len() + 4096, 0);
        fresh(&dir, &image);
        // A record whose missing bytes were zeros anyway is whole.
        let k = ends.iter().filter(|&&e| image[..e] == bytes[..e]).count();
        assert!(k >= ends.iter().filter(|&&e| e <= cut).count());
        let (_, replay) = open(&dir).unwrap_or_else(|e| panic!("cut {cut}: {e}"));
        check_prefix(&replay, k);
        let good = if k == 0 { HEADER_LEN } else { ends[k - 1] };
        assert_eq!(replay.dropped_bytes(), (image.len() - good) as u64);
    }
}

#[test]
fn every_damaged_byte_of_a_middle_record_is_a_hard_error() {
    let (bytes, ends) = reference();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    for m in [0, 3, 5] {
        let start = if m == 0 { HEADER_LEN } else { ends[m - 1] };
        for at in start..ends[m] {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut image = bytes.clone();
                image[at] ^= flip;
                let path = fresh(&dir, &image);
                match open(&dir) {
                    Err(JournalError::Corrupt { path: p, offset, source: FormatError::Damaged { next_valid, .. } }) => {
                        assert_eq!(p, path);
                        assert_eq!(offset, start as u64, "record {m} byte {at} ^ {flip:#x}");
                        assert_eq!(next_valid, ends[m] as u64, "record {m} byte {at} ^ {flip:#x}");
                    }
                    other => panic!("record {m} byte {at} ^ {flip:#x}: expected damage, got {other:?}"),
                }
                assert_eq!(fs::read(&path).expect("read"), image, "file changed");
            }
        }
    }
}

#[test]
fn random_bit_flips_before_the_last_record_are_hard_errors() {
    let (bytes, ends) = reference();
    let last_start = ends[ends.len() - 2];
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..300 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let at = (state % last_start as u64) as usize;
        let bit = 1u8 << ((state >> 32) % 8);
        let mut image = bytes.clone();
        image[at] ^= bit;
        let path = fresh(&dir, &image);
        let err = open(&dir).err().unwrap_or_else(|| panic!("byte {at} bit {bit:#x}: opened"));
        assert!(matches!(err, JournalError::Corrupt { .. }), "byte {at}: {err:?}");
        assert_eq!(fs::read(&path).expect("read"), image, "file changed");
        assert_eq!(fs::read_dir(&dir).expect("list").count(), 2, "only the segment and the lock");
    }
}

#[test]
fn damage_in_the_last_record_reads_as_a_torn_write() {
    // Indistinguishable from a write cut short: documented as the one place where damage
    // to an acknowledged record is dropped (with a warning) rather than refused.
    let (mut bytes, ends) = reference();
    let n = ends.len();
    bytes[ends[n - 1] - 3] ^= 0x10;
    let tmp = tempfile::tempdir().expect("tempdir");
    fresh(tmp.path(), &bytes);
    let (_, replay) = open(tmp.path()).expect("open");
    check_prefix(&replay, n - 1);
    assert_eq!(replay.dropped_bytes(), (ends[n - 1] - ends[n - 2]) as u64);
}

/// A journal of several sealed segments plus the newest; returns the segment paths.
fn multi_segment(dir: &Path) -> Vec<PathBuf> {
    let (mut j, _) = Journal::open(dir, JournalOptions { segment_bytes: 150 }).expect("open");
    for i in 0..12u8 {
        j.append(1, &[i; 30]).expect("append");
    }
    let last = j.segment();
    drop(j);
    assert!(last >= 4);
    (1..=last).map(|n| segment_path(dir, n)).collect()
}

#[test]
fn damage_in_a_sealed_segment_is_never_a_torn_tail() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let paths = multi_segment(tmp.path());
    let sealed = &paths[1];
    let original = fs::read(sealed).expect("read");
    for cut in [original.len() - 1, original.len() - 25, HEADER_LEN + 1] {
        fs::write(sealed, &original[..cut]).expect("write");
        match open(tmp.path()) {
            Err(JournalError::SealedDamage { path, .. }) => assert_eq!(&path, sealed),
            other => panic!("cut {cut}: expected sealed damage, got {other:?}"),
        }
        assert_eq!(fs::read(sealed).expect("read"), &original[..cut]);
    }
    fs::write(sealed, &original).expect("restore");
    let (_, replay) = open(tmp.path()).expect("open");
    assert_eq!(replay.records.len(), 12);
}

#[test]
fn missing_or_misnamed_segments_are_hard_errors() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let paths = multi_segment(tmp.path());
    let saved = fs::read(&paths[2]).expect("read");
    fs::remove_file(&paths[2]).expect("remove");
    assert!(matches!(open(tmp.path()), Err(JournalError::Discontinuous { .. })), "gap in segment numbers");
    // The same bytes under another number: the header names its own segment.
    let last = paths.len() as u64;
    fs::write(segment_path(tmp.path(), last + 1), &saved).expect("write");
    fs::write(&paths[2], &saved).expect("write");
    assert!(matches!(open(tmp.path()), Err(JournalError::Discontinuous { .. })), "misnamed segment");
    fs::remove_file(segment_path(tmp.path(), last + 1)).expect("remove");
    // The oldest segment lost: the history does not start at sequence 1.
    let first = fs::read(&paths[0]).expect("read");
    fs::remove_file(&paths[0]).expect("remove");
    assert!(matches!(open(tmp.path()), Err(JournalError::Discontinuous { .. })), "oldest missing");
    fs::write(&paths[0], &first).expect("restore");
    let (_, replay) = open(tmp.path()).expect("open");
    assert_eq!(replay.records.len(), 12);
}

#[test]
fn salvage_keeps_the_prefix_before_the_damage_and_moves_the_rest_aside() {
    use fabricd::journal::{SalvageAction, salvage};
    // Intact: nothing to do.
    let tmp = tempfile::tempdir().expect("tempdir");
    multi_segment(tmp.path());
    assert_eq!(salvage(tmp.path()).expect("salvage"), fabricd::journal::Salvage::default());

    // Damage in a middle record of the newest segment: cut there.
    let (mut bytes, ends) = reference();
    bytes[ends[3] + 5] ^= 0x04;
    let dir = tmp.path().join("one");
    let path = fresh(&dir, &bytes);
    assert!(open(&dir).is_err());
    let report = salvage(&dir).expect("salvage");
    let aside = report.aside.clone().expect("aside dir");
    assert_eq!(
        report.actions,
        [SalvageAction::Truncated {
            path: path.clone(),
            offset: ends[3] as u64,
            copy: aside.join("0000000000000001.seg")
        }]
    );
    assert_eq!(fs::read(aside.join("0000000000000001.seg")).expect("copy"), bytes, "full bytes kept");
    let (mut j, replay) = open(&dir).expect("open after salvage");
    check_prefix(&replay, 4);
    assert_eq!(j.append(1, b"on we go").expect("append"), 5);

    // Damage in a sealed segment's header: it and every later segment go aside.
    let dir = tmp.path().join("multi");
    let paths = multi_segment(&dir);
    let mut second = fs::read(&paths[1]).expect("read");
    second[20] ^= 0xff;
    fs::write(&paths[1], &second).expect("write");
    assert!(open(&dir).is_err());
    let report = salvage(&dir).expect("salvage");
    let moved: Vec<_> = report
        .actions
        .iter()
        .map(|a| match a {
            SalvageAction::MovedAside { path, .. } => path.clone(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(moved, paths[1..]);
    let (_, replay) = open(&dir).expect("open after salvage");
    let first_segment_records = replay.records.len();
    assert!(first_segment_records > 0 && first_segment_records < 12);
    assert_eq!(
        replay.records.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (1..=first_segment_records as u64).collect::<Vec<_>>()
    );
}

/// A snapshot split over records with a part damaged (intact records after it) is the
/// whole segment's fault: salvage moves it aside whole, once, and its full bytes stay
/// there (before, a cut inside the snapshot was copied aside, then the cut segment moved
/// over that copy).
#[test]
fn salvage_moves_a_damaged_split_snapshot_aside_whole() {
    use fabricd::journal::{MAX_PAYLOAD, SalvageAction, salvage};
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    let (mut j, _) = open(&dir).expect("open");
    j.append(1, b"before").expect("append");
    let snapshot = vec![7u8; 2 * MAX_PAYLOAD + 5];
    j.compact(&snapshot).expect("compact");
    j.append(1, b"after").expect("append");
    let path = segment_path(&dir, j.segment());
    drop(j);
    let mut bytes = fs::read(&path).expect("read");
    bytes[HEADER_LEN + FRAME_LEN + MAX_PAYLOAD + FRAME_LEN + 10] ^= 0x01;
    fs::write(&path, &bytes).expect("write");
    match open(&dir) {
        Err(JournalError::Corrupt { offset, source: FormatError::MissingSnapshot, .. }) => {
            assert_eq!(offset, HEADER_LEN as u64);
        }
        other => panic!("expected the snapshot missing, got {:?}", other.map(|(_, r)| r.last_seq())),
    }
    let report = salvage(&dir).expect("salvage");
    let aside = report.aside.clone().expect("aside dir");
    let to = aside.join(path.file_name().expect("name"));
    assert_eq!(report.actions, [SalvageAction::MovedAside { path: path.clone(), to: to.clone() }]);
    assert!(fs::read(&to).expect("kept") == bytes, "the full bytes kept");
    let (_, replay) = open(&dir).expect("open after salvage");
    assert_eq!((replay.snapshot, replay.records.len()), (None, 0), "nothing before the snapshot is left");
}
