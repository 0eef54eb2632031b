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
    /// An out-of-turn message: the first 80 characters of what it is. Only those are
    /// formatted (a peer's message may carry a megabyte, which `{:?}` would make five).
    pub(crate) fn unexpected(expected: &'static str, got: &impl std::fmt::Debug) -> Self {
        let mut capped = Capped { out: String::new(), left: 80 };
        // Stopped with an error once full: what was written is what is kept.
        let _ = std::fmt::write(&mut capped, format_args!("{got:?}"));
        LinkError::Unexpected { expected, got: capped.out }
    }
}

/// A `fmt::Write` that takes `left` characters more, then refuses (which ends a `Debug`
/// formatting at once).
struct Capped {
    out: String,
    left: usize,
}

impl std::fmt::Write for Capped {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        for c in s.chars() {
            if self.left == 0 {
                return Err(std::fmt::Error);
            }
            self.out.push(c);
            self.left -= 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::LinkError;

    /// A message of a megabyte is described by its first 80 characters, and only those
    /// are formatted: a `Debug` that counts what it is asked for stops early.
    #[test]
    fn an_unexpected_message_is_described_in_80_characters_without_formatting_the_rest() {
        struct Counting(std::cell::Cell<usize>);
        impl std::fmt::Debug for Counting {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                for _ in 0..1 << 20 {
                    self.0.set(self.0.get() + 1);
                    f.write_str("00")?;
                }
                Ok(())
            }
        }
        let got = Counting(std::cell::Cell::new(0));
        let LinkError::Unexpected { got: said, .. } = LinkError::unexpected("a hello", &got) else { unreachable!() };
        assert_eq!(said, "0".repeat(80));
        assert!(got.0.get() <= 41, "{} pieces formatted", got.0.get());
        let LinkError::Unexpected { got: short, .. } = LinkError::unexpected("a hello", &"hi") else { unreachable!() };
        assert_eq!(short, "\"hi\"");
    }
}
