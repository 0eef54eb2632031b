//! Tier 3, two hosts: two guests whose CXL type-3 devices share one host file, each running
//! fabricd as a node of one domain (etcd in guest A, reached over a private link between
//! the guests; the node link between the two fabricds over that link too, with
//! certificates from a test CA made here). Each claims a share of the shared device in
//! the domain, and the two are disjoint. A stores into a region on its set (inside A's
//! share); B finds the
//! region's GFA in its domain map as node a's, and B's client imports A's handle: B's
//! fabricd asks A over the node link and hands its client B's own DAX device at the
//! region's place in the set; the client loads A's bytes and stores its own; A loads them
//! back through its fabricd; the host finds B's stores in the shared file at that offset
//! (the DPA: a 1-way region from DPA 0).
//!
//! The per-region variant runs the same with `[memory] dax_per_region` on both hosts: A's
//! region has a DAX device of its own, B's fabricd carves one at the region's range for the
//! import, and A's free of the region ends a mapping B still holds (its load faults) and
//! leaves no device behind on B. B's fabricd is stopped while A frees the region: A keeps
//! the region's DPAs quarantined for B until B, resumed, deletes its device and
//! acknowledges.

use std::time::Duration;

use fabric_nodelink::DomainCa;
use fabric_qemu_tests::twohost::{self, Host, SERIAL};
use fabric_qemu_tests::{env, scripts, vm};

/// Bytes and patterns of guest/domain.sh.
const LEN: u64 = 0x80_0000;
const SEED_B: u64 = 0x5eed_00b2;

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0)).and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

fn spec(host: Host, run: &Run, port: u16, etcd: &[u8], ca: &DomainCa) -> vm::VmSpec {
    let file = run.file.as_path();
    let mut spec = vm::VmSpec::new(&format!("{}-{}", run.name, host.node()), scripts::DOMAIN);
    if run.per_region {
        spec.files.push(("fabric/per-region".into(), Vec::new()));
    }
    // A run takes about a minute; a guest the emulator starved past this is failed here,
    // before nextest's 10-minute kill, and the test run once more (its retry:
    // .config/nextest.toml).
    spec.timeout = Duration::from_secs(240);
    twohost::add(&mut spec, host, file, port).expect("the shared backing file");
    // The node link's credentials: the domain CA and this node's certificate.
    let node = ca.issue(host.node(), &[]).expect("a node certificate");
    spec.files.push(("fabric/ca.pem".into(), ca.pem().cert.clone().into_bytes()));
    spec.files.push(("fabric/node.pem".into(), node.cert.into_bytes()));
    spec.files.push(("fabric/node.key".into(), node.key.into_bytes()));
    if host == Host::A {
        spec.files.push(("fabric/etcd".into(), etcd.to_vec()));
    }
    spec
}

/// One run of the two guests: its name (guests and logs), the shared file, and whether
/// both hosts carve a DAX device per region.
struct Run {
    name: &'static str,
    file: std::path::PathBuf,
    per_region: bool,
}

#[test]
fn two_hosts_share_cxl_memory_in_one_domain() {
    two_hosts("two_hosts_share_cxl_memory_in_one_domain", "domain", false);
}

#[test]
fn two_hosts_share_cxl_memory_with_a_dax_device_per_region() {
    two_hosts("two_hosts_share_cxl_memory_with_a_dax_device_per_region", "domain-per-region", true);
}

#[allow(clippy::print_stderr)] // A test's word on why it did not run.
fn two_hosts(test: &str, name: &'static str, per_region: bool) {
    let Some(pre) = env::prereqs_or_skip(test) else { return };
    let Some(etcd_bin) = fabric_domain::testing::etcd_binary() else {
        assert!(
            std::env::var("FABRIC_QEMU_TESTS").as_deref() != Ok("1"),
            "the QEMU tier is required but etcd is not installed (scripts/deps.sh installs etcd-server)"
        );
        eprintln!("{test}: not run: no etcd binary");
        return;
    };
    let etcd = std::fs::read(&etcd_bin).expect("read the etcd binary");
    let dir = pre.logs.join(format!("{name}-shared"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the shared file's directory");
    let run = Run { name, file: dir.join("shared.raw"), per_region };
    let file = run.file.clone();
    let port = free_port();
    // A listens on the link, so its QEMU starts first; both then run side by side.
    let ca = DomainCa::generate("shared-cxl").expect("a test CA");
    let a = vm::Guest::start(&pre, &spec(Host::A, &run, port, &etcd, &ca)).expect("boot A");
    let b = vm::Guest::start(&pre, &spec(Host::B, &run, port, &etcd, &ca)).expect("boot B");
    let out_b = b.finish().expect("guest B's run");
    let out_a = a.finish().expect("guest A's run");

    for (out, checks) in [
        (
            &out_a,
            &["link", "cxl-region", "dax-device", "etcd", "fabricd-start", "domain-joined", "share", "lib-alloc-store"]
                [..],
        ),
        (
            &out_b,
            &["link", "cxl-region", "dax-device", "etcd", "fabricd-start", "domain-joined", "share", "region-line"][..],
        ),
    ] {
        for c in checks {
            out.expect_check(c);
        }
    }
    // Both nodes list both, each with its slot.
    for out in [&out_a, &out_b] {
        let nodes: serde_json::Value =
            serde_json::from_str(out.blob("domain-nodes")).unwrap_or_else(|e| out.fail(&format!("nodes JSON: {e}")));
        let names: Vec<&str> =
            nodes["nodes"].as_array().into_iter().flatten().filter_map(|n| n["name"].as_str()).collect();
        if names != ["a", "b"] {
            out.fail(&format!("domain nodes {names:?}"));
        }
    }
    // Both merge the domain's topology whole: the device both kernels see under one serial
    // is the pool's, once, reached from each host by CXL.
    for out in [&out_a, &out_b] {
        out.expect_check("domain-topology");
        let doc: serde_json::Value = serde_json::from_str(out.blob("domain-topology"))
            .unwrap_or_else(|e| out.fail(&format!("topology JSON: {e}")));
        let shared: Vec<&serde_json::Value> = doc["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["id"].as_str() == Some(&format!("serial:cxl/{SERIAL:#x}")))
            .collect();
        if shared.len() != 1 || !shared[0]["node"].is_null() {
            out.fail(&format!("the shared device in the domain's topology: {shared:?}"));
        }
    }
    // A's line: handle, GFA, offset of the region in A's DAX device (0 in a device of
    // its own).
    let line = out_a.blob("lib-region").trim().to_owned();
    let field = |i: usize| {
        line.split_whitespace()
            .nth(i)
            .and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok())
            .unwrap_or_else(|| out_a.fail(&format!("lib-region line {line:?}")))
    };
    let (gfa, dax_offset) = (field(1), field(2));
    // Each host's share of the shared device (64 MiB each, claimed in the domain), and A's
    // region inside A's: a 1-way set from DPA 0, so the DAX offset is the DPA.
    let share = |out: &vm::Outcome| {
        let status: serde_json::Value =
            serde_json::from_str(out.blob("domain-status")).unwrap_or_else(|e| out.fail(&format!("status JSON: {e}")));
        let s = &status["self"]["shares"][0];
        match (s["resource"].as_str(), s["offset"].as_u64(), s["len"].as_u64()) {
            (Some(r), Some(o), Some(l)) if r.starts_with("serial:cxl/0x3000/") && l == 64 << 20 => (o, o + l),
            _ => out.fail(&format!("shares in {status}")),
        }
    };
    let (share_a, share_b) = (share(&out_a), share(&out_b));
    if share_a.0 < share_b.1 && share_b.0 < share_a.1 {
        out_a.fail(&format!("the hosts' shares overlap: a {share_a:x?}, b {share_b:x?}"));
    }
    if per_region && dax_offset != 0 {
        out_a.fail(&format!("A's region is at {dax_offset:#x} of a DAX device of its own, not at 0"));
    }
    // B's domain map names A as the GFA's node, A's set, and the region's offset in it.
    out_b.expect_check("translate");
    let t: serde_json::Value =
        serde_json::from_str(out_b.blob("translate")).unwrap_or_else(|e| out_b.fail(&format!("translate JSON: {e}")));
    let offset = t["offset"].as_str().and_then(|o| u64::from_str_radix(o.trim_start_matches("0x"), 16).ok());
    if t["node"] != "a"
        || t["live"] != true
        || !t["answer"].as_str().unwrap_or("").starts_with("interleave set cxl-region:")
    {
        out_b.fail(&format!("B translates A's GFA {gfa:#x} as {t}"));
    }
    // A 1-way region from DPA 0: the set's offset is the DPA, and the offset in A's DAX
    // device over the whole region (per region, A's device starts there).
    let Some(dpa) = offset else { out_b.fail(&format!("B's translate gives no offset: {t}")) };
    if !per_region && dpa != dax_offset {
        out_b.fail(&format!("B's translate gives offset {dpa:#x}, A's region is at {dax_offset:#x} of its DAX device"));
    }
    if dpa < share_a.0 || dpa + LEN > share_a.1 {
        out_a.fail(&format!("A's region at {dpa:#x} is outside A's share {share_a:x?}"));
    }
    out_b.expect_check("b-imports");
    out_b.expect_check("b-not-coherent");
    out_a.expect_check("b-stored");
    out_a.expect_check("a-loads-b");
    out_a.expect_check("lib-owner");
    if per_region {
        for c in ["b-holds", "b-revoked", "b-device-gone"] {
            out_b.expect_check(c);
        }
        // While B's fabricd was stopped, A kept the freed region's DPAs for B; B's
        // acknowledgement gave them back.
        for c in ["a-quarantine", "a-quarantine-lifted"] {
            out_a.expect_check(c);
        }
    }
    if let Err(e) = twohost::check_file(&file, dpa, LEN, SEED_B) {
        out_b.fail(&format!("B's stores are not in the shared file at the DPA: {e}"));
    }
}
