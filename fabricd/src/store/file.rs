//! The file store: the map record in `<state dir>/map.record`, replaced whole
//! ([`fabric_addrmap::durable::write_whole`]) on every save. A state dir of a daemon
//! before the record (`map.state` and `partitions.state`) is read once and retired to
//! `<name>.migrated` after the first record is saved.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use fabric_addrmap::{MapConfig, PersistError, State};

use super::{MapStore, Record, StoreError, decode_record, encode_record};

/// The record's file name in the state directory.
pub const RECORD_FILE: &str = "map.record";
/// The address map state file of a daemon before the record.
pub const LEGACY_MAP_FILE: &str = "map.state";

/// The map record kept in a state directory. One daemon writes it (the journal's lock
/// keeps a second one off the directory); the generation it last loaded or saved is what
/// [`MapStore::save`] compares with.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
    path: PathBuf,
    /// The generation on disk; held by a save from its compare to its update, which only
    /// writers (already serialised by the daemon's map writer) take.
    at: Mutex<u64>,
    /// Syncs the state directory after the record's rename (tests make it fail).
    sync_dir: fn(&Path) -> std::io::Result<()>,
}

impl FileStore {
    /// The store of `state_dir` (nothing is read until [`MapStore::load`]).
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.to_owned(),
            path: state_dir.join(RECORD_FILE),
            at: Mutex::new(0),
            sync_dir: fabric_addrmap::durable::sync_dir,
        }
    }

    /// The same store whose directory syncs fail (`EIO`).
    #[cfg(test)]
    fn failing_dir_syncs(self) -> Self {
        Self { sync_dir: |_| Err(std::io::Error::from_raw_os_error(libc::EIO)), ..self }
    }

    /// The record's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `map.state`, `partitions.state`, then `map.state.prev` (the legacy map's last good
    /// copy: left behind, a record moved aside found it and refused to start,
    /// `MissingWithPrevious`).
    fn legacy_files(&self) -> [PathBuf; 3] {
        let map = self.dir.join(LEGACY_MAP_FILE);
        let prev = fabric_addrmap::persist::prev_path(&map);
        [map, self.dir.join(crate::partitions::FILE_NAME), prev]
    }

    /// Reads `map.state` and `partitions.state`; `None` when neither exists.
    fn load_legacy(&self) -> Result<Option<Record>, StoreError> {
        let [map_path, _, _] = self.legacy_files();
        let map = match fabric_addrmap::persist::load(&map_path) {
            Ok(state) => Some(state),
            Err(PersistError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(StoreError::LegacyMap(e)),
        };
        let path = self.dir.join(crate::partitions::FILE_NAME);
        let bindings = match crate::sys::privdir::read_private(&path) {
            Ok(bytes) => {
                Some(crate::partitions::decode(&bytes).map_err(|source| StoreError::LegacyBindings { path, source })?)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(StoreError::Io { what: "reading", path, source }),
        };
        if map.is_none() && bindings.is_none() {
            return Ok(None);
        }
        tracing::info!(dir = %self.dir.display(), "migrating map.state and partitions.state to one map record");
        Ok(Some(Record {
            generation: 0,
            map: Arc::new(map.unwrap_or_else(|| State::new(MapConfig::default()))),
            bindings: Arc::new(bindings.unwrap_or_default()),
        }))
    }

    /// Renames the files the record replaced, once it is durable; best effort (a file
    /// left behind is ignored while the record exists).
    fn retire_legacy(&self) {
        for old in self.legacy_files() {
            if !old.exists() {
                continue;
            }
            let to = fabric_addrmap::durable::suffixed(&old, ".migrated");
            match std::fs::rename(&old, &to) {
                Ok(()) => tracing::info!(from = %old.display(), to = %to.display(), "migrated file retired"),
                Err(e) => tracing::warn!(file = %old.display(), error = %e, "cannot retire a migrated file"),
            }
        }
    }
}

impl MapStore for FileStore {
    fn load(&self) -> Result<Option<Record>, StoreError> {
        let record = match crate::sys::privdir::read_private(&self.path) {
            Ok(bytes) => {
                let r =
                    decode_record(&bytes).map_err(|source| StoreError::Corrupt { path: self.path.clone(), source })?;
                self.retire_legacy();
                Some(r)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.load_legacy()?,
            Err(source) => return Err(StoreError::Io { what: "reading", path: self.path.clone(), source }),
        };
        *self.at.lock().unwrap_or_else(|p| p.into_inner()) = record.as_ref().map_or(0, |r| r.generation);
        Ok(record)
    }

    fn save(&self, expected: u64, record: &Record) -> Result<(), StoreError> {
        let mut at = self.at.lock().unwrap_or_else(|p| p.into_inner());
        if *at != expected || record.generation <= expected {
            return Err(StoreError::Conflict { expected, found: *at });
        }
        match fabric_addrmap::durable::write_whole_with(&self.path, &encode_record(record), self.sync_dir) {
            Ok(_) => {}
            // The new record is in place: a restart loads it, so the change is made (were
            // it refused, the map rolled back, a restart would bring it back). Only a power
            // loss before a later save syncs the directory may lose it.
            Err(e) if e.step == fabric_addrmap::durable::WriteStep::SyncDir => {
                tracing::error!(path = %self.path.display(), error = %e.source, generation = record.generation, "map record saved, but its directory could not be synced: the change is in effect, and a power loss before the next save may lose it");
            }
            Err(e) => return Err(StoreError::Io { what: "saving", path: e.path, source: e.source }),
        }
        *at = record.generation;
        drop(at);
        if expected == 0 {
            self.retire_legacy();
        }
        tracing::debug!(path = %self.path.display(), generation = record.generation, "map record saved");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partitions::Binding;
    use crate::store::{RecordError, next_record};
    use fabric_addrmap::durable::FrameError;

    fn state_with_partition() -> State {
        let mut map = fabric_addrmap::AddressMap::new(MapConfig::default()).unwrap();
        map.partition("tenant-a", &["uuid:GPU-0".parse().unwrap()]);
        map.state().clone()
    }

    #[test]
    fn saves_compare_generations_and_load_what_was_saved() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path());
        assert_eq!(store.load().unwrap(), None);
        let bindings = Arc::new(vec![Binding::new("tenant-a", &[61001], &[])]);
        let first = next_record(0, Arc::new(state_with_partition()), bindings.clone());
        store.save(0, &first).unwrap();
        assert_eq!(FileStore::new(dir.path()).load().unwrap(), Some(first.clone()));
        // A writer that started from generation 0 again is refused; the record stays.
        let e = store.save(0, &next_record(0, first.map.clone(), Arc::new(Vec::new()))).unwrap_err();
        assert!(matches!(e, StoreError::Conflict { expected: 0, found: 1 }), "{e}");
        let second = next_record(1, first.map.clone(), Arc::new(Vec::new()));
        store.save(1, &second).unwrap();
        assert_eq!(FileStore::new(dir.path()).load().unwrap(), Some(second));
        assert!(!fabric_addrmap::durable::suffixed(store.path(), ".tmp").exists());
    }

    #[test]
    fn a_corrupt_or_truncated_record_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path());
        let r = next_record(0, Arc::new(state_with_partition()), Arc::new(Vec::new()));
        store.save(0, &r).unwrap();
        let good = std::fs::read(store.path()).unwrap();
        std::fs::write(store.path(), &good[..good.len() - 3]).unwrap();
        let e = FileStore::new(dir.path()).load().unwrap_err();
        assert!(
            matches!(&e, StoreError::Corrupt { source: RecordError::Frame(FrameError::Truncated { .. }), .. }),
            "{e}"
        );
        let mut flipped = good.clone();
        flipped[good.len() / 2] ^= 0x40;
        std::fs::write(store.path(), &flipped).unwrap();
        let e = FileStore::new(dir.path()).load().unwrap_err();
        assert!(matches!(&e, StoreError::Corrupt { .. }), "{e}");
        assert_eq!(std::fs::read(store.path()).unwrap(), flipped, "left as it was");
    }

    /// A directory sync that fails after the rename: the record on disk is the new one,
    /// so the save stands. Before, it was refused (the writer rolled the map back) while
    /// a restart loaded the change the client had been told failed.
    #[test]
    fn a_save_whose_directory_sync_fails_stands_as_the_record_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path()).failing_dir_syncs();
        let state = Arc::new(state_with_partition());
        let bindings = Arc::new(vec![Binding::new("tenant-a", &[61001], &[61100])]);
        store.save(0, &next_record(0, state.clone(), bindings.clone())).unwrap();
        assert!(
            matches!(store.save(0, &next_record(0, state.clone(), bindings.clone())), Err(StoreError::Conflict { .. })),
            "the store is at the new generation"
        );
        let back = FileStore::new(dir.path()).load().unwrap().unwrap();
        assert_eq!((back.generation, &*back.bindings), (1, &*bindings));
    }

    /// A state dir of a daemon before the record: `map.state` and `partitions.state` load
    /// as one record at generation 0; the first save retires them, and later loads come
    /// from the record alone.
    #[test]
    fn the_two_old_files_migrate_into_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let state = state_with_partition();
        // Saved twice: the legacy map keeps its last good copy, `map.state.prev`.
        fabric_addrmap::persist::save(&dir.path().join(LEGACY_MAP_FILE), &state).unwrap();
        fabric_addrmap::persist::save(&dir.path().join(LEGACY_MAP_FILE), &state).unwrap();
        let prev = fabric_addrmap::persist::prev_path(&dir.path().join(LEGACY_MAP_FILE));
        assert!(prev.exists());
        let bindings = vec![Binding::new("tenant-a", &[61001], &[61100])];
        std::fs::write(dir.path().join(crate::partitions::FILE_NAME), crate::partitions::encode(&bindings)).unwrap();
        let store = FileStore::new(dir.path());
        let r = store.load().unwrap().unwrap();
        assert_eq!((r.generation, &*r.map, &*r.bindings), (0, &state, &bindings));
        store.save(0, &next_record(0, r.map.clone(), r.bindings.clone())).unwrap();
        assert!(!dir.path().join(LEGACY_MAP_FILE).exists());
        assert!(dir.path().join("partitions.state.migrated").exists());
        let again = FileStore::new(dir.path()).load().unwrap().unwrap();
        assert_eq!((again.generation, &*again.map, &*again.bindings), (1, &state, &bindings));
        // The legacy map's last good copy is retired too: a record moved aside (what the
        // corrupt-record message says to do) lays the map out anew. Before, the copy left
        // behind made that load fail (`MissingWithPrevious`) and the daemon refuse to start.
        assert!(!prev.exists());
        std::fs::rename(dir.path().join(RECORD_FILE), dir.path().join("map.record.bad")).unwrap();
        assert!(FileStore::new(dir.path()).load().unwrap().is_none());
        // Only the bindings file (a daemon that never saved a map): an empty map with them.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(crate::partitions::FILE_NAME), crate::partitions::encode(&bindings)).unwrap();
        let r = FileStore::new(dir.path()).load().unwrap().unwrap();
        assert!(r.map.partitions.is_empty());
        assert_eq!(*r.bindings, bindings);
        // A damaged old file stops the load rather than dropping security state.
        std::fs::write(dir.path().join(crate::partitions::FILE_NAME), b"not a bindings file at all, long enough")
            .unwrap();
        let e = FileStore::new(dir.path()).load().unwrap_err();
        assert!(
            matches!(&e, StoreError::LegacyBindings { source: crate::partitions::DecodeError::BadMagic, .. }),
            "{e}"
        );
        assert!(e.to_string().contains(crate::partitions::FILE_NAME), "{e}");
    }
}
