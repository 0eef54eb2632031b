//! Background tasks: rescans, periodic and on kernel uevents ([`monitor`], [`uevent`]), the
//! resume grace period of sessions found in the journal ([`grace`]), and the periodic check
//! that region files keep their size ([`sizewatch`]); and a domain node's join, watch and
//! placements ([`domain`], on a runtime of its own). Each runs on the daemon's runtime
//! until shutdown and reaches the state only through [`crate::Daemon`].

pub mod domain;
pub mod grace;
pub mod monitor;
pub mod sizewatch;
pub mod uevent;
