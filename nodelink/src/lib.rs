//! The node-to-node link of a domain: TCP between fabricd nodes, mutually authenticated
//! TLS with certificates from the domain's CA that name their node, framed like the Unix
//! socket. fabricd listens and dials with it (`fabricd/src/peer/`; docs/domain.md, "Node
//! link").

mod admitting;
pub mod certs;
pub mod identity;

pub use certs::{CertError, DomainCa, Pem, PemFiles, San, create_ca, create_node};
pub use identity::{IdentityError, NodeIdentity};
pub mod message;

pub use message::{
    HELLO_DECODER, Hello, MessageError, PEER_DECODER, PEER_PROTOCOL, PEER_PROTOCOL_MIN, PeerError, PeerFailure,
    PeerMessage, PeerOp, PeerRequest, PeerResponse, Refusal, Welcome,
};
pub mod tls;

pub use tls::{Credentials, TlsError};
pub mod blocking;
pub mod error;
pub mod framed;
pub mod link;

pub use blocking::BlockingLink;
pub use error::{LinkError, Stage};
pub use link::{Link, LinkLimits, LinkStats, Peer, PeerPolicy, PeerService, Served, Server, Unserved};
