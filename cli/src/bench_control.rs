//! `fabricctl bench control`: fabricd's control path (no-op, alloc, export, import round
//! trips, and requests per second with many clients) against a bare Unix-socket echo server
//! that speaks the same framing, measured in the same run.
//!
//! The echo server is this same program in a child process (`fabricctl bench echo-server`,
//! hidden), so that both sides of the comparison cross a process boundary: it reads each
//! whole frame with the protocol's codec and answers it with an empty response frame, and
//! does nothing else. The client side of both measurements is the same
//! [`Connection::call`], so the difference is what fabricd adds: its runtime, dispatch,
//! the operation itself and its bookkeeping.

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, CodecError, Connection, DeviceName, ExportHandle, ExportPolicy,
    ExportRequest, FrameKind, FreeRequest, Header, ImportRequest, MemoryClass, Message, ReleaseRequest, Request,
    Response, SUPPORTED_VERSIONS, TopologyRequest, recv_frame, send_message,
};
use serde::Serialize;

/// Why the control benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum ControlBenchError {
    /// A file or socket step failed.
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
    /// fabricd did not come up.
    #[error("fabricd did not answer on {socket} within 30 s; its log:\n{log}")]
    DaemonStart {
        /// The socket it was asked to serve.
        socket: PathBuf,
        /// Its stderr.
        log: String,
    },
    /// The fabric has no HBM to allocate from.
    #[error("the daemon's fabric has no device with HBM to allocate from")]
    NoHbm,
    /// An answer of the wrong kind.
    #[error("unexpected answer to {0}")]
    Unexpected(&'static str),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ControlBenchError {
    let what = what.into();
    move |source| ControlBenchError::Io { what, source }
}

fn call_err(what: &'static str) -> impl FnOnce(CodecError) -> ControlBenchError {
    move |source| ControlBenchError::Call { what: what.to_owned(), source }
}

/// Result of `bench control`; latencies in microseconds.
#[derive(Debug, Serialize)]
pub struct ControlBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// Round trips timed per operation.
    pub iterations: usize,
    /// Region size for alloc/export/import, bytes.
    pub region_bytes: u64,
    /// Bare echo with the same framing (baseline), median.
    pub echo_p50_us: f64,
    /// Bare echo, 99th percentile.
    pub echo_p99_us: f64,
    /// `Ping` through fabricd, median.
    pub noop_p50_us: f64,
    /// `Ping`, 99th percentile.
    pub noop_p99_us: f64,
    /// `Alloc` (region created, its descriptor received), median.
    pub alloc_p50_us: f64,
    /// `Alloc`, 99th percentile.
    pub alloc_p99_us: f64,
    /// `Export`, median.
    pub export_p50_us: f64,
    /// `Export`, 99th percentile.
    pub export_p99_us: f64,
    /// `Import` from a second connection (descriptor received), back to back like the
    /// pings, median.
    pub import_p50_us: f64,
    /// `Import`, 99th percentile.
    pub import_p99_us: f64,
    /// `Import` right after the export it names (so after two journal `fdatasync`s, with
    /// both connections idle meanwhile), median.
    pub import_after_change_p50_us: f64,
    /// The same, 99th percentile.
    pub import_after_change_p99_us: f64,
    /// `noop_p50_us / echo_p50_us` (target ≤ 1.5).
    pub noop_ratio: f64,
    /// `import_p50_us / echo_p50_us` (target ≤ 3).
    pub import_ratio: f64,
    /// Concurrent clients in the throughput run.
    pub clients: usize,
    /// Seconds the throughput run lasted.
    pub seconds: f64,
    /// `Ping` requests per second through fabricd with `clients` connections.
    pub rps: f64,
    /// Echo round trips per second with `clients` connections (baseline).
    pub echo_rps: f64,
    /// Failed requests in the throughput runs (must be 0).
    pub errors: u64,
}

/// What to run against.
#[derive(Debug, Clone)]
pub struct ControlOptions {
    /// A running daemon's socket; `None` starts a private fabricd on `sim`.
    pub daemon: Option<PathBuf>,
    /// The sim fabric for a private daemon.
    pub sim: PathBuf,
    /// Round trips per operation.
    pub iterations: usize,
    /// Concurrent clients in the throughput run.
    pub clients: usize,
    /// Length of each throughput run.
    pub duration: Duration,
    /// Isolation mode on a running daemon: the interleave set the load allocates on (its
    /// big allocations on device memory the daemon zeroes), instead of a GPU's HBM.
    pub set: Option<String>,
    /// Isolation mode: the size of one allocation in eight of the load (1 GiB by default).
    pub zeroed_bytes: u64,
}

/// A child process killed on drop.
pub(crate) struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Serves `socket` as a bare echo: every frame is read whole and answered with an empty
/// response of the same opcode and request id. Runs until killed.
pub fn echo_server(socket: &Path) -> Result<(), ControlBenchError> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).map_err(io_err(format!("binding {}", socket.display())))?;
    for stream in listener.incoming() {
        let stream = stream.map_err(io_err("accepting"))?;
        std::thread::spawn(move || echo_connection(&stream));
    }
    Ok(())
}

fn echo_connection(stream: &UnixStream) {
    while let Ok(frame) = recv_frame(stream) {
        let h = frame.header;
        let reply = Header::new(h.opcode, FrameKind::Response, h.request_id);
        // Hello needs a real answer for the client's negotiation; everything else is echoed
        // with an empty body, which is what Ping's answer is.
        let msg = if h.opcode == fabric_proto::wire::Opcode::Hello {
            Message::Response(Response::Hello(fabric_proto::wire::HelloResponse {
                version: fabric_proto::wire::PROTOCOL_VERSION,
                server: fabric_proto::wire::Name::truncated("echo"),
                session: 0,
                max_request_body: fabric_proto::wire::MAX_REQUEST_BODY,
                max_fds: fabric_proto::wire::MAX_FDS,
                token: None,
            }))
        } else {
            Message::Response(Response::Ping)
        };
        if send_message(stream, &reply, &msg, &[]).is_err() {
            return;
        }
    }
}

pub(crate) fn connect(socket: &Path) -> Result<Connection, ControlBenchError> {
    let s = fabric_proto::wire::connect_unix(socket, Some(Duration::from_secs(30)))
        .map_err(io_err(format!("connecting to {}", socket.display())))?;
    s.set_read_timeout(Some(Duration::from_secs(30))).map_err(io_err("setting a read timeout"))?;
    let mut c = Connection::new(s);
    c.hello("fabricctl-bench", SUPPORTED_VERSIONS).map_err(call_err("hello"))?;
    Ok(c)
}

fn wait_for(socket: &Path, child: &mut Child, log: &Path) -> Result<(), ControlBenchError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if connect(socket).is_ok() {
            return Ok(());
        }
        if matches!(child.try_wait(), Ok(Some(_))) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(ControlBenchError::DaemonStart {
        socket: socket.to_owned(),
        log: std::fs::read_to_string(log).unwrap_or_default(),
    })
}

fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

pub(crate) fn start_daemon(dir: &Path, sim: &Path) -> Result<(Reaped, PathBuf), ControlBenchError> {
    start_daemon_with(dir, sim, "")
}

/// [`start_daemon`] with `extra` TOML (whole tables) appended to the configuration.
pub(crate) fn start_daemon_with(dir: &Path, sim: &Path, extra: &str) -> Result<(Reaped, PathBuf), ControlBenchError> {
    start_daemon_on(dir, &[sim], "", extra, None)
}

/// [`start_daemon_with`] serving every sim fabric of `sims`, with `discovery` (keys of the
/// `[discovery]` table, one a line) added to that table, and its metrics endpoint on
/// `127.0.0.1:metrics` when given (off otherwise).
pub(crate) fn start_daemon_on(
    dir: &Path,
    sims: &[&Path],
    discovery: &str,
    extra: &str,
    metrics: Option<u16>,
) -> Result<(Reaped, PathBuf), ControlBenchError> {
    let socket = dir.join("fabricd.sock");
    let mut names = Vec::with_capacity(sims.len());
    for sim in sims {
        let sim = sim.canonicalize().map_err(io_err(format!("sim fabric {}", sim.display())))?;
        names.push(format!("{:?}", sim.display().to_string()));
    }
    let config = dir.join("fabricd.toml");
    let text = format!(
        "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsim = [{}]\n{discovery}[metrics]\nlisten = {:?}\n[log]\nlevel = \"warn\"\n{extra}",
        socket.display().to_string(),
        dir.join("state").display().to_string(),
        names.join(", "),
        metrics.map(|port| format!("127.0.0.1:{port}")).unwrap_or_default(),
    );
    std::fs::write(&config, text).map_err(io_err("writing the daemon's configuration"))?;
    let log = dir.join("fabricd.log");
    let stderr = std::fs::File::create(&log).map_err(io_err("creating the daemon's log"))?;
    let mut child = Command::new(sibling("fabricd"))
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(io_err("starting fabricd (build it: cargo build --release -p fabricd)"))?;
    wait_for(&socket, &mut child, &log)?;
    Ok((Reaped(child), socket))
}

pub(crate) fn start_echo(dir: &Path) -> Result<(Reaped, PathBuf), ControlBenchError> {
    let socket = dir.join("echo.sock");
    let log = dir.join("echo.log");
    let stderr = std::fs::File::create(&log).map_err(io_err("creating the echo server's log"))?;
    let exe = std::env::current_exe().map_err(io_err("finding this program"))?;
    let mut child = Command::new(exe)
        .args(["bench", "echo-server", "--socket"])
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(io_err("starting the echo server"))?;
    wait_for(&socket, &mut child, &log)?;
    Ok((Reaped(child), socket))
}

/// The `p`-th percentile (0..=100) of sorted samples, in µs.
fn percentile_us(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

pub(crate) fn p50_p99(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort_unstable();
    (percentile_us(&v, 50.0), percentile_us(&v, 99.0))
}

pub(crate) fn time_pings(c: &mut Connection, n: usize) -> Result<Vec<Duration>, ControlBenchError> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        c.call(Request::Ping, &[]).map_err(call_err("ping"))?;
        out.push(t.elapsed());
    }
    Ok(out)
}

pub(crate) fn hbm_device(c: &mut Connection) -> Result<String, ControlBenchError> {
    device_with_memory(c, Some("hbm"))?.ok_or(ControlBenchError::NoHbm)
}

/// The first device the daemon lists with memory of `kind` (any kind: `None`).
pub(crate) fn device_with_memory(c: &mut Connection, kind: Option<&str>) -> Result<Option<String>, ControlBenchError> {
    let (resp, _) = c.call(Request::Devices(TopologyRequest { node: None }), &[]).map_err(call_err("devices"))?;
    let Response::Devices(doc) = resp else { return Err(ControlBenchError::Unexpected("devices")) };
    let v: serde_json::Value = serde_json::from_str(&doc.json).map_err(|_| ControlBenchError::Unexpected("devices"))?;
    Ok(v["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["memory"].as_array().is_some_and(|m| m.iter().any(|r| kind.is_none_or(|k| r["kind"] == k))))
        .and_then(|d| d["id"].as_str().map(str::to_owned)))
}

struct MemoryTimes {
    alloc: Vec<Duration>,
    export: Vec<Duration>,
    /// Imports right after their export (each follows two journaled changes).
    import_after_change: Vec<Duration>,
    /// Imports back to back, as the pings are timed.
    import: Vec<Duration>,
}

fn alloc_export(
    owner: &mut Connection,
    device: &str,
    size: u64,
    t: &mut MemoryTimes,
) -> Result<(u64, ExportHandle), ControlBenchError> {
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Hbm },
        size,
        align: 0,
    });
    let start = Instant::now();
    let (resp, fds) = owner.call(req, &[]).map_err(call_err("alloc"))?;
    t.alloc.push(start.elapsed());
    drop(fds);
    let Response::Alloc(a) = resp else { return Err(ControlBenchError::Unexpected("alloc")) };
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    };
    let start = Instant::now();
    let (resp, _) = owner
        .call(Request::Export(ExportRequest { region: a.region, policy, node: None }), &[])
        .map_err(call_err("export"))?;
    t.export.push(start.elapsed());
    let Response::Export(e) = resp else { return Err(ControlBenchError::Unexpected("export")) };
    Ok((a.region, e.handle))
}

/// One import (timed into `into`) and its release (untimed).
fn import_release(
    importer: &mut Connection,
    handle: ExportHandle,
    into: &mut Vec<Duration>,
) -> Result<(), ControlBenchError> {
    let start = Instant::now();
    let (resp, fds) = importer
        .call(Request::Import(ImportRequest { handle, access: AccessMode::ReadWrite }), &[])
        .map_err(call_err("import"))?;
    into.push(start.elapsed());
    drop(fds);
    let Response::Import(i) = resp else { return Err(ControlBenchError::Unexpected("import")) };
    importer.call(Request::Release(ReleaseRequest { import: i.import }), &[]).map_err(call_err("release"))?;
    Ok(())
}

/// Times `n` allocs and exports, each export imported at once (`import_after_change`),
/// and, per batch of exports, imports back to back (`import`).
fn time_memory(socket: &Path, device: &str, size: u64, n: usize) -> Result<MemoryTimes, ControlBenchError> {
    let mut owner = connect(socket)?;
    let mut importer = connect(socket)?;
    let mut t = MemoryTimes {
        alloc: Vec::with_capacity(n),
        export: Vec::with_capacity(n),
        import_after_change: Vec::with_capacity(n),
        import: Vec::with_capacity(n),
    };
    // Batches keep the live regions few (per-uid limits) and the imports back to back.
    let batch = 50;
    let mut done = 0;
    while done < n {
        let k = batch.min(n - done);
        let mut live = Vec::with_capacity(k);
        for _ in 0..k {
            let (region, handle) = alloc_export(&mut owner, device, size, &mut t)?;
            import_release(&mut importer, handle, &mut t.import_after_change)?;
            live.push((region, handle));
        }
        for (_, handle) in &live {
            import_release(&mut importer, *handle, &mut t.import)?;
        }
        for (region, _) in live {
            owner.call(Request::Free(FreeRequest { region, node: None }), &[]).map_err(call_err("free"))?;
        }
        done += k;
    }
    Ok(t)
}

/// Pings from `clients` connections for `duration`: (requests per second, errors).
fn throughput(socket: &Path, clients: usize, duration: Duration) -> Result<(f64, u64), ControlBenchError> {
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(connect(socket)?);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let threads: Vec<_> = conns
        .into_iter()
        .map(|mut c| {
            let (stop, done, errors) = (stop.clone(), done.clone(), errors.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match c.call(Request::Ping, &[]) {
                        Ok(_) => done.fetch_add(1, Ordering::Relaxed),
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                    };
                }
            })
        })
        .collect();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let secs = start.elapsed().as_secs_f64();
    Ok((done.load(Ordering::Relaxed) as f64 / secs, errors.load(Ordering::Relaxed)))
}

/// Runs the control benchmark.
pub fn control(opts: &ControlOptions) -> Result<ControlBench, ControlBenchError> {
    let dir = tempfile::tempdir().map_err(io_err("creating a temporary directory"))?;
    let (_daemon, socket) = match &opts.daemon {
        Some(s) => (None, s.clone()),
        None => {
            let (child, socket) = start_daemon(dir.path(), &opts.sim)?;
            (Some(child), socket)
        }
    };
    let (_echo, echo_socket) = start_echo(dir.path())?;
    let n = opts.iterations.max(1);
    let warm = (n / 10).max(10);

    let mut echo = connect(&echo_socket)?;
    let mut daemon = connect(&socket)?;
    // Interleave the two so that drift in the machine's load hits both alike.
    let (mut echo_t, mut noop_t) = (Vec::with_capacity(n), Vec::with_capacity(n));
    time_pings(&mut echo, warm)?;
    time_pings(&mut daemon, warm)?;
    let chunk = 100;
    while echo_t.len() < n {
        let k = chunk.min(n - echo_t.len());
        echo_t.extend(time_pings(&mut echo, k)?);
        noop_t.extend(time_pings(&mut daemon, k)?);
    }

    let device = hbm_device(&mut daemon)?;
    let region_bytes = 2 << 20;
    time_memory(&socket, &device, region_bytes, warm)?;
    let mem = time_memory(&socket, &device, region_bytes, n.min(5000))?;

    let (echo_rps, echo_errors) = throughput(&echo_socket, opts.clients, opts.duration)?;
    let (rps, errors) = throughput(&socket, opts.clients, opts.duration)?;

    let (echo_p50_us, echo_p99_us) = p50_p99(echo_t);
    let (noop_p50_us, noop_p99_us) = p50_p99(noop_t);
    let (alloc_p50_us, alloc_p99_us) = p50_p99(mem.alloc);
    let (export_p50_us, export_p99_us) = p50_p99(mem.export);
    let (import_p50_us, import_p99_us) = p50_p99(mem.import);
    let (import_after_change_p50_us, import_after_change_p99_us) = p50_p99(mem.import_after_change);
    Ok(ControlBench {
        bench: "control",
        iterations: n,
        region_bytes,
        echo_p50_us,
        echo_p99_us,
        noop_p50_us,
        noop_p99_us,
        alloc_p50_us,
        alloc_p99_us,
        export_p50_us,
        export_p99_us,
        import_p50_us,
        import_p99_us,
        import_after_change_p50_us,
        import_after_change_p99_us,
        noop_ratio: noop_p50_us / echo_p50_us.max(f64::MIN_POSITIVE),
        import_ratio: import_p50_us / echo_p50_us.max(f64::MIN_POSITIVE),
        clients: opts.clients,
        seconds: opts.duration.as_secs_f64(),
        rps,
        echo_rps,
        errors: errors + echo_errors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_ranks() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile_us(&v, 50.0), 51.0);
        assert_eq!(percentile_us(&v, 99.0), 99.0);
        assert_eq!(percentile_us(&v, 0.0), 1.0);
        assert_eq!(percentile_us(&[], 50.0), 0.0);
    }

    #[test]
    fn echo_server_answers_the_client_codec() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("e.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            echo_connection(&s);
        });
        let mut c = connect(&socket).unwrap();
        assert_eq!(time_pings(&mut c, 5).unwrap().len(), 5);
    }
}
