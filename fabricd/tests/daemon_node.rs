//! Node identities on the real daemon (protocol 1.5): its handles and grants name the node
//! kept in its state dir; a client at 1.4 gets node-less handles and no grants, which the
//! daemon resolves as its own; a handle naming another node is refused with `WrongNode`
//! naming that node; the mixes a version cannot mean are bad requests.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::net::UnixStream;
use std::time::Duration;

use fabric_proto::wire::{
    Access, AccessMode, CodecError, Connection, ErrorBody, ErrorCode, ErrorDetail, ExportHandle, Grant, ImportRequest,
    NodeId, Request, Response, RevokeRequest, Version, VersionRange,
};
use fabric_topology::{Fabric, MemoryKind};

fn gpu() -> String {
    let f = Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap();
    let d = f.inventory().devices.iter().find(|d| d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)).unwrap();
    d.id.to_string()
}

/// A client that offers only 1.0 to 1.4: what a client built before node identities speaks.
fn old_client(socket: &std::path::Path) -> Connection {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = Connection::new(s);
    let hello = c.hello("fabricd-test-1.4", VersionRange::new(Version::new(1, 0), Version::new(1, 4))).unwrap();
    assert_eq!(hello.version, Version::new(1, 4));
    c
}

fn export(c: &mut Connection, region: u64) -> ExportHandle {
    common::export(c, region, AccessMode::ReadWrite)
}

fn import(c: &mut Connection, handle: ExportHandle) -> Result<(Option<Grant>, usize), ErrorBody> {
    match c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly }), &[]) {
        Ok((Response::Import(i), fds)) => Ok((i.grant, fds.len())),
        Err(CodecError::Refused { body, .. }) => Err(body),
        other => panic!("unexpected {other:?}"),
    }
}

fn refused(c: &mut Connection, req: Request) -> ErrorBody {
    match c.call(req, &[]) {
        Err(CodecError::Refused { body, .. }) => body,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn handles_and_grants_name_this_node_and_an_older_client_gets_what_it_understood() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let node: NodeId =
        std::fs::read_to_string(setup.state.join("node-id")).unwrap().trim_end().parse().expect("a node id file");
    let gpu = gpu();

    // 1.5: the grant names this node and says the memory is a descriptor; so does the handle.
    let mut new = common::client(&setup.socket);
    let (a, _file) = common::alloc_hbm(&mut new, &gpu, 1 << 20);
    assert_eq!(a.grant, Some(Grant { owner: node, access: Access::Fd }));
    let handle = export(&mut new, a.region);
    assert_eq!(handle.node, Some(node));
    assert!(handle.to_string().starts_with(&format!("fbh2-{node}-")));
    assert_eq!(import(&mut new, handle), Ok((Some(Grant { owner: node, access: Access::Fd }), 1)));

    // 1.4: no grant, a node-less handle (fbh1), and the same memory as ever.
    let mut old = old_client(&setup.socket);
    let (b, _file) = common::alloc_hbm(&mut old, &gpu, 1 << 20);
    assert_eq!(b.grant, None);
    let old_handle = export(&mut old, b.region);
    assert_eq!(old_handle.node, None);
    assert!(old_handle.to_string().starts_with("fbh1-"));
    assert_eq!(import(&mut old, old_handle), Ok((None, 1)));
    // A 1.5 handle read by a 1.4 client (which drops the node it cannot parse) is
    // resolved as this daemon's.
    assert_eq!(import(&mut old, ExportHandle { node: None, ..handle }), Ok((None, 1)));
}

#[test]
fn a_handle_naming_another_node_or_none_is_refused_with_a_typed_error() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let mut new = common::client(&setup.socket);
    let (a, _file) = common::alloc_hbm(&mut new, &gpu(), 1 << 20);
    let handle = export(&mut new, a.region);
    let here = handle.node.unwrap();
    let there = NodeId(here.0.map(|b| b ^ 0x5a));
    let elsewhere = ExportHandle { node: Some(there), ..handle };

    // Another node's handle: WrongNode, naming it, for import and revoke alike.
    let e = import(&mut new, elsewhere).unwrap_err();
    assert_eq!(e.code, ErrorCode::WrongNode);
    assert_eq!(e.detail, Some(ErrorDetail::Node { node: there }));
    assert!(e.message.contains(&there.to_string()), "{}", e.message);
    let e = refused(&mut new, Request::Revoke(RevokeRequest { handle: elsewhere }));
    assert_eq!((e.code, e.detail), (ErrorCode::WrongNode, Some(ErrorDetail::Node { node: there })));
    // A node-less (1.4) handle from a 1.5 client: it must say whose it is.
    let e = import(&mut new, ExportHandle { node: None, ..handle }).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("fbh1"), "{}", e.message);

    // A 1.4 client cannot mean a node: a handle with one, this node's or another's, is
    // a bad request, never the WrongNode code it could not decode.
    let mut old = old_client(&setup.socket);
    for h in [handle, elsewhere] {
        let e = import(&mut old, h).unwrap_err();
        assert_eq!((e.code, e.detail), (ErrorCode::BadRequest, None), "{}", e.message);
    }
    // The export is untouched by all of it.
    assert_eq!(import(&mut new, handle).map(|(g, fds)| (g.map(|g| g.access), fds)), Ok((Some(Access::Fd), 1)));
}
