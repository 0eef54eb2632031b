//! The node-to-node link of a domain: TCP between fabricd nodes, mutually authenticated
//! TLS with certificates from the domain's CA that name their node, framed like the Unix
//! socket. Not wired into fabricd yet (docs/domain.md, "Node link").

pub mod certs;
pub mod identity;

pub use certs::{CertError, DomainCa, Pem, PemFiles, San, create_ca, create_node};
pub use identity::{IdentityError, NodeIdentity};
