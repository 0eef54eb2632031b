//! Hostile clients — garbage, wrong magic, oversized announcements, unknown opcodes,
//! undecodable bodies, announced descriptors, truncated and stalled frames, abrupt
//! disconnects — get typed errors or are dropped, while another client keeps being served.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use fabric_proto::wire::{
    Connection, ErrorCode, FrameKind, Header, Message, Opcode, Request, Response, StatusRequest, encode_frame,
    recv_message,
};

fn raw(socket: &std::path::Path) -> UnixStream {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

fn frame(op: Opcode, id: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_frame(&Header::new(op, FrameKind::Request, id), body, &mut out).unwrap();
    out
}

/// Reads one error frame: its request id and code.
fn error(s: &UnixStream) -> (u64, ErrorCode) {
    match recv_message(s).unwrap() {
        (h, Message::Error(e), _) => (h.request_id, e.code),
        other => panic!("expected an error frame, got {other:?}"),
    }
}

fn closed(mut s: &UnixStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0))
}

fn still_served(c: &mut Connection) {
    let (r, _) = c.call(Request::Status(StatusRequest {}), &[]).unwrap();
    assert!(matches!(r, Response::Status(_)));
}

#[test]
fn hostile_frames_get_typed_errors_or_a_close_and_others_keep_being_served() {
    let s = common::Setup::new("");
    let mut d = common::start(&s.config, s.dir.path());
    let mut good = common::client(&s.socket);
    still_served(&mut good);

    // Wrong magic: BadFrame, then closed (the stream cannot be resynchronised).
    let mut bytes = frame(Opcode::Status, 1, &[]);
    bytes[..4].copy_from_slice(b"XXXX");
    let mut c = raw(&s.socket);
    c.write_all(&bytes).unwrap();
    assert_eq!(error(&c).1, ErrorCode::BadFrame);
    assert!(closed(&c));
    still_served(&mut good);

    // A header announcing a 60 MB body: refused before anything is read or allocated.
    let mut bytes = frame(Opcode::Status, 2, &[]);
    bytes[12..16].copy_from_slice(&(60u32 << 20).to_le_bytes());
    let mut c = raw(&s.socket);
    c.write_all(&bytes).unwrap();
    assert_eq!(error(&c).1, ErrorCode::BadFrame);
    assert!(closed(&c));

    // Random garbage.
    let mut c = raw(&s.socket);
    let junk: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let _ = c.write_all(&junk);
    assert_eq!(error(&c).1, ErrorCode::BadFrame);
    still_served(&mut good);

    // Unknown opcode with a small body: skipped, UnknownOpcode with the request's id, and
    // the connection stays usable.
    let mut bytes = frame(Opcode::Status, 42, &[]);
    bytes[6..8].copy_from_slice(&0x7777u16.to_le_bytes());
    bytes[12..16].copy_from_slice(&10u32.to_le_bytes());
    bytes.extend_from_slice(&[0xAB; 10]);
    let mut c = raw(&s.socket);
    c.write_all(&bytes).unwrap();
    assert_eq!(error(&c), (42, ErrorCode::UnknownOpcode));
    let mut conn = Connection::new(c);
    conn.hello("after-unknown", fabric_proto::wire::SUPPORTED_VERSIONS).unwrap();
    still_served(&mut conn);

    // A body that does not decode (Status takes none): BadRequest, connection kept.
    let s2 = conn.stream().try_clone().unwrap();
    (&s2).write_all(&frame(Opcode::Status, 77, &[1, 2, 3])).unwrap();
    assert_eq!(error(&s2), (77, ErrorCode::BadRequest));
    // A descriptor announced (Register may carry one) but none sent with the frame: BadFds.
    let mut bytes = frame(Opcode::Register, 78, &[0; 8]);
    bytes[8..10].copy_from_slice(&(1u16 << 3).to_le_bytes());
    bytes[10] = 1;
    (&s2).write_all(&bytes).unwrap();
    assert_eq!(error(&s2), (78, ErrorCode::BadFds));
    still_served(&mut conn);

    // Half a header, then gone; a stalled client that never finishes its frame; a client
    // that disconnects with a request in flight.
    let mut c = raw(&s.socket);
    c.write_all(&frame(Opcode::Status, 5, &[])[..10]).unwrap();
    drop(c);
    let mut stalled = raw(&s.socket);
    stalled.write_all(&frame(Opcode::Status, 6, &[])[..20]).unwrap();
    for _ in 0..20 {
        let c = common::client(&s.socket);
        let id = 1000;
        let mut req = Vec::new();
        fabric_proto::wire::encode_message(
            &Header { version: c.version(), ..Header::new(Opcode::Topology, FrameKind::Request, id) },
            &Message::Request(Request::Topology(Default::default())),
            &mut req,
        )
        .unwrap();
        let st = c.stream().try_clone().unwrap();
        (&st).write_all(&req).unwrap();
        drop(st);
        drop(c);
    }
    still_served(&mut good);

    // Many clients at once, all answered.
    let threads: Vec<_> = (0..64)
        .map(|_| {
            let sock = s.socket.clone();
            std::thread::spawn(move || {
                let mut c = common::client(&sock);
                still_served(&mut c);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    still_served(&mut good);
    drop(stalled);

    assert!(d.child.try_wait().unwrap().is_none(), "the daemon is still running");
    let log = d.log();
    assert!(!log.contains("panicked"), "{log}");
    assert!(log.contains("bad magic"), "the refusal is logged: {log}");
}
