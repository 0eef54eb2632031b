//! A real crash test: a child process appends, batches and compacts in a loop, printing
//! each sequence number once the journal has acknowledged it; the parent SIGKILLs it at a
//! random moment, reopens the journal and checks that every acknowledged record is there,
//! in order, with its payload. Repeated over many crash points on one directory.
//!
//! The child is this same test binary, re-run with `--ignored --exact kill9_child`.
#![allow(clippy::print_stdout, clippy::print_stderr, reason = "the child's acknowledgements and the test's report")]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fabricd::journal::{Journal, JournalOptions, KIND_SNAPSHOT, Replay};

const ENV_DIR: &str = "FABRICD_KILL9_DIR";
const ENV_SEED: &str = "FABRICD_KILL9_SEED";
const ROUNDS: usize = 40;
const OPTIONS: JournalOptions = JournalOptions { segment_bytes: 32 << 10 };

#[test]
fn acknowledged_records_survive_kill_9() {
    parent();
}

/// The child half of [`acknowledged_records_survive_kill_9`], which runs it in a process of
/// its own; it does nothing when run directly.
#[test]
#[ignore = "the child process of acknowledged_records_survive_kill_9, which runs it"]
fn kill9_child() {
    if let Ok(dir) = std::env::var(ENV_DIR) {
        child(Path::new(&dir), seed_from_env().unwrap_or(1));
    }
}

/// xorshift64*: enough randomness for timing and workload, reproducible from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn seed_from_env() -> Option<u64> {
    std::env::var(ENV_SEED).ok()?.parse().ok()
}

/// The payload every record with sequence `seq` carries, so the parent can check it.
fn payload(seq: u64) -> Vec<u8> {
    // Mostly small; now and then large enough that a kill can land inside its write()
    // (the kernel stops copying pages once SIGKILL is pending), leaving a torn tail.
    let len = if seq.is_multiple_of(41) {
        400_000 + (seq % 1000) as usize
    } else {
        (seq.wrapping_mul(2_654_435_761) % 3000) as usize
    };
    (0..len).map(|i| (seq as usize).wrapping_mul(131).wrapping_add(i) as u8).collect()
}

fn kind(seq: u64) -> u16 {
    1 + (seq % 7) as u16
}

/// A snapshot's payload: the sequence numbers of every record it stands for.
fn encode_covered(covered: &[u64]) -> Vec<u8> {
    covered.iter().flat_map(|s| s.to_le_bytes()).collect()
}

fn decode_covered(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

/// The records the journal stands for after a replay: covered by the snapshot, or replayed.
fn present(replay: &Replay) -> Vec<u64> {
    let mut seqs = replay.snapshot.as_ref().map(|s| decode_covered(&s.payload)).unwrap_or_default();
    seqs.extend(replay.records.iter().map(|r| r.seq));
    seqs
}

fn child(dir: &Path, seed: u64) {
    let (mut journal, replay) = Journal::open(dir, OPTIONS).expect("child: open");
    let mut covered = present(&replay);
    let mut rng = Rng(seed | 1);
    let mut out = std::io::stdout().lock();
    // End the harness's "test kill9_child ... " line so every acknowledgement has its own.
    if writeln!(out).is_err() {
        return;
    }
    loop {
        let roll = rng.below(100);
        if roll < 4 {
            let seq = journal.compact(&encode_covered(&covered)).expect("child: compact");
            if writeln!(out, "S {seq}").is_err() {
                return;
            }
        } else {
            let n = if roll < 30 { 1 + rng.below(8) } else { 1 };
            let first = journal.next_seq();
            let payloads: Vec<Vec<u8>> = (first..first + n).map(payload).collect();
            let batch: Vec<(u16, &[u8])> =
                payloads.iter().enumerate().map(|(i, p)| (kind(first + i as u64), p.as_slice())).collect();
            let seqs = journal.append_batch(&batch).expect("child: append");
            for seq in seqs {
                covered.push(seq);
                if writeln!(out, "A {seq}").is_err() {
                    return;
                }
            }
        }
    }
}

fn parent() {
    let seed = seed_from_env()
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64));
    eprintln!("journal_kill9: seed {seed} (set {ENV_SEED} to repeat)");
    let mut rng = Rng(seed | 1);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("journal");
    let exe = std::env::current_exe().expect("test binary");
    let mut acked = BTreeSet::new();
    let mut acked_snapshot = 0;
    let (mut torn, mut removed, mut snapshots) = (0, 0, 0);
    for round in 0..ROUNDS {
        let mut child = Command::new(&exe)
            .args(["--ignored", "--exact", "kill9_child", "--nocapture", "--test-threads=1"])
            .env(ENV_DIR, &dir)
            .env(ENV_SEED, rng.next().to_string())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let mut reader = BufReader::new(child.stdout.take().expect("child stdout"));
        let mut record = |line: &str| {
            // The test harness writes its own lines ("running 1 test", "test kill9_child ...");
            // only "A seq" and "S seq" lines are the child's.
            let mut parts = line.trim_end().splitn(2, ' ');
            let (Some(tag @ ("A" | "S")), Some(seq)) = (parts.next(), parts.next()) else { return };
            let seq: u64 = seq.parse().expect("sequence number");
            match tag {
                "A" => assert!(acked.insert(seq), "sequence {seq} acknowledged twice"),
                "S" => acked_snapshot = acked_snapshot.max(seq),
                _ => unreachable!("only A and S lines get here"),
            }
        };
        let wait_for = 1 + rng.below(300);
        let mut line = String::new();
        for _ in 0..wait_for {
            line.clear();
            if reader.read_line(&mut line).expect("read") == 0 {
                panic!("round {round}: child ended on its own: {:?}", child.wait());
            }
            record(&line);
        }
        let delay = rng.below(4000);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
        }
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        // Lines the child completed before it died were acknowledged too; a line cut in
        // half by the kill was not.
        loop {
            line.clear();
            if reader.read_line(&mut line).expect("read") == 0 || !line.ends_with('\n') {
                break;
            }
            record(&line);
        }

        let (journal, replay) = Journal::open(&dir, OPTIONS).expect("reopen after kill -9");
        torn += usize::from(replay.truncated.is_some());
        removed += replay.removed.len();
        if let Some(s) = &replay.snapshot {
            assert_eq!(s.kind, KIND_SNAPSHOT);
            assert!(s.seq >= acked_snapshot, "round {round}: acknowledged compaction {acked_snapshot} rolled back");
            snapshots += 1;
        }
        for r in &replay.records {
            assert_eq!((r.kind, &r.payload), (kind(r.seq), &payload(r.seq)), "round {round}: record {}", r.seq);
        }
        let have = present(&replay);
        let set: BTreeSet<u64> = have.iter().copied().collect();
        assert_eq!(set.len(), have.len(), "round {round}: a record is present twice");
        assert!(have.windows(2).all(|w| w[0] < w[1]), "round {round}: records out of order");
        let lost: Vec<_> = acked.difference(&set).take(10).collect();
        assert!(lost.is_empty(), "round {round}: acknowledged records lost: {lost:?}");
        drop(journal);
    }
    println!(
        "journal_kill9: survived {ROUNDS} kill -9 crash points; {} acknowledged records all present; \
         {torn} torn tails cut off, {removed} leftover files removed, {snapshots} replays from a snapshot",
        acked.len()
    );
}
