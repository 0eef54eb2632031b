//! One topology across the domain, with real fabricd processes and a private etcd: two
//! trays of the sim supernode and an HGX host with no memory fabric shared with them each
//! publish their topology record; every node answers the same merged topology, whose
//! matrix says NV18 between GPUs of the two trays (through the fabric-level NVLink
//! switches) and NET between a tray and the HGX host; a tray killed with SIGKILL is still
//! listed, its devices marked down and no longer reached, within TTL + 1 s.
//!
//! Each test starts its own etcd on 127.0.0.1; without an `etcd` binary it says it is
//! skipped (scripts/deps.sh installs Debian's etcd-server).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::domain::{node, sim, topology, until};
use serde_json::Value;

const TTL: u64 = 2;
const SPAN: u64 = 1 << 40;

/// The matrix of a topology document as `(node of row, node of column) → classes` of
/// GPUs, and each GPU label's node.
struct Matrix {
    node_of: BTreeMap<String, String>,
    classes: Vec<Vec<String>>,
    labels: Vec<String>,
}

impl Matrix {
    fn of(doc: &Value) -> Self {
        let node_of = doc["devices"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"] == "gpu")
            .map(|d| (d["label"].as_str().unwrap().to_owned(), d["node"].as_str().unwrap().to_owned()))
            .collect();
        let m = &doc["matrix"];
        let labels = m["labels"].as_array().unwrap().iter().map(|l| l.as_str().unwrap().to_owned()).collect();
        let classes = m["classes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_owned()).collect())
            .collect();
        Self { node_of, classes, labels }
    }

    /// Every class between a GPU of `a` and a GPU of `b` (other than a GPU with itself).
    fn between(&self, a: &str, b: &str) -> Vec<String> {
        let gpus = |n: &str| -> Vec<usize> {
            self.labels
                .iter()
                .enumerate()
                .filter(|(_, l)| self.node_of.get(*l).is_some_and(|x| x == n))
                .map(|(i, _)| i)
                .collect()
        };
        let mut out: Vec<String> = Vec::new();
        for i in gpus(a) {
            for j in gpus(b) {
                if i != j {
                    out.push(self.classes[i][j].clone());
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

#[test]
fn the_domain_has_one_topology_and_shows_a_node_down() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let supernode = sim("supernode-64.toml");
    let setups = [
        node(&etcd, &supernode, "tray0", SPAN, TTL),
        node(&etcd, &supernode, "tray1", SPAN, TTL),
        node(&etcd, &sim("hgx-h100-8gpu.toml"), "node0", SPAN, TTL),
    ];
    let mut daemons: Vec<_> = setups.iter().map(|s| Some(common::start(&s.config, s.dir.path()))).collect();
    let mut clients: Vec<_> = setups.iter().map(|s| common::client(&s.socket)).collect();
    let nodes = |doc: &Value| doc["nodes"].clone();
    for c in &mut clients {
        until(Duration::from_secs(15), "every node's topology merged", || {
            nodes(&topology(c)) == serde_json::json!(["node0", "tray0", "tray1"])
        });
    }
    let first = topology(&mut clients[0]);
    for c in &mut clients[1..] {
        let doc = topology(c);
        assert_eq!(
            (&doc["matrix"], &doc["labels"]),
            (&first["matrix"], &first["labels"]),
            "one topology on every node"
        );
    }
    let m = Matrix::of(&first);
    assert_eq!(m.node_of.len(), 4 + 4 + 8, "{:?}", m.node_of);
    assert_eq!(m.between("tray0", "tray1"), ["NV18"], "trays reach each other through the fabric switches");
    assert_eq!(m.between("tray0", "tray0"), ["NV18"]);
    assert_eq!(m.between("node0", "node0"), ["NV18"], "the HGX board's own NVSwitches");
    assert_eq!(m.between("tray0", "node0"), ["NET"], "no memory fabric between them");
    assert_eq!(m.between("node0", "tray1"), ["NET"]);
    let switches = first["devices"].as_array().unwrap().iter().filter(|d| d["kind"] == "nv_switch").count();
    assert_eq!(switches, 18 + 4, "the supernode's 18 fabric switches once, and the HGX board's 4");

    // kill -9 tray1: still listed, its devices marked down and no longer reached.
    let mut dead = daemons[1].take().unwrap();
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    for i in [0, 2] {
        until(Duration::from_secs(TTL + 3), "tray1 down in the topology", || {
            Matrix::of(&topology(&mut clients[i])).between("tray0", "tray1") == ["-"]
        });
    }
    let seen = killed.elapsed();
    assert!(seen <= Duration::from_secs(TTL + 1), "down seen after {seen:?}, more than TTL + 1 s");
    let doc = topology(&mut clients[2]);
    assert_eq!(nodes(&doc), serde_json::json!(["node0", "tray0", "tray1"]), "a node down is still listed");
    let m = Matrix::of(&doc);
    assert_eq!(m.between("tray1", "node0"), ["-"]);
    assert_eq!(m.between("tray0", "node0"), ["NET"]);
    assert_eq!(m.between("tray0", "tray0"), ["NV18"], "the live tray keeps its switches");
    for d in doc["devices"].as_array().unwrap().iter().filter(|d| d["node"] == "tray1") {
        assert_eq!(d["attrs"]["domain_node"], "down", "{d}");
        assert!(d["attrs"]["failed"].as_str().unwrap().contains("tray1"), "{d}");
    }
    for d in doc["devices"].as_array().unwrap().iter().filter(|d| d["node"] == "tray0") {
        assert_eq!(d["attrs"]["domain_node"], "live", "{d}");
    }
    drop(daemons);
}
