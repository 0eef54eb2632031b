//! What readers see of the map record: the address map's snapshot and the partition
//! bindings saved with it, published together by one atomic swap after the record is
//! saved, so that no reader sees new devices with old bindings or the other way round.

use std::sync::Arc;

use arc_swap::ArcSwap;
use fabric_addrmap::Snapshot;

use crate::partitions::Binding;

/// One saved state of the map record, as readers use it.
#[derive(Debug)]
pub struct MapView {
    /// The address map (translation, placements, partitions' device sets).
    pub map: Arc<Snapshot>,
    /// Who each partition binds, sorted by name.
    pub bindings: Arc<Vec<Binding>>,
}

impl MapView {
    /// The binding of one partition (an empty one when it has none).
    pub fn binding(&self, name: &str) -> Binding {
        self.bindings.iter().find(|b| b.name == name).cloned().unwrap_or_else(|| Binding::new(name, &[], &[]))
    }

    /// The partitions that bind a client ([`crate::partitions::bound`]).
    pub fn bound(&self, uid: u32, groups: &[u32]) -> Vec<String> {
        crate::partitions::bound(&self.bindings, uid, groups)
    }

    /// Whether partition `name` exists: it has devices in the map or a binding.
    pub fn has_partition(&self, name: &str) -> bool {
        self.map.state().partitions.iter().any(|p| p.name == name) || self.bindings.iter().any(|b| b.name == name)
    }
}

/// The current [`MapView`], read without locking; replaced only by
/// [`crate::store::MapWriter::commit`] after the record it shows is saved.
#[derive(Debug)]
pub struct Published {
    current: ArcSwap<MapView>,
}

impl Published {
    /// Starts with `view` (the record as loaded and saved at start).
    pub fn new(view: MapView) -> Self {
        Self { current: ArcSwap::from_pointee(view) }
    }

    /// The view now.
    pub fn load(&self) -> Arc<MapView> {
        self.current.load_full()
    }

    /// Publishes a view whose record was saved.
    pub(super) fn publish(&self, view: MapView) {
        self.current.store(Arc::new(view));
    }
}
