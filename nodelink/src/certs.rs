//! The domain's certificates: a self-signed domain CA, and node certificates it signs whose
//! identity is the URI SAN `fabric://<domain>/node/<name>` ([`NodeIdentity`]), plus the
//! node's DNS names and addresses. Keys are PEM files only their owner may read (0600).

use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::identity::{IdentityError, NodeIdentity, check_name};

/// How long a domain CA is valid.
pub const CA_VALIDITY: Duration = Duration::days(10 * 365);
/// How long a node certificate is valid.
pub const NODE_VALIDITY: Duration = Duration::days(365);
/// How far back validity starts, for clocks a little behind.
const BACKDATE: Duration = Duration::hours(1);
/// The most extra names on a node certificate.
pub const MAX_SANS: usize = 16;

/// Why certificates are not made or read.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// A domain or node name is refused.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// An extra name is neither an address nor a host name.
    #[error("{0:?} is neither an IP address nor a host name")]
    San(String),
    /// More extra names than [`MAX_SANS`].
    #[error("at most {MAX_SANS} extra names")]
    TooManySans,
    /// rcgen refused to make or sign a certificate.
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    /// A file exists where one would be written; nothing is overwritten.
    #[error("{} exists; remove it first to make a new one", .0.display())]
    Exists(PathBuf),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The CA files do not hold this domain's CA (another domain's, or a key that is not
    /// the certificate's).
    #[error("{} is not the CA of domain {domain:?} with the key beside it: {why}", path.display())]
    NotThisCa {
        /// The CA certificate.
        path: PathBuf,
        /// The domain asked for.
        domain: String,
        /// What did not match.
        why: String,
    },
}

/// An extra subject alternative name of a node certificate: how others may address it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum San {
    /// A host name.
    Dns(String),
    /// An address.
    Ip(IpAddr),
}

impl FromStr for San {
    type Err = CertError;
    fn from_str(s: &str) -> Result<Self, CertError> {
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(San::Ip(ip));
        }
        let host = !s.is_empty()
            && s.len() <= 253
            && s.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        if host { Ok(San::Dns(s.to_ascii_lowercase())) } else { Err(CertError::San(s.chars().take(64).collect())) }
    }
}

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub struct Pem {
    /// The certificate.
    pub cert: String,
    /// The private key (PKCS#8).
    pub key: String,
}

impl fmt::Debug for Pem {
    /// Never the key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pem").field("cert_len", &self.cert.len()).finish_non_exhaustive()
    }
}

/// A domain's CA, able to sign node certificates.
#[derive(Debug)]
pub struct DomainCa {
    domain: String,
    pem: Pem,
}

fn ca_params(domain: &str, now: OffsetDateTime) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, format!("fabric domain {domain} CA"));
    params.distinguished_name.push(DnType::OrganizationName, "fabric");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = now - BACKDATE;
    params.not_after = now + CA_VALIDITY;
    params
}

impl DomainCa {
    /// A new CA for `domain` (ECDSA P-256).
    pub fn generate(domain: &str) -> Result<Self, CertError> {
        check_name("domain", domain)?;
        let key = KeyPair::generate()?;
        let cert = ca_params(domain, OffsetDateTime::now_utc()).self_signed(&key)?;
        Ok(Self { domain: domain.to_owned(), pem: Pem { cert: cert.pem(), key: key.serialize_pem() } })
    }

    /// The CA of `domain` from its PEM certificate and key; refused unless the key is the
    /// certificate's and the certificate is this domain's CA.
    pub fn from_pem(domain: &str, pem: Pem, path: &Path) -> Result<Self, CertError> {
        check_name("domain", domain)?;
        let not_this = |why: String| CertError::NotThisCa { path: path.to_owned(), domain: domain.to_owned(), why };
        let key = KeyPair::from_pem(&pem.key).map_err(|e| not_this(format!("key: {e}")))?;
        let params =
            CertificateParams::from_ca_cert_pem(&pem.cert).map_err(|e| not_this(format!("certificate: {e}")))?;
        let want = ca_params(domain, OffsetDateTime::now_utc()).distinguished_name;
        if params.distinguished_name.get(&DnType::CommonName) != want.get(&DnType::CommonName) {
            return Err(not_this("another domain's CA".into()));
        }
        let der = pem_der(&pem.cert).map_err(|e| not_this(e.to_string()))?;
        let (_, cert) = X509Certificate::from_der(&der).map_err(|e| not_this(e.to_string()))?;
        if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(not_this("the key is not the certificate's".into()));
        }
        Ok(Self { domain: domain.to_owned(), pem })
    }

    /// The domain.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The CA certificate and key.
    pub fn pem(&self) -> &Pem {
        &self.pem
    }

    /// A certificate for `node` of this domain, for both ends of a link (server and client
    /// authentication), with its own new key.
    pub fn issue(&self, node: &str, sans: &[San]) -> Result<Pem, CertError> {
        let id = NodeIdentity::new(&self.domain, node)?;
        if sans.len() > MAX_SANS {
            return Err(CertError::TooManySans);
        }
        let ca_key = KeyPair::from_pem(&self.pem.key)?;
        let issuer = CertificateParams::from_ca_cert_pem(&self.pem.cert)?.self_signed(&ca_key)?;
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, format!("fabric node {node} of {}", self.domain));
        params.subject_alt_names.push(SanType::URI(id.uri().try_into()?));
        for san in sans {
            params.subject_alt_names.push(match san {
                San::Dns(name) => SanType::DnsName(name.clone().try_into()?),
                San::Ip(ip) => SanType::IpAddress(*ip),
            });
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - BACKDATE;
        params.not_after = now + NODE_VALIDITY;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer, &ca_key)?;
        Ok(Pem { cert: cert.pem(), key: key.serialize_pem() })
    }
}

/// The DER of the first PEM block.
fn pem_der(pem: &str) -> Result<Vec<u8>, rustls_pki_types::pem::Error> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes()).map(|c| c.to_vec())
}

/// The files of a CA or node in a directory: `<stem>.pem` and `<stem>.key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PemFiles {
    /// The certificate.
    pub cert: PathBuf,
    /// The private key (mode 0600).
    pub key: PathBuf,
}

impl PemFiles {
    /// The files of the domain CA in `dir`: `ca.pem`, `ca.key`.
    pub fn ca(dir: &Path) -> Self {
        Self::named(dir, "ca")
    }

    /// The files of `node` in `dir`: `<node>.pem`, `<node>.key`.
    pub fn node(dir: &Path, node: &str) -> Self {
        Self::named(dir, node)
    }

    fn named(dir: &Path, stem: &str) -> Self {
        Self { cert: dir.join(format!("{stem}.pem")), key: dir.join(format!("{stem}.key")) }
    }

    /// Reads both files.
    pub fn read(&self) -> Result<Pem, CertError> {
        let read = |p: &Path| fs::read_to_string(p).map_err(|source| CertError::Io { path: p.to_owned(), source });
        Ok(Pem { cert: read(&self.cert)?, key: read(&self.key)? })
    }

    /// Writes both files, the key first and 0600 from its creation; refuses to overwrite.
    pub fn write(&self, pem: &Pem) -> Result<(), CertError> {
        for path in [&self.cert, &self.key] {
            if path.exists() {
                return Err(CertError::Exists(path.clone()));
            }
        }
        write_new(&self.key, pem.key.as_bytes(), 0o600)?;
        write_new(&self.cert, pem.cert.as_bytes(), 0o644)
    }
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CertError> {
    let io = |source| CertError::Io { path: path.to_owned(), source };
    let mut file = OpenOptions::new().write(true).create_new(true).mode(mode).open(path).map_err(|e| {
        if e.kind() == io::ErrorKind::AlreadyExists { CertError::Exists(path.to_owned()) } else { io(e) }
    })?;
    file.write_all(bytes).map_err(io)?;
    file.sync_all().map_err(io)
}

/// Makes the CA of `domain` in `dir` (`ca.pem`, `ca.key`), creating `dir` (0700) if needed.
pub fn create_ca(dir: &Path, domain: &str) -> Result<PemFiles, CertError> {
    let ca = DomainCa::generate(domain)?;
    make_dir(dir)?;
    let files = PemFiles::ca(dir);
    files.write(ca.pem())?;
    Ok(files)
}

/// Makes the certificate of `node` in `dir` (`<node>.pem`, `<node>.key`), signed by the
/// domain CA found there.
pub fn create_node(dir: &Path, domain: &str, node: &str, sans: &[San]) -> Result<PemFiles, CertError> {
    check_name("node", node)?;
    let ca_files = PemFiles::ca(dir);
    let ca = DomainCa::from_pem(domain, ca_files.read()?, &ca_files.cert)?;
    let pem = ca.issue(node, sans)?;
    let files = PemFiles::node(dir, node);
    files.write(&pem)?;
    Ok(files)
}

fn make_dir(dir: &Path) -> Result<(), CertError> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| CertError::Io { path: dir.to_owned(), source })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn node_certificate_names_its_node_and_keys_are_private() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = create_ca(dir.path(), "lab").expect("ca");
        let sans = ["10.0.0.1".parse().expect("ip"), "n1.example".parse().expect("dns")];
        let node = create_node(dir.path(), "lab", "n1", &sans).expect("node");
        for key in [&ca.key, &node.key] {
            let mode = fs::metadata(key).expect("key").permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", key.display());
        }
        let der = pem_der(&node.read().expect("read").cert).expect("der");
        assert_eq!(NodeIdentity::from_certificate(&der), Ok(NodeIdentity::new("lab", "n1").expect("id")));
        assert!(matches!(create_node(dir.path(), "lab", "n1", &[]), Err(CertError::Exists(_))));
        assert!(matches!(create_node(dir.path(), "other", "n2", &[]), Err(CertError::NotThisCa { .. })));
        assert!(matches!(create_node(dir.path(), "lab", "N2", &[]), Err(CertError::Identity(_))));
        assert!("not a name!".parse::<San>().is_err());
    }

    #[test]
    fn a_key_that_is_not_the_certificates_is_refused() {
        let a = DomainCa::generate("lab").expect("a");
        let b = DomainCa::generate("lab").expect("b");
        let mixed = Pem { cert: a.pem().cert.clone(), key: b.pem().key.clone() };
        assert!(matches!(DomainCa::from_pem("lab", mixed, Path::new("ca.pem")), Err(CertError::NotThisCa { .. })));
    }
}
