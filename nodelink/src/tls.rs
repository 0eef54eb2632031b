//! TLS for the node link (rustls, ring): the server requires a client certificate chained
//! to the domain CA; the client verifies the server's chain against the same CA and that
//! its certificate names the expected node. TLS 1.3 only. A peer's identity is read from
//! its certificate after the handshake ([`peer_identity`]), never from what it says.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::verify_server_cert_signed_by_trust_anchor;
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

use crate::certs::Pem;
use crate::identity::{IdentityError, NodeIdentity};

/// Why TLS cannot be set up, or a peer's identity not read.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file holds no certificate or key of the right kind.
    #[error("{what}: {why}")]
    Pem {
        /// Which.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The client certificate verifier could not be built (an empty CA).
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    /// The server name sent for a node is refused by TLS (cannot happen: see
    /// [`server_name`]).
    #[error("server name {0:?}")]
    ServerName(String),
    /// This node's own certificate names no node.
    #[error("this node's certificate: {0}")]
    OwnIdentity(IdentityError),
}

/// What a node needs for its links: the domain CA, its certificate chain and key, and the
/// identity its certificate states.
#[derive(Clone)]
pub struct Credentials {
    provider: Arc<CryptoProvider>,
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    identity: NodeIdentity,
}

impl fmt::Debug for Credentials {
    /// Never the key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials").field("identity", &self.identity).finish_non_exhaustive()
    }
}

impl Credentials {
    /// From the domain CA's certificate (PEM) and this node's certificate and key.
    pub fn from_pem(ca_cert: &str, node: &Pem) -> Result<Self, TlsError> {
        let pem_err = |what| move |e: rustls::pki_types::pem::Error| TlsError::Pem { what, why: e.to_string() };
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_cert.as_bytes()) {
            roots.add(cert.map_err(pem_err("CA certificate"))?)?;
        }
        let chain = CertificateDer::pem_slice_iter(node.cert.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(pem_err("node certificate"))?;
        let first = chain.first().ok_or(TlsError::Pem { what: "node certificate", why: "no certificate".into() })?;
        let identity = NodeIdentity::from_certificate(first).map_err(TlsError::OwnIdentity)?;
        let key = PrivateKeyDer::from_pem_slice(node.key.as_bytes()).map_err(pem_err("node key"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Ok(Self { provider, roots: Arc::new(roots), chain, key: Arc::new(key), identity })
    }

    /// The identity this node's certificate states.
    pub fn identity(&self) -> &NodeIdentity {
        &self.identity
    }

    /// A server configuration: a client certificate chained to the domain CA is required.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), self.provider.clone()).build()?;
        let config = ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())?;
        Ok(Arc::new(config))
    }

    /// A client configuration that accepts only a server whose certificate, chained to the
    /// domain CA, names `expected`.
    pub fn client_config(&self, expected: &NodeIdentity) -> Result<Arc<ClientConfig>, TlsError> {
        let verifier =
            NodeVerifier { provider: self.provider.clone(), roots: self.roots.clone(), expected: expected.clone() };
        let config = ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())?;
        Ok(Arc::new(config))
    }
}

/// The server name a client sends for `node`: its name, where that is a name TLS takes; a
/// node name TLS refuses as a host name (all digits, `0x1f`: it could be taken for an IPv4
/// address) is sent as [`OTHER_NODE`]. The server ignores it; the check that matters is
/// the verifier's, which checks that the certificate names `node`.
pub fn server_name(node: &NodeIdentity) -> Result<ServerName<'static>, TlsError> {
    match ServerName::try_from(node.node.clone()) {
        Ok(name @ ServerName::DnsName(_)) => Ok(name),
        _ => ServerName::try_from(OTHER_NODE).map_err(|_| TlsError::ServerName(OTHER_NODE.to_owned())),
    }
}

/// What a client sends as the server name of a node whose name TLS does not take.
pub const OTHER_NODE: &str = "node.fabric.invalid";

/// The identity the peer's certificate of a finished handshake states.
pub fn peer_identity(certs: Option<&[CertificateDer<'_>]>) -> Result<NodeIdentity, IdentityError> {
    let first = certs.and_then(|c| c.first()).ok_or(IdentityError::Missing)?;
    NodeIdentity::from_certificate(first)
}

/// Verifies a server: its chain against the domain CA (webpki, server authentication), then
/// that its certificate names the expected node of the expected domain.
#[derive(Debug)]
struct NodeVerifier {
    provider: Arc<CryptoProvider>,
    roots: Arc<RootCertStore>,
    expected: NodeIdentity,
}

impl ServerCertVerifier for NodeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        let algs = self.provider.signature_verification_algorithms.all;
        verify_server_cert_signed_by_trust_anchor(&cert, &self.roots, intermediates, now, algs)?;
        match NodeIdentity::from_certificate(end_entity) {
            Ok(id) if id == self.expected => Ok(ServerCertVerified::assertion()),
            _ => Err(rustls::Error::InvalidCertificate(CertificateError::NotValidForName)),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}
