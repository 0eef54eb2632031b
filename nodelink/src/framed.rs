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
            let buf = self.decoder.read_buf(true);
            let n = match timeout_at(deadline, self.stream.read(buf)).await {
                Err(_) => return Err(LinkError::Timeout(stage)),
                Ok(r) => r.map_err(LinkError::Io)?,
            };
            if n == 0 {
                return Err(if self.decoder.at_boundary() { LinkError::Closed } else { LinkError::Truncated });
            }
            self.decoder.filled(n, Vec::new(), false);
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
