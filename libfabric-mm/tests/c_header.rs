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
