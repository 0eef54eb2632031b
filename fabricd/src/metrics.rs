//! Prometheus metrics: request counters and latency histograms kept in atomics (no lock on
//! the request path), and the text exposition format (version 0.0.4) rendered per scrape.
//! [`http`](crate::transport::http) serves the page; `docs/fabricd.md` lists every metric.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use fabric_proto::wire::{ErrorCode, Opcode};
use fabric_topology::{BackendState, Fabric, LinkState};

use crate::memory::Counts;

/// Upper bounds of the request duration histogram buckets, in seconds (50 µs .. 5 s).
pub const BUCKETS_S: [f64; 16] =
    [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];
/// The same bounds in nanoseconds (what [`Histogram::observe`] compares with).
const BUCKETS_NS: [u64; 16] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
];

/// The `op` label values: every opcode, then `unknown` (a frame whose opcode is not known
/// or that could not be decoded).
const OPS: usize = Opcode::ALL.len() + 1;
/// The `result` label values: `ok`, then one per error code.
const RESULTS: [&str; 18] = [
    "ok",
    "bad_frame",
    "unknown_opcode",
    "unsupported_version",
    "not_negotiated",
    "bad_request",
    "permission_denied",
    "admin_required",
    "not_found",
    "invalid_handle",
    "revoked",
    "limit_exceeded",
    "no_space",
    "bad_fds",
    "unavailable",
    "internal",
    "not_implemented",
    "wrong_node",
];

fn result_index(code: Option<ErrorCode>) -> usize {
    match code {
        None => 0,
        Some(ErrorCode::BadFrame) => 1,
        Some(ErrorCode::UnknownOpcode) => 2,
        Some(ErrorCode::UnsupportedVersion) => 3,
        Some(ErrorCode::NotNegotiated) => 4,
        Some(ErrorCode::BadRequest) => 5,
        Some(ErrorCode::PermissionDenied) => 6,
        Some(ErrorCode::AdminRequired) => 7,
        Some(ErrorCode::NotFound) => 8,
        Some(ErrorCode::InvalidHandle) => 9,
        Some(ErrorCode::Revoked) => 10,
        Some(ErrorCode::LimitExceeded) => 11,
        Some(ErrorCode::NoSpace) => 12,
        Some(ErrorCode::BadFds) => 13,
        Some(ErrorCode::Unavailable) => 14,
        Some(ErrorCode::Internal) => 15,
        Some(ErrorCode::NotImplemented) => 16,
        Some(ErrorCode::WrongNode) => 17,
    }
}

fn op_index(op: Option<Opcode>) -> usize {
    op.and_then(|op| Opcode::ALL.iter().position(|o| *o == op)).unwrap_or(Opcode::ALL.len())
}

fn op_name(i: usize) -> &'static str {
    Opcode::ALL.get(i).map_or("unknown", |op| op.name())
}

/// What a received uevent was (`fabricd_uevents_total{kind}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UeventKind {
    /// From a fabric subsystem: asked for a rescan.
    Relevant,
    /// From another subsystem.
    Ignored,
    /// Not a kernel uevent (unparsable, or not sent by the kernel).
    Malformed,
}

const UEVENT_KINDS: [&str; 3] = ["relevant", "ignored", "malformed"];

/// What started a rescan (`fabricd_rescans_total{trigger}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RescanTrigger {
    /// `discovery.rescan_interval_s`.
    Interval,
    /// Kernel uevents.
    Uevent,
}

/// How a rescan ended (`fabricd_rescans_total{result}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RescanResult {
    /// The fabric changed.
    Changed,
    /// Nothing changed.
    Unchanged,
    /// Discovery or the map update failed; the fabric was kept.
    Failed,
}

const TRIGGERS: [&str; 2] = ["interval", "uevent"];
const RESCAN_RESULTS: [&str; 3] = ["changed", "unchanged", "failed"];

/// A latency histogram: per-bucket counts (not cumulative; made cumulative when rendered)
/// and the sum in nanoseconds.
#[derive(Debug, Default)]
pub struct Histogram {
    /// One slot per bound, then the overflow (`+Inf` only).
    buckets: [AtomicU64; BUCKETS_NS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let slot = BUCKETS_NS.iter().position(|b| ns <= *b).unwrap_or(BUCKETS_NS.len());
        self.buckets[slot].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Cumulative counts per bound, then the total (the `+Inf` bucket and `_count`), and
    /// the sum in seconds.
    pub fn read(&self) -> ([u64; BUCKETS_NS.len() + 1], f64) {
        let mut out = [0u64; BUCKETS_NS.len() + 1];
        let mut acc = 0u64;
        for (o, b) in out.iter_mut().zip(&self.buckets) {
            acc = acc.saturating_add(b.load(Ordering::Relaxed));
            *o = acc;
        }
        #[allow(clippy::cast_precision_loss)]
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (out, sum)
    }
}

/// The daemon's request metrics.
#[derive(Debug)]
pub struct Metrics {
    requests: [[AtomicU64; RESULTS.len()]; OPS],
    durations: [Histogram; OPS],
    /// The fabric part (devices, links, backends), rendered when the fabric changes.
    fabric_text: Mutex<String>,
    map_generation: AtomicU64,
    map_mapped_bytes: AtomicU64,
    uevents: [AtomicU64; UEVENT_KINDS.len()],
    uevent_overruns: AtomicU64,
    uevents_listening: AtomicBool,
    rescans: [[AtomicU64; RESCAN_RESULTS.len()]; TRIGGERS.len()],
    /// Finished copies and their bytes, by result (`fabricd_copies_total`,
    /// `fabricd_copy_bytes_total`).
    copies: [[AtomicU64; RESULTS.len()]; 2],
    /// Copy engines replaced because a chunk stalled in a client's own memory
    /// (`fabricd_copy_engines_stalled_total`).
    copy_engines_stalled: AtomicU64,
    /// Connections closed at accept, by the limit they hit (`fabricd_connections_refused_total`).
    refused: [AtomicU64; REFUSAL_LIMITS.len()],
}

/// The `limit` label of `fabricd_connections_refused_total`.
const REFUSAL_LIMITS: [&str; 2] = ["clients", "clients_per_uid"];

/// Which limit closed a connection at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientLimit {
    /// `limits.clients` (or fewer, by the open-file limit): all users together.
    Clients,
    /// `limits.clients_per_uid`: the connecting uid's.
    ClientsPerUid,
}

impl ClientLimit {
    /// The configuration key (and metric label) of the limit.
    pub fn name(self) -> &'static str {
        REFUSAL_LIMITS[self as usize]
    }
}

/// What the page shows besides what [`Metrics`] holds, read at scrape time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Live {
    /// Connected clients.
    pub sessions: u64,
    /// Sessions opened since start.
    pub sessions_total: u64,
    /// The memory registry's counters.
    pub memory: Counts,
    /// The domain's gauges, for a domain node.
    pub domain: Option<DomainGauges>,
}

/// What the metrics page shows of a domain node (read from the domain task's state).
#[derive(Debug, Clone, Copy, Default)]
pub struct DomainGauges {
    /// Members whose lease lives.
    pub live: u64,
    /// Nodes that hold a slot but whose lease ended.
    pub gone: u64,
    /// Nodes whose state this node cannot confirm while it is not joined (itself
    /// included): counted in neither of the above.
    pub unknown: u64,
    /// 1 while this node is joined (not fenced, etcd reachable at the last join).
    pub joined: bool,
    /// The last etcd round trip, in seconds.
    pub round_trip_s: Option<f64>,
    /// etcd requests that failed since start.
    pub etcd_errors: u64,
    /// Merges of the domain's topology since start (one per change of what it is made of,
    /// at the first request that needs it).
    pub topology_merges: u64,
    /// Whether this node leads the domain.
    pub leader: bool,
    /// The term of the leader this node knows of; none while not known.
    pub leader_term: Option<i64>,
    /// The node link's listener, while it listens.
    pub link: Option<LinkGauges>,
}

/// What the metrics page shows of the node link's listener.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinkGauges {
    /// What it did with the connections it accepted.
    pub stats: fabric_nodelink::LinkStats,
    /// The members' sources it admits first.
    pub member_sources: u64,
}

impl Metrics {
    /// Metrics for a daemon serving `fabric`, all counters at zero.
    pub fn new(fabric: &Fabric) -> Self {
        Self {
            requests: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            durations: std::array::from_fn(|_| Histogram::default()),
            fabric_text: Mutex::new(fabric_text(fabric, 0)),
            map_generation: AtomicU64::new(0),
            map_mapped_bytes: AtomicU64::new(0),
            uevents: std::array::from_fn(|_| AtomicU64::new(0)),
            uevent_overruns: AtomicU64::new(0),
            uevents_listening: AtomicBool::new(false),
            rescans: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            copies: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            copy_engines_stalled: AtomicU64::new(0),
            refused: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// Renders the device, link and backend gauges for `fabric` (after a rescan changed
    /// it); `missing` devices were seen since start and are gone now.
    pub fn set_fabric(&self, fabric: &Fabric, missing: u64) {
        let text = fabric_text(fabric, missing);
        *self.fabric_text.lock().unwrap_or_else(|p| p.into_inner()) = text;
    }

    /// Counts one received uevent.
    pub fn uevent(&self, kind: UeventKind) {
        let i = match kind {
            UeventKind::Relevant => 0,
            UeventKind::Ignored => 1,
            UeventKind::Malformed => 2,
        };
        self.uevents[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one uevent socket overrun (events lost).
    pub fn uevent_overrun(&self) {
        self.uevent_overruns.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the uevent listener runs.
    pub fn set_uevents_listening(&self, on: bool) {
        self.uevents_listening.store(on, Ordering::Relaxed);
    }

    /// Counts one rescan.
    pub fn rescan(&self, trigger: RescanTrigger, result: RescanResult) {
        let t = match trigger {
            RescanTrigger::Interval => 0,
            RescanTrigger::Uevent => 1,
        };
        let r = match result {
            RescanResult::Changed => 0,
            RescanResult::Unchanged => 1,
            RescanResult::Failed => 2,
        };
        self.rescans[t][r].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one answered request: its opcode (`None`: unknown or undecodable), its
    /// result (`None`: answered; else the error code) and how long it took.
    pub fn record(&self, op: Option<Opcode>, error: Option<ErrorCode>, took: Duration) {
        let o = op_index(op);
        self.requests[o][result_index(error)].fetch_add(1, Ordering::Relaxed);
        self.durations[o].observe(took);
    }

    /// Counts one connection closed at accept by `limit`.
    pub fn connection_refused(&self, limit: ClientLimit) {
        self.refused[limit as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one finished copy: its result (`None`: every byte copied; else why it
    /// stopped) and the bytes it moved.
    pub fn copy_done(&self, error: Option<ErrorCode>, bytes: u64) {
        let r = result_index(error);
        self.copies[0][r].fetch_add(1, Ordering::Relaxed);
        self.copies[1][r].fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts one copy engine replaced by the watchdog (a chunk stalled in a client's
    /// memory).
    pub fn copy_engine_stalled(&self) {
        self.copy_engines_stalled.fetch_add(1, Ordering::Relaxed);
    }

    /// Sets the address map gauges.
    pub fn set_map(&self, generation: u64, mapped_bytes: u64) {
        self.map_generation.store(generation, Ordering::Relaxed);
        self.map_mapped_bytes.store(mapped_bytes, Ordering::Relaxed);
    }

    /// The whole page in the text exposition format.
    pub fn render(&self, live: Live) -> String {
        let mut p = Page::default();
        p.family("fabricd_up", "gauge", "1 while fabricd serves.");
        p.sample("fabricd_up", &[], 1);
        p.family("fabricd_build_info", "gauge", "Always 1; the label names the fabricd version.");
        p.sample("fabricd_build_info", &[("version", env!("CARGO_PKG_VERSION"))], 1);

        p.family("fabricd_requests_total", "counter", "Requests answered, by operation and result.");
        for (o, row) in self.requests.iter().enumerate() {
            for (r, c) in row.iter().enumerate() {
                let n = c.load(Ordering::Relaxed);
                if n > 0 {
                    p.sample("fabricd_requests_total", &[("op", op_name(o)), ("result", RESULTS[r])], n);
                }
            }
        }
        p.family(
            "fabricd_request_duration_seconds",
            "histogram",
            "Time from a request read to its answer ready to send, by operation.",
        );
        for (o, h) in self.durations.iter().enumerate() {
            let (cum, sum) = h.read();
            let count = cum[BUCKETS_S.len()];
            if count > 0 {
                p.histogram("fabricd_request_duration_seconds", &[("op", op_name(o))], &cum, sum);
            }
        }

        for (i, (name, help)) in [
            ("fabricd_copies_total", "Copies finished by the copy engine, by result."),
            ("fabricd_copy_bytes_total", "Bytes moved by the copy engine, by the result of their copy."),
        ]
        .into_iter()
        .enumerate()
        {
            p.family(name, "counter", help);
            for (r, c) in self.copies[i].iter().enumerate() {
                let n = c.load(Ordering::Relaxed);
                if n > 0 || (r == 0 && i == 0) {
                    p.sample(name, &[("result", RESULTS[r])], n);
                }
            }
        }

        p.family(
            "fabricd_copy_engines_stalled_total",
            "counter",
            "Copy engine threads replaced because a chunk stalled in a client's own memory.",
        );
        p.sample("fabricd_copy_engines_stalled_total", &[], self.copy_engines_stalled.load(Ordering::Relaxed));

        p.family("fabricd_sessions", "gauge", "Connected clients.");
        p.sample("fabricd_sessions", &[], live.sessions);
        p.family("fabricd_sessions_total", "counter", "Client sessions opened since start.");
        p.sample("fabricd_sessions_total", &[], live.sessions_total);
        p.family(
            "fabricd_connections_refused_total",
            "counter",
            "Connections closed at accept, by the limit they hit.",
        );
        for (limit, n) in REFUSAL_LIMITS.iter().zip(&self.refused) {
            p.sample("fabricd_connections_refused_total", &[("limit", limit)], n.load(Ordering::Relaxed));
        }

        p.family("fabricd_map_generation", "gauge", "Generation of the global address map.");
        p.sample("fabricd_map_generation", &[], self.map_generation.load(Ordering::Relaxed));
        p.family("fabricd_map_mapped_bytes", "gauge", "Bytes of the address map that translate.");
        p.sample("fabricd_map_mapped_bytes", &[], self.map_mapped_bytes.load(Ordering::Relaxed));

        memory_series(&mut p, &live.memory);
        if let Some(d) = &live.domain {
            domain_series(&mut p, d);
        }

        p.family("fabricd_uevents_listening", "gauge", "1 while kernel uevents are listened to.");
        p.sample("fabricd_uevents_listening", &[], u8::from(self.uevents_listening.load(Ordering::Relaxed)));
        p.family("fabricd_uevents_total", "counter", "Kernel uevents received, by kind.");
        for (kind, n) in UEVENT_KINDS.iter().zip(&self.uevents) {
            p.sample("fabricd_uevents_total", &[("kind", kind)], n.load(Ordering::Relaxed));
        }
        p.family("fabricd_uevent_overruns_total", "counter", "Times the uevent socket overran (events lost).");
        p.sample("fabricd_uevent_overruns_total", &[], self.uevent_overruns.load(Ordering::Relaxed));
        p.family("fabricd_rescans_total", "counter", "Rescans, by what started them and how they ended.");
        for (trigger, row) in TRIGGERS.iter().zip(&self.rescans) {
            for (result, n) in RESCAN_RESULTS.iter().zip(row) {
                let labels = [("trigger", *trigger), ("result", *result)];
                p.sample("fabricd_rescans_total", &labels, n.load(Ordering::Relaxed));
            }
        }

        p.out.push_str(&self.fabric_text.lock().unwrap_or_else(|p| p.into_inner()));
        p.out
    }
}

/// The memory registry's gauges.
fn memory_series(p: &mut Page, m: &Counts) {
    let gauges: [(&str, &str, u64); 8] = [
        ("fabricd_regions", "Live regions of sim device memory (lost ones included).", m.regions),
        ("fabricd_regions_lost", "Regions whose device vanished or failed.", m.lost_regions),
        ("fabricd_exports", "Unrevoked exports.", m.exports),
        ("fabricd_imports", "Live imports.", m.imports),
        ("fabricd_allocated_bytes", "Bytes of live regions.", m.allocated_bytes),
        ("fabricd_imported_bytes", "Bytes of regions mapped by importers, summed over live imports.", m.imported_bytes),
        ("fabricd_pinned_bytes", "Bytes pinned for DMA by registrations.", m.pinned_bytes),
        (
            "fabricd_quarantined_bytes",
            "Bytes of freed regions held out of reuse while a node that imported them may still map them.",
            m.quarantined_bytes,
        ),
    ];
    for (name, help, v) in gauges {
        p.family(name, "gauge", help);
        p.sample(name, &[], v);
    }
}

/// The `fabricd_domain_*` series.
fn domain_series(p: &mut Page, d: &DomainGauges) {
    p.family(
        "fabricd_domain_members",
        "gauge",
        "Nodes of the domain, by state: live (lease alive), gone, or unknown (this node is not joined: its last view, unconfirmed).",
    );
    p.sample("fabricd_domain_members", &[("state", "live")], d.live);
    p.sample("fabricd_domain_members", &[("state", "gone")], d.gone);
    p.sample("fabricd_domain_members", &[("state", "unknown")], d.unknown);
    p.family("fabricd_domain_joined", "gauge", "1 while this node is joined to its domain (0: fenced or unreachable).");
    p.sample("fabricd_domain_joined", &[], u8::from(d.joined));
    if let Some(rtt) = d.round_trip_s {
        p.family("fabricd_domain_etcd_round_trip_seconds", "gauge", "Round trip of the last etcd probe.");
        p.sample("fabricd_domain_etcd_round_trip_seconds", &[], rtt);
    }
    p.family("fabricd_domain_etcd_errors_total", "counter", "etcd requests that failed.");
    p.sample("fabricd_domain_etcd_errors_total", &[], d.etcd_errors);
    p.family(
        "fabricd_domain_topology_merges_total",
        "counter",
        "Merges of the domain's topology records (after a node joined, left or rescanned, at the next request that reads it).",
    );
    p.sample("fabricd_domain_topology_merges_total", &[], d.topology_merges);
    p.family("fabricd_domain_leader", "gauge", "1 while this node leads its domain, else 0.");
    p.sample("fabricd_domain_leader", &[], u8::from(d.leader));
    if let Some(term) = d.leader_term {
        p.family("fabricd_domain_leader_term", "gauge", "Term of the domain's leader as this node knows it.");
        p.sample("fabricd_domain_leader_term", &[], term);
    }
    if let Some(link) = &d.link {
        link_series(p, link);
    }
}

/// The `fabricd_peer_*` series: the node link's listener.
fn link_series(p: &mut Page, l: &LinkGauges) {
    p.family(
        "fabricd_peer_connections_total",
        "counter",
        "Connections the node link's listener accepted, by what became of them: admitted, refused (a Hello that disagrees, the policy, busy), failed (no or a bad certificate, garbage, silence), closed at accept or ended for another (every handshake slot taken).",
    );
    let s = l.stats;
    for (outcome, n) in [
        ("admitted", s.admitted),
        ("refused", s.refused),
        ("failed", s.failed),
        ("closed_at_accept", s.closed_at_accept),
        ("ended_for_another", s.ended_for_another),
    ] {
        p.sample("fabricd_peer_connections_total", &[("outcome", outcome)], n);
    }
    p.family(
        "fabricd_peer_member_sources",
        "gauge",
        "Sources (IP addresses, an IPv6 /64 once) of the domain's members whose connections the node link's listener admits first.",
    );
    p.sample("fabricd_peer_member_sources", &[], l.member_sources);
}

/// `fabricd_devices`, `fabricd_device_states`, `fabricd_links` and
/// `fabricd_backend_present` for a fabric with `missing` vanished devices.
fn fabric_text(fabric: &Fabric, missing: u64) -> String {
    let inv = fabric.inventory();
    let mut devices: BTreeMap<String, u64> = BTreeMap::new();
    for d in &inv.devices {
        let kind = serde_json::to_value(d.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| format!("{:?}", d.kind).to_lowercase());
        *devices.entry(kind).or_default() += 1;
    }
    let mut links: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for l in &inv.links {
        let state = match l.state {
            LinkState::Up => "up",
            LinkState::Degraded => "degraded",
            LinkState::Down => "down",
        };
        *links.entry((l.kind.name(), state)).or_default() += 1;
    }
    let failed = inv.devices.iter().filter(|d| crate::tasks::monitor::failure(d).is_some()).count() as u64;
    let mut p = Page::default();
    p.family("fabricd_devices", "gauge", "Devices in the fabric, by kind.");
    for (kind, n) in &devices {
        p.sample("fabricd_devices", &[("kind", kind)], *n);
    }
    p.family(
        "fabricd_device_states",
        "gauge",
        "Devices by state: ok, failed (its backend reports a failure), missing (seen since start, gone now).",
    );
    let ok = (inv.devices.len() as u64).saturating_sub(failed);
    for (state, n) in [("ok", ok), ("failed", failed), ("missing", missing)] {
        p.sample("fabricd_device_states", &[("state", state)], n);
    }
    p.family("fabricd_links", "gauge", "Links in the fabric, by kind and state.");
    for ((kind, state), n) in &links {
        p.sample("fabricd_links", &[("kind", kind), ("state", state)], *n);
    }
    p.family("fabricd_backend_present", "gauge", "1 when the discovery backend is present, else 0.");
    for b in &inv.backends {
        let present = u64::from(matches!(b.state, BackendState::Present));
        p.sample("fabricd_backend_present", &[("backend", &b.backend)], present);
    }
    p.out
}

/// Escapes a label value: backslash, double quote and line feed.
pub fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// Escapes HELP text: backslash and line feed.
pub fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A page being written.
#[derive(Debug, Default)]
pub struct Page {
    /// The text so far.
    pub out: String,
}

impl Page {
    /// `# HELP` and `# TYPE` lines of a family.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One sample line.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.out.push_str(name);
        self.labels(labels, None);
        let _ = writeln!(self.out, " {value}");
    }

    /// The `_bucket`, `_sum` and `_count` lines of one histogram: `cumulative` has one count
    /// per bound of [`BUCKETS_S`] and then the total.
    pub fn histogram(&mut self, name: &str, labels: &[(&str, &str)], cumulative: &[u64], sum_s: f64) {
        for (i, n) in cumulative.iter().enumerate() {
            let le = BUCKETS_S.get(i).map_or_else(|| "+Inf".to_owned(), |b| format!("{b}"));
            let _ = write!(self.out, "{name}_bucket");
            self.labels(labels, Some(&le));
            let _ = writeln!(self.out, " {n}");
        }
        let total = cumulative.last().copied().unwrap_or(0);
        let _ = write!(self.out, "{name}_sum");
        self.labels(labels, None);
        let _ = writeln!(self.out, " {sum_s}");
        let _ = write!(self.out, "{name}_count");
        self.labels(labels, None);
        let _ = writeln!(self.out, " {total}");
    }

    fn labels(&mut self, labels: &[(&str, &str)], le: Option<&str>) {
        if labels.is_empty() && le.is_none() {
            return;
        }
        self.out.push('{');
        let mut first = true;
        for (k, v) in labels.iter().copied().chain(le.map(|le| ("le", le))) {
            if !first {
                self.out.push(',');
            }
            first = false;
            let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
        }
        self.out.push('}');
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn label_values_and_help_are_escaped() {
        assert_eq!(escape_label(r#"a\b"c"#), r#"a\\b\"c"#);
        assert_eq!(escape_label("x\ny"), "x\\ny");
        assert_eq!(escape_help("a\\b\nc \"q\""), "a\\\\b\\nc \"q\"");
        let mut p = Page::default();
        p.family("m", "gauge", "two\nlines");
        p.sample("m", &[("backend", "we\"ird\\\n")], 1);
        assert_eq!(p.out, "# HELP m two\\nlines\n# TYPE m gauge\nm{backend=\"we\\\"ird\\\\\\n\"} 1\n");
    }

    #[test]
    fn histogram_buckets_are_cumulative_with_inf_sum_and_count() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(10)); // first bucket (<= 50 µs)
        h.observe(Duration::from_micros(50)); // on the bound: still the first
        h.observe(Duration::from_micros(51)); // 100 µs bucket
        h.observe(Duration::from_millis(3)); // 5 ms bucket
        h.observe(Duration::from_secs(9)); // only +Inf
        let (cum, sum) = h.read();
        assert_eq!(cum[0], 2);
        assert_eq!(cum[1], 3);
        assert_eq!(cum[5], 3); // 2.5 ms
        assert_eq!(cum[6], 4); // 5 ms
        assert_eq!(cum[15], 4); // 5 s
        assert_eq!(cum[16], 5); // +Inf
        assert!(cum.windows(2).all(|w| w[0] <= w[1]));
        assert!((sum - 9.003111).abs() < 1e-9, "{sum}");

        let mut p = Page::default();
        p.histogram("h", &[("op", "status")], &cum, sum);
        let lines: Vec<&str> = p.out.lines().collect();
        assert_eq!(lines.len(), BUCKETS_S.len() + 3);
        assert_eq!(lines[0], "h_bucket{op=\"status\",le=\"0.00005\"} 2");
        assert_eq!(lines[15], "h_bucket{op=\"status\",le=\"5\"} 4");
        assert_eq!(lines[16], "h_bucket{op=\"status\",le=\"+Inf\"} 5");
        assert_eq!(lines[17], "h_sum{op=\"status\"} 9.003111");
        assert_eq!(lines[18], "h_count{op=\"status\"} 5");
    }

    #[test]
    fn render_counts_requests_by_op_and_result() {
        let inv = fabric_drivers::sim::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml"),
        )
        .unwrap();
        let fabric = Fabric::build(inv).unwrap();
        let m = Metrics::new(&fabric);
        m.record(Some(Opcode::Status), None, Duration::from_micros(70));
        m.record(Some(Opcode::Status), None, Duration::from_micros(70));
        m.record(Some(Opcode::Alloc), Some(ErrorCode::NotImplemented), Duration::from_micros(10));
        m.record(None, Some(ErrorCode::UnknownOpcode), Duration::from_micros(10));
        m.set_map(7, 1 << 30);
        let memory = Counts { regions: 3, allocated_bytes: 6 << 20, pinned_bytes: 2 << 20, ..Counts::default() };
        m.uevent(UeventKind::Relevant);
        m.uevent(UeventKind::Ignored);
        m.uevent(UeventKind::Ignored);
        m.rescan(RescanTrigger::Uevent, RescanResult::Changed);
        m.connection_refused(ClientLimit::ClientsPerUid);
        m.connection_refused(ClientLimit::ClientsPerUid);
        let domain = DomainGauges {
            live: 2,
            gone: 1,
            unknown: 0,
            joined: true,
            round_trip_s: Some(0.0005),
            etcd_errors: 4,
            topology_merges: 3,
            leader: true,
            leader_term: Some(12),
            link: Some(LinkGauges {
                stats: fabric_nodelink::LinkStats { admitted: 3, ended_for_another: 1, ..Default::default() },
                member_sources: 2,
            }),
        };
        let page = m.render(Live { sessions: 2, sessions_total: 5, memory, domain: Some(domain) });
        for want in [
            "fabricd_requests_total{op=\"status\",result=\"ok\"} 2\n",
            "fabricd_requests_total{op=\"alloc\",result=\"not_implemented\"} 1\n",
            "fabricd_requests_total{op=\"unknown\",result=\"unknown_opcode\"} 1\n",
            "fabricd_request_duration_seconds_bucket{op=\"status\",le=\"0.00005\"} 0\n",
            "fabricd_request_duration_seconds_bucket{op=\"status\",le=\"0.0001\"} 2\n",
            "fabricd_request_duration_seconds_count{op=\"status\"} 2\n",
            "fabricd_sessions 2\n",
            "fabricd_sessions_total 5\n",
            "fabricd_connections_refused_total{limit=\"clients\"} 0\n",
            "fabricd_connections_refused_total{limit=\"clients_per_uid\"} 2\n",
            "fabricd_map_generation 7\n",
            "fabricd_domain_members{state=\"live\"} 2\n",
            "fabricd_domain_members{state=\"gone\"} 1\n",
            "fabricd_domain_members{state=\"unknown\"} 0\n",
            "fabricd_domain_joined 1\n",
            "fabricd_domain_etcd_round_trip_seconds 0.0005\n",
            "fabricd_domain_etcd_errors_total 4\n",
            "fabricd_domain_topology_merges_total 3\n",
            "fabricd_domain_leader 1\n",
            "fabricd_domain_leader_term 12\n",
            "fabricd_peer_connections_total{outcome=\"admitted\"} 3\n",
            "fabricd_peer_connections_total{outcome=\"closed_at_accept\"} 0\n",
            "fabricd_peer_connections_total{outcome=\"ended_for_another\"} 1\n",
            "fabricd_peer_member_sources 2\n",
            "fabricd_map_mapped_bytes 1073741824\n",
            "fabricd_devices{kind=\"gpu\"} 8\n",
            "fabricd_regions 3\n",
            "fabricd_allocated_bytes 6291456\n",
            "fabricd_pinned_bytes 2097152\n",
            "fabricd_exports 0\n",
            "fabricd_uevents_total{kind=\"relevant\"} 1\n",
            "fabricd_uevents_total{kind=\"ignored\"} 2\n",
            "fabricd_rescans_total{trigger=\"uevent\",result=\"changed\"} 1\n",
            "fabricd_rescans_total{trigger=\"interval\",result=\"changed\"} 0\n",
            "fabricd_device_states{state=\"missing\"} 0\n",
            "fabricd_build_info{version=\"",
            "fabricd_up 1\n",
        ] {
            assert!(page.contains(want), "missing {want:?} in\n{page}");
        }
        assert!(!page.contains("op=\"hello\""), "series that never moved are left out");
        let links: u64 = page
            .lines()
            .filter(|l| l.starts_with("fabricd_links{"))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum();
        assert_eq!(links as usize, fabric.inventory().links.len());
        let devices = fabric.inventory().devices.len();
        assert!(page.contains(&format!("fabricd_device_states{{state=\"ok\"}} {devices}\n")), "{page}");
        // A rescan's fabric replaces the gauges.
        let mut inv = fabric.inventory().clone();
        let gpu = inv.devices.iter().position(|d| d.kind == fabric_topology::DeviceKind::Gpu).unwrap();
        inv.devices[gpu].attrs.insert(crate::tasks::monitor::FAILED_ATTR.into(), "fell off the bus".into());
        m.set_fabric(&Fabric::build(inv).unwrap(), 2);
        let page = m.render(Live::default());
        for want in [
            "fabricd_device_states{state=\"failed\"} 1\n".to_owned(),
            "fabricd_device_states{state=\"missing\"} 2\n".to_owned(),
            format!("fabricd_device_states{{state=\"ok\"}} {}\n", devices - 1),
        ] {
            assert!(page.contains(&want), "missing {want:?} in\n{page}");
        }
        // Every family has exactly one HELP and one TYPE line.
        for fam in page.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let name = fam.split(' ').next().unwrap();
            assert_eq!(page.matches(&format!("# HELP {name} ")).count(), 1, "{name}");
        }
    }
}
