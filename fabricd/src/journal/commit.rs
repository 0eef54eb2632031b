//! Group commit: changes that arrive together share one write and one `fdatasync`.
//!
//! A caller [`enqueue`](Committer::enqueue)s its record (a memory-only step, cheap enough
//! to take under the caller's own lock, so records reach the journal in the order the
//! caller's state changed) and later [`wait`](Ticket::wait)s for it outside that lock. The
//! first waiter to find no write in progress becomes the leader: it takes every queued
//! record, writes them with [`Journal::append_batch`] (one `fdatasync` for all of them) and
//! wakes the others. Records queued while the leader syncs form the next batch. A record
//! is durable, and may be acknowledged, only once its ticket's `wait` returns `Ok`.
//!
//! A compaction ([`Committer::enqueue_compaction`]) takes its place in the same order: the
//! records queued before it are written first, then the journal is compacted to its
//! [`Image`] — the state the writer folds from every record it writes, which is what a
//! replay of the journal would rebuild. So the caller captures nothing for a snapshot:
//! queuing one is as cheap under its lock as queuing a record.
//!
//! After a failed write the journal is poisoned and every later record fails too, until
//! the owner queues a reopen ([`Committer::enqueue_reopen`]) with a snapshot of what was
//! acknowledged: the writer closes the journal, opens it again and compacts it to that
//! snapshot in the queue's order, so the records queued after it follow the snapshot and
//! the owner does none of that I/O under its lock either.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use super::{Journal, JournalError, JournalOptions, MAX_BATCH_BYTES, format};

/// A batch's outcome, shared by its records' tickets.
type Outcome = Result<(), Arc<JournalError>>;

/// A queued record or snapshot; [`Ticket::wait`] says whether it is durable.
#[derive(Debug)]
#[must_use = "a change is acknowledged only once its ticket's wait returns Ok"]
pub struct Ticket {
    committer: Arc<Committer>,
    slot: Arc<OnceLock<Outcome>>,
}

impl Ticket {
    /// Blocks until the record is durable (`Ok`) or its write failed. Never call it under
    /// a lock that an [`enqueue`](Committer::enqueue) needs: the leader's write would wait
    /// for nobody, but the other waiters would wait for the lock.
    pub fn wait(self) -> Result<(), JournalError> {
        self.committer.wait_for(&self.slot).map_err(JournalError::Batch)
    }
}

/// What the journal holds, as its owner's state: folded by the writer from each record
/// once it is durable, and encoded by it as the snapshot a compaction writes. It must
/// rebuild what a replay of the records would (recovery's rules, skips included), so that
/// compacting never changes what a restart finds.
pub trait Image: Send + std::fmt::Debug {
    /// Folds in a record just written.
    fn apply(&mut self, kind: u16, payload: &[u8]);
    /// The snapshot of everything folded in; an `Err` (what went wrong) writes nothing.
    fn encode(&self) -> Result<Vec<u8>, String>;
    /// Starts again from `snapshot`, which the journal was just compacted to.
    fn reset(&mut self, snapshot: &[u8]);
}

#[derive(Debug)]
enum Entry {
    Record(u16, Vec<u8>),
    /// Compact to the image as of the records before it.
    Compact,
    /// Close and open the journal again, compact it to this snapshot, and start the image
    /// again from it.
    Reopen(Vec<u8>),
}

#[derive(Debug)]
struct Item {
    entry: Entry,
    slot: Arc<OnceLock<Outcome>>,
}

impl Drop for Item {
    /// An item dropped unsettled (its leader's write panicked) fails its ticket rather
    /// than leave it waiting for a write that will never come.
    fn drop(&mut self) {
        if self.slot.get().is_none() {
            let _ = self.slot.set(Err(Arc::new(JournalError::Poisoned)));
        }
    }
}

#[derive(Debug, Default)]
struct Queue {
    pending: Vec<Item>,
    /// A leader is writing a batch.
    leading: bool,
}

/// The journal behind a queue that batches concurrent commits.
#[derive(Debug)]
pub struct Committer {
    queue: Mutex<Queue>,
    written: Condvar,
    /// Held by the leader while it writes; `None` once poisoned, until a reopen.
    journal: Mutex<Option<Journal>>,
    /// Taken after `journal`, by whoever holds that: the journal's contents as a state.
    image: Mutex<Box<dyn Image>>,
    dir: PathBuf,
    /// The directory's lock, held for as long as the committer lives: a journal poisoned
    /// or not reopened leaves it locked.
    dir_lock: Arc<std::fs::File>,
    options: JournalOptions,
    syncs: AtomicU64,
    /// Tests: the next write panics.
    #[cfg(test)]
    pub(crate) panic_next: std::sync::atomic::AtomicBool,
    /// Tests: a write with a snapshot in it (a compaction or a reopen) waits while this is
    /// held for writing.
    #[cfg(test)]
    pub(crate) snapshot_gate: std::sync::RwLock<()>,
    /// Tests: every write waits while this is held for writing (before it panics, when
    /// `panic_next` says so).
    #[cfg(test)]
    pub(crate) write_gate: std::sync::RwLock<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Committer {
    /// A committer over `journal`, opened with `options` and just compacted to the snapshot
    /// `image` holds, which folds in every record written from now on.
    pub fn new(journal: Journal, options: JournalOptions, image: Box<dyn Image>) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::new(Queue::default()),
            written: Condvar::new(),
            dir: journal.dir().to_owned(),
            dir_lock: journal.lock(),
            journal: Mutex::new(Some(journal)),
            image: Mutex::new(image),
            options,
            syncs: AtomicU64::new(0),
            #[cfg(test)]
            panic_next: std::sync::atomic::AtomicBool::new(false),
            #[cfg(test)]
            snapshot_gate: std::sync::RwLock::new(()),
            #[cfg(test)]
            write_gate: std::sync::RwLock::new(()),
        })
    }

    /// The journal's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Batches written (each one `fdatasync`, or one compaction), for tests and metrics.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Queues a record after every record queued before it. No I/O.
    pub fn enqueue(self: &Arc<Self>, kind: u16, payload: Vec<u8>) -> Ticket {
        self.push(Entry::Record(kind, payload))
    }

    /// Queues a compaction to the [`Image`] as of every record queued so far and of
    /// nothing queued later; the writer encodes it when its turn comes. No I/O, nothing
    /// copied. Fails without writing anything where the image does not encode.
    pub fn enqueue_compaction(self: &Arc<Self>) -> Ticket {
        self.push(Entry::Compact)
    }

    fn push(self: &Arc<Self>, entry: Entry) -> Ticket {
        let slot = Arc::new(OnceLock::new());
        lock(&self.queue).pending.push(Item { entry, slot: slot.clone() });
        Ticket { committer: self.clone(), slot }
    }

    /// Queues a reopen: the writer closes the journal and opens it again, then compacts it
    /// to `snapshot`, so that it holds exactly what was acknowledged whatever a failed
    /// write left behind; the image starts again from `snapshot`. It is written whatever
    /// failed before it (that is what it mends); the records queued after it follow it,
    /// and fail with it if it fails. The caller makes sure no record it still counts on is
    /// queued before it. No I/O.
    pub fn enqueue_reopen(self: &Arc<Self>, snapshot: Vec<u8>) -> Ticket {
        self.push(Entry::Reopen(snapshot))
    }

    /// The reopen itself: the old journal (it holds the directory's lock) closed first;
    /// left poisoned (`None`) when the new one cannot be opened or written.
    fn reopen(&self, journal: &mut Option<Journal>, image: &mut dyn Image, snapshot: &[u8]) -> Outcome {
        *journal = None;
        let opened = Journal::reopen(&self.dir, self.options, self.dir_lock.clone()).and_then(|(mut fresh, _)| {
            fresh.compact(snapshot)?;
            Ok(fresh)
        });
        let fresh = opened.map_err(|e| {
            tracing::error!(error = %crate::error_chain(&e), "journal cannot be reopened; changes are refused");
            Arc::new(e)
        })?;
        self.syncs.fetch_add(1, Ordering::Relaxed);
        *journal = Some(fresh);
        image.reset(snapshot);
        tracing::warn!(dir = %self.dir.display(), "journal reopened after a failed write; snapshot written");
        Ok(())
    }

    fn wait_for(&self, slot: &OnceLock<Outcome>) -> Outcome {
        let mut q = lock(&self.queue);
        loop {
            if let Some(done) = slot.get() {
                return done.clone();
            }
            if q.leading {
                q = self.written.wait(q).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            q.leading = true;
            let batch = std::mem::take(&mut q.pending);
            drop(q);
            // A write that panics fails its batch (each item's drop) and poisons the
            // journal (it may have left a torn record, after which nothing appended would
            // replay) until the owner reopens it; the leader goes on to read its own
            // outcome, so that its caller settles the change as any failed one.
            let wrote = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.write(batch)));
            if wrote.is_err() {
                tracing::error!(dir = %self.dir.display(), "journal write panicked; its batch is refused and the journal poisoned until reopened");
                *lock(&self.journal) = None;
            }
            q = lock(&self.queue);
            q.leading = false;
            self.written.notify_all();
        }
    }

    /// Writes `batch` in order: runs of records with one `append_batch` each (one
    /// `fdatasync`), a compaction with `compact`, a reopen with [`Self::reopen`]. After a
    /// failure the rest fail with it, up to a reopen.
    fn write(&self, batch: Vec<Item>) {
        #[cfg(test)]
        let _gates = (
            self.write_gate.read(),
            batch
                .iter()
                .any(|i| matches!(i.entry, Entry::Compact | Entry::Reopen(_)))
                .then(|| self.snapshot_gate.read()),
        );
        #[cfg(test)]
        if self.panic_next.swap(false, Ordering::Relaxed) {
            panic!("a journal write that panics (test)");
        }
        let mut guard = lock(&self.journal);
        let mut image = lock(&self.image);
        let mut failed: Option<Arc<JournalError>> = match guard.as_ref() {
            Some(_) => None,
            None => Some(Arc::new(JournalError::Poisoned)),
        };
        let mut run: Vec<Item> = Vec::new();
        let mut run_bytes = 0usize;
        let mut items = batch.into_iter().peekable();
        while let Some(item) = items.next() {
            if let Entry::Reopen(snapshot) = &item.entry {
                // What failed before it is what it mends.
                let done = self.reopen(&mut guard, image.as_mut(), snapshot);
                failed = done.as_ref().err().cloned();
                let _ = item.slot.set(done);
                continue;
            }
            if let Some(e) = &failed {
                let _ = item.slot.set(Err(e.clone()));
                continue;
            }
            let Some(j) = guard.as_mut() else { continue };
            match &item.entry {
                Entry::Record(_, payload) => {
                    run_bytes = run_bytes.saturating_add(format::record_len(payload.len()));
                    run.push(item);
                    let next_fits = match items.peek().map(|i| &i.entry) {
                        Some(Entry::Record(_, p)) => {
                            run_bytes.saturating_add(format::record_len(p.len())) <= MAX_BATCH_BYTES
                        }
                        _ => false,
                    };
                    if !next_fits {
                        failed = self.flush(j, image.as_mut(), std::mem::take(&mut run));
                        run_bytes = 0;
                    }
                }
                Entry::Compact => {
                    let done = match image.encode() {
                        Ok(bytes) => {
                            let done = j.compact(&bytes).map(|_| ()).map_err(Arc::new);
                            self.syncs.fetch_add(1, Ordering::Relaxed);
                            // One too large to write wrote nothing: what follows goes on.
                            failed = done.as_ref().err().filter(|e| !e.wrote_nothing()).cloned();
                            done
                        }
                        // Nothing written: what follows goes on.
                        Err(why) => Err(Arc::new(JournalError::Encode(why))),
                    };
                    let _ = item.slot.set(done);
                }
                // Written above, whatever failed before it.
                Entry::Reopen(_) => {}
            }
        }
    }

    /// Appends `run` with one write and one `fdatasync`, folds it into `image` once it is
    /// durable, and settles its tickets.
    fn flush(&self, j: &mut Journal, image: &mut dyn Image, run: Vec<Item>) -> Option<Arc<JournalError>> {
        let records: Vec<(u16, &[u8])> = run
            .iter()
            .filter_map(|i| match &i.entry {
                Entry::Record(kind, payload) => Some((*kind, payload.as_slice())),
                Entry::Compact | Entry::Reopen(_) => None,
            })
            .collect();
        let done = j.append_batch(&records).map(|_| ()).map_err(Arc::new);
        self.syncs.fetch_add(1, Ordering::Relaxed);
        match &done {
            Err(e) => {
                tracing::error!(error = %crate::error_chain(e), records = run.len(), "journal write failed; the batch is refused");
            }
            Ok(()) => {
                for (kind, payload) in &records {
                    image.apply(*kind, payload);
                }
            }
        }
        for item in &run {
            let _ = item.slot.set(done.clone());
        }
        done.err()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    fn open(dir: &Path) -> Arc<Committer> {
        open_with(dir, Lines::default())
    }

    fn replayed(dir: &Path) -> (Option<Vec<u8>>, Vec<Vec<u8>>) {
        let (_, replay) = Journal::open(dir, JournalOptions::default()).expect("reopen");
        (replay.snapshot.map(|s| s.payload), replay.records.into_iter().map(|r| r.payload).collect())
    }

    #[test]
    fn a_leader_whose_write_panics_fails_its_batch_and_poisons_the_journal_instead_of_hanging() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open(dir.path());
        c.enqueue(1, b"before".to_vec()).wait().expect("durable");
        // The leader's write panics: its own ticket and the batch fail, nobody hangs.
        c.panic_next.store(true, Ordering::Relaxed);
        let lost = c.enqueue(1, b"lost".to_vec());
        assert!(matches!(lost.wait(), Err(JournalError::Batch(e)) if matches!(*e, JournalError::Poisoned)));
        assert!(!lock(&c.queue).leading);
        // Later commits fail until a reopen, then go on.
        assert!(c.enqueue(1, b"after".to_vec()).wait().is_err());
        // The poisoned journal is closed, but the directory stays locked: no other daemon
        // starts on it meanwhile.
        assert!(matches!(Journal::open(dir.path(), JournalOptions::default()), Err(JournalError::Locked { .. })));
        c.enqueue_reopen(b"snap".to_vec()).wait().expect("reopen");
        c.enqueue(1, b"again".to_vec()).wait().expect("durable after the reopen");
        drop(c);
        let (snapshot, records) = replayed(dir.path());
        assert_eq!(snapshot.as_deref(), Some(&b"snap"[..]));
        assert_eq!(records, vec![b"again".to_vec()]);
    }

    #[test]
    fn a_reopen_that_fails_keeps_the_directory_locked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open(dir.path());
        c.enqueue(1, b"before".to_vec()).wait().expect("durable");
        // A snapshot past the snapshot bound (allocated, never touched): the journal is
        // closed, and not opened again.
        let failed = c.enqueue_reopen(vec![0; crate::journal::MAX_SNAPSHOT + 1]).wait();
        assert!(failed.is_err(), "{failed:?}");
        assert!(matches!(Journal::open(dir.path(), JournalOptions::default()), Err(JournalError::Locked { .. })));
        drop(c);
        assert!(Journal::open(dir.path(), JournalOptions::default()).is_ok(), "free once the committer went");
    }

    #[test]
    fn concurrent_commits_share_syncs_and_all_are_durable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open(dir.path());
        const N: usize = 16;
        const EACH: usize = 20;
        let start = Arc::new(Barrier::new(N));
        let threads: Vec<_> = (0..N)
            .map(|t| {
                let (c, start) = (c.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    for k in 0..EACH {
                        c.enqueue(1, format!("{t}.{k}").into_bytes()).wait().expect("durable");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        let syncs = c.syncs();
        assert!(syncs < (N * EACH) as u64, "{syncs} syncs for {} commits: none shared", N * EACH);
        drop(c);
        let (_, records) = replayed(dir.path());
        assert_eq!(records.len(), N * EACH);
        // Each thread's records are in its own order.
        for t in 0..N {
            let mine: Vec<_> = records
                .iter()
                .filter_map(|r| String::from_utf8(r.clone()).ok())
                .filter(|s| s.starts_with(&format!("{t}.")))
                .collect();
            let want: Vec<_> = (0..EACH).map(|k| format!("{t}.{k}")).collect();
            assert_eq!(mine, want);
        }
    }

    #[test]
    fn queued_records_go_out_in_one_sync_in_queue_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open(dir.path());
        let tickets: Vec<_> = (0u8..8).map(|i| c.enqueue(1, vec![i])).collect();
        for t in tickets.into_iter().rev() {
            t.wait().expect("durable");
        }
        assert_eq!(c.syncs(), 1, "eight queued records, one leader, one sync");
        drop(c);
        assert_eq!(replayed(dir.path()).1, (0u8..8).map(|i| vec![i]).collect::<Vec<_>>());
    }

    /// A test image: the payloads folded in so far, encoded joined by `|`.
    #[derive(Debug, Default)]
    struct Lines {
        lines: Vec<Vec<u8>>,
        /// `encode` fails.
        broken: bool,
        /// `encode` makes a snapshot larger than a snapshot may be.
        oversized: bool,
        /// Tests: a lock the caller holds while it queues; encoding finds it free.
        caller: Option<Arc<Mutex<()>>>,
    }

    impl Image for Lines {
        fn apply(&mut self, _kind: u16, payload: &[u8]) {
            self.lines.push(payload.to_vec());
        }
        fn encode(&self) -> Result<Vec<u8>, String> {
            if self.broken {
                return Err("no".into());
            }
            if self.oversized {
                return Ok(vec![0; super::super::MAX_SNAPSHOT + 1]);
            }
            if self.caller.as_ref().is_some_and(|c| c.try_lock().is_err()) {
                return Err("encoded under the caller's lock".into());
            }
            Ok(self.lines.join(&b'|'))
        }
        fn reset(&mut self, snapshot: &[u8]) {
            self.lines = snapshot.split(|&b| b == b'|').map(<[u8]>::to_vec).collect();
        }
    }

    fn open_with(dir: &Path, image: Lines) -> Arc<Committer> {
        let (j, _) = Journal::open(dir, JournalOptions::default()).expect("open");
        Committer::new(j, JournalOptions::default(), Box::new(image))
    }

    #[test]
    fn a_compaction_keeps_its_place_in_the_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open_with(dir.path(), Lines::default());
        let a = c.enqueue(1, b"a".to_vec());
        let b = c.enqueue(1, b"b".to_vec());
        let s = c.enqueue_compaction();
        let after = c.enqueue(1, b"after".to_vec());
        after.wait().expect("after");
        a.wait().expect("a");
        b.wait().expect("b");
        s.wait().expect("compaction");
        drop(c);
        // The image as of the records queued before it, none after.
        let (snapshot, records) = replayed(dir.path());
        assert_eq!(snapshot.as_deref(), Some(&b"a|b"[..]));
        assert_eq!(records, vec![b"after".to_vec()]);
    }

    #[test]
    fn a_compaction_captures_nothing_from_the_caller_and_is_encoded_outside_its_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let caller = Arc::new(Mutex::new(()));
        let c = open_with(dir.path(), Lines { caller: Some(caller.clone()), ..Lines::default() });
        c.enqueue(1, b"before".to_vec()).wait().expect("before");
        let held = lock(&caller);
        let s = c.enqueue_compaction();
        let after = c.enqueue(1, b"after".to_vec());
        drop(held);
        after.wait().expect("after");
        s.wait().expect("compaction written");
        drop(c);
        let (snapshot, records) = replayed(dir.path());
        assert_eq!(snapshot.as_deref(), Some(&b"before"[..]));
        assert_eq!(records, vec![b"after".to_vec()]);
    }

    #[test]
    fn a_compaction_that_does_not_encode_writes_nothing_and_the_journal_goes_on() {
        let e = a_compaction_that_fails(Lines { broken: true, ..Lines::default() });
        assert!(e.wrote_nothing(), "{e}");
    }

    /// A compaction of `image` between records `a` and `b`, which fails: its error, once
    /// the records around it and one after (`c`) are written and are all the journal
    /// holds (no snapshot).
    fn a_compaction_that_fails(image: Lines) -> JournalError {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open_with(dir.path(), image);
        let a = c.enqueue(1, b"a".to_vec());
        let s = c.enqueue_compaction();
        let b = c.enqueue(1, b"b".to_vec());
        b.wait().expect("a record after it is written");
        a.wait().expect("a record before it is written");
        let e = s.wait().expect_err("the compaction failed");
        c.enqueue(1, b"c".to_vec()).wait().expect("not poisoned");
        drop(c);
        let (snapshot, records) = replayed(dir.path());
        assert_eq!(snapshot, None);
        assert_eq!(records, vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        e
    }

    /// A registry grown past what a snapshot holds: its snapshot is refused before any
    /// byte is written, and the journal goes on without it (it was poisoned, and every
    /// later change refused, until the registry shrank).
    #[test]
    fn a_snapshot_too_large_writes_nothing_and_the_journal_goes_on() {
        let e = a_compaction_that_fails(Lines { oversized: true, ..Lines::default() });
        let too_large = |e: &JournalError| match e {
            JournalError::Batch(inner) => matches!(**inner, JournalError::SnapshotTooLarge { .. }),
            e => matches!(e, JournalError::SnapshotTooLarge { .. }),
        };
        assert!(too_large(&e) && e.wrote_nothing(), "{e:?}");
    }

    /// A registry larger than one record compacts, and a failed write reopens onto it:
    /// the snapshot goes in several records (before, the reopen was refused for the
    /// snapshot's size, and every later change with it until a restart).
    #[test]
    fn a_snapshot_larger_than_a_record_compacts_and_reopens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open_with(dir.path(), Lines::default());
        let big = |b: u8| vec![b; super::super::MAX_PAYLOAD / 2 + 1];
        for b in [b'a', b'b'] {
            c.enqueue(1, big(b)).wait().expect("durable");
        }
        c.enqueue_compaction().wait().expect("a compaction over one record's size");
        // The journal is the committer's (locked): its one segment is read as bytes.
        let (numbers, _) = super::super::recover::list(dir.path()).expect("list");
        assert_eq!(numbers.len(), 1, "older segments removed");
        let bytes = std::fs::read(super::super::segment_path(dir.path(), numbers[0])).expect("read");
        let d = super::super::decode_segment(&bytes).expect("decodes");
        let parts: Vec<&[u8]> = d.records.iter().map(|r| r.payload).collect();
        assert_eq!((d.header.snapshot_parts, parts.concat()), (2, [big(b'a'), big(b'b')].join(&b'|')));
        // A write fails; the reopen writes what was acknowledged, three halves of a record.
        let bad = c.enqueue(super::super::RESERVED_KINDS, b"x".to_vec());
        assert!(bad.wait().is_err());
        let acked = [big(b'a'), big(b'b'), big(b'c')].join(&b'|');
        c.enqueue_reopen(acked.clone()).wait().expect("reopen onto a snapshot of three halves");
        c.enqueue(1, b"later".to_vec()).wait().expect("durable after the reopen");
        drop(c);
        let (snapshot, records) = replayed(dir.path());
        assert_eq!(snapshot, Some(acked));
        assert_eq!(records, vec![b"later".to_vec()]);
    }

    #[test]
    fn a_reopen_restarts_the_image_from_its_snapshot_and_a_failed_batch_is_not_folded_in() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open_with(dir.path(), Lines::default());
        c.enqueue(1, b"kept".to_vec()).wait().expect("durable");
        let bad = c.enqueue(super::super::RESERVED_KINDS, b"x".to_vec());
        let with_it = c.enqueue(1, b"lost".to_vec());
        assert!(bad.wait().is_err() && with_it.wait().is_err());
        c.enqueue_reopen(b"acked|state".to_vec()).wait().expect("reopen");
        c.enqueue(1, b"later".to_vec()).wait().expect("durable after reopen");
        c.enqueue_compaction().wait().expect("compaction");
        drop(c);
        let (snapshot, records) = replayed(dir.path());
        assert_eq!(snapshot.as_deref(), Some(&b"acked|state|later"[..]));
        assert!(records.is_empty());
    }

    /// A reopen is written in the queue's order, whatever failed before it: the records
    /// queued behind it follow its snapshot; one that cannot be written fails them too,
    /// and a later one mends the journal.
    #[test]
    fn a_reopen_mends_what_failed_before_it_and_what_follows_fails_with_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("journal");
        let c = open(&path);
        c.enqueue(1, b"kept".to_vec()).wait().expect("durable");
        assert!(c.enqueue(super::super::RESERVED_KINDS, b"x".to_vec()).wait().is_err());
        // The journal's directory is gone and a file stands in its place: the reopen cannot
        // open it, and the record behind it fails with it.
        let aside = dir.path().join("aside");
        std::fs::rename(&path, &aside).expect("rename");
        std::fs::write(&path, b"not a directory").expect("file");
        let reopen = c.enqueue_reopen(b"acked".to_vec());
        let behind = c.enqueue(1, b"behind".to_vec());
        assert!(behind.wait().is_err(), "a record behind a failed reopen fails");
        assert!(reopen.wait().is_err());
        assert!(c.enqueue(1, b"still".to_vec()).wait().is_err(), "still poisoned");
        // Back in place: the next reopen and the records queued behind it, in one batch.
        std::fs::remove_file(&path).expect("remove");
        std::fs::rename(&aside, &path).expect("rename back");
        let syncs = c.syncs();
        drop(c.enqueue_reopen(b"acked".to_vec()));
        let tickets: Vec<_> = [&b"one"[..], b"two"].iter().map(|p| c.enqueue(1, p.to_vec())).collect();
        for t in tickets {
            t.wait().expect("durable after the reopen");
        }
        assert_eq!(c.syncs() - syncs, 2, "the reopen's snapshot, then both records in one sync");
        drop(c);
        let (snapshot, records) = replayed(&path);
        assert_eq!(snapshot.as_deref(), Some(&b"acked"[..]));
        assert_eq!(records, vec![b"one".to_vec(), b"two".to_vec()]);
    }

    #[test]
    fn a_failed_write_fails_its_batch_and_what_follows_until_reopened() {
        let dir = tempfile::tempdir().expect("tempdir");
        let c = open(dir.path());
        c.enqueue(1, b"kept".to_vec()).wait().expect("durable");
        // A reserved kind is refused by the journal before anything is written, which fails
        // the batch as a write failure would.
        let bad = c.enqueue(super::super::RESERVED_KINDS, b"x".to_vec());
        let with_it = c.enqueue(1, b"same batch".to_vec());
        assert!(bad.wait().is_err());
        assert!(with_it.wait().is_err(), "the rest of a failed batch fails with it");
        c.enqueue_reopen(b"acknowledged".to_vec()).wait().expect("reopen");
        c.enqueue(1, b"later".to_vec()).wait().expect("durable after reopen");
        drop(c);
        let (snapshot, records) = replayed(dir.path());
        assert_eq!(snapshot.as_deref(), Some(&b"acknowledged"[..]));
        assert_eq!(records, vec![b"later".to_vec()]);
    }
}
