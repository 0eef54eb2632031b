//! `fabricctl bench libcontrol`: the control path as an application sees it through
//! libfabric-mm: import + map + unmap of an exported region, timed round trip, against the
//! same bare Unix-socket echo (same framing, separate process) as `bench control`, in the
//! same run. Also the library's own no-op (`Session::ping`) against that echo, which is
//! what the library's connection (reader thread, request multiplexing) adds.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use fabric_mm::{MemoryClass, Policy, Session, SessionConfig, Target, WindowConfig};
use serde::Serialize;

use crate::bench_control::{self, ControlBenchError};

/// Why the library benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum LibControlBenchError {
    /// Starting the daemon or the echo server, or the echo itself.
    #[error(transparent)]
    Control(#[from] ControlBenchError),
    /// A library call failed.
    #[error("{what}")]
    Library {
        /// What was being done.
        what: &'static str,
        /// Why.
        #[source]
        source: fabric_mm::Error,
    },
}

pub(crate) fn lib_err(what: &'static str) -> impl FnOnce(fabric_mm::Error) -> LibControlBenchError {
    move |source| LibControlBenchError::Library { what, source }
}

/// Result of `bench libcontrol`; latencies in microseconds.
#[derive(Debug, Serialize)]
pub struct LibControlBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// Round trips timed per figure.
    pub iterations: usize,
    /// Size of the region imported and mapped, bytes.
    pub region_bytes: u64,
    /// Bare echo with the same framing (baseline), median.
    pub echo_p50_us: f64,
    /// Bare echo, 99th percentile.
    pub echo_p99_us: f64,
    /// `Session::ping` through the library and fabricd, median.
    pub lib_noop_p50_us: f64,
    /// `Session::ping`, 99th percentile.
    pub lib_noop_p99_us: f64,
    /// `Session::import` + `Session::map` + dropping the mapping (unmap), median.
    pub import_map_p50_us: f64,
    /// The same, 99th percentile.
    pub import_map_p99_us: f64,
    /// `lib_noop_p50_us / echo_p50_us`.
    pub noop_ratio: f64,
    /// `import_map_p50_us / echo_p50_us` (target ≤ 3).
    pub ratio: f64,
}

/// What to run against.
#[derive(Debug, Clone)]
pub struct LibControlOptions {
    /// A running daemon's socket; `None` starts a private fabricd on `sim`.
    pub daemon: Option<PathBuf>,
    /// The sim fabric for a private daemon.
    pub sim: PathBuf,
    /// Round trips per figure.
    pub iterations: usize,
}

fn session(socket: &std::path::Path) -> Result<Session, LibControlBenchError> {
    Session::open_with(SessionConfig {
        socket: Some(socket.to_owned()),
        window: Some(WindowConfig::default()),
        client_name: Some("fabricctl-bench-lib".into()),
        ..SessionConfig::default()
    })
    .map_err(lib_err("opening a session"))
}

/// Runs the library benchmark.
pub fn libcontrol(opts: &LibControlOptions) -> Result<LibControlBench, LibControlBenchError> {
    let dir = tempfile::tempdir()
        .map_err(|source| ControlBenchError::Io { what: "creating a temporary directory".into(), source })?;
    let (_daemon, socket) = match &opts.daemon {
        Some(s) => (None, s.clone()),
        None => {
            let (child, socket) = bench_control::start_daemon(dir.path(), &opts.sim)?;
            (Some(child), socket)
        }
    };
    let (_echo, echo_socket) = bench_control::start_echo(dir.path())?;
    let n = opts.iterations.max(1);
    let warm = (n / 10).max(10);

    let mut echo = bench_control::connect(&echo_socket)?;
    let mut probe = bench_control::connect(&socket)?;
    let device = bench_control::hbm_device(&mut probe)?;
    drop(probe);
    let owner = session(&socket)?;
    let importer = session(&socket)?;
    let region_bytes = 2 << 20;
    let region =
        owner.alloc(&Target::Device { device, memory: MemoryClass::Hbm }, region_bytes).map_err(lib_err("alloc"))?;
    let handle = owner.export(&region, &Policy::default()).map_err(lib_err("export"))?;

    let import_map = |k: usize, into: &mut Vec<Duration>| -> Result<(), LibControlBenchError> {
        for _ in 0..k {
            let start = Instant::now();
            let import = importer.import(&handle, true).map_err(lib_err("import"))?;
            let mapping = importer.map(&import).map_err(lib_err("map"))?;
            drop(mapping);
            into.push(start.elapsed());
            // The release is a round trip of its own, not part of the figure.
            drop(import);
        }
        Ok(())
    };
    let ping = |k: usize, into: &mut Vec<Duration>| -> Result<(), LibControlBenchError> {
        for _ in 0..k {
            let start = Instant::now();
            importer.ping().map_err(lib_err("ping"))?;
            into.push(start.elapsed());
        }
        Ok(())
    };

    let (mut echo_t, mut noop_t, mut map_t) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    bench_control::time_pings(&mut echo, warm)?;
    ping(warm, &mut Vec::new())?;
    import_map(warm, &mut Vec::new())?;
    // Interleaved in chunks, so that drift in the machine's load hits all three alike.
    let chunk = 100;
    while echo_t.len() < n {
        let k = chunk.min(n - echo_t.len());
        echo_t.extend(bench_control::time_pings(&mut echo, k)?);
        ping(k, &mut noop_t)?;
        import_map(k, &mut map_t)?;
    }
    drop(region);

    let (echo_p50_us, echo_p99_us) = bench_control::p50_p99(echo_t);
    let (lib_noop_p50_us, lib_noop_p99_us) = bench_control::p50_p99(noop_t);
    let (import_map_p50_us, import_map_p99_us) = bench_control::p50_p99(map_t);
    let base = echo_p50_us.max(f64::MIN_POSITIVE);
    Ok(LibControlBench {
        bench: "libcontrol",
        iterations: n,
        region_bytes,
        echo_p50_us,
        echo_p99_us,
        lib_noop_p50_us,
        lib_noop_p99_us,
        import_map_p50_us,
        import_map_p99_us,
        noop_ratio: lib_noop_p50_us / base,
        ratio: import_map_p50_us / base,
    })
}
