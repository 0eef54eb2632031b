//! Property test: random appends, batches, compactions, torn batches and reopens against an
//! in-memory model of what must come back.

use std::fs::OpenOptions;
use std::path::Path;

use fabricd::journal::format::{FRAME_LEN, HEADER_LEN};
use fabricd::journal::{Journal, JournalOptions, KIND_SNAPSHOT, RESERVED_KINDS, Replay, segment_path};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Append(u16, Vec<u8>),
    Batch(Vec<(u16, Vec<u8>)>),
    Compact(Vec<u8>),
    /// A batch whose write is cut after this fraction (per mille) of its bytes, then a
    /// crash: the records wholly before the cut survive.
    TornBatch(Vec<(u16, Vec<u8>)>, u16),
    Reopen(u64),
}

fn payload() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..120)
}

fn record() -> impl Strategy<Value = (u16, Vec<u8>)> {
    (0..RESERVED_KINDS, payload())
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => record().prop_map(|(k, p)| Op::Append(k, p)),
        3 => prop::collection::vec(record(), 0..6).prop_map(Op::Batch),
        1 => payload().prop_map(Op::Compact),
        2 => (prop::collection::vec(record(), 1..6), 0..1000u16).prop_map(|(b, c)| Op::TornBatch(b, c)),
        2 => prop::sample::select(vec![100u64, 300, 1000, 1 << 20]).prop_map(Op::Reopen),
    ]
}

/// What the journal must give back.
#[derive(Debug, Default)]
struct Model {
    snapshot: Option<(u64, Vec<u8>)>,
    records: Vec<(u64, u16, Vec<u8>)>,
    next_seq: u64,
}

impl Model {
    fn check(&self, replay: &Replay) {
        let snapshot = replay.snapshot.as_ref().map(|s| {
            assert_eq!(s.kind, KIND_SNAPSHOT);
            (s.seq, s.payload.clone())
        });
        assert_eq!(snapshot, self.snapshot);
        let records: Vec<_> = replay.records.iter().map(|r| (r.seq, r.kind, r.payload.clone())).collect();
        assert_eq!(records, self.records);
    }
}

fn batch_refs(batch: &[(u16, Vec<u8>)]) -> Vec<(u16, &[u8])> {
    batch.iter().map(|(k, p)| (*k, p.as_slice())).collect()
}

fn run(dir: &Path, ops: Vec<Op>) {
    let mut options = JournalOptions { segment_bytes: 300 };
    let (mut j, replay) = Journal::open(dir, options).expect("open");
    let mut model = Model { next_seq: 1, ..Model::default() };
    model.check(&replay);
    for op in ops {
        match op {
            Op::Append(kind, payload) => {
                assert_eq!(j.append(kind, &payload).expect("append"), model.next_seq);
                model.records.push((model.next_seq, kind, payload));
                model.next_seq += 1;
            }
            Op::Batch(batch) => {
                let seqs = j.append_batch(&batch_refs(&batch)).expect("batch");
                assert_eq!(seqs, (model.next_seq..model.next_seq + batch.len() as u64).collect::<Vec<_>>());
                for (kind, payload) in batch {
                    model.records.push((model.next_seq, kind, payload));
                    model.next_seq += 1;
                }
            }
            Op::Compact(snapshot) => {
                assert_eq!(j.compact(&snapshot).expect("compact"), model.next_seq);
                model.snapshot = Some((model.next_seq, snapshot));
                model.records.clear();
                model.next_seq += 1;
            }
            Op::TornBatch(batch, per_mille) => {
                let (segment, len) = (j.segment(), j.segment_len());
                j.append_batch(&batch_refs(&batch)).expect("batch");
                let start = if j.segment() == segment { len } else { HEADER_LEN as u64 };
                let total: u64 = batch.iter().map(|(_, p)| (FRAME_LEN + p.len()) as u64).sum();
                let cut = total * u64::from(per_mille) / 1000;
                let path = segment_path(dir, j.segment());
                drop(j);
                OpenOptions::new().write(true).open(&path).and_then(|f| f.set_len(start + cut)).expect("cut");
                let mut kept = 0;
                for (kind, payload) in batch {
                    let end = kept + (FRAME_LEN + payload.len()) as u64;
                    if end > cut {
                        break;
                    }
                    kept = end;
                    model.records.push((model.next_seq, kind, payload));
                    model.next_seq += 1;
                }
                let (reopened, replay) = Journal::open(dir, options).expect("reopen after crash");
                model.check(&replay);
                assert_eq!(replay.dropped_bytes(), cut - kept);
                j = reopened;
            }
            Op::Reopen(segment_bytes) => {
                drop(j);
                options = JournalOptions { segment_bytes };
                let (reopened, replay) = Journal::open(dir, options).expect("reopen");
                model.check(&replay);
                assert!(replay.truncated.is_none() && replay.removed.is_empty());
                j = reopened;
            }
        }
        assert_eq!(j.next_seq(), model.next_seq);
    }
    drop(j);
    let (_, replay) = Journal::open(dir, options).expect("final reopen");
    model.check(&replay);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn journal_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        let tmp = tempfile::tempdir().expect("tempdir");
        run(&tmp.path().join("j"), ops);
    }
}
