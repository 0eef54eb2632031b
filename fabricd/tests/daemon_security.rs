//! Security of a real daemon against real clients under unprivileged uids: the socket's
//! mode and group, partition bindings by uid and by supplementary group, what a bound
//! client sees and touches, export handles (forged, stale, revoked, replayed, policies that
//! name someone else or a partition), admin-only changes, and `security.require_partition`
//! after a restart on the same state; every operation that names another session's region,
//! import or registration by id (free, export, register, release, unregister, revoke, copy)
//! refused with the object unharmed; handles of freed regions dead, across a restart too;
//! `limits.clients_per_uid`: one uid's idle connections cannot take every client slot.
//!
//! It needs root (to run clients under other uids); CI runs it as root. As anyone else it
//! prints why it skipped. Each client is this test binary re-run (`--ignored --exact
//! security_child`) under its uid, gid and groups: it reads one command a line on stdin and
//! answers one line on stdout. Only numeric ids are used: nothing is created in /etc.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr, reason = "a test and its child process")]

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, CodecError, Connection, CopyEndpoint, CopyRequest, DeviceName,
    Event, ExportHandle, ExportPolicy, ExportRequest, FreeRequest, ImportRequest, MemoryClass, Name, PartitionSpec,
    PartitionsRequest, RegionsRequest, RegisterRequest, RegisterSource, ReleaseRequest, Request, ResourceName,
    Response, RevokeRequest, SubscribeRequest, Topics, TopologyRequest, TranslateQuery, TranslateRequest, Translation,
    UnregisterRequest,
};
use fabric_topology::Fabric;

const ENV_SOCKET: &str = "FABRICD_SECURITY_SOCKET";

const SOCKET_GID: u32 = 61100;
const ADMIN_GID: u32 = 61150;
const TENANT_A_GID: u32 = 61300;
/// Bound to tenant-a by uid.
const UID_A: u32 = 61001;
/// Bound to tenant-b by uid.
const UID_B: u32 = 61002;
/// Bound to nothing.
const UID_C: u32 = 61003;
/// Member of the admin group (a supplementary group).
const UID_ADMIN: u32 = 61004;
/// Bound to tenant-a through a supplementary group.
const UID_D: u32 = 61005;

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn gpus() -> Vec<String> {
    let f = Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap();
    f.inventory().devices.iter().filter(|d| d.gpu.is_some()).map(|d| d.id.to_string()).collect()
}

/// One client process under its own credentials.
struct Client {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    /// Runs this test binary's `security_child` as `uid`, primary gid `SOCKET_GID` and the
    /// supplementary `groups`.
    fn spawn(name: &'static str, socket: &std::path::Path, uid: u32, groups: &[u32]) -> Self {
        Self::spawn_child(name, "security_child", socket, uid, groups)
    }

    /// [`Client::spawn`] running the child test `child`.
    fn spawn_child(name: &'static str, child: &str, socket: &std::path::Path, uid: u32, groups: &[u32]) -> Self {
        let mut cmd = common::child_as(child, ENV_SOCKET, socket, uid, SOCKET_GID, groups);
        cmd.stdin(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut c = Self { name, child, stdin, stdout };
        assert_eq!(c.ask("whoami"), format!("ok uid={uid}"), "{name} runs under its uid");
        c
    }

    /// Sends one command and returns the child's one-line answer.
    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "{} exited while answering {cmd:?}", self.name);
            // libtest prints its own text, even on the answer's line ("test x ... answer: ").
            if let Some((_, a)) = line.split_once("answer: ") {
                let a = a.trim_end().to_owned();
                println!("{} ({cmd}) -> {a}", self.name);
                return a;
            }
        }
    }

    /// The value of `key=` in an `ok` answer.
    fn ok(&mut self, cmd: &str, key: &str) -> String {
        let a = self.ask(cmd);
        assert!(a.starts_with("ok"), "{}: {cmd} -> {a}", self.name);
        a.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")).map(str::to_owned))
            .unwrap_or_else(|| panic!("{}: {cmd} -> {a} has no {key}=", self.name))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

fn admin_call(c: &mut Connection, req: Request) -> Response {
    c.call(req, &[]).unwrap().0
}

fn spec(name: &str, devices: &[&str], uids: &[u32], gids: &[u32]) -> PartitionSpec {
    PartitionSpec {
        name: Name::truncated(name),
        devices: devices.iter().map(|d| (*d).try_into().unwrap()).collect::<Vec<_>>().try_into().unwrap(),
        uids: uids.to_vec().try_into().unwrap(),
        gids: gids.to_vec().try_into().unwrap(),
    }
}

/// A daemon whose socket belongs to `SOCKET_GID` and whose admins are `ADMIN_GID`'s
/// members; `None` (with a message) when not root.
fn secured() -> Option<(common::Setup, common::Daemon)> {
    if !is_root() {
        eprintln!("skipped: needs root to run clients under uids {UID_A}..{UID_D} (CI runs it as root)");
        return None;
    }
    let s = common::Setup::new(&format!("group = \"{SOCKET_GID}\"\nadmin_group = \"{ADMIN_GID}\""));
    let d = common::start(&s.config, s.dir.path());
    Some((s, d))
}

/// Root (an admin) carves two partitions: tenant-a of GPUs 0 and 1, bound by uid A and the
/// group D has; tenant-b of GPUs 2 and 3, bound by uid B.
fn two_tenants(root: &mut Connection, g: &[String]) {
    admin_call(
        root,
        Request::Partitions(PartitionsRequest::Set(spec("tenant-a", &[&g[0], &g[1]], &[UID_A], &[TENANT_A_GID]))),
    );
    admin_call(root, Request::Partitions(PartitionsRequest::Set(spec("tenant-b", &[&g[2], &g[3]], &[UID_B], &[]))));
}

fn forged(h: &str) -> String {
    let mut h: ExportHandle = h.parse().unwrap();
    h.secret.0[7] ^= 1;
    h.to_string()
}

fn stale(h: &str) -> String {
    let mut h: ExportHandle = h.parse().unwrap();
    h.generation += 1;
    h.to_string()
}

#[test]
fn partitions_handles_and_admin_rights_hold_against_other_uids() {
    let Some((s, d)) = secured() else { return };
    let g = gpus();
    assert!(g.len() >= 5);

    // The socket: 0660, owned by the configured group.
    let meta = std::fs::metadata(&s.socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), SOCKET_GID);

    let mut root = common::client(&s.socket);
    two_tenants(&mut root, &g);

    let mut a = Client::spawn("A", &s.socket, UID_A, &[]);
    let mut b = Client::spawn("B", &s.socket, UID_B, &[]);
    let mut c = Client::spawn("C", &s.socket, UID_C, &[]);
    let mut dd = Client::spawn("D", &s.socket, UID_D, &[TENANT_A_GID]);
    let mut adm = Client::spawn("admin-member", &s.socket, UID_ADMIN, &[ADMIN_GID]);

    // Non-admins cannot change partitions; a member of the admin group can.
    assert_eq!(a.ask(&format!("pset evil {}", g[2])), "err AdminRequired");
    assert_eq!(a.ask("prm tenant-b"), "err AdminRequired");
    assert_eq!(c.ask("prm tenant-a"), "err AdminRequired");
    assert_eq!(adm.ask(&format!("pset shared {}", g[4])), "ok");
    assert_eq!(adm.ask("prm shared"), "ok");
    let log = d.log();
    assert!(log.contains(&format!("uid={UID_A}")) && log.contains("AdminRequired"), "refusals are logged: {log}");

    // Listing: a bound client sees its own partitions only; an unbound one none; admins all.
    assert_eq!(a.ok("plist", "names"), "tenant-a");
    assert_eq!(dd.ok("plist", "names"), "tenant-a", "bound through a supplementary group");
    assert_eq!(b.ok("plist", "names"), "tenant-b");
    assert_eq!(c.ok("plist", "names"), "");
    assert_eq!(adm.ok("plist", "names"), "tenant-a,tenant-b");

    // Devices, topology and map: A sees its GPUs and not B's; C (unbound) sees everything.
    let seen_a = a.ok("devices", "gpus");
    assert_eq!(seen_a, format!("{},{}", g[0], g[1]));
    assert_eq!(dd.ok("devices", "gpus"), seen_a);
    assert_eq!(b.ok("devices", "gpus"), format!("{},{}", g[2], g[3]));
    assert_eq!(c.ok("devices", "gpus").split(',').count(), g.len());
    assert_eq!(a.ok("topology", "gpus"), seen_a);
    let map_a = a.ok("map", "owners");
    assert!(map_a.contains(&g[0]) && map_a.contains(&g[1]) && !map_a.contains(&g[2]), "{map_a}");

    // Translation: A resolves its own memory and gets NotInPartition for B's.
    let gfa_b = b.ok(&format!("reverse {}", g[2]), "gfa");
    let gfa_a = a.ok(&format!("reverse {}", g[0]), "gfa");
    assert_eq!(a.ask(&format!("reverse {}", g[2])), "notinpartition");
    assert_eq!(a.ask(&format!("gfa {gfa_b}")), "notinpartition");
    assert_eq!(a.ok(&format!("gfa {gfa_a}"), "device"), g[0]);
    assert_eq!(c.ok(&format!("gfa {gfa_b}"), "device"), g[2], "an unbound client sees the whole map");

    // Alloc: only on the partition's devices.
    assert_eq!(a.ask(&format!("alloc {}", g[2])), "err PermissionDenied");
    let region = a.ok(&format!("alloc {}", g[0]), "region");
    let region_b = b.ok(&format!("alloc {}", g[2]), "region");

    // Handles. Owner-only policy: no other uid imports, even in the same partition.
    let h_owner = a.ok(&format!("export {region} - -"), "handle");
    assert_eq!(dd.ask(&format!("import {h_owner}")), "err PermissionDenied");
    assert_eq!(c.ask(&format!("import {h_owner}")), "err PermissionDenied");
    // A policy naming D: D imports; a forged secret or a stale generation does not.
    let h_d = a.ok(&format!("export {region} {UID_D} -"), "handle");
    assert!(dd.ask(&format!("import {h_d}")).starts_with("ok"));
    assert_eq!(dd.ask(&format!("import {}", forged(&h_d))), "err InvalidHandle");
    assert_eq!(dd.ask(&format!("import {}", stale(&h_d))), "err InvalidHandle");
    assert_eq!(c.ask(&format!("import {}", forged(&h_d))), "err InvalidHandle");
    // A policy naming other uids admits nobody else.
    assert_eq!(c.ask(&format!("import {h_d}")), "err PermissionDenied");
    // A policy naming B's uid still does not reach across partitions: the region is on A's device.
    let h_b = a.ok(&format!("export {region} {UID_B} -"), "handle");
    assert_eq!(b.ask(&format!("import {h_b}")), "err PermissionDenied");
    // Nor may A import B's region, whatever B's policy says about A's uid.
    let h_ba = b.ok(&format!("export {region_b} {UID_A} -"), "handle");
    assert_eq!(a.ask(&format!("import {h_ba}")), "err PermissionDenied");
    // A policy naming a partition: its clients import, others do not; an exporter names
    // only a partition it is bound to.
    assert_eq!(a.ask(&format!("export {region} - tenant-b")), "err PermissionDenied");
    assert_eq!(a.ask(&format!("export {region} - nowhere")), "err NotFound");
    let h_part = a.ok(&format!("export {region} - tenant-a"), "handle");
    assert!(dd.ask(&format!("import {h_part}")).starts_with("ok"));
    assert_eq!(b.ask(&format!("import {h_part}")), "err PermissionDenied");
    assert_eq!(c.ask(&format!("import {h_part}")), "err PermissionDenied", "unbound: not in tenant-a");
    // Revocation: later imports, and replays of the same handle, are refused.
    assert_eq!(dd.ask(&format!("revoke {h_d}")), "err PermissionDenied", "only the owner revokes");
    assert_eq!(a.ask(&format!("revoke {h_d}")), "ok");
    assert_eq!(dd.ask(&format!("import {h_d}")), "err Revoked");
    assert_eq!(dd.ask(&format!("import {h_d}")), "err Revoked", "a replay is refused again");
    assert_eq!(c.ask(&format!("import {h_d}")), "err Revoked");

    // Regions: one's own; everyone's for admins only. The listing carries no secret.
    assert_eq!(a.ok("regions", "regions"), "1");
    assert_eq!(a.ok("regions", "exports"), "4");
    assert_eq!(dd.ok("regions", "imports"), "2");
    assert_eq!(a.ask("regions-all"), "err AdminRequired");
    assert_eq!(adm.ok("regions-all", "regions"), "2");
    let Response::Regions(all) = admin_call(&mut root, Request::Regions(RegionsRequest { all: true })) else {
        panic!()
    };
    assert_eq!(all.regions.len(), 2);
    assert!(all.exports.iter().any(|e| e.revoked && e.policy.uids.as_slice() == [UID_D]));

    // The bindings survive a restart, and with security.require_partition an unbound
    // client is refused while bound ones carry on.
    drop((a, b, c, dd, adm, root));
    drop(d);
    let text = std::fs::read_to_string(&s.config).unwrap() + "[security]\nrequire_partition = true\n";
    std::fs::write(&s.config, text).unwrap();
    let _d = common::start(&s.config, s.dir.path());
    let mut a = Client::spawn("A", &s.socket, UID_A, &[]);
    let mut c = Client::spawn("C", &s.socket, UID_C, &[]);
    assert_eq!(a.ok("devices", "gpus"), seen_a, "bindings are durable");
    assert_eq!(a.ok("plist", "names"), "tenant-a");
    assert_eq!(c.ask("devices"), "err PermissionDenied");
    assert_eq!(c.ask(&format!("gfa {gfa_a}")), "err PermissionDenied");
    assert_eq!(c.ask(&format!("alloc {}", g[4])), "err PermissionDenied");
    assert_eq!(c.ask(&format!("register {} region 1", g[4])), "err PermissionDenied", "not NotFound: refused first");
    assert_eq!(c.ok("plist", "names"), "", "listing stays open");
    assert!(c.ask("status").starts_with("ok"), "status stays open");
}

/// The handle `h` naming region `region` with generation `generation` instead.
fn renamed(h: &str, region: u64, generation: u64) -> String {
    let mut h: ExportHandle = h.parse().unwrap();
    h.region = region;
    h.generation = generation;
    h.to_string()
}

#[test]
fn regions_imports_and_registrations_of_others_cannot_be_touched_by_id_and_dead_handles_stay_dead() {
    let Some((s, d)) = secured() else { return };
    let g = gpus();
    let mut root = common::client(&s.socket);
    two_tenants(&mut root, &g);
    let mut a = Client::spawn("A", &s.socket, UID_A, &[]);
    // A's uid on another connection: another session, which owns none of A's objects.
    let mut a2 = Client::spawn("A2", &s.socket, UID_A, &[]);
    let mut b = Client::spawn("B", &s.socket, UID_B, &[]);
    let mut c = Client::spawn("C", &s.socket, UID_C, &[]);
    let mut dd = Client::spawn("D", &s.socket, UID_D, &[TENANT_A_GID]);

    // A's region with a pattern, a registration of it, an export naming D and D's import.
    let alloc = a.ask(&format!("alloc {}", g[0]));
    let field = |a: &str, k: &str| a.split_whitespace().find_map(|w| w.strip_prefix(k)).unwrap().to_owned();
    let (ra, gfa_a) = (field(&alloc, "region="), field(&alloc, "gfa="));
    assert_eq!(a.ask(&format!("fill {ra} a5")), "ok");
    let reg_a = a.ok(&format!("register {} region {ra}", g[0]), "registration");
    let h = a.ok(&format!("export {ra} {UID_D} -"), "handle");
    let imp_d = dd.ok(&format!("import {h}"), "import");
    // B's region likewise, for the way back.
    let alloc_b = b.ask(&format!("alloc {}", g[2]));
    let (rb, gfa_b) = (field(&alloc_b, "region="), field(&alloc_b, "gfa="));
    assert_eq!(b.ask(&format!("fill {rb} b6")), "ok");
    let reg_b = b.ok(&format!("register {} region {rb}", g[2]), "registration");

    // Every operation that names A's objects by id, from another partition (B), an unbound
    // uid (C) and A's own uid on another connection (A2): refused, typed.
    let own_c = c.ask(&format!("alloc {}", g[4]));
    let own_a2 = a2.ask(&format!("alloc {}", g[1]));
    for (x, dev, own_gfa) in [
        (&mut b, g[2].as_str(), gfa_b.clone()),
        (&mut c, g[4].as_str(), field(&own_c, "gfa=")),
        (&mut a2, g[1].as_str(), field(&own_a2, "gfa=")),
    ] {
        assert_eq!(x.ask(&format!("free {ra}")), "err PermissionDenied");
        assert_eq!(x.ask(&format!("export {ra} - -")), "err PermissionDenied");
        assert_eq!(x.ask(&format!("register {dev} region {ra}")), "err PermissionDenied");
        assert_eq!(x.ask(&format!("register {dev} import {imp_d}")), "err PermissionDenied");
        assert_eq!(x.ask(&format!("release {imp_d}")), "err PermissionDenied");
        assert_eq!(x.ask(&format!("unregister {reg_a}")), "err PermissionDenied");
        assert_eq!(x.ask(&format!("revoke {h}")), "err PermissionDenied");
        // A GFA in A's region is in no region of this session: it cannot be written or read.
        assert_eq!(x.ask(&format!("copy {gfa_a} {own_gfa}")), "err NotFound");
        assert_eq!(x.ask(&format!("copy {own_gfa} {gfa_a}")), "err NotFound");
        assert_eq!(x.ask(&format!("copy r{reg_a} {own_gfa}")), "err PermissionDenied");
        // Ids that name nothing are NotFound, not a hint about someone else's.
        assert_eq!(x.ask("free 987654321"), "err NotFound");
    }
    // A bound client registers nothing for a device outside its partitions, not even its own
    // memory (the device's DMA domain is the other tenant's).
    assert_eq!(b.ask(&format!("register {} region {rb}", g[0])), "err PermissionDenied");
    // And back: A cannot touch B's region.
    assert_eq!(a.ask(&format!("free {rb}")), "err PermissionDenied");
    assert_eq!(a.ask(&format!("unregister {reg_b}")), "err PermissionDenied");
    assert_eq!(a.ask(&format!("copy {gfa_b} {gfa_a}")), "err NotFound");

    // Unharmed: the bytes, the registration, the export and the import are all still there.
    assert_eq!(a.ask(&format!("peek {ra}")), "ok byte=a5");
    assert_eq!(b.ask(&format!("peek {rb}")), "ok byte=b6");
    assert_eq!(a.ok("regions", "regions"), "2", "listed by uid: A's and A2's");
    assert_eq!(a.ok("regions", "exports"), "1");
    assert_eq!(dd.ok("regions", "imports"), "1");

    // A valid, unrevoked handle replayed by uids its policy does not admit: refused, and
    // the refusals neither consume nor revoke it.
    assert_eq!(b.ask(&format!("import {h}")), "err PermissionDenied");
    assert_eq!(c.ask(&format!("import {h}")), "err PermissionDenied");
    assert_eq!(a2.ask(&format!("import {h}")), "err PermissionDenied", "the policy names D, not the owner's uid");
    assert!(dd.ask(&format!("import {h}")).starts_with("ok"));
    assert_eq!(a.ask(&format!("unregister {reg_a}")), "ok");
    assert_eq!(dd.ask(&format!("release {imp_d}")), "ok");

    // A freed region's handle is dead; the next region has a new id and generation, and no
    // mix of the old handle's parts with the new region's imports it.
    let gen_old: u64 = h.parse::<ExportHandle>().unwrap().generation;
    assert_eq!(a.ask(&format!("free {ra}")), "ok");
    assert_eq!(dd.ask(&format!("import {h}")), "err InvalidHandle");
    let ra2 = a.ok(&format!("alloc {}", g[0]), "region");
    assert_ne!(ra2, ra, "region ids are not reused");
    let h2 = a.ok(&format!("export {ra2} {UID_D} -"), "handle");
    let gen_new = h2.parse::<ExportHandle>().unwrap().generation;
    assert_ne!(gen_new, gen_old);
    let ra2: u64 = ra2.parse().unwrap();
    assert_eq!(dd.ask(&format!("import {}", renamed(&h, ra2, gen_new))), "err InvalidHandle", "old secret");
    assert_eq!(dd.ask(&format!("import {}", renamed(&h2, ra2, gen_old))), "err InvalidHandle", "old generation");
    assert!(dd.ask(&format!("import {h2}")).starts_with("ok"));

    // After a restart on the same state, ids still move on and the old handle stays dead.
    drop((a, a2, b, c, dd, root));
    drop(d);
    let _d = common::start(&s.config, s.dir.path());
    let mut a = Client::spawn("A", &s.socket, UID_A, &[]);
    let mut dd = Client::spawn("D", &s.socket, UID_D, &[TENANT_A_GID]);
    let ra3: u64 = a.ok(&format!("alloc {}", g[0]), "region").parse().unwrap();
    assert!(ra3 > ra2, "region {ra3} after a restart, {ra2} before");
    assert_eq!(dd.ask(&format!("import {h}")), "err InvalidHandle");
    assert_eq!(dd.ask(&format!("import {h2}")), "err InvalidHandle");
}

#[test]
fn bound_subscribers_get_only_their_partitions_device_events() {
    if !is_root() {
        eprintln!("skipped: needs root to run clients under uids {UID_A}, {UID_B} (CI runs it as root)");
        return;
    }
    // An editable copy of the sim, rescanned every second.
    let s = common::Setup::new(&format!("group = \"{SOCKET_GID}\"\nadmin_group = \"{ADMIN_GID}\""));
    let sim = s.dir.path().join("fabric.toml");
    let base = std::fs::read_to_string(common::sim_file()).unwrap();
    std::fs::write(&sim, &base).unwrap();
    let config = std::fs::read_to_string(&s.config).unwrap().replace(
        &format!("sim = [{:?}]", common::sim_file().display().to_string()),
        &format!("sim = [{:?}]\nrescan_interval_s = 1", sim.display().to_string()),
    );
    assert!(config.contains("rescan_interval_s = 1"));
    std::fs::write(&s.config, config).unwrap();
    let d = common::start(&s.config, s.dir.path());
    let g = gpus();
    let last = g.last().unwrap().clone();
    let mut root = common::client(&s.socket);
    // tenant-a holds the GPU that will vanish; tenant-b does not.
    admin_call(
        &mut root,
        Request::Partitions(PartitionsRequest::Set(spec("tenant-a", &[&g[0], &last], &[UID_A], &[]))),
    );
    admin_call(
        &mut root,
        Request::Partitions(PartitionsRequest::Set(spec("tenant-b", &[&g[2], &g[3]], &[UID_B], &[]))),
    );
    let mut a = Client::spawn("A", &s.socket, UID_A, &[]);
    let mut b = Client::spawn("B", &s.socket, UID_B, &[]);
    assert_eq!(a.ask("subscribe"), "ok");
    assert_eq!(b.ask("subscribe"), "ok");

    // The last GPU (and its NVLinks) leaves the sim file.
    let seven = base
        .replacen("count = 8\nparent = \"plx{i/2}\"", "count = 7\nparent = \"plx{i/2}\"", 1)
        .replacen("i = 8\n", "i = 7\n", 1);
    assert_ne!(seven, base);
    let tmp = sim.with_extension("tmp");
    std::fs::write(&tmp, &seven).unwrap();
    std::fs::rename(&tmp, &sim).unwrap();

    let seen_a = a.ok("events-until-map 20", "devices");
    assert!(seen_a.split(',').any(|e| e == format!("{last}:Removed")), "A sees its GPU go: {seen_a}");
    assert!(seen_a.split(',').all(|e| e.is_empty() || e.starts_with(&last)), "A sees only its devices: {seen_a}");
    let seen_b = b.ask("events-until-map 20");
    assert_eq!(seen_b, "ok devices= links=0 map=true", "B sees the map change and no device or link of A's");
    drop(d);
}

/// The client half of the tests above, run by them under another uid; does nothing when
/// run directly.
#[test]
#[ignore = "the client process of partitions_handles_and_admin_rights_hold_against_other_uids, which runs it"]
fn security_child() {
    let Some(socket) = std::env::var_os(ENV_SOCKET) else { return };
    let mut conn = common::client(std::path::Path::new(&socket));
    // The files of the regions this client allocated, by region id.
    let mut files = HashMap::new();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"quit") {
            break;
        }
        let answer = child_command(&mut conn, &mut files, &words);
        println!("answer: {answer}");
        std::io::stdout().flush().unwrap();
    }
}

fn code(e: CodecError) -> String {
    match e {
        CodecError::Refused { body, .. } => format!("err {:?}", body.code),
        other => panic!("transport failure: {other}"),
    }
}

fn gpu_ids(json: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let devices = v["devices"].as_array().unwrap();
    let ids: Vec<&str> = devices.iter().filter(|d| d["kind"] == "gpu").map(|d| d["id"].as_str().unwrap()).collect();
    ids.join(",")
}

/// Bytes of a region's first page a `fill` writes and a `peek` reads.
const PAGE: usize = 4096;

fn child_command(conn: &mut Connection, files: &mut HashMap<u64, std::fs::File>, w: &[&str]) -> String {
    let mut call = |req: Request| conn.call(req, &[]).map(|(r, _fds)| r);
    let resource = |dev: &str| ResourceName { device: dev.try_into().unwrap(), memory: MemoryClass::Hbm, ordinal: 0 };
    let r = match w {
        ["whoami"] => return format!("ok uid={}", nix::unistd::getuid()),
        ["status"] => call(Request::Status(Default::default())).map(|_| "ok".to_owned()),
        ["subscribe"] => call(Request::Subscribe(SubscribeRequest { topics: Topics::ALL })).map(|_| "ok".to_owned()),
        ["events-until-map", secs] => {
            // Device events as id:Change, the number of link events, whether a map event came.
            let secs: u64 = secs.parse().unwrap();
            conn.stream().set_read_timeout(Some(std::time::Duration::from_secs(secs))).unwrap();
            let (mut devices, mut links, mut map) = (Vec::new(), 0, false);
            while !map {
                match conn.next_event() {
                    Ok(Event::Device { device, change }) => devices.push(format!("{}:{change:?}", device.as_str())),
                    Ok(Event::Link { .. }) => links += 1,
                    Ok(Event::Map(_)) => map = true,
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            return format!("ok devices={} links={links} map={map}", devices.join(","));
        }
        ["pset", name, dev] => {
            call(Request::Partitions(PartitionsRequest::Set(spec(name, &[dev], &[], &[])))).map(|_| "ok".to_owned())
        }
        ["prm", name] => call(Request::Partitions(PartitionsRequest::Remove { name: Name::truncated(name) }))
            .map(|_| "ok".to_owned()),
        ["plist"] => call(Request::Partitions(PartitionsRequest::List)).map(|r| {
            let Response::Partitions(p) = r else { panic!("{r:?}") };
            let names: Vec<&str> = p.partitions.iter().map(|s| s.name.as_str()).collect();
            format!("ok names={}", names.join(","))
        }),
        ["devices"] => call(Request::Devices(TopologyRequest::default())).map(|r| {
            let Response::Devices(doc) = r else { panic!("{r:?}") };
            format!("ok gpus={}", gpu_ids(&doc.json))
        }),
        ["topology"] => call(Request::Topology(TopologyRequest::default())).map(|r| {
            let Response::Topology(doc) = r else { panic!("{r:?}") };
            format!("ok gpus={}", gpu_ids(&doc.json))
        }),
        ["map"] => call(Request::Map(TopologyRequest::default())).map(|r| {
            let Response::Map(doc) = r else { panic!("{r:?}") };
            let v: serde_json::Value = serde_json::from_str(&doc.json).unwrap();
            let owners: Vec<&str> =
                v["ranges"].as_array().unwrap().iter().map(|r| r["owner"].as_str().unwrap()).collect();
            format!("ok owners={}", owners.join(","))
        }),
        ["reverse", dev] => {
            let q = TranslateQuery::Resource { resource: resource(dev), offset: 0 };
            call(Request::Translate(TranslateRequest { queries: BoundedVec::new(vec![q]).unwrap() })).map(|r| {
                let Response::Translate(t) = r else { panic!("{r:?}") };
                match &t.results[0] {
                    Translation::Gfa(g) => format!("ok gfa={g}"),
                    Translation::NotInPartition => "notinpartition".to_owned(),
                    other => format!("other {other:?}"),
                }
            })
        }
        ["gfa", gfa] => {
            let q = TranslateQuery::Gfa(gfa.parse().unwrap());
            call(Request::Translate(TranslateRequest { queries: BoundedVec::new(vec![q]).unwrap() })).map(|r| {
                let Response::Translate(t) = r else { panic!("{r:?}") };
                match &t.results[0] {
                    Translation::Resource { resource, .. } => format!("ok device={}", resource.device),
                    Translation::NotInPartition => "notinpartition".to_owned(),
                    other => format!("other {other:?}"),
                }
            })
        }
        ["alloc", dev] => {
            let target = AllocTarget::Resource(resource(dev));
            let req = Request::Alloc(AllocRequest { target, size: 2 << 20, align: 0 });
            conn.call(req, &[]).map(|(r, fds)| {
                let Response::Alloc(a) = r else { panic!("{r:?}") };
                files.insert(a.region, std::fs::File::from(fds.into_iter().next().unwrap()));
                format!("ok region={} gfa={:#x}", a.region, a.gfa.unwrap())
            })
        }
        ["fill", region, byte] => {
            use std::os::unix::fs::FileExt;
            let byte = u8::from_str_radix(byte, 16).unwrap();
            files[&region.parse::<u64>().unwrap()].write_all_at(&[byte; PAGE], 0).unwrap();
            return "ok".to_owned();
        }
        ["peek", region] => {
            use std::os::unix::fs::FileExt;
            let mut page = [0u8; PAGE];
            files[&region.parse::<u64>().unwrap()].read_exact_at(&mut page, 0).unwrap();
            let same = page.iter().all(|b| *b == page[0]);
            return if same { format!("ok byte={:02x}", page[0]) } else { "mixed".to_owned() };
        }
        ["free", region] => {
            call(Request::Free(FreeRequest { region: region.parse().unwrap(), node: None })).map(|_| "ok".to_owned())
        }
        ["release", import] => {
            call(Request::Release(ReleaseRequest { import: import.parse().unwrap() })).map(|_| "ok".to_owned())
        }
        ["register", dev, kind, id] => {
            let id = id.parse().unwrap();
            let source = if *kind == "region" { RegisterSource::Region(id) } else { RegisterSource::Import(id) };
            let req = RegisterRequest {
                device: DeviceName::truncated(dev),
                source,
                offset: 0,
                len: PAGE as u64,
                access: AccessMode::ReadWrite,
                node: None,
            };
            call(Request::Register(req)).map(|r| {
                let Response::Register(g) = r else { panic!("{r:?}") };
                format!("ok registration={}", g.registration)
            })
        }
        ["unregister", id] => {
            call(Request::Unregister(UnregisterRequest { registration: id.parse().unwrap() })).map(|_| "ok".to_owned())
        }
        ["copy", dst, src] => {
            // GFAs (0x…) or registrations (r<id>), one page.
            let end = |s: &str| match s.strip_prefix("r") {
                Some(id) => CopyEndpoint::Registration { id: id.parse().unwrap(), offset: 0 },
                None => CopyEndpoint::Gfa(u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap()),
            };
            let req = CopyRequest { dst: end(dst), src: end(src), len: PAGE as u64 };
            call(Request::Copy(req)).map(|r| {
                let Response::Copy(c) = r else { panic!("{r:?}") };
                format!("ok copy={}", c.copy)
            })
        }
        ["export", region, uids, partition] => {
            let uids: Vec<u32> =
                if *uids == "-" { Vec::new() } else { uids.split(',').map(|u| u.parse().unwrap()).collect() };
            let policy = ExportPolicy {
                uids: uids.try_into().unwrap(),
                gids: BoundedVec::default(),
                partition: (*partition != "-").then(|| Name::truncated(partition)),
                access: AccessMode::ReadWrite,
            };
            call(Request::Export(ExportRequest { region: region.parse().unwrap(), policy, node: None })).map(|r| {
                let Response::Export(e) = r else { panic!("{r:?}") };
                format!("ok handle={}", e.handle)
            })
        }
        ["import", handle] => {
            let handle: ExportHandle = handle.parse().unwrap();
            call(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly })).map(|r| {
                let Response::Import(i) = r else { panic!("{r:?}") };
                format!("ok import={}", i.import)
            })
        }
        ["revoke", handle] => {
            let handle: ExportHandle = handle.parse().unwrap();
            call(Request::Revoke(RevokeRequest { handle })).map(|_| "ok".to_owned())
        }
        ["regions"] | ["regions-all"] => {
            call(Request::Regions(RegionsRequest { all: w[0] == "regions-all" })).map(|r| {
                let Response::Regions(l) = r else { panic!("{r:?}") };
                format!("ok regions={} exports={} imports={}", l.regions.len(), l.exports.len(), l.imports.len())
            })
        }
        other => panic!("unknown command {other:?}"),
    };
    r.unwrap_or_else(code)
}

/// `limits.clients_per_uid` of the tests below.
const PER_UID: u32 = 4;

/// One uid holds its limit of idle connections: one more is refused with a typed error;
/// another uid and root are served meanwhile; closing some lets it connect again; a
/// connection the daemon drops on a timeout gives its count back.
#[test]
fn one_uid_cannot_take_every_client_slot_and_closed_or_timed_out_connections_count_no_more() {
    if !is_root() {
        eprintln!("skipped: needs root to run clients under uids {UID_A}, {UID_B} (CI runs it as root)");
        return;
    }
    let s = common::Setup::new(&format!("group = \"{SOCKET_GID}\""));
    let text = std::fs::read_to_string(&s.config).unwrap();
    std::fs::write(&s.config, format!("{text}[limits]\nclients_per_uid = {PER_UID}\n")).unwrap();
    let d = common::start(&s.config, s.dir.path());
    let refused = format!("err LimitExceeded what=clients_per_uid used={PER_UID} max={PER_UID}");

    let mut a = Client::spawn_child("A", "uid_limit_child", &s.socket, UID_A, &[]);
    assert_eq!(a.ask(&format!("open {PER_UID}")), format!("ok open={PER_UID}"));
    assert_eq!(a.ask("try"), refused, "A's connection past its limit");
    assert_eq!(a.ask("try"), refused, "and the next one");
    assert_eq!(a.ask("status"), format!("ok served={PER_UID}"), "A's own connections are still served");
    // Another uid, and root past the per-uid limit, are served beside A's full allowance.
    let mut b = Client::spawn_child("B", "uid_limit_child", &s.socket, UID_B, &[]);
    assert_eq!(b.ask(&format!("open {PER_UID}")), format!("ok open={PER_UID}"));
    assert_eq!(b.ask("status"), format!("ok served={PER_UID}"));
    let mut root: Vec<Connection> = (0..2 * PER_UID).map(|_| common::client(&s.socket)).collect();
    for c in &mut root {
        admin_call(c, Request::Status(Default::default()));
    }
    drop(b);
    // Closed connections give their counts back, as soon as the daemon sees them closed
    // (a few tries on a loaded machine).
    assert_eq!(a.ask("close 2"), format!("ok open={}", PER_UID - 2));
    assert_eq!(a.ask("try-until 20"), format!("ok open={}", PER_UID - 1));
    assert_eq!(a.ask("try-until 20"), format!("ok open={PER_UID}"));
    assert_eq!(a.ask("try"), refused, "at the limit again");
    // A connection the daemon drops for stalling inside a frame gives its count back too.
    assert_eq!(a.ask("stall"), "ok stalled=1");
    assert_eq!(a.ask("try"), refused, "the stalled connection counts while it is open");
    assert_eq!(a.ask("wait-dropped 60"), "ok dropped");
    // The count is given back as the connection's thread ends, just after the close the
    // client saw.
    assert_eq!(a.ask("try-until 20"), format!("ok open={PER_UID}"), "the dropped connection's count came back");
    assert_eq!(a.ask("status"), format!("ok served={PER_UID}"));
    drop(a);
    drop(root);

    let log = d.log();
    let line = format!("limits.clients_per_uid reached for uid {UID_A}; refusing a new connection");
    assert!(log.contains(&line), "{log}");
    assert!(log.contains(&format!("limit={PER_UID}")), "{log}");
    assert!(!log.contains(&format!("limits.clients_per_uid reached for uid {UID_B}")), "{log}");
    assert!(!log.contains("limits.clients_per_uid reached for uid 0"), "{log}");
    assert!(log.contains("client stalled inside a frame header; closing"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

/// Without root: the daemon's own uid (root's too) is not held to
/// `limits.clients_per_uid`, and a connection past `limits.clients` gets a typed
/// `LimitExceeded` error frame and a log line and is counted.
#[test]
fn the_daemons_own_uid_is_not_limited_per_uid_and_a_full_daemon_refuses_with_a_typed_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let s = common::Setup::new("");
    let text =
        std::fs::read_to_string(&s.config).unwrap().replace("listen = \"\"", &format!("listen = \"127.0.0.1:{port}\""));
    std::fs::write(&s.config, format!("{text}[limits]\nclients = 6\nclients_per_uid = 2\n")).unwrap();
    let d = common::start(&s.config, s.dir.path());
    let mut held: Vec<Connection> = (0..6).map(|_| common::client(&s.socket)).collect();
    for c in &mut held {
        admin_call(c, Request::Status(Default::default()));
    }
    let mut seventh = Connection::new(std::os::unix::net::UnixStream::connect(&s.socket).unwrap());
    seventh.stream().set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    match seventh.hello("seventh", fabric_proto::wire::SUPPORTED_VERSIONS) {
        Err(CodecError::Refused { body, .. }) => {
            assert_eq!(body.code, fabric_proto::wire::ErrorCode::LimitExceeded, "{}", body.message.as_str());
            assert!(
                matches!(&body.detail, Some(fabric_proto::wire::ErrorDetail::Limit { what, used: 6, requested: 1, max: 6 }) if what.as_str() == "clients"),
                "{:?}",
                body.detail
            );
        }
        other => panic!("a seventh client of a daemon serving 6: {other:?}"),
    }
    // A slot given back is taken again.
    drop(held.pop());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut again = loop {
        let mut c = Connection::new(std::os::unix::net::UnixStream::connect(&s.socket).unwrap());
        if c.hello("again", fabric_proto::wire::SUPPORTED_VERSIONS).is_ok() {
            break c;
        }
        assert!(std::time::Instant::now() < deadline, "the closed client's slot never came back");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    admin_call(&mut again, Request::Status(Default::default()));
    let mut http = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut page = String::new();
    std::io::Read::read_to_string(&mut http, &mut page).unwrap();
    assert!(page.contains("fabricd_connections_refused_total{limit=\"clients_per_uid\"} 0\n"), "{page}");
    let refused: u64 = page
        .lines()
        .find_map(|l| l.strip_prefix("fabricd_connections_refused_total{limit=\"clients\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(refused >= 1, "{page}");
    let log = d.log();
    assert!(log.contains("client limit reached; refusing a new connection"), "{log}");
    assert!(!log.contains("limits.clients_per_uid reached"), "{log}");
}

/// The client half of the per-uid test, run under another uid; does nothing when run
/// directly. Holds connections (`open N`, `close N`, `try`, `try-until SECS`, `stall` one,
/// `wait-dropped SECS`) and answers one line per command.
#[test]
#[ignore = "the client process of one_uid_cannot_take_every_client_slot_..., which runs it"]
fn uid_limit_child() {
    let Some(socket) = std::env::var_os(ENV_SOCKET) else { return };
    let socket = std::path::PathBuf::from(socket);
    let mut held: Vec<Connection> = Vec::new();
    let mut stalled: Vec<std::os::unix::net::UnixStream> = Vec::new();
    // A connection and hello: served, or the refusal's code and numbers.
    let attempt = || {
        let s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
        let mut c = Connection::new(s);
        match c.hello("uid-limit", fabric_proto::wire::SUPPORTED_VERSIONS) {
            Ok(_) => Ok(c),
            Err(CodecError::Refused { body, .. }) => Err(match body.detail {
                Some(fabric_proto::wire::ErrorDetail::Limit { what, used, max, .. }) => {
                    format!("err {:?} what={} used={used} max={max}", body.code, what.as_str())
                }
                _ => format!("err {:?}", body.code),
            }),
            Err(e) => Err(format!("transport {e}")),
        }
    };
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["quit"] => break,
            ["whoami"] => format!("ok uid={}", nix::unistd::getuid()),
            ["open", n] => (0..n.parse::<usize>().unwrap())
                .try_for_each(|_| attempt().map(|c| held.push(c)))
                .map_or_else(|e| e, |()| format!("ok open={}", held.len())),
            ["close", n] => {
                held.truncate(held.len() - n.parse::<usize>().unwrap());
                format!("ok open={}", held.len())
            }
            ["try"] => attempt().map_or_else(
                |e| e,
                |c| {
                    held.push(c);
                    format!("ok open={}", held.len())
                },
            ),
            ["try-until", secs] => {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs.parse().unwrap());
                loop {
                    match attempt() {
                        Ok(c) => {
                            held.push(c);
                            break format!("ok open={}", held.len());
                        }
                        Err(e) if std::time::Instant::now() > deadline => break e,
                        Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
                    }
                }
            }
            ["status"] => {
                let served = held
                    .iter_mut()
                    .map(|c| c.call(Request::Status(Default::default()), &[]).is_ok())
                    .filter(|ok| *ok)
                    .count();
                format!("ok served={served}")
            }
            ["stall"] => {
                // A served connection sends ten bytes of a 32-byte header, and nothing
                // more: the daemon drops it after its frame timeout (10 s).
                let c = held.pop().unwrap();
                let s = c.stream().try_clone().unwrap();
                drop(c);
                (&s).write_all(&[0; 10]).unwrap();
                stalled.push(s);
                format!("ok stalled={}", stalled.len())
            }
            ["wait-dropped", secs] => {
                let s = stalled.pop().unwrap();
                s.set_read_timeout(Some(std::time::Duration::from_secs(secs.parse().unwrap()))).unwrap();
                match std::io::Read::read(&mut &s, &mut [0; 64]) {
                    Ok(0) => "ok dropped".to_owned(),
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => "ok dropped".to_owned(),
                    other => format!("not dropped: {other:?}"),
                }
            }
            _ => format!("unknown command {line:?}"),
        };
        println!("answer: {answer}");
        std::io::stdout().flush().unwrap();
    }
}
