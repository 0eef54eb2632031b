//! Helpers of the domain tests: a node's configuration (a node of a sim fabric, by default
//! one tray of the sim supernode, in domain `test`), the documents and maps a node
//! answers, and polling.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fabric_domain::testing::EtcdServer;
use fabric_proto::wire::{
    AccessMode, AllocResponse, BoundedVec, Connection, DomainAction, DomainRequest, ImportRequest, RegionsRequest,
    Request, Response, SUPPORTED_VERSIONS, SessionToken, TopologyRequest, TranslateQuery, TranslateRequest,
    Translation,
};
use serde_json::Value;

use super::Setup;

/// The sim supernode: 16 trays of 4 GPUs.
pub fn supernode() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/supernode-64.toml").canonicalize().unwrap()
}

/// A sim fabric file under `configs/sim/`.
pub fn sim(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim").join(name).canonicalize().unwrap()
}

/// A node's files: node `name` serving tray `tray` of the supernode in domain `test` at
/// etcd `endpoint`, node span `span`, lease TTL `ttl` seconds.
pub fn node(endpoint: &str, name: &str, tray: &str, span: u64, ttl: u64) -> Setup {
    node_on(endpoint, &supernode(), name, tray, span, ttl)
}

/// A node's files: node `name` of sim fabric `fabric` (which serves its node of the same
/// name) in domain `test` at `etcd`, node span `span`, lease TTL `ttl` seconds.
pub fn node_of(etcd: &EtcdServer, fabric: &Path, name: &str, span: u64, ttl: u64) -> Setup {
    node_on(etcd.endpoint(), fabric, name, name, span, ttl)
}

/// Node `name` serving node `sim_node` of sim fabric `fabric`.
fn node_on(endpoint: &str, fabric: &Path, name: &str, sim_node: &str, span: u64, ttl: u64) -> Setup {
    let extra = format!(
        "[map]\nnode_span = {{ fixed = {span} }}\n[domain]\nname = \"test\"\nendpoints = [{endpoint:?}]\nnode = {name:?}\nlease_ttl_secs = {ttl}\n"
    );
    let s = Setup::with_sim(fabric, &extra);
    let text = std::fs::read_to_string(&s.config).unwrap();
    std::fs::write(&s.config, text.replace("[discovery]\n", &format!("[discovery]\nsim_node = {sim_node:?}\n")))
        .unwrap();
    s
}

/// The `fabric.topology/v1` document a node answers.
pub fn topology(c: &mut Connection) -> Value {
    let Response::Topology(d) = c.call(Request::Topology(TopologyRequest::default()), &[]).unwrap().0 else {
        panic!("not a topology answer")
    };
    serde_json::from_str(&d.json).unwrap()
}

/// The `fabric.domain/v1` document `c`'s node answers to `action`.
pub fn domain(c: &mut Connection, action: DomainAction) -> Value {
    match c.call(Request::Domain(DomainRequest { action }), &[]).unwrap().0 {
        Response::Domain(d) => serde_json::from_str(&d.json).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// The domain map a node shows, without the etcd revision it was read at.
pub fn map(c: &mut Connection) -> Value {
    let Response::Map(d) = c.call(Request::Map(TopologyRequest::default()), &[]).unwrap().0 else { panic!() };
    let mut v: Value = serde_json::from_str(&d.json).unwrap();
    v.as_object_mut().unwrap().remove("generation");
    v
}

/// What `c`'s node answers for `gfa`.
pub fn translate(c: &mut Connection, gfa: u64) -> Translation {
    let queries = BoundedVec::new(vec![TranslateQuery::Gfa(gfa)]).unwrap();
    let Response::Translate(t) = c.call(Request::Translate(TranslateRequest { queries }), &[]).unwrap().0 else {
        panic!()
    };
    t.results.into_vec().remove(0)
}

/// `(name, state, slot, ranges)` of every node `c` lists.
pub fn nodes(c: &mut Connection) -> Vec<(String, String, u64, u64)> {
    let doc = domain(c, DomainAction::Nodes);
    doc["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let s = |k: &str| n[k].as_str().unwrap_or_default().to_owned();
            (s("name"), s("state"), n["slot"].as_u64().unwrap_or(u64::MAX), n["ranges"].as_u64().unwrap_or(0))
        })
        .collect()
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

/// Whether `c` lists `n` nodes, every one live with its placements published.
pub fn all_live_and_placed(c: &mut Connection, n: usize) -> bool {
    let list = nodes(c);
    list.len() == n && list.iter().all(|(_, state, _, ranges)| state == "live" && *ranges > 0)
}

/// `(standing, incarnation)` of `c`'s node, from `domain status`.
pub fn standing(c: &mut Connection) -> (String, u64) {
    let s = domain(c, DomainAction::Status);
    (s["self"]["standing"].as_str().unwrap_or_default().to_owned(), s["self"]["incarnation"].as_u64().unwrap_or(0))
}

/// The id of the first GPU of node `node` in a `fabric.topology/v1` document.
pub fn gpu_of(doc: &Value, node: &str) -> String {
    doc["devices"].as_array().unwrap().iter().find(|d| d["kind"] == "gpu" && d["node"] == node).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// How many partitions `c`'s node lists.
pub fn partitions(c: &mut Connection) -> usize {
    match c.call(Request::Partitions(fabric_proto::wire::PartitionsRequest::List), &[]).unwrap().0 {
        Response::Partitions(p) => p.partitions.len(),
        other => panic!("{other:?}"),
    }
}

/// Lets members of group `gid` connect to the socket of the node configured in `config`
/// (`[socket] group`), so that clients under other uids can.
pub fn socket_group(config: &Path, gid: u32) {
    let text = std::fs::read_to_string(config).unwrap();
    std::fs::write(config, text.replacen("\n[state]\n", &format!("\ngroup = \"{gid}\"\n[state]\n"), 1)).unwrap();
}

/// A region a client allocated on a node and wrote, its session's connection kept open
/// until the node dies, so the session is the journal's to resume (a connection closed on a
/// live node would end the session and free the region) ([`hold_region`]).
pub struct HeldRegion {
    /// The session's token.
    pub token: SessionToken,
    /// The allocation.
    pub region: AllocResponse,
    /// What was written over the whole region.
    pub bytes: Vec<u8>,
    /// The session's connection.
    _connection: Connection,
}

/// Allocates 1 MiB of `device`'s HBM through `socket`'s node and writes it whole.
pub fn hold_region(socket: &Path, device: &str) -> HeldRegion {
    let (mut c, token) = resumable(socket, None).unwrap();
    let (region, file) = super::alloc_hbm(&mut c, device, 1 << 20);
    let bytes: Vec<u8> =
        (0..region.size).map(|i| (i.wrapping_mul(31).wrapping_add(region.region) as u8) ^ (i >> 12) as u8).collect();
    std::os::unix::fs::FileExt::write_all_at(&file, &bytes, region.offset).unwrap();
    HeldRegion { token, region, bytes, _connection: c }
}

impl HeldRegion {
    /// After its node (`node`, at `socket`) restarted: the session is taken back by token
    /// and holds the region, with its bytes, where it was; `other` (another node's client)
    /// translates its GFA to `node`'s `device` again.
    pub fn check_back(&self, socket: &Path, other: &mut Connection, node: &str, device: &str) {
        let (mut c, token) = resumable(socket, Some(self.token)).expect("the session is taken back");
        assert_eq!(token, self.token);
        let Response::Regions(list) = c.call(Request::Regions(RegionsRequest { all: false }), &[]).unwrap().0 else {
            panic!()
        };
        let r = &self.region;
        let back = list.regions.iter().find(|b| b.region == r.region).expect("the region is back");
        assert_eq!((back.size, back.offset, back.resource.device.as_str()), (r.size, r.offset, device));
        let gfa = r.gfa.expect("a region of a GPU's HBM has a GFA");
        match translate(other, gfa + 7) {
            Translation::Remote { node: n, live: true, resource: Some(res), offset, set: None } => {
                assert_eq!((n.as_str(), res.device.as_str(), offset), (node, device, r.offset + 7));
            }
            t => panic!("{t:?}"),
        }
        let handle = super::export(&mut c, r.region, AccessMode::ReadOnly);
        let asked = Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly });
        let (Response::Import(i), fds) = c.call(asked, &[]).unwrap() else { panic!() };
        let file = std::fs::File::from(fds.into_iter().next().unwrap());
        let mut read = vec![0; self.bytes.len()];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut read, i.offset).unwrap();
        assert!(read == self.bytes, "the region's bytes survived");
    }
}

/// A connection to `socket` that takes session `resume` back (or starts one), with its
/// token.
pub fn resumable(socket: &Path, resume: Option<SessionToken>) -> Result<(Connection, SessionToken), String> {
    let s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = Connection::new(s);
    let hello = c.hello_with("domain-test", SUPPORTED_VERSIONS, resume).map_err(|e| format!("{e:?}"))?;
    Ok((c, hello.token.expect("a hello carries a token")))
}
