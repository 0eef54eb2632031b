//! Node identities on the real daemon (protocol 1.5): its handles and grants name the node
//! kept in its state dir; a client at 1.4 gets node-less handles and no grants, which the
//! daemon resolves as its own; a handle naming another node is refused with `WrongNode`
//! naming that node; the mixes a version cannot mean are bad requests. Since 1.8 the same
//! holds for the region a `Free`, `Export` or `Register` names.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::net::UnixStream;
use std::time::Duration;

use fabric_proto::wire::{
    Access, AccessMode, BoundedVec, CodecError, Coherence, Connection, DeviceName, ErrorBody, ErrorCode, ErrorDetail,
    ExportHandle, ExportPolicy, ExportRequest, FreeRequest, Grant, ImportRequest, NodeId, RegisterRequest,
    RegisterSource, Request, Response, RevokeRequest, StatusRequest, Version, VersionRange,
};
use fabric_topology::{Fabric, MemoryKind};

fn gpu() -> String {
    let f = Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap();
    let d = f.inventory().devices.iter().find(|d| d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)).unwrap();
    d.id.to_string()
}

/// A client that offers only 1.0 to 1.`minor`: what a client built before a version speaks.
fn client_up_to(socket: &std::path::Path, minor: u8) -> Connection {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = Connection::new(s);
    let max = Version::new(1, minor);
    let hello = c.hello(&format!("fabricd-test-1.{minor}"), VersionRange::new(Version::new(1, 0), max)).unwrap();
    assert_eq!(hello.version, max);
    c
}

/// What a client built before node identities (1.5) speaks.
fn old_client(socket: &std::path::Path) -> Connection {
    client_up_to(socket, 4)
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

    // 1.5: the grant names this node and says the memory is a descriptor; so does the
    // handle. 1.9: the grant also says this host's caches are coherent with it (this
    // node's own memory).
    let mut new = common::client(&setup.socket);
    let (a, _file) = common::alloc_hbm(&mut new, &gpu, 1 << 20);
    let coherent = Grant::new(node, Access::Fd).with_coherence(Coherence::Hardware);
    assert_eq!(a.grant, Some(coherent));
    let handle = export(&mut new, a.region);
    assert_eq!(handle.node, Some(node));
    assert!(handle.to_string().starts_with(&format!("fbh2-{node}-")));
    assert_eq!(import(&mut new, handle), Ok((Some(coherent), 1)));

    // 1.8: the 1.5 grant, without the coherence it cannot read.
    let mut before = client_up_to(&setup.socket, 8);
    let (c, _file) = common::alloc_hbm(&mut before, &gpu, 1 << 20);
    assert_eq!(c.grant, Some(Grant::new(node, Access::Fd)));
    assert_eq!(import(&mut before, handle), Ok((Some(Grant::new(node, Access::Fd)), 1)));

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

#[test]
fn a_region_named_with_another_node_is_refused_before_it_is_looked_up() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let mut new = common::client(&setup.socket);
    let gpu = gpu();
    let (a, _file) = common::alloc_hbm(&mut new, &gpu, 1 << 20);
    let here = a.grant.unwrap().owner;
    let there = NodeId(here.0.map(|b| b ^ 0x5a));
    let status = |c: &mut Connection| match c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 {
        Response::Status(s) => (s.regions, s.exports, s.registrations),
        other => panic!("{other:?}"),
    };

    // Region a's id, said to be another node's: refused naming that node, whatever the
    // request, and region a is untouched (a region of the same number elsewhere is not
    // this daemon's to free).
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadOnly,
    };
    let register = |node| {
        Request::Register(RegisterRequest {
            device: DeviceName::truncated(&gpu),
            source: RegisterSource::Region(a.region),
            offset: 0,
            len: 4096,
            access: AccessMode::ReadOnly,
            node,
        })
    };
    for req in [
        Request::Free(FreeRequest { region: a.region, node: Some(there) }),
        Request::Export(ExportRequest { region: a.region, policy: policy.clone(), node: Some(there) }),
        register(Some(there)),
    ] {
        let e = refused(&mut new, req);
        assert_eq!((e.code, e.detail), (ErrorCode::WrongNode, Some(ErrorDetail::Node { node: there })));
        assert!(e.message.contains(&there.to_string()) && e.message.contains(&here.to_string()), "{}", e.message);
    }
    assert_eq!(status(&mut new), (1, 0, 0));

    // Named as this node's, or bare (what every older client sends): served.
    let Response::Export(e) =
        new.call(Request::Export(ExportRequest { region: a.region, policy, node: Some(here) }), &[]).unwrap().0
    else {
        panic!()
    };
    assert_eq!(e.handle.node, Some(here));
    let Response::Register(_) = new.call(register(Some(here)), &[]).unwrap().0 else { panic!() };
    assert_eq!(status(&mut new), (1, 1, 1));
    let (b, _file) = common::alloc_hbm(&mut new, &gpu, 1 << 20);
    assert_eq!(new.call(Request::Free(FreeRequest { region: b.region, node: None }), &[]).unwrap().0, Response::Free);

    // A 1.7 client cannot mean a node for a region: one is a bad request, even this node's.
    let mut old = client_up_to(&setup.socket, 7);
    let (c, _file) = common::alloc_hbm(&mut old, &gpu, 1 << 20);
    let e = refused(&mut old, Request::Free(FreeRequest { region: c.region, node: Some(here) }));
    assert_eq!((e.code, e.detail), (ErrorCode::BadRequest, None), "{}", e.message);
    assert_eq!(old.call(Request::Free(FreeRequest { region: c.region, node: None }), &[]).unwrap().0, Response::Free);

    assert_eq!(
        new.call(Request::Free(FreeRequest { region: a.region, node: Some(here) }), &[]).unwrap().0,
        Response::Free
    );
    assert_eq!(status(&mut new), (0, 0, 0));
}
