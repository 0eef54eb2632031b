//! `fabricd`, the privileged fabric daemon: discovery, the global address map, memory
//! brokering, authorization and the journal.
//!
//! What this crate serves today (`docs/fabricd.md` is exact about it):
//! - [`config`]: the configuration, documented key by key in `configs/fabricd.toml`;
//! - [`daemon`]: start-up — discovery, the fabric, the address map in the state dir and
//!   the journal's lock — and the state every connection shares;
//! - [`server`]: the Unix socket server ([`run`]): hello negotiation, then each request
//!   made an operation ([`ops`]) and applied by the one dispatch ([`dispatch`]: one
//!   authorization point, every refusal a typed error and a log line) — status,
//!   topology, devices, map, translate and partitions, and alloc, free, export, revoke,
//!   import and release ([`memops`] over [`memory`], regions passed as descriptors);
//! - [`principal`]: who a request comes from, computed once per connection;
//! - [`admission`]: client slots at accept, for all users and per uid;
//! - [`socket`], [`notify`], [`auth`]: the socket file, `sd_notify`, the admin check;
//! - [`peer`]: a connection's identity, fixed at accept (credentials, groups, a pidfd);
//! - [`partitions`], [`scope`], [`regions`]: who each partition binds, what each client
//!   sees through its partitions, and the partition operations;
//! - [`store`]: the map record (address map state and bindings, saved as one before
//!   either is published) behind the `MapStore` trait, and its file store;
//! - [`metrics`], [`http`]: the Prometheus page and its loopback HTTP endpoint;
//!   [`refusals`]: the rate-limited refusal log;
//! - [`journal`]: the durable journal (`docs/journal.md`).
//!
//! - [`events`]: subscriptions (`Subscribe` on a connection) with bounded queues, and
//!   revocation events to importers; [`monitor`]: rescans (periodic, and on kernel
//!   [`uevent`]s), their device, link and map events, lost devices' revocations and CXL
//!   interleave sets rebuilt.
//!
//! - [`memory`] is durable: regions and exports are journaled before they are
//!   acknowledged and survive a daemon restart; [`grace`] reclaims sessions that do not
//!   come back.
//!
//! - [`dma`], [`dmaops`]: DMA registration (register/unregister): IOVAs per DMA domain
//!   below each device's mask, pinned memory, and the copy path's lookup;
//!   [`placement`]: region GFAs and interleave-set allocation.
//!
//! - [`copy`], [`copyops`]: the copy engine (`Copy`): engine threads that move bytes
//!   between registrations and GFAs, completions sent to the issuing connection.

pub mod admission;
pub mod auth;
pub mod config;
pub mod copy;
pub mod copyops;
pub mod daemon;
pub mod dispatch;
pub mod dma;
pub mod dmaops;
pub mod events;
pub mod fdbudget;
pub mod grace;
pub mod http;
pub mod inbox;
pub mod journal;
pub mod memops;
pub mod memory;
pub mod metrics;
pub mod monitor;
pub mod nodeid;
pub mod notify;
pub mod ops;
pub mod partitions;
pub mod peer;
pub mod placement;
pub mod principal;
pub mod privdir;
pub mod refusals;
pub mod regions;
pub mod scope;
pub mod server;
pub mod sizewatch;
pub mod socket;
pub mod store;
pub(crate) mod sys;
pub mod uevent;

pub use daemon::{Daemon, StartError};
pub use server::{ServeError, run};

/// An error with its sources, `: `-separated, for one-line log messages.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}
