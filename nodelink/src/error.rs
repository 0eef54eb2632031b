//! Why a node link fails.

use std::io;

use fabric_proto::wire::DecodeError;

use crate::identity::IdentityError;
use crate::message::{MessageError, PeerError, Refusal};
use crate::tls::TlsError;

/// What a link was waiting for when its time ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The TLS handshake and the Hello/Welcome exchange.
    Handshake,
    /// A frame to begin (nothing sent for the idle time), or an answer.
    Idle,
    /// The rest of a begun frame.
    Frame,
    /// A write to finish (the peer does not read).
    Write,
}

/// Why a node link failed or was refused.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// TLS could not be set up.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A socket error, or the TLS handshake failed (no or a bad certificate, not TLS).
    #[error("i/o: {0}")]
    Io(#[source] io::Error),
    /// The peer's certificate states no node identity.
    #[error("peer certificate: {0}")]
    Identity(#[from] IdentityError),
    /// Time ran out.
    #[error("timed out waiting for {0:?}")]
    Timeout(Stage),
    /// The peer closed the link between frames.
    #[error("the peer closed the link")]
    Closed,
    /// The peer closed the link inside a frame.
    #[error("the peer closed the link inside a frame")]
    Truncated,
    /// The peer sent a frame the decoder refuses.
    #[error("refused frame: {0}")]
    Frame(DecodeError),
    /// The peer sent a frame that is no node-link message, or a message that cannot be
    /// sent.
    #[error(transparent)]
    Message(#[from] MessageError),
    /// The peer sent a message out of turn.
    #[error("expected {expected}, got {got}")]
    Unexpected {
        /// What was expected.
        expected: &'static str,
        /// What came (its debug form, cut short).
        got: String,
    },
    /// The server refused this node's Hello (or this server refused the peer's).
    #[error("refused: {0}")]
    Refused(Refusal),
    /// The peer answered a request with a failure.
    #[error("the peer failed the request: {0}")]
    Peer(PeerError),
}

impl LinkError {
    /// An out-of-turn message.
    pub(crate) fn unexpected(expected: &'static str, got: &impl std::fmt::Debug) -> Self {
        LinkError::Unexpected { expected, got: format!("{got:?}").chars().take(80).collect() }
    }
}
