//! Compaction interrupted at each step: the directory as a crash would leave it, then
//! open. Either the old history or the snapshot comes back, whole, never a mix, and no
//! record is lost or doubled.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use fabricd::journal::sys::TEMP_SUFFIX;
use fabricd::journal::{Journal, JournalOptions, KIND_SNAPSHOT, Replay, segment_name};

const OPTIONS: JournalOptions = JournalOptions { segment_bytes: 160 };

/// File name -> bytes.
type Files = BTreeMap<String, Vec<u8>>;

/// Every segment and temporary in `dir`.
fn image(dir: &Path) -> Files {
    fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry"))
        .map(|e| (e.file_name().into_string().expect("utf-8"), e.path()))
        .filter(|(n, _)| n.ends_with(".seg") || n.ends_with(TEMP_SUFFIX))
        .map(|(n, p)| (n, fs::read(p).expect("read")))
        .collect()
}

fn restore(dir: &Path, files: &Files) {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir).expect("mkdir");
    for (name, bytes) in files {
        fs::write(dir.join(name), bytes).expect("write");
    }
}

fn seqs(replay: &Replay) -> Vec<u64> {
    replay.records.iter().map(|r| r.seq).collect()
}

/// A journal with `n` records over several segments, then compacted; returns the files
/// before and after compaction, and the new segment's name.
fn compacted(dir: &Path, n: u8) -> (Files, Files, String) {
    let (mut j, _) = Journal::open(dir, OPTIONS).expect("open");
    for i in 0..n {
        j.append(1, &[i; 40]).expect("append");
    }
    let before = image(dir);
    assert!(before.len() >= 3, "several segments: {:?}", before.keys());
    j.compact(format!("state through {n}").as_bytes()).expect("compact");
    let name = segment_name(j.segment());
    drop(j);
    let after = image(dir);
    assert_eq!(after.keys().collect::<Vec<_>>(), [&name]);
    (before, after, name)
}

fn assert_old_history(replay: &Replay, n: u8) {
    assert_eq!(replay.snapshot, None);
    assert_eq!(seqs(replay), (1..=u64::from(n)).collect::<Vec<_>>());
    for (i, r) in replay.records.iter().enumerate() {
        assert_eq!(r.payload, [i as u8; 40]);
    }
}

fn assert_snapshot(replay: &Replay, n: u8, after: &[u64]) {
    let s = replay.snapshot.as_ref().expect("snapshot wins");
    assert_eq!((s.seq, s.kind), (u64::from(n) + 1, KIND_SNAPSHOT));
    assert_eq!(s.payload, format!("state through {n}").as_bytes());
    assert_eq!(seqs(replay), after);
}

#[test]
fn crash_before_the_rename_keeps_the_old_history() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    let (before, after, name) = compacted(&dir, 10);
    let snapshot_bytes = &after[&name];
    let temp = format!("{name}{TEMP_SUFFIX}");
    for len in [0, 1, snapshot_bytes.len() / 2, snapshot_bytes.len() - 1, snapshot_bytes.len()] {
        let mut files = before.clone();
        files.insert(temp.clone(), snapshot_bytes[..len].to_vec());
        restore(&dir, &files);
        let (mut j, replay) = Journal::open(&dir, OPTIONS).expect("open");
        assert_old_history(&replay, 10);
        assert_eq!(replay.removed, [dir.join(&temp)]);
        assert!(!dir.join(&temp).exists());
        // The journal goes on from the old history, and can compact again.
        assert_eq!(j.append(1, b"more").expect("append"), 11);
        assert_eq!(j.compact(b"again").expect("compact"), 12);
        drop(j);
        let (_, replay) = Journal::open(&dir, OPTIONS).expect("reopen");
        assert_eq!(replay.snapshot.map(|s| (s.seq, s.payload)), Some((12, b"again".to_vec())));
        assert!(replay.records.is_empty());
    }
}

#[test]
fn crash_after_the_rename_lets_the_snapshot_win() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    let (before, after, name) = compacted(&dir, 10);
    let old: Vec<&String> = before.keys().collect();
    // None, some (oldest first, as compaction removes them) or all but one old segment
    // removed; and an old segment damaged (it is obsolete either way).
    let mut cases: Vec<Files> = Vec::new();
    for kept_from in 0..old.len() {
        let mut files = after.clone();
        for n in &old[kept_from..] {
            files.insert((*n).clone(), before[*n].clone());
        }
        cases.push(files);
    }
    let mut damaged = after.clone();
    damaged.extend(before.clone());
    if let Some(bytes) = damaged.get_mut(old[1]) {
        bytes[60] ^= 0xff;
    }
    cases.push(damaged);
    for files in cases {
        let stale: Vec<_> = files.keys().filter(|n| **n != name).map(|n| dir.join(n)).collect();
        restore(&dir, &files);
        let (mut j, replay) = Journal::open(&dir, OPTIONS).expect("open");
        assert_snapshot(&replay, 10, &[]);
        assert_eq!(replay.removed, stale);
        assert_eq!(image(&dir).keys().collect::<Vec<_>>(), [&name]);
        assert_eq!(j.append(1, b"more").expect("append"), 12);
        drop(j);
        let (_, replay) = Journal::open(&dir, OPTIONS).expect("reopen");
        assert_snapshot(&replay, 10, &[12]);
    }
}

#[test]
fn stale_segments_beside_a_grown_snapshot_history_are_dropped() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    let (before, _, _) = compacted(&dir, 8);
    let (mut j, _) = Journal::open(&dir, OPTIONS).expect("open");
    for i in 0..6u8 {
        j.append(2, &[i; 50]).expect("append");
    }
    drop(j);
    let mut files = image(&dir);
    assert!(files.len() >= 2, "the snapshot's history rotated: {:?}", files.keys());
    files.extend(before);
    restore(&dir, &files);
    let (_, replay) = Journal::open(&dir, OPTIONS).expect("open");
    assert_snapshot(&replay, 8, &(10..=15).collect::<Vec<_>>());
}

#[test]
fn a_second_compaction_supersedes_the_first() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    let (_, first, _) = compacted(&dir, 5);
    let (mut j, _) = Journal::open(&dir, OPTIONS).expect("open");
    j.append(1, b"x").expect("append");
    let middle = image(&dir);
    assert_eq!(j.compact(b"second").expect("compact"), 8);
    drop(j);
    let mut files = image(&dir);
    files.extend(middle);
    files.extend(first);
    restore(&dir, &files);
    let (_, replay) = Journal::open(&dir, OPTIONS).expect("open");
    assert_eq!(replay.snapshot.map(|s| (s.seq, s.payload)), Some((8, b"second".to_vec())));
    assert!(replay.records.is_empty());
}

#[test]
fn crash_while_starting_a_segment_leaves_only_a_temporary() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("j");
    let (mut j, _) = Journal::open(&dir, OPTIONS).expect("open");
    for i in 0..3u8 {
        j.append(1, &[i; 40]).expect("append");
    }
    let next = segment_name(j.segment() + 1);
    drop(j);
    // A rotation cut short: part of the next segment's header, never renamed into place.
    let first = fs::read(dir.join(segment_name(1))).expect("read");
    fs::write(dir.join(format!("{next}{TEMP_SUFFIX}")), &first[..30]).expect("write");
    let (mut j, replay) = Journal::open(&dir, OPTIONS).expect("open");
    assert_eq!(seqs(&replay), [1, 2, 3]);
    assert_eq!(replay.removed.len(), 1);
    for i in 3..8u8 {
        j.append(1, &[i; 40]).expect("append");
    }
    drop(j);
    let (_, replay) = Journal::open(&dir, OPTIONS).expect("reopen");
    assert_eq!(seqs(&replay), (1..=8).collect::<Vec<_>>());
}
