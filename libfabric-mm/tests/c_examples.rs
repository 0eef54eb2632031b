//! The C examples, compiled with gcc against the built library through its pkg-config file
//! (filled in for the build tree), plainly and with `-fsanitize=address`, and run against a
//! real fabricd.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn target_dir() -> PathBuf {
    std::env::current_exe().unwrap().parent().and_then(Path::parent).unwrap().to_owned()
}

/// A pkg-config directory whose fabric-mm.pc points at the build tree.
fn pkg_config_dir(dir: &Path) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = target_dir();
    assert!(
        lib.join("libfabric_mm.so").exists(),
        "{} has no libfabric_mm.so: run `cargo build -p libfabric-mm` (scripts/test.sh does)",
        lib.display()
    );
    let pc = std::fs::read_to_string(manifest.join("fabric-mm.pc.in"))
        .unwrap()
        .replace("@PREFIX@", &lib.display().to_string())
        .replace("@LIBDIR@", &lib.display().to_string())
        .replace("@INCLUDEDIR@", &manifest.join("include").display().to_string())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    std::fs::write(dir.join("fabric-mm.pc"), pc).unwrap();
    dir.to_owned()
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
    let out = Command::new(bin)
        .arg(socket)
        .env("LD_LIBRARY_PATH", target_dir())
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
        .output()
        .unwrap();
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

/// Builds `example` plainly and under ASan and runs both against one fabricd started with
/// `config` appended to its configuration; their outputs.
fn plain_and_asan(example: &str, config: &str) -> [String; 2] {
    let d = common::daemon_with_config(config);
    let tmp = tempfile::tempdir().unwrap();
    let pc = pkg_config_dir(tmp.path());
    let name = example.trim_end_matches(".c");
    let plain = tmp.path().join(name);
    build(example, &plain, &pc, &[]);
    let asan = tmp.path().join(format!("{name}-asan"));
    build(example, &asan, &pc, &["-fsanitize=address", "-fno-omit-frame-pointer"]);
    [run(&plain, &d.socket), run(&asan, &d.socket)]
}

#[test]
fn share_example_runs_plain_and_under_address_sanitizer() {
    for out in plain_and_asan("share.c", "") {
        assert!(out.contains("importer: pattern seen") && out.contains("its store is visible"), "{out}");
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
fn copy_example_runs_plain_and_under_address_sanitizer() {
    for out in plain_and_asan("copy.c", "") {
        assert!(
            out.contains("the engine copied")
                && out.contains("refusals are typed")
                && out.contains("to registered host buffer"),
            "{out}"
        );
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
