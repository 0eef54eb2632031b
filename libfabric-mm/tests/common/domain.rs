//! Domain nodes for the library's cross-node tests: real fabricd processes joined through a
//! private etcd, each with a node-link certificate from a test CA.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fabric_nodelink::DomainCa;
use fabric_proto::wire::{Connection, DomainAction, DomainRequest, Request, Response, SUPPORTED_VERSIONS};

use super::Daemon;

/// A private etcd and a test CA the nodes of one test share (both gone when it drops).
pub struct Lab {
    pub etcd: fabric_domain::testing::EtcdServer,
    pub ca: DomainCa,
    pub ca_file: PathBuf,
    pub dir: tempfile::TempDir,
    _rt: tokio::runtime::Runtime,
}

impl Lab {
    /// Starts etcd and makes the CA, or `None` (the test skips) where etcd is not installed.
    pub fn start() -> Option<Lab> {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let etcd = rt.block_on(fabric_domain::testing::etcd_or_skip())?;
        let ca = DomainCa::generate("lab").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, &ca.pem().cert).unwrap();
        Some(Lab { etcd, ca, ca_file, dir, _rt: rt })
    }

    /// [`start`] of node `name` in this lab.
    pub fn node(&self, fabric: &Path, shared: Option<&Path>, name: &str) -> Daemon {
        start(self.etcd.endpoint(), &self.ca, &self.ca_file, fabric, shared, name)
    }
}

/// Each node's span of the address map.
pub const SPAN: u64 = 1 << 40;

/// A sim fabric of the repository's `configs/sim/`.
pub fn sim(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim").join(name).canonicalize().unwrap()
}

/// Node `name` of domain `lab` serving node `name` of sim fabric `fabric`, its link on a
/// free port with a certificate `ca` issues (files beside `ca_file`), on the shared sim
/// fabric `shared` when given.
pub fn start(etcd: &str, ca: &DomainCa, ca_file: &Path, fabric: &Path, shared: Option<&Path>, name: &str) -> Daemon {
    let pem = ca.issue(name, &[]).unwrap();
    let pki = ca_file.parent().unwrap();
    let (cert, key) = (pki.join(format!("{name}.pem")), pki.join(format!("{name}.key")));
    std::fs::write(&cert, &pem.cert).unwrap();
    std::fs::write(&key, &pem.key).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let shared = shared.map(|s| format!("shared_dir = {s:?}\n")).unwrap_or_default();
    let extra = format!(
        "[map]\nnode_span = {{ fixed = {SPAN} }}\n\
         [domain]\nname = \"lab\"\nendpoints = [{etcd:?}]\nnode = {name:?}\nlease_ttl_secs = 2\n\
         [peer]\naddress = \"127.0.0.1:{port}\"\nca = {ca_file:?}\ncert = {cert:?}\nkey = {key:?}\n\
         {shared}shared_identities = true\n"
    );
    super::daemon_on(fabric, &format!("sim_node = {name:?}"), &extra, |_| {})
}

/// The node's `domain status` document.
pub fn status(socket: &Path) -> serde_json::Value {
    let s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    let mut c = Connection::new(s);
    c.hello("crossnode-test", SUPPORTED_VERSIONS).unwrap();
    match c.call(Request::Domain(DomainRequest { action: DomainAction::Status }), &[]).unwrap().0 {
        Response::Domain(d) => serde_json::from_str(&d.json).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// Waits until every node lists all of them live and placed, and answers the slot of the
/// first.
pub fn wait_live(nodes: &[&Daemon]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let docs: Vec<serde_json::Value> = nodes.iter().map(|n| status(&n.socket)).collect();
        let live = |s: &serde_json::Value| {
            s["nodes"].as_array().is_some_and(|x| x.iter().filter(|n| n["state"] == "live").count() == nodes.len())
        };
        if docs.iter().all(live) {
            return docs[0]["self"]["slot"].as_u64().unwrap();
        }
        assert!(Instant::now() < deadline, "the nodes did not see each other: {docs:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
