//! `fabricctl bench copy`: the bandwidth of fabricd's copy engine against a single-thread
//! `memcpy` of the same size, measured in the same run, for each copy size and for 1, 2,
//! 4... engines (a private fabricd restarted with `copy.engines = k` for each).
//!
//! An engine copy is timed from the `Copy` request to its `CopyDone` event on the
//! client, so it includes the round trip; both regions are registered for DMA (when the
//! daemon may pin them) so that the engine copies between its pinned mappings, and the
//! same copy by GFA (which maps the region per chunk) is reported beside it. The baseline
//! copies between two buffers of this process, both faulted in beforehand.
//! The private daemon's state dir is on `/dev/shm` when it exists, as sim device memory
//! is shared memory.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, CodecError, Connection, CopyEndpoint, CopyRequest, CopyResult, DeviceName,
    Event, MemoryClass, RegisterRequest, RegisterSource, Request, Response, SUPPORTED_VERSIONS,
};
use serde::Serialize;

use crate::bench_control::{self, ControlBenchError, start_daemon_with};

/// Why the copy benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum CopyBenchError {
    /// A file, socket or process step failed.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A protocol call failed.
    #[error("{what}")]
    Call {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: CodecError,
    },
    /// The private fabricd did not start, or the devices it serves could not be read.
    #[error(transparent)]
    Daemon(#[from] ControlBenchError),
    /// A copy did not complete whole.
    #[error("copy of {len} bytes failed: {result:?}")]
    CopyFailed {
        /// Bytes.
        len: u64,
        /// How it ended.
        result: CopyResult,
    },
    /// An answer of the wrong kind, or no HBM to allocate from.
    #[error("unexpected: {0}")]
    Unexpected(&'static str),
    /// Bad options.
    #[error("{0}")]
    Options(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> CopyBenchError {
    let what = what.into();
    move |source| CopyBenchError::Io { what, source }
}

fn call_err(what: &'static str) -> impl FnOnce(CodecError) -> CopyBenchError {
    move |source| CopyBenchError::Call { what: what.to_owned(), source }
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// The sim fabric the private daemon serves.
    pub sim: PathBuf,
    /// Copy sizes, bytes.
    pub sizes: Vec<u64>,
    /// Engine counts, one private daemon each.
    pub engines: Vec<u32>,
    /// Timed copies per size (the median is reported).
    pub iterations: usize,
}

/// One size under one engine count; bandwidths in GB/s (10^9 bytes per second).
#[derive(Debug, Clone, Serialize)]
pub struct CopyPoint {
    /// Bytes per copy.
    pub size: u64,
    /// The engine's bandwidth (registration endpoints, or GFA when the daemon could not
    /// pin: see `endpoints`), request to completion.
    pub engine_gbps: f64,
    /// The same copies by GFA.
    pub gfa_gbps: f64,
    /// Single-thread memcpy of the same size in this process, measured just before.
    pub memcpy_gbps: f64,
    /// `engine_gbps / memcpy_gbps`.
    pub ratio: f64,
}

/// One private daemon's run.
#[derive(Debug, Clone, Serialize)]
pub struct EngineRun {
    /// `copy.engines`.
    pub engines: u32,
    /// Each size.
    pub points: Vec<CopyPoint>,
    /// The smallest ratio over sizes of 1 MiB and more (over all sizes if none is).
    pub ratio_min: f64,
}

/// Result of `bench copy`.
#[derive(Debug, Serialize)]
pub struct CopyBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// What the engine copies between: `registration` or `gfa`.
    pub endpoints: &'static str,
    /// Copies timed per size and engine count.
    pub iterations: usize,
    /// The engine count whose smallest ratio at 1 MiB and more is the best; the figures
    /// below are its.
    pub engines: u32,
    /// The engine's bandwidth at the largest size, GB/s.
    pub engine_gbps: f64,
    /// memcpy at that size, GB/s.
    pub memcpy_gbps: f64,
    /// Their ratio (target: at least 0.9 for copies of 1 MiB and more).
    pub ratio: f64,
    /// The smallest ratio at 1 MiB and more of that engine count.
    pub ratio_min: f64,
    /// Whether `ratio_min >= 0.9`.
    pub target_met: bool,
    /// Each engine count.
    pub runs: Vec<EngineRun>,
}

fn connect(socket: &Path) -> Result<Connection, CopyBenchError> {
    let s = UnixStream::connect(socket).map_err(io_err(format!("connecting to {}", socket.display())))?;
    s.set_read_timeout(Some(Duration::from_secs(60))).map_err(io_err("setting a read timeout"))?;
    let mut c = Connection::new(s);
    c.hello("fabricctl-bench-copy", SUPPORTED_VERSIONS).map_err(call_err("hello"))?;
    Ok(c)
}

/// A region's GFA and, when the daemon could pin it, its registration.
struct Side {
    gfa: u64,
    registration: Option<u64>,
}

fn region(c: &mut Connection, device: &str, size: u64) -> Result<Side, CopyBenchError> {
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Hbm },
        size,
        align: 0,
    });
    let (resp, _fds) = c.call(req, &[]).map_err(call_err("alloc"))?;
    let Response::Alloc(a) = resp else { return Err(CopyBenchError::Unexpected("alloc answer")) };
    let gfa = a.gfa.ok_or(CopyBenchError::Unexpected("a region without a GFA"))?;
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(device),
        source: RegisterSource::Region(a.region),
        offset: 0,
        len: size,
        access: AccessMode::ReadWrite,
    });
    let registration = match c.call(req, &[]) {
        Ok((Response::Register(r), _)) => Some(r.registration),
        // Pinning refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK): the GFA path only.
        _ => None,
    };
    Ok(Side { gfa, registration })
}

fn endpoint(s: &Side, by_gfa: bool) -> CopyEndpoint {
    match (s.registration, by_gfa) {
        (Some(id), false) => CopyEndpoint::Registration { id, offset: 0 },
        _ => CopyEndpoint::Gfa(s.gfa),
    }
}

/// One engine copy, request to completion.
fn engine_copy(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> Result<Duration, CopyBenchError> {
    let t = Instant::now();
    let (resp, _) = c.call(Request::Copy(CopyRequest { dst, src, len }), &[]).map_err(call_err("copy"))?;
    let Response::Copy(r) = resp else { return Err(CopyBenchError::Unexpected("copy answer")) };
    loop {
        if let Event::CopyDone(d) = c.next_event().map_err(call_err("copy completion"))?
            && d.copy == r.copy
        {
            let took = t.elapsed();
            return match d.result {
                CopyResult::Ok => Ok(took),
                result => Err(CopyBenchError::CopyFailed { len, result }),
            };
        }
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

/// Median single-thread memcpy time of `len` bytes between `a` and `b`.
fn memcpy_time(a: &[u8], b: &mut [u8], len: usize, iterations: usize) -> Duration {
    b[..len].copy_from_slice(&a[..len]);
    let times = (0..iterations)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(&mut b[..len]).copy_from_slice(std::hint::black_box(&a[..len]));
            t.elapsed()
        })
        .collect();
    median(times)
}

fn run_one(
    opts: &CopyOptions,
    engines: u32,
    base: &Path,
    bufs: (&[u8], &mut [u8]),
) -> Result<(EngineRun, bool), CopyBenchError> {
    let dir = tempfile::Builder::new()
        .prefix("fabricctl-bench-copy-")
        .tempdir_in(base)
        .map_err(io_err(format!("a scratch directory in {}", base.display())))?;
    let (_daemon, socket) = start_daemon_with(dir.path(), &opts.sim, &format!("[copy]\nengines = {engines}\n"))?;
    let mut c = connect(&socket)?;
    let device = bench_control::hbm_device(&mut c)?;
    let max = opts.sizes.iter().copied().max().unwrap_or(0);
    let (src, dst) = (region(&mut c, &device, max)?, region(&mut c, &device, max)?);
    let registered = src.registration.is_some() && dst.registration.is_some();
    // Fault everything in once (the engine's first touch of region memory).
    engine_copy(&mut c, endpoint(&dst, false), endpoint(&src, false), max)?;
    let (a, b) = bufs;
    let mut points = Vec::new();
    for &size in &opts.sizes {
        let memcpy = memcpy_time(a, b, size as usize, opts.iterations);
        let mut time = |by_gfa| -> Result<Duration, CopyBenchError> {
            let (d, s) = (endpoint(&dst, by_gfa || !registered), endpoint(&src, by_gfa || !registered));
            engine_copy(&mut c, d, s, size)?;
            let v = (0..opts.iterations).map(|_| engine_copy(&mut c, d, s, size)).collect::<Result<Vec<_>, _>>()?;
            Ok(median(v))
        };
        let engine = time(false)?;
        let gfa = time(true)?;
        let (engine_gbps, memcpy_gbps) = (gbps(size, engine), gbps(size, memcpy));
        points.push(CopyPoint {
            size,
            engine_gbps,
            gfa_gbps: gbps(size, gfa),
            memcpy_gbps,
            ratio: engine_gbps / memcpy_gbps,
        });
    }
    let big: Vec<f64> = points.iter().filter(|p| p.size >= 1 << 20).map(|p| p.ratio).collect();
    let pool = if big.is_empty() { points.iter().map(|p| p.ratio).collect() } else { big };
    let ratio_min = pool.into_iter().fold(f64::INFINITY, f64::min);
    Ok((EngineRun { engines, points, ratio_min }, registered))
}

/// Runs the benchmark.
pub fn copy(opts: &CopyOptions) -> Result<CopyBench, CopyBenchError> {
    if opts.sizes.is_empty() || opts.engines.is_empty() || opts.iterations == 0 {
        return Err(CopyBenchError::Options("need at least one size, one engine count and one iteration".into()));
    }
    if let Some(s) = opts.sizes.iter().find(|&&s| s == 0 || s > 1 << 30) {
        return Err(CopyBenchError::Options(format!("size {s} is out of range (1 byte to 1 GiB)")));
    }
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() };
    let max = opts.sizes.iter().copied().max().unwrap_or(0) as usize;
    let a: Vec<u8> = (0..max).map(|i| i as u8).collect();
    let mut b = vec![1u8; max];
    let mut runs = Vec::new();
    let mut all_registered = true;
    for &k in &opts.engines {
        let (run, registered) = run_one(opts, k, &base, (&a, &mut b))?;
        all_registered &= registered;
        runs.push(run);
    }
    // The engine count whose worst ratio (at 1 MiB and more) is best.
    let best = runs.iter().max_by(|x, y| x.ratio_min.total_cmp(&y.ratio_min));
    let engines = best.map_or(0, |r| r.engines);
    let ratio_min = best.map_or(0.0, |r| r.ratio_min);
    let largest = best.and_then(|r| r.points.iter().max_by_key(|p| p.size));
    let (engine_gbps, memcpy_gbps, ratio) =
        largest.map_or((0.0, 0.0, 0.0), |p| (p.engine_gbps, p.memcpy_gbps, p.ratio));
    Ok(CopyBench {
        bench: "copy",
        endpoints: if all_registered { "registration" } else { "gfa" },
        iterations: opts.iterations,
        engines,
        engine_gbps,
        memcpy_gbps,
        ratio,
        ratio_min,
        target_met: ratio_min >= 0.9,
        runs,
    })
}
