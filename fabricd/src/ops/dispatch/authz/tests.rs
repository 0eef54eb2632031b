//! The authorization table, every operation against every kind of caller, with no daemon.

use std::collections::HashSet;
use std::sync::Arc;

use fabric_proto::wire::{
    AccessMode, BoundedVec, CopyEndpoint, CopyRequest, ErrorCode, ExportHandle, ExportPolicy, Name, ObjectKind,
    PeerCred, Secret, Topics,
};
use fabric_topology::{DeviceId, MemoryKind};

use super::*;
use crate::memory::Place;
use crate::ops::dispatch::operation::{PartitionChange, RegisterFrom};
use crate::ops::principal::Client;
use crate::transport::peer::Peer;

fn dev(n: u8) -> DeviceId {
    format!("uuid:GPU-{n}").parse().unwrap()
}

fn handle(region: u64) -> ExportHandle {
    ExportHandle { node: None, region, generation: 1, secret: Secret([region as u8; 16]) }
}

fn policy(partition: Option<&str>) -> ExportPolicy {
    ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: partition.map(Name::truncated),
        access: AccessMode::ReadWrite,
    }
}

/// Partition `a` holds GPU-0, `b` holds GPU-1; set `both` stripes over the two, `zero`
/// lies on GPU-0. Export 1 is for partition `a` (its region on GPU-1), export 2 for
/// no partition (on GPU-0), export 3 was revoked.
struct Fake;

impl Facts for Fake {
    fn partition_exists(&self, name: &str) -> bool {
        name == "a" || name == "b"
    }

    fn members(&self, names: &[String]) -> HashSet<DeviceId> {
        names
            .iter()
            .filter_map(|n| match n.as_str() {
                "a" => Some(dev(0)),
                "b" => Some(dev(1)),
                _ => None,
            })
            .collect()
    }

    fn set_devices(&self, name: &str) -> Option<Vec<DeviceId>> {
        match name {
            "both" => Some(vec![dev(0), dev(1)]),
            "zero" => Some(vec![dev(0)]),
            _ => None,
        }
    }

    fn export_subject(&self, h: &ExportHandle) -> Option<ExportSubject> {
        let (policy, devices, revoked) = match h.region {
            1 => (policy(Some("a")), vec![dev(1)], false),
            2 => (policy(None), vec![dev(0)], false),
            3 => (policy(Some("b")), vec![dev(1)], true),
            // A region of the interleave set over both devices.
            4 => (policy(None), vec![dev(0), dev(1)], false),
            _ => return None,
        };
        Some(ExportSubject { policy, devices, revoked, object: None })
    }

    fn admin_group(&self) -> Option<&str> {
        None
    }

    fn is_this_node(&self, node: fabric_proto::wire::NodeId) -> bool {
        node == HERE
    }
}

const HERE: fabric_proto::wire::NodeId = fabric_proto::wire::NodeId([1; 8]);

/// Export `region`'s handle as another node's: that node's to judge.
fn elsewhere(region: u64) -> ExportHandle {
    ExportHandle { node: Some(fabric_proto::wire::NodeId([2; 8])), ..handle(region) }
}

/// The kinds of caller: their scope is what the bindings resolve to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Root.
    Admin,
    /// Bound to partition `a`.
    BoundA,
    /// Bound to partition `b`.
    BoundB,
    /// Bound to nothing, partitions not required.
    Open,
    /// Bound to nothing while `security.require_partition` is set.
    Unbound,
}

const KINDS: [Kind; 5] = [Kind::Admin, Kind::BoundA, Kind::BoundB, Kind::Open, Kind::Unbound];

fn caller(kind: Kind) -> Caller {
    let uid = if kind == Kind::Admin { 0 } else { 1000 };
    let peer = Peer::new(PeerCred { pid: 1, uid, gid: uid }, Vec::new(), None);
    let client = Arc::new(Client::accept(&peer, None));
    let scope = match kind {
        Kind::Admin | Kind::Open => Scope::All,
        Kind::BoundA => Scope::Bound(vec!["a".into()]),
        Kind::BoundB => Scope::Bound(vec!["b".into()]),
        Kind::Unbound => Scope::Unbound,
    };
    let map = fabric_addrmap::AddressMap::new(fabric_addrmap::MapConfig::default()).unwrap().snapshot();
    Caller {
        client,
        scope,
        map: Arc::new(crate::store::MapView { map, bindings: Arc::new(Vec::new()) }),
        domain_partitions: Vec::new(),
    }
}

fn place(n: u8) -> Place {
    Place { device: dev(n), kind: MemoryKind::Hbm, ordinal: None }
}

fn copy() -> CopyRequest {
    CopyRequest { dst: CopyEndpoint::Gfa(0), src: CopyEndpoint::Gfa(4096), len: 4096 }
}

const OK: Option<ErrorCode> = None;
const DENIED: Option<ErrorCode> = Some(ErrorCode::PermissionDenied);
const ADMIN: Option<ErrorCode> = Some(ErrorCode::AdminRequired);
const NOT_FOUND: Option<ErrorCode> = Some(ErrorCode::NotFound);

/// One row: an operation and what each kind gets, in [`KINDS`] order.
fn rows() -> Vec<(Operation, [Option<ErrorCode>; 5])> {
    use Operation as O;
    let anyone = [OK; 5];
    let scoped = [OK, OK, OK, OK, DENIED];
    let admins = [OK, ADMIN, ADMIN, ADMIN, ADMIN];
    let on_a = [OK, OK, DENIED, OK, DENIED];
    let change = PartitionChange { name: "c".into(), devices: vec![dev(0)], uids: vec![1000], gids: Vec::new() };
    vec![
        (O::Status, anyone),
        (O::ListPartitions, anyone),
        (O::Subscribe { topics: Topics::NONE }, anyone),
        (O::Regions { all: false }, anyone),
        (O::Free { region: 1 }, anyone),
        (O::Revoke { handle: handle(1) }, anyone),
        (O::Release { import: 1 }, anyone),
        (O::Unregister { registration: 1 }, anyone),
        (O::Topology { node: None }, scoped),
        (O::Devices { node: None }, scoped),
        (O::Inventory { node: None }, scoped),
        (O::Map { node: None }, scoped),
        (O::Translate { queries: Vec::new() }, scoped),
        (O::Copy { copies: vec![copy()], batch: false }, scoped),
        (O::Copy { copies: vec![copy(), copy()], batch: true }, scoped),
        (O::Regions { all: true }, admins),
        (O::SetPartition(change), admins),
        (O::RemovePartition { name: "a".into() }, admins),
        (O::Domain { action: fabric_proto::wire::DomainAction::Status }, scoped),
        (O::Domain { action: fabric_proto::wire::DomainAction::Nodes }, scoped),
        (
            O::Domain {
                action: fabric_proto::wire::DomainAction::Gc { node: fabric_proto::wire::Name::truncated("tray1") },
            },
            admins,
        ),
        (O::Alloc { target: Target::Place(place(0)), size: 1, align: 0 }, on_a),
        (O::Alloc { target: Target::Set("zero".into()), size: 1, align: 0 }, on_a),
        (O::Alloc { target: Target::Set("both".into()), size: 1, align: 0 }, [OK, DENIED, DENIED, OK, DENIED]),
        // A set the map lacks is the allocation's NotFound, not a refusal here.
        (O::Alloc { target: Target::Set("gone".into()), size: 1, align: 0 }, scoped),
        (O::Adopt { place: place(0), size: 1, object: ObjectKind::CudaPosixFd, fd: None }, on_a),
        (
            O::Register {
                device: dev(0),
                from: RegisterFrom::Region(1),
                offset: 0,
                len: 1,
                access: AccessMode::ReadWrite,
            },
            on_a,
        ),
        (O::Export { region: 1, policy: policy(None) }, anyone),
        (O::Export { region: 1, policy: policy(Some("a")) }, [OK, OK, DENIED, DENIED, DENIED]),
        (O::Export { region: 1, policy: policy(Some("nowhere")) }, [NOT_FOUND; 5]),
        // Export 1 is for partition a (whatever device its region lies on).
        (O::Import { handle: handle(1), access: AccessMode::ReadOnly }, [OK, OK, DENIED, DENIED, DENIED]),
        (O::ImportObject { handle: handle(1), access: AccessMode::ReadOnly }, [OK, OK, DENIED, DENIED, DENIED]),
        // Export 2 names no partition: its region's device decides.
        (O::Import { handle: handle(2), access: AccessMode::ReadOnly }, on_a),
        // Export 4 names no partition and its region is striped over both devices: a
        // client bound to either alone reaches only half of it. Before, the set's first
        // member alone was checked, and a client bound to `a` imported it.
        (O::Import { handle: handle(4), access: AccessMode::ReadOnly }, [OK, DENIED, DENIED, OK, DENIED]),
        // Revoked or unknown: the registry refuses it (Revoked, InvalidHandle).
        (O::Import { handle: handle(3), access: AccessMode::ReadOnly }, scoped),
        (O::Import { handle: handle(9), access: AccessMode::ReadOnly }, scoped),
        // Another node's export (whatever an export of this node with its number says): a
        // scope here, the rest is its owner's (it gets the caller's partitions).
        (O::Import { handle: elsewhere(1), access: AccessMode::ReadOnly }, scoped),
        (O::ImportObject { handle: elsewhere(1), access: AccessMode::ReadOnly }, scoped),
        (
            O::Import { handle: ExportHandle { node: Some(HERE), ..handle(1) }, access: AccessMode::ReadOnly },
            [OK, OK, DENIED, DENIED, DENIED],
        ),
    ]
}

#[test]
fn every_operation_against_every_kind_of_caller() {
    let mut failures = Vec::new();
    for (op, expected) in rows() {
        for (kind, want) in KINDS.iter().zip(expected) {
            let got = authorize(&op, &caller(*kind), &Fake).err().map(|e| e.code);
            if got != want {
                failures.push(format!("{} by {kind:?}: got {got:?}, want {want:?}", op.name()));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_operation_kind_is_in_the_table() {
    // A new operation without a row fails here: `name` lists every variant.
    let named: HashSet<&str> = rows().iter().map(|(op, _)| op.name()).collect();
    for name in [
        "status",
        "topology",
        "devices",
        "inventory",
        "map",
        "translate",
        "partitions",
        "regions",
        "alloc",
        "adopt",
        "free",
        "export",
        "revoke",
        "import",
        "import_object",
        "release",
        "register",
        "unregister",
        "copy",
        "copy_batch",
        "subscribe",
    ] {
        assert!(named.contains(name), "no row for {name} (names: {named:?})");
    }
}

#[test]
fn a_copy_grant_carries_the_callers_devices_for_its_endpoints() {
    let op = Operation::Copy { copies: vec![copy()], batch: true };
    let g = authorize(&op, &caller(Kind::BoundB), &Fake).unwrap();
    assert_eq!(g.members, Some([dev(1)].into_iter().collect()));
    assert_eq!(authorize(&op, &caller(Kind::Admin), &Fake).unwrap().members, None);
}

#[test]
fn refusals_name_the_uid_and_the_partitions() {
    let op = Operation::Alloc { target: Target::Place(place(1)), size: 1, align: 0 };
    let e = authorize(&op, &caller(Kind::BoundA), &Fake).unwrap_err();
    assert!(e.message.contains("GPU-1") && e.message.contains("(a)"), "{}", e.message);
    let e = authorize(&Operation::Regions { all: true }, &caller(Kind::Open), &Fake).unwrap_err();
    assert!(e.message.contains("uid 1000"), "{}", e.message);
}

/// Another node asking for its client, bound there to `claims`, in a domain that does or
/// does not share identities.
fn node(claims: &[&str], shared_identities: bool) -> Caller {
    let node = crate::ops::principal::PeerNode {
        node: "tray1".into(),
        incarnation: 2,
        claims: claims.iter().map(|c| (*c).to_owned()).collect(),
        uid: 0,
        gid: 0,
        shared_identities,
    };
    Caller { client: Arc::new(Client::node(node)), scope: Scope::All, ..caller(Kind::Open) }
}

#[test]
fn another_node_imports_by_its_claims_and_asks_nothing_else() {
    use Operation as O;
    let import = |region| O::Import { handle: handle(region), access: AccessMode::ReadOnly };
    let code = |op: &Operation, c: &Caller| authorize(op, c, &Fake).err().map(|e| e.code);
    let (in_a, in_b, none) = (node(&["a"], false), node(&["b"], false), node(&[], false));
    // Export 1 is for partition a: a node whose client is bound to a there.
    assert_eq!(code(&import(1), &in_a), OK);
    assert_eq!(code(&O::ImportObject { handle: handle(1), access: AccessMode::ReadOnly }, &in_a), OK);
    assert_eq!(code(&import(1), &in_b), DENIED);
    assert_eq!(code(&import(1), &none), DENIED);
    // Export 2 names no partition: only where identities are shared (then its uids).
    assert_eq!(code(&import(2), &in_a), DENIED);
    assert_eq!(code(&import(2), &node(&[], true)), OK);
    // Revoked or unknown: the registry's to refuse.
    assert_eq!(code(&import(3), &in_b), OK);
    assert_eq!(code(&import(9), &none), OK);
    assert_eq!(code(&O::Release { import: 1 }, &none), OK);
    // Nothing else, not even with uid 0 claimed where identities are shared.
    let root_elsewhere = node(&["a"], true);
    for op in rows().into_iter().map(|(op, _)| op) {
        if matches!(op, O::Import { .. } | O::ImportObject { .. } | O::Release { .. }) {
            continue;
        }
        assert_eq!(code(&op, &root_elsewhere), DENIED, "{}", op.name());
    }
}
