//! The global fabric address map (GFA): every byte of device memory in a domain gets one
//! stable place in one address space of at least 57 significant bits.
//!
//! - [`layout`] is the placement algorithm: a pure function of (previous state, inventory),
//!   stable by resource identity, deterministic across nodes.
//! - [`interleave`] has the CXL HDM interleave arithmetic (ways 1..16 incl. 3/6/12).
//! - [`snapshot`] and [`partition`] translate GFA <-> (resource, offset) without locks.
//! - [`map`] is the writer that publishes snapshots; [`persist`] the state file, in the
//!   checksummed frame and whole-file write of [`durable`].
//! - [`mod@bench`] has the benchmarks the CLI exposes.
//!
//! See docs/addrmap.md for the layout rules, the file format and the recovery procedure.

pub mod alloc;
pub mod bench;
pub mod config;
pub mod durable;
pub mod interleave;
pub mod layout;
pub mod listing;
pub mod map;
pub mod partition;
pub mod persist;
pub mod snapshot;
pub mod state;
pub mod sync;
mod sys;

pub use config::{DeviceOverride, GIB, MapConfig, NodeOverride, NodeSpan, TIB};
pub use interleave::{Geometry, InterleaveError};
pub use layout::{Change, GcFilter, LayoutError, RangeChange, Unplaced};
pub use listing::{Listing, NodeUsage, RangeInfo, RangeKind};
pub use map::{AddressMap, CachedReader, MapError, Reader, RebuildFrom, Rebuilt};
pub use partition::PartitionView;
pub use persist::{DecodeError, PersistError, decode_state, encode_state};
pub use snapshot::{HoleOwner, Location, ResourceRef, SetRef, Snapshot, TranslateError};
pub use state::{
    FABRIC_NODE, InterleaveSet, MAX_GENERATION, NodeSlot, Partition, Placement, Presence, ResourceKey, State,
};
pub use sync::{
    InventorySync, REGION_SET_PREFIX, RegionSet, SetSync, SyncScope, Synced, open_synced, region_sets, sync_inventory,
    sync_sets,
};
