//! `fabricctl bench register` and `fabricctl bench loadstore`: libfabric-mm's DMA
//! registration and direct load/store, each against a baseline measured in the same run.
//!
//! - `register`: a registration-cache hit (`hit_ns`, target ≤ 100 ns; its baseline is a
//!   bare `HashMap` lookup plus `Arc` clone, the least any cache can do), and a miss per
//!   MiB — a fresh daemon registration of a touched host buffer, pinned by fabricd — against
//!   `mlock` of a touched local buffer of the same bytes (target: `ratio` ≤ 1.5).
//! - `loadstore`: `memcpy` into an imported region mapped in the unified window against
//!   `memcpy` into a local buffer of the same size (target: `ratio` ≥ 0.95, import speed
//!   over local speed).
//!
//! A private fabricd keeps its state (the sim's HBM backing files) in `/dev/shm` when
//! there is one, so that sim device memory is RAM, as HBM would be.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_mm::{Access, CacheLimits, HostBuffer, MemoryClass, Policy, Session, SessionConfig, Target, WindowConfig};
use serde::Serialize;

use crate::bench_control::{ControlBenchError, start_daemon};

/// Why a DMA benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum DmaBenchError {
    /// The private daemon could not start.
    #[error("starting a private fabricd")]
    Daemon(#[source] ControlBenchError),
    /// A temporary directory could not be made.
    #[error("creating a temporary directory")]
    TempDir(#[source] std::io::Error),
    /// A library call failed.
    #[error("{what}")]
    Library {
        /// What was being done.
        what: &'static str,
        /// Why.
        #[source]
        source: fabric_mm::Error,
    },
    /// The fabric has no HBM.
    #[error("the daemon's fabric has no device with HBM")]
    NoHbm,
    /// `mlock` of the baseline buffer failed.
    #[error("mlock of the baseline buffer (run as root or raise `ulimit -l`)")]
    Mlock(#[source] std::io::Error),
}

fn lib(what: &'static str) -> impl FnOnce(fabric_mm::Error) -> DmaBenchError {
    move |source| DmaBenchError::Library { what, source }
}

/// What to run against.
#[derive(Debug, Clone)]
pub struct DmaOptions {
    /// A running daemon's socket; `None` starts a private fabricd on `sim`.
    pub daemon: Option<PathBuf>,
    /// The sim fabric for a private daemon.
    pub sim: PathBuf,
    /// Bytes per buffer.
    pub bytes: u64,
    /// Timed repetitions of the big operations (miss, mlock, memcpy).
    pub iterations: usize,
    /// Timed cache hits.
    pub hits: usize,
}

/// Result of `bench register`.
#[derive(Debug, Serialize)]
pub struct RegisterBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// Bytes per registration.
    pub bytes: u64,
    /// Timed misses (and mlocks).
    pub iterations: usize,
    /// Timed hits.
    pub hits: usize,
    /// A cache hit (`Session::register` of an already registered buffer and the drop of
    /// the result), mean ns of this thread's CPU time (target ≤ 100): on a shared machine
    /// the wall clock also counts the time other processes ran.
    pub hit_ns: f64,
    /// The same hits, mean ns of wall-clock time.
    pub hit_wall_ns: f64,
    /// Baseline for the hit: `HashMap` lookup + `Arc` clone and drop, mean ns of CPU time.
    pub hit_baseline_ns: f64,
    /// `hit_ns / hit_baseline_ns`.
    pub hit_ratio: f64,
    /// A miss (a fresh registration, pinned by fabricd), median, µs per MiB.
    pub miss_us_per_mib: f64,
    /// Baseline: `mlock` of a touched local buffer of the same bytes, median, µs per MiB.
    pub mlock_us_per_mib: f64,
    /// `miss_us_per_mib / mlock_us_per_mib` (target ≤ 1.5).
    pub ratio: f64,
    /// `hit_ns` ≤ 100.
    pub hit_target_met: bool,
    /// `ratio` ≤ 1.5.
    pub miss_target_met: bool,
}

/// Result of `bench loadstore`.
#[derive(Debug, Serialize)]
pub struct LoadstoreBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// Bytes per copy.
    pub bytes: u64,
    /// Timed copies of each kind.
    pub iterations: usize,
    /// `memcpy` into the mapped import, median, GB/s.
    pub import_gbps: f64,
    /// Baseline: `memcpy` into a local buffer of the same size, median, GB/s.
    pub local_gbps: f64,
    /// `import_gbps / local_gbps` (target ≥ 0.95).
    pub ratio: f64,
    /// `ratio` ≥ 0.95.
    pub target_met: bool,
}

/// A daemon to talk to: the private one lives as long as this.
struct Daemon {
    _dir: Option<tempfile::TempDir>,
    _child: Option<crate::bench_control::Reaped>,
    socket: PathBuf,
}

fn daemon(opts: &DmaOptions) -> Result<Daemon, DmaBenchError> {
    if let Some(s) = &opts.daemon {
        return Ok(Daemon { _dir: None, _child: None, socket: s.clone() });
    }
    let shm = Path::new("/dev/shm");
    let dir =
        if shm.is_dir() { tempfile::tempdir_in(shm) } else { tempfile::tempdir() }.map_err(DmaBenchError::TempDir)?;
    let (child, socket) = start_daemon(dir.path(), &opts.sim).map_err(DmaBenchError::Daemon)?;
    Ok(Daemon { _dir: Some(dir), _child: Some(child), socket })
}

fn session(socket: &Path) -> Result<Session, DmaBenchError> {
    Session::open_with(SessionConfig {
        socket: Some(socket.to_owned()),
        window: Some(WindowConfig::default()),
        client_name: Some("fabricctl-bench".into()),
        ..SessionConfig::default()
    })
    .map_err(lib("opening a session"))
}

fn hbm_device(s: &Session) -> Result<String, DmaBenchError> {
    Ok(s.first_device_with(MemoryClass::Hbm).map_err(lib("listing devices"))?.ok_or(DmaBenchError::NoHbm)?.id)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// This thread's CPU time so far.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Touches every page of a host buffer so that registering it measures pinning, not the
/// first fault.
fn touch(b: &HostBuffer) {
    // SAFETY: the buffer is not registered while it is filled.
    unsafe { b.as_mut_slice() }.fill(1);
}

/// Runs the register benchmark.
pub fn register(opts: &DmaOptions) -> Result<RegisterBench, DmaBenchError> {
    let d = daemon(opts)?;
    let s = session(&d.socket)?;
    let dev = hbm_device(&s)?;
    let n = opts.iterations.max(1);
    let hits = opts.hits.max(1);
    s.set_registration_cache(CacheLimits { entries: 1024, bytes: u64::MAX });

    // Hits: one miss, then the same registration again and again.
    let buf = s.alloc_host(opts.bytes).map_err(lib("allocating a host buffer"))?;
    touch(&buf);
    let first = s.register(&buf, &dev, Access::ReadWrite).map_err(lib("registering"))?;
    for _ in 0..hits.min(10_000) {
        drop(s.register(&buf, &dev, Access::ReadWrite).map_err(lib("registering (hit)"))?);
    }
    let (t, c) = (Instant::now(), thread_cpu());
    for _ in 0..hits {
        drop(std::hint::black_box(s.register(&buf, &dev, Access::ReadWrite).map_err(lib("registering (hit)"))?));
    }
    let hit_ns = (thread_cpu() - c).as_nanos() as f64 / hits as f64;
    let hit_wall_ns = t.elapsed().as_nanos() as f64 / hits as f64;
    drop(first);
    let map: HashMap<u64, Arc<u64>> = (0..1024u64).map(|k| (k, Arc::new(k))).collect();
    let c = thread_cpu();
    for i in 0..hits {
        drop(std::hint::black_box(map.get(&std::hint::black_box(i as u64 & 1023)).cloned()));
    }
    let hit_baseline_ns = (thread_cpu() - c).as_nanos() as f64 / hits as f64;

    // Misses against mlock, interleaved so that drift in the machine's load hits both.
    let local = s.alloc_host(opts.bytes).map_err(lib("allocating the baseline buffer"))?;
    touch(&local);
    let len = local.len() as usize;
    let (mut miss, mut lock) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..=n {
        let t = Instant::now();
        let r = s.register_uncached(&buf, &dev, Access::ReadWrite).map_err(lib("registering (miss)"))?;
        let m = t.elapsed();
        drop(r);
        let t = Instant::now();
        // SAFETY: mlock of our own mapped buffer; it changes no contents.
        if unsafe { libc::mlock(local.as_ptr().cast(), len) } != 0 {
            return Err(DmaBenchError::Mlock(std::io::Error::last_os_error()));
        }
        let l = t.elapsed();
        // SAFETY: as above.
        unsafe { libc::munlock(local.as_ptr().cast(), len) };
        if i > 0 {
            miss.push(m);
            lock.push(l);
        }
    }
    let mib = buf.len() as f64 / (1u64 << 20) as f64;
    let miss_us_per_mib = median(miss).as_secs_f64() * 1e6 / mib;
    let mlock_us_per_mib = median(lock).as_secs_f64() * 1e6 / mib;
    let ratio = miss_us_per_mib / mlock_us_per_mib.max(f64::MIN_POSITIVE);
    Ok(RegisterBench {
        bench: "register",
        bytes: buf.len(),
        iterations: n,
        hits,
        hit_ns,
        hit_wall_ns,
        hit_baseline_ns,
        hit_ratio: hit_ns / hit_baseline_ns.max(f64::MIN_POSITIVE),
        miss_us_per_mib,
        mlock_us_per_mib,
        ratio,
        hit_target_met: hit_ns <= 100.0,
        miss_target_met: ratio <= 1.5,
    })
}

fn copy_local(src: &[u8], local: &mut [u8]) -> Duration {
    let t = Instant::now();
    local.copy_from_slice(src);
    std::hint::black_box(local);
    t.elapsed()
}

/// Runs the load/store benchmark.
pub fn loadstore(opts: &DmaOptions) -> Result<LoadstoreBench, DmaBenchError> {
    let d = daemon(opts)?;
    let owner = session(&d.socket)?;
    let user = session(&d.socket)?;
    let dev = hbm_device(&owner)?;
    let target = Target::Device { device: dev, memory: MemoryClass::Hbm };
    let region = owner.alloc(&target, opts.bytes).map_err(lib("allocating a region"))?;
    let handle = owner.export(&region, &Policy::default()).map_err(lib("exporting"))?;
    let import = user.import(&handle, true).map_err(lib("importing"))?;
    let mapping = user.map(&import).map_err(lib("mapping the import"))?;
    let len = (opts.bytes as usize).min(mapping.len());
    let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let mut local = vec![0u8; len];
    let dst = mapping.as_ptr();
    let n = opts.iterations.max(1);
    let (mut imp, mut loc) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let into_import = || {
        let t = Instant::now();
        // SAFETY: `dst` has `len` writable bytes (a read-write mapping of at least `len`);
        // `src` is a distinct allocation; nothing else writes the region.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len) };
        std::hint::black_box(dst);
        t.elapsed()
    };
    // The first round of each faults the pages in and is not counted; the order alternates
    // so that neither side always runs with the source warm in the cache.
    for i in 0..=n {
        let (a, b) = if i % 2 == 0 {
            let a = into_import();
            (a, copy_local(&src, &mut local))
        } else {
            let b = copy_local(&src, &mut local);
            (into_import(), b)
        };
        if i > 0 {
            imp.push(a);
            loc.push(b);
        }
    }
    let gbps = |d: Duration| len as f64 / d.as_secs_f64().max(1e-12) / 1e9;
    let import_gbps = gbps(median(imp));
    let local_gbps = gbps(median(loc));
    let ratio = import_gbps / local_gbps.max(f64::MIN_POSITIVE);
    drop((mapping, import, region));
    Ok(LoadstoreBench {
        bench: "loadstore",
        bytes: len as u64,
        iterations: n,
        import_gbps,
        local_gbps,
        ratio,
        target_met: ratio >= 0.95,
    })
}
