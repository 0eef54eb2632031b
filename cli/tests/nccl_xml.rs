//! The NCCL topology XML export against the structure NCCL's loader accepts
//! (`src/graph/xml.cc`: `system > cpu > pci* > gpu|nic`, `gpu > nvlink`, `nic > net`) and
//! against public NCCL topology files (`tests/data/nccl-public/`, see its README): a
//! bare-metal HGX H200 `NCCL_TOPO_DUMP_FILE` posted to NVIDIA/nccl-tests, and two files
//! Azure ships as `NCCL_TOPO_FILE`.

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

/// The elements, nesting and attributes NCCL's files use (all public files together), and
/// the attributes its loader needs; every element of `root`, in document order.
fn check_nccl_structure(root: &El) -> Vec<&El> {
    let (mut want, mut got) = (Shape::default(), Shape::default());
    for (_, text) in PUBLIC {
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
