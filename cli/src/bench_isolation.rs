//! `fabricctl bench control --mode isolation`: whether one client's requests wait behind
//! another's work in fabricd, and whether concurrent allocations share the journal's fsync
//! (group commit). The baselines are the same daemon in the same run: the no-op's latency
//! idle, and allocations per second from one client.
//!
//! - **Latency isolation.** One client times no-ops (`Ping`) idle, then while other
//!   clients allocate and free regions in a loop (2 MiB ones and, one in eight, 1 GiB
//!   ones on device memory that fabricd zeroes whole before handing it out: a DAX device
//!   whose stand-in is a sparse file, backing the CXL pool's 2-way set: a private daemon
//!   serves the CXL pool next to `--sim` when it is there, the 2 MiB regions on a member of
//!   the set), then while an admin client changes partitions in a loop (each change saves the
//!   address map). p50, p99 and max of each. A `Ping` takes no shared lock at all, so the
//!   same is timed for `Status`, which reads the memory registry: what a request that
//!   touches shared state waits.
//!   Then, as root, 3 s of pings with nothing else going on (the baseline of what follows:
//!   a long run of pings behaves unlike the short phases above on this kind of VM), then
//!   3 s while the kernel sends the private daemon a `node` uevent every quarter of a
//!   second (written into a sysfs `uevent` file, as udev's `trigger` does), each of which
//!   makes it rescan: the rescans counted from its metrics.
//! - **Group commit.** Allocations (each freed at once) per second from one client, then
//!   from 16 clients at once; with group commit the 16 share fsyncs and get more through.
//!
//! With `--daemon` (a running daemon) the 1 GiB regions are HBM, not zeroed device memory,
//! and no rescans are triggered. docs/BENCHMARKS.md says what each figure covers.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AllocRequest, AllocTarget, BoundedVec, Connection, DeviceName, FreeRequest, MemoryClass, Name, PartitionSpec,
    PartitionsRequest, Request, Response, StatusRequest,
};
use serde::Serialize;

use crate::bench_control::{
    ControlBenchError, ControlOptions, connect, device_with_memory, hbm_device, start_daemon_on, time_pings,
};

/// Clients that allocate while the no-ops are timed.
const ALLOCATING_CLIENTS: usize = 4;
/// Clients of the group-commit run.
const COMMIT_CLIENTS: usize = 16;

/// Result of the isolation mode; latencies in microseconds.
#[derive(Debug, Serialize)]
pub struct IsolationBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// No-ops timed per phase.
    pub iterations: usize,
    /// Idle: p50, p99, max.
    pub idle_p50_us: f64,
    /// Idle p99.
    pub idle_p99_us: f64,
    /// Idle max.
    pub idle_max_us: f64,
    /// While other clients allocate and free (1 GiB regions among them): p50.
    pub loaded_p50_us: f64,
    /// Same, p99 (target: ≤ 2 × `idle_p99_us`).
    pub loaded_p99_us: f64,
    /// Same, max (target: ≤ 5 ms).
    pub loaded_max_us: f64,
    /// Allocations the loading clients made meanwhile.
    pub loaded_allocs: u64,
    /// The 1 GiB regions of the load were on device memory that is zeroed (a DAX stand-in).
    pub loaded_zeroed: bool,
    /// While partitions change in a loop: p50.
    pub partitions_p50_us: f64,
    /// Same, p99.
    pub partitions_p99_us: f64,
    /// Same, max.
    pub partitions_max_us: f64,
    /// Partition changes made meanwhile.
    pub partition_changes: u64,
    /// The rescan phase's baseline: pings for as long, nothing else going on: p50 (0 when
    /// skipped).
    pub steady_p50_us: f64,
    /// Same, p99.
    pub steady_p99_us: f64,
    /// Same, max.
    pub steady_max_us: f64,
    /// While uevents make the daemon rescan: p50 (0 when skipped).
    pub rescans_p50_us: f64,
    /// Same, p99.
    pub rescans_p99_us: f64,
    /// Same, max.
    pub rescans_max_us: f64,
    /// Rescans the daemon ran meanwhile (its `fabricd_rescans_total{trigger="uevent"}`).
    pub rescans: u64,
    /// Why the rescan phase did not run, if it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rescans_skipped: Option<String>,
    /// `Status` (reads the registry) idle: p99.
    pub status_idle_p99_us: f64,
    /// `Status` while other clients allocate: p99.
    pub status_loaded_p99_us: f64,
    /// `Status` while other clients allocate: max.
    pub status_loaded_max_us: f64,
    /// Allocations (and frees) per second, one client.
    pub allocs_per_s_1: f64,
    /// Allocations (and frees) per second, 16 clients together.
    pub allocs_per_s_16: f64,
    /// `allocs_per_s_16 / allocs_per_s_1` (target with group commit: ≥ 3).
    pub group_commit_ratio: f64,
    /// Seconds each throughput run lasted.
    pub seconds: f64,
    /// Failed requests of the loading clients (must be 0).
    pub errors: u64,
}

fn stats(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let at = |p: f64| v.get(((p / 100.0) * (v.len().saturating_sub(1)) as f64).round() as usize).copied();
    (at(50.0).map_or(0.0, us), at(99.0).map_or(0.0, us), v.last().copied().map_or(0.0, us))
}

/// Where the 2 MiB regions of the load go: a device and its kind of memory, or an
/// interleave set (`--set`).
#[derive(Debug, Clone)]
enum On {
    Device { device: String, memory: MemoryClass },
    Set(String),
}

impl On {
    fn target(&self) -> AllocTarget {
        match self {
            Self::Device { device, memory } => {
                AllocTarget::Device { device: DeviceName::truncated(device), memory: *memory }
            }
            Self::Set(name) => AllocTarget::Set(Name::truncated(name)),
        }
    }
}

fn alloc_req(on: &On, size: u64) -> Request {
    Request::Alloc(AllocRequest { target: on.target(), size, align: 0 })
}

/// Size of the DAX stand-in's sparse file: more than the pool's set holds.
const DAX_BYTES: u64 = 512 << 30;

/// A sysfs tree under `root` with `dax0.0` (the CXL pool's region0 DAX device) bound to
/// device_dax, 2 MiB align, its device file a sparse regular file.
fn dax_stand_in(root: &Path) -> std::io::Result<()> {
    let d = root.join("sys/bus/dax/devices/dax0.0");
    std::fs::create_dir_all(&d)?;
    std::fs::write(d.join("size"), format!("{DAX_BYTES}\n"))?;
    std::fs::write(d.join("align"), format!("{}\n", 2 << 20))?;
    let drv = root.join("sys/bus/dax/drivers/device_dax");
    std::fs::create_dir_all(&drv)?;
    std::os::unix::fs::symlink(&drv, d.join("driver"))?;
    std::fs::create_dir_all(root.join("dev"))?;
    std::fs::File::create(root.join("dev/dax0.0"))?.set_len(DAX_BYTES)
}

/// The CXL pool's 2-way set on the DAX stand-in, and the member regions of the load go to.
#[derive(Debug, Clone)]
struct ZeroedSet {
    set: String,
    member: String,
}

/// Starts the private daemon: on the CXL pool (`cxl-pool.toml` next to `sim`, when there:
/// fabricd serves one sim fabric) with its 2-way set on the DAX stand-in, else on `sim`;
/// rescanning on uevents only, its metrics on `127.0.0.1:metrics`.
///
/// The stand-in lives in `shm` (a tmpfs, as device memory is memory: zeroing it writes no
/// disk, which would slow the journal's `fdatasync`s of later phases), the state in `dir`.
fn start_private(
    dir: &Path,
    shm: &Path,
    sim: &Path,
    metrics: u16,
) -> Result<(crate::bench_control::Reaped, std::path::PathBuf, Option<ZeroedSet>), ControlBenchError> {
    let pool = sim.with_file_name("cxl-pool.toml");
    let set = fabric_drivers::sim::load(&pool).ok().and_then(|inv| {
        let s = fabric_addrmap::region_sets(&inv).into_iter().find(|s| s.ways == 2)?;
        let member = s.members.last()?.device.to_string();
        Some(ZeroedSet { set: s.name.clone(), member })
    });
    // Rescans only when a uevent asks (the rescan phase's), none on a timer.
    let rescans = "rescan_interval_s = 0\nuevents = \"on\"\n";
    let Some(set) = set else {
        let (child, socket) = start_daemon_on(dir, &[sim], rescans, "", Some(metrics))?;
        return Ok((child, socket, None));
    };
    let root = shm.join("root");
    dax_stand_in(&root).map_err(|source| ControlBenchError::Io { what: "making the DAX stand-in".into(), source })?;
    let discovery = format!("sysfs_root = {:?}\n{rescans}", root.display().to_string());
    let (child, socket) = start_daemon_on(dir, &[&pool], &discovery, "[memory]\ndax = [\"dax0.0\"]\n", Some(metrics))?;
    Ok((child, socket, Some(set)))
}

/// A port on 127.0.0.1 free now (for the private daemon's metrics).
fn free_port() -> Result<u16, ControlBenchError> {
    let io = |source| ControlBenchError::Io { what: "finding a free port for the metrics".into(), source };
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).map_err(io)
}

/// The rescans uevents started, from the daemon's metrics page on `port`.
fn uevent_rescans(port: u16) -> Result<u64, ControlBenchError> {
    use std::io::{Read, Write};
    let io = |source| ControlBenchError::Io { what: "reading the daemon's metrics".into(), source };
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(io)?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(io)?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").map_err(io)?;
    let mut page = String::new();
    s.read_to_string(&mut page).map_err(io)?;
    Ok(page
        .lines()
        .filter(|l| l.starts_with("fabricd_rescans_total{trigger=\"uevent\""))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
        .sum())
}

/// A sysfs file a write of `change` into makes the kernel send a uevent of the `node`
/// subsystem (one fabricd rescans for).
const NODE_UEVENT: &str = "/sys/devices/system/node/node0/uevent";
/// Between two uevents: more than the daemon's quiet after one (200 ms), so each is a
/// rescan of its own.
const UEVENT_EVERY: Duration = Duration::from_millis(250);
/// How long the pings are timed while the daemon rescans.
const RESCAN_PHASE: Duration = Duration::from_secs(3);

/// Pings timed on `probe` for [`RESCAN_PHASE`], with `uevents` while uevents make the
/// daemon (metrics on `port`) rescan: the times and the rescans it ran meanwhile.
fn long_pings(
    probe: &mut Connection,
    n: usize,
    port: u16,
    uevents: bool,
) -> Result<(Vec<Duration>, u64), ControlBenchError> {
    let before = uevent_rescans(port)?;
    let stop = Arc::new(AtomicBool::new(false));
    let sender = uevents.then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let _ = std::fs::write(NODE_UEVENT, "change");
                std::thread::sleep(UEVENT_EVERY);
            }
        })
    });
    let start = Instant::now();
    let mut times = Vec::new();
    let mut failed = None;
    while start.elapsed() < RESCAN_PHASE {
        match time_pings(probe, n.min(1000)) {
            Ok(t) => times.extend(t),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(s) = sender {
        let _ = s.join();
        // The last uevent's rescan, after its quiet.
        std::thread::sleep(Duration::from_millis(500));
    }
    match failed {
        Some(e) => Err(e),
        None => Ok((times, uevent_rescans(port)?.saturating_sub(before))),
    }
}

/// The rescan phase and its baseline: pings for [`RESCAN_PHASE`] with nothing else going
/// on (a long run of pings is slower on this kind of VM than the short phases: the
/// baseline is as long), then as long while uevents make the daemon rescan. `Err(why)`
/// when no uevent can be sent here (not root, or no such sysfs file).
#[derive(Default)]
struct Rescans {
    steady: Vec<Duration>,
    during: Vec<Duration>,
    count: u64,
}

fn rescan_phase(probe: &mut Connection, n: usize, port: u16) -> Result<Result<Rescans, String>, ControlBenchError> {
    if let Err(e) = std::fs::write(NODE_UEVENT, "change") {
        return Ok(Err(format!("cannot write {NODE_UEVENT} (root is needed): {e}")));
    }
    // That uevent's rescan done before anything is timed.
    std::thread::sleep(Duration::from_millis(500));
    let (steady, _) = long_pings(probe, n, port, false)?;
    let (during, count) = long_pings(probe, n, port, true)?;
    Ok(Ok(Rescans { steady, during, count }))
}

/// Clients that each loop over `work` (one step per call) until stopped; the count of
/// steps done and of errors.
struct Load {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(
        socket: &Path,
        clients: usize,
        work: impl Fn(&mut Connection, u64) -> bool + Send + Sync + 'static,
    ) -> Result<Self, ControlBenchError> {
        let (stop, done, errors) = (Arc::new(AtomicBool::new(false)), Arc::default(), Arc::default());
        let work = Arc::new(work);
        let mut threads = Vec::with_capacity(clients);
        for _ in 0..clients {
            let mut c = connect(socket)?;
            let (stop, done, errors, work): (Arc<AtomicBool>, Arc<AtomicU64>, Arc<AtomicU64>, _) =
                (stop.clone(), Arc::clone(&done), Arc::clone(&errors), work.clone());
            threads.push(std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if work(&mut c, i) {
                        done.fetch_add(1, Ordering::Relaxed);
                    } else {
                        errors.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    i += 1;
                }
            }));
        }
        Ok(Self { stop, done, errors, threads })
    }

    /// Stops the clients: (steps done, errors).
    fn stop(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        (self.done.load(Ordering::Relaxed), self.errors.load(Ordering::Relaxed))
    }
}

/// `n` `Status` round trips, each timed.
fn time_status(c: &mut Connection, n: usize) -> Result<Vec<Duration>, ControlBenchError> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        c.call(Request::Status(StatusRequest {}), &[])
            .map_err(|source| ControlBenchError::Call { what: "status".into(), source })?;
        out.push(t.elapsed());
    }
    Ok(out)
}

/// One allocation of `size` on `on`, freed at once; false when either is refused.
fn alloc_free(c: &mut Connection, on: &On, size: u64) -> bool {
    free_after(c, alloc_req(on, size))
}

/// The allocation `req`, freed at once; false when either is refused.
fn free_after(c: &mut Connection, req: Request) -> bool {
    let Ok((Response::Alloc(a), fds)) = c.call(req, &[]) else { return false };
    drop(fds);
    c.call(Request::Free(FreeRequest { region: a.region, node: None }), &[]).is_ok()
}

/// Allocations per second from `clients` clients for `duration`, and their errors.
fn allocs_per_s(socket: &Path, on: &On, clients: usize, duration: Duration) -> Result<(f64, u64), ControlBenchError> {
    let dev = on.clone();
    let start = Instant::now();
    let load = Load::start(socket, clients, move |c, _| alloc_free(c, &dev, 2 << 20))?;
    std::thread::sleep(duration);
    let (done, errors) = load.stop();
    Ok((done as f64 / start.elapsed().as_secs_f64(), errors))
}

/// Runs the isolation mode.
pub fn isolation(opts: &ControlOptions) -> Result<IsolationBench, ControlBenchError> {
    let dir = tempfile::tempdir()
        .map_err(|source| ControlBenchError::Io { what: "creating a temporary directory".into(), source })?;
    // Removed after the daemon is stopped (declared first, dropped last).
    let shm = tempfile::tempdir_in("/dev/shm").or_else(|_| tempfile::tempdir()).map_err(|source| {
        ControlBenchError::Io { what: "creating a temporary directory for the DAX stand-in".into(), source }
    })?;
    let (_daemon, socket, zeroed_set, metrics) = match &opts.daemon {
        Some(s) => (None, s.clone(), None, None),
        None => {
            let port = free_port()?;
            let (child, socket, set) = start_private(dir.path(), shm.path(), &opts.sim, port)?;
            (Some(child), socket, set, Some(port))
        }
    };
    let n = opts.iterations.max(10);
    let mut probe = connect(&socket)?;
    // On the CXL pool, the member the set does not start on; on a running daemon's set
    // (`--set`), that set; else a GPU's HBM.
    let on = match (&opts.set, &zeroed_set) {
        (Some(set), _) => On::Set(set.clone()),
        (None, Some(z)) => On::Device { device: z.member.clone(), memory: MemoryClass::CxlVolatile },
        (None, None) => On::Device { device: hbm_device(&mut probe)?, memory: MemoryClass::Hbm },
    };
    // The set the load's big allocations go to, on device memory the daemon zeroes.
    let set = opts.set.clone().or_else(|| zeroed_set.map(|z| z.set));
    let big = opts.zeroed_bytes;
    time_pings(&mut probe, (n / 10).max(10))?;
    let idle = time_pings(&mut probe, n)?;
    let status_idle = time_status(&mut probe, n)?;

    // Other clients allocate and free, one allocation in eight of `--zeroed-bytes` (1 GiB;
    // on the zeroed device memory when it is served).
    let dev = on.clone();
    let loaded_zeroed = set.is_some();
    let load = Load::start(&socket, ALLOCATING_CLIENTS, move |c, i| match (&set, i % 8 == 7) {
        (Some(set), true) => {
            let req = AllocRequest { target: AllocTarget::Set(Name::truncated(set)), size: big, align: 0 };
            free_after(c, Request::Alloc(req))
        }
        (None, true) => alloc_free(c, &dev, big),
        (_, false) => alloc_free(c, &dev, 2 << 20),
    })?;
    std::thread::sleep(Duration::from_millis(50));
    let loaded = time_pings(&mut probe, n)?;
    let status_loaded = time_status(&mut probe, n)?;
    let (loaded_allocs, alloc_errors) = load.stop();

    // An admin (this user runs the private daemon) changes a partition in a loop.
    // The partition names the load's device; with a set, a device of the daemon's with memory.
    let dev = match &on {
        On::Device { device, .. } => device.clone(),
        On::Set(_) => device_with_memory(&mut probe, None)?.ok_or(ControlBenchError::Unexpected("devices"))?,
    };
    let load = Load::start(&socket, 1, move |c, i| {
        let req = if i % 2 == 0 {
            let devices = BoundedVec::new(vec![DeviceName::truncated(&dev)]).unwrap_or_default();
            let spec = PartitionSpec {
                name: Name::truncated("bench"),
                devices,
                uids: BoundedVec::default(),
                gids: BoundedVec::default(),
            };
            PartitionsRequest::Set(spec)
        } else {
            PartitionsRequest::Remove { name: Name::truncated("bench") }
        };
        c.call(Request::Partitions(req), &[]).is_ok()
    })?;
    std::thread::sleep(Duration::from_millis(50));
    let partitions = time_pings(&mut probe, n)?;
    let (partition_changes, partition_errors) = load.stop();

    // The kernel asks the daemon to rescan, again and again.
    let (rescan_phase, rescans_skipped) = match metrics {
        None => (None, Some("a running daemon (--daemon) is not made to rescan".to_owned())),
        Some(port) => match rescan_phase(&mut probe, n, port)? {
            Ok(r) => (Some(r), None),
            Err(why) => (None, Some(why)),
        },
    };
    let Rescans { steady, during, count: rescans } = rescan_phase.unwrap_or_default();

    let (allocs_per_s_1, e1) = allocs_per_s(&socket, &on, 1, opts.duration)?;
    let (allocs_per_s_16, e16) = allocs_per_s(&socket, &on, COMMIT_CLIENTS, opts.duration)?;

    let (idle_p50_us, idle_p99_us, idle_max_us) = stats(idle);
    let (loaded_p50_us, loaded_p99_us, loaded_max_us) = stats(loaded);
    let (partitions_p50_us, partitions_p99_us, partitions_max_us) = stats(partitions);
    let (steady_p50_us, steady_p99_us, steady_max_us) = stats(steady);
    let (rescans_p50_us, rescans_p99_us, rescans_max_us) = stats(during);
    let (_, status_idle_p99_us, _) = stats(status_idle);
    let (_, status_loaded_p99_us, status_loaded_max_us) = stats(status_loaded);
    Ok(IsolationBench {
        bench: "control-isolation",
        iterations: n,
        idle_p50_us,
        idle_p99_us,
        idle_max_us,
        loaded_p50_us,
        loaded_p99_us,
        loaded_max_us,
        loaded_allocs,
        loaded_zeroed,
        partitions_p50_us,
        partitions_p99_us,
        partitions_max_us,
        partition_changes,
        steady_p50_us,
        steady_p99_us,
        steady_max_us,
        rescans_p50_us,
        rescans_p99_us,
        rescans_max_us,
        rescans,
        rescans_skipped,
        status_idle_p99_us,
        status_loaded_p99_us,
        status_loaded_max_us,
        allocs_per_s_1,
        allocs_per_s_16,
        group_commit_ratio: allocs_per_s_16 / allocs_per_s_1.max(f64::MIN_POSITIVE),
        seconds: opts.duration.as_secs_f64(),
        errors: alloc_errors + partition_errors + e1 + e16,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_are_median_p99_and_max() {
        let v: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let (p50, p99, max) = stats(v);
        assert_eq!((p50.round(), p99.round(), max.round()), (51.0, 99.0, 100.0));
        assert_eq!(stats(Vec::new()), (0.0, 0.0, 0.0));
    }
}
