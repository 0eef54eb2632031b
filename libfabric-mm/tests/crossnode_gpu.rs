//! GPU memory shared across nodes of one NVLink domain by its CUDA fabric handle, on the
//! stand-in driver: three real fabricd nodes (a private etcd, certificates from a test CA)
//! — tray0 and tray1 of the sim supernode, whose GPUs are NV18 through the fabric
//! switches, and an HGX host, `node0`, that shares no NVLink with them. A session on tray0
//! adopts a fabric-handle allocation and exports it; a session on tray1 imports the handle
//! through tray1 (`ImportObject`, asked of tray0 over the node link), imports the handle
//! into its own CUDA context and reads tray0's bytes, and stores back; `node0` is refused
//! (not in the NVLink domain), as is a POSIX-descriptor allocation (a descriptor of tray0's
//! host cannot cross nodes); tray0 frees the region and tray1's callback runs with `Freed`.
//!
//! The stand-in's "fabric handle" is a pid and a descriptor read through `/proc` (same host,
//! same uid), so what this shows is fabricd's part — authorization, the NVLink-domain check,
//! the handle's journey and revocation — not IMEX (docs/gpu.md says what real NVL systems
//! also need). The CUDA work runs in a child process (this test re-run) whose
//! `LD_LIBRARY_PATH` puts the stand-in first.
//!
//! Without an `etcd` binary or a C compiler it says it is skipped.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

#[path = "fake_libcuda/mod.rs"]
mod fake_libcuda;

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use common::domain;
use fabric_mm::cuda::{AllocOptions, CudaContext};
use fabric_mm::{Error, MemoryClass, Policy, RevocationReason};

/// Set in the child: the sockets of tray0, tray1 and node0.
const CHILD: &str = "FABRIC_MM_CROSSNODE_GPU";
const LEN: usize = 2 << 20;

#[test]
fn a_fabric_handle_reaches_a_node_of_the_same_nvlink_domain_and_no_other() {
    if let Ok(sockets) = std::env::var(CHILD) {
        return child(&sockets);
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = fake_libcuda::build(dir.path()) else {
        eprintln!("skipped: no C compiler for the stand-in driver");
        return;
    };
    let Some(lab) = domain::Lab::start() else { return };
    let supernode = domain::sim("supernode-64.toml");
    let n0 = lab.node(&supernode, None, "tray0");
    let n1 = lab.node(&supernode, None, "tray1");
    let far = lab.node(&domain::sim("hgx-h100-8gpu.toml"), None, "node0");
    domain::wait_live(&[&n0, &n1, &far]);

    let sockets = [&n0, &n1, &far].map(|n| n.socket.display().to_string()).join(" ");
    let o = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "a_fabric_handle_reaches_a_node_of_the_same_nvlink_domain_and_no_other"])
        .args(["--nocapture", "--test-threads=1"])
        .env(CHILD, sockets)
        .env("LD_LIBRARY_PATH", &lib)
        .env("FAKE_CUDA_FABRIC", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && stdout.contains("1 passed"),
        "{stdout}\n{}\n--- tray0\n{}\n--- tray1\n{}",
        String::from_utf8_lossy(&o.stderr),
        n0.log(),
        n1.log()
    );
    assert!(n0.log().contains("node link: vendor object granted"), "{}", n0.log());
    assert!(n1.log().contains("imported another node's vendor object"), "{}", n1.log());
}

/// The CUDA side, on the stand-in: `sockets` are tray0's, tray1's and node0's.
fn child(sockets: &str) {
    let s: Vec<&str> = sockets.split(' ').collect();
    let gpu = CudaContext::new(0).unwrap();
    let owner = common::session(Path::new(s[0]));
    // tray0's own GPU (the session lists the domain's devices).
    let device = owner
        .devices()
        .unwrap()
        .into_iter()
        .find(|d| d.node.as_deref() == Some("tray0") && d.memory.iter().any(|(c, _)| *c == MemoryClass::Hbm))
        .expect("tray0 has a GPU")
        .id;

    // tray0: a fabric-handle allocation with a pattern, adopted and exported.
    let mem = gpu.allocate(LEN, AllocOptions { fabric: true, ..AllocOptions::default() }).unwrap();
    let om = mem.map(&[&gpu]).unwrap();
    om.write(0, b"tray0's HBM").unwrap();
    let region = owner.adopt_gpu_fabric(&mem, Some(&device)).unwrap();
    let handle = region.export(&Policy::default()).unwrap();

    // tray1: the same ImportObject call as for a local handle.
    let importer = common::session(Path::new(s[1]));
    let imp = importer.import_gpu(&handle, &gpu).unwrap();
    assert!(imp.is_fabric());
    assert_eq!(imp.device(), device, "the exporter's GPU, named as tray0 names it");
    assert_eq!(imp.gfa(), region.gfa(), "one GFA on both nodes");
    assert_eq!(imp.region(), (region.id(), region.generation()));
    let im = imp.memory().map(&[&gpu]).unwrap();
    let mut seen = [0u8; 11];
    im.read(0, &mut seen).unwrap();
    assert_eq!(&seen, b"tray0's HBM", "tray0's bytes through tray1's import");
    im.write(LEN - 8, b"on tray1").unwrap();
    let mut back = [0u8; 8];
    om.read(LEN - 8, &mut back).unwrap();
    assert_eq!(&back, b"on tray1", "tray1's store in tray0's allocation");

    // node0 shares no NVLink with tray0: refused, and told why.
    let far = common::session(Path::new(s[2]));
    let e = far.import_gpu(&handle, &gpu).unwrap_err().to_string();
    assert!(e.contains("not in the NVLink domain") && e.contains("tray0"), "{e}");

    // A POSIX-descriptor allocation is tray0's host's alone.
    let posix = gpu.allocate(LEN, AllocOptions::default()).unwrap();
    let posix_region = owner.adopt_gpu(&posix, Some(&device)).unwrap();
    let posix_handle = posix_region.export(&Policy::default()).unwrap();
    let e = importer.import_gpu(&posix_handle, &gpu).unwrap_err().to_string();
    assert!(e.contains("cannot cross nodes"), "{e}");

    // tray0 frees the region: tray1's callback runs with Freed, the import reports revoked.
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    importer.on_revocation(move |r| {
        let _ = tx.lock().unwrap().send(*r);
    });
    drop(region);
    let r = rx.recv_timeout(Duration::from_secs(1)).expect("the revocation within a second of the free");
    assert_eq!((r.reason, r.import), (RevocationReason::Freed, imp.import_id()));
    assert!(matches!(imp.check(), Err(Error::Revoked { reason: RevocationReason::Freed, .. })));
}
