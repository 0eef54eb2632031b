//! `fabricd`, the privileged fabric daemon: discovery, the global address map, memory
//! brokering, authorization and the journal.
//!
//! So far the crate holds the daemon's durable journal ([`journal`]: append-only,
//! checksummed segments, fsync before acknowledging, compaction, crash recovery; see
//! docs/journal.md). The daemon itself (Unix-socket server, protocol, sessions, registry)
//! is still to come with the daemon issue; until then the discovery and topology it will
//! serve live in `fabric-drivers` and `fabric-topology`, and `fabricctl` reads them
//! directly.

pub mod journal;
