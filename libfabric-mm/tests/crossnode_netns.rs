//! Client processes on two nodes in network namespaces of their own write and read each
//! other's bytes on the sim's shared fabric: tray0 and tray1 each run in a namespace (their
//! node link at the namespace's address, etcd in a third one, on a bridge the test made),
//! and each has a client process of its own, spawned in its node's namespace. tray0's
//! client allocates HBM, stores a pattern and exports it; tray1's client imports the
//! handle with the same `import` call as a local one (its fabricd asks tray0 over the
//! link across the namespaces), loads tray0's pattern and stores its own, which tray0's
//! client then loads. Needs root (namespaces) and etcd; says it is skipped otherwise.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};

use common::{check, domain, fill};
use fabric_mm::{Handle, MemoryClass, Policy, Target};

/// The environment variable that makes [`client_process`] a client: `ROLE SOCKET [HANDLE]`.
const ENV: &str = "FABRIC_NETNS_CLIENT";
const LEN: u64 = 2 << 20;
const SEED_0: u64 = 0x7a0;
const SEED_1: u64 = 0x7a1;

/// A client process of the test below, on the node of `SOCKET`: `owner` allocates, stores
/// [`SEED_0`], exports and says `HANDLE h`, then, told to, loads [`SEED_1`] and says
/// `CHECKED`; `importer` imports `HANDLE`, loads [`SEED_0`], stores [`SEED_1`] and says
/// `STORED`.
#[test]
#[ignore = "a client process of the namespaces test, which runs it"]
fn client_process() {
    let Ok(args) = std::env::var(ENV) else { return };
    let mut a = args.split(' ');
    let (role, socket) = (a.next().unwrap(), a.next().unwrap());
    let s = domain::session(Path::new(socket), None);
    let mut out = std::io::stdout();
    match role {
        "owner" => {
            let gpu = s.first_device_with(MemoryClass::Hbm).unwrap().unwrap().id;
            let region = s.alloc(&Target::Device { device: gpu, memory: MemoryClass::Hbm }, LEN).unwrap();
            let m = s.map(&region).unwrap();
            fill(&m, SEED_0, LEN);
            m.flush(0, LEN).unwrap();
            let handle = s.export(&region, &Policy::default()).unwrap();
            writeln!(out, "\nHANDLE {handle}").unwrap();
            out.flush().unwrap();
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            m.invalidate(0, LEN).unwrap();
            check(&m, SEED_1, LEN);
            writeln!(out, "CHECKED").unwrap();
        }
        "importer" => {
            let handle: Handle = a.next().unwrap().parse().unwrap();
            let import = s.import(&handle, true).unwrap();
            let m = s.map(&import).unwrap();
            m.invalidate(0, LEN).unwrap();
            check(&m, SEED_0, LEN);
            fill(&m, SEED_1, LEN);
            m.flush(0, LEN).unwrap();
            writeln!(out, "\nSTORED").unwrap();
        }
        other => panic!("no role {other}"),
    }
}

/// Starts [`client_process`] as `role` in namespace `i` of `lab`.
fn client(lab: &domain::Lab, i: usize, role: &str) -> (Child, BufReader<ChildStdout>) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--ignored", "--exact", "client_process", "--nocapture", "--test-threads=1"])
        .env(ENV, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    lab.net.as_ref().unwrap().nodes()[i].enter_on_spawn(&mut cmd).unwrap();
    let mut child = cmd.spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    (child, out)
}

/// The first line of `out` that starts with `word`, with the rest of it.
fn said(out: &mut BufReader<ChildStdout>, word: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the client exited before saying {word}");
        if let Some(rest) = line.trim().strip_prefix(word) {
            return rest.trim().to_owned();
        }
    }
}

#[test]
fn client_processes_on_nodes_in_two_namespaces_store_and_load_each_others_bytes() {
    let Some(lab) = domain::Lab::start_in_namespaces(2) else { return };
    let shared = lab.dir.path().join("sim");
    let supernode = domain::sim("supernode-64.toml");
    let n0 = lab.node_in(0, &supernode, Some(&shared), "tray0");
    let n1 = lab.node_in(1, &supernode, Some(&shared), "tray1");
    domain::wait_live(&[&n0, &n1]);

    let (mut owner, mut owner_out) = client(&lab, 0, &format!("owner {}", n0.socket.display()));
    let handle = said(&mut owner_out, "HANDLE");
    let (importer, mut importer_out) = client(&lab, 1, &format!("importer {} {handle}", n1.socket.display()));
    said(&mut importer_out, "STORED");
    let done = importer.wait_with_output().unwrap();
    assert!(done.status.success(), "tray1's client: {:?}", done.status);
    writeln!(owner.stdin.take().unwrap(), "load").unwrap();
    said(&mut owner_out, "CHECKED");
    assert!(owner.wait().unwrap().success(), "tray0's client");
    // Both nodes' links ran at their namespaces' addresses.
    for (node, ns) in [&n0, &n1].into_iter().zip(lab.net.as_ref().unwrap().nodes()) {
        let status = domain::status(&node.socket);
        let me = status["self"]["node"].as_str().unwrap().to_owned();
        let entry = status["nodes"].as_array().unwrap().iter().find(|n| n["name"] == me.as_str()).cloned().unwrap();
        assert_eq!(entry["peer_address"], format!("{}:7471", ns.addr()), "{status}");
    }
}
