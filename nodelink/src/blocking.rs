//! A client link on a blocking socket, for a thread that waits for its answer anyway (a
//! fabricd request thread asking another node for an import): the thread sleeps in the
//! socket's own read and the kernel wakes it when the answer arrives, with no runtime's
//! I/O driver in between to wake it in turn. The same TLS, Hello, frames, deadlines and
//! checks as the async [`crate::Link`] (the handshake's and the answer's checks are
//! shared with it); the server cannot tell the two apart.

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
use crate::message::{PEER_DECODER, PeerMessage, PeerRequest, PeerResponse};
use crate::tls::{Credentials, server_name};

/// A link to another node, as its client, on a blocking socket (see the module doc).
#[derive(Debug)]
pub struct BlockingLink {
    stream: StreamOwned<ClientConnection, TcpStream>,
    decoder: FrameDecoder<OwnedFd>,
    out: Vec<u8>,
    peer: NodeIdentity,
    peer_incarnation: u64,
    next_id: u64,
    limits: LinkLimits,
}

/// The time left until `deadline` as a socket timeout, or the timeout of `stage` when
/// none is left (a zero timeout would mean "never" to the socket).
fn left(deadline: Instant, stage: Stage) -> Result<Duration, LinkError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() { Err(LinkError::Timeout(stage)) } else { Ok(left) }
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
            stream: StreamOwned::new(tls, tcp),
            decoder: FrameDecoder::new(PEER_DECODER),
            out: Vec::new(),
            peer: expected.clone(),
            peer_incarnation: 0,
            next_id: 1,
            limits,
        };
        // The TLS handshake runs within the first write and the read after it.
        link.send(0, &PeerMessage::Hello(hello_of(creds, incarnation)), deadline, Stage::Handshake)?;
        let welcome = welcomed(expected, link.recv(deadline, deadline, Stage::Handshake)?)?;
        link.peer_incarnation = welcome.incarnation;
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

    /// Sends a request and waits for its answer, at most until `deadline` (and the
    /// limits' idle time); a link whose call failed other than by the peer's refusal
    /// ([`LinkError::Peer`]) is not to be used again.
    pub fn call(&mut self, request: PeerRequest, deadline: Instant) -> Result<PeerResponse, LinkError> {
        let op = request.op;
        let id = self.next_id;
        self.next_id += 1;
        let write_by = deadline.min(Instant::now() + self.limits.frame_timeout);
        self.send(id, &PeerMessage::Request(request), write_by, Stage::Write)?;
        let idle_by = deadline.min(Instant::now() + self.limits.idle_timeout);
        match self.recv(idle_by, deadline, Stage::Idle)? {
            (got, answer) if got == id => answer_to(op, answer),
            (_, other) => Err(LinkError::unexpected("an answer with the request's id", &other)),
        }
    }

    /// Writes `message` whole before `deadline`.
    fn send(&mut self, id: u64, message: &PeerMessage, deadline: Instant, stage: Stage) -> Result<(), LinkError> {
        self.out.clear();
        message.encode(id, &mut self.out)?;
        let tcp = self.stream.get_ref();
        tcp.set_write_timeout(Some(left(deadline, stage)?)).map_err(LinkError::Io)?;
        // A handshake's write reads the server's flight too.
        tcp.set_read_timeout(Some(left(deadline, stage)?)).map_err(LinkError::Io)?;
        self.stream.write_all(&self.out).map_err(|e| io_error(e, stage))?;
        self.stream.flush().map_err(|e| io_error(e, stage))
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
            self.stream.get_ref().set_read_timeout(Some(left(by, stage)?)).map_err(LinkError::Io)?;
            let n = match self.stream.read(self.decoder.read_buf(true)) {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
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
        let tcp = self.stream.get_ref();
        if tcp.set_nonblocking(true).is_ok() {
            let _ = self.stream.conn.complete_io(&mut self.stream.sock);
        }
    }
}
