//! Builds the stand-in driver (`fake_cuda.c`) for tests that run programs on it: include
//! with `#[path = "fake_libcuda/mod.rs"] mod fake_libcuda;`.
#![allow(dead_code)] // Each test binary uses part of it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Compiles the stand-in into `dir` as libcuda.so.1 and libcuda.so (the names the library
/// and cudarc try); `dir` to put first on `LD_LIBRARY_PATH`. `None` without a C compiler.
pub fn build(dir: &Path) -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_libcuda/fake_cuda.c");
    let lib = dir.join("libcuda.so.1");
    let cc =
        Command::new("cc").args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"]).arg(&lib).arg(&src).status();
    match cc {
        Ok(s) => assert!(s.success(), "compiling the stand-in driver failed: {s}"),
        Err(_) => return None,
    }
    std::fs::copy(&lib, dir.join("libcuda.so")).expect("copy");
    Some(dir.to_owned())
}

/// The 32 hex digits of a `uuid:GPU-…` device name, as `FAKE_CUDA_UUID` takes them (the
/// stand-in then reports that UUID, so its GPU is the one fabricd knows by that name).
pub fn uuid_hex(device: &str) -> String {
    let hex: String = device.trim_start_matches("uuid:GPU-").chars().filter(|c| *c != '-').collect();
    assert_eq!(hex.len(), 32, "{device}");
    hex
}
