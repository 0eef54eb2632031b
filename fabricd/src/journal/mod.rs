//! The durable journal: an append-only, checksummed log of records in segment files, with
//! group commit, rotation and compaction into a snapshot.
//!
//! A change is *acknowledged* when [`Journal::append`] (or [`Journal::append_batch`] or
//! [`Journal::compact`]) returns `Ok`: its bytes were written and `fdatasync`ed, and (for a
//! new segment) the directory was fsynced. The daemon answers a client only after that.
//! After a crash at any instant, [`Journal::open`] replays every acknowledged record, in
//! order. A write that was cut short leaves a torn tail, which was never acknowledged and
//! is cut off with a warning; damage anywhere else stops `open` with a typed error and
//! leaves the files as they are. See docs/journal.md for the format and the operator's
//! procedure.
//!
//! Layout: [`format`](mod@format) is the byte format and a pure decoder, `recover` the scan at open,
//! `writer` the appending side, `commit` the group commit that shares one `fdatasync` among
//! concurrent changes, `salvage` the operator's repair of a damaged journal,
//! [`sys`] the file-system steps.

mod commit;
pub mod format;
mod recover;
mod salvage;
pub mod sys;
mod writer;

use std::io;

use std::path::PathBuf;

pub use commit::{Committer, Image, Ticket};
pub use format::{
    DecodedSegment, FormatError, KIND_SNAPSHOT, MAX_PAYLOAD, MAX_SNAPSHOT, RESERVED_KINDS, RecordFault, decode_segment,
};
pub use salvage::{Salvage, SalvageAction, salvage};
pub use sys::{segment_name, segment_path};
pub use writer::Journal;

/// A record's sequence number: 1 for the first record ever written, then one more for
/// each record, across segments and compactions.
pub type Seq = u64;

/// Largest batch (framed bytes) that one [`Journal::append_batch`] writes: 64 MiB.
pub const MAX_BATCH_BYTES: usize = 64 << 20;
/// Largest segment size a journal may be configured with: 1 GiB.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 30;
/// Largest segment file `open` reads; anything larger is not one of ours.
pub const MAX_SEGMENT_FILE: u64 = MAX_SEGMENT_BYTES + MAX_BATCH_BYTES as u64 + format::HEADER_LEN as u64;

/// How a journal is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JournalOptions {
    /// A segment that would grow past this many bytes is closed and a new one started
    /// (a record or batch never spans segments, so one batch may overshoot it).
    pub segment_bytes: u64,
}

impl Default for JournalOptions {
    fn default() -> Self {
        Self { segment_bytes: 64 << 20 }
    }
}

/// One replayed record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Sequence number.
    pub seq: Seq,
    /// Kind, as given to `append` ([`KIND_SNAPSHOT`] for a snapshot).
    pub kind: u16,
    /// Payload.
    pub payload: Vec<u8>,
}

/// A torn tail that `open` cut off: the end of a write that was never acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncation {
    /// The segment.
    pub path: PathBuf,
    /// Where the tail started; the segment is now this long.
    pub offset: u64,
    /// Bytes dropped.
    pub dropped: u64,
    /// What was wrong with the first dropped frame.
    pub fault: RecordFault,
}

/// What `open` found: the records to apply, in order, and what it cleaned up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replay {
    /// The latest snapshot, if the journal was ever compacted: its records' payloads
    /// joined, with the last one's sequence number. Apply it first.
    pub snapshot: Option<Record>,
    /// Records after the snapshot (or since the start), in sequence order, no gaps.
    pub records: Vec<Record>,
    /// The torn tail cut off, if any.
    pub truncated: Option<Truncation>,
    /// Files removed: temporaries of an interrupted segment creation and segments made
    /// obsolete by a snapshot whose compaction was interrupted.
    pub removed: Vec<PathBuf>,
}

impl Replay {
    /// Sequence number of the last record (snapshot included), if any.
    pub fn last_seq(&self) -> Option<Seq> {
        self.records.last().or(self.snapshot.as_ref()).map(|r| r.seq)
    }

    /// Bytes of torn tail dropped.
    pub fn dropped_bytes(&self) -> u64 {
        self.truncated.as_ref().map_or(0, |t| t.dropped)
    }
}

/// Errors from the journal.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// Listing the journal directory failed.
    #[error("cannot list journal directory {path}")]
    ListDir {
        /// Directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Reading a segment failed.
    #[error("cannot read {path}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Creating, writing, renaming or truncating a file failed.
    #[error("cannot write {path}")]
    Write {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// fsync or fdatasync failed: what reached the disk is unknown.
    #[error("cannot sync {path}")]
    Sync {
        /// File or directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Removing a file failed.
    #[error("cannot remove {path}")]
    Remove {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Another process (or another `Journal` in this one) holds the journal.
    #[error("journal is in use by another writer (lock {path} held)")]
    Locked {
        /// The lock file.
        path: PathBuf,
    },
    /// A segment's bytes are damaged or inconsistent. Nothing was changed.
    #[error("journal segment {path} is damaged at byte {offset} (left untouched; see docs/journal.md, Recovery)")]
    Corrupt {
        /// The segment.
        path: PathBuf,
        /// Byte offset of the damage in it.
        offset: u64,
        /// What is wrong.
        #[source]
        source: FormatError,
    },
    /// A segment that is not the newest ends in damage: sealed segments are complete, so
    /// this is not a torn write. Nothing was changed.
    #[error(
        "sealed journal segment {path} is damaged at byte {offset} ({fault}; left untouched; see docs/journal.md, Recovery)"
    )]
    SealedDamage {
        /// The segment.
        path: PathBuf,
        /// Byte offset of the damage.
        offset: u64,
        /// What is wrong with the frame there.
        fault: RecordFault,
    },
    /// The segments do not form one unbroken history (missing segment, sequence gap,
    /// header that disagrees with its file name). Nothing was changed.
    #[error(
        "journal segment {path} does not follow its predecessor: {what} (left untouched; see docs/journal.md, Recovery)"
    )]
    Discontinuous {
        /// The segment.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A segment file is too large to be one of ours.
    #[error("journal segment {path} is {len} bytes, more than any segment this journal writes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
    /// A payload over [`MAX_PAYLOAD`].
    #[error("payload of {len} bytes exceeds the {MAX_PAYLOAD}-byte maximum")]
    PayloadTooLarge {
        /// Its size.
        len: usize,
    },
    /// A snapshot over [`MAX_SNAPSHOT`].
    #[error("snapshot of {len} bytes exceeds the {MAX_SNAPSHOT}-byte maximum")]
    SnapshotTooLarge {
        /// Its size.
        len: usize,
    },
    /// A batch over [`MAX_BATCH_BYTES`].
    #[error("batch of {len} bytes exceeds the {MAX_BATCH_BYTES}-byte maximum")]
    BatchTooLarge {
        /// Its size, framed.
        len: usize,
    },
    /// A record kind reserved for the journal itself.
    #[error("record kind {kind:#06x} is reserved for the journal")]
    ReservedKind {
        /// The kind.
        kind: u16,
    },
    /// Options out of range.
    #[error("segment size {segment_bytes} is out of range (1..={MAX_SEGMENT_BYTES})")]
    Options {
        /// The configured size.
        segment_bytes: u64,
    },
    /// The journal directory is not the daemon's own private directory.
    #[error("journal directory")]
    Dir(#[source] crate::sys::privdir::DirError),
    /// Sequence or segment numbers ran out (only a crafted header can get here).
    #[error("journal sequence or segment numbers exhausted")]
    Exhausted,
    /// An earlier write or sync failed, so the file's state is unknown; nothing more is
    /// written until the journal is opened again (which recovers what is durable).
    #[error("journal stopped after an earlier write or sync failure; reopen it")]
    Poisoned,
    /// A snapshot queued to be encoded when its turn came did not encode: nothing was
    /// written, the journal is as it was.
    #[error("the snapshot does not encode: {0}")]
    Encode(String),
    /// The batch a record was group-committed in failed (`commit.rs`).
    #[error("the group commit's write failed")]
    Batch(#[source] std::sync::Arc<JournalError>),
}

impl JournalError {
    /// Whether nothing was written: a snapshot that did not encode, or a payload or
    /// snapshot refused for its size before any byte went out (a registry grown past what
    /// a snapshot holds); either leaves the journal whole (no reopen needed).
    pub fn wrote_nothing(&self) -> bool {
        match self {
            Self::Encode(_) | Self::PayloadTooLarge { .. } | Self::SnapshotTooLarge { .. } => true,
            Self::Batch(inner) => inner.wrote_nothing(),
            _ => false,
        }
    }
}
