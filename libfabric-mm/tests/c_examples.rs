//! The C examples, compiled with gcc against the built library through its pkg-config file
//! (filled in for the build tree), plainly and with `-fsanitize=address`, and run against a
//! real fabricd; `gpu_share.c` on the stand-in CUDA driver (tests/fake_libcuda) and with no
//! driver at all.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "fake_libcuda/mod.rs"]
mod fake_libcuda;

use std::path::{Path, PathBuf};
use std::process::Command;

fn target_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().and_then(Path::parent).unwrap().to_owned()
}

/// Installs the built library into a prefix under `dir` with `scripts/install-mm.sh` (what
/// a C user runs) and returns the directory of the fabric-mm.pc it wrote.
fn pkg_config_dir(dir: &Path) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = target_dir();
    assert!(
        lib.join("libfabric_mm.so").exists(),
        "{} has no libfabric_mm.so: run `cargo build -p libfabric-mm` (scripts/test.sh does)",
        lib.display()
    );
    let prefix = dir.join("prefix");
    let out = Command::new(manifest.join("../scripts/install-mm.sh"))
        .arg("--prefix")
        .arg(&prefix)
        .arg("--from")
        .arg(&lib)
        .output()
        .unwrap();
    assert!(out.status.success(), "install-mm.sh: {}", String::from_utf8_lossy(&out.stderr));
    prefix.join("lib/pkgconfig")
}

fn build(example: &str, out: &Path, pc_dir: &Path, extra: &[&str]) {
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "fabric-mm"])
        .env("PKG_CONFIG_PATH", pc_dir)
        .output()
        .expect("pkg-config is installed (scripts/deps.sh installs pkgconf)");
    assert!(flags.status.success(), "pkg-config: {}", String::from_utf8_lossy(&flags.stderr));
    let flags = String::from_utf8(flags.stdout).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/c").join(example);
    let cc = Command::new("gcc")
        .args(["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-g", "-O1"])
        .args(extra)
        .arg(&src)
        .args(flags.split_whitespace())
        .arg("-o")
        .arg(out)
        .output()
        .unwrap();
    assert!(cc.status.success(), "gcc {example} {extra:?}:\n{}", String::from_utf8_lossy(&cc.stderr));
}

fn run(bin: &Path, socket: &Path) -> String {
    run_with(bin, socket, None, &[])
}

/// Runs `bin SOCKET` with `lib` (a stand-in libcuda's directory) first on the library path
/// and `env` set; the exit status, stdout and stderr.
fn output(bin: &Path, socket: &Path, lib: Option<&Path>, env: &[(&str, &str)]) -> std::process::Output {
    output_args(bin, socket, &[], lib, env)
}

/// [`output`] with arguments after the socket.
fn output_args(
    bin: &Path,
    socket: &Path,
    args: &[&str],
    lib: Option<&Path>,
    env: &[(&str, &str)],
) -> std::process::Output {
    let path = match lib {
        Some(lib) => format!("{}:{}", lib.display(), target_dir().display()),
        None => target_dir().display().to_string(),
    };
    Command::new(bin)
        .arg(socket)
        .args(args)
        .env("LD_LIBRARY_PATH", path)
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// [`output`] of a run that must succeed: its stdout.
fn run_with(bin: &Path, socket: &Path, lib: Option<&Path>, env: &[(&str, &str)]) -> String {
    let out = output(bin, socket, lib, env);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        bin.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Builds `example` plainly and under ASan into `dir`: the two binaries.
fn build_both(example: &str, dir: &Path) -> [PathBuf; 2] {
    let pc = pkg_config_dir(dir);
    let name = example.trim_end_matches(".c");
    let plain = dir.join(name);
    build(example, &plain, &pc, &[]);
    let asan = dir.join(format!("{name}-asan"));
    build(example, &asan, &pc, &["-fsanitize=address", "-fno-omit-frame-pointer"]);
    [plain, asan]
}

/// Builds `example` plainly and under ASan and runs both against one fabricd started with
/// `config` appended to its configuration; their outputs.
fn plain_and_asan(example: &str, config: &str) -> [String; 2] {
    let d = common::daemon_with_config(config);
    let tmp = tempfile::tempdir().unwrap();
    build_both(example, tmp.path()).map(|bin| run(&bin, &d.socket))
}

#[test]
fn share_example_runs_plain_and_under_address_sanitizer() {
    for out in plain_and_asan("share.c", "") {
        assert!(out.contains("importer: pattern seen") && out.contains("its store is visible"), "{out}");
    }
}

/// `scripts/install-mm.sh` as a packager runs it: staged under a DESTDIR for a prefix
/// that does not exist yet, the header byte for byte the committed one, a pkg-config file
/// naming the final prefix and the crate's version, and a static archive that links on its
/// own (no libfabric_mm.so on the library path) into a program that runs.
#[test]
fn install_script_stages_library_header_and_pkg_config_for_a_prefix() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = manifest.join("../scripts/install-mm.sh");
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("stage");
    let out = Command::new(&script)
        .args(["--prefix", "/opt/fabric", "--destdir"])
        .arg(&dest)
        .arg("--from")
        .arg(target_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "install-mm.sh: {}", String::from_utf8_lossy(&out.stderr));
    let root = dest.join("opt/fabric");
    assert_eq!(
        std::fs::read(root.join("include/fabric_mm.h")).unwrap(),
        std::fs::read(manifest.join("include/fabric_mm.h")).unwrap()
    );
    for lib in ["libfabric_mm.so", "libfabric_mm.a"] {
        assert!(root.join("lib").join(lib).is_file(), "{lib} not installed");
    }
    let pc = std::fs::read_to_string(root.join("lib/pkgconfig/fabric-mm.pc")).unwrap();
    assert!(pc.lines().any(|l| l == "prefix=/opt/fabric"), "{pc}");
    assert!(pc.lines().any(|l| l == "includedir=/opt/fabric/include"), "{pc}");
    assert!(!pc.contains('@'), "an unfilled placeholder: {pc}");
    let version = Command::new("pkg-config")
        .args(["--modversion", "fabric-mm"])
        .env("PKG_CONFIG_PATH", root.join("lib/pkgconfig"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&version.stdout).trim(), env!("CARGO_PKG_VERSION"));

    // The staged archive, with the private libraries pkg-config names for static links.
    let private = Command::new("pkg-config")
        .args(["--static", "--libs-only-l", "fabric-mm"])
        .env("PKG_CONFIG_PATH", root.join("lib/pkgconfig"))
        .output()
        .unwrap();
    let private = String::from_utf8(private.stdout).unwrap();
    let bin = tmp.path().join("share-static");
    let cc = Command::new("gcc")
        .args(["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg(manifest.join("examples/c/share.c"))
        .arg(format!("-I{}", root.join("include").display()))
        .arg(root.join("lib/libfabric_mm.a"))
        .args(private.split_whitespace().filter(|f| *f != "-lfabric_mm"))
        .arg("-o")
        .arg(&bin)
        .output()
        .unwrap();
    assert!(cc.status.success(), "gcc share.c static:\n{}", String::from_utf8_lossy(&cc.stderr));
    let d = common::daemon_with_config("");
    let run = Command::new(&bin).arg(&d.socket).env_remove("LD_LIBRARY_PATH").output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success() && stdout.contains("importer: pattern seen"), "{stdout}");

    // Bad arguments: exit status 2 and a message, nothing installed.
    for args in [&["--prefix", "relative/dir"][..], &["--bogus"], &["--prefix"]] {
        let out = Command::new(&script).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}

#[test]
fn register_example_runs_plain_and_under_address_sanitizer() {
    for out in plain_and_asan("register.c", "") {
        assert!(
            out.contains("again: cache hit") && out.contains("at IOVA 0x") && out.contains("register: done"),
            "{out}"
        );
    }
}

#[test]
fn topology_example_prints_the_gpu_matrix_from_one_view_plain_and_under_address_sanitizer() {
    for out in plain_and_asan("topology.c", "") {
        assert!(out.contains("8 GPUs") && out.contains("topology: done"), "{out}");
        // The HGX sim: every GPU pair over NVSwitch, X on the diagonal.
        let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("GPU") && l.contains("  X")).collect();
        assert_eq!(rows.len(), 8, "{out}");
        assert!(
            rows.iter().all(|r| r.split_whitespace().skip(1).filter(|c| c.starts_with("NV")).count() == 7),
            "{out}"
        );
        assert!(out.contains("GPU0 -> GPU1: NV"), "{out}");
        assert!(out.contains("nearest 0: ") && out.contains("class 0, X"), "own HBM first: {out}");
    }
}

#[test]
fn copy_example_runs_plain_and_under_address_sanitizer() {
    for out in plain_and_asan("copy.c", "") {
        assert!(
            out.contains("the engine copied")
                && out.contains("refusals are typed")
                && out.contains("to registered host buffer")
                && out.contains("completion callback got 3145745 bytes, also with the handle freed first"),
            "{out}"
        );
    }
}

/// The sim CXL pool's 2-way interleave set over mem0 and mem1 (4 KiB granules).
const CXL_SET: &str = "cxl-region:hpa-0x1000000000";

#[test]
fn interleave_example_allocates_on_a_set_translates_and_is_called_back_on_revocation() {
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml").canonicalize().unwrap();
    let d = common::daemon_with(&sim, "", |_| {});
    let tmp = tempfile::tempdir().unwrap();
    for bin in build_both("interleave.c", tmp.path()) {
        let out = output_args(&bin, &d.socket, &[CXL_SET], None, &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        for want in [
            "unknown set refused (-11): ",
            CXL_SET,
            // 5 MiB rounded up to 2 ways x 2 MiB.
            "interleave: 8388608 bytes (5242880 asked) on ",
            "cxl_volatile#0 + 0x0 (set ",
            "cxl_volatile#0 + 0x1005 (set ",
            "cxl_volatile#0 + 0x3fffff (set ",
            "the top of the address space is unmapped",
            "every member byte reverses to its GFA",
            "revoked by its owner; import check -13",
            "interleave: done",
        ] {
            assert!(stdout.contains(want), "{}: no {want:?} in\n{stdout}", bin.display());
        }
    }
}

#[test]
fn resume_example_takes_a_closed_session_back_by_token_plain_and_under_address_sanitizer() {
    for out in plain_and_asan("resume.c", "[memory]\ndetach_grace_s = 60\n") {
        let token = out.lines().find_map(|l| l.strip_prefix("owner: token ")).unwrap_or_else(|| panic!("{out}"));
        assert!(token.len() > 32 && token[..32].bytes().all(|b| b.is_ascii_hexdigit()), "{out}");
        assert!(
            out.contains("connection closed, region not freed")
                && out.contains("resumed: token kept, pattern seen")
                && out.contains("export revoked by the new owner; the token resumes once"),
            "{out}"
        );
    }
}

#[test]
fn gpu_share_example_shares_gpu_memory_through_fabricd_on_the_stand_in_driver() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(lib) = fake_libcuda::build(tmp.path()) else { return };
    let d = common::daemon();
    // The stand-in GPU is the sim GPU fabricd knows: adopt finds it by CUDA's UUID.
    let gpu = common::gpu(&common::session(&d.socket));
    let hex = fake_libcuda::uuid_hex(&gpu);
    let [plain, asan] = build_both("gpu_share.c", tmp.path());
    for bin in [plain, asan, bundled(tmp.path())] {
        let out = run_with(&bin, &d.socket, Some(&lib), &[("FAKE_CUDA_UUID", &hex)]);
        for want in [
            // 3 MiB asked, rounded up to the stand-in's 2 MiB granularity.
            "exporter: 4194304 bytes (3145728 asked) at device address 0x",
            &format!("adopted as a region of 4194304 bytes on {gpu} at GFA 0x"),
            "importer: 4194304 bytes imported, mapped at device address 0x",
            "exporter's pattern seen",
            "importer: device-to-device copy verified",
            "exporter: the importer's stores are in this GPU's memory",
            "importer: revoked (-13): region ",
            "was revoked: Freed",
            "importer: done",
            "exporter: region freed",
            "gpu_share: passed",
        ] {
            assert!(out.contains(want), "{}: no {want:?} in\n{out}", bin.display());
        }
        // The stand-in has no dma-buf: the driver's refusal is FMM_E_DEVICE with its name.
        assert!(out.contains("no dma-buf here: cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED"), "{out}");
    }
    let log = d.log();
    assert!(log.contains("vendor object adopted") && log.contains("imported"), "{log}");
}

/// `gpu_share SOCKET fabric`: the allocation travels as a fabric handle (the stand-in makes
/// them with `FAKE_CUDA_FABRIC=1`); without fabric handles in the driver it fails, saying so.
#[test]
fn gpu_share_example_shares_by_fabric_handle_on_the_stand_in_driver() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(lib) = fake_libcuda::build(tmp.path()) else { return };
    let d = common::daemon();
    let gpu = common::gpu(&common::session(&d.socket));
    let hex = fake_libcuda::uuid_hex(&gpu);
    let [plain, asan] = build_both("gpu_share.c", tmp.path());
    for bin in [plain, asan] {
        let env = [("FAKE_CUDA_UUID", hex.as_str()), ("FAKE_CUDA_FABRIC", "1")];
        let out = output_args(&bin, &d.socket, &["fabric"], Some(&lib), &env);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        for want in [
            "exporter: handed over as a fabric handle",
            "exporter's pattern seen",
            "exporter: the importer's stores are in this GPU's memory",
            "was revoked: Freed",
            "gpu_share: passed",
        ] {
            assert!(stdout.contains(want), "{}: no {want:?} in\n{stdout}", bin.display());
        }
        let out = output_args(&bin, &d.socket, &["fabric"], Some(&lib), &env[..1]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("fmm_gpu_alloc"), "{stderr}");
    }
    assert!(d.log().contains("kind=\"CUDA fabric handle\"") || d.log().contains("CUDA fabric handle"), "{}", d.log());
}

/// `gpu_share` as scripts/gpu-bundle-c.sh links it for the GPU check (against the static
/// library of this build): it needs no libfabric_mm.so.
fn bundled(dir: &Path) -> PathBuf {
    let profile = target_dir().file_name().unwrap().to_str().unwrap().to_owned();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-bundle-c.sh");
    let out =
        Command::new(script).arg(dir.join("bundle")).arg(&profile).env("FABRIC_BUNDLE_NO_BUILD", "1").output().unwrap();
    assert!(out.status.success(), "gpu-bundle-c.sh: {}", String::from_utf8_lossy(&out.stderr));
    let bin = dir.join("bundle/bin/gpu_share");
    let elf = Command::new("readelf").arg("-d").arg(&bin).output().unwrap();
    let dynamic = String::from_utf8_lossy(&elf.stdout);
    assert!(dynamic.contains("NEEDED") && !dynamic.contains("libfabric_mm"), "{dynamic}");
    bin
}

#[test]
fn gpu_share_example_without_a_driver_exits_3_with_the_reason() {
    // On a machine with a CUDA driver there is no "without" to show.
    if fabric_mm::cuda::probe_library(&[fabric_mm::cuda::LIBCUDA]).is_ok() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // No daemon either: the example stops at fmm_gpu_open, before any session.
    let socket = tmp.path().join("no-daemon.sock");
    let [plain, asan] = build_both("gpu_share.c", tmp.path());
    for bin in [plain, asan, bundled(tmp.path())] {
        let out = output(&bin, &socket, None, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{}: {stderr}", bin.display());
        assert!(
            stderr.contains(
                "exporter: no GPU here (-33): CUDA not present: libcuda.so.1: cannot open shared object file"
            ),
            "{stderr}"
        );
        // The importer saw the exporter give up and left quietly; ASan found no leak.
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(String::from_utf8_lossy(&out.stdout).is_empty());
    }
}

/// `crossnode.c` across real domain nodes (a private etcd, node-link certificates from a
/// test CA), plain and under ASan: from tray0 to tray1, which shares the sim's fabric (the
/// import is mapped; stores are seen both ways), and to tray2, which does not (the import
/// is copy-only; bytes are pushed and pulled over the node link).
#[test]
fn crossnode_example_maps_or_copies_another_nodes_memory_plain_and_under_address_sanitizer() {
    let Some(lab) = common::domain::Lab::start() else { return };
    let shared = lab.dir.path().join("sim");
    let supernode = common::domain::sim("supernode-64.toml");
    let n0 = lab.node(&supernode, Some(&shared), "tray0");
    let n1 = lab.node(&supernode, Some(&shared), "tray1");
    let n2 = lab.node(&supernode, None, "tray2");
    common::domain::wait_live(&[&n0, &n1, &n2]);
    let tmp = tempfile::tempdir().unwrap();
    for bin in build_both("crossnode.c", tmp.path()) {
        for (importer, path) in [(&n1, "mapped another node's region"), (&n2, "copy-only import")] {
            let out = output_args(&bin, &n0.socket, &[importer.socket.to_str().unwrap()], None, &[]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains(path),
                "{} to {}: {}\n{stdout}\n{}",
                bin.display(),
                importer.socket.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
