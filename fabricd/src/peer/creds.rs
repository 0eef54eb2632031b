//! The node link's credentials from `[peer]`'s files: the domain CA, this node's
//! certificate and key. The certificate must name this node of this domain — a node that
//! would present another's identity is refused at start, not at its first link.

use std::path::{Path, PathBuf};

use fabric_nodelink::{Credentials, NodeIdentity, Pem, TlsError};

/// The most bytes read from one credentials file (a chain of a few certificates).
const MAX_FILE_LEN: u64 = 64 * 1024;

/// Why the node link's credentials cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// A file could not be read (or is over 64 KiB).
    #[error("reading {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The files hold no usable CA, certificate or key.
    #[error("the node link's credentials")]
    Tls(#[source] TlsError),
    /// The certificate names another node or domain than `[domain]`.
    #[error("the certificate names {certified}, but this is {configured}")]
    Identity {
        /// What the certificate names.
        certified: String,
        /// What `[domain]` says.
        configured: String,
    },
}

/// Reads the credentials and checks that they name `node` of `domain`.
pub fn load(ca: &Path, cert: &Path, key: &Path, domain: &str, node: &str) -> Result<Credentials, CredentialsError> {
    let creds = Credentials::from_pem(&read(ca)?, &Pem { cert: read(cert)?, key: read(key)? })
        .map_err(CredentialsError::Tls)?;
    let certified = creds.identity();
    if certified.domain != domain || certified.node != node {
        let configured = NodeIdentity { domain: domain.to_owned(), node: node.to_owned() };
        return Err(CredentialsError::Identity { certified: certified.uri(), configured: configured.uri() });
    }
    Ok(creds)
}

fn read(path: &Path) -> Result<String, CredentialsError> {
    use std::io::Read;
    let err = |source| CredentialsError::Read { path: path.to_owned(), source };
    let mut text = String::new();
    std::fs::File::open(path).and_then(|f| f.take(MAX_FILE_LEN + 1).read_to_string(&mut text)).map_err(err)?;
    if text.len() as u64 > MAX_FILE_LEN {
        return Err(err(std::io::Error::other(format!("over {MAX_FILE_LEN} bytes"))));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use fabric_nodelink::DomainCa;

    use super::*;

    #[test]
    fn a_certificate_of_another_node_or_domain_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ca = DomainCa::generate("lab").unwrap();
        let node = ca.issue("n1", &[]).unwrap();
        let p = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let (c, n, k) = (p("ca.pem", &ca.pem().cert), p("n1.pem", &node.cert), p("n1.key", &node.key));
        assert_eq!(load(&c, &n, &k, "lab", "n1").unwrap().identity().node, "n1");
        let e = load(&c, &n, &k, "lab", "n2").unwrap_err().to_string();
        assert!(e.contains("fabric://lab/node/n1") && e.contains("fabric://lab/node/n2"), "{e}");
        assert!(matches!(load(&c, &n, &k, "other", "n1"), Err(CredentialsError::Identity { .. })));
        assert!(matches!(load(&c, &n, &c, "lab", "n1"), Err(CredentialsError::Tls(_))));
        assert!(matches!(load(&dir.path().join("none"), &n, &k, "lab", "n1"), Err(CredentialsError::Read { .. })));
    }
}
