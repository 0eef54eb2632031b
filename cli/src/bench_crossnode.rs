//! `fabricctl bench crossnode`: import + map + unmap through libfabric-mm of a region
//! exported on one domain node, from a session on another node (asked over the node link)
//! against the same from a session on the owner node, in the same run; stores into the
//! remote mapping against stores into a local buffer; and how long an owner's revoke
//! takes to reach the remote importer's callback. Runs against two running nodes of one
//! domain with a node link and the sim's shared fabric (`scripts/domain.sh up 2`); with
//! `--net-importer`, a third node off the shared fabric, against which `bench netcopy`
//! runs too, so that one JSON carries every figure (`netcopy_ratio` and the `netcopy`
//! document; `FABRIC_DOMAIN_NET=1 scripts/domain.sh up 3`).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fabric_mm::{MemoryClass, Policy, Session, SessionConfig, Target, WindowConfig};
use fabric_proto::wire::{DomainAction, DomainRequest, Request, Response};
use serde::Serialize;

use crate::bench_control::{self, ControlBenchError};
use crate::bench_libcontrol::{LibControlBenchError, lib_err};
use crate::bench_netcopy::{self, NetCopyBench, NetCopyOptions};

/// Result of `bench crossnode`; latencies in microseconds.
#[derive(Debug, Serialize)]
pub struct CrossNodeBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// Round trips timed per figure.
    pub iterations: usize,
    /// Size of the region, bytes.
    pub region_bytes: u64,
    /// Import + map + unmap from a session on another node, median.
    pub remote_import_p50_us: f64,
    /// The same, 99th percentile.
    pub remote_import_p99_us: f64,
    /// Import + map + unmap from a session on the owner node, median (baseline).
    pub local_import_p50_us: f64,
    /// The same, 99th percentile.
    pub local_import_p99_us: f64,
    /// `remote_import_p50_us / local_import_p50_us` (target ≤ 2).
    pub import_ratio: f64,
    /// A round trip of a 512-byte message over a raw TLS stream on loopback with the node
    /// link's configuration, median: what any request over the link adds at the least.
    pub tls_round_trip_p50_us: f64,
    /// `(local_import_p50_us + tls_round_trip_p50_us) / local_import_p50_us`: the ratio a
    /// remote import that cost a local one plus one bare TLS round trip would reach.
    pub import_floor_ratio: f64,
    /// Bandwidth of copying into the remote mapping over copying into a local buffer
    /// (target ≥ 0.95).
    pub remote_loadstore_ratio: f64,
    /// Owner's revoke to the remote importer's callback, median.
    pub revoke_p50_us: f64,
    /// The same, worst.
    pub revoke_max_us: f64,
    /// `bench netcopy`'s push over a raw TCP stream (target ≥ 0.8), with `--net-importer`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netcopy_ratio: Option<f64>,
    /// `bench netcopy`'s whole document, with `--net-importer`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub netcopy: Option<NetCopyBench>,
}

/// What to run against.
#[derive(Debug, Clone)]
pub struct CrossNodeOptions {
    /// The owner node's socket.
    pub owner: PathBuf,
    /// The importer node's socket.
    pub importer: PathBuf,
    /// Round trips per figure.
    pub iterations: usize,
    /// A node that shares no memory fabric with the owner (class NET): `bench netcopy`
    /// runs against it too.
    pub net_importer: Option<PathBuf>,
    /// Bytes per copy of that run.
    pub net_bytes: u64,
}

/// The owner node's slot and node span, from its `domain status`.
fn slot(socket: &Path) -> Result<(u64, u64), LibControlBenchError> {
    let mut c = bench_control::connect(socket)?;
    let req = Request::Domain(DomainRequest { action: DomainAction::Status });
    let (resp, _) =
        c.call(req, &[]).map_err(|source| ControlBenchError::Call { what: "domain status".into(), source })?;
    let Response::Domain(doc) = resp else { return Err(ControlBenchError::Unexpected("domain status").into()) };
    let v: serde_json::Value =
        serde_json::from_str(&doc.json).map_err(|_| ControlBenchError::Unexpected("domain status"))?;
    let slot = v["self"]["slot"].as_u64().ok_or(ControlBenchError::Unexpected("domain status (not a domain node)"))?;
    let span = v["settings"]["node_span"].as_u64().ok_or(ControlBenchError::Unexpected("domain status settings"))?;
    Ok((slot, span))
}

fn session(socket: &Path, gfa: u64, len: u64) -> Result<Session, LibControlBenchError> {
    Session::open_with(SessionConfig {
        socket: Some(socket.to_owned()),
        window: Some(WindowConfig { gfa, len }),
        client_name: Some("fabricctl-bench-crossnode".into()),
        ..SessionConfig::default()
    })
    .map_err(lib_err("opening a session"))
}

/// Bytes per second of copying `src` into `dst` `rounds` times.
fn copy_rate(dst: *mut u8, src: &[u8], rounds: usize) -> f64 {
    let start = Instant::now();
    for _ in 0..rounds {
        // SAFETY: `dst` points to at least `src.len()` writable bytes (a mapping or a
        // buffer of that size the caller holds), which nothing else touches meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        std::hint::black_box(dst);
    }
    (src.len() * rounds) as f64 / start.elapsed().as_secs_f64().max(f64::MIN_POSITIVE)
}

/// Runs the cross-node benchmark.
pub fn crossnode(opts: &CrossNodeOptions) -> Result<CrossNodeBench, LibControlBenchError> {
    let n = opts.iterations.max(1);
    let (slot, span) = slot(&opts.owner)?;
    let device = bench_control::hbm_device(&mut bench_control::connect(&opts.owner)?)?;
    let owner = session(&opts.owner, slot * span, span)?;
    let local = session(&opts.owner, slot * span, span)?;
    let remote = session(&opts.importer, slot * span, span)?;
    let region_bytes: u64 = 2 << 20;
    let region =
        owner.alloc(&Target::Device { device, memory: MemoryClass::Hbm }, region_bytes).map_err(lib_err("alloc"))?;
    let handle = owner.export(&region, &Policy::default()).map_err(lib_err("export"))?;
    let round = |s: &Session, into: &mut Vec<Duration>| -> Result<(), LibControlBenchError> {
        let start = Instant::now();
        let import = s.import(&handle, true).map_err(lib_err("import"))?;
        let mapping = s.map(&import).map_err(lib_err("map"))?;
        drop(mapping);
        into.push(start.elapsed());
        drop(import);
        Ok(())
    };
    let warm = (n / 10).max(5);
    for _ in 0..warm {
        round(&local, &mut Vec::new())?;
        round(&remote, &mut Vec::new())?;
    }
    let (mut local_t, mut remote_t) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut tls_t = Vec::with_capacity(n);
    let mut tls = bench_netcopy::TlsEcho::start(512)?;
    tls.round_trips(warm)?;
    // Interleaved, so that drift in the machine's load hits all alike: chunks of 100
    // imports each, then as many TLS round trips.
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        for _ in chunk {
            round(&local, &mut local_t)?;
            round(&remote, &mut remote_t)?;
        }
        tls_t.extend(tls.round_trips(chunk.len())?);
    }
    drop(tls);

    // Stores: into the remote mapping vs into a local buffer, the same bytes.
    let import = remote.import(&handle, true).map_err(lib_err("import"))?;
    let mapping = remote.map(&import).map_err(lib_err("map"))?;
    let src = vec![0x5au8; region_bytes as usize];
    let mut buf = vec![0u8; region_bytes as usize];
    let rounds = 64;
    copy_rate(mapping.as_ptr(), &src, rounds / 8);
    copy_rate(buf.as_mut_ptr(), &src, rounds / 8);
    let (mut remote_rate, mut local_rate) = (0.0f64, 0.0f64);
    for _ in 0..3 {
        remote_rate = remote_rate.max(copy_rate(mapping.as_ptr(), &src, rounds));
        local_rate = local_rate.max(copy_rate(buf.as_mut_ptr(), &src, rounds));
    }
    drop(mapping);
    drop(import);

    // Revocation reach: a fresh export per round, imported remotely, then revoked.
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    remote.on_revocation(move |_| {
        let _ = tx.lock().map(|t| t.send(Instant::now()));
    });
    let mut reach = Vec::new();
    for _ in 0..n.min(200) {
        let h = owner.export(&region, &Policy::default()).map_err(lib_err("export"))?;
        let import = remote.import(&h, false).map_err(lib_err("import"))?;
        let start = Instant::now();
        owner.revoke(&h).map_err(lib_err("revoke"))?;
        let at = rx.recv_timeout(Duration::from_secs(5)).map_err(|_| ControlBenchError::Unexpected("revocation"))?;
        reach.push(at.saturating_duration_since(start));
        drop(import);
    }
    drop(region);
    let netcopy = match &opts.net_importer {
        Some(net) => Some(bench_netcopy::netcopy(&NetCopyOptions {
            owner: opts.owner.clone(),
            importer: net.clone(),
            bytes: opts.net_bytes,
            rounds: 3,
            netns: None,
        })?),
        None => None,
    };
    let (remote_import_p50_us, remote_import_p99_us) = bench_control::p50_p99(remote_t);
    let (local_import_p50_us, local_import_p99_us) = bench_control::p50_p99(local_t);
    let (tls_round_trip_p50_us, _) = bench_control::p50_p99(tls_t);
    let local_p50 = local_import_p50_us.max(f64::MIN_POSITIVE);
    let revoke_max_us = reach.iter().max().map_or(0.0, |d| d.as_secs_f64() * 1e6);
    let (revoke_p50_us, _) = bench_control::p50_p99(reach);
    Ok(CrossNodeBench {
        bench: "crossnode",
        iterations: n,
        region_bytes,
        remote_import_p50_us,
        remote_import_p99_us,
        local_import_p50_us,
        local_import_p99_us,
        import_ratio: remote_import_p50_us / local_p50,
        tls_round_trip_p50_us,
        import_floor_ratio: (local_import_p50_us + tls_round_trip_p50_us) / local_p50,
        remote_loadstore_ratio: remote_rate / local_rate.max(f64::MIN_POSITIVE),
        revoke_p50_us,
        revoke_max_us,
        netcopy_ratio: netcopy.as_ref().map(|n| n.netcopy_ratio),
        netcopy,
    })
}
