//! GPU memory shared across nodes of one NVLink domain by its CUDA fabric handle, on the
//! stand-in driver: three real fabricd nodes (a private etcd, certificates from a test CA)
//! — tray0 and tray1 of the sim supernode, whose GPUs are NV18 through the fabric
//! switches, and an HGX host, `node0`, that shares no NVLink with them. A session on tray0
//! adopts a fabric-handle allocation and exports it; a session on tray1 imports the handle
//! through tray1 (`ImportObject`, asked of tray0 over the node link), imports the handle
//! into its own CUDA context and reads tray0's bytes, and stores back; `node0` is refused
//! (not in the NVLink domain), as is a POSIX-descriptor allocation (a descriptor of tray0's
//! host cannot cross nodes); tray0 frees the region and tray1's callback runs with `Freed`.
//! In a domain whose data paths leave out `nvlink`, tray1 is refused the handle, told why.
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

    let test = "a_fabric_handle_reaches_a_node_of_the_same_nvlink_domain_and_no_other";
    in_child(test, CHILD, &[&n0, &n1, &far], &lib);
    assert!(n0.log().contains("node link: vendor object granted"), "{}", n0.log());
    assert!(n1.log().contains("imported another node's vendor object"), "{}", n1.log());
}

/// Set in the child of the data-path test: the sockets of tray0 and tray1.
const CHILD_NO_NVLINK: &str = "FABRIC_MM_CROSSNODE_GPU_NO_NVLINK";

#[test]
fn a_domain_whose_data_paths_leave_out_nvlink_hands_no_fabric_handle_to_another_node() {
    if let Ok(sockets) = std::env::var(CHILD_NO_NVLINK) {
        return child_no_nvlink(&sockets);
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = fake_libcuda::build(dir.path()) else {
        eprintln!("skipped: no C compiler for the stand-in driver");
        return;
    };
    let Some(mut lab) = domain::Lab::start() else { return };
    lab.domain_lines = "data_paths = [\"shared_file\", \"cxl\"]\n".to_owned();
    let supernode = domain::sim("supernode-64.toml");
    let n0 = lab.node(&supernode, None, "tray0");
    let n1 = lab.node(&supernode, None, "tray1");
    domain::wait_live(&[&n0, &n1]);
    let test = "a_domain_whose_data_paths_leave_out_nvlink_hands_no_fabric_handle_to_another_node";
    in_child(test, CHILD_NO_NVLINK, &[&n0, &n1], &lib);
}

/// Runs `test` again in a child process with the stand-in driver first on its library path
/// and `var` naming the nodes' sockets; fails with the child's output and the nodes' logs.
fn in_child(test: &str, var: &str, nodes: &[&common::Daemon], lib: &Path) {
    let sockets = nodes.iter().map(|n| n.socket.display().to_string()).collect::<Vec<_>>().join(" ");
    let o = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(var, sockets)
        .env("LD_LIBRARY_PATH", lib)
        .env("FAKE_CUDA_FABRIC", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let logs: String = nodes.iter().enumerate().map(|(i, n)| format!("\n--- node {i}\n{}", n.log())).collect();
    assert!(
        o.status.success() && stdout.contains("1 passed"),
        "{stdout}\n{}{logs}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The first GPU with HBM of `node`, as `session` lists the domain's devices.
fn gpu_of(session: &fabric_mm::Session, node: &str) -> String {
    session
        .devices()
        .unwrap()
        .into_iter()
        .find(|d| d.node.as_deref() == Some(node) && d.memory.iter().any(|(c, _)| *c == MemoryClass::Hbm))
        .unwrap_or_else(|| panic!("{node} has a GPU"))
        .id
}

/// tray0 exports a fabric-handle allocation; tray1, of the same NVLink domain, is refused
/// because the domain's data paths leave out nvlink.
fn child_no_nvlink(sockets: &str) {
    let s: Vec<&str> = sockets.split(' ').collect();
    let gpu = CudaContext::new(0).unwrap();
    let owner = common::session(Path::new(s[0]));
    let device = gpu_of(&owner, "tray0");
    let mem = gpu.allocate(LEN, AllocOptions { fabric: true, ..AllocOptions::default() }).unwrap();
    let region = owner.adopt_gpu_fabric(&mem, Some(&device)).unwrap();
    let handle = region.export(&Policy::default()).unwrap();
    let importer = common::session(Path::new(s[1]));
    let e = importer.import_gpu(&handle, &gpu).unwrap_err().to_string();
    assert!(e.contains("data paths (shared_file, cxl) leave out nvlink"), "{e}");
}

/// The CUDA side, on the stand-in: `sockets` are tray0's, tray1's and node0's.
fn child(sockets: &str) {
    let s: Vec<&str> = sockets.split(' ').collect();
    let gpu = CudaContext::new(0).unwrap();
    let owner = common::session(Path::new(s[0]));
    // tray0's own GPU (the session lists the domain's devices).
    let device = gpu_of(&owner, "tray0");

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
