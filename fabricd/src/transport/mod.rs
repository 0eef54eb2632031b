//! The transport layer: the client socket and what arrives on it — accept and client slots
//! ([`admission`]), a connection's identity fixed at accept ([`peer`]), frames read through
//! proto's decoder ([`inbox`]), the request loop, hello and drain ([`server`]), the socket
//! file ([`socket`]) — and the loopback metrics endpoint ([`http`]). Wire types and Unix
//! credentials end here: below it, requests are operations of a principal ([`crate::ops`]).

pub mod admission;
pub mod http;
pub mod inbox;
pub mod peer;
pub mod server;
pub mod socket;
