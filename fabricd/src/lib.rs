//! `fabricd`, the privileged fabric daemon: discovery, the global address map, memory
//! brokering, authorization and the journal.
//!
//! Built so far, as groundwork for the daemon issue:
//! - [`config`]: the configuration, documented key by key in `configs/fabricd.toml`;
//! - [`journal`]: the durable journal — append-only, checksummed segments, fsync before
//!   acknowledging, compaction, crash recovery (`docs/journal.md`).
//!
//! The socket server, sessions, memory brokering and monitoring arrive with the rest of the
//! daemon issue; until then there is no `fabricd` binary, and `fabricctl` reads discovery
//! and the address map directly.

pub mod config;
pub mod journal;
mod sys;
