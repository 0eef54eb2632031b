//! A node's identity as its certificate states it: the URI subject alternative name
//! `fabric://<domain>/node/<name>`, read from the certificate and from nothing else.

use std::fmt;

use fabric_domain::config::is_valid_name;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// The scheme of an identity URI.
const SCHEME: &str = "fabric://";

/// One node of one domain, as a certificate names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeIdentity {
    /// The domain's name.
    pub domain: String,
    /// The node's name within it.
    pub node: String,
}

/// Why a name or a certificate does not give a node identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// A domain or node name outside the domain's naming rule (1–63 of `[a-z0-9-]`, no `-`
    /// at either end).
    #[error("{what} name {value:?} is not 1-63 of [a-z0-9-] without a '-' at either end")]
    Name {
        /// `domain` or `node`.
        what: &'static str,
        /// The name (cut to 64 characters).
        value: String,
    },
    /// The certificate does not parse as X.509.
    #[error("the certificate does not parse: {0}")]
    Certificate(String),
    /// The certificate names no node.
    #[error("the certificate names no node (no fabric:// URI subject alternative name)")]
    Missing,
    /// The certificate names more than one node, or a `fabric://` URI that is no node's.
    #[error("the certificate's fabric:// names are ambiguous or malformed: {0:?}")]
    Malformed(String),
}

impl NodeIdentity {
    /// An identity from checked names.
    pub fn new(domain: &str, node: &str) -> Result<Self, IdentityError> {
        check_name("domain", domain)?;
        check_name("node", node)?;
        Ok(Self { domain: domain.to_owned(), node: node.to_owned() })
    }

    /// The URI a certificate carries: `fabric://<domain>/node/<name>`.
    pub fn uri(&self) -> String {
        format!("{SCHEME}{}/node/{}", self.domain, self.node)
    }

    /// Parses [`NodeIdentity::uri`]'s form, and nothing looser.
    pub fn from_uri(uri: &str) -> Result<Self, IdentityError> {
        let malformed = || IdentityError::Malformed(shown(uri));
        let rest = uri.strip_prefix(SCHEME).ok_or_else(malformed)?;
        let (domain, node) = rest.split_once("/node/").ok_or_else(malformed)?;
        Self::new(domain, node).map_err(|_| malformed())
    }

    /// The identity a certificate (DER) states: exactly one `fabric://` URI SAN, naming a
    /// node. Other SANs (the node's DNS names and addresses) are ignored here.
    pub fn from_certificate(der: &[u8]) -> Result<Self, IdentityError> {
        let (_, cert) = X509Certificate::from_der(der).map_err(|e| IdentityError::Certificate(e.to_string()))?;
        let san = cert.subject_alternative_name().map_err(|e| IdentityError::Certificate(e.to_string()))?;
        let mut found = None;
        for name in san.iter().flat_map(|ext| ext.value.general_names.iter()) {
            let GeneralName::URI(uri) = name else { continue };
            if !uri.starts_with(SCHEME) {
                continue;
            }
            if found.is_some() {
                return Err(IdentityError::Malformed(shown(uri)));
            }
            found = Some(Self::from_uri(uri)?);
        }
        found.ok_or(IdentityError::Missing)
    }
}

impl fmt::Display for NodeIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.domain, self.node)
    }
}

/// Checks a domain or node name against the domain's rule.
pub fn check_name(what: &'static str, value: &str) -> Result<(), IdentityError> {
    if is_valid_name(value) { Ok(()) } else { Err(IdentityError::Name { what, value: shown(value) }) }
}

/// At most 64 characters of untrusted text, for an error.
fn shown(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_round_trips_and_refuses_looser_forms() {
        let id = NodeIdentity::new("lab", "node-1").expect("valid");
        assert_eq!(id.uri(), "fabric://lab/node/node-1");
        assert_eq!(NodeIdentity::from_uri(&id.uri()), Ok(id));
        for bad in [
            "fabric://lab/node/",
            "fabric://lab/node/a/b",
            "fabric://Lab/node/a",
            "https://lab/node/a",
            "fabric://lab/nodes/a",
            "fabric:///node/a",
        ] {
            assert!(NodeIdentity::from_uri(bad).is_err(), "{bad}");
        }
    }
}
