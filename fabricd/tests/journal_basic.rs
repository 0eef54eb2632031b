//! Black-box behaviour of the journal: append, batch, reopen, rotation, compaction, the
//! lock, and refusals.

use std::fs;
use std::path::Path;

use fabricd::journal::{
    Journal, JournalError, JournalOptions, KIND_SNAPSHOT, MAX_PAYLOAD, MAX_SNAPSHOT, RESERVED_KINDS, segment_name,
};

fn open(dir: &Path, segment_bytes: u64) -> (Journal, fabricd::journal::Replay) {
    Journal::open(dir, JournalOptions { segment_bytes }).expect("open")
}

fn segments(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
        .filter(|n| n.ends_with(".seg"))
        .collect();
    names.sort();
    names
}

#[test]
fn appends_survive_reopen_in_order() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("journal");
    let (mut j, replay) = open(&dir, 1 << 20);
    assert_eq!(replay.last_seq(), None);
    assert_eq!(j.append(1, b"first").expect("append"), 1);
    assert_eq!(j.append(2, b"").expect("append"), 2);
    assert_eq!(j.append_batch(&[(3, b"a"), (4, b"bb"), (5, b"ccc")]).expect("batch"), [3, 4, 5]);
    assert_eq!(j.append_batch(&[]).expect("empty batch"), Vec::<u64>::new());
    assert_eq!(j.next_seq(), 6);
    drop(j);
    let (mut j, replay) = open(&dir, 1 << 20);
    let got: Vec<_> = replay.records.iter().map(|r| (r.seq, r.kind, r.payload.clone())).collect();
    assert_eq!(
        got,
        [
            (1, 1, b"first".to_vec()),
            (2, 2, vec![]),
            (3, 3, b"a".to_vec()),
            (4, 4, b"bb".to_vec()),
            (5, 5, b"ccc".to_vec())
        ]
    );
    assert_eq!(replay.snapshot, None);
    assert_eq!(replay.truncated, None);
    assert_eq!(j.append(1, b"next").expect("append"), 6);
}

#[test]
fn rotation_starts_new_segments_and_replays_across_them() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (mut j, _) = open(tmp.path(), 200);
    for i in 0..30u32 {
        j.append(1, &i.to_le_bytes().repeat(10)).expect("append");
    }
    let names = segments(tmp.path());
    assert!(names.len() >= 5, "expected several segments, got {names:?}");
    assert_eq!(names[0], segment_name(1));
    // A record larger than a segment still goes in (in a segment of its own).
    j.append(1, &[7; 1000]).expect("oversized record");
    drop(j);
    let (_, replay) = open(tmp.path(), 200);
    assert_eq!(replay.records.len(), 31);
    for (i, r) in replay.records.iter().take(30).enumerate() {
        assert_eq!(r.seq, i as u64 + 1);
        assert_eq!(r.payload, (i as u32).to_le_bytes().repeat(10));
    }
    assert_eq!(replay.records[30].payload, [7; 1000]);
}

#[test]
fn compaction_replaces_history_with_the_snapshot() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (mut j, _) = open(tmp.path(), 256);
    for i in 0..20u8 {
        j.append(1, &[i; 40]).expect("append");
    }
    assert!(segments(tmp.path()).len() > 2);
    let snap = j.compact(b"state as of 20").expect("compact");
    assert_eq!(snap, 21);
    assert_eq!(segments(tmp.path()), [segment_name(j.segment())], "older segments removed");
    j.append(1, b"after").expect("append");
    drop(j);
    let (mut j, replay) = open(tmp.path(), 256);
    let s = replay.snapshot.as_ref().expect("snapshot");
    assert_eq!((s.seq, s.kind, s.payload.as_slice()), (21, KIND_SNAPSHOT, &b"state as of 20"[..]));
    assert_eq!(replay.records.iter().map(|r| r.seq).collect::<Vec<_>>(), [22]);
    assert_eq!(replay.last_seq(), Some(22));
    // A second compaction, right after reopening.
    assert_eq!(j.compact(b"state as of 22").expect("compact"), 23);
    drop(j);
    let (_, replay) = open(tmp.path(), 256);
    assert_eq!(replay.snapshot.map(|s| s.seq), Some(23));
    assert!(replay.records.is_empty());
}

/// A snapshot over one record's bound is written as several records, each at most the
/// bound, under one header that counts them; replay joins them, and a segment missing one
/// is refused, never replayed as a shorter snapshot.
#[test]
fn a_snapshot_over_one_record_is_split_and_replays_whole() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (mut j, _) = open(tmp.path(), 1 << 20);
    j.append(1, b"before").expect("append");
    let snapshot: Vec<u8> = (0..2 * MAX_PAYLOAD + 5).map(|i| (i % 251) as u8).collect();
    assert_eq!(j.compact(&snapshot).expect("compact"), 4, "three records: 2, 3 and 4");
    assert_eq!(j.append(1, b"after").expect("append"), 5);
    drop(j);
    let (_, replay) = open(tmp.path(), 1 << 20);
    let s = replay.snapshot.as_ref().expect("snapshot");
    assert_eq!((s.seq, s.kind, s.payload.len()), (4, KIND_SNAPSHOT, snapshot.len()));
    assert!(s.payload == snapshot, "the parts joined in order");
    assert_eq!(replay.records.iter().map(|r| (r.seq, r.payload.as_slice())).collect::<Vec<_>>(), [(5, &b"after"[..])]);
    let names = segments(tmp.path());
    let first = tmp.path().join(&names[0]);
    let bytes = fs::read(&first).expect("read");
    let d = fabricd::journal::decode_segment(&bytes).expect("decodes");
    assert_eq!(d.header.snapshot_parts, 3);
    assert!(d.records.iter().all(|r| r.payload.len() <= MAX_PAYLOAD));
    // The last part cut short: the journal does not open on two thirds of a snapshot.
    fs::write(&first, &bytes[..bytes.len() - 3]).expect("cut");
    match Journal::open(tmp.path(), JournalOptions { segment_bytes: 1 << 20 }) {
        Err(JournalError::Corrupt { source: fabricd::journal::FormatError::MissingSnapshot, .. }) => {}
        other => panic!("expected a missing snapshot, got {:?}", other.map(|(_, r)| r.last_seq())),
    }
}

#[test]
fn a_second_writer_is_refused_until_the_first_closes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (j, _) = open(tmp.path(), 1 << 20);
    match Journal::open(tmp.path(), JournalOptions::default()) {
        Err(JournalError::Locked { .. }) => {}
        other => panic!("expected Locked, got {other:?}"),
    }
    drop(j);
    open(tmp.path(), 1 << 20);
}

#[test]
fn bad_requests_are_refused_and_leave_the_journal_usable() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (mut j, _) = open(tmp.path(), 1 << 20);
    assert!(matches!(j.append(RESERVED_KINDS, b"x"), Err(JournalError::ReservedKind { .. })));
    assert!(matches!(j.append(KIND_SNAPSHOT, b"x"), Err(JournalError::ReservedKind { .. })));
    let big = vec![0; MAX_PAYLOAD + 1];
    assert!(matches!(j.append(1, &big), Err(JournalError::PayloadTooLarge { .. })));
    // Allocated, never touched: refused for its size before it is read.
    let huge = vec![0; MAX_SNAPSHOT + 1];
    assert!(matches!(j.compact(&huge), Err(JournalError::SnapshotTooLarge { .. })));
    let max = vec![1; MAX_PAYLOAD];
    let batch: Vec<(u16, &[u8])> = (0..4).map(|_| (1, max.as_slice())).collect();
    assert!(matches!(j.append_batch(&batch), Err(JournalError::BatchTooLarge { .. })));
    assert_eq!(j.append(1, b"ok").expect("append"), 1);
    assert_eq!(j.append(1, &max).expect("largest payload"), 2);
    for bad in [0, 2 << 30] {
        assert!(matches!(
            Journal::open(&tmp.path().join("other"), JournalOptions { segment_bytes: bad }),
            Err(JournalError::Options { .. })
        ));
    }
    drop(j);
    let (_, replay) = open(tmp.path(), 1 << 20);
    assert_eq!(replay.records.len(), 2);
    assert_eq!(replay.records[1].payload.len(), MAX_PAYLOAD);
}

#[test]
fn unrelated_files_are_left_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    fs::write(tmp.path().join("README"), b"operator notes").expect("write");
    let (mut j, _) = open(tmp.path(), 1 << 20);
    j.append(1, b"x").expect("append");
    j.compact(b"s").expect("compact");
    drop(j);
    let (_, replay) = open(tmp.path(), 1 << 20);
    assert!(replay.removed.is_empty());
    assert_eq!(fs::read(tmp.path().join("README")).expect("read"), b"operator notes");
}

#[test]
fn segments_built_from_the_documented_layout_decode() {
    // fuzz/seeds/journal_records holds segments written by a separate script straight
    // from the byte tables in docs/journal.md, not by this code.
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/journal_records");
    let read = |name: &str| fs::read(seeds.join(name)).expect("seed");
    let plain = read("plain.seg");
    let d = fabricd::journal::decode_segment(&plain).expect("plain");
    assert_eq!(d.records.len(), 6);
    assert_eq!(d.records.iter().map(|r| r.kind).collect::<Vec<_>>(), [1, 2, 3, 1, 2, 3]);
    assert_eq!(d.records[5].payload, [5; 35]);
    assert_eq!(d.torn, None);
    for (torn, intact) in [("torn.seg", 5), ("zero_tail.seg", 6)] {
        let bytes = read(torn);
        let d = fabricd::journal::decode_segment(&bytes).expect(torn);
        assert_eq!(d.records.len(), intact, "{torn}");
        assert!(d.torn.is_some(), "{torn}");
    }
    let snap = read("snapshot.seg");
    let d = fabricd::journal::decode_segment(&snap).expect("snapshot");
    assert!(d.header.snapshot);
    assert_eq!((d.header.segment, d.header.generation, d.header.first_seq), (5, 2, 40));
    assert_eq!((d.records[0].kind, d.records[0].payload), (KIND_SNAPSHOT, &b"snapshot state"[..]));
    // A snapshot of three records ("split ", "snapshot ", "state"), then one record.
    let split = read("split_snapshot.seg");
    let d = fabricd::journal::decode_segment(&split).expect("split snapshot");
    assert_eq!((d.header.first_seq, d.header.snapshot_parts, d.header.snapshot_records()), (70, 3, 3));
    let parts: Vec<&[u8]> = d.records[..3].iter().map(|r| r.payload).collect();
    assert_eq!(parts.concat(), b"split snapshot state");
    assert_eq!((d.records[3].seq, d.records[3].kind, d.records[3].payload), (73, 1, &b"after"[..]));
    let empty = read("empty.seg");
    assert_eq!(fabricd::journal::decode_segment(&empty).expect("empty").last_seq(), 16);
}

#[test]
fn a_journal_at_the_last_sequence_number_is_refused_as_exhausted_not_wrapped() {
    use fabricd::journal::format::{SegmentHeader, encode_record};
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("journal");
    fs::create_dir_all(&dir).expect("mkdir");
    // A valid segment (checksums right) whose snapshot took the last number but one.
    let header =
        SegmentHeader { segment: 1, generation: 1, first_seq: u64::MAX - 1, snapshot: true, snapshot_parts: 0 };
    let mut bytes = header.encode().to_vec();
    encode_record(&mut bytes, u64::MAX - 1, KIND_SNAPSHOT, b"state");
    fs::write(dir.join(segment_name(1)), bytes).expect("write");
    let (mut j, replay) = open(&dir, 1 << 20);
    assert_eq!(replay.last_seq(), Some(u64::MAX - 1));
    assert!(matches!(j.append(1, b"one"), Err(JournalError::Exhausted)), "no number after the last");
    assert!(matches!(j.append_batch(&[(1, &b"a"[..]), (1, &b"b"[..])]), Err(JournalError::Exhausted)));
    drop(j);
    // Nothing was written: the journal opens as it was, and refuses the same.
    let (mut j, replay) = open(&dir, 1 << 20);
    assert_eq!(replay.last_seq(), Some(u64::MAX - 1));
    assert!(matches!(j.append(1, b"one"), Err(JournalError::Exhausted)));
}
