//! A connection's identity is the process that connected, not whatever process later
//! holds its pid: a client connects under one uid, hands its connection on and exits, and
//! another uid's process is started at its pid (through `/proc/sys/kernel/ns_last_pid`).
//! The connection must reach neither that process's locked memory (`Register { Process }`
//! and a copy) nor its admin group.
//!
//! It needs root (to run processes under other uids and to choose the next pid); as
//! anyone else it prints why it skipped. The processes are this test binary re-run
//! (`--ignored --exact <child>`) under numeric uids; nothing is created in /etc.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr, reason = "a test and its child processes")]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Child, ChildStdout, Stdio};

use fabric_proto::wire::{
    AccessMode, CodecError, Connection, CopyEndpoint, CopyRequest, DeviceName, ErrorBody, ErrorCode, Event,
    PartitionSpec, PartitionsRequest, RegisterRequest, RegisterSource, Request, Response, SUPPORTED_VERSIONS,
};
use fabric_topology::Fabric;

const ENV_SOCKET: &str = "FABRICD_PIDREUSE_SOCKET";
const SOCKET_GID: u32 = 61100;
const ADMIN_GID: u32 = 61150;
/// The attacker: neither admin nor bound to anything.
const UID_ATTACKER: u32 = 61011;
/// The victim of the memory test.
const UID_VICTIM: u32 = 61012;
/// The victim of the admin test: a member of the admin group.
const UID_ADMIN: u32 = 61014;
/// What the victim keeps in its locked page.
const SECRET: &str = "victim-secret-0123456789";

/// This test binary's `child` test run as `uid` (primary gid `SOCKET_GID`, supplementary
/// `groups`) with `stdin` as its standard input.
fn spawn(child: &str, socket: &std::path::Path, uid: u32, groups: &[u32], stdin: Stdio) -> Child {
    let mut cmd = common::child_as(child, ENV_SOCKET, socket, uid, SOCKET_GID, groups);
    cmd.stdin(stdin);
    cmd.spawn().unwrap()
}

/// The next line a child prints after `answer: ` (libtest prints its own text too).
fn answer(out: &mut BufReader<ChildStdout>) -> String {
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "a child exited before answering");
        if let Some((_, a)) = line.split_once("answer: ") {
            return a.trim_end().to_owned();
        }
    }
}

/// A connection made by a process of `UID_ATTACKER` that has exited since (reaped): the
/// connection and the pid it had.
fn orphaned_connection(socket: &std::path::Path) -> (Connection, u32) {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let mut p = spawn("pidreuse_attacker_child", socket, UID_ATTACKER, &[], Stdio::from(OwnedFd::from(theirs)));
    let pid = p.id();
    let mut buf = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = nix::sys::socket::recvmsg::<()>(
        mine.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .unwrap();
    let fd = msg
        .cmsgs()
        .unwrap()
        .find_map(|c| match c {
            nix::sys::socket::ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
            _ => None,
        })
        .expect("the attacker sent its connection");
    // SAFETY: the kernel installed this descriptor for the message just received.
    let stream = UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
    assert!(p.wait().unwrap().success(), "the attacker's process exited cleanly");
    stream.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    let mut conn = Connection::new(stream);
    conn.hello("pidreuse-test", SUPPORTED_VERSIONS).unwrap();
    (conn, pid)
}

/// Starts the victim child as `uid` with `groups` at pid `pid` (free: its process was
/// reaped), by writing `pid - 1` to `ns_last_pid` just before; retries while other
/// processes of the machine take the pid first. `None` when it never got it.
fn victim_at(pid: u32, socket: &std::path::Path, uid: u32, groups: &[u32]) -> Option<(Child, BufReader<ChildStdout>)> {
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", pid - 1)).unwrap();
        let mut v = spawn("pidreuse_victim_child", socket, uid, groups, Stdio::piped());
        if v.id() == pid {
            let out = BufReader::new(v.stdout.take().unwrap());
            return Some((v, out));
        }
        let _ = v.kill();
        let _ = v.wait();
    }
    None
}

/// A daemon whose admins are `ADMIN_GID`'s members, when this test may run.
fn setup() -> Option<(common::Setup, common::Daemon)> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root to run processes under other uids and to choose a pid");
        return None;
    }
    if std::fs::OpenOptions::new().write(true).open("/proc/sys/kernel/ns_last_pid").is_err() {
        eprintln!("skipped: /proc/sys/kernel/ns_last_pid cannot be written here");
        return None;
    }
    let s = common::Setup::new(&format!("group = \"{SOCKET_GID}\"\nadmin_group = \"{ADMIN_GID}\""));
    let d = common::start(&s.config, s.dir.path());
    Some((s, d))
}

fn gpu() -> String {
    let f = Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap();
    f.inventory().devices.iter().find(|d| d.gpu.is_some()).unwrap().id.to_string()
}

fn register(c: &mut Connection, source: RegisterSource, fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<u64, ErrorBody> {
    let req = RegisterRequest {
        device: DeviceName::truncated(&gpu()),
        source,
        offset: 0,
        len: 4096,
        access: AccessMode::ReadWrite,
        node: None,
    };
    match c.call(Request::Register(req), fds) {
        Ok((Response::Register(r), _)) => Ok(r.registration),
        Err(CodecError::Refused { body, .. }) => Err(body),
        other => panic!("register: {other:?}"),
    }
}

#[test]
fn a_reused_pid_gives_no_access_to_the_new_process_memory() {
    let Some((s, _daemon)) = setup() else { return };
    let (mut conn, pid) = orphaned_connection(&s.socket);
    let Some((mut victim, mut out)) = victim_at(pid, &s.socket, UID_VICTIM, &[]) else {
        eprintln!("skipped: pid {pid} kept being taken by other processes");
        return;
    };
    let addr: u64 = u64::from_str_radix(answer(&mut out).strip_prefix("addr=0x").unwrap(), 16).unwrap();

    // The attacker's connection names the victim's locked secret as its own memory.
    let attack = register(&mut conn, RegisterSource::Process { addr }, &[]);
    if let Ok(reg) = attack {
        // What the code before the fix allowed: overwrite it through a copy.
        let memfd = memfd_with(b"attacker-bytes");
        let from = register(&mut conn, RegisterSource::Fd, &[memfd.as_fd()]).unwrap();
        let copy = CopyRequest {
            dst: CopyEndpoint::Registration { id: reg, offset: 0 },
            src: CopyEndpoint::Registration { id: from, offset: 0 },
            len: 14,
        };
        if let Ok((Response::Copy(c), _)) = conn.call(Request::Copy(copy), &[]) {
            while !matches!(conn.next_event().unwrap(), Event::CopyDone(d) if d.copy == c.copy) {}
        }
    }
    writeln!(victim.stdin.as_mut().unwrap(), "secret").unwrap();
    let now = answer(&mut out);
    drop(victim.stdin.take());
    victim.wait().unwrap();
    assert_eq!(now, SECRET, "another uid's locked memory was written through a reused pid");
    let e = attack.expect_err("registering another process's memory through a reused pid was accepted");
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{}", e.message);
    assert!(e.message.contains("has exited"), "{}", e.message);
    // No refusal describes any process's mappings.
    assert!(!e.message.contains("0x"), "{}", e.message);
}

#[test]
fn a_reused_pid_gives_no_admin_rights_of_the_new_process() {
    let Some((s, _daemon)) = setup() else { return };
    let (mut conn, pid) = orphaned_connection(&s.socket);
    let Some((mut admin, mut out)) = victim_at(pid, &s.socket, UID_ADMIN, &[ADMIN_GID]) else {
        eprintln!("skipped: pid {pid} kept being taken by other processes");
        return;
    };
    answer(&mut out);
    let spec = PartitionSpec {
        name: "stolen".try_into().unwrap(),
        devices: vec![gpu().as_str().try_into().unwrap()].try_into().unwrap(),
        uids: vec![UID_ATTACKER].try_into().unwrap(),
        gids: Vec::new().try_into().unwrap(),
    };
    let r = conn.call(Request::Partitions(PartitionsRequest::Set(spec)), &[]);
    drop(admin.stdin.take());
    admin.wait().unwrap();
    match r {
        Err(CodecError::Refused { body, .. }) => assert_eq!(body.code, ErrorCode::AdminRequired, "{}", body.message),
        other => panic!("a non-admin's connection changed partitions through a reused pid: {other:?}"),
    }
}

fn memfd_with(bytes: &[u8]) -> std::fs::File {
    use std::os::unix::fs::FileExt;
    // SAFETY: a NUL-terminated name and flags; returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"pidreuse".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just made and nothing else owns it.
    let f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.set_len(4096).unwrap();
    f.write_all_at(bytes, 0).unwrap();
    f
}

/// The attacker: connects, and asks for a ping before any hello (refused
/// `NotNegotiated`: an answer, so the daemon has accepted the connection and taken this
/// process as its peer, without agreeing a version, which the test's process then does),
/// sends the connection to the test on its standard input (a Unix socket) and exits.
#[test]
#[ignore = "a child process of this file's tests, which run it"]
fn pidreuse_attacker_child() {
    let Some(socket) = std::env::var_os(ENV_SOCKET) else { return };
    let mut conn = Connection::new(UnixStream::connect(std::path::Path::new(&socket)).unwrap());
    match conn.call(Request::Ping, &[]) {
        Err(CodecError::Refused { body, .. }) => assert_eq!(body.code, ErrorCode::NotNegotiated, "{body:?}"),
        other => panic!("a ping before hello: {other:?}"),
    }
    let fds = [conn.stream().as_raw_fd()];
    let cmsgs = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
    let iov = [std::io::IoSlice::new(b"c")];
    nix::sys::socket::sendmsg::<()>(0, &iov, &cmsgs, nix::sys::socket::MsgFlags::empty(), None).unwrap();
}

/// The victim: locks a page holding [`SECRET`], prints its address, and on `secret`
/// prints what the page holds now; exits at the end of its input.
#[test]
#[ignore = "a child process of this file's tests, which run it"]
fn pidreuse_victim_child() {
    if std::env::var_os(ENV_SOCKET).is_none() {
        return;
    }
    let mut page = memmap2::MmapMut::map_anon(4096).unwrap();
    page[..SECRET.len()].copy_from_slice(SECRET.as_bytes());
    // SAFETY: locks the page just mapped; it stays mapped until the end.
    assert_eq!(unsafe { libc::mlock(page.as_ptr().cast(), 4096) }, 0);
    println!("answer: addr={:#x}", page.as_ptr() as usize);
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        if line.unwrap() == "secret" {
            // Read through a volatile copy: the daemon may have written it meanwhile.
            let now: Vec<u8> =
                // SAFETY: the page is mapped for its 4096 bytes; SECRET is shorter.
                (0..SECRET.len()).map(|i| unsafe { std::ptr::read_volatile(page.as_ptr().add(i)) }).collect();
            println!("answer: {}", String::from_utf8_lossy(&now));
            std::io::stdout().flush().unwrap();
        }
    }
}
