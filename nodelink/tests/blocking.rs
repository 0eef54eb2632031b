//! The blocking client link against the real server on 127.0.0.1: it links, is answered
//! and refused as the async link is, and every wait ends at its deadline — a server that
//! never finishes the handshake, one slow to answer, one that closes mid-way. A server
//! that answers garbage (a hostile or broken peer, with a valid certificate) gets a typed
//! error, never a panic or a wait past the deadline, and the link refuses any later call.
//! A call that polls its socket for the answer first behaves the same.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{DOMAIN, SERVER_INCARNATION, TestDomain, limits};
use fabric_nodelink::framed::Framed;
use fabric_nodelink::{
    BlockingLink, LinkError, NodeIdentity, PEER_PROTOCOL, Peer, PeerError, PeerMessage, PeerOp, PeerRequest,
    PeerResponse, PeerService, Refusal, Served, Server, Stage, Welcome,
};
use fabric_proto::wire::{FrameKind, Header, Opcode};
use tokio::io::AsyncWriteExt;

/// Echoes a request's body; holds a request whose body is one zero for two seconds first.
struct Echo;

impl PeerService for Echo {
    fn serve(&self, _peer: &Peer, request: PeerRequest) -> Served {
        Box::pin(async move {
            if request.body == [0] {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Ok(PeerResponse { op: request.op, body: request.body })
        })
    }
}

/// An [`Echo`] server as node `n1` of `d`'s domain.
async fn echo_server(d: &TestDomain) -> Server {
    let server_creds = common::creds(&d.ca, "n1");
    let any = "127.0.0.1:0".parse().expect("addr");
    Server::bind_serving(any, &server_creds, 7, d.members.clone(), Arc::new(Echo), limits()).await.expect("server")
}

/// Links from a thread of its own (the blocking link is for threads that are no
/// runtime's workers).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("the blocking side panicked")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_links_and_is_answered_and_refused_as_on_the_async_link() {
    let d = TestDomain::start(limits()).await;
    let (addr, creds, server) = (d.addr(), d.creds("n2"), d.server_id.clone());
    blocking(move || {
        let mut link = BlockingLink::connect(addr, &creds, &server, 1, limits()).expect("link");
        assert_eq!(link.peer(), &server);
        assert_eq!(link.peer_incarnation(), SERVER_INCARNATION);
        let deadline = Instant::now() + Duration::from_secs(3);
        for _ in 0..3 {
            let answer = link.call(PeerRequest { op: PeerOp::Import, body: vec![1, 2, 3] }, deadline);
            // The server's answer, and the link still sound after it.
            assert!(matches!(answer, Err(LinkError::Peer(PeerError::Unsupported(PeerOp::Import)))), "{answer:?}");
        }
    })
    .await;
    // A pinging peer is not held up by it, and the link counts as one admitted.
    let mut good = d.good_peer().await;
    common::assert_pong(&mut good).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_not_the_expected_node_a_stale_incarnation_and_a_non_member_are_refused() {
    let d = TestDomain::start(limits()).await;
    d.members.set("n3", 2);
    let (addr, ca_creds) = (d.addr(), [d.creds("n2"), d.creds("n3"), d.creds("n9")]);
    let server = d.server_id.clone();
    blocking(move || {
        let [n2, n3, n9] = ca_creds;
        let wrong = NodeIdentity::new(DOMAIN, "n3").expect("id");
        let r = BlockingLink::connect(addr, &n2, &wrong, 1, limits());
        assert!(matches!(r, Err(LinkError::Io(_))), "{r:?}");
        let r = BlockingLink::connect(addr, &n3, &server, 1, limits());
        assert!(matches!(r, Err(LinkError::Refused(Refusal::StaleIncarnation { offered: 1, .. }))), "{r:?}");
        let r = BlockingLink::connect(addr, &n9, &server, 1, limits());
        assert!(matches!(r, Err(LinkError::Refused(Refusal::NotMember(_)))), "{r:?}");
        BlockingLink::connect(addr, &n3, &server, 2, limits()).expect("the current incarnation links");
    })
    .await;
}

/// Node names are DNS labels, digits alone included; TLS takes no such name as a host's
/// (it could be an IPv4 address). A node named `1` or `0x1f` is dialled all the same, on
/// either link, and still only when its certificate names it. Before, every dial to it
/// failed before connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_name_is_all_digits_is_dialled() {
    let d = TestDomain::start(limits()).await;
    for name in ["1", "0x1f"] {
        let creds = common::creds(&d.ca, name);
        let any = "127.0.0.1:0".parse().expect("addr");
        let server =
            Server::bind_serving(any, &creds, 7, d.members.clone(), Arc::new(Echo), limits()).await.expect("server");
        let (addr, n2, id) = (server.local_addr(), d.creds("n2"), creds.identity().clone());
        let mut link = fabric_nodelink::Link::connect(addr, &n2, &id, 1, limits()).await.expect("async link");
        common::assert_pong(&mut link).await;
        let other = NodeIdentity::new(DOMAIN, "n3").expect("id");
        blocking(move || {
            let mut link = BlockingLink::connect(addr, &n2, &id, 1, limits()).expect("blocking link");
            let r = link.call(PeerRequest { op: PeerOp::Copy, body: vec![5] }, Instant::now() + Duration::from_secs(3));
            assert_eq!(r.expect("answer").body, [5]);
            // Its certificate names it, not n3: refused.
            assert!(BlockingLink::connect(addr, &n2, &other, 1, limits()).is_err());
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_come_back_whole_and_a_slow_one_ends_at_the_callers_deadline() {
    let d = TestDomain::start(limits()).await;
    let echo = echo_server(&d).await;
    let (addr, creds, server) = (echo.local_addr(), d.creds("n2"), d.server_id.clone());
    blocking(move || {
        let mut link = BlockingLink::connect(addr, &creds, &server, 1, limits()).expect("link");
        // A body of several TLS records and reads (a copy chunk's size).
        let body: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        let r = link.call(PeerRequest { op: PeerOp::Copy, body: body.clone() }, deadline).expect("answer");
        assert_eq!((r.op, r.body.len()), (PeerOp::Copy, body.len()));
        assert!(r.body == body);
        let start = Instant::now();
        let deadline = start + Duration::from_millis(300);
        let r = link.call(PeerRequest { op: PeerOp::Import, body: vec![0] }, deadline);
        assert!(matches!(r, Err(LinkError::Timeout(Stage::Idle))), "{r:?}");
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(290) && waited < Duration::from_millis(1500), "{waited:?}");
    })
    .await;
}

/// A call that gave up waiting leaves its answer pending: read late, it is the answer
/// (what an importer that gave up needs, to give back what the owner granted meanwhile);
/// the link stays broken for calls, and nothing is pending after a call that was answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_given_up_on_is_read_late() {
    let d = TestDomain::start(limits()).await;
    let echo = echo_server(&d).await;
    let (addr, creds, server) = (echo.local_addr(), d.creds("n2"), d.server_id.clone());
    blocking(move || {
        let mut link = BlockingLink::connect(addr, &creds, &server, 1, limits()).expect("link");
        let r = link.call(PeerRequest { op: PeerOp::Copy, body: vec![7] }, Instant::now() + Duration::from_secs(5));
        assert_eq!(r.expect("answer").body, [7]);
        assert!(!link.answer_pending());
        assert!(matches!(link.late_answer(Instant::now() + Duration::from_secs(1)), Err(LinkError::Closed)));
        // The echo holds this one two seconds; the call gives up after 300 ms.
        let start = Instant::now();
        let r = link.call(PeerRequest { op: PeerOp::Import, body: vec![0] }, start + Duration::from_millis(300));
        assert!(matches!(r, Err(LinkError::Timeout(Stage::Idle))), "{r:?}");
        assert!(link.answer_pending() && link.is_broken());
        let late = link.late_answer(start + Duration::from_secs(5)).expect("the late answer");
        assert_eq!((late.op, late.body), (PeerOp::Import, vec![0]));
        assert!(!link.answer_pending(), "read once");
        let r = link.call(PeerRequest { op: PeerOp::Copy, body: vec![7] }, Instant::now() + Duration::from_secs(5));
        assert!(matches!(r, Err(LinkError::Closed)), "still broken for calls: {r:?}");
        // A late answer has its own deadline.
        let mut link = BlockingLink::connect(addr, &creds, &server, 1, limits()).expect("link");
        let start = Instant::now();
        let r = link.call(PeerRequest { op: PeerOp::Import, body: vec![0] }, start + Duration::from_millis(100));
        assert!(r.is_err() && link.answer_pending());
        let late = link.late_answer(Instant::now() + Duration::from_millis(200));
        assert!(matches!(late, Err(LinkError::Timeout(_))), "{late:?}");
        assert!(start.elapsed() < Duration::from_millis(1500));
    })
    .await;
}

/// A call that polls for its answer gets the same answers; one that comes after the poll
/// is spent is still read (the socket sleeps again, blocking), and the deadline holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_polled_for_is_the_same_and_one_after_the_poll_is_read_asleep() {
    let d = TestDomain::start(limits()).await;
    let echo = echo_server(&d).await;
    let (addr, creds, server) = (echo.local_addr(), d.creds("n2"), d.server_id.clone());
    blocking(move || {
        let mut link = BlockingLink::connect(addr, &creds, &server, 1, limits()).expect("link");
        // Longer than a loopback answer takes: these are found by the poll.
        link.set_answer_poll(Duration::from_millis(50));
        let body: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        for n in [1usize, 100, body.len()] {
            let deadline = Instant::now() + Duration::from_secs(5);
            let r = link.call(PeerRequest { op: PeerOp::Copy, body: body[..n].to_vec() }, deadline).expect("answer");
            assert_eq!((r.op, &r.body[..]), (PeerOp::Copy, &body[..n]));
        }
        // The echo holds this one two seconds: the 1 ms poll is long spent, and the
        // thread reads the answer asleep, well within the call's deadline.
        link.set_answer_poll(Duration::from_millis(1));
        let start = Instant::now();
        let r = link.call(PeerRequest { op: PeerOp::Import, body: vec![0] }, start + Duration::from_secs(5));
        assert_eq!(r.expect("the late answer").body, [0]);
        let waited = start.elapsed();
        assert!(waited >= Duration::from_secs(2) && waited < Duration::from_secs(4), "{waited:?}");
        // The link is sound after it, and a deadline shorter than the hold still ends the
        // call in time, the poll or not.
        let r = link.call(PeerRequest { op: PeerOp::Copy, body: vec![7] }, Instant::now() + Duration::from_secs(5));
        assert_eq!(r.expect("answer").body, [7]);
        let start = Instant::now();
        let r = link.call(PeerRequest { op: PeerOp::Import, body: vec![0] }, start + Duration::from_millis(300));
        assert!(matches!(r, Err(LinkError::Timeout(Stage::Idle))), "{r:?}");
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(290) && waited < Duration::from_millis(1500), "{waited:?}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_finishes_the_handshake_or_closes_is_given_up_in_time() {
    let d = TestDomain::start(limits()).await;
    let creds = d.creds("n2");
    let server = d.server_id.clone();
    blocking(move || {
        // Accepts and says nothing.
        let mute = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = mute.local_addr().expect("addr");
        let start = Instant::now();
        let r = BlockingLink::connect(addr, &creds, &server, 1, limits());
        assert!(matches!(r, Err(LinkError::Timeout(Stage::Handshake))), "{r:?}");
        let waited = start.elapsed();
        let handshake = limits().handshake_timeout;
        assert!(waited >= handshake && waited < handshake + Duration::from_secs(1), "{waited:?}");
        // Accepts and closes at once.
        let closing = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = closing.local_addr().expect("addr");
        let closer = std::thread::spawn(move || drop(closing.accept()));
        let r = BlockingLink::connect(addr, &creds, &server, 1, limits());
        assert!(matches!(r, Err(LinkError::Io(_) | LinkError::Closed)), "{r:?}");
        closer.join().expect("closer");
        drop(mute);
        // Trickles a TLS record: a header that promises 16,000 bytes, then one byte every
        // 100 ms. Each read returns before its timeout; the handshake's deadline still holds.
        let trickle = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = trickle.local_addr().expect("addr");
        let trickler = std::thread::spawn(move || {
            use std::io::Write;
            let (mut s, _) = trickle.accept().expect("accept");
            let _ = s.write_all(&[0x16, 0x03, 0x03, 0x3e, 0x80]);
            for _ in 0..60 {
                std::thread::sleep(Duration::from_millis(100));
                if s.write_all(&[0]).is_err() {
                    return;
                }
            }
        });
        let start = Instant::now();
        let r = BlockingLink::connect(addr, &creds, &server, 1, limits());
        assert!(matches!(r, Err(LinkError::Timeout(Stage::Handshake))), "{r:?}");
        let waited = start.elapsed();
        assert!(waited >= handshake && waited < handshake + Duration::from_secs(1), "{waited:?}");
        trickler.join().expect("trickler");
    })
    .await;
}

/// What a hostile server answers the first request with, after a proper Welcome.
#[derive(Debug, Clone, Copy)]
enum Garbage {
    BadMagic,
    Oversized,
    OtherId,
    Truncated,
    /// Half a frame, then the TCP connection closed (no TLS close_notify).
    CutMidFrame,
}

/// Serves one link as node `n1` of `d`'s domain: welcomes, reads one request, answers
/// `garbage`, then holds the connection open for a while.
async fn hostile_server(d: &TestDomain, garbage: Garbage) -> std::net::SocketAddr {
    let acceptor = tokio_rustls::TlsAcceptor::from(common::creds(&d.ca, "n1").server_config().expect("config"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        let tls = acceptor.accept(tcp).await.expect("tls");
        let mut framed = Framed::new(tls, Duration::from_secs(2));
        let (_, hello) = framed.recv(Duration::from_secs(2)).await.expect("hello");
        assert!(matches!(hello, PeerMessage::Hello(_)), "{hello:?}");
        let welcome = Welcome { node: "n1".into(), incarnation: SERVER_INCARNATION, version: PEER_PROTOCOL };
        framed.send(0, &PeerMessage::Welcome(welcome)).await.expect("welcome");
        let (id, _) = framed.recv(Duration::from_secs(2)).await.expect("request");
        let header = |body_len| {
            let h = Header { body_len, ..Header::new(Opcode::Import, FrameKind::Response, id) };
            zerocopy::IntoBytes::as_bytes(&h.to_raw()).to_vec()
        };
        match garbage {
            Garbage::OtherId => framed.send(id + 7, &PeerMessage::Pong).await.expect("answer"),
            other => {
                let bytes = match other {
                    Garbage::BadMagic => {
                        let mut h = header(0);
                        h[..4].copy_from_slice(b"EVIL");
                        h
                    }
                    Garbage::Oversized => header(64 << 20),
                    // A header that promises a body, then half of one.
                    _ => [header(64), vec![0; 32]].concat(),
                };
                let mut tls = framed.into_inner();
                tls.write_all(&bytes).await.expect("garbage");
                tls.flush().await.expect("flush");
                if matches!(other, Garbage::CutMidFrame) {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(3)).await;
                return;
            }
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_answers_garbage_is_refused_with_a_typed_error_in_time() {
    let d = TestDomain::start(limits()).await;
    let all = [Garbage::BadMagic, Garbage::Oversized, Garbage::OtherId, Garbage::Truncated, Garbage::CutMidFrame];
    // Each with the answer read at once and with it polled for first (a garbage answer
    // ends the poll as any bytes do; the read then says what is wrong with them).
    for (garbage, poll) in all.into_iter().flat_map(|g| [(g, Duration::ZERO), (g, Duration::from_millis(5))]) {
        let addr = hostile_server(&d, garbage).await;
        let (creds, server) = (d.creds("n2"), d.server_id.clone());
        let (r, waited) = blocking(move || {
            let mut link = BlockingLink::connect(addr, &creds, &server, 1, limits()).expect("link");
            link.set_answer_poll(poll);
            let start = Instant::now();
            let r = link.call(PeerRequest { op: PeerOp::Import, body: vec![1] }, start + Duration::from_secs(5));
            let waited = start.elapsed();
            // The stream may stand inside a frame: the link refuses to read on.
            assert!(link.is_broken(), "{garbage:?}");
            let again = link.call(PeerRequest { op: PeerOp::Import, body: vec![1] }, start + Duration::from_secs(5));
            assert!(matches!(again, Err(LinkError::Closed)), "{garbage:?}: {again:?}");
            (r, waited)
        })
        .await;
        let typed = match garbage {
            Garbage::BadMagic | Garbage::Oversized => matches!(r, Err(LinkError::Frame(_))),
            Garbage::OtherId => matches!(r, Err(LinkError::Unexpected { .. })),
            // The frame time (1 s in these limits) runs out inside the frame.
            Garbage::Truncated => matches!(r, Err(LinkError::Timeout(Stage::Frame))),
            Garbage::CutMidFrame => matches!(r, Err(LinkError::Truncated)),
        };
        assert!(typed, "{garbage:?}: {r:?}");
        assert!(waited < Duration::from_secs(2), "{garbage:?}: {waited:?}");
    }
}
