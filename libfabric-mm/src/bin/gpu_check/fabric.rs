//! The memory check through fabricd (`gpu_check memory --daemon SOCKET [--share fabric]`): the
//! exporter hands its allocation to the daemon (`Adopt`: a region on the GPU's HBM, with a
//! GFA) as a POSIX descriptor, or as a fabric handle with `--share fabric`, and exports it;
//! the importer imports it by handle (`ImportObject`: the daemon checks the handle and passes
//! the CUDA descriptor or fabric handle). The same checks as the direct path follow.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fabric_mm::cuda::{CudaContext, GpuImport, GpuMemory};
use fabric_mm::{Handle, Policy, Session, SessionConfig};
use serde_json::{Value, json};

use super::Report;

/// Where the daemon is, and which fabric device the GPU is (default: `uuid:` + CUDA's UUID).
pub struct Daemon {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// The GPU's fabric identity, when CUDA's UUID is not it.
    pub device: Option<String>,
    /// Hand the allocation over as a fabric handle (it must have that handle type).
    pub fabric: bool,
}

fn open(socket: &Path) -> Result<Session, String> {
    let config = SessionConfig {
        socket: Some(socket.to_owned()),
        client_name: Some("gpu_check".into()),
        ..SessionConfig::default()
    };
    Session::open_with(config).map_err(|e| e.to_string())
}

/// Exporter side: adopt, export, start the importer with the handle, wait for its report.
pub fn share(r: &mut Report, mem: &GpuMemory, iters: u32, out: &Path, d: &Daemon) -> Value {
    let Some(session) = r.step(
        "fabricd session",
        open(&d.socket),
        |s| json!({ "socket": s.socket(), "protocol": s.protocol_version().to_string() }),
    ) else {
        return Value::Null;
    };
    let (adopted, step) = if d.fabric {
        let a = session.adopt_gpu_fabric(mem, d.device.as_deref());
        (a, "Adopt as a fabric handle (the allocation becomes a region on the GPU's HBM)")
    } else {
        (session.adopt_gpu(mem, d.device.as_deref()), "Adopt (the allocation becomes a region on the GPU's HBM)")
    };
    let Some(region) = r.step(
        step,
        adopted.map_err(|e| e.to_string()),
        |g| json!({ "region": g.id(), "device": g.device(), "gfa": g.gfa(), "size": g.size() }),
    ) else {
        return Value::Null;
    };
    let exported = region.export(&Policy::default()).map_err(|e| e.to_string());
    let Some(handle) = r.step("Export", exported, |h| json!({ "region": h.region() })) else {
        return Value::Null;
    };
    let child_out = out.with_extension("importer.json");
    // Once the importer's stores are done, the region is freed: the importer must see the
    // revocation. The allocation stays this process's (`mem`), for the exporter's check.
    let mut region = Some(region);
    let result = run_importer(&d.socket, &handle, iters, &child_out, || drop(region.take()));
    r.step("importer through fabricd (ImportObject, map, verify, bandwidth, latency, write)", result, Clone::clone)
        .unwrap_or(Value::Null)
}

/// The file the importer creates once its stores are done (next to its report).
pub fn written_marker(out: &Path) -> PathBuf {
    out.with_extension("written")
}

/// Importer side, after its stores: announces them, waits up to 20 s for the owner's
/// freeing of the region to arrive as a revocation, then checks the mapping still reads
/// what was written (`verify`).
pub fn await_revocation(
    r: &mut Report,
    import: &GpuImport,
    marker: &Path,
    verify: impl FnOnce() -> Result<Value, String>,
) {
    if let Err(e) = std::fs::write(marker, b"") {
        r.step("announce the stores", Err::<(), _>(e.to_string()), |_| json!(null));
        return;
    }
    let t = Instant::now();
    let seen = loop {
        match import.check() {
            Err(e) => break Ok(e.to_string()),
            Ok(()) if t.elapsed() > Duration::from_secs(20) => break Err("no revocation within 20 s".to_owned()),
            Ok(()) => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if r.step("revocation seen after the owner freed the region", seen, |why| json!({ "why": why, "after_ms": ms }))
        .is_some()
    {
        r.step("the revoked mapping still reads the data (the driver's reference)", verify(), Clone::clone);
    }
}

fn run_importer(
    socket: &Path,
    handle: &Handle,
    iters: u32,
    child_out: &Path,
    mut on_written: impl FnMut(),
) -> Result<Value, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["import", "--daemon"])
        .arg(socket)
        .args(["--handle", &handle.to_string(), "--out"])
        .arg(child_out)
        .env("GPU_CHECK_ITERS", iters.to_string())
        .spawn()
        .map_err(|e| format!("starting the importer: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(240);
    let marker = written_marker(child_out);
    let mut told = false;
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break st;
        }
        if !told && marker.exists() {
            told = true;
            on_written();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err("the importer ran past 240 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let doc: Value = std::fs::read(child_out)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_else(|| json!({ "error": "no report" }));
    if status.success() { Ok(doc) } else { Err(format!("importer exit {status}: {doc}")) }
}

/// Importer side: the import (which holds its session open while the memory is used).
pub fn import(r: &mut Report, ctx: &CudaContext, socket: &Path, handle: &str) -> Option<GpuImport> {
    let handle: Handle = r.step(
        "parse handle",
        handle.parse().map_err(|e| format!("{e}")),
        |h: &Handle| json!({ "region": h.region() }),
    )?;
    let session =
        r.step("fabricd session", open(socket), |s| json!({ "protocol": s.protocol_version().to_string() }))?;
    let imported = session.import_gpu(&handle, ctx).map_err(|e| e.to_string());
    let import = r.step(
        "ImportObject + cuMemImportFromShareableHandle",
        imported,
        |i| {
            let object = if i.is_fabric() { "fabric handle" } else { "POSIX descriptor" };
            json!({ "import": i.import_id(), "device": i.device(), "gfa": i.gfa(), "size": i.memory().size(), "object": object })
        },
    )?;
    Some(import)
}
