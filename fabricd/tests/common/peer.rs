//! Nodes of one domain with the node link (`daemon_peer*.rs`): a test CA and its
//! certificates, nodes of the supernode sim on 127.0.0.1, and the client calls the
//! cross-node tests share.
#![allow(dead_code, clippy::unwrap_used)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fabric_domain::testing::{EtcdServer, until};
use fabric_nodelink::{Credentials, DomainCa, Pem};
use fabric_proto::wire::{
    AccessMode, CodecError, Connection, CopyDone, CopyEndpoint, CopyRequest, DeviceName, DomainAction, DomainRequest,
    ErrorBody, Event, ExportHandle, ImportRequest, ImportResponse, RegisterRequest, RegisterSource, Request, Response,
    StatusRequest, SubscribeRequest, Topics,
};
use serde_json::Value;

use super::scrape::free_port;

pub const TTL: u64 = 2;
pub const SPAN: u64 = 1 << 40;
pub const DOMAIN: &str = "test";

pub fn supernode() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/supernode-64.toml").canonicalize().unwrap()
}

/// The CA's and the nodes' PEM files in `dir`.
pub struct Pki {
    /// The CA.
    pub ca: DomainCa,
    /// Where its files are.
    pub dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Self {
        let pki = Self { ca: DomainCa::generate(DOMAIN).unwrap(), dir: tempfile::tempdir().unwrap() };
        std::fs::write(pki.dir.path().join("ca.pem"), &pki.ca.pem().cert).unwrap();
        pki
    }

    /// Issues `node`'s certificate; its files (certificate, key).
    pub fn issue(&self, node: &str) -> (PathBuf, PathBuf) {
        let pem = self.ca.issue(node, &[]).unwrap();
        let (cert, key) = (self.dir.path().join(format!("{node}.pem")), self.dir.path().join(format!("{node}.key")));
        std::fs::write(&cert, &pem.cert).unwrap();
        std::fs::write(&key, &pem.key).unwrap();
        (cert, key)
    }

    pub fn credentials(&self, node: &str) -> Credentials {
        let (cert, key) = self.issue(node);
        let pem = Pem { cert: std::fs::read_to_string(cert).unwrap(), key: std::fs::read_to_string(key).unwrap() };
        Credentials::from_pem(&self.ca.pem().cert, &pem).unwrap()
    }
}

/// Node `name` serving tray `name` of the supernode, its link at `port` with `cert_of`'s
/// certificate.
pub fn node(etcd: &EtcdServer, pki: &Pki, name: &str, cert_of: &str, port: u16) -> super::Setup {
    node_with(etcd, pki, name, cert_of, port, "")
}

/// [`node`] with more `[peer]` keys.
pub fn node_with(etcd: &EtcdServer, pki: &Pki, name: &str, cert_of: &str, port: u16, peer: &str) -> super::Setup {
    node_at(etcd, pki, name, cert_of, &format!("127.0.0.1:{port}"), peer)
}

/// [`node_with`] with its link at `address`.
pub fn node_at(etcd: &EtcdServer, pki: &Pki, name: &str, cert_of: &str, address: &str, peer: &str) -> super::Setup {
    let (cert, key) = pki.issue(cert_of);
    let extra = format!(
        "[map]\nnode_span = {{ fixed = {SPAN} }}\n[domain]\nname = {DOMAIN:?}\nendpoints = [{:?}]\nnode = {name:?}\nlease_ttl_secs = {TTL}\n\
         [peer]\naddress = {address:?}\nca = {:?}\ncert = {:?}\nkey = {:?}\n{peer}",
        etcd.endpoint(),
        pki.dir.path().join("ca.pem"),
        cert,
        key,
    );
    let s = super::Setup::with_sim(&supernode(), &extra);
    let text = std::fs::read_to_string(&s.config).unwrap();
    std::fs::write(&s.config, text.replace("[discovery]\n", &format!("[discovery]\nsim_node = {name:?}\n"))).unwrap();
    s
}

pub fn status(c: &mut Connection) -> Value {
    match c.call(Request::Domain(DomainRequest { action: DomainAction::Status }), &[]).unwrap().0 {
        Response::Domain(d) => serde_json::from_str(&d.json).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// `name`'s incarnation as `c`'s node lists it, once live.
pub fn incarnation_of(c: &mut Connection, name: &str) -> Option<u64> {
    let doc = status(c);
    doc["nodes"].as_array()?.iter().find(|n| n["name"] == name && n["state"] == "live")?["incarnation"].as_u64()
}

/// The map's first HBM range of `node`: its device.
pub fn hbm_of(c: &mut Connection, node: &str) -> String {
    let Response::Map(d) = c.call(Request::Map(fabric_proto::wire::TopologyRequest::default()), &[]).unwrap().0 else {
        panic!()
    };
    let v: Value = serde_json::from_str(&d.json).unwrap();
    let r = v["ranges"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node"] == node && r["owner"].as_str().is_some_and(|o| o.contains("#hbm")))
        .unwrap_or_else(|| panic!("no HBM range of {node}: {v}"));
    r["owner"].as_str().unwrap().split('#').next().unwrap().to_owned()
}

pub fn import(
    c: &mut Connection,
    handle: ExportHandle,
    access: AccessMode,
) -> Result<(ImportResponse, File), ErrorBody> {
    match c.call(Request::Import(ImportRequest { handle, access }), &[]) {
        Ok((Response::Import(i), fds)) => Ok((i, File::from(fds.into_iter().next().unwrap()))),
        Ok((other, _)) => panic!("{other:?}"),
        Err(CodecError::Refused { body, .. }) => Err(body),
        Err(e) => panic!("{e:?}"),
    }
}

/// Three nodes tray0..tray2 on a shared sim fabric in `shared` (all but those `apart`
/// says), started, each listing all three live: their files, daemons and clients.
pub fn three_nodes(
    etcd: &EtcdServer,
    pki: &Pki,
    shared: &Path,
    apart: impl Fn(usize) -> bool,
) -> (Vec<super::Setup>, Vec<Option<super::Daemon>>, Vec<Connection>) {
    three_nodes_with(etcd, pki, shared, apart, |_, text| text.to_owned())
}

/// [`three_nodes`], node `i`'s configuration text made `edit(i, text)` before it starts.
pub fn three_nodes_with(
    etcd: &EtcdServer,
    pki: &Pki,
    shared: &Path,
    apart: impl Fn(usize) -> bool,
    edit: impl Fn(usize, &str) -> String,
) -> (Vec<super::Setup>, Vec<Option<super::Daemon>>, Vec<Connection>) {
    three_nodes_named(etcd, pki, shared, ["tray0", "tray1", "tray2"], apart, edit)
}

/// [`three_nodes_with`], the nodes named `names` (each the sim's node of that name: an
/// `edit` points them at a fabric that has them).
pub fn three_nodes_named(
    etcd: &EtcdServer,
    pki: &Pki,
    shared: &Path,
    names: [&str; 3],
    apart: impl Fn(usize) -> bool,
    edit: impl Fn(usize, &str) -> String,
) -> (Vec<super::Setup>, Vec<Option<super::Daemon>>, Vec<Connection>) {
    let fabric = format!("shared_dir = {:?}\nshared_identities = true\n", shared.join("sim"));
    let setups: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let s = node_with(etcd, pki, n, n, free_port(), if apart(i) { "" } else { &fabric });
            let text = std::fs::read_to_string(&s.config).unwrap();
            std::fs::write(&s.config, edit(i, &text)).unwrap();
            s
        })
        .collect();
    let daemons: Vec<_> = setups.iter().map(|s| Some(super::start(&s.config, s.dir.path()))).collect();
    let mut clients: Vec<_> = setups.iter().map(|s| super::client(&s.socket)).collect();
    let mut sorted = names.to_vec();
    sorted.sort_unstable();
    for c in &mut clients {
        for n in names {
            until(Duration::from_secs(15), "every node lists every other live", || incarnation_of(c, n));
        }
        // An owner waits only so long for an importer's topology record (it decides what
        // the importer may map): every node has every node's before a test imports.
        until(Duration::from_secs(15), "every node's topology merged", || {
            (super::domain::topology(c)["nodes"] == serde_json::json!(sorted)).then_some(())
        });
    }
    (setups, daemons, clients)
}

pub fn subscribe(c: &mut Connection) {
    let Response::Subscribe(_) =
        c.call(Request::Subscribe(SubscribeRequest { topics: Topics::REVOCATION }), &[]).unwrap().0
    else {
        panic!()
    };
}

pub fn imports(c: &mut Connection) -> u64 {
    match c.call(Request::Status(StatusRequest::default()), &[]).unwrap().0 {
        Response::Status(s) => s.imports,
        other => panic!("{other:?}"),
    }
}

pub fn revocation(c: &mut Connection) -> fabric_proto::wire::Revocation {
    match c.next_event().unwrap() {
        Event::Revocation(r) => r,
        other => panic!("{other:?}"),
    }
}

pub fn standing(c: &mut Connection) -> String {
    status(c)["self"]["standing"].as_str().unwrap_or_default().to_owned()
}

/// A copy-only import of `handle` (no descriptor comes with it), or the refusal.
pub fn import_copy_only(
    c: &mut Connection,
    handle: ExportHandle,
    access: AccessMode,
) -> Result<ImportResponse, ErrorBody> {
    match c.call(Request::Import(ImportRequest { handle, access }), &[]) {
        Ok((Response::Import(i), fds)) => {
            assert!(fds.is_empty(), "a copy-only grant carries no descriptor");
            Ok(i)
        }
        Ok((other, _)) => panic!("{other:?}"),
        Err(CodecError::Refused { body, .. }) => Err(body),
        Err(e) => panic!("{e:?}"),
    }
}

/// Bytes of a test pattern.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8).collect()
}

/// A memfd of `len` bytes registered by `c` for DMA by `gpu`: the registration and the file.
pub fn registered(c: &mut Connection, gpu: &str, len: u64) -> (u64, File) {
    use std::os::fd::{AsFd, FromRawFd};
    let name = std::ffi::CString::new("peer-copy").unwrap();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just created and is owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len).unwrap();
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(gpu),
        source: RegisterSource::Fd,
        offset: 0,
        len,
        access: AccessMode::ReadWrite,
        node: None,
    });
    let Response::Register(r) = c.call(req, &[file.as_fd()]).unwrap().0 else { panic!() };
    (r.registration, file)
}

/// Starts a copy on `c`: its id, or the refusal.
pub fn start_copy(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> Result<u64, ErrorBody> {
    match c.call(Request::Copy(CopyRequest { dst, src, len }), &[]) {
        Ok((Response::Copy(r), _)) => Ok(r.copy),
        Ok((other, _)) => panic!("{other:?}"),
        Err(CodecError::Refused { body, .. }) => Err(body),
        Err(e) => panic!("{e:?}"),
    }
}

/// Waits for copy `copy`'s completion event on `c`.
pub fn copy_done(c: &mut Connection, copy: u64) -> CopyDone {
    loop {
        match c.next_event().unwrap() {
            Event::CopyDone(d) if d.copy == copy => return d,
            _ => {}
        }
    }
}

/// Registration `id` at `offset`, as a copy's endpoint.
pub fn reg(id: u64, offset: u64) -> CopyEndpoint {
    CopyEndpoint::Registration { id, offset }
}
