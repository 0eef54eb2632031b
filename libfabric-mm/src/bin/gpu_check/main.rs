//! gpu_check: the CUDA memory half of scripts/gpu-check.sh. Two processes share GPU memory:
//! the exporter allocates HBM (`cuMemCreate`), fills it from a PTX kernel, exports it as a
//! POSIX descriptor and passes it over a Unix socket (`SCM_RIGHTS`) — or, with `--daemon`,
//! hands it to fabricd (`Adopt`, as a descriptor or with `--share fabric` as a fabric handle)
//! and passes a handle the importer imports through the daemon (`ImportObject`,
//! `fabric.rs`); the importer imports,
//! maps and checks it from the GPU, times copies through the imported mapping against
//! `cuMemcpyDtoD` between its own allocations of the same size, times map/unmap, and writes
//! a new pattern the exporter then checks in its own mapping.
//!
//! ```text
//! gpu_check probe  --out FILE
//! gpu_check ptx    --out FILE                       (writes the PTX kernel text)
//! gpu_check memory --out FILE [--size-mib N] [--iters N] [--daemon SOCKET [--device ID] [--share fd|fabric]]
//! gpu_check import --socket PATH --out FILE        (started by `memory`)
//! gpu_check import --daemon SOCKET --handle H --out FILE  (started by `memory --daemon`)
//! gpu_check summarize OUTDIR --out FILE [--elapsed S] (scripts/gpu-check.sh's summary.json)
//! ```
//! Exit codes: 0 every step passed; 1 a step failed; 2 usage; 3 CUDA not present (the
//! JSON says why).

use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use fabric_mm::cuda::{
    self, AllocOptions, CudaContext, CudaError, GpuMapping, GpuMemory, Module, Stream, fdpass, pattern_word,
};
use serde_json::{Value, json};

mod fabric;
mod summary;

const NOT_PRESENT: u8 = 3;
const SEED_EXPORTER: u32 = 0x5eed_0001;
const SEED_IMPORTER: u32 = 0x5eed_0002;

/// The results of one process: steps in order, each ok or not, with figures.
#[derive(Default)]
struct Report {
    steps: Vec<Value>,
    failed: usize,
}

impl Report {
    fn step<T>(&mut self, name: &str, r: Result<T, String>, detail: impl FnOnce(&T) -> Value) -> Option<T> {
        match r {
            Ok(v) => {
                self.steps.push(json!({ "step": name, "ok": true, "detail": detail(&v) }));
                Some(v)
            }
            Err(e) => {
                self.failed += 1;
                self.steps.push(json!({ "step": name, "ok": false, "error": e }));
                None
            }
        }
    }

    /// A step that may be unsupported on this machine: recorded, not counted as a failure.
    fn optional<T>(&mut self, name: &str, r: Result<T, CudaError>, detail: impl FnOnce(&T) -> Value) -> Option<T> {
        match r {
            Ok(v) => self.step(name, Ok(v), detail),
            Err(e) => {
                self.steps.push(json!({ "step": name, "ok": null, "unsupported": e.to_string() }));
                None
            }
        }
    }

    fn skip(&mut self, name: &str, why: &str) {
        self.steps.push(json!({ "step": name, "ok": null, "skipped": why }));
    }
}

fn s<T>(r: Result<T, CudaError>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn write_json(path: &Path, v: &Value) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    serde_json::to_writer_pretty(&mut f, v)?;
    writeln!(f)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let Some(out) = arg(&args, "--out").map(PathBuf::from) else {
        let _ = writeln!(std::io::stderr(), "usage: gpu_check probe|memory|import --out FILE [...]");
        return ExitCode::from(2);
    };
    if args.get(1).map(String::as_str) == Some("ptx") {
        // The kernel text, for inspection (ptxas) next to the bundle.
        return match std::fs::write(&out, cuda::PATTERN_PTX) {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => ExitCode::from(1),
        };
    }
    let (doc, code) = match args.get(1).map(String::as_str) {
        Some("probe") => probe(),
        Some("memory") => {
            let size = arg(&args, "--size-mib").and_then(|v| v.parse::<usize>().ok()).unwrap_or(256) << 20;
            let iters = arg(&args, "--iters").and_then(|v| v.parse().ok()).unwrap_or(20);
            let fabric = match arg(&args, "--share").as_deref() {
                None | Some("fd") => false,
                Some("fabric") => true,
                Some(other) => {
                    let _ = writeln!(std::io::stderr(), "--share fd|fabric, not {other}");
                    return ExitCode::from(2);
                }
            };
            let daemon = arg(&args, "--daemon").map(|socket| fabric::Daemon {
                socket: PathBuf::from(socket),
                device: arg(&args, "--device"),
                fabric,
            });
            exporter(size, iters, &out, daemon.as_ref())
        }
        Some("summarize") => match args.get(2) {
            Some(dir) => summary::summarize(Path::new(dir), arg(&args, "--elapsed").and_then(|v| v.parse().ok())),
            None => (json!({ "error": "OUTDIR missing" }), 2),
        },
        Some("import") => match (arg(&args, "--socket"), arg(&args, "--daemon"), arg(&args, "--handle")) {
            (Some(sock), None, None) => importer(Source::Direct(PathBuf::from(sock)), &out),
            (None, Some(socket), Some(handle)) => {
                importer(Source::Daemon { socket: PathBuf::from(socket), handle }, &out)
            }
            _ => (json!({ "error": "either --socket, or --daemon and --handle" }), 2),
        },
        _ => (json!({ "error": "unknown command" }), 2),
    };
    if let Err(e) = write_json(&out, &doc) {
        let _ = writeln!(std::io::stderr(), "gpu_check: writing {}: {e}", out.display());
        return ExitCode::from(1);
    }
    let _ = writeln!(std::io::stderr(), "gpu_check: {} (exit {code})", doc["status"].as_str().unwrap_or("?"));
    ExitCode::from(code)
}

fn not_present(e: &CudaError) -> Option<(Value, u8)> {
    matches!(e, CudaError::NotPresent(_))
        .then(|| (json!({ "status": "not_present", "reason": e.to_string() }), NOT_PRESENT))
}

fn finish(mut doc: Value, r: Report) -> (Value, u8) {
    doc["status"] = json!(if r.failed == 0 { "passed" } else { "failed" });
    doc["failed_steps"] = json!(r.failed);
    doc["steps"] = Value::Array(r.steps);
    (doc, u8::from(r.failed > 0))
}

fn probe() -> (Value, u8) {
    if let Err(e) = cuda::available() {
        return not_present(&e).unwrap_or_else(|| (json!({ "status": "failed", "error": e.to_string() }), 1));
    }
    let mut r = Report::default();
    let version = r.step("cuDriverGetVersion", s(cuda::driver_version()), |v| json!(v));
    let count = r.step("cuDeviceGetCount", s(cuda::device_count()), |v| json!(v)).unwrap_or(0);
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let p = s(CudaContext::new(ordinal).and_then(|c| c.properties()));
        if let Some(p) = r.step(&format!("device {ordinal} properties"), p, |p| json!(p)) {
            devices.push(json!(p));
        }
    }
    finish(json!({ "driver_version": version, "devices": devices }), r)
}

/// Fills a mapping with the pattern: the PTX kernel when it loaded, else a host copy.
fn fill(module: Option<&(Module, Stream)>, m: &GpuMapping<'_>, seed: u32) -> Result<&'static str, String> {
    match module {
        Some((k, st)) => s(k.fill(st, m, seed)).map(|()| "kernel fill_u32"),
        None => {
            let host: Vec<u8> = (0..(m.len() / 4) as u64).flat_map(|i| pattern_word(i, seed).to_ne_bytes()).collect();
            s(m.write(0, &host)).map(|()| "host-to-device copy (no kernel)")
        }
    }
}

/// Checks a mapping holds the pattern: from the GPU (kernel) when possible, and always the
/// first and last 64 KiB from the host.
fn verify(module: Option<&(Module, Stream)>, m: &GpuMapping<'_>, seed: u32) -> Result<Value, String> {
    let gpu_errors = match module {
        Some((k, st)) => Some(s(k.verify(st, m, seed))?),
        None => None,
    };
    let chunk = (64 << 10).min(m.len());
    let mut host_errors = 0u64;
    for start in [0, m.len() - chunk] {
        let mut buf = vec![0u8; chunk];
        s(m.read(start, &mut buf))?;
        for (i, w) in buf.chunks_exact(4).enumerate() {
            let want = pattern_word((start / 4 + i) as u64, seed);
            host_errors += u64::from(u32::from_ne_bytes([w[0], w[1], w[2], w[3]]) != want);
        }
    }
    let v = json!({ "gpu_mismatched_words": gpu_errors, "host_sampled_mismatched_words": host_errors });
    if gpu_errors.unwrap_or(0) + host_errors > 0 { Err(format!("content differs: {v}")) } else { Ok(v) }
}

fn exporter(size: usize, iters: u32, out: &Path, daemon: Option<&fabric::Daemon>) -> (Value, u8) {
    let ctx = match CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => return not_present(&e).unwrap_or_else(|| (json!({ "status": "failed", "error": e.to_string() }), 1)),
    };
    let mut r = Report::default();
    let props = r.step("device 0 properties", s(ctx.properties()), |p| json!(p)).unwrap_or_default();
    let opts = AllocOptions { fabric: props.fabric_handles, gpu_direct_rdma: props.gpu_direct_rdma_with_vmm };
    r.step(
        "allocation granularity",
        s(ctx.granularity(opts)),
        |(min, rec)| json!({ "minimum": min, "recommended": rec }),
    );
    let mut mem = ctx.allocate(size, opts);
    // Why the allocation has no fabric handle type, when it has none.
    let mut no_fabric = (!opts.fabric).then(|| "the device reports no fabric-handle support".to_owned());
    if let (Err(e), true) = (&mem, opts.fabric) {
        // NOT_PERMITTED: no IMEX channel (/dev/nvidia-caps-imex-channels) on this host.
        no_fabric = Some(format!("cuMemCreate with the fabric handle type: {e}"));
        r.optional("cuMemCreate with fabric handles", mem, |_| json!(null));
        mem = ctx.allocate(size, AllocOptions { fabric: false, ..opts });
    }
    let Some(mem) = r.step("cuMemCreate", s(mem), |m| json!({ "bytes": m.size(), "requested": size })) else {
        return finish(json!({}), r);
    };
    if let (Some(why), Some(fabric::Daemon { fabric: true, .. })) = (&no_fabric, daemon) {
        // Asked to share by fabric handle, and the allocation has none: that is the finding.
        r.step("fabric handle for fabricd", Err::<(), _>(why.clone()), |_| json!(null));
        return finish(json!({ "size": mem.size() }), r);
    }
    let Some(map) = r.step("map (reserve, map, set access)", s(mem.map(&[])), |m| json!({ "va": m.device_ptr() }))
    else {
        return finish(json!({}), r);
    };
    let module = r.step("load PTX module", s(ctx.load_pattern_module().and_then(|m| Ok((m, ctx.stream()?)))), |_| {
        json!("cuModuleLoadData")
    });
    r.step("fill exporter pattern", fill(module.as_ref(), &map, SEED_EXPORTER), |how| json!(how));
    r.step("verify locally", verify(module.as_ref(), &map, SEED_EXPORTER), Clone::clone);
    optional_exports(&mut r, &ctx, &mem, &map, no_fabric.as_deref());
    peers(&mut r, &ctx, &mem, SEED_EXPORTER);
    let child = match daemon {
        Some(d) => fabric::share(&mut r, &mem, iters, out, d),
        None => share(&mut r, &mem, size, iters, out),
    };
    r.step(
        "verify importer's stores in exporter's mapping",
        verify(module.as_ref(), &map, SEED_IMPORTER),
        Clone::clone,
    );
    drop(map);
    finish(json!({ "size": mem.size(), "importer": child }), r)
}

/// Fabric handle (when the allocation has that type: `no_fabric` says why not), dma-buf,
/// host registration.
fn optional_exports(r: &mut Report, ctx: &CudaContext, mem: &GpuMemory, map: &GpuMapping<'_>, no_fabric: Option<&str>) {
    match no_fabric {
        None => {
            if let Some(h) = r.optional("export fabric handle", mem.export_fabric(), |_| json!("64-byte handle")) {
                r.optional("import fabric handle (same process)", ctx.import_fabric(&h, mem.size()), |m| {
                    json!(m.size())
                });
            }
        }
        Some(why) => r.skip("export fabric handle", why),
    }
    r.optional("dma-buf export (cuMemGetHandleForAddressRange)", map.dma_buf_fd(), |fd| {
        // A dma-buf reports its size to lseek(SEEK_END).
        let size = fd.try_clone().ok().map(std::fs::File::from).and_then(|mut f| f.seek(SeekFrom::End(0)).ok());
        json!({ "size_by_lseek": size })
    });
    let len = (64 << 20).min(map.len());
    let (mut host, mut pageable) = (vec![1u8; len], vec![1u8; len]);
    let t = Instant::now();
    // SAFETY: `host` is this function's allocation and outlives the registration (dropped
    // first, below); the GPU touches it only inside the synchronous copies of
    // `host_copies`, which hold the only reference then.
    let reg = unsafe { ctx.register_host(host.as_mut_ptr(), host.len()) };
    let reg_us = t.elapsed().as_secs_f64() * 1e6;
    if let Some(reg) = r.step("cuMemHostRegister 64 MiB", s(reg), |_| json!({ "register_us": reg_us })) {
        let copies = host_copies(ctx, &mut host, &mut pageable);
        r.step("host<->device copies: registered vs pageable", copies, Clone::clone);
        let t = Instant::now();
        drop(reg);
        r.step("cuMemHostUnregister", Ok(t.elapsed().as_secs_f64() * 1e6), |us| json!({ "unregister_us": us }));
    }
    drop(host);
}

/// Host-to-device and device-to-host bandwidth from a registered (pinned) buffer against a
/// pageable one of the same size, 10 copies each, in GB/s, to a scratch allocation.
fn host_copies(ctx: &CudaContext, pinned: &mut [u8], pageable: &mut [u8]) -> Result<Value, String> {
    const N: u32 = 10;
    let len = pinned.len();
    let scratch = s(ctx.allocate(len, AllocOptions::default()))?;
    let map = s(scratch.map(&[]))?;
    let mut fig = serde_json::Map::new();
    for (name, buf) in [("registered", pinned), ("pageable", pageable)] {
        s(map.write(0, buf))?; // warm-up
        let t = Instant::now();
        for _ in 0..N {
            s(map.write(0, buf))?;
        }
        fig.insert(format!("HtoD {name} GB/s"), json!(gbps(len, N, t.elapsed().as_secs_f64())));
        let t = Instant::now();
        for _ in 0..N {
            s(map.read(0, buf))?;
        }
        fig.insert(format!("DtoH {name} GB/s"), json!(gbps(len, N, t.elapsed().as_secs_f64())));
    }
    fig.insert("bytes".into(), json!(len));
    Ok(Value::Object(fig))
}

/// Peer access from GPU 0 to each other GPU that can reach it. The context's peer access
/// (`cuCtxEnablePeerAccess`, which ordinary allocations need) is enabled and held; then the
/// path this library uses, where VMM access is per mapping: GPU 0's memory (holding the
/// pattern for `seed`) mapped with access for the peer, read there by the peer's kernel,
/// copied by the peer into its own memory and verified; and the same copy from a mapping
/// that did not grant the peer must be refused (by the library, before the driver: on a GPU
/// such an access would fault the context).
fn peers(r: &mut Report, ctx: &CudaContext, mem: &GpuMemory, seed: u32) {
    let count = cuda::device_count().unwrap_or(0);
    if count < 2 {
        r.skip("peer access", &format!("{count} GPU(s): peer access needs two"));
        return;
    }
    for ordinal in 1..count {
        let Some(peer) = r.step(&format!("open GPU {ordinal}"), s(CudaContext::new(ordinal)), |_| json!(ordinal))
        else {
            continue;
        };
        let can = r.step(&format!("can access peer 0->{ordinal}"), s(ctx.can_access_peer(&peer)), |c| json!(c));
        if can != Some(true) {
            continue;
        }
        // Held until the checks below are done: dropping it disables the access again.
        let access =
            r.step(&format!("enable peer access 0->{ordinal}"), s(ctx.enable_peer_access(&peer)), |_| json!(true));
        let shared = r.step(
            &format!("map with access for GPU {ordinal}"),
            s(mem.map(&[&peer])),
            |m| json!({ "va": m.device_ptr(), "granted": m.granted() }),
        );
        let local = s(peer.allocate(mem.size(), AllocOptions::default()));
        let Some(local) = r.step(&format!("allocate on GPU {ordinal}"), local, |m| json!(m.size())) else { continue };
        let Some(local_map) = r.step(&format!("map on GPU {ordinal}"), s(local.map(&[])), |m| json!(m.device_ptr()))
        else {
            continue;
        };
        if let Some(shared) = &shared {
            let module = s(peer.load_pattern_module().and_then(|m| Ok((m, peer.stream()?)))).ok();
            r.step(
                &format!("GPU {ordinal} kernel reads GPU 0's memory through the peer mapping"),
                verify(module.as_ref(), shared, seed),
                Clone::clone,
            );
            let t = Instant::now();
            let copied = s(local_map.copy_from(shared, shared.len())).map(|()| t.elapsed().as_secs_f64());
            let copied = r.step(
                &format!("GPU {ordinal} copies from GPU 0"),
                copied,
                |secs| json!({ "bytes": shared.len(), "GB/s": gbps(shared.len(), 1, *secs) }),
            );
            if copied.is_some() {
                r.step(
                    &format!("verify the copy on GPU {ordinal}"),
                    verify(module.as_ref(), &local_map, seed),
                    Clone::clone,
                );
            }
        }
        r.step(&format!("copy by GPU {ordinal} without its access is refused"), refused(mem, &local_map), |why| {
            json!(why)
        });
        drop(access);
    }
}

/// A copy into `dst` (another GPU's mapping) from a mapping of `mem` that grants only
/// `mem`'s own GPU: passes when the library refuses it as [`CudaError::NoAccess`].
fn refused(mem: &GpuMemory, dst: &GpuMapping<'_>) -> Result<String, String> {
    let private = s(mem.map(&[]))?;
    match dst.copy_from(&private, private.len()) {
        Err(e @ CudaError::NoAccess { .. }) => Ok(e.to_string()),
        Err(e) => Err(format!("refused, but not for want of access: {e}")),
        Ok(()) => Err("the copy went through without access".into()),
    }
}

/// Exports the memory, starts the importer, passes the descriptor, waits for its report.
fn share(r: &mut Report, mem: &GpuMemory, size: usize, iters: u32, out: &Path) -> Value {
    let Some(fd) = r.step("export POSIX fd", s(mem.export_fd()), |_| json!("cuMemExportToShareableHandle")) else {
        return Value::Null;
    };
    let dir = std::env::temp_dir().join(format!("gpu-check-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let sock = dir.join("s");
    let child_out = out.with_extension("importer.json");
    let result = (|| -> Result<Value, String> {
        let listener = UnixListener::bind(&sock).map_err(|e| e.to_string())?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = Command::new(exe)
            .args(["import", "--socket"])
            .arg(&sock)
            .arg("--out")
            .arg(&child_out)
            .env("GPU_CHECK_ITERS", iters.to_string())
            .spawn()
            .map_err(|e| format!("starting the importer: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(30);
        let conn: UnixStream = loop {
            match listener.accept() {
                Ok((c, _)) => break c,
                Err(_) if Instant::now() < deadline && child.try_wait().ok().flatten().is_none() => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(format!("the importer did not connect: {e}")),
            }
        };
        conn.set_nonblocking(false).map_err(|e| e.to_string())?;
        let payload = json!({ "size": size.max(mem.size()), "seed": SEED_EXPORTER, "seed_write": SEED_IMPORTER });
        s(fdpass::send_fd(&conn, fd.as_fd(), payload.to_string().as_bytes()))?;
        let deadline = Instant::now() + Duration::from_secs(240);
        let status = loop {
            if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
                break st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err("the importer ran past 240 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let doc: Value = std::fs::read(&child_out)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_else(|| json!({ "error": "no report" }));
        if status.success() { Ok(doc) } else { Err(format!("importer exit {status}: {doc}")) }
    })();
    let _ = std::fs::remove_dir_all(&dir);
    r.step("importer (import, map, verify, bandwidth, latency, write)", result, Clone::clone).unwrap_or(Value::Null)
}

/// Where the importer gets the memory: a descriptor straight from the exporter, or an
/// import through fabricd.
enum Source {
    Direct(PathBuf),
    Daemon { socket: PathBuf, handle: String },
}

/// What the importer holds while it uses the memory.
enum Held {
    Direct(GpuMemory),
    /// The import holds its session open.
    Fabric(cuda::GpuImport),
}

impl Held {
    fn memory(&self) -> &GpuMemory {
        match self {
            Held::Direct(m) => m,
            Held::Fabric(i) => i.memory(),
        }
    }
}

/// The direct path: the descriptor over the exporter's socket, imported here.
fn receive(r: &mut Report, ctx: &CudaContext, sock: &Path) -> Option<Held> {
    let conn =
        r.step("connect to the exporter", UnixStream::connect(sock).map_err(|e| e.to_string()), |_| json!(null))?;
    let (payload, fd) =
        r.step("receive fd (SCM_RIGHTS)", s(fdpass::recv_fd(&conn)), |(p, _)| json!(String::from_utf8_lossy(p)))?;
    let p: Value = serde_json::from_slice(&payload).unwrap_or_default();
    let size = p["size"].as_u64().unwrap_or(0) as usize;
    let mem = r.step("cuMemImportFromShareableHandle", s(ctx.import_fd(fd.as_fd(), size)), |m| json!(m.size()))?;
    Some(Held::Direct(mem))
}

fn importer(source: Source, out: &Path) -> (Value, u8) {
    let mut r = Report::default();
    let iters: u32 = std::env::var("GPU_CHECK_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20).max(1);
    let ctx = match CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => return not_present(&e).unwrap_or_else(|| (json!({ "status": "failed", "error": e.to_string() }), 1)),
    };
    let held = match &source {
        Source::Direct(sock) => receive(&mut r, &ctx, sock),
        Source::Daemon { socket, handle } => fabric::import(&mut r, &ctx, socket, handle).map(Held::Fabric),
    };
    let Some(held) = held else { return finish(json!({}), r) };
    let mem = held.memory();
    let Some(map) = r.step("map imported memory", s(mem.map(&[])), |m| json!(m.device_ptr())) else {
        return finish(json!({}), r);
    };
    let module = r.step("load PTX module", s(ctx.load_pattern_module().and_then(|m| Ok((m, ctx.stream()?)))), |_| {
        json!("cuModuleLoadData")
    });
    r.step("verify exporter's pattern through the import", verify(module.as_ref(), &map, SEED_EXPORTER), Clone::clone);
    let figures = bench(&mut r, &ctx, mem, &map, iters);
    r.step("write importer pattern through the import", fill(module.as_ref(), &map, SEED_IMPORTER), |how| json!(how));
    if let Held::Fabric(import) = &held {
        // The owner frees the region once this exists; the import must hear of it, and the
        // mapping (held by the driver's reference) still reads what was written.
        fabric::await_revocation(&mut r, import, &fabric::written_marker(out), || {
            verify(module.as_ref(), &map, SEED_IMPORTER)
        });
    }
    let size = mem.size();
    drop(map);
    drop(held);
    finish(json!({ "size": size, "iterations": iters, "figures": figures }), r)
}

/// min/p50/p99/max/mean of samples.
fn summary(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    json!({ "min": v[0], "p50": at(0.5), "p99": at(0.99), "max": v[v.len() - 1],
            "mean": v.iter().sum::<f64>() / v.len() as f64, "samples": v.len() })
}

fn gbps(bytes: usize, iters: u32, secs: f64) -> f64 {
    bytes as f64 * f64::from(iters) / secs / 1e9
}

/// Copy bandwidth through the import against local-to-local copies of the same size, and
/// map/unmap latency of the imported memory against a local allocation.
fn bench(r: &mut Report, ctx: &CudaContext, imported: &GpuMemory, imap: &GpuMapping<'_>, iters: u32) -> Value {
    let size = imported.size();
    let locals = s(ctx
        .allocate(size, AllocOptions::default())
        .and_then(|a| Ok((a, ctx.allocate(size, AllocOptions::default())?))));
    let Some((l1, l2)) = r.step("allocate two local buffers", locals, |_| json!(size)) else { return Value::Null };
    let maps = s(l1.map(&[]).and_then(|a| Ok((a, l2.map(&[])?))));
    let Some((m1, m2)) = r.step("map local buffers", maps, |_| json!(null)) else { return Value::Null };
    let sync = |dst: &GpuMapping<'_>, src: &GpuMapping<'_>| -> Result<f64, String> {
        s(dst.copy_from(src, size))?; // warm-up
        let t = Instant::now();
        for _ in 0..iters {
            s(dst.copy_from(src, size))?;
        }
        Ok(gbps(size, iters, t.elapsed().as_secs_f64()))
    };
    let timed = |dst: &GpuMapping<'_>, src: &GpuMapping<'_>| -> Result<f64, String> {
        let st = s(ctx.stream())?;
        let (a, b) = (s(ctx.event())?, s(ctx.event())?);
        s(st.record(&a))?;
        for _ in 0..iters {
            // SAFETY: both mappings outlive the copies: we synchronise on `b` below, before
            // either can be dropped.
            s(unsafe { st.copy_async(dst, src, size) })?;
        }
        s(st.record(&b))?;
        let ms = s(a.elapsed_ms(&b))?;
        s(st.synchronize())?;
        Ok(gbps(size, iters, f64::from(ms) / 1e3))
    };
    let mut fig = serde_json::Map::new();
    for (name, res) in [
        ("baseline cuMemcpyDtoD local->local GB/s", sync(&m2, &m1)),
        ("cuMemcpyDtoD imported->local GB/s", sync(&m2, imap)),
        ("cuMemcpyDtoD local->imported GB/s", sync(imap, &m1)),
        ("baseline stream copy local->local GB/s (events)", timed(&m2, &m1)),
        ("stream copy imported->local GB/s (events)", timed(&m2, imap)),
        ("stream copy local->imported GB/s (events)", timed(imap, &m1)),
    ] {
        if let Some(v) = r.step(name, res, |v| json!(v)) {
            fig.insert(name.to_owned(), json!(v));
        }
    }
    drop((m1, m2));
    let latency = |mem: &GpuMemory| -> Result<(Value, Value), String> {
        let (mut map_us, mut unmap_us) = (Vec::new(), Vec::new());
        for _ in 0..iters.max(50) {
            let t = Instant::now();
            let m = s(mem.map(&[]))?;
            map_us.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            drop(m);
            unmap_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok((summary(map_us), summary(unmap_us)))
    };
    for (name, mem) in [("local", &l1), ("imported", imported)] {
        if let Some((m, u)) =
            r.step(&format!("map/unmap latency ({name})"), latency(mem), |(m, u)| json!({ "map_us": m, "unmap_us": u }))
        {
            fig.insert(format!("map us ({name})"), m);
            fig.insert(format!("unmap us ({name})"), u);
        }
    }
    Value::Object(fig)
}
