//! `fabricd`, the privileged fabric daemon: discovery, the global address map, memory
//! brokering, authorization and the journal.
//!
//! This crate is reserved by the workspace layout and is filled by the daemon issue
//! (Unix-socket server, protocol, sessions, journal). Until then it holds no code: the
//! discovery and topology it will serve already live in `fabric-drivers` and
//! `fabric-topology`, and `fabricctl` reads them directly.
