//! Domain test helpers: a node's configuration in a private etcd's domain, its documents.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fabric_domain::testing::EtcdServer;
use fabric_proto::wire::{Connection, Request, Response, TopologyRequest};
use serde_json::Value;

/// A sim fabric file under `configs/sim/`.
pub fn sim(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim").join(name).canonicalize().unwrap()
}

/// A node's files: node `name` of sim fabric `fabric` (which serves its node of the same
/// name) in domain `test`, node span `span`, lease TTL `ttl`.
pub fn node(etcd: &EtcdServer, fabric: &Path, name: &str, span: u64, ttl: u64) -> super::Setup {
    let extra = format!(
        "[map]\nnode_span = {{ fixed = {span} }}\n[domain]\nname = \"test\"\nendpoints = [{:?}]\nnode = {name:?}\nlease_ttl_secs = {ttl}\n",
        etcd.endpoint()
    );
    let s = super::Setup::with_sim(fabric, &extra);
    let text = std::fs::read_to_string(&s.config).unwrap();
    std::fs::write(&s.config, text.replace("[discovery]\n", &format!("[discovery]\nsim_node = {name:?}\n"))).unwrap();
    s
}

/// The `fabric.topology/v1` document a node answers.
pub fn topology(c: &mut Connection) -> Value {
    let Response::Topology(d) = c.call(Request::Topology(TopologyRequest::default()), &[]).unwrap().0 else {
        panic!("not a topology answer")
    };
    serde_json::from_str(&d.json).unwrap()
}

/// Polls `f` every 50 ms for up to `within`; the time it took.
pub fn until(within: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}
