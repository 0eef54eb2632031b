//! Renderer unit tests on hand-built fabrics (see `tests/common/mod.rs`).

use std::collections::HashMap;
use std::io::Write;
use std::time::Instant;

use fabric_proto::{TopologyDoc, parse_doc};
use fabric_topology::{DeviceIdx, HopClass, Inventory, LinkState};

use crate::render;
use crate::testkit;
use crate::view::View;

fn view(inv: Inventory) -> View {
    View::new(testkit::fabric(inv), None).expect("view")
}

fn out(v: &View, f: impl Fn(&View, &mut dyn Write) -> std::io::Result<()>) -> String {
    let mut buf = Vec::new();
    f(v, &mut buf).expect("render");
    String::from_utf8(buf).expect("utf-8")
}

/// Parses the class grid at the top of a matrix rendering into (row, column) -> cell.
fn grid(text: &str) -> HashMap<(String, String), String> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("header").split_whitespace().collect();
    let cols: Vec<&str> = header.iter().copied().take_while(|h| *h != "CPU").collect();
    let mut m = HashMap::new();
    for l in lines.take_while(|l| !l.trim().is_empty()) {
        let t: Vec<&str> = l.split_whitespace().collect();
        for (j, c) in cols.iter().enumerate() {
            m.insert((t[0].to_owned(), (*c).to_owned()), t[j + 1].to_owned());
        }
    }
    m
}

fn cell(g: &HashMap<(String, String), String>, a: &str, b: &str) -> String {
    g.get(&(a.to_owned(), b.to_owned())).cloned().unwrap_or_else(|| panic!("no cell {a}/{b}"))
}

/// The same inventory with devices in reverse discovery order (links remapped).
fn reversed(inv: &Inventory) -> Inventory {
    let n = inv.devices.len() as u32;
    let mut out = Inventory::new();
    for d in inv.devices.iter().rev() {
        out.add_device(d.clone()).expect("device");
    }
    for l in inv.links.iter().rev() {
        let mut l = l.clone();
        l.a = DeviceIdx(n - 1 - l.a.0);
        l.b = DeviceIdx(n - 1 - l.b.0);
        out.add_link(l);
    }
    out.cxl = inv.cxl.clone();
    out.backends = inv.backends.clone();
    out
}

#[test]
fn matrix_shows_every_pci_class_and_nvlink_count() {
    let v = view(testkit::hgx());
    let t = out(&v, render::matrix::render);
    let g = grid(&t);
    assert_eq!(cell(&g, "GPU0", "GPU0"), "X");
    assert_eq!(cell(&g, "GPU0", "GPU7"), "NV18");
    assert_eq!(cell(&g, "GPU4", "NIC3"), "PIX", "GPU and NIC on one switch");
    assert_eq!(cell(&g, "GPU0", "NIC0"), "PXB", "NIC behind a nested switch");
    assert_eq!(cell(&g, "GPU0", "NIC1"), "PHB", "management NIC on another root port");
    assert_eq!(cell(&g, "GPU0", "NIC2"), "NODE", "other host bridge, same NUMA node");
    assert_eq!(cell(&g, "GPU0", "NIC3"), "SYS", "other NUMA node");
    assert_eq!(cell(&g, "NIC3", "GPU4"), "PIX", "the matrix is symmetric");
    // Affinity columns come from the device (or the CPU it hangs off).
    let row = t.lines().find(|l| l.starts_with("GPU4 ")).expect("GPU4 row");
    assert!(row.trim_end().ends_with("56-111,168-223  1"), "{row}");
}

#[test]
fn matrix_has_legend_labels_and_degraded_links() {
    let v = view(testkit::hgx());
    let t = out(&v, render::matrix::render);
    assert!(t.contains("Legend:"));
    for (k, desc) in HopClass::LEGEND {
        assert!(t.contains(&format!("  {k:<5} = {desc}")), "legend entry {k}");
    }
    assert!(t.contains("  GPU0  uuid:GPU-node0-00"), "label key names ids");
    assert!(t.contains("  NIC4  pci:node0/0000:77:00.0  mlx5_3, MT2910 Family [ConnectX-7]"));
    assert!(
        t.contains("NIC4 pcie link 0000:72:02.0 -> 0000:77:00.0: 31.5 of 63.0 GB/s (50%)"),
        "degraded link with the fraction left:\n{t}"
    );
    let healthy = view(testkit::two_nodes());
    assert!(out(&healthy, render::matrix::render).contains("Degraded links: none"));
}

#[test]
fn matrix_shows_net_across_nodes_and_cxl_to_memory() {
    let v = view(testkit::two_nodes());
    let g = grid(&out(&v, render::matrix::render));
    assert_eq!(cell(&g, "GPU0", "GPU8"), "NET");
    assert_eq!(cell(&g, "GPU8", "GPU15"), "NV18");
    assert_eq!(cell(&g, "NIC0", "NIC5"), "NET");
    let v = view(testkit::cxl_host());
    let g = grid(&out(&v, render::matrix::render));
    assert_eq!(cell(&g, "GPU0", "CXL0"), "CXL");
}

#[test]
fn unknown_affinity_is_na_and_node_filter_keeps_global_labels() {
    let mut inv = testkit::hgx();
    for d in &mut inv.devices {
        d.numa_node = None;
        d.local_cpus = None;
    }
    // Cut GPU0 from its host so no CPU can lend it affinity.
    let gpu0 = inv.find(&"uuid:GPU-node0-00".parse().expect("id")).expect("gpu0");
    inv.links.retain(|l| l.b != gpu0 || !l.kind.is_hierarchical());
    let v = view(inv);
    let t = out(&v, render::matrix::render);
    let row = t.lines().find(|l| l.starts_with("GPU0 ")).expect("row");
    assert!(row.trim_end().ends_with("N/A           N/A"), "{row}");

    let v = View::new(testkit::fabric(testkit::two_nodes()), Some("node1".into())).expect("view");
    let t = out(&v, render::matrix::render);
    assert!(
        t.starts_with("       GPU8 ") || t.lines().next().is_some_and(|h| h.split_whitespace().next() == Some("GPU8"))
    );
    assert!(!t.contains("GPU0 "), "node filter drops node0");
    assert!(View::new(testkit::fabric(testkit::hgx()), Some("nope".into())).is_err());
}

#[test]
fn outputs_do_not_depend_on_discovery_order() {
    for inv in [testkit::hgx(), testkit::two_nodes(), testkit::cxl_host()] {
        let a = view(inv.clone());
        let b = view(reversed(&inv));
        for f in [
            render::matrix::render as fn(&View, &mut dyn Write) -> std::io::Result<()>,
            render::tree::render,
            render::json::render_topology,
            render::dot::render,
            render::devices::render,
        ] {
            assert_eq!(out(&a, f), out(&b, f));
        }
        let node = a.single_node().expect("node").to_owned();
        assert_eq!(
            out(&a, |v, w| render::nccl::render(v, &node, w)),
            out(&b, |v, w| render::nccl::render(v, &node, w))
        );
    }
}

#[test]
fn json_round_trips_and_carries_the_matrix() {
    let v = view(testkit::hgx());
    let text = out(&v, render::json::render_topology);
    let doc: TopologyDoc = parse_doc(&text).expect("parses");
    assert_eq!(doc, render::json::topology_doc(&v));
    let built = serde_json::to_string_pretty(&render::json::topology_doc(&v)).expect("json");
    assert_eq!(text, built + "\n", "streaming writes the same bytes as the built document");
    assert_eq!(doc.schema, "fabric.topology/v1");
    assert_eq!(doc.devices.len(), v.fabric.len());
    assert_eq!(doc.links.len(), v.fabric.inventory().links.len());
    let m = doc.matrix.as_ref().expect("matrix for 13 devices");
    assert_eq!(m.labels.len(), 13);
    let (i, j) = (
        m.labels.iter().position(|l| l == "GPU4").expect("GPU4"),
        m.labels.iter().position(|l| l == "NIC3").expect("NIC3"),
    );
    assert_eq!(m.classes[i][j], "PIX");
    let degraded: Vec<_> = doc.links.iter().filter(|l| l.state == LinkState::Degraded).collect();
    assert_eq!(degraded.len(), 1);
    assert_eq!(degraded[0].fraction, Some(0.5));
    assert_eq!(degraded[0].b.as_str(), "pci:node0/0000:77:00.0");
    let gpu = doc.devices.iter().find(|d| d.label.as_deref() == Some("GPU0")).expect("GPU0");
    assert_eq!(gpu.link_kinds.get("nvlink"), Some(&4));
    assert_eq!(gpu.parent.as_ref().map(|p| p.as_str()), Some("pci:node0/0000:12:00.0"));
    // The CXL case carries decoders, regions and backend reports.
    let doc = render::json::topology_doc(&view(testkit::cxl_host()));
    assert_eq!(doc.cxl.regions.len(), 1);
    assert_eq!(doc.backends.iter().find(|b| b.backend == "nvml").map(|b| b.state.as_str()), Some("not_present"));
    // A wrong schema is refused.
    let bad = text.replace("fabric.topology/v1", "fabric.topology/v9");
    assert!(parse_doc::<TopologyDoc>(&bad).is_err());
}

/// A small DOT checker: statement structure, balanced braces and quotes.
fn check_dot(text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("graph fabric {"));
    assert_eq!(lines.last(), Some(&"}"));
    let mut depth = 0i32;
    for l in &lines {
        let t = l.trim();
        let unescaped = t.replace("\\\\", "").replace("\\\"", "");
        assert_eq!(unescaped.matches('"').count() % 2, 0, "unbalanced quotes: {t}");
        if t.ends_with('{') {
            depth += 1;
        } else if t == "}" {
            depth -= 1;
        } else {
            assert!(t.ends_with(';'), "statement without ';': {t}");
        }
        assert!(depth >= 0);
    }
    assert_eq!(depth, 0);
}

#[test]
fn dot_is_valid_and_marks_degraded_edges() {
    let v = view(testkit::hgx());
    let t = out(&v, render::dot::render);
    check_dot(&t);
    assert!(t.contains("subgraph \"cluster_node0\""));
    let edge =
        t.lines().find(|l| l.contains("\"pci:node0/0000:72:02.0\" -- \"pci:node0/0000:77:00.0\"")).expect("edge");
    assert!(edge.contains("style=dashed") && edge.contains("color=red") && edge.contains("50%"), "{edge}");
    assert_eq!(t.matches(" -- ").count(), v.fabric.inventory().links.len());
    check_dot(&out(&view(testkit::two_nodes()), render::dot::render));
    // Graphviz itself, when installed.
    if let Ok(mut child) = std::process::Command::new("dot")
        .arg("-Tsvg")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
    {
        child.stdin.take().expect("stdin").write_all(t.as_bytes()).expect("write");
        assert!(child.wait().expect("dot runs").success());
    }
}

#[test]
fn devices_table_lists_every_device() {
    let v = view(testkit::hgx());
    let t = out(&v, render::devices::render);
    assert_eq!(t.lines().count(), v.fabric.len() + 1);
    assert!(t.lines().next().is_some_and(|h| h.starts_with("LABEL")));
    let gpu = t.lines().find(|l| l.starts_with("GPU0 ")).expect("GPU0");
    for want in ["uuid:GPU-node0-00", "gpu", "node0", "0000:13:00.0", "5 (nvlink:4,pcie:1)", "80 GiB"] {
        assert!(gpu.contains(want), "{want} in {gpu}");
    }
    let json = out(&v, render::json::render_devices);
    let doc: fabric_proto::DevicesDoc = parse_doc(&json).expect("devices document");
    assert_eq!(doc, fabric_proto::DevicesDoc::from_fabric(&v.fabric, None));
    assert_eq!(doc.devices.len(), v.fabric.len());
}

/// Names wider or narrower than their bytes (CJK, accents) keep the table's columns in
/// line on a terminal: widths were counted in bytes, so such a row's later columns sat
/// to the left of the header's.
#[test]
fn devices_table_columns_line_up_with_wide_and_accented_names() {
    let mut inv = testkit::hgx();
    let names = ["数据中心加速器", "Ünïcödé H100"];
    for (d, name) in inv.devices.iter_mut().filter(|d| d.id.as_str().starts_with("uuid:GPU")).zip(names) {
        d.name = Some(name.to_owned());
    }
    let v = view(inv);
    let t = out(&v, render::devices::render);
    let header = t.lines().next().expect("header");
    let numa_at = render::columns(&header[..header.find("NUMA").expect("NUMA column")]);
    for name in names {
        let line = t.lines().find(|l| l.contains(name)).expect(name);
        let end = line.find(name).expect(name) + name.len();
        let cell_end = end + line[end..].len() - line[end..].trim_start().len();
        assert_eq!(render::columns(&line[..cell_end]), numa_at, "{line}\n{header}");
    }
    assert_eq!(render::columns("数据"), 4);
    assert_eq!(render::pad("数据", 6), "数据  ");
    assert_eq!(render::pad("wider than", 3), "wider than");
}

#[test]
fn tree_nests_the_pci_hierarchy() {
    let v = view(testkit::hgx());
    let t = out(&v, render::tree::render);
    let indent = |needle: &str| {
        let l = t.lines().find(|l| l.contains(needle)).unwrap_or_else(|| panic!("{needle}"));
        l.len() - l.trim_start().len()
    };
    assert_eq!(indent("CPU name:node0/numa0"), 2);
    assert_eq!(indent("HB name:node0/pci0000:10"), 4);
    assert_eq!(indent("GPU0 0000:13:00.0"), 12);
    assert!(t.contains(
        "NIC4 0000:77:00.0 \"MT2910 Family [ConnectX-7]\" [pcie gen5 x8 (max gen5 x16), 31.5 of 63.0 GB/s (50%)]"
    ));
    assert!(t.contains("HBM 80 GiB {nvlink to 4 peers, 18 links}"));
    assert!(t.contains("outside the PCI tree:"));
    let t = out(&view(testkit::two_nodes()), render::tree::render);
    assert!(t.contains("node node1") && t.contains("fabric-level devices (1):"));
}

#[test]
fn large_fabrics_are_summarised_fast() {
    let inv = testkit::cluster(300);
    let start = Instant::now();
    let v = view(inv);
    let t = out(&v, render::matrix::render);
    assert!(t.starts_with("Fabric summary (3900 matrix devices"), "{}", &t[..200]);
    assert!(t.contains("scale-up domains  300 x 8 devices"), "{t}");
    assert!(t.contains("Matrix of node node0:"));
    assert!(t.contains("within a node     1000 pairs: NV18"), "{t}");
    assert!(t.contains("across nodes      1000 pairs: NET 1000 (100%)"), "{t}");
    assert!(!t.contains("GPU8 "), "only the first node's matrix");
    let tree = out(&v, render::tree::render);
    assert!(tree.contains("299 more nodes"), "{}", &tree[tree.len().saturating_sub(600)..]);
    assert!(tree.contains("299 nodes (node1 .. node299), each:"));
    let elapsed = start.elapsed();
    assert!(elapsed.as_secs() < 60, "took {elapsed:?}");
    // The same sample every run.
    assert_eq!(t, out(&v, render::matrix::render));
}

#[test]
fn paths_report_bottleneck_class_and_degradation() {
    let v = view(testkit::hgx());
    let (a, b) = (v.resolve("gpu6").expect("label"), v.resolve("pci:node0/0000:77:00.0").expect("id"));
    assert_eq!(v.labels.label(b), Some("NIC4"));
    let route = v.fabric.route(a, b).expect("route");
    let doc = fabric_proto::PathDoc::from_route(&v.fabric, &v.labels, a, b, &route);
    assert_eq!(doc.class, "PIX");
    assert!(doc.degraded);
    assert_eq!((doc.bandwidth_mbps, doc.max_bandwidth_mbps), (Some(31_507), Some(63_015)));
    let mut buf = Vec::new();
    render::path::render_table(&doc, &mut buf).expect("render");
    let t = String::from_utf8(buf).expect("utf-8");
    assert!(t.contains("bottleneck  31.5 of 63.0 GB/s (50%)") && t.contains("DEGRADED"), "{t}");
    let back: fabric_proto::PathDoc = {
        let mut buf = Vec::new();
        render::path::render_json(&doc, &mut buf).expect("json");
        parse_doc(std::str::from_utf8(&buf).expect("utf-8")).expect("parse")
    };
    assert_eq!(back, doc);
    assert!(v.resolve("GPU99").is_err() && v.resolve("uuid:nope").is_err());

    let v = view(testkit::two_nodes());
    let (a, b) = (v.resolve("GPU0").expect("a"), v.resolve("GPU8").expect("b"));
    let route = v.fabric.route(a, b).expect("route");
    let doc = fabric_proto::PathDoc::from_route(&v.fabric, &v.labels, a, b, &route);
    assert_eq!(doc.class, "NET");
    assert!(doc.hops.iter().any(|h| h.id.as_str() == "name:fabric/leaf0"));
    assert_eq!(doc.latency_ns, Some(1200));
}

#[test]
fn backends_that_are_missing_are_explained() {
    let t = out(&view(testkit::cxl_host()), render::matrix::render);
    assert!(t.contains("Discovery:\n\n  nvml: not present (libnvidia-ml.so.1 not found)"), "{t}");
    assert!(!out(&view(testkit::hgx()), render::matrix::render).contains("Discovery:"));
}

#[test]
fn a_domain_node_that_is_down_is_named_in_the_labels_not_in_the_link_list() {
    use fabric_topology::{DOMAIN_NODE_ATTR, DOMAIN_NODE_DOWN, DOMAIN_NODE_LIVE};
    let mut inv = testkit::two_nodes();
    for d in &mut inv.devices {
        let state = match d.node.as_deref() {
            Some("node0") => DOMAIN_NODE_LIVE,
            Some(_) => DOMAIN_NODE_DOWN,
            None => continue,
        };
        d.attrs.insert(DOMAIN_NODE_ATTR.into(), state.into());
    }
    let down: Vec<bool> = inv.devices.iter().map(|d| d.node.as_deref() == Some("node1")).collect();
    for l in &mut inv.links {
        if down[l.a.get()] || down[l.b.get()] {
            l.state = LinkState::Down;
        }
    }
    let t = out(&view(inv), render::matrix::render);
    let g = grid(&t);
    assert_eq!(cell(&g, "GPU0", "GPU8"), "-", "a node that is down is not reached");
    assert_eq!(cell(&g, "GPU0", "GPU1"), "NV18");
    let label = |l: &str| {
        t.lines()
            .find(|x| x.trim_start().starts_with(&format!("{l} ")) && x.contains("uuid:"))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(label("GPU8").contains("node1 (down)"), "{t}");
    assert!(label("GPU0").contains("node0") && !label("GPU0").contains("down"), "{t}");
    assert!(t.contains("Degraded links: none"), "{t}");
}

/// A CXL device two hosts of a domain share (one device of no node, a CXL link to it from
/// each host's bridge, as the domain's merge makes it): each host's tree names it, the
/// fabric-level devices show it whole, and no one host lends it CPU or NUMA affinity.
#[test]
fn a_pooled_cxl_device_is_named_under_every_host_and_shown_once_as_the_fabrics() {
    use fabric_topology::{Bandwidth, Device, DeviceId, DeviceKind, Link, LinkKind, MemoryKind, MemoryResource};
    let mut inv = Inventory::new();
    let mut pool = Device::new(DeviceId::cxl(0x5eed), DeviceKind::CxlMemdev, None);
    pool.memory.push(MemoryResource { kind: MemoryKind::CxlVolatile, size: 64 << 30, hpa: None, numa_node: None });
    let pool = inv.add_device(pool).expect("pool");
    for node in ["h0", "h1"] {
        let mut cpu = Device::new(DeviceId::named(node, "numa0"), DeviceKind::Cpu, Some(node));
        cpu.numa_node = Some(0);
        cpu.local_cpus = Some("0-7".parse().expect("cpulist"));
        let cpu = inv.add_device(cpu).expect("cpu");
        let hb = inv.add_device(Device::new(DeviceId::named(node, "pci0000:0c"), DeviceKind::HostBridge, Some(node)));
        let hb = hb.expect("bridge");
        inv.add_link(Link::new(cpu, hb, LinkKind::HostAttach, Bandwidth::default(), None));
        inv.add_link(Link::new(hb, pool, LinkKind::Cxl { width: Some(8) }, Bandwidth::default(), None));
    }
    let v = view(inv.clone());
    let t = out(&v, render::tree::render);
    let named = "      CXL0 serial:cxl/0x5eed (shared: with the fabric-level devices)";
    assert_eq!(t.lines().filter(|l| *l == named).count(), 2, "under each host's bridge:\n{t}");
    let whole = t.split("fabric-level devices (1):").nth(1).unwrap_or_else(|| panic!("{t}"));
    assert!(whole.contains("CXL0 serial:cxl/0x5eed [cxl x8] CXL ram 64 GiB"), "{t}");
    let m = out(&v, render::matrix::render);
    let row = m.lines().find(|l| l.starts_with("CXL0 ")).unwrap_or_else(|| panic!("{m}"));
    assert!(row.trim_end().ends_with("N/A           N/A"), "{row}");
    // One node shown (`--node h1`): no fabric-level list, so the device is shown whole
    // under that node's port.
    let one = View::new(testkit::fabric(inv), Some("h1".into())).expect("view");
    let t = out(&one, render::tree::render);
    assert!(t.contains("      CXL0 serial:cxl/0x5eed [cxl x8] CXL ram 64 GiB"), "{t}");
    assert!(!t.contains("fabric-level") && !t.contains("h0"), "{t}");
}

#[test]
fn no_terminal_control_reaches_the_output_but_newlines_and_tabs() {
    use std::io::Write as _;
    let mut o = crate::Output::new(Vec::new());
    // OSC 52 (writes the clipboard), CSI as a C1 control (U+009B), DEL; a C1 split across
    // writes; ordinary UTF-8 with a 0xC2 lead byte (U+00B0) kept whole.
    write!(o, "gpu\u{1b}]52;c;aGk=\u{7}\tname\n\u{9b}2J \u{7f} 20\u{b0}C").unwrap();
    o.write_all(&[0xc2]).unwrap();
    o.write_all(&[0x9b, b'x']).unwrap();
    o.flush().unwrap();
    assert!(!o.closed());
    let text = String::from_utf8(o.into_inner()).unwrap();
    assert_eq!(text, "gpu?]52;c;aGk=?\tname\n?2J ? 20\u{b0}C?x");
    assert_eq!(crate::inert("refused: \u{1b}[31mred\n"), "refused: ?[31mred\n");
}
