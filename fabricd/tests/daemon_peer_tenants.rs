//! The policy across hosts with the domain's tenants (`docs/domain.md`, "Import across
//! nodes"): two real fabricd nodes on the shared sim fabric, a private etcd and node-link
//! certificates, identities **not** shared across the domain. The admin defines two
//! partitions of the domain in etcd — `tenant` (a GPU of each tray, for one uid) and
//! `other` (another GPU of tray1, for another uid). tray0 exports one region to partition
//! `tenant` and one with the default policy (the exporter's uid). On tray1, a client bound
//! to `tenant` imports the first; a client bound to `other` and the unbound admin are
//! refused it; nobody on tray1 gets the second, since a uid means nothing on another host.
//! A copy from the import into the tenant client's own region on tray1 is authorized as a
//! copy on the node: refused once the admin takes that region's GPU out of `tenant`.
//!
//! Needs root (clients run under other uids); without an `etcd` binary it says it is
//! skipped.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use common::domain::{gpu_of, partitions, socket_group, topology, until};
use common::peer::*;
use common::scrape::{free_port, scrape, value};
use fabric_proto::wire::{
    AccessMode, BoundedVec, CodecError, CopyEndpoint, ExportHandle, ExportPolicy, ExportRequest, ImportRequest, Name,
    PartitionSpec, PartitionsRequest, Request, Response,
};

/// Bound to partition `tenant`, and to `other`.
const UID_TENANT: u32 = 61201;
const UID_OTHER: u32 = 61202;
/// The group the nodes' sockets admit (so that those uids may connect).
const SOCKET_GID: u32 = 61200;
const ENV_SOCKET: &str = "FABRICD_TENANT_IMPORT_SOCKET";
const ENV_HANDLE: &str = "FABRICD_TENANT_IMPORT_HANDLE";

/// Imports the handle in [`ENV_HANDLE`] on the socket in [`ENV_SOCKET`] and prints
/// `answer: ok` or the refusal's code. Run by the test below under another uid; does
/// nothing otherwise.
#[test]
fn tenant_import_child() {
    let Some(sock) = std::env::var_os(ENV_SOCKET) else { return };
    let handle: ExportHandle = std::env::var(ENV_HANDLE).unwrap().parse().unwrap();
    let mut c = common::client(std::path::Path::new(&sock));
    println!("answer: {}", outcome(&mut c, handle));
}

const ENV_COPY_GPU: &str = "FABRICD_TENANT_COPY_GPU";

/// Imports the handle in [`ENV_HANDLE`] (read-write) on the socket in [`ENV_SOCKET`],
/// allocates 1 MiB on the GPU in [`ENV_COPY_GPU`], and copies from the import into it:
/// prints `first: ` and the outcome, then `ready`, waits for a line on stdin (the
/// partitions changed meanwhile), copies again and prints `answer: ` and the outcome. Run
/// by the test below under another uid; does nothing otherwise.
#[test]
fn tenant_copy_child() {
    let Some(gpu) = std::env::var_os(ENV_COPY_GPU) else { return };
    let sock = std::env::var_os(ENV_SOCKET).unwrap();
    let handle: ExportHandle = std::env::var(ENV_HANDLE).unwrap().parse().unwrap();
    let mut c = common::client(std::path::Path::new(&sock));
    let Ok((Response::Import(i), _)) =
        c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadWrite }), &[])
    else {
        panic!("the import")
    };
    let (own, _file) = common::alloc_hbm(&mut c, gpu.to_str().unwrap(), 1 << 20);
    let (from, into) = (CopyEndpoint::Gfa(i.gfa.unwrap()), CopyEndpoint::Gfa(own.gfa.unwrap()));
    let copy = |c: &mut fabric_proto::wire::Connection| match start_copy(c, into, from, 4096) {
        Ok(id) => format!("{:?}", copy_done(c, id).result),
        Err(body) => format!("{:?}: {}", body.code, body.message),
    };
    println!("first: {}", copy(&mut c));
    println!("ready");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    println!("answer: {}", copy(&mut c));
}

fn outcome(c: &mut fabric_proto::wire::Connection, handle: ExportHandle) -> String {
    match c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly }), &[]) {
        // What the grant hands over: `Fd` for a file of the shared fabric.
        Ok((Response::Import(i), _)) => format!("ok {:?}", i.grant.map(|g| g.access)),
        Ok((other, _)) => format!("{other:?}"),
        Err(CodecError::Refused { body, .. }) => format!("{:?}: {}", body.code, body.message),
        Err(e) => format!("{e:?}"),
    }
}

/// What a client of uid `uid` on `socket` gets importing `handle`.
fn import_as(uid: u32, socket: &std::path::Path, handle: ExportHandle) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "tenant_import_child", "--nocapture", "--test-threads", "1"])
        .env(ENV_SOCKET, socket)
        .env(ENV_HANDLE, handle.to_string())
        .uid(uid)
        .gid(SOCKET_GID)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    text.lines().find_map(|l| l.split_once("answer: ").map(|(_, a)| a.to_owned())).expect(&text)
}

fn partition(name: &str, devices: &[&str], uid: u32) -> PartitionSpec {
    PartitionSpec {
        name: Name::truncated(name),
        devices: devices.iter().map(|d| (*d).try_into().unwrap()).collect::<Vec<_>>().try_into().unwrap(),
        uids: vec![uid].try_into().unwrap(),
        gids: Vec::new().try_into().unwrap(),
    }
}

#[test]
fn only_a_client_bound_to_the_exports_partition_imports_it_from_another_node() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root to run clients under uids {UID_TENANT} and {UID_OTHER}");
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    // The shared sim fabric, and no shared identities (the default).
    let fabric = format!("shared_dir = {:?}\n", shared.path().join("sim"));
    let setups: Vec<_> =
        ["tray0", "tray1"].iter().map(|n| node_with(&etcd, &pki, n, n, free_port(), &fabric)).collect();
    for s in &setups {
        socket_group(&s.config, SOCKET_GID);
    }
    // tray0's metrics page, for how often it merges the domain's topology.
    let metrics = free_port();
    let text = std::fs::read_to_string(&setups[0].config).unwrap();
    std::fs::write(&setups[0].config, text.replace("listen = \"\"", &format!("listen = \"127.0.0.1:{metrics}\"")))
        .unwrap();
    let merges = || value(&scrape(metrics), "fabricd_domain_topology_merges_total").unwrap();
    let _daemons: Vec<_> = setups.iter().map(|s| common::start(&s.config, s.dir.path())).collect();
    let mut admin: Vec<_> = setups.iter().map(|s| common::client(&s.socket)).collect();
    for c in &mut admin {
        for n in ["tray0", "tray1"] {
            until(Duration::from_secs(15), "every node lists every other live", || incarnation_of(c, n).is_some());
        }
        until(Duration::from_secs(15), "both topologies merged", || {
            topology(c)["nodes"] == serde_json::json!(["tray0", "tray1"])
        });
    }
    // The domain's tenants: a GPU of each tray for `tenant`, another GPU of tray1 for `other`.
    let doc = topology(&mut admin[0]);
    let merged = merges();
    assert!(merged >= 1.0, "{merged}");
    let (gpu0, gpu1) = (gpu_of(&doc, "tray0"), gpu_of(&doc, "tray1"));
    let gpu1b = doc["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["kind"] == "gpu" && d["node"] == "tray1")
        .map(|d| d["id"].as_str().unwrap().to_owned())
        .find(|id| *id != gpu1)
        .unwrap();
    for spec in [partition("tenant", &[&gpu0, &gpu1], UID_TENANT), partition("other", &[&gpu1b], UID_OTHER)] {
        let set = admin[0].call(Request::Partitions(PartitionsRequest::Set(spec)), &[]).unwrap().0;
        assert!(matches!(set, Response::Partitions(_)), "{set:?}");
    }
    until(Duration::from_secs(5), "tray1 sees both partitions", || partitions(&mut admin[1]) == 2);
    // Partition records are no part of the topology: tray0 answers from the fabric it merged
    // before they were written.
    until(Duration::from_secs(5), "tray0 sees both partitions", || partitions(&mut admin[0]) == 2);
    assert_eq!(topology(&mut admin[0])["nodes"], serde_json::json!(["tray0", "tray1"]));
    assert_eq!(merges(), merged, "no merge for the partitions' records");
    // tray1's topology record written again (as a rescan or a rejoin writes it): the
    // domain's topology is out of date on tray0, yet the imports below, whose scale-up
    // check reads tray1's topology, merge only the two nodes' records, never the domain.
    rt.block_on(async {
        let key = fabric_domain::Keys::new(DOMAIN).topology("tray1");
        let mut client = fabric_domain::etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
        let value = client.get(key.clone(), None).await.unwrap().kvs()[0].value().to_vec();
        client.put(key, value, None).await.unwrap();
    });
    // Long enough for tray0's watch to see the write (loopback: milliseconds).
    std::thread::sleep(Duration::from_secs(1));

    // tray0 exports a region of its tenant GPU to `tenant`, and one with the default policy.
    let (a, _file) = common::alloc_hbm(&mut admin[0], &gpu0, 1 << 20);
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: Some(Name::truncated("tenant")),
        access: AccessMode::ReadWrite,
    };
    let Response::Export(e) =
        admin[0].call(Request::Export(ExportRequest { region: a.region, policy, node: None }), &[]).unwrap().0
    else {
        panic!()
    };
    let to_tenant = e.handle;
    let (b, _file) = common::alloc_hbm(&mut admin[0], &gpu0, 1 << 20);
    let by_uid = common::export(&mut admin[0], b.region, AccessMode::ReadWrite);

    let on_tray1 = &setups[1].socket;
    // A client of tray1 bound to the export's partition maps the shared file: tray0 found
    // tray1 in its GPU's scale-up domain.
    let tenant = import_as(UID_TENANT, on_tray1, to_tenant);
    assert_eq!(tenant, "ok Some(Fd)", "a client of tray1 bound to the export's partition");
    let other = import_as(UID_OTHER, on_tray1, to_tenant);
    assert!(other.starts_with("PermissionDenied: node tray0:") && other.contains("\"tenant\""), "{other}");
    let unbound = outcome(&mut admin[1], to_tenant);
    assert!(unbound.starts_with("PermissionDenied") && unbound.contains("not bound"), "the unbound admin: {unbound}");
    for uid in [UID_TENANT, UID_OTHER] {
        let got = import_as(uid, on_tray1, by_uid);
        assert!(got.starts_with("PermissionDenied") && got.contains("identities are not shared"), "{got}");
    }
    let root = outcome(&mut admin[1], by_uid);
    assert!(root.starts_with("PermissionDenied") && root.contains("identities are not shared"), "{root}");
    assert_eq!(merges(), merged, "imports checked against the two nodes' records, not a merge of the domain");

    // A copy across nodes is authorized as a copy on the node is: a tenant client copies
    // from its import into its own region on gpu1; once the admin takes gpu1 out of
    // `tenant`, that region lies outside the client's partitions and the copy is refused.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "tenant_copy_child", "--nocapture", "--test-threads", "1"])
        .env(ENV_SOCKET, on_tray1)
        .env(ENV_HANDLE, to_tenant.to_string())
        .env(ENV_COPY_GPU, &gpu1)
        .uid(UID_TENANT)
        .gid(SOCKET_GID)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let mut said = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        said.push_str(&line);
        said.push('\n');
        if line == "ready" {
            break;
        }
    }
    assert!(said.contains("first: Ok"), "the copy while gpu1 is the tenant's: {said}");
    let set =
        admin[0].call(Request::Partitions(PartitionsRequest::Set(partition("tenant", &[&gpu0], UID_TENANT))), &[]);
    assert!(matches!(set, Ok((Response::Partitions(_), _))), "{set:?}");
    until(Duration::from_secs(5), "tray1 sees gpu1 out of `tenant`", || {
        let Ok((Response::Partitions(p), _)) = admin[1].call(Request::Partitions(PartitionsRequest::List), &[]) else {
            return false;
        };
        p.partitions.iter().any(|x| x.name.as_str() == "tenant" && x.devices.len() == 1)
    });
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), b"go\n").unwrap();
    // Read to the end: the child's harness still writes after the answer.
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    assert!(child.wait().unwrap().success(), "{said}{rest:?}");
    let answer = rest.iter().find_map(|l| l.strip_prefix("answer: ")).unwrap();
    assert!(
        answer.starts_with("PermissionDenied") && answer.contains("outside the caller's partitions"),
        "a copy across nodes into a region outside the caller's partitions: {answer}"
    );
}
