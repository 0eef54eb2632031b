//! UALink discovery on a synthetic vendor-attribute tree: 4 accelerators and 2 switches in
//! one pod, each accelerator with 2 ports to each switch (4 lanes at 212.5 GT/s).

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use fabric_drivers::Backend;
use fabric_drivers::sysfs::SysfsRoot;
use fabric_drivers::ualink::UalinkBackend;
use fabric_topology::{
    BackendState, Bandwidth, Device, DeviceId, DeviceKind, Inventory, LinkKind, LinkState, PciAddress, PciInfo,
};

const NODE: &str = "n0";
/// (BDF, parent path under sys/devices, accelerator id or switch id).
const ACCELS: [(&str, &str); 4] = [
    ("0000:41:00.0", "pci0000:40/0000:40:01.0"),
    ("0000:42:00.0", "pci0000:40/0000:40:02.0"),
    ("0000:c1:00.0", "pci0000:c0/0000:c0:01.0"),
    ("0000:c2:00.0", "pci0000:c0/0000:c0:02.0"),
];
const SWITCHES: [(&str, &str); 2] =
    [("0000:43:00.0", "pci0000:40/0000:40:03.0"), ("0000:c3:00.0", "pci0000:c0/0000:c0:03.0")];

fn w(dir: &Path, rel: &str, v: &str) {
    let p = dir.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, format!("{v}\n")).unwrap();
}

/// Writes a function's directory and its `/sys/bus/pci/devices` link; returns its `ualink/`.
fn function(root: &Path, bdf: &str, parent: &str) -> std::path::PathBuf {
    let dev = root.join(format!("sys/devices/{parent}/{bdf}"));
    w(&dev, "class", "0x120000");
    let bus = root.join("sys/bus/pci/devices");
    fs::create_dir_all(&bus).unwrap();
    symlink(format!("../../../devices/{parent}/{bdf}"), bus.join(bdf)).unwrap();
    dev.join("ualink")
}

fn port(u: &Path, n: u32, state: &str, remote: (&str, u32)) {
    let p = format!("ports/port{n}");
    w(u, &format!("{p}/state"), state);
    w(u, &format!("{p}/{}", remote.0), &remote.1.to_string());
    w(u, &format!("{p}/lanes"), "4");
    w(u, &format!("{p}/rate_gts"), "212.5");
}

fn pod() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    let root = t.path();
    // A function without UALink, which the backend must ignore.
    function(root, "0000:00:1f.0", "pci0000:00");
    for (i, (bdf, parent)) in ACCELS.iter().enumerate() {
        let u = function(root, bdf, parent);
        for (k, v) in
            [("pod_id", "7"), ("vpod_id", "1"), ("port_count", "4"), ("link_rate_gts", "212.5"), ("lanes", "4")]
        {
            w(&u, k, v);
        }
        w(&u, "accelerator_id", &i.to_string());
        for p in 0..4 {
            let state = if i == 3 && p == 3 { "down" } else { "up" };
            port(&u, p, state, ("remote_switch_id", p / 2));
        }
    }
    for (s, (bdf, parent)) in SWITCHES.iter().enumerate() {
        let u = function(root, bdf, parent);
        for (k, v) in
            [("pod_id", "7"), ("vpod_id", "0"), ("port_count", "8"), ("link_rate_gts", "212.5"), ("lanes", "4")]
        {
            w(&u, k, v);
        }
        w(&u, "switch_id", &s.to_string());
        for p in 0..8 {
            let state = if s == 1 && p == 7 { "down" } else { "up" };
            port(&u, p, state, ("remote_accelerator_id", p / 2));
        }
    }
    t
}

fn discover(root: &Path, inv: &mut Inventory) -> fabric_topology::BackendReport {
    UalinkBackend::new(SysfsRoot::new(root, NODE)).discover(inv)
}

fn pci(s: &str) -> DeviceId {
    DeviceId::pci(NODE, s.parse().unwrap())
}

fn seed(inv: &mut Inventory) {
    for bdf in ACCELS.iter().chain(&SWITCHES).map(|(b, _)| *b).chain(["0000:00:1f.0"]) {
        let a: PciAddress = bdf.parse().unwrap();
        let kind = if bdf == "0000:c2:00.0" { DeviceKind::Gpu } else { DeviceKind::Other };
        let mut d = Device::new(DeviceId::pci(NODE, a), kind, Some(NODE));
        d.pci = Some(PciInfo { address: Some(a), ..PciInfo::default() });
        d.sources.push("pci".into());
        inv.add_device(d).unwrap();
    }
}

#[test]
fn no_ualink_attributes_is_not_present() {
    let t = tempfile::tempdir().unwrap();
    function(t.path(), "0000:00:1f.0", "pci0000:00");
    let mut inv = Inventory::new();
    let r = discover(t.path(), &mut inv);
    assert_eq!(r.state, BackendState::NotPresent("no device exposes ualink/ attributes".into()));
    assert!(inv.devices.is_empty());
}

#[test]
fn existing_pci_functions_are_enriched_and_linked() {
    let t = pod();
    let mut inv = Inventory::new();
    seed(&mut inv);
    let r = discover(t.path(), &mut inv);
    assert_eq!(r.state, BackendState::Present);
    assert!(r.unknown.is_empty(), "{:#?}", r.unknown);
    assert_eq!((r.devices, inv.devices.len()), (6, 7), "enriched in place, nothing added");
    for (i, (bdf, _)) in ACCELS.iter().enumerate() {
        let d = inv.device(inv.find(&pci(bdf)).unwrap());
        let u = d.ualink.as_ref().unwrap();
        assert_eq!(
            (u.pod, u.vpod, u.accelerator_id, u.switch_id, u.ports),
            (Some(7), Some(1), Some(i as u16), None, Some(4))
        );
        // A GPU stays a GPU; other functions become accelerators.
        let want = if *bdf == "0000:c2:00.0" { DeviceKind::Gpu } else { DeviceKind::Accelerator };
        assert_eq!(d.kind, want);
        assert_eq!(d.sources, vec!["pci".to_owned(), "ualink".to_owned()]);
    }
    for (s, (bdf, _)) in SWITCHES.iter().enumerate() {
        let d = inv.device(inv.find(&pci(bdf)).unwrap());
        assert_eq!(d.kind, DeviceKind::UalinkSwitch);
        assert_eq!(d.ualink.as_ref().unwrap().switch_id, Some(s as u16));
    }
    assert_eq!(inv.device(inv.find(&pci("0000:00:1f.0")).unwrap()).ualink, None);

    // One link per accelerator-switch pair, two ports bundled: 2 x 4 lanes x 25,000 MB/s.
    assert_eq!(inv.links.len(), 8);
    for (i, (acc, _)) in ACCELS.iter().enumerate() {
        for (s, (sw, _)) in SWITCHES.iter().enumerate() {
            let (a, b) = (inv.find(&pci(acc)).unwrap(), inv.find(&pci(sw)).unwrap());
            let l = inv.links.iter().find(|l| l.a == a && l.b == b).unwrap_or_else(|| panic!("{acc} - {sw}"));
            if i == 3 && s == 1 {
                assert_eq!(l.kind, LinkKind::Ualink { ports: 1, lanes: 4, gts: 212 });
                assert_eq!(l.bandwidth, Bandwidth { current_mbps: Some(100_000), max_mbps: Some(200_000) });
                assert_eq!(l.state, LinkState::Degraded);
            } else {
                assert_eq!(l.kind, LinkKind::Ualink { ports: 2, lanes: 4, gts: 212 });
                assert_eq!(l.bandwidth, Bandwidth::full(200_000));
                assert_eq!(l.state, LinkState::Up);
            }
        }
    }
    inv.validate().unwrap();

    // Discovering again adds no duplicate links.
    discover(t.path(), &mut inv);
    assert_eq!(inv.links.len(), 8);
}

#[test]
fn without_the_pci_backend_functions_are_added_and_say_so() {
    let t = pod();
    let mut inv = Inventory::new();
    let r = discover(t.path(), &mut inv);
    assert_eq!(inv.devices.len(), 6);
    assert_eq!(inv.count(DeviceKind::Accelerator), 4);
    assert_eq!(inv.count(DeviceKind::UalinkSwitch), 2);
    assert_eq!(inv.links.len(), 8);
    assert_eq!(r.unknown.iter().filter(|l| l.contains("not found by the PCI backend")).count(), 6);
}

#[test]
fn hostile_attributes_are_refused_with_notes() {
    let t = pod();
    let root = t.path();
    let u0 = root.join("sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0/ualink");
    // A port naming a switch that does not exist, and a garbage trained rate.
    w(&u0, "ports/port0/remote_switch_id", "9");
    w(&u0, "ports/port1/rate_gts", "fast");
    // An accelerator claiming to be a switch too: no kind, no links of its own.
    let u1 = root.join("sys/devices/pci0000:40/0000:40:02.0/0000:42:00.0/ualink");
    w(&u1, "switch_id", "5");
    // All ports of accelerator 2 down towards switch 0.
    let u2 = root.join("sys/devices/pci0000:c0/0000:c0:01.0/0000:c1:00.0/ualink");
    w(&u2, "ports/port0/state", "down");
    w(&u2, "ports/port1/state", "sideways");
    // A function whose ualink/ lives outside the root.
    let outside = tempfile::tempdir().unwrap();
    w(outside.path(), "ualink/accelerator_id", "9");
    symlink(outside.path(), root.join("sys/bus/pci/devices/0000:99:00.0")).unwrap();

    let mut inv = Inventory::new();
    let r = discover(root, &mut inv);
    let has = |s: &str| r.unknown.iter().any(|l| l.contains(s));
    assert!(has("port0: remote Switch(9) not found"), "{:#?}", r.unknown);
    assert!(has("port1/rate_gts: invalid") && has("port1/state: invalid"));
    assert!(has("0000:42:00.0: needs exactly one of accelerator_id, switch_id"));
    assert!(has("link leaves the sysfs root"));
    assert!(inv.find(&pci("0000:99:00.0")).is_none());
    assert_eq!(inv.device(inv.find(&pci("0000:42:00.0")).unwrap()).kind, DeviceKind::Other);

    let link = |a: &str, b: &str| {
        let (a, b) = (inv.find(&pci(a)).unwrap(), inv.find(&pci(b)).unwrap());
        inv.links.iter().find(|l| l.a == a && l.b == b).cloned()
    };
    // acc0 -> sw0: port0 dropped (unknown remote), port1 up with an unknown rate.
    let l = link("0000:41:00.0", "0000:43:00.0").unwrap();
    assert_eq!(l.kind, LinkKind::Ualink { ports: 1, lanes: 4, gts: 212 });
    assert_eq!(l.bandwidth, Bandwidth { current_mbps: None, max_mbps: Some(100_000) });
    // acc1 has no links; the switches' ports towards it do not invent one.
    assert!(link("0000:42:00.0", "0000:43:00.0").is_none());
    // acc2 -> sw0: no port up.
    let l = link("0000:c1:00.0", "0000:43:00.0").unwrap();
    assert_eq!((l.state, l.bandwidth.current_mbps), (LinkState::Down, Some(0)));
    inv.validate().unwrap();
}

/// Two accelerators claiming one id: a port naming that id could mean either, so it links
/// to neither. Before, the last one found took the id and got the link.
#[test]
fn an_id_claimed_twice_links_no_port_that_names_it() {
    let t = pod();
    let root = t.path();
    let acc = |bdf: &str, parent: &str| root.join(format!("sys/devices/{parent}/{bdf}/ualink"));
    // acc3 claims acc0's id; acc2 gets a direct port to accelerator 0.
    w(&acc("0000:c2:00.0", "pci0000:c0/0000:c0:02.0"), "accelerator_id", "0");
    port(&acc("0000:c1:00.0", "pci0000:c0/0000:c0:01.0"), 4, "up", ("remote_accelerator_id", 0));
    let mut inv = Inventory::new();
    let r = discover(root, &mut inv);
    assert!(r.unknown.iter().any(|l| l.contains("id 0 used twice in pod Some(7)")), "{:#?}", r.unknown);
    assert!(r.unknown.iter().any(|l| l.contains("port4: remote Accelerator(0) is claimed by several devices")));
    let acc2 = inv.find(&pci("0000:c1:00.0")).unwrap();
    for other in ["0000:41:00.0", "0000:c2:00.0"] {
        let o = inv.find(&pci(other)).unwrap();
        assert!(
            !inv.links.iter().any(|l| (l.a, l.b) == (acc2, o) || (l.a, l.b) == (o, acc2)),
            "acc2 linked to {other}"
        );
    }
    inv.validate().unwrap();
}
