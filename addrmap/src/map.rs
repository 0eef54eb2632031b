//! The address map: one writer that changes the state and publishes immutable snapshots,
//! and any number of readers that translate without locks.
//!
//! Writers take `&mut self` (the daemon owns the map; wrap it in a mutex to share writes).
//! Each change builds a new [`Snapshot`] off to the side and swaps it in with one atomic
//! pointer store ([`ArcSwap`]); a reader that loaded the old one keeps it, unchanged, for as
//! long as it holds the `Arc`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use fabric_topology::{DeviceId, Inventory};

use crate::config::{ConfigError, MapConfig};
use crate::interleave::{Geometry, InterleaveError};
use crate::layout::{self, Change, GcFilter, LayoutError};
use crate::persist::{self, PersistError};
use crate::snapshot::Snapshot;
use crate::state::{ResourceKey, State, StateError};

/// Errors from map operations.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The configuration is invalid.
    #[error("invalid configuration")]
    Config(#[from] ConfigError),
    /// A given state is inconsistent.
    #[error("inconsistent state")]
    State(#[from] StateError),
    /// A layout change is impossible.
    #[error("layout change refused")]
    Layout(#[from] LayoutError),
    /// Interleave parameters are illegal.
    #[error("illegal interleave geometry")]
    Interleave(#[from] InterleaveError),
    /// Reading or writing the state file failed.
    #[error("state file")]
    Persist(#[from] PersistError),
}

/// Where `rebuild` starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebuildFrom {
    /// An empty state with the given configuration: every range is placed anew.
    Inventory,
    /// The previous good copy (`map.state.prev`), brought up to date with the inventory.
    Previous,
}

/// What `rebuild` did.
#[derive(Debug)]
pub struct Rebuilt {
    /// The new map (already saved).
    pub map: AddressMap,
    /// Where the bad file went, if there was one.
    pub moved_aside: Option<PathBuf>,
    /// What the inventory changed.
    pub change: Change,
}

/// A cheap, clonable, `Send + Sync` handle through which readers get the current snapshot.
#[derive(Debug, Clone)]
pub struct Reader {
    current: Arc<ArcSwap<Snapshot>>,
}

impl Reader {
    /// The current snapshot (lock-free).
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// A short-lived guard on the current snapshot: cheaper than [`Reader::snapshot`] for one
    /// lookup or one batch.
    pub fn load(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.current.load()
    }
}

/// A reader for one thread's hot loop: it keeps the current snapshot and checks for a newer
/// one with a single atomic load per call (cheaper than [`Reader::load`]). It holds the
/// snapshot it last returned until the next call.
#[derive(Debug)]
pub struct CachedReader {
    cache: arc_swap::Cache<Arc<ArcSwap<Snapshot>>, Arc<Snapshot>>,
}

impl CachedReader {
    /// The current snapshot.
    #[inline]
    pub fn current(&mut self) -> &Arc<Snapshot> {
        self.cache.load()
    }
}

impl Reader {
    /// A caching reader for one thread.
    pub fn cached(&self) -> CachedReader {
        CachedReader { cache: arc_swap::Cache::new(self.current.clone()) }
    }
}

/// The global fabric address map.
#[derive(Debug)]
pub struct AddressMap {
    state: Arc<State>,
    current: Arc<ArcSwap<Snapshot>>,
    /// Inside [`AddressMap::commit`]: changes update `state` but are not published yet.
    held: bool,
}

impl AddressMap {
    /// An empty map.
    pub fn new(config: MapConfig) -> Result<Self, MapError> {
        config.validate()?;
        Self::from_state(State::new(config))
    }

    /// A map over an existing state (validated).
    pub fn from_state(state: State) -> Result<Self, MapError> {
        state.validate()?;
        let state = Arc::new(state);
        let snap = Snapshot::build(state.clone());
        Ok(Self { state, current: Arc::new(ArcSwap::from_pointee(snap)), held: false })
    }

    /// Loads a state file; a corrupt file is an error and is left untouched.
    pub fn load(path: &Path) -> Result<Self, MapError> {
        Self::from_state(persist::load(path)?)
    }

    /// Loads `path`, or starts empty with `config` when neither it nor its `.prev` exists.
    pub fn open(path: &Path, config: MapConfig) -> Result<Self, MapError> {
        match persist::load(path) {
            Err(PersistError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Self::new(config)
            }
            other => Self::from_state(other?),
        }
    }

    /// Operator recovery: moves the state file aside (to `map.state.corrupt-<generation>`),
    /// starts from `from`, applies the inventory and saves.
    pub fn rebuild(path: &Path, config: MapConfig, inv: &Inventory, from: RebuildFrom) -> Result<Rebuilt, MapError> {
        let mut map = match from {
            RebuildFrom::Inventory => Self::new(config)?,
            RebuildFrom::Previous => Self::load(&persist::prev_path(path))?,
        };
        let moved_aside = persist::move_aside(path)?;
        let change = map.update(inv)?;
        map.save(path)?;
        tracing::warn!(path = %path.display(), generation = map.generation(), "address map rebuilt");
        Ok(Rebuilt { map, moved_aside, change })
    }

    /// Saves atomically, keeping the previous file as `.prev`.
    pub fn save(&self, path: &Path) -> Result<(), MapError> {
        Ok(persist::save(path, &self.state)?)
    }

    /// The current state.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The current generation.
    pub fn generation(&self) -> u64 {
        self.state.generation
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// A reader handle that follows every published generation.
    pub fn reader(&self) -> Reader {
        Reader { current: self.current.clone() }
    }

    fn publish(&mut self, (state, change): (State, Change)) -> Change {
        if !change.is_empty() {
            self.state = Arc::new(state);
            if !self.held {
                self.current.store(Arc::new(Snapshot::build(self.state.clone())));
                tracing::info!(generation = change.generation, "address map generation published");
            }
        }
        change
    }

    /// Commit, then publish: runs the changes `f` makes to the map, saves the resulting
    /// state to `path` (atomically, as [`AddressMap::save`]) when it changed, and only
    /// then publishes its snapshot, so that no reader ever sees a generation that is not
    /// on disk. When `f` or the save fails, the map is back where it was and readers saw
    /// nothing of it.
    pub fn commit<T, E: From<MapError>>(
        &mut self,
        path: &Path,
        f: impl FnOnce(&mut Self) -> Result<T, E>,
    ) -> Result<T, E> {
        self.commit_with(
            f,
            |state, changed| if changed { Ok(persist::save(path, state).map_err(MapError::from)?) } else { Ok(()) },
        )
    }

    /// [`AddressMap::commit`] with the saving left to `save`, which is called once `f`
    /// succeeded, with the resulting state and whether `f` changed it (a store that keeps
    /// more than the map may have other changes to save). The snapshot is published only
    /// after `save` succeeded; when either fails the map is back where it was.
    pub fn commit_with<T, E>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, E>,
        save: impl FnOnce(&Arc<State>, bool) -> Result<(), E>,
    ) -> Result<T, E> {
        let before = self.state.clone();
        self.held = true;
        let r = f(self).and_then(|t| {
            save(&self.state, !Arc::ptr_eq(&before, &self.state))?;
            Ok(t)
        });
        self.held = false;
        match r {
            Ok(t) => {
                if !Arc::ptr_eq(&before, &self.state) {
                    self.current.store(Arc::new(Snapshot::build(self.state.clone())));
                    tracing::info!(generation = self.state.generation, "address map generation saved and published");
                }
                Ok(t)
            }
            Err(e) => {
                self.state = before;
                Err(e)
            }
        }
    }

    /// Brings the map in line with the domain's inventory.
    pub fn update(&mut self, inv: &Inventory) -> Result<Change, MapError> {
        let next = layout::apply_inventory(&self.state, inv)?;
        Ok(self.publish(next))
    }

    /// Brings one node's part of the map in line with its inventory
    /// ([`layout::apply_node_inventory`]): other nodes' placements are not touched.
    pub fn update_node(&mut self, node: &str, inv: &Inventory) -> Result<Change, MapError> {
        let next = layout::apply_node_inventory(&self.state, node, inv)?;
        Ok(self.publish(next))
    }

    /// Creates an interleave set (see [`layout::add_interleave`]).
    pub fn add_interleave(
        &mut self,
        name: &str,
        ways: u32,
        granularity: u64,
        members: &[ResourceKey],
        member_size: Option<u64>,
    ) -> Result<Change, MapError> {
        let geometry = Geometry::new(ways, granularity)?;
        let next = layout::add_interleave(&self.state, name, geometry, members, member_size)?;
        Ok(self.publish(next))
    }

    /// Removes an interleave set.
    pub fn remove_interleave(&mut self, name: &str) -> Result<Change, MapError> {
        let next = layout::remove_interleave(&self.state, name)?;
        Ok(self.publish(next))
    }

    /// Collects holes.
    pub fn gc(&mut self, filter: &GcFilter) -> Change {
        let next = layout::gc(&self.state, filter);
        self.publish(next)
    }

    /// Creates or replaces a partition.
    pub fn partition(&mut self, name: &str, devices: &[DeviceId]) -> Change {
        let next = layout::set_partition(&self.state, name, devices);
        self.publish(next)
    }

    /// Removes a partition.
    pub fn remove_partition(&mut self, name: &str) -> Result<Change, MapError> {
        let next = layout::remove_partition(&self.state, name)?;
        Ok(self.publish(next))
    }

    /// Checks that the map holds slots of `node` only (and of [`crate::FABRIC_NODE`]), as a
    /// domain node's own map does: other nodes' memory is theirs to place, in their slots,
    /// and a slot of another name (a map laid out while the daemon served as another node)
    /// would answer GFAs of the domain's other slots here.
    pub fn only_node(&self, node: &str) -> Result<(), MapError> {
        match self.state.nodes.iter().find(|n| n.node != node && n.node != crate::state::FABRIC_NODE) {
            Some(n) => Err(LayoutError::OtherNode { node: n.node.clone(), this: node.to_owned(), at: n.start }.into()),
            None => Ok(()),
        }
    }

    /// Replaces the configuration that *new* placements follow; placed ranges stay.
    pub fn set_config(&mut self, config: MapConfig) -> Result<Change, MapError> {
        config.validate()?;
        if config == self.state.config {
            return Ok(Change { generation: self.generation(), ..Change::default() });
        }
        // A pin moves no node that has memory: its first slot stays where it is, and with a
        // slot size pinned too, every slot of the node lies inside the pinned one (else its
        // GFAs would reach into the next node's).
        for (node, pin) in &config.nodes {
            let slots = || self.state.nodes.iter().filter(|n| n.node == *node);
            let (Some(base), Some(at)) = (pin.base, slots().map(|n| n.start).min()) else { continue };
            if base != at {
                return Err(LayoutError::PinnedMoved { node: node.clone(), base, at }.into());
            }
            let Some(span) = pin.span else { continue };
            let end = slots().map(|n| n.start.saturating_add(n.span)).max().unwrap_or(base);
            if end > base.saturating_add(span) {
                return Err(LayoutError::PinnedOutside { node: node.clone(), base, span, end }.into());
            }
        }
        let mut st = (*self.state).clone();
        st.config = config;
        st.generation += 1;
        st.validate()?;
        let generation = st.generation;
        self.state = Arc::new(st);
        if !self.held {
            self.current.store(Arc::new(Snapshot::build(self.state.clone())));
        }
        Ok(Change { generation, ..Change::default() })
    }
}
