//! The committed C header equals what cbindgen generates from src/ffi.rs now; run with
//! `UPDATE_HEADER=1` to rewrite it after changing the C ABI.
#![allow(clippy::unwrap_used)]

use std::path::Path;

#[test]
fn committed_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses src/ffi.rs")
        .write(&mut generated);
    let path = dir.join("include/fabric_mm.h");
    if std::env::var_os("UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale: run `UPDATE_HEADER=1 cargo test -p libfabric-mm --test c_header` and commit it",
        path.display()
    );
}

/// Every name the header defines is the library's own (`FMM_…`, the include guard): a
/// `pub const` elsewhere in the crate is not part of the C ABI (it was: `#define LINE 64`
/// from the cache-line flush).
#[test]
fn the_header_defines_only_prefixed_names() {
    let header = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/fabric_mm.h")).unwrap();
    let stray: Vec<&str> = header
        .lines()
        .filter_map(|l| l.strip_prefix("#define "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| !name.starts_with("FMM_") && *name != "FABRIC_MM_H")
        .collect();
    assert!(stray.is_empty(), "names outside the FMM_ prefix in the header: {stray:?}");
}
