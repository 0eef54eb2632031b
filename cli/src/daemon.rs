//! fabricctl as a client of fabricd: the socket to use, the documents it serves, and
//! `fabricctl status`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fabric_addrmap::Listing;
use fabric_proto::wire::{
    CodecError, Connection, PartitionsRequest, PartitionsResponse, ProblemKind, RegionsRequest, RegionsResponse,
    Request, Response, SUPPORTED_VERSIONS, StatusRequest, StatusResponse, TopologyRequest, Version, connect_unix,
};
use fabric_topology::{Fabric, Inventory};
use serde::Serialize;

use crate::args::{ListFormat, SourceArgs};

/// Errors talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// No socket path could be chosen.
    #[error("no fabricd socket: set FABRIC_SOCKET or XDG_RUNTIME_DIR, or pass --daemon SOCKET")]
    NoSocket,
    /// Nothing listens on the socket.
    #[error("no fabricd is listening on {path}")]
    NotRunning {
        /// The socket tried.
        path: PathBuf,
        /// Why the connection failed.
        #[source]
        source: io::Error,
    },
    /// The daemon did not take the connection in time: its accept queue is full.
    #[error("fabricd at {path} took no connection within {after:?}")]
    Busy {
        /// The socket tried.
        path: PathBuf,
        /// The time waited.
        after: Duration,
    },
    /// The exchange failed or the daemon refused.
    #[error("fabricd at {path}")]
    Call {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: CodecError,
    },
    /// The daemon answered with something else than asked.
    #[error("fabricd at {0} answered with an unexpected response")]
    Unexpected(PathBuf),
    /// A document from the daemon does not parse or index.
    #[error("fabricd at {path} sent a {schema} document that does not load: {message}")]
    Document {
        /// The socket.
        path: PathBuf,
        /// Its schema.
        schema: &'static str,
        /// Why.
        message: String,
    },
    /// The daemon speaks an older protocol that lacks the operation.
    #[error("fabricd at {path} speaks protocol {version}; {what} needs 1.1")]
    TooOld {
        /// The socket.
        path: PathBuf,
        /// Negotiated version.
        version: Version,
        /// The operation.
        what: &'static str,
    },
    /// The command does not use the daemon yet.
    #[error("fabricctl {0} does not use the daemon yet; drop --daemon (it reads discovery and the map directly)")]
    CommandUnavailable(&'static str),
}

impl DaemonError {
    /// How to fix it.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            DaemonError::NotRunning { .. } => Some(
                "start fabricd (`fabricd --config configs/fabricd.toml`, or `systemctl start fabricd`), \
                 or pass the socket it serves with --daemon SOCKET",
            ),
            DaemonError::NoSocket => Some("pass --daemon SOCKET"),
            DaemonError::Busy { .. } | DaemonError::Call { source: CodecError::TimedOut { .. }, .. } => Some(
                "fabricd is wedged or overloaded: read its log (`journalctl -u fabricd`), \
                 or wait longer with --timeout SECS",
            ),
            DaemonError::TooOld { .. } => Some("upgrade fabricd, or drop --daemon to discover locally"),
            _ => None,
        }
    }
}

/// The socket to use: the one given, else `$FABRIC_SOCKET`, else `/run/fabric/fabricd.sock`
/// for root, else `$XDG_RUNTIME_DIR/fabric/fabricd.sock` — the daemon's own defaults.
pub fn socket_path(explicit: Option<&Path>) -> Result<PathBuf, DaemonError> {
    if let Some(p) = explicit {
        return Ok(p.to_owned());
    }
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("FABRIC_SOCKET") {
        return Ok(p);
    }
    if crate::map::is_root() {
        return Ok(PathBuf::from("/run/fabric/fabricd.sock"));
    }
    var("XDG_RUNTIME_DIR").map(|d| d.join("fabric/fabricd.sock")).ok_or(DaemonError::NoSocket)
}

/// Seconds a connection waits for the daemon (`--timeout`).
static TIMEOUT_S: AtomicU64 = AtomicU64::new(60);

/// How long each connection made from now on waits for fabricd to take it, and then for
/// each whole answer (`--timeout`; at least a second).
pub fn set_timeout(secs: u64) {
    TIMEOUT_S.store(secs.max(1), Ordering::Relaxed);
}

/// The most a command waits for the daemon at the default socket before it discovers
/// locally instead ([`select`]).
const PROBE: Duration = Duration::from_secs(5);

fn timeout() -> Duration {
    Duration::from_secs(TIMEOUT_S.load(Ordering::Relaxed))
}

/// A negotiated connection to the daemon.
#[derive(Debug)]
pub struct Client {
    conn: Connection,
    path: PathBuf,
}

impl Client {
    /// Connects and says hello, each bounded by the timeout ([`set_timeout`]): a wedged
    /// daemon (a full accept queue, an answer that never ends) is an error, not a hang.
    pub fn connect(explicit: Option<&Path>) -> Result<Self, DaemonError> {
        Self::connect_within(explicit, timeout())
    }

    /// [`Client::connect`], waiting at most `after` for each step (and each call after).
    fn connect_within(explicit: Option<&Path>, after: Duration) -> Result<Self, DaemonError> {
        let path = socket_path(explicit)?;
        let stream = connect_unix(&path, Some(after)).map_err(|source| match source.kind() {
            io::ErrorKind::TimedOut => DaemonError::Busy { path: path.clone(), after },
            _ => DaemonError::NotRunning { path: path.clone(), source },
        })?;
        let mut conn = Connection::new(stream);
        conn.set_call_timeout(Some(after));
        conn.hello("fabricctl", SUPPORTED_VERSIONS)
            .map_err(|source| DaemonError::Call { path: path.clone(), source })?;
        tracing::debug!(socket = %path.display(), version = %conn.version(), "connected to fabricd");
        Ok(Self { conn, path })
    }

    /// Sends a request and returns the response.
    pub fn call(&mut self, req: Request) -> Result<Response, DaemonError> {
        self.conn.call(req, &[]).map(|(r, _)| r).map_err(|source| DaemonError::Call { path: self.path.clone(), source })
    }

    /// The daemon's status.
    pub fn status(&mut self) -> Result<StatusResponse, DaemonError> {
        match self.call(Request::Status(StatusRequest {}))? {
            Response::Status(s) => Ok(s),
            _ => Err(DaemonError::Unexpected(self.path.clone())),
        }
    }

    /// The protocol version the connection negotiated.
    pub fn version(&self) -> Version {
        self.conn.version()
    }

    /// The socket in use.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn need_1_1(&self, what: &'static str) -> Result<(), DaemonError> {
        let version = self.conn.version();
        if version < Version::new(1, 1) {
            return Err(DaemonError::TooOld { path: self.path.clone(), version, what });
        }
        Ok(())
    }

    fn bad_doc(&self, schema: &'static str, message: impl ToString) -> DaemonError {
        DaemonError::Document { path: self.path.clone(), schema, message: message.to_string() }
    }

    /// The fabric the daemon serves to this caller (its partitions' part, for a bound
    /// client), from the `fabric.inventory/v1` document, indexed as a local discovery is.
    pub fn fabric(&mut self) -> Result<Fabric, DaemonError> {
        self.need_1_1("the inventory")?;
        let doc = match self.call(Request::Inventory(TopologyRequest::default()))? {
            Response::Inventory(d) => d,
            _ => return Err(DaemonError::Unexpected(self.path.clone())),
        };
        let inv: Inventory = serde_json::from_str(&doc.json).map_err(|e| self.bad_doc("fabric.inventory/v1", e))?;
        Fabric::build(inv).map_err(|e| self.bad_doc("fabric.inventory/v1", e))
    }

    /// The address map listing this caller may see: a domain node's in pages (1.7).
    pub fn listing(&mut self) -> Result<Listing, DaemonError> {
        if self.version() >= fabric_proto::wire::PAGED
            && let Some(l) = crate::pages::map(self)?
        {
            return Ok(l);
        }
        let doc = match self.call(Request::Map(TopologyRequest::default()))? {
            Response::Map(d) => d,
            _ => return Err(DaemonError::Unexpected(self.path.clone())),
        };
        serde_json::from_str(&doc.json).map_err(|e| self.bad_doc("fabric.map/v1", e))
    }

    /// Lists or changes partitions.
    pub fn partitions(&mut self, req: PartitionsRequest) -> Result<PartitionsResponse, DaemonError> {
        match self.call(Request::Partitions(req))? {
            Response::Partitions(p) => Ok(p),
            _ => Err(DaemonError::Unexpected(self.path.clone())),
        }
    }

    /// Regions, exports and imports: the caller's, or with `all` everyone's.
    pub fn regions(&mut self, all: bool) -> Result<RegionsResponse, DaemonError> {
        self.need_1_1("the regions listing")?;
        match self.call(Request::Regions(RegionsRequest { all }))? {
            Response::Regions(r) => Ok(r),
            _ => Err(DaemonError::Unexpected(self.path.clone())),
        }
    }
}

/// The daemon a command that can use one should ask: the one `--daemon` names (it must
/// answer); none with `--sim` or `--sysfs-root`; otherwise the one at the default socket
/// when it answers there (when nothing does, the command discovers locally).
pub fn select(source: &SourceArgs) -> Result<Option<Client>, DaemonError> {
    if let Some(explicit) = &source.daemon {
        return Client::connect(explicit.as_deref()).map(Some);
    }
    if source.sim.is_some() || source.sysfs_root.is_some() {
        return Ok(None);
    }
    let Ok(path) = socket_path(None) else { return Ok(None) };
    if !path.exists() {
        return Ok(None);
    }
    // A probe: a daemon that does not answer soon is not waited for (`--daemon` waits).
    match Client::connect_within(Some(&path), timeout().min(PROBE)) {
        Ok(c) => Ok(Some(c)),
        Err(e @ (DaemonError::Busy { .. } | DaemonError::Call { source: CodecError::TimedOut { .. }, .. })) => {
            tracing::warn!(socket = %path.display(), error = %e, "fabricd at the default socket does not answer; discovering locally (--daemon waits for it)");
            Ok(None)
        }
        Err(e) => {
            tracing::info!(socket = %path.display(), error = %e, "no usable fabricd at the default socket; discovering locally");
            Ok(None)
        }
    }
}

/// `fabric.status/v1`: what `fabricctl status -o json` prints.
#[derive(Debug, Serialize)]
pub struct StatusDoc {
    /// Schema.
    pub schema: &'static str,
    /// The socket asked.
    pub socket: String,
    /// Serving normally.
    pub ready: bool,
    /// Seconds since start.
    pub uptime_s: u64,
    /// Devices known.
    pub devices: u32,
    /// Links known.
    pub links: u32,
    /// Connected sessions (this one included).
    pub sessions: u32,
    /// Address map generation.
    pub map_generation: u64,
    /// What is missing or degraded and why.
    pub problems: Vec<ProblemDoc>,
}

/// One problem.
#[derive(Debug, Serialize)]
pub struct ProblemDoc {
    /// `backend_missing`, `backend_failed`, `device_missing`, `device_failed`, `link_down`,
    /// `link_degraded` or `other`.
    pub kind: &'static str,
    /// The backend, device or link (`A<->B`).
    pub subject: String,
    /// Why.
    pub detail: String,
    /// Fraction of the link's bandwidth left (0 to 1), for links.
    pub bandwidth_fraction: Option<f64>,
}

fn kind_name(k: ProblemKind) -> &'static str {
    match k {
        ProblemKind::BackendMissing => "backend_missing",
        ProblemKind::BackendFailed => "backend_failed",
        ProblemKind::DeviceMissing => "device_missing",
        ProblemKind::DeviceFailed => "device_failed",
        ProblemKind::LinkDown => "link_down",
        ProblemKind::LinkDegraded => "link_degraded",
        ProblemKind::Other => "other",
    }
}

/// The status document.
pub fn status_doc(socket: &Path, s: &StatusResponse) -> StatusDoc {
    StatusDoc {
        schema: "fabric.status/v1",
        socket: socket.display().to_string(),
        ready: s.ready,
        uptime_s: s.uptime_s,
        devices: s.devices,
        links: s.links,
        sessions: s.sessions,
        map_generation: s.map_generation,
        problems: s
            .problems
            .iter()
            .map(|p| ProblemDoc {
                kind: kind_name(p.kind),
                subject: p.subject.to_string(),
                detail: p.detail.to_string(),
                bandwidth_fraction: p.bandwidth_permille.map(|m| f64::from(m) / 1000.0),
            })
            .collect(),
    }
}

/// Writes the status as a table or JSON.
pub fn render_status(doc: &StatusDoc, format: ListFormat, out: &mut dyn Write) -> io::Result<()> {
    if format == ListFormat::Json {
        serde_json::to_writer_pretty(&mut *out, doc).map_err(io::Error::other)?;
        return writeln!(out);
    }
    let state = if doc.ready { "serving" } else { "not ready" };
    writeln!(out, "fabricd at {}: {state} (up {} s, {} sessions)", doc.socket, doc.uptime_s, doc.sessions)?;
    writeln!(out, "devices {}, links {}, address map generation {}", doc.devices, doc.links, doc.map_generation)?;
    if doc.problems.is_empty() {
        return writeln!(out, "no problems: every backend present, every link up");
    }
    writeln!(out, "problems ({}):", doc.problems.len())?;
    for p in &doc.problems {
        let what = match p.kind {
            "backend_missing" => format!("backend {} not present: {}", p.subject, p.detail),
            "backend_failed" => format!("backend {} failed: {}", p.subject, p.detail),
            "link_down" => format!("link {} down: {}", p.subject, p.detail),
            "link_degraded" => match p.bandwidth_fraction {
                Some(f) => {
                    format!("link {} degraded: {:.1}% of its bandwidth left ({})", p.subject, f * 100.0, p.detail)
                }
                None => format!("link {} degraded: {}", p.subject, p.detail),
            },
            "device_missing" => format!("device {} missing: {}", p.subject, p.detail),
            "device_failed" => format!("device {} failed: {}", p.subject, p.detail),
            _ => format!("{}: {}", p.subject, p.detail),
        };
        writeln!(out, "  {what}")?;
    }
    Ok(())
}
