//! The domain: several fabricd nodes joined through etcd into one fabric address space.
//!
//! This crate is the first step (see `docs/domain.md`): the `[domain]` configuration
//! ([`config`]), the etcd key layout and strict record encoding ([`records`]), and a thin
//! etcd client ([`etcd`]) with the node's lease ([`lease`]), slot claims by compare-and-swap
//! (`slots.rs`), shares of memory several hosts reach ([`shares`]) and member join, writes fenced by the node's membership ([`fence`]), the
//! domain's leader ([`election`]) and [`view`]: the domain as one node sees it, built from
//! those records, with [`topology`] records merged into one fabric by [`domain_fabric`];
//! records a newer node wrote are read by [`tolerant`]'s rules.
//! [`testing`] starts a private etcd for tests, and network namespaces for
//! fault tests. fabricd joins through it (`fabricd/src/tasks/domain/`).

pub mod config;
pub mod domain_fabric;
pub mod duties;
pub mod election;
pub mod etcd;
pub mod fence;
pub mod lease;
mod nearby;
pub mod partition;
pub mod records;
pub mod shares;
mod slots;
pub mod testing;
pub mod tolerant;
pub mod topology;
pub mod view;

pub use config::{ConfigError, DEFAULT_DATA_PATHS, DomainConfig, EtcdTls};
pub use duties::{GcRequest, LeaderFence};
pub use election::{Election, Leadership};
pub use etcd::{DomainClient, EtcdError, MemberList, fresh_incarnation};
/// The etcd client crate, for callers that read or watch on [`DomainClient::raw`] under
/// [`DomainClient::call`].
pub use etcd_client;
pub use fence::Fence;
pub use lease::{Lease, LeaseState};
pub use partition::PartitionRecord;
pub use records::{
    DataPathKind, DomainSettings, FabricGroup, Keys, MemberRecord, PlacedKind, PlacedRange, PlacementsRecord,
    RecordError, RecordLimits, SlotClaim,
};
pub use shares::{Share, ShareTable, ShareWant};
pub use slots::MAX_CLAIM_ATTEMPTS;
pub use topology::TopologyRecord;
pub use view::{DomainLocation, DomainView, NodeEntry};
