//! A client link on a blocking socket, for a thread that waits for its answer anyway (a
//! fabricd request thread asking another node for an import): the thread sleeps in the
//! socket's own read and the kernel wakes it when the answer arrives, with no runtime's
//! I/O driver in between to wake it in turn. The same TLS, Hello, frames, deadlines and
//! checks as the async [`crate::Link`] (the handshake's and the answer's checks are
//! shared with it); the server cannot tell the two apart. Every system call on the socket
//! — TLS's own reads and writes inside one record or the handshake included — is bounded
//! by the deadline of the step it serves (`Timed`), so a peer that trickles bytes
//! cannot stretch a step past it.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_proto::wire::FrameDecoder;
use rustls::{ClientConnection, StreamOwned};

use crate::error::{LinkError, Stage};
use crate::identity::NodeIdentity;
use crate::link::{LinkLimits, answer_to, hello_of, welcomed};
use crate::message::{PEER_DECODER, PeerMessage, PeerOp, PeerRequest, PeerResponse};
use crate::tls::{Credentials, server_name};

/// A socket whose every read and write ends by `deadline` (`TimedOut` once it passed).
#[derive(Debug)]
struct Timed {
    tcp: TcpStream,
    deadline: Instant,
}

impl Timed {
    /// The time left, as a socket timeout (never zero: that would mean "no timeout").
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() { Err(ErrorKind::TimedOut.into()) } else { Ok(left) }
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.tcp.set_read_timeout(Some(self.left()?))?;
        self.tcp.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tcp.set_write_timeout(Some(self.left()?))?;
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.tcp.flush()
    }
}

/// A link to another node, as its client, on a blocking socket (see the module doc).
#[derive(Debug)]
pub struct BlockingLink {
    stream: StreamOwned<ClientConnection, Timed>,
    decoder: FrameDecoder<OwnedFd>,
    out: Vec<u8>,
    peer: NodeIdentity,
    peer_incarnation: u64,
    /// The peer protocol the link speaks, from the Welcome.
    version: u16,
    next_id: u64,
    limits: LinkLimits,
    /// A call failed mid-way (other than by the peer's refusal): the stream may stand
    /// inside a frame or a TLS record, so no later call may read from it.
    broken: bool,
    /// How long a call polls the socket for its answer before it sleeps in the read
    /// ([`Self::set_answer_poll`]).
    answer_poll: Duration,
    /// The request sent whole whose answer was not read (its call gave up waiting):
    /// its id and op, for [`Self::late_answer`].
    pending: Option<(u64, PeerOp)>,
}

/// A socket error, a timeout where the socket's deadline passed.
fn io_error(e: std::io::Error, stage: Stage) -> LinkError {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => LinkError::Timeout(stage),
        _ => LinkError::Io(e),
    }
}

impl BlockingLink {
    /// Links to `expected` at `addr` as the node `creds` names, at `incarnation`, within
    /// the limits' handshake time.
    pub fn connect(
        addr: SocketAddr,
        creds: &Credentials,
        expected: &NodeIdentity,
        incarnation: u64,
        limits: LinkLimits,
    ) -> Result<Self, LinkError> {
        let deadline = Instant::now() + limits.handshake_timeout;
        let config: Arc<rustls::ClientConfig> = creds.client_config(expected)?;
        let name = server_name(expected)?;
        let tcp =
            TcpStream::connect_timeout(&addr, limits.handshake_timeout).map_err(|e| io_error(e, Stage::Handshake))?;
        let _ = tcp.set_nodelay(true);
        let tls = ClientConnection::new(config, name).map_err(|e| LinkError::Tls(e.into()))?;
        let mut link = Self {
            stream: StreamOwned::new(tls, Timed { tcp, deadline }),
            decoder: FrameDecoder::new(PEER_DECODER),
            out: Vec::new(),
            peer: expected.clone(),
            peer_incarnation: 0,
            version: 0,
            next_id: 1,
            limits,
            broken: false,
            answer_poll: Duration::ZERO,
            pending: None,
        };
        // The TLS handshake runs within the first write and the read after it.
        link.send(0, &PeerMessage::Hello(hello_of(creds, incarnation)), deadline, Stage::Handshake)?;
        let welcome = welcomed(expected, link.recv(deadline, deadline, Stage::Handshake)?)?;
        (link.peer_incarnation, link.version) = (welcome.incarnation, welcome.version);
        Ok(link)
    }

    /// The peer, as its certificate names it.
    pub fn peer(&self) -> &NodeIdentity {
        &self.peer
    }

    /// The peer's incarnation, from its Welcome.
    pub fn peer_incarnation(&self) -> u64 {
        self.peer_incarnation
    }

    /// The peer protocol the link speaks, from the Welcome.
    pub fn version(&self) -> u16 {
        self.version
    }

    /// Sends a request and waits for its answer, at most until `deadline` (and the
    /// limits' idle time). After a call that failed other than by the peer's refusal
    /// ([`LinkError::Peer`]) the link is broken: every later call answers
    /// [`LinkError::Closed`] at once, and the link is to be dropped.
    pub fn call(&mut self, request: PeerRequest, deadline: Instant) -> Result<PeerResponse, LinkError> {
        if self.broken {
            return Err(LinkError::Closed);
        }
        self.pending = None;
        let answer = self.ask(request, deadline);
        self.broken = matches!(&answer, Err(e) if !matches!(e, LinkError::Peer(_)));
        answer
    }

    /// Lets each call poll its socket for up to `poll` for the answer before it sleeps in
    /// the read (zero, the default: it sleeps at once). A thread that sleeps is woken by
    /// the kernel when the answer comes; where a wake-up costs more than the answer takes
    /// (a VM whose idle vCPU halts: tens of µs), polling trades that much CPU time per
    /// call for the wake-up. The poll ends at the answer's first byte, at an error or end
    /// of the stream, or when `poll` is spent, whichever comes first; it yields the CPU
    /// between looks, so it never keeps a thread that is ready to run (the peer's, when
    /// it shares the CPU) from it.
    pub fn set_answer_poll(&mut self, poll: Duration) {
        self.answer_poll = poll;
    }

    /// Whether a call failed mid-way (see [`Self::call`]).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Whether the last call gave up waiting for an answer to a request it had sent
    /// whole: the peer may still answer it ([`Self::late_answer`]).
    pub fn answer_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Reads the answer the last call gave up waiting for, until `deadline`: what a
    /// caller that gave up does with a link whose peer may have acted on the request (an
    /// import granted, recorded by the owner, that the asker must then give back). The
    /// link stays broken for calls either way. [`LinkError::Closed`] when no answer is
    /// pending.
    pub fn late_answer(&mut self, deadline: Instant) -> Result<PeerResponse, LinkError> {
        let Some((id, op)) = self.pending.take() else { return Err(LinkError::Closed) };
        match self.recv(deadline, deadline, Stage::Idle)? {
            (got, answer) if got == id => answer_to(op, answer),
            (_, other) => Err(LinkError::unexpected("an answer with the request's id", &other)),
        }
    }

    /// One request and its answer.
    fn ask(&mut self, request: PeerRequest, deadline: Instant) -> Result<PeerResponse, LinkError> {
        let op = request.op;
        let id = self.next_id;
        self.next_id += 1;
        let write_by = deadline.min(Instant::now() + self.limits.frame_timeout);
        self.send(id, &PeerMessage::Request(request), write_by, Stage::Write)?;
        let idle_by = deadline.min(Instant::now() + self.limits.idle_timeout);
        self.poll_for_answer(idle_by);
        match self.recv(idle_by, deadline, Stage::Idle) {
            Ok((got, answer)) if got == id => answer_to(op, answer),
            Ok((_, other)) => Err(LinkError::unexpected("an answer with the request's id", &other)),
            Err(e) => {
                // Given up waiting, the request sent: the peer may answer still.
                if matches!(e, LinkError::Timeout(_)) {
                    self.pending = Some((id, op));
                }
                Err(e)
            }
        }
    }

    /// Writes `message` whole before `deadline`.
    fn send(&mut self, id: u64, message: &PeerMessage, deadline: Instant, stage: Stage) -> Result<(), LinkError> {
        self.out.clear();
        message.encode(id, &mut self.out)?;
        // A handshake's write reads the server's flight too: both bounded alike.
        self.stream.sock.deadline = deadline;
        self.stream.write_all(&self.out).map_err(|e| io_error(e, stage))?;
        self.stream.flush().map_err(|e| io_error(e, stage))
    }

    /// Polls the socket until it is readable, for at most the answer poll
    /// ([`Self::set_answer_poll`]) and never past `by`; nothing when the answer may already
    /// be buffered here (the frame decoder's or TLS's own bytes), where the read would not
    /// sleep anyway.
    fn poll_for_answer(&mut self, by: Instant) {
        if self.answer_poll.is_zero() || !self.decoder.at_boundary() {
            return;
        }
        match self.stream.conn.process_new_packets() {
            Ok(io) if io.plaintext_bytes_to_read() == 0 => {}
            _ => return,
        }
        let tcp = &self.stream.sock.tcp;
        if tcp.set_nonblocking(true).is_err() {
            return;
        }
        let until = by.min(Instant::now() + self.answer_poll);
        let mut byte = [0u8; 1];
        loop {
            match tcp.peek(&mut byte) {
                Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < until => std::thread::yield_now(),
                // Readable, ended, failed (the read says how), or the poll is spent.
                _ => break,
            }
        }
        if tcp.set_nonblocking(false).is_err() {
            // A read that would sleep answers `WouldBlock` now, a timeout: the call fails
            // and the link is dropped rather than misread.
            tracing::debug!("node link: the socket stayed non-blocking");
        }
    }

    /// The next message and its id: a frame begun before `idle_by`, ended within the
    /// frame time (and before `deadline`).
    fn recv(&mut self, idle_by: Instant, deadline: Instant, stage: Stage) -> Result<(u64, PeerMessage), LinkError> {
        let mut frame_by = None;
        loop {
            if let Some(frame) = self.decoder.next_frame() {
                let frame = frame.map_err(LinkError::Frame)?;
                let message = PeerMessage::decode(&frame.header, frame.body)?;
                return Ok((frame.header.request_id, message));
            }
            if !self.decoder.at_boundary() && frame_by.is_none() {
                frame_by = Some(deadline.min(Instant::now() + self.limits.frame_timeout));
            }
            let (by, stage) = match frame_by {
                Some(d) => (d, if stage == Stage::Handshake { stage } else { Stage::Frame }),
                None => (idle_by, stage),
            };
            self.stream.sock.deadline = by;
            let n = match self.stream.read(self.decoder.read_buf(true)) {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // The TCP stream ended without TLS's close_notify: an end all the same.
                Err(e) if e.kind() == ErrorKind::UnexpectedEof => 0,
                Err(e) => return Err(io_error(e, stage)),
            };
            if n == 0 {
                return Err(if self.decoder.at_boundary() { LinkError::Closed } else { LinkError::Truncated });
            }
            self.decoder.filled(n, Vec::new(), false);
        }
    }
}

impl Drop for BlockingLink {
    /// Ends the link politely (TLS close_notify), without waiting: the peer may be gone.
    fn drop(&mut self) {
        self.stream.conn.send_close_notify();
        self.stream.sock.deadline = Instant::now() + Duration::from_millis(100);
        if self.stream.sock.tcp.set_nonblocking(true).is_ok() {
            let _ = self.stream.conn.complete_io(&mut self.stream.sock);
        }
    }
}
