//! The NCCL topology XML export against the structure NCCL's loader accepts
//! (`src/graph/xml.cc`: `system > cpu > pci* > gpu|nic`, `gpu > nvlink`, `nic > net`) and
//! against public NCCL topology files (`tests/data/nccl-public/`, see its README): a
//! bare-metal HGX H200 `NCCL_TOPO_DUMP_FILE` posted to NVIDIA/nccl-tests, and two files
//! Azure ships as `NCCL_TOPO_FILE`. AMD exports are held to RCCL's own files of AMD machines
//! (`tests/data/rccl-xml/`): a synthetic MI300X sysfs tree (no public capture has one
//! unpartitioned with its PCI tree) built like `topo_8p_940.xml`'s machine is discovered and
//! exported, and its GPUs' `<xgmi>` children compared with that file's.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use fabric_cli::render::nccl;
use fabric_cli::view::View;
use quick_xml::Reader;
use quick_xml::events::Event;

/// An element: name, attributes, children.
#[derive(Debug, Clone)]
struct El {
    name: String,
    attrs: BTreeMap<String, String>,
    kids: Vec<El>,
}

/// Parses with quick-xml, which rejects malformed XML (mismatched tags, bad attributes).
fn parse(text: &str) -> El {
    let mut r = Reader::from_str(text);
    let mut stack: Vec<El> = vec![El { name: "#doc".into(), attrs: BTreeMap::new(), kids: Vec::new() }];
    let el = |e: &quick_xml::events::BytesStart<'_>| El {
        name: e.name().as_ref().to_owned(),
        attrs: e
            .attributes()
            .map(|a| {
                let a = a.expect("well-formed attribute");
                (a.key.as_ref().to_owned(), a.value.to_string())
            })
            .collect(),
        kids: Vec::new(),
    };
    loop {
        match r.read_event().expect("well-formed XML") {
            Event::Start(e) => stack.push(el(&e)),
            Event::Empty(e) => {
                let x = el(&e);
                stack.last_mut().expect("parent").kids.push(x);
            }
            Event::End(_) => {
                let x = stack.pop().expect("open element");
                stack.last_mut().expect("parent").kids.push(x);
            }
            Event::Text(t) => assert!(t.as_ref().trim().is_empty(), "no text content in NCCL XML"),
            Event::Comment(_) => {}
            Event::Eof => break,
            other => panic!("unexpected XML event {other:?}"),
        }
    }
    assert_eq!(stack.len(), 1, "unclosed elements");
    let mut doc = stack.pop().expect("doc");
    assert_eq!(doc.kids.len(), 1, "one root element");
    doc.kids.remove(0)
}

/// (parent, element) pairs and attribute names per element.
#[derive(Debug, Default)]
struct Shape {
    nesting: BTreeSet<(String, String)>,
    attrs: BTreeMap<String, BTreeSet<String>>,
}

fn shape(e: &El, parent: &str, s: &mut Shape) {
    s.nesting.insert((parent.to_owned(), e.name.clone()));
    s.attrs.entry(e.name.clone()).or_default().extend(e.attrs.keys().cloned());
    for k in &e.kids {
        shape(k, &e.name, s);
    }
}

fn walk<'a>(e: &'a El, out: &mut Vec<&'a El>) {
    out.push(e);
    for k in &e.kids {
        walk(k, out);
    }
}

fn export(inv: fabric_topology::Inventory, node: &str) -> String {
    let v = View::new(common::fabric(inv), None).expect("view");
    let mut buf = Vec::new();
    nccl::render(&v, node, &mut buf).expect("render");
    String::from_utf8(buf).expect("utf-8")
}

/// NCCL's hand-written parser: no declaration, elements start with `<` after spaces or
/// newlines only (no tabs), single spaces between attributes, values under 256 characters,
/// no entities.
fn check_nccl_parser_constraints(text: &str) {
    assert!(text.starts_with("<system version=\"1\">"), "no XML declaration: NCCL cannot parse one");
    for line in text.lines() {
        assert!(!line.contains('\t'), "tab in {line:?}");
        assert!(line.trim_start().starts_with('<') && line.ends_with('>'), "{line:?}");
        assert!(
            !line.contains("  ") || line.trim_start() == line.trim_start().replace("  ", " "),
            "double space: {line:?}"
        );
        assert!(!line.contains('&'), "entity in {line:?}");
    }
}

const REQUIRED: &[(&str, &[&str])] = &[
    ("system", &["version"]),
    ("cpu", &["numaid"]),
    ("pci", &["busid", "class", "link_speed", "link_width"]),
    ("gpu", &["dev", "rank"]),
    ("nvlink", &["target", "count", "tclass"]),
    ("net", &["name", "dev"]),
];

/// The public NCCL topology files: (file name, text).
const PUBLIC: &[(&str, &str)] = &[
    ("nccl-tests-256-h200-numa0.xml", include_str!("data/nccl-public/nccl-tests-256-h200-numa0.xml")),
    ("azure-ncv4-topo.xml", include_str!("data/nccl-public/azure-ncv4-topo.xml")),
    ("azure-ndv5-topo.xml", include_str!("data/nccl-public/azure-ndv5-topo.xml")),
];

/// RCCL's topology files of AMD machines: (file name, text).
const RCCL: &[(&str, &str)] = &[
    ("topo_8p_940.xml", include_str!("data/rccl-xml/topo_8p_940.xml")),
    ("topo_8p1h.xml", include_str!("data/rccl-xml/topo_8p1h.xml")),
    ("topo_4p4h.xml", include_str!("data/rccl-xml/topo_4p4h.xml")),
];

/// The elements, nesting and attributes NCCL's files use (all public files together), and
/// the attributes its loader needs; every element of `root`, in document order.
fn check_nccl_structure(root: &El) -> Vec<&El> {
    check_structure(root, PUBLIC)
}

/// As [`check_nccl_structure`], against the files in `refs` together.
fn check_structure<'a>(root: &'a El, refs: &[(&str, &str)]) -> Vec<&'a El> {
    let (mut want, mut got) = (Shape::default(), Shape::default());
    for (_, text) in refs {
        shape(&parse(text), "#doc", &mut want);
    }
    shape(root, "#doc", &mut got);
    for pair in &got.nesting {
        assert!(want.nesting.contains(pair), "nesting {pair:?} does not occur in NCCL dumps");
    }
    for (el, names) in &got.attrs {
        let known = want.attrs.get(el).cloned().unwrap_or_default();
        let unknown: Vec<_> = names.difference(&known).collect();
        assert!(unknown.is_empty(), "{el} has attributes NCCL does not write: {unknown:?}");
    }
    let mut all = Vec::new();
    walk(root, &mut all);
    for e in &all {
        if let Some((_, req)) = REQUIRED.iter().find(|(n, _)| *n == e.name) {
            for r in *req {
                assert!(e.attrs.contains_key(*r), "{} lacks {r}: {:?}", e.name, e.attrs);
            }
        }
        if let Some(b) = e.attrs.get("busid").or(e.attrs.get("target")) {
            assert_eq!(b, &b.to_ascii_lowercase(), "bus ids are lower case");
        }
    }
    all
}

/// The constraints our export is held to are ones NCCL's own files meet: checked on every
/// public file, so that a constraint stricter than NCCL (or a mis-transcribed file) fails.
#[test]
fn public_nccl_files_meet_the_parser_constraints() {
    for (name, text) in PUBLIC {
        check_nccl_parser_constraints(text);
        let root = parse(text);
        assert_eq!(root.name, "system", "{name}");
        assert_eq!(root.attrs.get("version").map(String::as_str), Some("1"), "{name}");
        assert!(root.kids.iter().all(|c| c.name == "cpu" && c.attrs.contains_key("numaid")), "{name}");
    }
}

/// Where a GPU sits: the PCI classes from its CPU down to it, whether its switch also holds
/// a NIC, its NVLink bundle sizes (sorted) and the classes of their far ends.
#[derive(Debug, PartialEq, Eq)]
struct GpuPlace {
    classes: Vec<String>,
    nic_on_switch: bool,
    bundles: Vec<u32>,
    tclasses: BTreeSet<String>,
}

/// The place of every GPU under `root`, in document order.
fn gpu_places(root: &El) -> Vec<GpuPlace> {
    fn go(e: &El, up: &El, classes: &mut Vec<String>, out: &mut Vec<GpuPlace>) {
        for k in &e.kids {
            if k.name == "gpu" {
                let mut bundles: Vec<u32> =
                    k.kids.iter().map(|n| n.attrs["count"].parse::<u32>().expect("count")).collect();
                bundles.sort_unstable();
                out.push(GpuPlace {
                    classes: classes.clone(),
                    nic_on_switch: up.kids.iter().any(|s| s.kids.iter().any(|n| n.name == "nic")),
                    bundles,
                    tclasses: k.kids.iter().map(|n| n.attrs["tclass"].clone()).collect(),
                });
            } else if k.name == "pci" {
                classes.push(k.attrs["class"].clone());
                go(k, e, classes, out);
                classes.pop();
            }
        }
    }
    let mut out = Vec::new();
    for cpu in &root.kids {
        go(cpu, cpu, &mut Vec::new(), &mut out);
    }
    out
}

/// A sysfs tree of the machine `topo_8p_940.xml` models, as the kernel shows it
/// unpartitioned: 8 MI300X (0x1002:0x74a1, class 0x120000) each below a root port on NUMA
/// node 0 or 1, amdgpu's attributes on each function (hex `unique_id`, decimal hive id,
/// 192 GiB of VRAM, SPX/NPS1), and a KFD tree where every GPU has one xGMI io_link to each
/// other (weight 15, one link: min = max = 50000 MB/s) — RCCL's file has `count="1"` for
/// every pair.
struct Mi300xHost {
    dir: tempfile::TempDir,
}

const MI300X_BUSES: [u8; 8] = [0x0c, 0x15, 0x1e, 0x69, 0x9f, 0xaf, 0xbf, 0xdf];

impl Mi300xHost {
    fn write(&self, rel: &str, v: &str) {
        let p = self.dir.path().join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, format!("{v}\n")).expect("write");
    }

    fn function(&self, path: &str, attrs: &[(&str, String)]) {
        for (k, v) in attrs {
            self.write(&format!("sys/devices/{path}/{k}"), v);
        }
        let name = path.rsplit('/').next().expect("name");
        let link = self.dir.path().join("sys/bus/pci/devices").join(name);
        std::fs::create_dir_all(link.parent().expect("parent")).expect("mkdir");
        std::os::unix::fs::symlink(format!("../../../devices/{path}"), link).expect("symlink");
    }

    fn new() -> Self {
        let h = Self { dir: tempfile::tempdir().expect("tempdir") };
        let ids = |vendor: &str, device: &str, class: &str, numa: u8| {
            vec![
                ("vendor", vendor.to_owned()),
                ("device", device.to_owned()),
                ("class", class.to_owned()),
                ("numa_node", numa.to_string()),
                ("current_link_speed", "32.0 GT/s PCIe".to_owned()),
                ("current_link_width", "16".to_owned()),
                ("max_link_speed", "32.0 GT/s PCIe".to_owned()),
                ("max_link_width", "16".to_owned()),
            ]
        };
        for n in 0..2u8 {
            h.write(&format!("sys/devices/system/node/node{n}/cpulist"), &format!("{}-{}", n * 48, n * 48 + 47));
        }
        let kfd = "sys/class/kfd/kfd/topology/nodes";
        h.write(&format!("{kfd}/0/properties"), "cpu_cores_count 48\nsimd_count 0");
        h.write(&format!("{kfd}/1/properties"), "cpu_cores_count 48\nsimd_count 0");
        for (i, &bus) in MI300X_BUSES.iter().enumerate() {
            let numa = u8::from(bus >= 0x80);
            let rp = format!("pci0000:{bus:02x}/0000:{bus:02x}:01.0");
            h.function(&rp, &ids("0x1022", "0x14ab", "0x060400", numa));
            let gpu = format!("{rp}/0000:{:02x}:00.0", bus + 2);
            let mut a = ids("0x1002", "0x74a1", "0x120000", numa);
            let uid = 0x4a00_0000_0000_0000u64 + i as u64;
            a.extend([
                ("unique_id", format!("{uid:016x}")),
                ("xgmi_hive_info/xgmi_hive_id", "7331".to_owned()),
                ("xgmi_device_id", i.to_string()),
                ("mem_info_vram_total", (192u64 << 30).to_string()),
                ("current_compute_partition", "SPX".to_owned()),
                ("current_memory_partition", "NPS1".to_owned()),
            ]);
            h.function(&gpu, &a);
            let node = i + 2;
            h.write(
                &format!("{kfd}/{node}/properties"),
                &format!(
                    "simd_count 1216\nsimd_per_cu 4\nvendor_id 4098\ndevice_id 29857\nlocation_id {}\n\
                     domain 0\nhive_id 7331\ngfx_target_version 90402\nunique_id {uid}",
                    u32::from(bus + 2) << 8
                ),
            );
            for (k, peer) in (2..10).filter(|&p| p != node).enumerate() {
                h.write(
                    &format!("{kfd}/{node}/io_links/{k}/properties"),
                    &format!(
                        "type 11\nnode_from {node}\nnode_to {peer}\nweight 15\nmin_bandwidth 50000\nmax_bandwidth 50000"
                    ),
                );
            }
        }
        h
    }

    fn fabric(&self) -> fabric_topology::Fabric {
        let root = fabric_drivers::SysfsRoot::new(self.dir.path(), "amd0");
        common::fabric(fabric_drivers::discover_host(&root))
    }
}

#[test]
fn mi300x_export_has_rccls_xgmi_structure() {
    let host = Mi300xHost::new();
    let view = View::new(host.fabric(), None).expect("view");
    let mut buf = Vec::new();
    nccl::render(&view, "amd0", &mut buf).expect("render");
    let text = String::from_utf8(buf).expect("utf-8");
    check_nccl_parser_constraints(&text);
    let root = parse(&text);
    let refs: Vec<(&str, &str)> = PUBLIC.iter().chain(RCCL).copied().collect();
    let all = check_structure(&root, &refs);
    let gpus: Vec<&&El> = all.iter().filter(|e| e.name == "gpu").collect();
    assert_eq!(gpus.len(), 8, "{text}");
    for g in &gpus {
        assert_eq!(g.attrs.get("gcn").map(String::as_str), Some("gfx942"), "as topo_8p_940.xml writes it");
        assert!(g.kids.iter().all(|k| k.name == "xgmi"));
    }
    // Each GPU of the real file: 7 xGMI peers, one link each, all MI300X (0x120000).
    let real = gpu_places(&parse(RCCL[0].1));
    let ours = gpu_places(&root);
    assert_eq!(real.len(), 8);
    for (r, o) in real.iter().zip(&ours) {
        assert_eq!((&o.bundles, &o.tclasses), (&r.bundles, &r.tclasses));
        assert_eq!(o.classes.last().map(String::as_str), Some("0x120000"));
    }
    // Targets are the other seven GPUs' bus ids.
    let busids: BTreeSet<&str> = all
        .iter()
        .filter(|e| e.attrs.get("class").is_some_and(|c| c == "0x120000"))
        .map(|e| e.attrs["busid"].as_str())
        .collect();
    for g in &gpus {
        let targets: BTreeSet<&str> = g.kids.iter().map(|k| k.attrs["target"].as_str()).collect();
        assert_eq!(targets.len(), 7);
        assert!(targets.is_subset(&busids));
    }
}

#[test]
fn mi300x_matrix_shows_one_xgmi_link_between_every_pair() {
    let host = Mi300xHost::new();
    let view = View::new(host.fabric(), None).expect("view");
    let gpus: Vec<_> = view.matrix_devices().into_iter().filter(|(l, _)| l.starts_with("GPU")).collect();
    assert_eq!(gpus.len(), 8, "class 0x120000 from AMD is a GPU");
    for &(_, a) in &gpus {
        for &(_, b) in &gpus {
            let want = if a == b { "X" } else { "XGMI1" };
            assert_eq!(view.fabric.classify(a, b).to_string(), want);
        }
    }
    let mut buf = Vec::new();
    fabric_cli::render::matrix::render(&view, &mut buf).expect("render");
    let text = String::from_utf8(buf).expect("utf-8");
    let row = text.lines().find(|l| l.starts_with("GPU0 ")).expect("GPU0 row");
    assert_eq!(row.split_whitespace().filter(|c| *c == "XGMI1").count(), 7, "{text}");
    let d = view.fabric.device(gpus[0].1);
    assert!(d.id.as_str().starts_with("serial:amdgpu/0x4a00"), "keyed by unique_id, not a KFD node: {}", d.id);
    assert_eq!(d.gpu.as_ref().and_then(|g| g.compute_partition_mode.as_deref()), Some("SPX"));
    assert_eq!(d.memory_bytes(), 192 << 30, "mem_info_vram_total");
}

/// The HGX sim board's export (`configs/sim/hgx-h100-8gpu.toml`) next to NUMA node 0 of a
/// real HGX H200 dump: each GPU sits at the same depth under a PCIe switch (`0x060400` then
/// `0x030200`), shares that switch with a NIC, and has 18 NVLinks to NVSwitches in bundles
/// of 4 and 5 with NCCL's NVSwitch class.
#[test]
fn hgx_export_has_the_shape_of_a_real_h200_dump() {
    let real = gpu_places(&parse(PUBLIC[0].1));
    // The shipped sim board, as its golden keeps it (`tests/golden.rs` checks that
    // `fabricctl topology -o nccl-xml --sim configs/sim/hgx-h100-8gpu.toml` prints exactly it).
    let ours = gpu_places(&parse(include_str!("golden/hgx-h100-8gpu.nccl-xml")));
    assert_eq!(real.len(), 3);
    assert_eq!(ours.len(), 8);
    let want = &real[0];
    assert_eq!(want.classes, ["0x060400", "0x030200"], "the real dump's GPU path");
    assert!(want.nic_on_switch);
    assert_eq!(want.bundles, [4, 4, 5, 5]);
    assert_eq!(want.tclasses, BTreeSet::from(["0x068000".to_owned()]));
    for r in &real {
        assert_eq!(r, want, "the real dump is uniform");
    }
    for (i, o) in ours.iter().enumerate() {
        assert_eq!(o, want, "GPU {i} of the HGX export");
    }
}

#[test]
fn hgx_export_matches_nccls_structure() {
    let text = export(common::hgx(), "node0");
    check_nccl_parser_constraints(&text);
    let root = parse(&text);
    assert_eq!(root.name, "system");
    assert_eq!(root.attrs.get("version").map(String::as_str), Some("1"));

    let all = check_nccl_structure(&root);
    let count = |n: &str| all.iter().filter(|e| e.name == n).count();
    assert_eq!(count("cpu"), 2);
    assert_eq!(count("gpu"), 8);
    assert_eq!(count("net"), 5);
    assert_eq!(count("nvlink"), 32, "one per GPU and NVSwitch");
    // GPU dev numbers follow bus order; NVSwitch targets carry NCCL's NVSwitch class.
    let gpus: Vec<&&El> = all.iter().filter(|e| e.name == "gpu").collect();
    for (i, g) in gpus.iter().enumerate() {
        assert_eq!(g.attrs["dev"], i.to_string());
        assert_eq!(g.attrs["sm"], "90");
        let links: u32 = g.kids.iter().map(|n| n.attrs["count"].parse::<u32>().expect("count")).sum();
        assert_eq!(links, 18);
        assert!(g.kids.iter().all(|n| n.attrs["tclass"] == "0x068000" && n.attrs["target"] == nccl::NO_BUS_ID));
    }
    // Only switch upstream ports appear as bridges, as in NCCL's sysfs-derived XML.
    let cpu0 = &root.kids[0];
    assert_eq!(cpu0.attrs["numaid"], "0");
    assert_eq!(cpu0.attrs["affinity"], "000000ff,ffffffff,ffff0000,00000000,00ffffff,ffffffff");
    let first = &cpu0.kids[0];
    assert_eq!((first.attrs["busid"].as_str(), first.attrs["class"].as_str()), ("0000:11:00.0", "0x060400"));
    assert_eq!(first.kids[0].attrs["busid"], "0000:13:00.0");
    assert_eq!(first.kids[0].kids[0].name, "gpu");
    // The degraded NIC still exports its maximum link, as NCCL reads max_link_speed.
    let nic4 = all.iter().find(|e| e.attrs.get("busid").map(String::as_str) == Some("0000:77:00.0")).expect("NIC4");
    assert_eq!((nic4.attrs["link_speed"].as_str(), nic4.attrs["link_width"].as_str()), ("32.0 GT/s PCIe", "16"));
}

#[test]
fn network_speed_and_direct_nvlinks_are_exported() {
    let text = export(common::two_nodes(), "node1");
    let root = parse(&text);
    let mut all = Vec::new();
    walk(&root, &mut all);
    let nets: Vec<&&El> = all.iter().filter(|e| e.name == "net").collect();
    assert_eq!(nets.iter().filter(|n| n.attrs.get("speed").map(String::as_str) == Some("400000")).count(), 4);
    assert!(text.contains("node node1"));
    assert!(!text.contains("GPU-node0"), "only the requested node");

    // Two GPUs with a direct NVLink bundle: the peer's bus id and GPU class.
    let mut inv = common::cxl_host();
    let gpu = inv.find(&"uuid:GPU-cxl0-00".parse().expect("id")).expect("gpu");
    let mut peer = inv.devices[gpu.get()].clone();
    peer.id = "uuid:GPU-cxl0-01".parse().expect("id");
    let addr: fabric_topology::PciAddress = "0000:02:00.0".parse().expect("addr");
    peer.pci.as_mut().expect("pci").address = Some(addr);
    let rp = inv.find(&fabric_topology::DeviceId::pci("cxl0", "0000:00:01.0".parse().expect("a"))).expect("rp");
    let p = inv.add_device(peer).expect("add");
    inv.add_link(fabric_topology::Link::pcie(rp, p, (Some(5), Some(16)), (Some(5), Some(16))));
    let kind = fabric_topology::LinkKind::NvLink { generation: 3, count: 12 };
    inv.add_link(fabric_topology::Link::new(gpu, p, kind, fabric_topology::Bandwidth::full(300_000), None));
    let text = export(inv, "cxl0");
    check_nccl_parser_constraints(&text);
    assert!(text.contains("<nvlink target=\"0000:02:00.0\" count=\"12\" tclass=\"0x030200\"/>"), "{text}");
    assert!(!text.contains(" sm="), "unknown compute capability is left to NCCL: {text}");
}

/// The export of every sim fabric, as its golden keeps it (`tests/golden.rs` checks that
/// `fabricctl topology -o nccl-xml` prints exactly that), has NCCL's structure.
#[test]
fn every_sim_fabrics_export_has_nccls_structure() {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seen = 0;
    for e in std::fs::read_dir(manifest.join("../configs/sim")).expect("configs/sim").filter_map(Result::ok) {
        let path = e.path();
        let Some(stem) =
            path.file_stem().and_then(|s| s.to_str()).filter(|_| path.extension().is_some_and(|x| x == "toml"))
        else {
            continue;
        };
        let golden = manifest.join(format!("tests/golden/{stem}.nccl-xml"));
        let text = std::fs::read_to_string(&golden).unwrap_or_else(|e| panic!("{}: {e}", golden.display()));
        check_nccl_parser_constraints(&text);
        let root = parse(&text);
        assert_eq!(root.attrs.get("version").map(String::as_str), Some("1"), "{stem}");
        let all = check_nccl_structure(&root);
        assert!(all.iter().any(|e| e.name == "cpu"), "{stem}: no cpu element");
        seen += 1;
    }
    assert!(seen > 0, "no sim fabrics in configs/sim");
}

/// A host with two RDMA NICs, written from the kernel's sysfs ABI: a ConnectX-7 whose
/// `sys_image_guid` is that of `mlx5_0` in the public H200 dump (nccl-tests#256, byte order
/// undone), active at NDR, with `nvidia_peermem` loaded; and a RoCE NIC whose port is down.
fn rdma_host() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |rel: &str, v: &str| {
        let p = dir.path().join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, format!("{v}\n")).expect("write");
    };
    let link = |target: String, at: &str| {
        let p = dir.path().join(at);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::os::unix::fs::symlink(target, p).expect("symlink");
    };
    write("sys/devices/system/node/node0/cpulist", "0-7");
    write("sys/module/nvidia_peermem/version", "550.54.15");
    for (func, class, ib, guid, state, phys, layer) in [
        ("0000:18:00.0", "0x020700", "mlx5_0", "58a2:e103:00b1:7ca8", "4: ACTIVE", "5: LinkUp", "InfiniBand"),
        ("0000:19:00.0", "0x020000", "mlx5_1", "b83f:d203:00aa:bb10", "1: DOWN", "2: Polling", "Ethernet"),
    ] {
        let path = format!("pci0000:17/0000:17:01.0/{func}");
        for (k, v) in [("vendor", "0x15b3"), ("device", "0x1021"), ("class", class), ("numa_node", "0")] {
            write(&format!("sys/devices/{path}/{k}"), v);
        }
        link(format!("../../../devices/{path}"), &format!("sys/bus/pci/devices/{func}"));
        let ibdir = format!("sys/devices/{path}/infiniband/{ib}");
        write(&format!("{ibdir}/sys_image_guid"), guid);
        write(&format!("{ibdir}/ports/1/state"), state);
        write(&format!("{ibdir}/ports/1/phys_state"), phys);
        write(&format!("{ibdir}/ports/1/rate"), "400 Gb/sec (4X NDR)");
        write(&format!("{ibdir}/ports/1/link_layer"), layer);
        link(format!("../../devices/{path}/infiniband/{ib}"), &format!("sys/class/infiniband/{ib}"));
    }
    let rp = "pci0000:17/0000:17:01.0";
    for (k, v) in [("vendor", "0x8086"), ("device", "0x352a"), ("class", "0x060400"), ("numa_node", "0")] {
        write(&format!("sys/devices/{rp}/{k}"), v);
    }
    link(format!("../../../devices/{rp}"), "sys/bus/pci/devices/0000:17:01.0");
    dir
}

#[test]
fn rdma_ports_are_nets_as_nccl_writes_them() {
    let dir = rdma_host();
    let root = fabric_drivers::SysfsRoot::new(dir.path(), "ib0");
    let text = export(fabric_drivers::discover_host(&root), "ib0");
    check_nccl_parser_constraints(&text);
    let root = parse(&text);
    let all = check_nccl_structure(&root);
    let nets: Vec<&&El> = all.iter().filter(|e| e.name == "net").collect();
    assert_eq!(nets.len(), 1, "the down port is left out, as NCCL skips ports not ACTIVE: {text}");
    // The H200 dump's mlx5_0, less what sysfs cannot say (latency, maxconn = max_qp).
    let real = parse(PUBLIC[0].1);
    let mut real_all = Vec::new();
    walk(&real, &mut real_all);
    let mut want = real_all.iter().find(|e| e.name == "net").expect("net").attrs.clone();
    want.remove("latency");
    want.remove("maxconn");
    assert_eq!(nets[0].attrs, want, "{text}");
    assert!(text.contains("<!-- not active, left out: mlx5_1 port 1 -->"), "{text}");
}
