//! The map writer: the address map and the record generation it was saved at, changed
//! only through [`MapWriter::commit`], which saves the map state and the bindings as one
//! record and only then publishes both (commit, then publish).

use std::cell::RefCell;
use std::sync::Arc;

use fabric_addrmap::{AddressMap, MapError};

use super::{MapStore, StoreError, next_record};
use crate::partitions::{Binding, Bindings, PartitionError};

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
/// that only writers take; readers use [`AddressMap::reader`] and [`Bindings::snapshot`]).
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
    /// the bindings. On any failure nothing is published and the map is as it was.
    pub fn commit<T>(
        &mut self,
        store: &dyn MapStore,
        bindings: &Bindings,
        force: bool,
        f: impl FnOnce(&mut AddressMap, &mut Vec<Binding>) -> Result<T, CommitError>,
    ) -> Result<T, CommitError> {
        let before = bindings.snapshot();
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
        if let Some((generation, list)) = saved.take() {
            self.at = generation;
            if !Arc::ptr_eq(&list, &before) && *list != *before {
                bindings.publish(list);
            }
        }
        Ok(t)
    }
}
