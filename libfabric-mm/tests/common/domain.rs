//! Domain nodes for the library's cross-node tests: real fabricd processes joined through a
//! private etcd, each with a node-link certificate from a test CA.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fabric_nodelink::DomainCa;
use fabric_proto::wire::{
    Connection, DomainAction, DomainRequest, Request, Response, SUPPORTED_VERSIONS, TopologyRequest,
};

use super::Daemon;

/// A private etcd and a test CA the nodes of one test share (both gone when it drops).
pub struct Lab {
    pub etcd: fabric_domain::testing::EtcdServer,
    pub ca: DomainCa,
    pub ca_file: PathBuf,
    pub dir: tempfile::TempDir,
    /// More lines of every node's `[domain]` (e.g. `data_paths = [...]`).
    pub domain_lines: String,
    /// The network namespaces the nodes run in ([`Lab::start_in_namespaces`]), etcd in one
    /// of its own; `None`: every node on loopback.
    pub net: Option<fabric_domain::testing::netns::Net>,
    _rt: tokio::runtime::Runtime,
}

impl Lab {
    /// Starts etcd and makes the CA, or `None` (the test skips) where etcd is not installed.
    pub fn start() -> Option<Lab> {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let etcd = rt.block_on(fabric_domain::testing::etcd_or_skip())?;
        Some(Self::around(rt, etcd, None))
    }

    /// A lab whose nodes run in `nodes` network namespaces ([`Lab::node_in`]), etcd in one
    /// of its own, all on a bridge the lab made; `None` (the test skips) where namespaces
    /// or etcd are not available.
    pub fn start_in_namespaces(nodes: u8) -> Option<Lab> {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (net, etcd) = rt.block_on(fabric_domain::testing::net_and_etcd_or_skip(nodes))?;
        Some(Self::around(rt, etcd, Some(net)))
    }

    /// A lab on `etcd` (and `net`): its CA made, in a directory of its own.
    fn around(
        rt: tokio::runtime::Runtime,
        etcd: fabric_domain::testing::EtcdServer,
        net: Option<fabric_domain::testing::netns::Net>,
    ) -> Lab {
        let ca = DomainCa::generate("lab").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, &ca.pem().cert).unwrap();
        Lab { etcd, ca, ca_file, dir, domain_lines: String::new(), net, _rt: rt }
    }

    /// Node `name` in namespace `i` of this lab (made by [`Lab::start_in_namespaces`]),
    /// its link at the namespace's address, as [`Lab::node`] otherwise.
    pub fn node_in(&self, i: usize, fabric: &Path, shared: Option<&Path>, name: &str) -> Daemon {
        let ns = &self.net.as_ref().expect("a lab in namespaces").nodes()[i];
        let shared = shared.map(|s| format!("shared_dir = {s:?}\n")).unwrap_or_default();
        let address = format!("{}:7471", ns.addr());
        self.node_at(fabric, &format!("sim_node = {name:?}"), &shared, "", name, &address, |cmd| {
            ns.enter_on_spawn(cmd).unwrap();
        })
    }

    /// Node `name` of this lab serving node `name` of sim fabric `fabric`, on the shared
    /// sim fabric `shared` when given.
    pub fn node(&self, fabric: &Path, shared: Option<&Path>, name: &str) -> Daemon {
        let shared = shared.map(|s| format!("shared_dir = {s:?}\n")).unwrap_or_default();
        self.node_with(fabric, &format!("sim_node = {name:?}"), &shared, "", name)
    }

    /// Node `name` of this lab on sim fabric `fabric`, with lines `discovery` in its
    /// `[discovery]` and `peer` in its `[peer]`, and sections `extra`; its link on a free
    /// port with a certificate the lab's CA issues.
    pub fn node_with(&self, fabric: &Path, discovery: &str, peer: &str, extra: &str, name: &str) -> Daemon {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        self.node_at(fabric, discovery, peer, extra, name, &format!("127.0.0.1:{port}"), |_| {})
    }

    /// [`Lab::node_with`], its link at `address`, `prepare` applied to its command.
    #[allow(clippy::too_many_arguments)]
    fn node_at(
        &self,
        fabric: &Path,
        discovery: &str,
        peer: &str,
        extra: &str,
        name: &str,
        address: &str,
        prepare: impl FnOnce(&mut std::process::Command),
    ) -> Daemon {
        let pem = self.ca.issue(name, &[]).unwrap();
        let pki = self.dir.path();
        let (cert, key) = (pki.join(format!("{name}.pem")), pki.join(format!("{name}.key")));
        std::fs::write(&cert, &pem.cert).unwrap();
        std::fs::write(&key, &pem.key).unwrap();
        let (etcd, ca_file, lines) = (self.etcd.endpoint(), &self.ca_file, &self.domain_lines);
        let config = format!(
            "[map]\nnode_span = {{ fixed = {SPAN} }}\n\
             [domain]\nname = \"lab\"\nendpoints = [{etcd:?}]\nnode = {name:?}\nlease_ttl_secs = 2\n{lines}\
             [peer]\naddress = {address:?}\nca = {ca_file:?}\ncert = {cert:?}\nkey = {key:?}\n\
             {peer}shared_identities = true\n{extra}"
        );
        super::daemon_on(fabric, discovery, &config, prepare)
    }
}

/// Each node's span of the address map.
pub const SPAN: u64 = 1 << 40;

/// A sim fabric of the repository's `configs/sim/`.
pub fn sim(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim").join(name).canonicalize().unwrap()
}

/// The node's answer to `request`, a JSON document.
fn document(socket: &Path, request: Request) -> serde_json::Value {
    let s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    let mut c = Connection::new(s);
    c.hello("crossnode-test", SUPPORTED_VERSIONS).unwrap();
    match c.call(request, &[]).unwrap().0 {
        Response::Domain(d) => serde_json::from_str(&d.json).unwrap(),
        Response::Topology(d) => serde_json::from_str(&d.json).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// The node's `fabric.topology/v1` document (the domain's topology, merged).
pub fn topology(socket: &Path) -> serde_json::Value {
    document(socket, Request::Topology(TopologyRequest::default()))
}

/// The node's `domain status` document.
pub fn status(socket: &Path) -> serde_json::Value {
    document(socket, Request::Domain(DomainRequest { action: DomainAction::Status }))
}

/// Waits until every node lists all of them live and placed, with every node's topology
/// merged (an owner waits only so long for an importer's record before it refuses a
/// grant), and answers the slot of the first.
pub fn wait_live(nodes: &[&Daemon]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let docs: Vec<serde_json::Value> = nodes.iter().map(|n| status(&n.socket)).collect();
        let live = |s: &serde_json::Value| {
            s["nodes"].as_array().is_some_and(|x| x.iter().filter(|n| n["state"] == "live").count() == nodes.len())
        };
        let merged = |n: &&Daemon| topology(&n.socket)["nodes"].as_array().is_some_and(|x| x.len() == nodes.len());
        if docs.iter().all(live) && nodes.iter().all(merged) {
            return docs[0]["self"]["slot"].as_u64().unwrap();
        }
        let merged: Vec<_> = nodes
            .iter()
            .map(|n| {
                let t = topology(&n.socket);
                (t["nodes"].clone(), t["backends"].clone())
            })
            .collect();
        assert!(Instant::now() < deadline, "the nodes did not see each other: {docs:?}; topology nodes {merged:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A session on `socket` whose window covers slot `slot`, or with the window a domain
/// node's client gets by default (one aperture per node span it places memory of) for
/// `None`.
pub fn session(socket: &Path, slot: Option<u64>) -> fabric_mm::Session {
    fabric_mm::Session::open_with(fabric_mm::SessionConfig {
        socket: Some(socket.to_owned()),
        window: slot.map(|slot| fabric_mm::WindowConfig { gfa: slot * SPAN, len: SPAN }),
        client_name: Some("crossnode-test".into()),
        ..fabric_mm::SessionConfig::default()
    })
    .unwrap()
}

/// The revocations `session`'s callback sees, from now on.
pub fn revocations(session: &fabric_mm::Session) -> std::sync::mpsc::Receiver<fabric_mm::Revocation> {
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    session.on_revocation(move |r| {
        let _ = tx.lock().unwrap().send(*r);
    });
    rx
}
