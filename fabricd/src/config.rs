//! The daemon's configuration file (`configs/fabricd.toml` documents every key).
//!
//! Every key has a default; a file names only what it changes. Defaults depend on who runs
//! the daemon: as root it uses system paths (`/run/fabric`, `/var/lib/fabric`) and the host
//! backends; as a normal user it uses the user's runtime and state directories, which is
//! how the sim default runs unprivileged.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fabric_addrmap::MapConfig;
use fabric_domain::DomainConfig;
use serde::{Deserialize, Serialize};

/// Errors loading a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid (the message names the line, column and key).
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The TOML error.
        message: String,
    },
    /// A value is out of range or inconsistent with another.
    #[error("{path}: {key}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
    /// No default directory exists for this user.
    #[error("no default for {0}: set it in the configuration (no XDG_RUNTIME_DIR/XDG_STATE_HOME/HOME)")]
    NoDefault(&'static str),
}

/// Which discovery backends run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendName {
    /// PCI from sysfs.
    Pci,
    /// CXL from sysfs.
    Cxl,
    /// UALink vendor attributes.
    Ualink,
    /// NVIDIA NVML.
    Nvml,
    /// NVIDIA CUDA driver API.
    Cuda,
}

/// `[socket]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SocketConfig {
    /// Socket path. Default: `/run/fabric/fabricd.sock` as root, else
    /// `$XDG_RUNTIME_DIR/fabric/fabricd.sock`.
    pub path: Option<PathBuf>,
    /// Group that owns the socket (mode 0660): its members may connect. Default: the
    /// daemon's own group. A name, or a numeric gid (all digits).
    pub group: Option<String>,
    /// Group whose members may run admin operations (besides root). A name, or a numeric
    /// gid (all digits).
    pub admin_group: Option<String>,
}

/// `[state]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StateConfig {
    /// State directory (address map, journal, sim device memory). Default:
    /// `/var/lib/fabric` as root, else `$XDG_STATE_HOME/fabric` or `~/.local/state/fabric`.
    pub dir: Option<PathBuf>,
}

/// `[discovery]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Root the host backends read under.
    pub sysfs_root: PathBuf,
    /// Host backends to run, in this order.
    pub backends: Vec<BackendName>,
    /// Sim fabrics to serve instead of the host (relative paths are relative to the
    /// configuration file).
    pub sim: Vec<PathBuf>,
    /// Serve only this node's devices of the sim fabric (and its fabric-level switches):
    /// one node of a sim fabric, as a domain node serves its own part of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sim_node: Option<String>,
    /// Seconds between rescans (0: none; uevents may still trigger rescans).
    pub rescan_interval_s: u64,
    /// Listen to kernel uevents and rescan (debounced) when a relevant one arrives.
    pub uevents: UeventMode,
}

/// `discovery.uevents`: whether kernel uevents trigger rescans.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UeventMode {
    /// On for the host backends, off for a sim fabric (whose file no uevent describes).
    #[default]
    Auto,
    /// Always (with a sim fabric, a relevant uevent re-reads the sim file).
    On,
    /// Never: only the periodic rescans.
    Off,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            sysfs_root: PathBuf::from("/"),
            backends: vec![
                BackendName::Pci,
                BackendName::Cxl,
                BackendName::Ualink,
                BackendName::Nvml,
                BackendName::Cuda,
            ],
            sim: Vec::new(),
            sim_node: None,
            rescan_interval_s: 60,
            uevents: UeventMode::Auto,
        }
    }
}

/// `[limits]`, per user unless named otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Bytes of fabric memory one uid may have allocated. Unset: derived from the fabric
    /// (`memory::limits::default_allocated`), so that one uid cannot take all of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocated_bytes_per_uid: Option<u64>,
    /// Bytes one uid may have pinned for DMA. Unset: derived from the machine's memory
    /// (`memory::limits::default_pinned`), so that one uid cannot lock most of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_bytes_per_uid: Option<u64>,
    /// Regions, exports, imports and registrations one uid may hold.
    pub objects_per_uid: u32,
    /// Imports one other node of the domain may hold of this node's memory at once, its
    /// clients' together (where the domain does not share identities they count against
    /// nothing else, so no node can use up another's; each may keep a descriptor here,
    /// counted in the open-file table's shares too).
    pub imports_per_node: u32,
    /// Connected clients, all users together.
    pub clients: u32,
    /// Connected clients of one uid (root and the daemon's own uid excepted), so that one
    /// user cannot take every one of `clients`.
    pub clients_per_uid: u32,
    /// Largest request body accepted, bytes.
    pub max_request_bytes: u32,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            allocated_bytes_per_uid: None,
            pinned_bytes_per_uid: None,
            objects_per_uid: 4096,
            imports_per_node: 4096,
            clients: 1024,
            clients_per_uid: 64,
            max_request_bytes: 1 << 20,
        }
    }
}

/// Most `[[memory.shares]]` entries (claimed in one etcd transaction, which etcd bounds
/// at 128 operations by default).
pub const MAX_SHARES: usize = 32;

/// The longest period or grace a setting in seconds may name: a year.
pub const MAX_SECONDS: u64 = 365 * 24 * 3600;

/// `[memory]`: the durable memory registry (docs/fabricd.md, "Durability").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// Seconds a session found in the journal at start, whose process is still alive,
    /// has to come back (`Hello` with its token) before its regions are reclaimed.
    pub resume_grace_s: u64,
    /// Records appended since the last snapshot after which the journal is compacted.
    pub compact_records: u32,
    /// Seconds a session whose connection closed while its process lives keeps its regions
    /// and exports for a `Hello` with its token; 0: reclaimed at once (the default).
    pub detach_grace_s: u64,
    /// Device-DAX devices (`dax0.0`) whose CXL memory regions are allocated from: each
    /// backs the interleave set of the CXL region it is carved from. None by default:
    /// handing out a DAX device is an operator decision.
    pub dax: Vec<String>,
    /// Give each region on a `dax` device a DAX device of its own, carved from the DAX
    /// region at the region's range (each `dax` entry must then be a region's first device,
    /// `daxN.0`, which fabricd shrinks to 0 and every other device of which it owns), so that
    /// a client's descriptor reaches only its region. Off: a region is a range of the whole
    /// `dax` device.
    pub dax_per_region: bool,
    /// PCI memory BARs (`0000:00:05.0/2`) whose bytes regions are allocated from, through
    /// sysfs `resourceN`: each becomes a `host_exported` memory resource of its function.
    pub bars: Vec<String>,
    /// Memory-only NUMA nodes of CXL memory (onlined by `kmem`) whose memory regions are
    /// allocated from: each region is a memfd whose pages the daemon places on the node
    /// (docs/fabricd.md, "Memory backends"). A node with CPUs, or whose memory is not a
    /// CXL region's, is refused.
    pub numa: Vec<u32>,
    /// NUMA nodes served like `numa` without the memory-only and CXL checks (a DRAM node,
    /// or a memory-only node of plain DRAM): served only because they are listed here.
    pub numa_plain: Vec<u32>,
    /// The tmpfs directory where regions on `numa`/`numa_plain` nodes live, a file each, so
    /// that they outlive a daemon restart (not a reboot). Empty: `numa-HASH` in the runtime
    /// directory (`/run/fabric` for root, else `$XDG_RUNTIME_DIR/fabric`), HASH naming the
    /// state directory. Must be the daemon's own (0700) and on tmpfs.
    pub numa_dir: String,
    /// Seconds between checks that region files keep their size (a client that shrank or
    /// grew its region's file gets it put back); 0: never.
    pub size_check_s: u64,
    /// Devices whose memory other hosts of the domain reach too (a CXL device of a pool, a
    /// multi-headed one), each with the bytes of each of its memory resources this node
    /// claims in the domain (`[[memory.shares]]`; needs `[domain]`): new regions on such a
    /// resource go only in this node's share (docs/domain.md, "Shares of shared memory").
    pub shares: Vec<ShareConfig>,
}

/// `[[memory.shares]]`: this node's share of a device other hosts reach too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareConfig {
    /// The device, by its fabric id (`serial:cxl/0x…`, the same on every host).
    pub device: String,
    /// Bytes of each of its memory resources (a multiple of 2 MiB; at most the resource).
    pub bytes: u64,
    /// The CXL pool the device belongs to, as the node's member record names it (1 to 64
    /// of `[A-Za-z0-9._:-]`, the same on every host of the pool); default: the device id
    /// with `/` written `_` ([`ShareConfig::pool`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Whether the device keeps every host's caches coherent with what the others store
    /// (CXL back-invalidate, HDM-DB): mappings of it then need no flush or invalidate.
    /// Default `false`: CXL.mem shared by hosts is not, and regions on it say so.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub coherent: bool,
}

impl ShareConfig {
    /// The name of the CXL pool the device belongs to: `pool`, else the device id with
    /// each `/` written `_` (`serial:cxl/0x5eed` is in pool `serial:cxl_0x5eed`).
    pub fn pool(&self) -> String {
        self.pool.clone().unwrap_or_else(|| self.device.replace('/', "_"))
    }
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            resume_grace_s: 30,
            compact_records: 4096,
            detach_grace_s: 0,
            dax: Vec::new(),
            dax_per_region: false,
            bars: Vec::new(),
            numa: Vec::new(),
            numa_plain: Vec::new(),
            numa_dir: String::new(),
            size_check_s: 5,
            shares: Vec::new(),
        }
    }
}

/// `[copy]`: the copy engine (docs/fabricd.md, "Copy engine").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CopyConfig {
    /// Engine threads that move bytes (1 to 64).
    pub engines: u32,
    /// Copies one session may have queued or running at once; more are refused with
    /// `LimitExceeded`.
    pub max_in_flight_per_session: u32,
    /// Largest piece of a copy one engine moves at a time (bytes, 256 KiB to 1 GiB); a
    /// larger copy is split over the engines in pieces of at most this size.
    pub chunk_bytes: u64,
}

impl Default for CopyConfig {
    fn default() -> Self {
        Self { engines: 2, max_in_flight_per_session: 64, chunk_bytes: 4 << 20 }
    }
}

/// `[dma]`: device DMA through VFIO (docs/fabricd.md, "VFIO DMA backend").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DmaConfig {
    /// PCI functions (`DDDD:BB:DD.F`) fabricd takes for DMA through VFIO: bound to
    /// `vfio-pci` at start (root only), their IOMMU group opened, and registrations for
    /// them mapped in the group's type-1 container. Empty: registrations stay in software.
    pub vfio: Vec<String>,
    /// Test hook, admin-only by being config: after every `VFIO_IOMMU_UNMAP_DMA` the
    /// device's engine DMAs one page to the IOVA just unmapped and requires the IOMMU to
    /// block it (a DMAR fault in the kernel log); the outcome is logged. Never in production.
    pub vfio_verify_unmap: bool,
}

/// `[security]`: how partitions bind clients (`docs/fabricd.md`, "Security and
/// partitions").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecurityConfig {
    /// Refuse fabric and memory operations to a non-admin client that no partition binds
    /// (by its uid or one of its groups). When false, such a client sees the whole fabric.
    pub require_partition: bool,
}

/// `[metrics]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Prometheus endpoint (`host:port`, loopback only); empty disables it.
    pub listen: String,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { listen: "127.0.0.1:9477".to_owned() }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// Format.
    pub format: LogFormat,
    /// Level filter (`RUST_LOG` syntax); `RUST_LOG` overrides it.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { format: LogFormat::Text, level: "info".to_owned() }
    }
}

/// The whole configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The client socket.
    pub socket: SocketConfig,
    /// Persistent state.
    pub state: StateConfig,
    /// What to discover.
    pub discovery: DiscoveryConfig,
    /// Per-user limits.
    pub limits: LimitsConfig,
    /// The durable memory registry.
    pub memory: MemoryConfig,
    /// The copy engine.
    pub copy: CopyConfig,
    /// Device DMA through VFIO.
    pub dma: DmaConfig,
    /// Partition binding rules.
    pub security: SecurityConfig,
    /// Prometheus metrics.
    pub metrics: MetricsConfig,
    /// Logging.
    pub log: LogConfig,
    /// The global address map (the keys of `configs/addrmap.toml`).
    pub map: MapConfig,
    /// The domain this node joins (`docs/domain.md`); absent: the daemon runs alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<DomainConfig>,
    /// How other nodes of the domain reach this one.
    pub peer: PeerConfig,
}

/// `[peer]`: this node's address for the other nodes of its domain, and the credentials
/// of its node link (`docs/domain.md`, "Node link").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeerConfig {
    /// `host:port` published in the member record, where the node link listens when
    /// credentials are set; default `<domain.node>:7471`.
    pub address: Option<String>,
    /// The domain CA's certificate (PEM). With `cert` and `key`, or none of the three
    /// (then the node has no link: it neither listens nor dials).
    pub ca: Option<PathBuf>,
    /// This node's certificate (PEM), naming `fabric://<domain.name>/node/<domain.node>`.
    pub cert: Option<PathBuf>,
    /// This node's private key (PKCS#8 PEM).
    pub key: Option<PathBuf>,
    /// The sim fabric's shared memory: a directory every node of the domain on this host
    /// sees at the same path. Set, this node keeps its region files under `DIR/<node>/`
    /// (instead of `STATE/memory`), and imports another node's region by opening its file
    /// there — the stand-in for a memory-semantic fabric (`docs/domain.md`, "Import across
    /// nodes"). Unset, regions of other nodes are not importable for load/store.
    pub shared_dir: Option<PathBuf>,
    /// Whether uids and gids mean the same on every node of the domain (one directory
    /// service): then an export's uid and gid rules admit importers of other nodes too.
    /// Otherwise (default) only an export that names a partition is importable from
    /// another node. Set it alike on every node; the owner's setting decides.
    pub shared_identities: bool,
    /// Microseconds a request's thread that asked another node (an import) polls the
    /// link's socket for the answer before it sleeps in the read: where waking a sleeping
    /// thread costs more than the answer takes (a VM whose idle vCPUs halt), the poll
    /// saves that wake-up for at most this much CPU time per ask; `0` sleeps at once.
    /// At most [`PeerConfig::MAX_ANSWER_POLL_US`].
    pub answer_poll_us: u32,
}

impl Default for PeerConfig {
    fn default() -> Self {
        Self {
            address: None,
            ca: None,
            cert: None,
            key: None,
            shared_dir: None,
            shared_identities: false,
            answer_poll_us: Self::DEFAULT_ANSWER_POLL_US,
        }
    }
}

impl PeerConfig {
    /// `answer_poll_us`'s default: about what an answer takes on a loopback or LAN link.
    pub const DEFAULT_ANSWER_POLL_US: u32 = 250;
    /// The longest answer poll: beyond it the thread is busy, not faster.
    pub const MAX_ANSWER_POLL_US: u32 = 10_000;

    /// How long a request's thread polls for another node's answer.
    pub fn answer_poll(&self) -> Duration {
        Duration::from_micros(u64::from(self.answer_poll_us))
    }

    /// The credentials' paths (CA, certificate, key) when all three are set.
    pub fn credentials(&self) -> Option<(&Path, &Path, &Path)> {
        Some((self.ca.as_deref()?, self.cert.as_deref()?, self.key.as_deref()?))
    }
}

impl Config {
    /// Where region files live: `STATE/memory`, or `peer.shared_dir/<node>` for a domain
    /// node on a shared sim fabric.
    pub fn memory_root(&self, state_dir: &Path) -> PathBuf {
        match (&self.domain, &self.peer.shared_dir) {
            (Some(d), Some(shared)) => shared.join(&d.node),
            _ => state_dir.join("memory"),
        }
    }

    /// The peer address published in this node's member record (`peer.address`, else
    /// `<domain.node>:7471`); `None` outside a domain.
    pub fn peer_address(&self) -> Option<String> {
        let domain = self.domain.as_ref()?;
        Some(self.peer.address.clone().unwrap_or_else(|| format!("{}:7471", domain.node)))
    }
}

/// Who the daemon runs as, for defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environment {
    /// Running as root.
    pub root: bool,
    /// `$XDG_RUNTIME_DIR`.
    pub runtime_dir: Option<PathBuf>,
    /// `$XDG_STATE_HOME`.
    pub state_home: Option<PathBuf>,
    /// `$HOME`.
    pub home: Option<PathBuf>,
}

impl Environment {
    /// The daemon's runtime directory: `/run/fabric` for root, else
    /// `$XDG_RUNTIME_DIR/fabric` (the default socket's directory; NUMA region files go under
    /// it too). `None` for a user without `XDG_RUNTIME_DIR`.
    pub fn fabric_runtime_dir(&self) -> Option<PathBuf> {
        if self.root { Some(PathBuf::from("/run/fabric")) } else { self.runtime_dir.as_ref().map(|d| d.join("fabric")) }
    }

    /// This process's environment.
    pub fn current() -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        Self {
            root: crate::sys::effective_uid() == 0,
            runtime_dir: var("XDG_RUNTIME_DIR"),
            state_home: var("XDG_STATE_HOME"),
            home: var("HOME"),
        }
    }
}

impl Config {
    /// Parses a configuration; `origin` names the file in errors, and relative sim paths
    /// are resolved against `base_dir`.
    pub fn parse(text: &str, origin: &Path, base_dir: &Path) -> Result<Self, ConfigError> {
        let mut c: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        for s in &mut c.discovery.sim {
            if s.is_relative() {
                *s = base_dir.join(&*s);
            }
        }
        c.validate(origin)?;
        Ok(c)
    }

    /// Reads a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        Self::parse(&text, path, path.parent().unwrap_or(Path::new(".")))
    }

    fn validate(&self, origin: &Path) -> Result<(), ConfigError> {
        let bad = |key, message: String| ConfigError::Invalid { path: origin.to_owned(), key, message };
        if let Err(e) = self.map.validate() {
            return Err(bad("map", e.to_string()));
        }
        if self.limits.max_request_bytes < 4096 || self.limits.max_request_bytes > 64 << 20 {
            return Err(bad("limits.max_request_bytes", "must be between 4 KiB and 64 MiB".to_owned()));
        }
        if self.memory.compact_records == 0 {
            return Err(bad("memory.compact_records", "must be at least 1".to_owned()));
        }
        // Periods and deadlines are added to clocks: past a year they overflow them (a
        // panic in the task that reads them) long before they mean anything.
        let seconds = [
            ("discovery.rescan_interval_s", self.discovery.rescan_interval_s),
            ("memory.resume_grace_s", self.memory.resume_grace_s),
            ("memory.detach_grace_s", self.memory.detach_grace_s),
            ("memory.size_check_s", self.memory.size_check_s),
        ];
        if let Some((key, _)) = seconds.iter().find(|(_, s)| *s > MAX_SECONDS) {
            return Err(bad(key, format!("must be at most {MAX_SECONDS} (a year)")));
        }
        if let Some(n) = self.memory.numa_plain.iter().find(|n| self.memory.numa.contains(n)) {
            return Err(bad("memory.numa_plain", format!("node {n} is in memory.numa too: list it once")));
        }
        if self.limits.clients == 0 {
            return Err(bad("limits.clients", "must be at least 1".to_owned()));
        }
        if self.limits.imports_per_node == 0 {
            return Err(bad("limits.imports_per_node", "must be at least 1".to_owned()));
        }
        if self.limits.clients_per_uid == 0 {
            return Err(bad("limits.clients_per_uid", "must be at least 1".to_owned()));
        }
        if !(1..=64).contains(&self.copy.engines) {
            return Err(bad("copy.engines", "must be between 1 and 64".to_owned()));
        }
        if self.copy.max_in_flight_per_session == 0 {
            return Err(bad("copy.max_in_flight_per_session", "must be at least 1".to_owned()));
        }
        if !(256 << 10..=1 << 30).contains(&self.copy.chunk_bytes) {
            return Err(bad("copy.chunk_bytes", "must be between 256 KiB and 1 GiB".to_owned()));
        }
        for a in &self.dma.vfio {
            if a.parse::<fabric_topology::PciAddress>().is_err() {
                return Err(bad("dma.vfio", format!("{a:?} is not a PCI address (DDDD:BB:DD.F)")));
            }
        }
        if !self.metrics.listen.is_empty() {
            let addr: std::net::SocketAddr = self
                .metrics
                .listen
                .parse()
                .map_err(|_| bad("metrics.listen", format!("{:?} is not host:port", self.metrics.listen)))?;
            if !addr.ip().is_loopback() {
                return Err(bad("metrics.listen", format!("{addr} is not a loopback address")));
            }
        }
        if let Some(node) = &self.discovery.sim_node {
            if self.discovery.sim.len() != 1 {
                return Err(bad("discovery.sim_node", "needs exactly one discovery.sim file".to_owned()));
            }
            if !fabric_domain::config::is_valid_name(node) {
                return Err(bad("discovery.sim_node", format!("{node:?} is not a node name")));
            }
        }
        self.validate_shares().map_err(|(key, message)| bad(key, message))?;
        if let Some(domain) = &self.domain {
            self.validate_domain(domain).map_err(|(key, message)| bad(key, message))?;
        } else if self.peer != PeerConfig::default() {
            let key = if self.peer.address.is_some() { "peer.address" } else { "peer" };
            return Err(bad(key, "only a domain node has peers: add [domain]".to_owned()));
        }
        let mut seen = Vec::new();
        for b in &self.discovery.backends {
            if seen.contains(b) {
                return Err(bad("discovery.backends", format!("{b:?} is listed twice")));
            }
            seen.push(*b);
        }
        Ok(())
    }

    /// `[[memory.shares]]`: devices named once by fabric id, sizes in whole granules, only
    /// in a domain.
    fn validate_shares(&self) -> Result<(), (&'static str, String)> {
        let shares = &self.memory.shares;
        if shares.is_empty() {
            return Ok(());
        }
        if self.domain.is_none() {
            return Err(("memory.shares", "shares are claimed in a domain: add [domain]".to_owned()));
        }
        if shares.len() > MAX_SHARES {
            return Err(("memory.shares", format!("{} entries, more than {MAX_SHARES}", shares.len())));
        }
        for (i, s) in shares.iter().enumerate() {
            let id: fabric_topology::DeviceId =
                s.device.parse().map_err(|_| ("memory.shares", format!("{:?} is not a device id", s.device)))?;
            if fabric_domain::shares::check_resource(&id.to_string()).is_err() {
                return Err(("memory.shares", format!("{id}: not a name a share can be claimed under")));
            }
            if !fabric_domain::records::is_group_name(&s.pool()) {
                let hint = if s.pool.is_some() { "" } else { " (from the device id): name it with pool = \"...\"" };
                return Err((
                    "memory.shares",
                    format!("{}: pool {:?} is not 1 to 64 of [A-Za-z0-9._:-]{hint}", s.device, s.pool()),
                ));
            }
            if shares[..i].iter().any(|o| o.device == s.device) {
                return Err(("memory.shares", format!("{} is listed twice", s.device)));
            }
            if s.bytes == 0 || !s.bytes.is_multiple_of(crate::memory::alloc::GRANULE) {
                return Err((
                    "memory.shares",
                    format!("{}: {} bytes is not a whole number of 2 MiB", s.device, s.bytes),
                ));
            }
        }
        Ok(())
    }

    /// A domain node's settings against the rest of the configuration.
    fn validate_domain(&self, domain: &DomainConfig) -> Result<(), (&'static str, String)> {
        domain.validate().map_err(|e| ("domain", e.to_string()))?;
        if !matches!(self.map.node_span, fabric_addrmap::NodeSpan::Fixed(_)) {
            // Slot n of the domain starts at n × node_span on every node: one size for all.
            return Err((
                "map.node_span",
                "a domain node needs a fixed node span (map.node_span = { fixed = BYTES }), the same on every node"
                    .to_owned(),
            ));
        }
        crate::tasks::domain::join::check_settings(self).map_err(|e| ("map", format!("as domain settings: {e}")))?;
        if self.map.base != 0 {
            return Err(("map.base", "must be 0 in a domain: slot n starts at n × node_span".to_owned()));
        }
        if self.map.nodes.contains_key(&domain.node) {
            return Err((
                "map.nodes",
                format!("{}: a domain node's slot comes from the domain, not from map.nodes", domain.node),
            ));
        }
        if !self.discovery.sim.is_empty() && self.discovery.sim_node.as_deref() != Some(domain.node.as_str()) {
            return Err((
                "discovery.sim_node",
                format!("a domain node serving a sim fabric serves its own node of it: set it to {:?}", domain.node),
            ));
        }
        if let Some(address) = &self.peer.address
            && fabric_domain::records::check_peer_address(address).is_err()
        {
            return Err(("peer.address", format!("{address:?} is not host:port")));
        }
        if self.peer.answer_poll_us > PeerConfig::MAX_ANSWER_POLL_US {
            return Err((
                "peer.answer_poll_us",
                format!(
                    "{} is more than {}: a longer poll keeps a thread busy without a faster answer",
                    self.peer.answer_poll_us,
                    PeerConfig::MAX_ANSWER_POLL_US
                ),
            ));
        }
        let paths = [&self.peer.ca, &self.peer.cert, &self.peer.key];
        let set = paths.iter().filter(|p| p.is_some()).count();
        if set != 0 && set != paths.len() {
            return Err(("peer", "ca, cert and key go together: set all three, or none for no node link".to_owned()));
        }
        Ok(())
    }

    /// Whether kernel uevents are listened to: `discovery.uevents`, where `auto` means
    /// "when serving the host" (no sim fabric configured).
    pub fn uevents_enabled(&self) -> bool {
        match self.discovery.uevents {
            UeventMode::Auto => self.discovery.sim.is_empty(),
            UeventMode::On => true,
            UeventMode::Off => false,
        }
    }

    /// The socket path, from the file or the defaults for `env`.
    pub fn socket_path(&self, env: &Environment) -> Result<PathBuf, ConfigError> {
        if let Some(p) = &self.socket.path {
            return Ok(p.clone());
        }
        env.fabric_runtime_dir().map(|d| d.join("fabricd.sock")).ok_or(ConfigError::NoDefault("socket.path"))
    }

    /// The state directory, from the file or the defaults for `env`.
    pub fn state_dir(&self, env: &Environment) -> Result<PathBuf, ConfigError> {
        if let Some(p) = &self.state.dir {
            return Ok(p.clone());
        }
        if env.root {
            return Ok(PathBuf::from("/var/lib/fabric"));
        }
        if let Some(s) = &env.state_home {
            return Ok(s.join("fabric"));
        }
        env.home.as_ref().map(|h| h.join(".local/state/fabric")).ok_or(ConfigError::NoDefault("state.dir"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(t: &str) -> Result<Config, ConfigError> {
        Config::parse(t, Path::new("test.toml"), Path::new("/etc/fabric"))
    }

    #[test]
    fn an_empty_file_is_the_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
    }

    const DOMAIN: &str = "[domain]\nname = \"d\"\nendpoints = [\"http://127.0.0.1:2379\"]\nnode = \"tray0\"\n";
    const FIXED: &str = "[map]\nnode_span = { fixed = 1099511627776 }\n";

    /// A period past any clock's range panicked the task that reads it (the monitor's
    /// rescan interval, the size check) when it first ticked.
    #[test]
    fn periods_and_graces_past_a_year_are_refused() {
        for key in
            ["discovery.rescan_interval_s", "memory.resume_grace_s", "memory.detach_grace_s", "memory.size_check_s"]
        {
            let (table, field) = key.split_once('.').unwrap();
            let at = |v: u64| parse(&format!("[{table}]\n{field} = {v}\n"));
            assert!(at(super::MAX_SECONDS).is_ok(), "{key}");
            let e = at(9_223_372_036_854_775_807).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("a year"), "{key}: {e}");
        }
    }

    #[test]
    fn a_domain_node_is_checked_against_the_rest() {
        let c = parse(&format!("{FIXED}{DOMAIN}")).unwrap();
        assert_eq!(c.domain.as_ref().map(|d| d.node.as_str()), Some("tray0"));
        assert_eq!(c.peer_address().as_deref(), Some("tray0:7471"));
        assert_eq!(parse("").unwrap().peer_address(), None);
        let refused = |t: String, key: &str| {
            let e = parse(&t).unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        };
        refused(DOMAIN.to_owned(), "map.node_span: a domain node needs a fixed node span");
        refused(format!("{FIXED}base = 1099511627776\n{DOMAIN}"), "map.base");
        refused(format!("{FIXED}[map.nodes.tray0]\nbase = 0\n{DOMAIN}"), "map.nodes");
        refused(format!("[map]\nnode_span = {{ fixed = 4096 }}\n{DOMAIN}"), "node_span");
        refused(format!("{FIXED}{}", DOMAIN.replace("tray0", "Tray 0")), "domain: node");
        refused(format!("{FIXED}{DOMAIN}[peer]\naddress = \"nowhere\"\n"), "peer.address");
        refused("[peer]\naddress = \"h:1\"\n".to_owned(), "only a domain node has peers");
        refused("[peer]\nca = \"ca.pem\"\n".to_owned(), "peer: only a domain node has peers");
        refused(format!("{FIXED}{DOMAIN}[peer]\nca = \"ca.pem\"\ncert = \"n.pem\"\n"), "ca, cert and key go together");
        let linked = parse(&format!("{FIXED}{DOMAIN}[peer]\nca = \"c\"\ncert = \"n\"\nkey = \"k\"\n")).unwrap();
        assert_eq!(linked.peer.credentials(), Some((Path::new("c"), Path::new("n"), Path::new("k"))));
        assert_eq!(linked.peer.answer_poll(), Duration::from_micros(250));
        let polled = |us: u32| format!("{FIXED}{DOMAIN}[peer]\nanswer_poll_us = {us}\n");
        assert_eq!(parse(&polled(0)).unwrap().peer.answer_poll(), Duration::ZERO);
        assert_eq!(parse(&polled(10_000)).unwrap().peer.answer_poll(), Duration::from_millis(10));
        refused(polled(10_001), "peer.answer_poll_us: 10001 is more than 10000");
        refused("[peer]\nanswer_poll_us = 5\n".to_owned(), "only a domain node has peers");
        refused(format!("[discovery]\nsim = [\"a.toml\"]\n{FIXED}{DOMAIN}"), "discovery.sim_node");
        refused(format!("[discovery]\nsim = [\"a.toml\"]\nsim_node = \"tray1\"\n{FIXED}{DOMAIN}"), "\"tray0\"");
        refused("[discovery]\nsim_node = \"tray1\"\n".to_owned(), "needs exactly one discovery.sim file");
        let c = parse(&format!("[discovery]\nsim = [\"a.toml\"]\nsim_node = \"tray0\"\n{FIXED}{DOMAIN}")).unwrap();
        assert_eq!(c.discovery.sim_node.as_deref(), Some("tray0"));
    }

    #[test]
    fn shares_of_shared_memory_are_checked_at_load() {
        let share = |device: &str, bytes: u64| format!("[[memory.shares]]\ndevice = {device:?}\nbytes = {bytes}\n");
        let good = share("serial:cxl/0x5eed0000", 64 << 20);
        let c = parse(&format!("{FIXED}{DOMAIN}{good}")).unwrap();
        assert_eq!(
            c.memory.shares,
            vec![ShareConfig { device: "serial:cxl/0x5eed0000".into(), bytes: 64 << 20, pool: None, coherent: false }]
        );
        assert_eq!(c.memory.shares[0].pool(), "serial:cxl_0x5eed0000");
        let coherent = parse(&format!(
            "{FIXED}{DOMAIN}{good}coherent = true
"
        ))
        .unwrap();
        assert!(coherent.memory.shares[0].coherent);
        let named = parse(&format!("{FIXED}{DOMAIN}{good}pool = \"rack4-pool\"\n")).unwrap();
        assert_eq!(named.memory.shares[0].pool(), "rack4-pool");
        let refused = |t: String, why: &str| {
            let e = parse(&t).unwrap_err().to_string();
            assert!(e.contains("memory.shares") && e.contains(why), "{why}: {e}");
        };
        refused(good.clone(), "add [domain]");
        refused(format!("{FIXED}{DOMAIN}{}", share("no device", 64 << 20)), "is not a device id");
        refused(format!("{FIXED}{DOMAIN}{good}{good}"), "listed twice");
        refused(format!("{FIXED}{DOMAIN}{}", share("serial:cxl/0x1", (64 << 20) + 4096)), "whole number of 2 MiB");
        refused(format!("{FIXED}{DOMAIN}{}", share("serial:cxl/0x1", 0)), "whole number of 2 MiB");
        let many: String = (0..=MAX_SHARES).map(|i| share(&format!("serial:cxl/{i:#x}"), 2 << 20)).collect();
        refused(format!("{FIXED}{DOMAIN}{many}"), "more than 32");
        refused(format!("{FIXED}{DOMAIN}{good}pool = \"a/b\"\n"), "pool \"a/b\" is not");
        refused(format!("{FIXED}{DOMAIN}{good}pool = \"\"\n"), "pool \"\" is not");
        let long = format!("serial:cxl/0x{}", "5".repeat(60));
        refused(format!("{FIXED}{DOMAIN}{}", share(&long, 2 << 20)), "name it with pool =");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let e = parse("[socket]\npath = \"/x\"\ngroupp = \"fabric\"\n").unwrap_err().to_string();
        assert!(e.contains("test.toml") && e.contains("line 3") && e.contains("groupp"), "{e}");
        let e = parse("[metrics]\nlisten = \"0.0.0.0:9477\"\n").unwrap_err().to_string();
        assert!(e.contains("metrics.listen") && e.contains("loopback"), "{e}");
        let e = parse("[discovery]\nbackends = [\"pci\", \"pci\"]\n").unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        let e = parse("[discovery]\nbackends = [\"gpu\"]\n").unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        let e = parse("[map]\naddress_bits = 12\n").unwrap_err().to_string();
        assert!(e.contains("map") && e.contains("address_bits"), "{e}");
        let e = parse("[dma]\nvfio = [\"00:04.0\"]\n").unwrap_err().to_string();
        assert!(e.contains("dma.vfio") && e.contains("00:04.0"), "{e}");
        let c = parse("[dma]\nvfio = [\"0000:00:04.0\"]\nvfio_verify_unmap = true\n").expect("valid");
        assert_eq!(c.dma, DmaConfig { vfio: vec!["0000:00:04.0".into()], vfio_verify_unmap: true });
        let e = parse("[limits]\nclients_per_uid = 0\n").unwrap_err().to_string();
        assert!(e.contains("limits.clients_per_uid") && e.contains("at least 1"), "{e}");
        let e = parse("[limits]\nimports_per_node = 0\n").unwrap_err().to_string();
        assert!(e.contains("limits.imports_per_node") && e.contains("at least 1"), "{e}");
    }

    #[test]
    fn defaults_follow_who_runs_the_daemon() {
        let c = Config::default();
        let root = Environment { root: true, ..Environment::default() };
        assert_eq!(c.socket_path(&root).unwrap(), PathBuf::from("/run/fabric/fabricd.sock"));
        assert_eq!(c.state_dir(&root).unwrap(), PathBuf::from("/var/lib/fabric"));
        let user = Environment {
            root: false,
            runtime_dir: Some("/run/user/1000".into()),
            state_home: None,
            home: Some("/home/u".into()),
        };
        assert_eq!(c.socket_path(&user).unwrap(), PathBuf::from("/run/user/1000/fabric/fabricd.sock"));
        assert_eq!(c.state_dir(&user).unwrap(), PathBuf::from("/home/u/.local/state/fabric"));
        assert!(matches!(c.socket_path(&Environment::default()), Err(ConfigError::NoDefault(_))));
    }

    #[test]
    fn uevents_auto_means_host_only() {
        assert!(parse("").unwrap().uevents_enabled());
        assert!(!parse("[discovery]\nsim = [\"a.toml\"]\n").unwrap().uevents_enabled());
        assert!(parse("[discovery]\nsim = [\"a.toml\"]\nuevents = \"on\"\n").unwrap().uevents_enabled());
        assert!(!parse("[discovery]\nuevents = \"off\"\n").unwrap().uevents_enabled());
        assert!(parse("[discovery]\nuevents = \"yes\"\n").is_err());
    }

    #[test]
    fn sim_paths_are_relative_to_the_file() {
        let c = parse("[discovery]\nsim = [\"sim/a.toml\", \"/abs/b.toml\"]\n").unwrap();
        assert_eq!(c.discovery.sim, vec![PathBuf::from("/etc/fabric/sim/a.toml"), PathBuf::from("/abs/b.toml")]);
    }
}
