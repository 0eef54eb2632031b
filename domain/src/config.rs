//! The `[domain]` configuration section: which domain this node joins, through which etcd
//! endpoints (and TLS files), under which node name, with which lease TTL.
//!
//! It is a serde section the daemon's configuration embeds as `[domain]` (not wired into
//! fabricd yet: without the section a daemon runs alone). [`DomainConfig::validate`] checks
//! every field strictly and answers with a typed [`ConfigError`]; the rest of this crate only
//! takes a validated configuration.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::records::DataPathKind;

/// Longest domain or node name: one DNS label.
pub const MAX_NAME_LEN: usize = 63;
/// Most etcd endpoints a configuration may list.
pub const MAX_ENDPOINTS: usize = 16;
/// Longest endpoint URL accepted.
pub const MAX_ENDPOINT_LEN: usize = 256;
/// Shortest lease TTL in seconds: etcd 3.4 refuses shorter leases (1.5 election timeouts).
pub const MIN_LEASE_TTL_SECS: u64 = 2;
/// Longest lease TTL in seconds: a dead node stays listed at most this long.
pub const MAX_LEASE_TTL_SECS: u64 = 300;
/// Default lease TTL in seconds.
pub const DEFAULT_LEASE_TTL_SECS: u64 = 6;
/// Time allowed to establish the connection to etcd.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors from validating a `[domain]` section.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A domain or node name is not a DNS-label-like name.
    #[error("{what} {value:?} is not a name of 1 to 63 lowercase letters, digits and '-' (not at either end)")]
    Name {
        /// `domain` or `node`.
        what: &'static str,
        /// The name as given (cut to a printable length).
        value: String,
    },
    /// No etcd endpoint is listed, or too many.
    #[error("endpoints: {count} listed, 1 to {MAX_ENDPOINTS} are accepted")]
    EndpointCount {
        /// How many were listed.
        count: usize,
    },
    /// An endpoint is not an `http://HOST:PORT` or `https://HOST:PORT` URL.
    #[error("endpoint {value:?}: {reason}")]
    Endpoint {
        /// The endpoint as given (cut to a printable length).
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The endpoints' schemes disagree with the TLS options.
    #[error("endpoint {value:?} is {scheme} but TLS is {tls}: https endpoints need [domain.tls], http ones refuse it")]
    TlsScheme {
        /// The endpoint.
        value: String,
        /// Its scheme.
        scheme: String,
        /// `configured` or `not configured`.
        tls: &'static str,
    },
    /// A client certificate without its key, or a key without its certificate.
    #[error("tls: cert and key must be given together")]
    TlsIdentity,
    /// The TLS server name override is not a host name.
    #[error("tls.server_name {0:?} is not a host name")]
    TlsServerName(String),
    /// The lease TTL is outside the accepted range.
    #[error("lease_ttl_secs {0} is outside {MIN_LEASE_TTL_SECS}..={MAX_LEASE_TTL_SECS}")]
    LeaseTtl(u64),
    /// `data_paths` lists none.
    #[error("data_paths lists none: name at least one of shared_file, nvlink, cxl, rdma (or leave it out)")]
    NoDataPaths,
}

/// TLS options for the connection to etcd (paths to PEM files).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdTls {
    /// CA certificate(s) that sign etcd's server certificate.
    pub ca: PathBuf,
    /// This node's client certificate, when etcd checks client certificates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    /// The key of `cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
    /// The name etcd's certificate is checked against, when it differs from the endpoint's
    /// host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

/// The `[domain]` section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DomainConfig {
    /// The domain's name: the etcd prefix `/fabric/<name>/` holds all of its keys.
    pub name: String,
    /// etcd client URLs (`http://HOST:PORT`, or `https://` with `tls`).
    pub endpoints: Vec<String>,
    /// TLS for etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<EtcdTls>,
    /// This node's name in the domain (one per live daemon).
    pub node: String,
    /// Lease TTL in seconds: a node that stops renewing is gone from the domain this long
    /// after its last renewal.
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl_secs: u64,
    /// The data paths the domain's nodes may reach each other's memory by, a domain-wide
    /// setting ([`crate::DomainSettings::data_paths`]); `None`: [`DEFAULT_DATA_PATHS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_paths: Option<Vec<DataPathKind>>,
}

/// The data paths a domain allows when its first node's configuration names none: those
/// fabricd serves between nodes (a shared sim file, CUDA fabric handles within an NVLink
/// clique, shared CXL memory). The copy over the node link needs no setting: it is always
/// there.
pub const DEFAULT_DATA_PATHS: [DataPathKind; 3] = [DataPathKind::SharedFile, DataPathKind::Nvlink, DataPathKind::Cxl];

fn default_lease_ttl() -> u64 {
    DEFAULT_LEASE_TTL_SECS
}

impl DomainConfig {
    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_name("domain", &self.name)?;
        check_name("node", &self.node)?;
        if self.endpoints.is_empty() || self.endpoints.len() > MAX_ENDPOINTS {
            return Err(ConfigError::EndpointCount { count: self.endpoints.len() });
        }
        for endpoint in &self.endpoints {
            let scheme = check_endpoint(endpoint)?;
            let https = scheme == "https";
            if https != self.tls.is_some() {
                return Err(ConfigError::TlsScheme {
                    value: shown(endpoint),
                    scheme: scheme.to_owned(),
                    tls: if self.tls.is_some() { "configured" } else { "not configured" },
                });
            }
        }
        if let Some(tls) = &self.tls {
            if tls.cert.is_some() != tls.key.is_some() {
                return Err(ConfigError::TlsIdentity);
            }
            if let Some(name) = &tls.server_name
                && !is_host_name(name)
            {
                return Err(ConfigError::TlsServerName(shown(name)));
            }
        }
        if !(MIN_LEASE_TTL_SECS..=MAX_LEASE_TTL_SECS).contains(&self.lease_ttl_secs) {
            return Err(ConfigError::LeaseTtl(self.lease_ttl_secs));
        }
        if self.data_paths.as_ref().is_some_and(Vec::is_empty) {
            return Err(ConfigError::NoDataPaths);
        }
        Ok(())
    }

    /// The data paths this node brings to the domain's settings: configured, or
    /// [`DEFAULT_DATA_PATHS`]; sorted, each once (as the settings record keeps them).
    pub fn data_paths(&self) -> Vec<DataPathKind> {
        let mut paths = self.data_paths.clone().unwrap_or_else(|| DEFAULT_DATA_PATHS.to_vec());
        paths.sort();
        paths.dedup();
        paths
    }

    /// The lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    /// How often the lease is renewed: a third of its TTL, so two renewals may fail before
    /// the lease runs out.
    pub fn keepalive_interval(&self) -> Duration {
        self.lease_ttl() / 3
    }

    /// Longest wait for one etcd request. A third of the TTL: a node learns that etcd is
    /// unreachable while its lease still has time left to fence itself.
    pub fn request_timeout(&self) -> Duration {
        self.keepalive_interval()
    }
}

/// Whether `name` is a DNS-label-like name: 1 to 63 of `[a-z0-9-]`, no `-` at either end.
pub fn is_valid_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    match (bytes.first(), bytes.last()) {
        (Some(first), Some(last)) => {
            bytes.len() <= MAX_NAME_LEN
                && *first != b'-'
                && *last != b'-'
                && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        }
        _ => false,
    }
}

fn check_name(what: &'static str, name: &str) -> Result<(), ConfigError> {
    if is_valid_name(name) { Ok(()) } else { Err(ConfigError::Name { what, value: shown(name) }) }
}

/// A host name: dot-separated labels of letters, digits and `-`, at most 253 bytes.
fn is_host_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= MAX_NAME_LEN
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Checks one endpoint and returns its scheme.
fn check_endpoint(endpoint: &str) -> Result<&'static str, ConfigError> {
    let fail = |reason: &str| ConfigError::Endpoint { value: shown(endpoint), reason: reason.to_owned() };
    if endpoint.len() > MAX_ENDPOINT_LEN {
        return Err(fail("longer than 256 bytes"));
    }
    let url = url::Url::parse(endpoint).map_err(|e| fail(&e.to_string()))?;
    let scheme = match url.scheme() {
        "http" => "http",
        "https" => "https",
        _ => return Err(fail("the scheme must be http or https")),
    };
    if url.host().is_none() {
        return Err(fail("no host"));
    }
    if url.port().is_none() {
        return Err(fail("no port (etcd has no default port in a URL)"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(fail("credentials do not belong in the URL"));
    }
    if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
        return Err(fail("a path, query or fragment is not accepted"));
    }
    Ok(scheme)
}

/// A value cut to 80 characters for an error message.
fn shown(value: &str) -> String {
    value.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DomainConfig {
        DomainConfig {
            name: "supernode".into(),
            endpoints: vec!["http://127.0.0.1:2379".into()],
            tls: None,
            node: "tray-0".into(),
            lease_ttl_secs: 6,
            data_paths: None,
        }
    }

    #[test]
    fn parses_a_section_and_defaults_the_ttl() {
        let parsed: DomainConfig =
            toml::from_str("name = \"supernode\"\nendpoints = [\"http://127.0.0.1:2379\"]\nnode = \"tray-0\"\n")
                .unwrap();
        assert_eq!(parsed, config());
        parsed.validate().unwrap();
        assert_eq!(parsed.keepalive_interval(), Duration::from_secs(2));
    }

    #[test]
    fn data_paths_default_to_what_fabricd_serves_and_are_kept_sorted_once() {
        assert_eq!(config().data_paths(), [DataPathKind::SharedFile, DataPathKind::Nvlink, DataPathKind::Cxl]);
        let parsed: DomainConfig = toml::from_str(
            "name = \"d\"\nendpoints = [\"http://127.0.0.1:2379\"]\nnode = \"n\"\ndata_paths = [\"cxl\", \"shared_file\", \"cxl\"]\n",
        )
        .unwrap();
        parsed.validate().unwrap();
        assert_eq!(parsed.data_paths(), [DataPathKind::SharedFile, DataPathKind::Cxl]);
        let none = DomainConfig { data_paths: Some(vec![]), ..config() };
        assert_eq!(none.validate(), Err(ConfigError::NoDataPaths));
        let unknown = "name = \"d\"\nendpoints = [\"http://127.0.0.1:2379\"]\nnode = \"n\"\ndata_paths = [\"ib\"]\n";
        assert!(toml::from_str::<DomainConfig>(unknown).is_err());
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = toml::from_str::<DomainConfig>(
            "name = \"d\"\nendpoints = [\"http://127.0.0.1:2379\"]\nnode = \"n\"\nlease_ttl = 6\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("lease_ttl"), "{err}");
    }

    #[test]
    fn names_are_dns_labels() {
        for good in ["a", "tray-15", "0", &"x".repeat(63)] {
            assert!(is_valid_name(good), "{good}");
        }
        for bad in ["", "-a", "a-", "Tray", "a.b", "a_b", "tray 1", "é", &"x".repeat(64)] {
            assert!(!is_valid_name(bad), "{bad}");
            let c = DomainConfig { node: bad.into(), ..config() };
            assert!(matches!(c.validate(), Err(ConfigError::Name { what: "node", .. })), "{bad}");
        }
        let c = DomainConfig { name: "A".into(), ..config() };
        assert!(matches!(c.validate(), Err(ConfigError::Name { what: "domain", .. })));
    }

    #[test]
    fn ttl_bounds() {
        for (ttl, ok) in [(1, false), (2, true), (300, true), (301, false), (0, false)] {
            let c = DomainConfig { lease_ttl_secs: ttl, ..config() };
            assert_eq!(c.validate().is_ok(), ok, "{ttl}");
        }
    }

    #[test]
    fn endpoints_are_http_urls_with_a_port() {
        for bad in [
            "127.0.0.1:2379",
            "unix:///run/etcd.sock",
            "http://127.0.0.1",
            "http://user:pw@127.0.0.1:2379",
            "http://127.0.0.1:2379/v3",
            "http://127.0.0.1:2379?x=1",
            "http://:2379",
        ] {
            let c = DomainConfig { endpoints: vec![bad.into()], ..config() };
            assert!(matches!(c.validate(), Err(ConfigError::Endpoint { .. })), "{bad}: {:?}", c.validate());
        }
        let c = DomainConfig { endpoints: vec![], ..config() };
        assert_eq!(c.validate(), Err(ConfigError::EndpointCount { count: 0 }));
        let c = DomainConfig { endpoints: vec!["http://127.0.0.1:2379".into(); 17], ..config() };
        assert_eq!(c.validate(), Err(ConfigError::EndpointCount { count: 17 }));
        let c = DomainConfig { endpoints: vec!["http://etcd-0.example:2379".into()], ..config() };
        c.validate().unwrap();
    }

    #[test]
    fn tls_matches_the_scheme_and_pairs_cert_with_key() {
        let tls = EtcdTls { ca: "/etc/fabric/ca.pem".into(), cert: None, key: None, server_name: None };
        let c = DomainConfig { tls: Some(tls.clone()), ..config() };
        assert!(matches!(c.validate(), Err(ConfigError::TlsScheme { .. })));
        let c = DomainConfig { endpoints: vec!["https://127.0.0.1:2379".into()], ..config() };
        assert!(matches!(c.validate(), Err(ConfigError::TlsScheme { .. })));
        let https = vec!["https://127.0.0.1:2379".to_owned()];
        let c = DomainConfig { endpoints: https.clone(), tls: Some(tls.clone()), ..config() };
        c.validate().unwrap();
        let half = EtcdTls { cert: Some("/c.pem".into()), ..tls.clone() };
        let c = DomainConfig { endpoints: https.clone(), tls: Some(half), ..config() };
        assert_eq!(c.validate(), Err(ConfigError::TlsIdentity));
        let bad_name = EtcdTls { server_name: Some("etcd..local".into()), ..tls };
        let c = DomainConfig { endpoints: https, tls: Some(bad_name), ..config() };
        assert!(matches!(c.validate(), Err(ConfigError::TlsServerName(_))));
    }
}
