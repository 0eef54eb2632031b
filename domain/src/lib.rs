//! The domain: several fabricd nodes joined through etcd into one fabric address space.
//!
//! This crate is the first step (see `docs/domain.md`): the `[domain]` configuration
//! ([`config`]), the etcd key layout and strict record encoding ([`records`]), and a thin
//! etcd client ([`etcd`]) with the node's lease ([`lease`]), slot claims by compare-and-swap
//! (`slots.rs`) and member join, writes fenced by the node's membership ([`fence`]) and
//! the domain's leader ([`election`]). [`testing`] starts a private etcd for tests, and
//! network namespaces for fault tests. fabricd does not use it yet.

pub mod config;
pub mod election;
pub mod etcd;
pub mod fence;
pub mod lease;
pub mod records;
mod slots;
pub mod testing;

pub use config::{ConfigError, DomainConfig, EtcdTls};
pub use election::{Election, Leadership};
pub use etcd::{DomainClient, EtcdError, MemberList, fresh_incarnation};
pub use fence::Fence;
pub use lease::{Lease, LeaseState};
pub use records::{
    DataPathKind, DomainSettings, FabricGroup, Keys, MemberRecord, RecordError, RecordLimits, SlotClaim,
};
pub use slots::MAX_CLAIM_ATTEMPTS;
