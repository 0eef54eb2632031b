//! The topology records every node of a sim fabric publishes: within the record bound,
//! trimmed to the rings of switches around each node where the whole fabric does not fit,
//! and merged back into the whole fabric — what a trimmed record leaves out, another
//! node's record carries.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::Path;

use fabric_domain::records::{self, DEFAULT_MAX_RECORD_BYTES, MAX_RECORD_BYTES};
use fabric_domain::{DomainSettings, DomainView, Keys, RecordLimits, SlotClaim, TopologyRecord};
use fabric_topology::{DeviceIdx, Fabric, Inventory};

/// `cluster-100k.toml` at 96 nodes, 12 leaves per rail and 8 spines: 104 switches (its
/// 200G NIC cable on node47).
fn rails() -> Fabric {
    let text = std::fs::read_to_string(root().join("cluster-100k.toml")).unwrap();
    let mut changed = 0;
    let small: String = text
        .lines()
        .map(|line| {
            let to = match line {
                "nodes = 12500" => "nodes = 96",
                "leaf_radix = 64" => "leaf_radix = 16",
                "spines = 32" => "spines = 8",
                "device = \"node4711/nic3\"" => "device = \"node47/nic3\"",
                other => return format!("{other}\n"),
            };
            changed += 1;
            format!("{to}\n")
        })
        .collect();
    assert_eq!(changed, 4, "cluster-100k.toml changed shape");
    Fabric::build(fabric_drivers::sim::parse(&small, "rails.toml").unwrap()).unwrap()
}

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim")
}

/// The domain's view of `records`, every node a live member in a slot of its own.
fn view(records: &[TopologyRecord], limits: RecordLimits) -> DomainView {
    let keys = Keys::new("t");
    let settings = DomainSettings::new(57, 1 << 40, fabric_domain::DEFAULT_DATA_PATHS.to_vec());
    let mut entries = vec![(keys.settings(), records::encode(&settings))];
    for (slot, r) in (0u32..).zip(records) {
        entries.push((keys.slot(slot), records::encode(&SlotClaim::new(slot, &r.node))));
        entries.push((keys.member(&r.node), records::encode(&fabric_domain::testing::member(&r.node))));
        entries.push((keys.topology(&r.node), records::encode(r)));
    }
    let view = DomainView::load(keys, limits, entries.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())), 1);
    assert!(view.refused().is_empty(), "{:?}", view.refused());
    view
}

/// Device identities and links (by their ends' identities, kind and bandwidth now; each
/// as often as it is there) of an inventory, but the devices no record publishes (storage
/// and other functions without memory) and their links.
type Shape = (BTreeSet<String>, Vec<(String, String, &'static str, String)>);

fn shape(inv: &Inventory) -> Shape {
    let published = |i: DeviceIdx| fabric_domain::topology::is_published(inv.device(i));
    let id = |i: DeviceIdx| inv.device(i).id.to_string();
    let devices = (0..inv.devices.len())
        .map(|i| DeviceIdx(u32::try_from(i).unwrap()))
        .filter(|&i| published(i))
        .map(id)
        .collect();
    let mut links: Vec<_> = inv
        .links
        .iter()
        .filter(|l| published(l.a) && published(l.b))
        .map(|l| {
            let (a, b) = (id(l.a), id(l.b));
            (a.clone().min(b.clone()), a.max(b), l.kind.name(), format!("{:?}", l.bandwidth.current_mbps))
        })
        .collect();
    links.sort();
    (devices, links)
}

fn merged(records: &[TopologyRecord], limits: RecordLimits) -> Inventory {
    fabric_domain::domain_fabric::merge(&view(records, limits))
}

#[test]
fn a_large_network_is_trimmed_to_each_nodes_rings_and_merges_back_whole() {
    let fabric = rails();
    let whole = TopologyRecord::of_every_node(&fabric, 1, MAX_RECORD_BYTES);
    let largest = whole.iter().map(|r| records::encode(r).len()).max().unwrap();
    assert!(whole.iter().all(|r| r.devices.iter().filter(|d| d.fabric).count() == 104), "96 leaves and 8 spines");
    // A bound the whole network does not fit in.
    let bound = largest / 2;
    let trimmed = TopologyRecord::of_every_node(&fabric, 1, bound);
    for r in &trimmed {
        let switches: Vec<&str> = r.devices.iter().filter(|d| d.fabric).map(|d| d.id.as_str()).collect();
        assert_eq!(switches.len(), 16, "{}: its 8 rail leaves and the 8 spines above them: {switches:?}", r.node);
        assert!(switches.iter().filter(|s| s.contains("spine")).count() == 8, "{switches:?}");
        assert!(records::encode(r).len() + 20 <= bound, "{} bytes", records::encode(r).len());
        let full = whole.iter().find(|w| w.node == r.node).unwrap();
        let own = full.devices.iter().filter(|d| !d.fabric).count();
        assert_eq!(r.devices[..own], full.devices[..own], "the node's own devices come first, the same");
    }
    let limits = RecordLimits::new(MAX_RECORD_BYTES);
    let sim = shape(fabric.inventory());
    let (a, b) = (shape(&merged(&whole, limits)), shape(&merged(&trimmed, limits)));
    let own: usize = whole.iter().map(|r| r.devices.iter().filter(|d| !d.fabric).count()).sum();
    assert_eq!(a.0.len(), own + 104, "every node's devices and every switch");
    assert!(a == sim, "the whole records merge into the sim's fabric");
    assert!(b.0 == sim.0, "the trimmed records merge into every device");
    assert!(b.1 == sim.1, "and every link, each once");
    // One node alone shows only its rings: the rest comes with the others.
    let alone = shape(&merged(&trimmed[..1], limits));
    assert_eq!(alone.0.len(), trimmed[0].devices.len());
    assert_eq!(trimmed[0].devices.len(), whole[0].devices.len() - 88, "88 leaves of other nodes left out");
}

#[test]
fn the_bundled_sims_fit_whole_and_merge_with_nothing_refused() {
    for sim in ["hgx-h100-8gpu.toml", "supernode-64.toml", "cxl-pool.toml", "ualink-pod-1024.toml"] {
        let fabric = Fabric::build(fabric_drivers::sim::load(&root().join(sim)).unwrap()).unwrap();
        let at_default = TopologyRecord::of_every_node(&fabric, 1, DEFAULT_MAX_RECORD_BYTES);
        assert_eq!(at_default, TopologyRecord::of_every_node(&fabric, 1, MAX_RECORD_BYTES), "{sim}: nothing trimmed");
        let inv = merged(&at_default, RecordLimits::default());
        assert!(inv.backends[0].unknown.is_empty(), "{sim}: {:?}", inv.backends[0].unknown);
        let (got, want) = (shape(&inv), shape(fabric.inventory()));
        assert!(got.0 == want.0, "{sim}: every device");
        assert!(got.1 == want.1, "{sim}: every link, each once");
    }
}
