//! Where the address map and the partition bindings are kept: one [`Record`] holding both,
//! saved whole behind the [`MapStore`] trait before a change is published (commit, then
//! publish) as one [`MapView`]. [`FileStore`] keeps it in the state directory; a domain adds a shared store.

mod file;
mod published;
pub mod record;
mod writer;

use std::path::PathBuf;
use std::sync::Arc;

use fabric_addrmap::State;

use crate::partitions::Binding;
pub use file::{FileStore, RECORD_FILE};
pub use published::{MapView, Published};
pub use record::{Record, RecordError, decode_record, encode_record};
pub use writer::{CommitError, MapWriter};

/// Why a record could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The stored record is damaged or not a record; it is left as it is.
    #[error(
        "map record {path} is corrupt (left untouched; restore it from a backup, or move it aside to lay the map out anew: placed ranges and partition bindings are then made again)"
    )]
    Corrupt {
        /// Where.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: RecordError,
    },
    /// Reading or writing the store failed.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A save named a generation the store is no longer at (another writer saved first).
    #[error("map record is at generation {found}, not {expected}")]
    Conflict {
        /// The generation the writer started from.
        expected: u64,
        /// The one the store holds.
        found: u64,
    },
    /// The files of a daemon before the record (`map.state`, `partitions.state`) could
    /// not be read.
    #[error("migrating the address map state")]
    LegacyMap(#[source] fabric_addrmap::PersistError),
    /// An earlier daemon's bindings file is damaged or not a bindings file.
    #[error(
        "partition bindings {path} are unreadable (move the file aside to start without bindings, then set them again)"
    )]
    LegacyBindings {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: crate::partitions::DecodeError,
    },
}

/// A store of the one record that holds the address map state and the partition bindings.
///
/// Generations count saves: a store that holds no record is at generation 0, and each
/// [`MapStore::save`] moves it from `expected` to `record.generation` (`expected + 1`), or
/// fails with [`StoreError::Conflict`] when the store is elsewhere, so that a writer that
/// started from a stale record cannot overwrite a newer one.
pub trait MapStore: Send + Sync + std::fmt::Debug {
    /// The stored record, or `None` when there is none. A record migrated from older files
    /// comes at generation 0 (not saved yet).
    fn load(&self) -> Result<Option<Record>, StoreError>;

    /// Saves `record` durably, if the store is at `expected`.
    fn save(&self, expected: u64, record: &Record) -> Result<(), StoreError>;
}

/// A record to save: the next generation after `expected`.
pub fn next_record(expected: u64, map: Arc<State>, bindings: Arc<Vec<Binding>>) -> Record {
    Record { generation: expected.saturating_add(1), map, bindings }
}
