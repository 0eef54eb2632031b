//! Translate across a domain: two fabricd nodes (trays 0 and 1 of the sim supernode) joined
//! through a private etcd; a session on either node translates the other's GFAs to that
//! node and the same device, class, ordinal and offset the owner itself answers, and sees
//! the owner go (`live` false) once it is killed. Skipped, with a reason, without `etcd`
//! (scripts/deps.sh installs it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use fabric_domain::testing::{EtcdServer, etcd_or_skip, until};
use fabric_mm::{Location, MemoryClass, RemotePlace, ResourceOffset};

const TTL: u64 = 2;

fn node(etcd: &EtcdServer, name: &str) -> common::Daemon {
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/supernode-64.toml").canonicalize().unwrap();
    let extra = format!(
        "[map]\nnode_span = {{ fixed = {} }}\n[domain]\nname = \"mm\"\nendpoints = [{:?}]\nnode = {name:?}\nlease_ttl_secs = {TTL}\n",
        1u64 << 40,
        etcd.endpoint()
    );
    common::daemon_on(&sim, &format!("sim_node = {name:?}"), &extra, |_| {})
}

#[test]
fn each_node_translates_the_others_memory_to_that_node() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(etcd_or_skip()) else { return };
    let mut tray0 = node(&etcd, "tray0");
    let tray1 = node(&etcd, "tray1");
    let (s0, s1) = (common::session(&tray0.socket), common::session(&tray1.socket));

    // A byte of tray 0's first GPU, as tray 0 itself places and names it.
    let gpu = s0
        .devices()
        .unwrap()
        .into_iter()
        .find(|d| d.node.as_deref() == Some("tray0") && d.memory.iter().any(|(c, _)| *c == MemoryClass::Hbm))
        .expect("a node lists its own GPUs from its start")
        .id;
    let byte = ResourceOffset { device: gpu.clone(), memory: MemoryClass::Hbm, ordinal: 0, offset: 4096 };
    let gfa = s0.reverse(std::slice::from_ref(&byte)).unwrap()[0].expect("tray 0 maps its GPU");
    let Location::Resource { device, memory, ordinal, offset, .. } = s0.translate(&[gfa]).unwrap().remove(0) else {
        panic!("tray 0's own GFA is a local resource there")
    };
    assert_eq!((&device, memory, ordinal, offset), (&gpu, MemoryClass::Hbm, 0, 4096));

    // Tray 1 names the node and the same place, once its watch has tray 0's placements.
    let seen = until(Duration::from_secs(10), "tray 1 sees tray 0's placements", || {
        match s1.translate(&[gfa]).unwrap().remove(0) {
            Location::Remote { node, live: true, place } => Some((node, place)),
            _ => None,
        }
    });
    assert_eq!(seen, ("tray0".to_owned(), RemotePlace::Resource { device, memory, ordinal, offset }));
    // Tray 1's own GPU stays a local resource on tray 1 (its device list is the domain's).
    let own = s1
        .devices()
        .unwrap()
        .into_iter()
        .find(|d| d.node.as_deref() == Some("tray1") && d.memory.iter().any(|(c, _)| *c == MemoryClass::Hbm))
        .expect("a node lists its own GPUs from its start")
        .id;
    let own_byte = ResourceOffset { device: own.clone(), memory: MemoryClass::Hbm, ordinal: 0, offset: 0 };
    let own_gfa = s1.reverse(&[own_byte]).unwrap()[0].unwrap();
    assert!(matches!(&s1.translate(&[own_gfa]).unwrap()[0], Location::Resource { device, .. } if *device == own));

    // Tray 0 dies: its slot stays tray 0's, now a gone member's, within TTL + 1 s (and slack).
    drop(s0);
    tray0.child.kill().unwrap();
    tray0.child.wait().unwrap();
    let gone = until(Duration::from_secs(TTL + 5), "tray 1 sees tray 0 gone", || {
        match s1.translate(&[gfa]).unwrap().remove(0) {
            l @ Location::Remote { live: false, .. } => Some(l),
            _ => None,
        }
    });
    assert!(matches!(gone, Location::Remote { ref node, .. } if node == "tray0"), "{gone:?}");
}
