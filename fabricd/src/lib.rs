//! `fabricd`, the privileged fabric daemon: discovery, the global address map, memory
//! brokering, authorization and the journal.
//!
//! Built so far: the configuration ([`config`], documented key by key in
//! `configs/fabricd.toml`). The socket server, sessions, memory brokering and monitoring
//! arrive with the rest of the daemon issue; until then there is no `fabricd` binary, and
//! `fabricctl` reads discovery and the address map directly.

pub mod config;
mod sys;
