//! The appending side: group commit, rotation and compaction, each durable before it
//! returns.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::format::{self, HEADER_LEN, KIND_SNAPSHOT, MAX_PAYLOAD, MAX_SNAPSHOT, RESERVED_KINDS, SegmentHeader};
use super::recover::{self, Recovered};
use super::sys;
use super::{JournalError, JournalOptions, MAX_BATCH_BYTES, MAX_SEGMENT_BYTES, Replay, Seq};

/// Refuses a segment size of 0 or past [`MAX_SEGMENT_BYTES`].
fn check_options(options: JournalOptions) -> Result<(), JournalError> {
    if options.segment_bytes == 0 || options.segment_bytes > MAX_SEGMENT_BYTES {
        return Err(JournalError::Options { segment_bytes: options.segment_bytes });
    }
    Ok(())
}

/// An open journal: the only writer of its directory (it holds `journal.lock`).
///
/// Not shared between threads by itself: the daemon wraps it in a mutex and batches
/// concurrent changes into [`append_batch`](Self::append_batch) to share one fsync.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    options: JournalOptions,
    /// The directory's lock, shared with whoever reopens the journal in its place
    /// ([`Journal::reopen`]): the directory stays locked while no journal is open.
    lock: Arc<File>,
    file: File,
    segment: u64,
    first_segment: u64,
    generation: u64,
    len: u64,
    records_in_segment: u64,
    next_seq: Seq,
    buf: Vec<u8>,
    poisoned: bool,
}

impl Journal {
    /// Opens (or creates) the journal in `dir` and returns it with the records to replay.
    ///
    /// Every live segment is checked before anything is changed. A torn tail of the newest
    /// segment is cut off (and reported in [`Replay::truncated`]); any other damage is an
    /// error and the files are left as they are.
    pub fn open(dir: &Path, options: JournalOptions) -> Result<(Self, Replay), JournalError> {
        check_options(options)?;
        recover::ensure_dir(dir)?;
        let lock = Arc::new(sys::lock(dir)?);
        Self::open_locked(dir, options, lock)
    }

    /// Opens the journal in `dir` again, under `lock` (of a journal of the same directory,
    /// [`Journal::lock`]), which this process holds whether a journal is open or not: no
    /// other daemon starts on the directory while a failed journal is being reopened.
    pub fn reopen(dir: &Path, options: JournalOptions, lock: Arc<File>) -> Result<(Self, Replay), JournalError> {
        check_options(options)?;
        Self::open_locked(dir, options, lock)
    }

    /// The directory's lock (`journal.lock`), to keep it past this journal.
    pub fn lock(&self) -> Arc<File> {
        self.lock.clone()
    }

    fn open_locked(dir: &Path, options: JournalOptions, lock: Arc<File>) -> Result<(Self, Replay), JournalError> {
        let Recovered { replay, file, segment, first_segment, generation, len, records_in_segment, next_seq } =
            recover::recover(dir)?;
        let journal = Self {
            dir: dir.to_owned(),
            options,
            lock,
            file,
            segment,
            first_segment,
            generation,
            len,
            records_in_segment,
            next_seq,
            buf: Vec::new(),
            poisoned: false,
        };
        Ok((journal, replay))
    }

    /// Appends one record and makes it durable before returning its sequence number.
    /// Kinds from [`RESERVED_KINDS`] up are the journal's own.
    pub fn append(&mut self, kind: u16, payload: &[u8]) -> Result<Seq, JournalError> {
        let seqs = self.append_batch(&[(kind, payload)])?;
        seqs.first().copied().ok_or(JournalError::Exhausted)
    }

    /// Appends records with one write and one fdatasync (group commit) and returns their
    /// sequence numbers. All of them are durable when this returns `Ok`; after a crash
    /// before that, any prefix of them may survive. An empty batch writes nothing.
    pub fn append_batch(&mut self, records: &[(u16, &[u8])]) -> Result<Vec<Seq>, JournalError> {
        self.check_usable()?;
        let mut total = 0usize;
        for &(kind, payload) in records {
            if kind >= RESERVED_KINDS {
                return Err(JournalError::ReservedKind { kind });
            }
            if payload.len() > MAX_PAYLOAD {
                return Err(JournalError::PayloadTooLarge { len: payload.len() });
            }
            total = total.saturating_add(format::record_len(payload.len()));
        }
        if total > MAX_BATCH_BYTES {
            return Err(JournalError::BatchTooLarge { len: total });
        }
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let last = self.next_seq.checked_add(records.len() as u64 - 1).ok_or(JournalError::Exhausted)?;
        // The sequence after the batch must exist too: a crafted segment may start at the
        // last number there is.
        let next = last.checked_add(1).ok_or(JournalError::Exhausted)?;
        if self.records_in_segment > 0 && self.len + total as u64 > self.options.segment_bytes {
            self.rotate()?;
        }
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        for (i, &(kind, payload)) in records.iter().enumerate() {
            format::encode_record(&mut buf, self.next_seq + i as u64, kind, payload);
        }
        let written = self.write_durably(&buf);
        // Keep a modest buffer around for the next batch, not the largest one ever seen.
        if buf.capacity() <= 1 << 20 {
            self.buf = buf;
        }
        written?;
        let seqs = (self.next_seq..=last).collect();
        self.next_seq = next;
        self.records_in_segment += records.len() as u64;
        Ok(seqs)
    }

    /// Replaces the history with `snapshot`, a payload the caller made of its whole state
    /// as of now (at most [`MAX_SNAPSHOT`]). The snapshot is written, whole, at the start of
    /// a new segment — as one record, or as records of [`MAX_PAYLOAD`] when it is larger —
    /// (temporary file, fsync, rename, directory fsync); only then are older segments
    /// removed. Returns the sequence number of the snapshot's last record. A crash at any
    /// step leaves either the old history or the snapshot, never both and never neither.
    pub fn compact(&mut self, snapshot: &[u8]) -> Result<Seq, JournalError> {
        self.check_usable()?;
        if snapshot.len() > MAX_SNAPSHOT {
            return Err(JournalError::SnapshotTooLarge { len: snapshot.len() });
        }
        let parts: Vec<&[u8]> =
            if snapshot.is_empty() { vec![snapshot] } else { snapshot.chunks(MAX_PAYLOAD).collect() };
        let first = self.next_seq;
        let last = first.checked_add(parts.len() as u64 - 1).ok_or(JournalError::Exhausted)?;
        let next = last.checked_add(1).ok_or(JournalError::Exhausted)?;
        let segment = self.segment.checked_add(1).ok_or(JournalError::Exhausted)?;
        let generation = self.generation.checked_add(1).ok_or(JournalError::Exhausted)?;
        // At most MAX_SNAPSHOT_PARTS, so the count fits.
        let snapshot_parts = if parts.len() > 1 { parts.len() as u32 } else { 0 };
        let header = SegmentHeader { segment, generation, first_seq: first, snapshot: true, snapshot_parts };
        let len = HEADER_LEN + parts.iter().map(|p| format::record_len(p.len())).sum::<usize>();
        let mut bytes = Vec::with_capacity(len);
        bytes.extend_from_slice(&header.encode());
        for (seq, part) in (first..).zip(&parts) {
            format::encode_record(&mut bytes, seq, KIND_SNAPSHOT, part);
        }
        let path = sys::segment_path(&self.dir, segment);
        let file = sys::create_whole(&self.dir, &path, &bytes).inspect_err(|_| self.poisoned = true)?;
        // The snapshot is durable: from here on the old segments are obsolete.
        let old = self.first_segment..segment;
        self.switch_to(file, segment, bytes.len() as u64, parts.len() as u64);
        self.generation = generation;
        self.first_segment = segment;
        self.next_seq = next;
        let mut removed = 0;
        for n in old {
            match sys::remove(&sys::segment_path(&self.dir, n)) {
                Ok(()) => removed += 1,
                // Harmless: the next open removes segments older than the snapshot.
                Err(e) => tracing::warn!(error = %e, "cannot remove an obsolete journal segment"),
            }
        }
        if let Err(e) = sys::sync_dir(&self.dir) {
            tracing::warn!(error = %e, "cannot sync the journal directory after compaction");
        }
        let (bytes, records) = (snapshot.len(), parts.len());
        tracing::info!(seq = last, segment, generation, bytes, records, removed, "journal compacted");
        Ok(last)
    }

    /// The sequence number the next record will get.
    pub fn next_seq(&self) -> Seq {
        self.next_seq
    }

    /// The journal's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of the segment being appended to.
    pub fn segment(&self) -> u64 {
        self.segment
    }

    /// Bytes in the segment being appended to.
    pub fn segment_len(&self) -> u64 {
        self.len
    }

    fn check_usable(&self) -> Result<(), JournalError> {
        if self.poisoned { Err(JournalError::Poisoned) } else { Ok(()) }
    }

    /// Writes at the end of the segment and fdatasyncs. Any failure poisons the journal:
    /// after a failed fsync the kernel may have dropped the dirty pages, so retrying could
    /// acknowledge data that is not on disk. Reopening recovers what is.
    fn write_durably(&mut self, bytes: &[u8]) -> Result<(), JournalError> {
        let path = || sys::segment_path(&self.dir, self.segment);
        let result = match self.file.write_all_at(bytes, self.len) {
            Err(source) => Err(JournalError::Write { path: path(), source }),
            Ok(()) => self.file.sync_data().map_err(|source| JournalError::Sync { path: path(), source }),
        };
        if result.is_err() {
            self.poisoned = true;
        } else {
            self.len += bytes.len() as u64;
        }
        result
    }

    /// Seals the current segment (its records are already durable) and starts the next.
    fn rotate(&mut self) -> Result<(), JournalError> {
        let segment = self.segment.checked_add(1).ok_or(JournalError::Exhausted)?;
        let first_seq = self.next_seq;
        let header =
            SegmentHeader { segment, generation: self.generation, first_seq, snapshot: false, snapshot_parts: 0 };
        let path = sys::segment_path(&self.dir, segment);
        let file = sys::create_whole(&self.dir, &path, &header.encode()).inspect_err(|_| self.poisoned = true)?;
        tracing::debug!(segment, first_seq = self.next_seq, "journal segment started");
        self.switch_to(file, segment, HEADER_LEN as u64, 0);
        Ok(())
    }

    fn switch_to(&mut self, file: File, segment: u64, len: u64, records: u64) {
        self.file = file;
        self.segment = segment;
        self.len = len;
        self.records_in_segment = records;
    }
}
