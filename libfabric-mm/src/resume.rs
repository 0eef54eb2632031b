//! Taking a session back: the daemon gives every session a 128-bit resume token; a new
//! connection that presents it (`SessionConfig::resume`) gets the session's regions and
//! exports back, after a daemon restart, or after the connection dropped while the daemon
//! keeps disconnected sessions (`memory.detach_grace_s`), within the grace period.
//! Also the session's liveness probe.

use std::fmt;
use std::str::FromStr;

use fabric_proto::wire::{Opcode, Request, Response, SessionToken};

use crate::error::{Error, Result};
use crate::session::Session;

/// A session's resume token. A secret: its `Debug` form hides it; its text form (32 hex
/// digits, [`fmt::Display`] / [`FromStr`]) is how to keep it, e.g. in a file only the
/// owner can read.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Token(pub(crate) SessionToken);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0.expose() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for Token {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::InvalidArgument("a resume token is 32 hex digits".into());
        if s.len() != 32 || !s.is_ascii() {
            return Err(bad());
        }
        let mut bytes = [0u8; 16];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(SessionToken(bytes)))
    }
}

impl Session {
    /// This session's resume token (`None` when the daemon speaks protocol 1.0, which has
    /// none). With [`crate::SessionConfig::resume`] a later connection takes the session's
    /// regions and exports back.
    pub fn token(&self) -> Option<Token> {
        self.inner.client.token().map(Token)
    }

    /// Closes the connection to the daemon now, keeping this process's mappings. Every
    /// later call of this session (and drop of its objects) fails with or ignores
    /// [`Error::Disconnected`]. What the daemon does with the session's regions and
    /// exports is its `memory.detach_grace_s`: keep them for that long for a session
    /// opened with [`Session::token`] in [`crate::SessionConfig::resume`], or (0, the
    /// default) reclaim them at once.
    pub fn disconnect(&self) {
        self.inner.client.disconnect();
    }

    /// A no-op round trip to the daemon (liveness, and the library's own latency).
    pub fn ping(&self) -> Result<()> {
        match self.call(Request::Ping)? {
            Response::Ping => Ok(()),
            _ => Err(Error::Unexpected(Opcode::Ping)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_as_text_and_hide_in_debug() {
        let t = Token(SessionToken([0xA5; 16]));
        let s = t.to_string();
        assert_eq!(s, "a5".repeat(16));
        assert_eq!(s.parse::<Token>().unwrap(), t);
        assert_eq!(format!("{t:?}"), "Token(..)");
        assert!("a5".parse::<Token>().is_err());
        assert!("zz".repeat(16).parse::<Token>().is_err());
        assert!("é".repeat(16).parse::<Token>().is_err());
    }
}
