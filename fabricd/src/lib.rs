//! `fabricd`, the privileged fabric daemon: discovery, the global address map, memory
//! brokering, authorization and the journal (`docs/fabricd.md` is exact about what it
//! serves). Its modules, in layers, from the socket down:
//!
//! - [`transport`]: the Unix socket ([`run`]), client slots, a connection's identity fixed
//!   at accept, frames through proto's decoder, hello; the metrics endpoint. Wire types
//!   and Unix credentials stop here.
//! - [`ops`]: each request made one typed operation of a principal and applied by the one
//!   dispatch (`ops::dispatch`: one authorization point, one error mapping, one refusal
//!   log), and the read-only answers (status, topology, map, translate, partitions).
//! - [`memory`]: the registry of regions, exports, imports and registrations as a ledger
//!   (reservation under a short lock, slow work outside it, group-committed journal
//!   records, revocations as effects); [`dma`]: IOVAs and pinned memory; [`copy`]: the
//!   copy engine; [`journal`]: the durable log (`docs/journal.md`).
//! - [`daemon`]: start-up and the state every connection shares; [`store`]: the map
//!   record (address map and partition bindings saved as one before either is published);
//!   [`partitions`], [`placement`], [`nodeid`], [`events`], [`metrics`], [`config`].
//! - [`peer`]: the node link's two sides in a domain — asking another node for an import or
//!   a copy of its memory (`peer::importer`, `peer::copy`, on blocking links from the
//!   request's thread: `peer::direct`), and answering such asks for this node's memory
//!   (`peer::owner`), with what a departed or restarted node held voided.
//! - [`tasks`]: background work — the domain's membership and etcd (`tasks::domain`),
//!   rescans on timers and uevents, the resume grace period, region-file size checks.
//! - [`sys`]: private files and directories, open-file budget, `sd_notify`, raw syscalls.

pub mod config;
pub mod copy;
pub mod daemon;
pub mod dma;
pub mod events;
pub mod journal;
pub mod memory;
pub mod metrics;
pub mod nodeid;
pub mod ops;
pub mod partitions;
pub mod peer;
pub mod placement;
pub mod store;
pub mod sys;
pub mod tasks;
pub mod transport;

pub use daemon::{Daemon, StartError};
pub use transport::server::{ServeError, run};

/// An error with its sources, `: `-separated, for one-line log messages.
pub use fabric_topology::error_chain;
