//! The blocking transport over real Unix socket pairs: memory objects passed as
//! descriptors and read back, extra descriptors closed, missing ones refused, truncated
//! and stalled frames, peer credentials, and a client `Connection` against a tiny server.

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::Duration;

use fabric_proto::wire::*;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};

fn memfd_with(content: &[u8]) -> File {
    let fd = memfd_create("fabric-test", MFdFlags::MFD_CLOEXEC).unwrap();
    let mut f = File::from(fd);
    f.write_all(content).unwrap();
    f
}

fn alloc_response() -> Message {
    Message::Response(Response::Alloc(AllocResponse {
        region: 5,
        generation: 1,
        size: 4096,
        gfa: Some(1 << 40),
        offset: 0,
        grant: None,
    }))
}

fn frame_bytes(header: &Header, msg: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    encode_message(header, msg, &mut out).unwrap();
    out
}

/// Sends raw bytes with any descriptors, bypassing the codec's checks.
fn send_raw(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) {
    let iov = [std::io::IoSlice::new(bytes)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
    let n = sendmsg::<UnixAddr>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).unwrap();
    assert_eq!(n, bytes.len());
}

/// A pipe whose read end does not block: `Ok(0)` once every write end is closed.
fn pipe() -> (File, OwnedFd) {
    let (r, w) = std::io::pipe().unwrap();
    let r = File::from(OwnedFd::from(r));
    fcntl(r.as_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).unwrap();
    (r, OwnedFd::from(w))
}

fn write_end_closed(r: &mut File) -> bool {
    match r.read(&mut [0u8; 1]) {
        Ok(0) => true,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        other => panic!("unexpected pipe read {other:?}"),
    }
}

#[test]
fn a_memfd_travels_and_reads_back() {
    let (a, b) = UnixStream::pair().unwrap();
    let mem = memfd_with(b"fabric memory contents");
    let header = Header::new(Opcode::Alloc, FrameKind::Response, 42);
    send_message(&a, &header, &alloc_response(), &[mem.as_fd()]).unwrap();

    let (h, msg, fds) = recv_message(&b).unwrap();
    assert_eq!((h.opcode, h.kind, h.request_id, h.fd_count), (Opcode::Alloc, FrameKind::Response, 42, 1));
    assert_eq!(msg, alloc_response());
    assert_eq!(fds.len(), 1);
    let mut got = File::from(fds.into_iter().next().unwrap());
    // The same object, not a copy: same inode, and writes on one side show on the other.
    assert_eq!(got.metadata().unwrap().ino(), mem.metadata().unwrap().ino());
    let mut text = String::new();
    got.seek(SeekFrom::Start(0)).unwrap();
    got.read_to_string(&mut text).unwrap();
    assert_eq!(text, "fabric memory contents");
    got.write_all(b"!").unwrap();
    assert_eq!(mem.metadata().unwrap().len(), 23);
}

#[test]
fn descriptors_beyond_the_header_are_closed() {
    let (a, b) = UnixStream::pair().unwrap();
    let mem = memfd_with(b"x");
    let (mut r1, w1) = pipe();
    let (mut r2, w2) = pipe();
    let header = Header { fd_count: 1, ..Header::new(Opcode::Import, FrameKind::Response, 7) };
    let msg = Message::Response(Response::Import(ImportResponse {
        import: 1,
        region: 2,
        generation: 3,
        size: 1,
        gfa: None,
        offset: 0,
        access: AccessMode::ReadOnly,
        grant: None,
    }));
    send_raw(&a, &frame_bytes(&header, &msg), &[mem.as_raw_fd(), w1.as_raw_fd(), w2.as_raw_fd()]);
    drop((w1, w2));
    // The receiver's copies of the write ends are all that keep the pipes open now.
    assert!(!write_end_closed(&mut r1) && !write_end_closed(&mut r2));

    let (_, got, fds) = recv_message(&b).unwrap();
    assert_eq!(got, msg);
    assert_eq!(fds.len(), 1);
    assert_eq!(File::from(fds.into_iter().next().unwrap()).metadata().unwrap().ino(), mem.metadata().unwrap().ino());
    assert!(write_end_closed(&mut r1), "extra descriptor 1 left open");
    assert!(write_end_closed(&mut r2), "extra descriptor 2 left open");
}

#[test]
fn descriptors_on_a_frame_that_announces_none_are_closed() {
    let (a, b) = UnixStream::pair().unwrap();
    let (mut r, w) = pipe();
    let msg = Message::Request(Request::Status(StatusRequest {}));
    send_raw(&a, &frame_bytes(&Header::new(Opcode::Status, FrameKind::Request, 1), &msg), &[w.as_raw_fd()]);
    drop(w);
    let (_, got, fds) = recv_message(&b).unwrap();
    assert_eq!(got, msg);
    assert!(fds.is_empty());
    assert!(write_end_closed(&mut r));
}

#[test]
fn descriptors_of_a_refused_header_are_closed() {
    let (a, b) = UnixStream::pair().unwrap();
    let (mut r, w) = pipe();
    let mut bytes = frame_bytes(
        &Header::new(Opcode::Status, FrameKind::Request, 1),
        &Message::Request(Request::Status(StatusRequest {})),
    );
    bytes[0] = b'X';
    send_raw(&a, &bytes, &[w.as_raw_fd()]);
    drop(w);
    assert!(matches!(recv_frame(&b), Err(CodecError::Frame(FrameError::BadMagic { .. }))));
    assert!(write_end_closed(&mut r));
}

#[test]
fn missing_and_mismatched_descriptors_are_refused() {
    let (a, b) = UnixStream::pair().unwrap();
    // Announces one descriptor, sends none.
    let header = Header { fd_count: 1, ..Header::new(Opcode::Alloc, FrameKind::Response, 3) };
    send_raw(&a, &frame_bytes(&header, &alloc_response()), &[]);
    assert!(matches!(recv_message(&b), Err(CodecError::MissingFds { announced: 1, received: 0 })));

    // An alloc response without its memory object.
    send_message(&a, &Header::new(Opcode::Alloc, FrameKind::Response, 4), &alloc_response(), &[]).unwrap();
    assert!(matches!(recv_message(&b), Err(CodecError::FdsMismatch { required: 1, received: 0, .. })));

    // A register of a region that also sends a descriptor.
    let mem = memfd_with(b"y");
    let reg = Message::Request(Request::Register(RegisterRequest {
        device: DeviceName::new("pci:n0/0000:01:00.0").unwrap(),
        source: RegisterSource::Region(9),
        offset: 0,
        len: 1,
        access: AccessMode::ReadWrite,
        node: None,
    }));
    send_message(&a, &Header::new(Opcode::Register, FrameKind::Request, 5), &reg, &[mem.as_fd()]).unwrap();
    assert!(matches!(recv_message(&b), Err(CodecError::FdsMismatch { required: 0, received: 1, .. })));

    // The sender refuses more descriptors than an opcode allows.
    let fds: Vec<BorrowedFd<'_>> = vec![mem.as_fd(); 2];
    assert!(matches!(
        send_message(&a, &Header::new(Opcode::Alloc, FrameKind::Response, 6), &alloc_response(), &fds),
        Err(CodecError::Body(BodyError::Frame(FrameError::TooManyFds { count: 2, max: 1, .. })))
    ));
}

#[test]
fn truncated_and_closed_streams_are_told_apart() {
    let msg = Message::Request(Request::Free(FreeRequest { region: u64::MAX, node: None }));
    let bytes = frame_bytes(&Header::new(Opcode::Free, FrameKind::Request, 1), &msg);
    for cut in 0..=bytes.len() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&bytes[..cut]).unwrap();
        drop(a);
        let r = recv_message(&b);
        match cut {
            0 => assert!(matches!(r, Err(CodecError::Closed)), "{cut}: {r:?}"),
            c if c == bytes.len() => assert_eq!(r.unwrap().1, msg),
            _ => assert!(matches!(r, Err(CodecError::Truncated { .. })), "{cut}: {r:?}"),
        }
    }
}

#[test]
fn a_stalled_peer_times_out() {
    let (a, b) = UnixStream::pair().unwrap();
    b.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let msg = Message::Request(Request::Free(FreeRequest { region: 1, node: None }));
    let bytes = frame_bytes(&Header::new(Opcode::Free, FrameKind::Request, 1), &msg);
    (&a).write_all(&bytes[..HEADER_LEN + 1 - 2]).unwrap();
    match recv_frame(&b) {
        Err(CodecError::Io(e)) => assert!(matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "{e}"),
        other => panic!("{other:?}"),
    }
}

/// A call given a time bound fails with `TimedOut` when the answer trickles in a byte at
/// a time, though every single read gets its byte well within the bound.
#[test]
fn a_call_that_trickles_times_out_as_a_whole() {
    let (a, b) = UnixStream::pair().unwrap();
    let server = thread::spawn(move || {
        let request = recv_frame(&b).unwrap();
        let header = Header::new(Opcode::Alloc, FrameKind::Response, request.header.request_id);
        let bytes = frame_bytes(&header, &alloc_response());
        for byte in &bytes[..bytes.len() - 1] {
            thread::sleep(Duration::from_millis(20));
            if (&b).write_all(std::slice::from_ref(byte)).is_err() {
                return;
            }
        }
    });
    a.set_read_timeout(Some(Duration::from_secs(7))).unwrap();
    let mut conn = Connection::new(a);
    conn.set_call_timeout(Some(Duration::from_millis(300)));
    let start = std::time::Instant::now();
    let r = conn.call(Request::Free(FreeRequest { region: 1, node: None }), &[]);
    let elapsed = start.elapsed();
    assert!(matches!(r, Err(CodecError::TimedOut { after }) if after == Duration::from_millis(300)), "{r:?}");
    assert!(elapsed >= Duration::from_millis(300) && elapsed < Duration::from_secs(5), "{elapsed:?}");
    // The socket's own timeouts are back as they were before the call.
    assert_eq!(conn.stream().read_timeout().unwrap(), Some(Duration::from_secs(7)));
    assert_eq!(conn.stream().write_timeout().unwrap(), None);
    drop(conn);
    server.join().unwrap();
}

/// `connect_unix` to a listener whose accept queue is full gives up with `TimedOut`
/// after the time given (a blocking connect waits there for ever); once the queue has
/// room, it connects.
#[test]
fn a_connect_to_a_full_accept_queue_times_out() {
    use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, bind, connect, listen, socket};
    let dir = std::env::temp_dir().join(format!("fabric-proto-connect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("full.sock");
    let _ = std::fs::remove_file(&path);
    let listener = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
    let addr = UnixAddr::new(&path).unwrap();
    bind(listener.as_raw_fd(), &addr).unwrap();
    listen(&listener, Backlog::new(0).unwrap()).unwrap();
    let mut queued = Vec::new();
    loop {
        let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)
            .unwrap();
        match connect(fd.as_raw_fd(), &addr) {
            Ok(()) => queued.push(fd),
            Err(nix::errno::Errno::EAGAIN) => break,
            Err(e) => panic!("filling the accept queue: {e}"),
        }
        assert!(queued.len() < 64, "the accept queue never filled");
    }
    let start = std::time::Instant::now();
    let r = connect_unix(&path, Some(Duration::from_millis(200)));
    let elapsed = start.elapsed();
    assert_eq!(r.as_ref().map(|_| ()).unwrap_err().kind(), ErrorKind::TimedOut, "{r:?}");
    assert!(elapsed >= Duration::from_millis(200) && elapsed < Duration::from_secs(5), "{elapsed:?}");
    // Room again: the queued connections accepted and closed.
    let listener = std::os::unix::net::UnixListener::from(listener);
    for _ in 0..queued.len() {
        drop(listener.accept().unwrap());
    }
    let stream = connect_unix(&path, Some(Duration::from_secs(5))).unwrap();
    assert!(stream.read_timeout().unwrap().is_none(), "the stream comes back blocking, without timeouts");
    drop(listener.accept().unwrap());
    // A timeout past what an `Instant` holds is no bound, not a panic.
    drop(connect_unix(&path, Some(Duration::MAX)).unwrap());
    assert_eq!(
        connect_unix(&dir.join("none.sock"), Some(Duration::from_secs(5))).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn peer_credentials_name_this_process() {
    let (a, b) = UnixStream::pair().unwrap();
    let cred = peer_cred(&a).unwrap();
    assert_eq!(cred.pid as u32, std::process::id());
    assert_eq!(cred.uid, nix::unistd::geteuid().as_raw());
    assert_eq!(cred.gid, nix::unistd::getegid().as_raw());
    assert_eq!(peer_cred(&b).unwrap(), cred);
}

#[test]
fn a_large_document_crosses_in_pieces() {
    let (a, b) = UnixStream::pair().unwrap();
    let json = "x".repeat(3 << 20);
    let msg =
        Message::Response(Response::Topology(Document { schema: Name::new("fabric.topology/v1").unwrap(), json }));
    let sent = msg.clone();
    let writer =
        thread::spawn(move || send_message(&a, &Header::new(Opcode::Topology, FrameKind::Response, 2), &sent, &[]));
    let (_, got, _) = recv_message(&b).unwrap();
    writer.join().unwrap().unwrap();
    assert_eq!(got, msg);
}

/// A server that speaks `supported`: answers hello, one alloc (with a memfd and an event
/// before it), then stops.
fn serve(sock: UnixStream, supported: VersionRange) {
    let (h, msg, _) = recv_message(&sock).unwrap();
    let Message::Request(Request::Hello(hello)) = msg else { panic!("{msg:?}") };
    assert_eq!(h.version, hello.versions.min, "hello travels at the oldest offered version");
    let version = match negotiate(hello.versions, supported) {
        Ok(v) => v,
        Err(e) => {
            send_message(&sock, &h.answer(FrameKind::Error), &Message::Error(e.into()), &[]).unwrap();
            return;
        }
    };
    let resp = Response::Hello(HelloResponse {
        version,
        server: Name::new("test").unwrap(),
        session: 77,
        max_request_body: MAX_REQUEST_BODY,
        max_fds: MAX_FDS,
        token: None,
    });
    send_message(&sock, &Header { version, ..h.answer(FrameKind::Response) }, &Message::Response(resp), &[]).unwrap();

    let (h, msg, _) = recv_message(&sock).unwrap();
    assert_eq!(h.version, version);
    assert!(matches!(msg, Message::Request(Request::Alloc(_))));
    let event = Message::Event(Event::Map(MapChange { generation: 9, added: 1, holed: 0, removed: 0 }));
    send_message(&sock, &Header::new(Opcode::Subscribe, FrameKind::Event, 1), &event, &[]).unwrap();
    let mem = memfd_with(b"region");
    send_message(&sock, &h.answer(FrameKind::Response), &alloc_response(), &[mem.as_fd()]).unwrap();
}

#[test]
fn a_connection_negotiates_calls_and_queues_events() {
    let (client, server) = UnixStream::pair().unwrap();
    let supported = VersionRange::new(Version::new(1, 0), Version::new(1, 2));
    let t = thread::spawn(move || serve(server, supported));
    let mut conn = Connection::new(client);
    let hello = conn.hello("wire-test", VersionRange::new(Version::new(1, 1), Version::new(1, 9))).unwrap();
    assert_eq!(hello.version, Version::new(1, 2));
    assert_eq!(conn.version(), Version::new(1, 2));
    assert_eq!(hello.session, 77);

    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::new("uuid:GPU-1").unwrap(), memory: MemoryClass::Hbm },
        size: 4096,
        align: 0,
    });
    let (resp, fds) = conn.call(req, &[]).unwrap();
    assert_eq!(Message::Response(resp), alloc_response());
    let mut mem = File::from(fds.into_iter().next().unwrap());
    let mut text = String::new();
    mem.seek(SeekFrom::Start(0)).unwrap();
    mem.read_to_string(&mut text).unwrap();
    assert_eq!(text, "region");
    let event = conn.next_event().unwrap();
    assert_eq!(event, Event::Map(MapChange { generation: 9, added: 1, holed: 0, removed: 0 }));
    t.join().unwrap();
}

#[test]
fn a_connection_reports_a_version_refusal() {
    let (client, server) = UnixStream::pair().unwrap();
    let supported = VersionRange::new(Version::new(1, 0), Version::new(1, 0));
    let t = thread::spawn(move || serve(server, supported));
    let mut conn = Connection::new(client);
    let offered = VersionRange::new(Version::new(1, 1), Version::new(1, 4));
    match conn.hello("wire-test", offered) {
        Err(CodecError::Refused { opcode: Opcode::Hello, body }) => {
            assert_eq!(body.code, ErrorCode::UnsupportedVersion);
            assert_eq!(body.detail, Some(ErrorDetail::Versions { offered, supported }));
        }
        other => panic!("{other:?}"),
    }
    t.join().unwrap();
}

#[test]
fn a_frame_the_client_refuses_is_read_whole_and_the_next_one_decodes() {
    let (a, b) = UnixStream::pair().unwrap();
    let refused = Message::Error(ErrorBody {
        code: ErrorCode::Internal,
        message: ErrorText::new("from a newer server").unwrap(),
        detail: None,
    });
    let after = Message::Response(Response::Free);
    // An opcode this client does not know, with a body.
    let mut unknown = frame_bytes(&Header::new(Opcode::Free, FrameKind::Error, 1), &refused);
    unknown[6..8].copy_from_slice(&0x7777u16.to_le_bytes());
    send_raw(&a, &unknown, &[]);
    send_message(&a, &Header::new(Opcode::Free, FrameKind::Response, 2), &after, &[]).unwrap();
    assert!(matches!(recv_frame(&b), Err(CodecError::Frame(FrameError::UnknownOpcode { code: 0x7777, .. }))));
    assert_eq!(recv_message(&b).unwrap().1, after);
    // More descriptors than a read makes room for (MAX_FDS): refused, all closed, in sync.
    let pipes: Vec<_> = (0..usize::from(MAX_FDS) + 1).map(|_| pipe()).collect();
    let raw: Vec<RawFd> = pipes.iter().map(|(_, w)| w.as_raw_fd()).collect();
    let header = Header { fd_count: 1, ..Header::new(Opcode::Alloc, FrameKind::Response, 3) };
    send_raw(&a, &frame_bytes(&header, &alloc_response()), &raw);
    send_message(&a, &Header::new(Opcode::Free, FrameKind::Response, 4), &after, &[]).unwrap();
    assert!(matches!(recv_message(&b), Err(CodecError::ControlTruncated)));
    for (mut r, w) in pipes {
        drop(w);
        assert!(write_end_closed(&mut r), "a descriptor of the refused frame is still open");
    }
    let (h, msg, _) = recv_message(&b).unwrap();
    assert_eq!((h.request_id, msg), (4, after));
}
