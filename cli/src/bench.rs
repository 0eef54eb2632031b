//! `fabricctl bench`: benchmarks that measure Fabric against a baseline in the same run.
//!
//! - `host`: `fabricctl topology -o json` on this host as a whole process, against
//!   `lstopo-no-graphics --whole-io --of xml` (hwloc) run the same number of times.
//! - `scale`: load and build a large sim fabric and its address map (time, peak memory),
//!   then path queries on it against a plain breadth-first search over the whole graph.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fabric_topology::{DeviceIdx, DeviceKind, Fabric};
use serde::Serialize;

/// Errors from benchmarks.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A program to compare against is not installed.
    #[error("{0} not found on PATH")]
    MissingTool(&'static str),
    /// A benchmarked process failed.
    #[error("{cmd} failed: {status}")]
    ProcessFailed {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: String,
    },
    /// Spawning a process failed.
    #[error("running {cmd}")]
    Spawn {
        /// The command line.
        cmd: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Loading the fabric failed.
    #[error("loading {path}: {reason}")]
    Load {
        /// The sim file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The fabric has too few GPUs to query paths.
    #[error("{0} has fewer than two GPUs")]
    TooSmall(PathBuf),
}

impl BenchError {
    /// How to fix it.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            BenchError::MissingTool(_) => {
                Some("install hwloc (`apt-get install hwloc`) or run scripts/deps.sh as root")
            }
            BenchError::Load { .. } => Some("pass --sim with a sim fabric, e.g. configs/sim/cluster-100k.toml"),
            _ => None,
        }
    }
}

/// Result of `bench host`.
#[derive(Debug, Serialize)]
pub struct HostBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// Runs of each command.
    pub runs: u32,
    /// Mean wall time of `fabricctl topology -o json`, ms.
    pub fabricctl_ms: f64,
    /// Mean wall time of `lstopo-no-graphics --whole-io --of xml`, ms.
    pub lstopo_ms: f64,
    /// `lstopo_ms / fabricctl_ms`: how many times faster fabricctl is.
    pub ratio: f64,
}

/// Result of `bench scale`.
#[derive(Debug, Serialize)]
pub struct ScaleBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// The sim file.
    pub sim: String,
    /// Devices in the fabric.
    pub devices: usize,
    /// Links in the fabric.
    pub links: usize,
    /// GPUs in the fabric.
    pub gpus: usize,
    /// Time to parse and generate the inventory, ms.
    pub discover_ms: f64,
    /// Time to index it into the fabric graph, ms.
    pub build_ms: f64,
    /// Time to place every memory resource in a new global address map, ms.
    pub addrmap_ms: f64,
    /// Ranges in that map.
    pub addrmap_ranges: usize,
    /// Peak resident memory of the process after building both, MiB (VmHWM).
    pub peak_rss_mib: f64,
    /// Path queries timed.
    pub queries: usize,
    /// Mean time of one `route()` between random GPUs, µs.
    pub route_us: f64,
    /// Mean time of one `classify()` between random GPUs, µs.
    pub classify_us: f64,
    /// Mean time of a plain BFS over the whole graph between the same pairs, µs (baseline).
    pub bfs_us: f64,
    /// `bfs_us / route_us`.
    pub ratio: f64,
}

fn mean_ms(total: Duration, n: u32) -> f64 {
    total.as_secs_f64() * 1e3 / f64::from(n.max(1))
}

fn time_process(program: &Path, args: &[&str], runs: u32) -> Result<Duration, BenchError> {
    let cmd = format!("{} {}", program.display(), args.join(" "));
    let mut total = Duration::ZERO;
    for _ in 0..runs {
        let t = Instant::now();
        let status = Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|source| BenchError::Spawn { cmd: cmd.clone(), source })?;
        total += t.elapsed();
        if !status.success() {
            return Err(BenchError::ProcessFailed { cmd, status: status.to_string() });
        }
    }
    Ok(total)
}

fn on_path(tool: &'static str) -> Result<PathBuf, BenchError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join(tool)).find(|p| p.is_file()).ok_or(BenchError::MissingTool(tool))
}

/// Times `fabricctl topology -o json` against hwloc's `lstopo-no-graphics`, alternating
/// warm-up runs first so both read a warm page cache.
pub fn host(runs: u32, sysfs_root: &Path) -> Result<HostBench, BenchError> {
    let lstopo = on_path("lstopo-no-graphics")?;
    let me = std::env::current_exe().map_err(|source| BenchError::Spawn { cmd: "current_exe".into(), source })?;
    let root = sysfs_root.to_string_lossy().into_owned();
    let ours = ["topology", "-o", "json", "--sysfs-root", root.as_str()];
    let theirs = ["--whole-io", "--of", "xml"];
    time_process(&me, &ours, 2)?;
    time_process(&lstopo, &theirs, 2)?;
    let f = time_process(&me, &ours, runs)?;
    let l = time_process(&lstopo, &theirs, runs)?;
    let (fabricctl_ms, lstopo_ms) = (mean_ms(f, runs), mean_ms(l, runs));
    Ok(HostBench { bench: "host", runs, fabricctl_ms, lstopo_ms, ratio: lstopo_ms / fabricctl_ms })
}

/// Peak resident set size of this process in MiB, from `/proc/self/status`.
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// A small deterministic generator (xorshift) so every run queries the same pairs.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Hops of a plain BFS from `a` to `b` over every link: the naive baseline for `route`.
fn bfs_hops(f: &Fabric, a: DeviceIdx, b: DeviceIdx) -> Option<usize> {
    let mut dist = vec![u32::MAX; f.len()];
    let mut q = VecDeque::from([a]);
    dist[a.get()] = 0;
    while let Some(x) = q.pop_front() {
        if x == b {
            return Some(dist[x.get()] as usize);
        }
        for (n, _) in f.neighbors(x) {
            if dist[n.get()] == u32::MAX {
                dist[n.get()] = dist[x.get()] + 1;
                q.push_back(n);
            }
        }
    }
    None
}

/// Loads a sim fabric, builds it, and times path queries against a whole-graph BFS.
pub fn scale(sim: &Path, queries: usize) -> Result<ScaleBench, BenchError> {
    let t = Instant::now();
    let inv =
        fabric_drivers::sim::load(sim).map_err(|e| BenchError::Load { path: sim.to_owned(), reason: e.to_string() })?;
    let discover_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let fabric = Fabric::build(inv).map_err(|e| BenchError::Load { path: sim.to_owned(), reason: e.to_string() })?;
    let build_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let map = fabric_addrmap::AddressMap::new(fabric_addrmap::MapConfig::default())
        .and_then(|mut m| m.update(fabric.inventory()).map(|_| m))
        .map_err(|e| BenchError::Load { path: sim.to_owned(), reason: e.to_string() })?;
    let addrmap_ms = t.elapsed().as_secs_f64() * 1e3;
    let addrmap_ranges = map.snapshot().len();
    let peak = peak_rss_mib();
    let gpus: Vec<DeviceIdx> = fabric.devices_of(DeviceKind::Gpu).collect();
    if gpus.len() < 2 {
        return Err(BenchError::TooSmall(sim.to_owned()));
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let pairs: Vec<(DeviceIdx, DeviceIdx)> =
        (0..queries.max(1)).map(|_| (gpus[rng.below(gpus.len())], gpus[rng.below(gpus.len())])).collect();
    let t = Instant::now();
    let routed = pairs.iter().filter(|&&(a, b)| fabric.route(a, b).is_ok()).count();
    let route_us = t.elapsed().as_secs_f64() * 1e6 / pairs.len() as f64;
    let t = Instant::now();
    let classes = pairs.iter().map(|&(a, b)| fabric.classify(a, b)).filter(|c| c.is_scale_up()).count();
    let classify_us = t.elapsed().as_secs_f64() * 1e6 / pairs.len() as f64;
    // The baseline is slow (whole graph per query): a tenth of the pairs is plenty.
    let base = &pairs[..pairs.len().div_ceil(10)];
    let t = Instant::now();
    let reached = base.iter().filter(|&&(a, b)| bfs_hops(&fabric, a, b).is_some()).count();
    let bfs_us = t.elapsed().as_secs_f64() * 1e6 / base.len() as f64;
    tracing::debug!(routed, classes, reached, "scale bench");
    Ok(ScaleBench {
        bench: "scale",
        sim: sim.display().to_string(),
        devices: fabric.len(),
        links: fabric.inventory().links.len(),
        gpus: gpus.len(),
        discover_ms,
        build_ms,
        addrmap_ms,
        addrmap_ranges,
        peak_rss_mib: peak,
        queries: pairs.len(),
        route_us,
        classify_us,
        bfs_us,
        ratio: bfs_us / route_us,
    })
}

/// Prints a result as JSON or as aligned `key value` lines.
pub fn print<T: Serialize>(result: &T, json: bool, out: &mut dyn Write) -> io::Result<()> {
    let value = serde_json::to_value(result).map_err(io::Error::other)?;
    if json {
        serde_json::to_writer_pretty(&mut *out, &value).map_err(io::Error::other)?;
        return writeln!(out);
    }
    if let serde_json::Value::Object(map) = value {
        let width = map.keys().map(String::len).max().unwrap_or(0);
        for (k, v) in map {
            match v {
                serde_json::Value::Number(n) if n.is_f64() => {
                    writeln!(out, "{k:width$}  {:.3}", n.as_f64().unwrap_or(f64::NAN))?
                }
                serde_json::Value::String(s) => writeln!(out, "{k:width$}  {s}")?,
                other => writeln!(out, "{k:width$}  {other}")?,
            }
        }
    }
    Ok(())
}
