//! The map writer: the address map and the record generation it was saved at, changed
//! only through [`MapWriter::commit`], which saves the map state and the bindings as one
//! record and only then publishes both (commit, then publish).

use std::cell::RefCell;
use std::sync::Arc;

use fabric_addrmap::{AddressMap, MapError};

use super::published::{MapView, Published};
use super::{MapStore, StoreError, next_record};
use crate::partitions::{Binding, PartitionError};

/// Why a change to the map or the bindings was not made (nothing of it was published).
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// The map refused the change.
    #[error("address map")]
    Map(#[from] MapError),
    /// A binding breaks a bound.
    #[error("partition bindings")]
    Partition(#[from] PartitionError),
    /// The record could not be saved.
    #[error("saving the map record")]
    Store(#[from] StoreError),
}

/// The one writer of the address map and the bindings (the daemon keeps it behind a mutex
/// that only writers take; readers use [`Published::load`]).
#[derive(Debug)]
pub struct MapWriter {
    map: AddressMap,
    /// The record generation the store is at.
    at: u64,
}

impl MapWriter {
    /// A writer over a loaded map whose record is at generation `at` (0: none saved yet).
    pub fn new(map: AddressMap, at: u64) -> Self {
        Self { map, at }
    }

    /// The map.
    pub fn map(&self) -> &AddressMap {
        &self.map
    }

    /// The record generation the store is at.
    pub fn record_generation(&self) -> u64 {
        self.at
    }

    /// Runs `f` over the map and a copy of the bindings; when either changed (or `force`),
    /// saves both as one record in `store`, and only then publishes the map's snapshot and
    /// the bindings together, as one [`MapView`] in `published`. On any failure nothing is
    /// published and the map is as it was.
    pub fn commit<T>(
        &mut self,
        store: &dyn MapStore,
        published: &Published,
        force: bool,
        f: impl FnOnce(&mut AddressMap, &mut Vec<Binding>) -> Result<T, CommitError>,
    ) -> Result<T, CommitError> {
        let before = published.load().bindings.clone();
        let next = RefCell::new(before.as_ref().clone());
        let saved: RefCell<Option<(u64, Arc<Vec<Binding>>)>> = RefCell::new(None);
        let at = self.at;
        let t = self.map.commit_with(
            |m| f(m, &mut next.borrow_mut()),
            |state, changed| {
                let next = next.take();
                if !changed && !force && next == *before {
                    return Ok(());
                }
                crate::partitions::validate(&next).map_err(PartitionError::Invalid)?;
                let record = next_record(at, state.clone(), Arc::new(next));
                store.save(at, &record)?;
                *saved.borrow_mut() = Some((record.generation, record.bindings));
                Ok(())
            },
        )?;
        if let Some((generation, bindings)) = saved.take() {
            self.at = generation;
            let bindings = if *bindings == *before { before } else { bindings };
            published.publish(MapView { map: self.map.snapshot(), bindings });
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use fabric_addrmap::MapConfig;
    use fabric_topology::DeviceId;

    use super::*;
    use crate::store::FileStore;

    /// Each commit moves partition `p` to device `n` and binds uid `n` to it, together; a
    /// reader running alongside must only ever see the two agree (one swap publishes both),
    /// and a failed commit publishes nothing.
    #[test]
    fn readers_see_the_map_and_the_bindings_of_one_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path());
        let map = AddressMap::new(MapConfig::default()).unwrap();
        let published = Published::new(MapView { map: map.snapshot(), bindings: Arc::new(Vec::new()) });
        let mut writer = MapWriter::new(map, 0);
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut seen = 0u32;
                while !done.load(Ordering::Acquire) {
                    let view = published.load();
                    let devices = view.map.state().partitions.iter().find(|p| p.name == "p").map(|p| p.devices.clone());
                    let uids = view.bindings.iter().find(|b| b.name == "p").map(|b| b.uids.clone());
                    match (devices, uids) {
                        (None, None) => {}
                        (Some(d), Some(u)) => {
                            assert_eq!(d.len(), 1);
                            assert_eq!(
                                d[0].to_string(),
                                format!("uuid:GPU-{}", u[0]),
                                "map and bindings of two records"
                            );
                            seen += 1;
                        }
                        (d, u) => panic!("a view with devices {d:?} but uids {u:?}"),
                    }
                }
                seen
            });
            let written = (1..=60u32).try_for_each(|n| {
                let device: DeviceId = format!("uuid:GPU-{n}").parse().map_err(|e| format!("{e:?}"))?;
                writer
                    .commit(&store, &published, false, |m, bindings| {
                        *bindings = crate::partitions::with_binding(bindings, &Binding::new("p", &[n], &[]))?;
                        Ok(m.partition("p", &[device]))
                    })
                    .map(|_| ())
                    .map_err(|e| crate::error_chain(&e))
            });
            // Stop the reader before any assertion, so that a failure cannot hang the test.
            done.store(true, Ordering::Release);
            let seen = reader.join().unwrap();
            written.unwrap();
            assert!(seen > 0, "the reader saw a bound partition");
        });
        let before = published.load();
        let e = writer.commit(&store, &published, false, |m, bindings| {
            m.partition("p", &[]);
            *bindings = vec![Binding::new("b", &[1], &[]), Binding::new("a", &[1], &[])];
            Ok(())
        });
        assert!(matches!(e, Err(CommitError::Partition(_))), "unsorted bindings are refused");
        assert!(Arc::ptr_eq(&before, &published.load()), "nothing published");
        assert_eq!(writer.record_generation(), 60);
    }
}
