//! Node-link messages over a byte stream (TLS): the sans-IO frame decoder driven by reads
//! with deadlines — a peer that sends nothing for the idle time, or stops inside a frame
//! for the frame time, is cut off — and writes that must finish within the frame time.

use std::os::fd::OwnedFd;
use std::time::Duration;

use fabric_proto::wire::{DecoderConfig, FrameDecoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, timeout_at};

use crate::error::{LinkError, Stage};
use crate::message::{PEER_DECODER, PeerMessage};

/// How long a link waits at a frame boundary before it gives back buffers grown past
/// [`KEEP`] for large frames (copy chunks): the next burst allocates them again.
const SHRINK_AFTER: Duration = Duration::from_millis(100);

/// The buffer sizes a link keeps while idle.
const KEEP: usize = 64 << 10;

/// A stream of node-link messages.
#[derive(Debug)]
pub struct Framed<S> {
    stream: S,
    decoder: FrameDecoder<OwnedFd>,
    frame_timeout: Duration,
    out: Vec<u8>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Framed<S> {
    /// Messages over `stream`; a frame once begun, and a write, must finish within
    /// `frame_timeout`.
    pub fn new(stream: S, frame_timeout: Duration) -> Self {
        Self::with_limits(stream, frame_timeout, PEER_DECODER)
    }

    /// The same, reading frames within `limits` (until [`Framed::set_limits`]).
    pub fn with_limits(stream: S, frame_timeout: Duration, limits: DecoderConfig) -> Self {
        Self { stream, decoder: FrameDecoder::new(limits), frame_timeout, out: Vec::new() }
    }

    /// Reads the next frames within `limits`.
    pub fn set_limits(&mut self, limits: DecoderConfig) {
        self.decoder.set_config(limits);
    }

    /// The stream.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// The stream; bytes read past the last message are dropped (tests write raw bytes).
    pub fn into_inner(self) -> S {
        self.stream
    }

    /// The next message and its request id. Waits up to `idle` for a frame to begin, then
    /// up to the frame time for it to end. Any refused frame ends the stream.
    pub async fn recv(&mut self, idle: Duration) -> Result<(u64, PeerMessage), LinkError> {
        let idle_deadline = Instant::now() + idle;
        let mut frame_deadline = None;
        let mut shrink_at = self.holds_large().then(|| Instant::now() + SHRINK_AFTER);
        loop {
            if let Some(frame) = self.decoder.next_frame() {
                let frame = frame.map_err(LinkError::Frame)?;
                let message = PeerMessage::decode(&frame.header, frame.body)?;
                return Ok((frame.header.request_id, message));
            }
            if !self.decoder.at_boundary() && frame_deadline.is_none() {
                frame_deadline = Some(Instant::now() + self.frame_timeout);
            }
            let (deadline, stage) = match frame_deadline {
                Some(d) => (d, Stage::Frame),
                None => (idle_deadline, Stage::Idle),
            };
            // Idle at a boundary with large buffers: wake up early to give them back (a
            // read cut short takes no bytes), then wait on.
            let early = shrink_at.filter(|at| frame_deadline.is_none() && *at < deadline);
            let buf = self.decoder.read_buf(true);
            let n = match timeout_at(early.unwrap_or(deadline), self.stream.read(buf)).await {
                Err(_) if early.is_some() => {
                    shrink_at = None;
                    self.shrink();
                    continue;
                }
                Err(_) => return Err(LinkError::Timeout(stage)),
                Ok(r) => r.map_err(LinkError::Io)?,
            };
            if n == 0 {
                return Err(if self.decoder.at_boundary() { LinkError::Closed } else { LinkError::Truncated });
            }
            self.decoder.filled(n, Vec::new(), false);
        }
    }

    /// Whether its buffers grew past what an idle link keeps.
    fn holds_large(&self) -> bool {
        self.decoder.capacity() > KEEP || self.out.capacity() > KEEP
    }

    /// Gives back buffers grown for large frames (nothing is buffered at a boundary).
    fn shrink(&mut self) {
        if self.decoder.capacity() > KEEP {
            self.decoder.shrink();
        }
        if self.out.capacity() > KEEP {
            self.out = Vec::new();
        }
    }

    /// Sends `message` with `request_id`, within the frame time.
    pub async fn send(&mut self, request_id: u64, message: &PeerMessage) -> Result<(), LinkError> {
        self.out.clear();
        message.encode(request_id, &mut self.out)?;
        let deadline = Instant::now() + self.frame_timeout;
        let write = async {
            self.stream.write_all(&self.out).await?;
            self.stream.flush().await
        };
        match timeout_at(deadline, write).await {
            Err(_) => Err(LinkError::Timeout(Stage::Write)),
            Ok(r) => r.map_err(LinkError::Io),
        }
    }

    /// Ends the stream politely (TLS close_notify), within the frame time; errors ignored:
    /// the peer may be gone.
    pub async fn close(&mut self) {
        let _ = tokio::time::timeout(self.frame_timeout, self.stream.shutdown()).await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::message::{PeerOp, PeerRequest};

    /// A link that carried copy chunks gives their buffers back once it idles, on both
    /// sides, and reads on. Before, about one chunk's size stayed per direction for good.
    #[tokio::test(start_paused = true)]
    async fn buffers_grown_for_copy_chunks_are_given_back_when_the_link_idles() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (mut a, mut b) = (Framed::new(a, Duration::from_secs(1)), Framed::new(b, Duration::from_secs(1)));
        let chunk = PeerMessage::Request(PeerRequest { op: PeerOp::Copy, body: vec![5; 512 << 10] });
        let sent = async { b.send(1, &chunk).await.unwrap() };
        let (got, ()) = tokio::join!(a.recv(Duration::from_secs(1)), sent);
        assert_eq!(got.unwrap(), (1, chunk));
        assert!(a.holds_large() && b.holds_large());
        // Idle for less than the shrink delay: kept (the next chunk may be on its way).
        let quick = a.recv(SHRINK_AFTER / 2).await;
        assert!(matches!(quick, Err(LinkError::Timeout(Stage::Idle))), "{quick:?}");
        assert!(a.holds_large());
        let idle = a.recv(SHRINK_AFTER * 3).await;
        assert!(matches!(idle, Err(LinkError::Timeout(Stage::Idle))), "{idle:?}");
        assert!(!a.holds_large(), "the reader gave its buffer back");
        assert!(matches!(b.recv(SHRINK_AFTER * 2).await, Err(LinkError::Timeout(Stage::Idle))));
        assert!(!b.holds_large(), "the writer gave its buffer back");
        // Both go on as before.
        let sent = async { a.send(2, &PeerMessage::Ping).await.unwrap() };
        let (got, ()) = tokio::join!(b.recv(Duration::from_secs(1)), sent);
        assert_eq!(got.unwrap(), (2, PeerMessage::Ping));
    }
}
