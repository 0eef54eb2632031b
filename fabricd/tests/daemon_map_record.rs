//! The map record (address map state and partition bindings saved as one) from outside:
//! a daemon started on the two files of a daemon before it migrates them; and commit,
//! then publish, across `kill -9`: a client changes one partition in a loop, each
//! `Set` moving it to another GPU *and* another bound uid together (GPU k is bound to uid
//! 61000 + k); the daemon is killed at a random moment and restarted, and the partition it
//! lists must pair a GPU with that GPU's uid, at the last acknowledged change or the one
//! in flight. A daemon that saved the map and the bindings in two files (bindings first)
//! could be killed between them and come back with GPU j bound to uid 61000 + k.
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "the test's report")]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fabric_proto::wire::{BoundedVec, DeviceName, Name, PartitionSpec, PartitionsRequest, Request, Response};
use fabric_topology::Fabric;

const ROUNDS: usize = 40;
const BUDGET: Duration = Duration::from_secs(40);
const BASE_UID: u32 = 61000;

fn gpus() -> Vec<String> {
    let f = Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap();
    let mut v: Vec<String> =
        f.inventory().devices.iter().filter(|d| d.gpu.is_some()).map(|d| d.id.to_string()).collect();
    v.sort();
    v
}

fn spec(gpu: &str, uid: u32) -> PartitionSpec {
    PartitionSpec {
        name: Name::truncated("p"),
        devices: vec![DeviceName::truncated(gpu)].try_into().unwrap(),
        uids: BoundedVec::new(vec![uid]).unwrap(),
        gids: BoundedVec::default(),
    }
}

/// The partition `p` as the daemon lists it: (its GPU's index, its uids).
fn listed(socket: &std::path::Path, gpus: &[String]) -> Option<(usize, Vec<u32>)> {
    let mut c = common::client(socket);
    let (r, _) = c.call(Request::Partitions(PartitionsRequest::List), &[]).unwrap();
    let Response::Partitions(list) = r else { panic!("{r:?}") };
    let p = list.partitions.iter().find(|p| p.name.as_str() == "p")?;
    let gpu = gpus.iter().position(|g| g == p.devices[0].as_str()).unwrap();
    Some((gpu, p.uids.to_vec()))
}

#[test]
fn a_kill_between_map_and_bindings_cannot_leave_them_disagreeing() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("daemon_map_record: skipped (changing partitions needs an admin: run as root)");
        return;
    }
    let gpus = gpus();
    assert!(gpus.len() >= 2, "{gpus:?}");
    let s = common::Setup::new("");
    let mut seed = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 | 1;
    eprintln!("daemon_map_record: seed {seed}");
    let started = Instant::now();
    let mut next = 0usize;
    let mut rounds = 0;
    let mut changes = 0u64;
    while rounds < ROUNDS && started.elapsed() < BUDGET {
        let daemon = common::start(&s.config, s.dir.path());
        // Where the last round left it: GPU and uid agree, at an acknowledged change or
        // the one in flight.
        if let Some((gpu, uids)) = listed(&s.socket, &gpus) {
            assert_eq!(uids, vec![BASE_UID + gpu as u32], "round {rounds}: GPU {gpu} bound to {uids:?}");
            let acked = (next + gpus.len() - 1) % gpus.len();
            assert!(gpu == acked || gpu == next % gpus.len(), "round {rounds}: at GPU {gpu}, acknowledged {acked}");
            next = gpu + 1;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let last_acked = Arc::new(AtomicI64::new(-1));
        let acks = Arc::new(AtomicU64::new(0));
        let worker = {
            let (stop, last_acked, gpus, socket) = (stop.clone(), last_acked.clone(), gpus.clone(), s.socket.clone());
            let acks = acks.clone();
            let first = next;
            std::thread::spawn(move || {
                // The kill may come during the handshake too.
                let Ok(stream) = std::os::unix::net::UnixStream::connect(&socket) else { return };
                let mut c = fabric_proto::wire::Connection::new(stream);
                if c.hello("fabricd-test", fabric_proto::wire::SUPPORTED_VERSIONS).is_err() {
                    return;
                }
                let mut k = first;
                while !stop.load(Ordering::Relaxed) {
                    let g = k % gpus.len();
                    let req = Request::Partitions(PartitionsRequest::Set(spec(&gpus[g], BASE_UID + g as u32)));
                    if c.call(req, &[]).is_err() {
                        break;
                    }
                    last_acked.store(g as i64, Ordering::Relaxed);
                    acks.fetch_add(1, Ordering::Relaxed);
                    k += 1;
                }
            })
        };
        // xorshift: a kill somewhere in the first ~60 ms of changes.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_micros(2_000 + seed % 60_000));
        let mut daemon = daemon;
        daemon.child.kill().unwrap();
        daemon.child.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        worker.join().unwrap();
        changes += acks.load(Ordering::Relaxed);
        if let Ok(g) = usize::try_from(last_acked.load(Ordering::Relaxed)) {
            next = g + 1;
        }
        rounds += 1;
    }
    let daemon = common::start(&s.config, s.dir.path());
    if let Some((gpu, uids)) = listed(&s.socket, &gpus) {
        assert_eq!(uids, vec![BASE_UID + gpu as u32], "after the last round: GPU {gpu} bound to {uids:?}");
    }
    drop(daemon);
    assert!(changes > rounds as u64, "only {changes} changes acknowledged in {rounds} rounds");
    eprintln!(
        "daemon_map_record: {rounds} kill -9 crash points, {changes} acknowledged changes, in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// A state dir of a daemon before the map record (`map.state` and `partitions.state`): the
/// daemon starts on it with the partition and its binding as they were, saves the record
/// and retires the old files; a restart loads the record alone.
#[test]
fn a_state_dir_with_the_two_old_files_is_migrated() {
    let gpus = gpus();
    let s = common::Setup::new("");
    std::fs::create_dir_all(&s.state).unwrap();
    std::fs::set_permissions(&s.state, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let mut map = fabric_addrmap::AddressMap::new(fabric_addrmap::MapConfig::default()).unwrap();
    map.partition("p", &[gpus[1].parse().unwrap()]);
    map.save(&s.state.join("map.state")).unwrap();
    let bindings = vec![fabricd::partitions::Binding::new("p", &[BASE_UID + 1], &[])];
    std::fs::write(s.state.join(fabricd::partitions::FILE_NAME), fabricd::partitions::encode(&bindings)).unwrap();
    std::fs::set_permissions(
        s.state.join(fabricd::partitions::FILE_NAME),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    for restart in 0..2 {
        let daemon = common::start(&s.config, s.dir.path());
        assert_eq!(listed(&s.socket, &gpus), Some((1, vec![BASE_UID + 1])), "start {restart}: {}", daemon.log());
        assert!(s.state.join(fabricd::store::RECORD_FILE).exists());
        assert!(!s.state.join("map.state").exists() && !s.state.join(fabricd::partitions::FILE_NAME).exists());
        drop(daemon);
    }
}
