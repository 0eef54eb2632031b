//! gpu_check's whole CUDA path against a stand-in driver (tests/fake_libcuda/fake_cuda.c,
//! built here with `cc`): presence probe, allocation with the fabric-handle fallback,
//! granularity rounding, POSIX-fd export passed to a second process over SCM_RIGHTS,
//! import, map/set access/unmap, the pattern kernels' parameter layout, copies and event
//! timing, and the importer's stores seen in the exporter's mapping. What this cannot show
//! — that a real driver and GPU behave so — is the GPU check's job (docs/gpu.md).

mod common;
#[path = "fake_libcuda/mod.rs"]
mod fake_libcuda;

use std::path::{Path, PathBuf};
use std::process::Command;

fn gpu_check() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpu_check"))
}

/// Builds the stand-in as libcuda.so.1 in `dir` (`None`: no C compiler here).
fn fake_driver(dir: &Path) -> Option<PathBuf> {
    fake_libcuda::build(dir)
}

fn run(lib: &Path, args: &[&str], out: &Path) -> (Option<i32>, serde_json::Value) {
    run_env(lib, args, out, &[])
}

fn run_env(lib: &Path, args: &[&str], out: &Path, env: &[(&str, &str)]) -> (Option<i32>, serde_json::Value) {
    let o = Command::new(gpu_check())
        .args(args)
        .arg("--out")
        .arg(out)
        .envs(env.iter().copied())
        .env("LD_LIBRARY_PATH", lib)
        .env_remove("RUST_LOG")
        .output()
        .expect("runs");
    let doc = std::fs::read(out).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    assert!(o.status.code().is_some(), "killed by a signal: {}", String::from_utf8_lossy(&o.stderr));
    (o.status.code(), doc)
}

fn step<'a>(doc: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    doc["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .find(|s| s["step"] == name)
        .unwrap_or_else(|| panic!("{name}: {doc}"))
}

#[test]
fn the_memory_check_runs_end_to_end_on_the_stand_in_driver() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = fake_driver(dir.path()) else { return };
    let (code, probe) = run(&lib, &["probe"], &dir.path().join("probe.json"));
    assert_eq!(code, Some(0), "{probe}");
    assert_eq!(probe["driver_version"], 12080);
    assert_eq!(probe["devices"][0]["compute_capability"], serde_json::json!([9, 0]));

    let out = dir.path().join("memory.json");
    let (code, doc) = run(&lib, &["memory", "--size-mib", "3", "--iters", "3"], &out);
    assert_eq!(code, Some(0), "{doc:#}");
    assert_eq!(doc["status"], "passed");
    // 3 MiB rounds up to the stand-in's 2 MiB granularity.
    assert_eq!(doc["size"], 4 << 20);
    // The device claims fabric handles; cuMemCreate refuses them; the fallback allocates.
    assert!(
        step(&doc, "cuMemCreate with fabric handles")["unsupported"].as_str().expect("why").contains("NOT_SUPPORTED")
    );
    assert_eq!(step(&doc, "cuMemCreate")["ok"], true);
    assert_eq!(step(&doc, "fill exporter pattern")["detail"], "kernel fill_u32");
    assert_eq!(step(&doc, "verify locally")["detail"]["gpu_mismatched_words"], 0);
    assert!(step(&doc, "dma-buf export (cuMemGetHandleForAddressRange)")["unsupported"].is_string());
    assert_eq!(step(&doc, "peer access")["skipped"], "1 GPU(s): peer access needs two");
    // The importer saw the exporter's pattern, and the exporter sees the importer's.
    let imp = &doc["importer"];
    assert_eq!(imp["status"], "passed", "{imp:#}");
    assert_eq!(step(imp, "verify exporter's pattern through the import")["detail"]["gpu_mismatched_words"], 0);
    assert_eq!(step(&doc, "verify importer's stores in exporter's mapping")["ok"], true);
    let fig = &imp["figures"];
    for k in [
        "baseline cuMemcpyDtoD local->local GB/s",
        "cuMemcpyDtoD imported->local GB/s",
        "stream copy imported->local GB/s (events)",
    ] {
        assert!(fig[k].as_f64().expect(k) > 0.0, "{k}: {fig}");
    }
    assert!(fig["map us (imported)"]["samples"].as_u64().expect("samples") >= 50);
}

#[test]
fn a_content_mismatch_is_caught() {
    // The stand-in with a kernel that writes the wrong pattern: verification must fail.
    let dir = tempfile::tempdir().expect("tempdir");
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_libcuda/fake_cuda.c"))
        .expect("source")
        .replace("buf[i] = pattern(i, seed);", "buf[i] = pattern(i, seed) ^ (i == 7);");
    let bad = dir.path().join("bad.c");
    std::fs::write(&bad, src).expect("write");
    let lib = dir.path().join("libcuda.so.1");
    match Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&bad).status() {
        Ok(s) => assert!(s.success()),
        Err(_) => return,
    }
    std::fs::copy(&lib, dir.path().join("libcuda.so")).expect("copy");
    let (code, doc) = run(dir.path(), &["memory", "--size-mib", "2", "--iters", "1"], &dir.path().join("m.json"));
    assert_eq!(code, Some(1));
    assert_eq!(doc["status"], "failed");
    let v = step(&doc, "verify locally");
    assert_eq!(v["ok"], false);
    assert!(v["error"].as_str().expect("error").contains("\"gpu_mismatched_words\":1"), "{v}");
}

#[test]
fn the_memory_check_goes_through_fabricd() {
    through_fabricd(&[], "Adopt (the allocation becomes a region on the GPU's HBM)", "POSIX descriptor");
}

/// The same with the allocation handed over as a fabric handle (protocol 1.4): the stand-in
/// driver makes fabric handles when told to, and the daemon passes the bytes.
#[test]
fn the_memory_check_shares_a_fabric_handle_through_fabricd() {
    through_fabricd(
        &["--share", "fabric"],
        "Adopt as a fabric handle (the allocation becomes a region on the GPU's HBM)",
        "fabric handle",
    );
}

/// Asked to share by fabric handle where the driver makes none (no IMEX channel): a failed
/// step that says why, not a silent fall back to descriptors.
#[test]
fn a_fabric_share_without_fabric_handles_fails_and_says_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = fake_driver(dir.path()) else { return };
    let d = common::daemon();
    let out = dir.path().join("memory.json");
    let socket = d.socket.display().to_string();
    let args = ["memory", "--size-mib", "2", "--iters", "1", "--daemon", &socket, "--share", "fabric"];
    let (code, doc) = run(&lib, &args, &out);
    assert_eq!(code, Some(1), "{doc:#}");
    let s = step(&doc, "fabric handle for fabricd");
    assert_eq!(s["ok"], false, "{s}");
    assert!(s["error"].as_str().expect("error").contains("cuMemCreate"), "{s}");
    assert!(!d.log().contains("vendor object adopted"), "{}", d.log());
}

fn through_fabricd(extra: &[&str], adopt_step: &str, object: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = fake_driver(dir.path()) else { return };
    let d = common::daemon();
    let gpu = common::gpu(&common::session(&d.socket));
    // The stand-in reports the sim GPU's UUID, so the exporter finds its fabric identity
    // through CUDA (`uuid:` + cuDeviceGetUuid), as on a real host.
    let hex = fake_libcuda::uuid_hex(&gpu);
    let out = dir.path().join("memory.json");
    let socket = d.socket.display().to_string();
    let mut args = vec!["memory", "--size-mib", "2", "--iters", "2", "--daemon", &socket];
    args.extend_from_slice(extra);
    let (code, doc) = run_env(&lib, &args, &out, &[("FAKE_CUDA_UUID", &hex), ("FAKE_CUDA_FABRIC", "1")]);
    assert_eq!(code, Some(0), "{doc:#}\n{}", d.log());
    let adopted = &step(&doc, adopt_step)["detail"];
    assert_eq!(adopted["device"], gpu.as_str());
    assert!(adopted["gfa"].is_u64(), "{adopted}");
    let imp = &doc["importer"];
    assert_eq!(imp["status"], "passed", "{imp:#}");
    let got = &step(imp, "ImportObject + cuMemImportFromShareableHandle")["detail"];
    assert_eq!(got["gfa"], adopted["gfa"]);
    assert_eq!(got["device"], gpu.as_str());
    assert_eq!(got["object"], object);
    assert_eq!(step(imp, "verify exporter's pattern through the import")["detail"]["gpu_mismatched_words"], 0);
    assert_eq!(step(&doc, "verify importer's stores in exporter's mapping")["ok"], true);
    // The exporter freed the region once the importer's stores were done: the importer
    // heard of it, and its mapping still read what it had written.
    let seen = step(imp, "revocation seen after the owner freed the region");
    assert_eq!(seen["ok"], true, "{seen}");
    assert!(seen["detail"]["why"].as_str().expect("why").contains("Freed"), "{seen}");
    assert_eq!(step(imp, "the revoked mapping still reads the data (the driver's reference)")["ok"], true);
    let host = &step(&doc, "host<->device copies: registered vs pageable")["detail"];
    for k in ["HtoD registered GB/s", "HtoD pageable GB/s", "DtoH registered GB/s", "DtoH pageable GB/s"] {
        assert!(host[k].as_f64().expect(k) > 0.0, "{k}: {host}");
    }
    let log = d.log();
    assert!(log.contains("vendor object adopted") && log.contains("imported"), "{log}");
}

#[test]
fn with_two_stand_in_gpus_the_memory_check_copies_across_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = fake_driver(dir.path()) else { return };
    let out = dir.path().join("memory.json");
    let env = [("FAKE_CUDA_DEVICES", "2")];
    let (code, doc) = run_env(&lib, &["memory", "--size-mib", "2", "--iters", "1"], &out, &env);
    assert_eq!(code, Some(0), "{doc:#}");
    assert_eq!(step(&doc, "can access peer 0->1")["detail"], true);
    assert_eq!(step(&doc, "enable peer access 0->1")["ok"], true);
    assert_eq!(step(&doc, "map with access for GPU 1")["detail"]["granted"], serde_json::json!([0, 1]));
    let read = step(&doc, "GPU 1 kernel reads GPU 0's memory through the peer mapping");
    assert_eq!(read["detail"]["gpu_mismatched_words"], 0, "{read}");
    assert_eq!(step(&doc, "GPU 1 copies from GPU 0")["ok"], true);
    assert_eq!(step(&doc, "verify the copy on GPU 1")["detail"]["gpu_mismatched_words"], 0);
    let refused = step(&doc, "copy by GPU 1 without its access is refused");
    assert!(refused["detail"].as_str().expect("why").contains("device 1 was not granted access"), "{refused}");
}

/// The child process of `peer_access_on_two_stand_in_gpus` (set: the stand-in's path).
const PEER_CHILD: &str = "FAKE_CUDA_PEER_CHILD";

#[test]
fn peer_access_on_two_stand_in_gpus() {
    let Some(lib) = std::env::var_os(PEER_CHILD) else {
        // The parent: build the stand-in and run this test again on it, with two devices.
        let dir = tempfile::tempdir().expect("tempdir");
        let Some(lib) = fake_driver(dir.path()) else { return };
        let o = Command::new(std::env::current_exe().expect("exe"))
            .args(["--exact", "peer_access_on_two_stand_in_gpus", "--nocapture", "--test-threads=1"])
            .env(PEER_CHILD, &lib)
            .env("FAKE_CUDA_DEVICES", "2")
            .env("LD_LIBRARY_PATH", &lib)
            .output()
            .expect("runs");
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success() && stdout.contains("1 passed"), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
        return;
    };
    two_gpus(Path::new(&lib));
}

/// The library's peer path on the stand-in, and the stand-in's own checks called directly
/// (bypassing the library's) so that they are known to answer as the driver documents.
fn two_gpus(lib: &Path) {
    use fabric_mm::cuda::{AllocOptions, CudaContext, CudaError, pattern_word};
    type Ctx = *mut std::ffi::c_void;
    let gpu0 = CudaContext::new(0).expect("GPU 0");
    let gpu1 = CudaContext::new(1).expect("GPU 1");
    // The copy cudarc loaded (libcuda.so and libcuda.so.1 are two files, each with its own
    // state), found without loading another.
    let raw: libloading::Library = ["libcuda.so", "libcuda.so.1"]
        .iter()
        .find_map(|name| {
            // SAFETY: RTLD_NOLOAD only finds a library already loaded; nothing runs.
            unsafe { libloading::os::unix::Library::open(Some(lib.join(name)), libc::RTLD_NOLOAD | libc::RTLD_NOW) }
                .ok()
        })
        .expect("the stand-in is loaded")
        .into();
    // SAFETY: the signatures are those of cuda.h (and of fake_cuda.c).
    let (retain, disable, dtod, set_access) = unsafe {
        (
            *raw.get::<unsafe extern "C" fn(*mut Ctx, i32) -> i32>(b"cuDevicePrimaryCtxRetain\0").expect("sym"),
            *raw.get::<unsafe extern "C" fn(Ctx) -> i32>(b"cuCtxDisablePeerAccess\0").expect("sym"),
            *raw.get::<unsafe extern "C" fn(u64, u64, usize) -> i32>(b"cuMemcpyDtoD_v2\0").expect("sym"),
            *raw.get::<unsafe extern "C" fn(u64, usize, *const [i32; 3], usize) -> i32>(b"cuMemSetAccess\0")
                .expect("sym"),
        )
    };
    assert_ne!(gpu0.uuid().expect("stand-in"), gpu1.uuid().expect("stand-in"));
    assert!(gpu0.can_access_peer(&gpu1).expect("stand-in") && gpu1.can_access_peer(&gpu0).expect("stand-in"));
    assert!(!gpu0.can_access_peer(&gpu0).expect("stand-in"), "a device is not its own peer");
    assert!(matches!(gpu0.enable_peer_access(&gpu0), Err(CudaError::InvalidArgument(_))));

    // Context peer access: enabled once, a second time is the driver's ALREADY_ENABLED,
    // and the guard's drop disables it (so disabling again is NOT_ENABLED).
    let mut ctx1: Ctx = std::ptr::null_mut();
    // SAFETY: `ctx1` is writable; device 1 exists.
    assert_eq!(unsafe { retain(&mut ctx1, 1) }, 0);
    let access = gpu0.enable_peer_access(&gpu1).expect("peer access 0->1");
    match gpu0.enable_peer_access(&gpu1) {
        Err(CudaError::Call { op: "cuCtxEnablePeerAccess", raw: 704, code }) => {
            assert_eq!(code, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED")
        }
        other => panic!("{other:?}"),
    }
    drop(access);
    gpu0.bind().expect("stand-in");
    // SAFETY: ctx1 is a retained context; the current one is GPU 0's.
    assert_eq!(unsafe { disable(ctx1) }, 705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: the guard disabled it");

    // VMM: GPU 0's memory, written with a pattern, mapped with and without GPU 1's access.
    let mem = gpu0.allocate(1, AllocOptions::default()).expect("allocate on GPU 0");
    let pattern: Vec<u8> = (0..mem.size() as u64 / 4).flat_map(|i| pattern_word(i, 7).to_ne_bytes()).collect();
    let shared = mem.map(&[&gpu1, &gpu1, &gpu0]).expect("map with GPU 1's access");
    assert_eq!(shared.granted(), [0, 1], "the owner once, each peer once");
    shared.write(0, &pattern).expect("stand-in");
    let private = mem.map(&[]).expect("map for GPU 0 only");
    assert_eq!(private.granted(), [0]);
    let local = gpu1.allocate(mem.size(), AllocOptions::default()).expect("allocate on GPU 1");
    let dst = local.map(&[]).expect("map on GPU 1");

    // GPU 1 copies what it was granted, and it arrives.
    dst.copy_from(&shared, mem.size()).expect("GPU 1 copies from GPU 0");
    let mut back = vec![0u8; mem.size()];
    dst.read(0, &mut back).expect("stand-in");
    assert!(back == pattern, "the copy on GPU 1 holds GPU 0's pattern");
    // Not what it was not granted: a typed refusal from the library, before the driver...
    match dst.copy_from(&private, mem.size()) {
        Err(CudaError::NoAccess { device: 1, owner: 0 }) => {}
        other => panic!("{other:?}"),
    }
    let stream = gpu1.stream().expect("stand-in");
    // SAFETY: the copy is refused before it is queued; nothing outlives anything.
    let queued = unsafe { stream.copy_async(&dst, &private, mem.size()) };
    assert!(matches!(queued, Err(CudaError::NoAccess { device: 1, owner: 0 })), "{queued:?}");
    // ...and the stand-in refuses it too when asked directly, as a copy engine would fail.
    gpu1.bind().expect("stand-in");
    let n = mem.size();
    // SAFETY: both ranges are live mappings of `n` bytes; the stand-in copies host memory.
    unsafe {
        assert_eq!(dtod(dst.device_ptr(), private.device_ptr(), n), 1, "CUDA_ERROR_INVALID_VALUE");
        assert_eq!(dtod(dst.device_ptr(), shared.device_ptr(), n), 0);
    }
    // cuMemSetAccess: a location that is no device; then access taken away again.
    // SAFETY: each descriptor is (location type DEVICE, id, flags) as CUmemAccessDesc is.
    unsafe {
        assert_eq!(set_access(shared.device_ptr(), n, &[1, 5, 3], 1), 101, "CUDA_ERROR_INVALID_DEVICE");
        assert_eq!(set_access(shared.device_ptr() + 4096, n - 4096, &[1, 1, 3], 1), 1, "not a whole mapping");
        assert_eq!(set_access(shared.device_ptr(), n, &[1, 1, 0], 1), 0, "PROT_NONE for GPU 1");
        assert_eq!(dtod(dst.device_ptr(), shared.device_ptr(), n), 1, "GPU 1's access is gone");
    }
}
