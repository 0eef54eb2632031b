//! The check and the act of an operation see the same partition state: a partition
//! change is acknowledged only after the operations authorized against the state it
//! replaces have finished (`fabricd::ops::dispatch::gate`).
//!
//! In process: the window between an operation's authorization and its effects cannot be
//! held open from outside the daemon, so a `Register` from a memory object is held inside
//! its pin (which asks the request's `abandon` between pieces, outside every lock) while
//! an admin moves the device out of the caller's partition.
#![allow(clippy::unwrap_used)]

mod common;

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use fabric_proto::wire::{
    AccessMode, ErrorCode, Name, PROTOCOL_VERSION, PartitionSpec, PartitionsRequest, PeerCred, RegisterRequest,
    RegisterSource, Request, Response,
};
use fabricd::ops::dispatch::Context;
use fabricd::ops::principal::Client;
use fabricd::transport::peer::Peer;

const TENANT: u32 = 4242;

fn memfd(len: u64) -> OwnedFd {
    let name = CString::new("gate-test").unwrap();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just created and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    std::fs::File::from(fd.try_clone().unwrap()).set_len(len).unwrap();
    fd
}

fn set(name: &str, device: &str) -> Request {
    Request::Partitions(PartitionsRequest::Set(PartitionSpec {
        name: Name::truncated(name),
        devices: vec![device.try_into().unwrap()].try_into().unwrap(),
        uids: vec![TENANT].try_into().unwrap(),
        gids: Default::default(),
    }))
}

fn register(device: &str) -> Request {
    Request::Register(RegisterRequest {
        device: device.try_into().unwrap(),
        source: RegisterSource::Fd,
        offset: 0,
        len: 4096,
        access: AccessMode::ReadWrite,
        node: None,
    })
}

#[test]
fn a_partition_change_is_acknowledged_after_the_operations_checked_against_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let (config, socket, state) = (dir.path().join("c.toml"), dir.path().join("s.sock"), dir.path().join("st"));
    common::Setup::write(&config, &socket, &state, "");
    let d = fabricd::Daemon::start(fabricd::config::Config::load(&config).unwrap()).unwrap();
    let gpus: Vec<String> =
        d.view().fabric.inventory().devices.iter().filter(|x| x.gpu.is_some()).map(|x| x.id.to_string()).collect();
    let root = Peer::new(PeerCred { pid: 1, uid: 0, gid: 0 }, Vec::new(), None);
    fabricd::ops::handle(&d, &root, set("tenant", &gpus[0])).unwrap();
    let tenant = Arc::new(Client::accept(
        &Peer::new(PeerCred { pid: std::process::id() as i32, uid: TENANT, gid: TENANT }, Vec::new(), None),
        d.admin_gid,
    ));

    let (pinning, release) = (Barrier::new(2), AtomicBool::new(false));
    let acknowledged = AtomicBool::new(false);
    std::thread::scope(|s| {
        let held = s.spawn(|| {
            let first = AtomicBool::new(true);
            // Asked before each piece of the pin: the first call says the operation is in
            // flight (authorized, not yet registered), then it waits to be let go.
            let abandon = || {
                if first.swap(false, Ordering::SeqCst) {
                    pinning.wait();
                }
                while !release.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                None
            };
            let cx = Context {
                client: &tenant,
                session: 7,
                request_id: 1,
                version: PROTOCOL_VERSION,
                abandon: &abandon,
                copies: None,
            };
            fabricd::ops::request(&d, &cx, register(&gpus[0]), vec![memfd(4096)])
        });
        pinning.wait();
        // The tenant's register is past its check; the admin moves GPU 0 out of its partition.
        let change = s.spawn(|| {
            let r = fabricd::ops::handle(&d, &root, set("tenant", &gpus[1]));
            acknowledged.store(true, Ordering::SeqCst);
            r
        });
        std::thread::sleep(Duration::from_millis(300));
        let early = acknowledged.load(Ordering::SeqCst);
        // Let the register go before any assertion, so that a failure does not hang.
        release.store(true, Ordering::SeqCst);
        assert!(
            !early,
            "the partition change was acknowledged while a register checked against the old partition was in flight"
        );
        let registered = held.join().unwrap().unwrap();
        assert!(matches!(registered.response, Response::Register(_)), "authorized before the change: it stands");
        change.join().unwrap().unwrap();
    });

    // From now on the tenant's GPU 0 is out of reach.
    let cx = Context {
        client: &tenant,
        session: 7,
        request_id: 2,
        version: PROTOCOL_VERSION,
        abandon: &|| None,
        copies: None,
    };
    let e = fabricd::ops::request(&d, &cx, register(&gpus[0]), vec![memfd(4096)]).unwrap_err();
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{}", e.message);
    fabricd::ops::request(&d, &cx, register(&gpus[1]), vec![memfd(4096)]).unwrap();
}
