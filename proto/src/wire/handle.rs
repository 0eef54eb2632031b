//! Export handles: the capability that names an exported region (owner node, region id,
//! generation, 128-bit secret), a text form to pass between processes, and the
//! constant-time comparison a server must use to check one.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::node::NodeId;

/// The 128-bit random part of a handle. Its `Debug` does not print it and `==` takes the
/// same time wherever the values differ.
#[derive(Clone, Copy, Eq, Serialize, Deserialize)]
pub struct Secret(pub [u8; 16]);

impl Secret {
    /// The secret bytes (to journal them; never to log them).
    pub fn expose(&self) -> &[u8; 16] {
        &self.0
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        ct_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// A session's resume token: 128 random bits the server gives in the `Hello` response
/// (protocol 1.1 and later) and journals with the session's regions. After a daemon
/// restart, a client that presents it in its `Hello` takes its regions and exports back
/// (docs/fabricd.md, "Durability"). Its `Debug` does not print it and `==` takes the same
/// time wherever the values differ: it is a capability, like an export's secret.
#[derive(Clone, Copy, Eq, Serialize, Deserialize)]
pub struct SessionToken(pub [u8; 16]);

impl SessionToken {
    /// The token bytes (to journal them; never to log them).
    pub fn expose(&self) -> &[u8; 16] {
        &self.0
    }
}

impl PartialEq for SessionToken {
    fn eq(&self, other: &Self) -> bool {
        ct_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for SessionToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionToken(..)")
    }
}

/// Compares two byte strings in time that depends only on their lengths, not on where
/// they differ: every byte is examined and the differences are folded together.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        // black_box keeps the optimiser from turning the fold into an early exit.
        diff |= std::hint::black_box(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

/// The capability that names an exported region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportHandle {
    /// The node that owns the region (1.5). `None` is the node-less handle of 1.4 and
    /// older, which only the daemon that made it resolves (as its own). Travels as a
    /// trailing extension of the bodies that carry a handle, present only when `Some`
    /// (`docs/protocol.md`, "Node identities").
    #[serde(skip)]
    pub node: Option<NodeId>,
    /// Region id.
    pub region: u64,
    /// Generation of the region (or of its export); a freed and reused id has a new one.
    pub generation: u64,
    /// Random secret chosen by the server.
    pub secret: Secret,
}

impl ExportHandle {
    /// Whether `presented` names this export: region, generation and secret are compared,
    /// the secret in constant time, without an early exit on the first mismatch. The node
    /// is not: which node a handle is for is settled before, where it is resolved.
    pub fn verify(&self, presented: &ExportHandle) -> bool {
        let ids = (self.region == presented.region) & (self.generation == presented.generation);
        let secret = ct_eq(&self.secret.0, &presented.secret.0);
        ids & secret
    }
}

/// Prefix of the text form of a node-less handle (1.4 and older).
const TEXT_PREFIX: &str = "fbh1";

/// Prefix of the text form of a handle that names its node (1.5).
const NODE_TEXT_PREFIX: &str = "fbh2";

/// The text form: `fbh2-NNNNNNNNNNNNNNNN-RRRRRRRRRRRRRRRR-GGGGGGGGGGGGGGGG-SSSS...` (node,
/// region and generation as 16 hex digits, secret as 32), or for a node-less handle
/// `fbh1-` and the last three fields. It carries the secret: treat it like a password.
impl fmt::Display for ExportHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.node {
            Some(node) => write!(f, "{NODE_TEXT_PREFIX}-{node}-")?,
            None => write!(f, "{TEXT_PREFIX}-")?,
        }
        write!(f, "{:016x}-{:016x}-", self.region, self.generation)?;
        for b in self.secret.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A handle's text form that does not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HandleError {
    /// Not `fbh1-` followed by three hex fields of 16, 16 and 32 digits, nor `fbh2-`
    /// followed by four of 16, 16, 16 and 32.
    #[error("malformed export handle")]
    Malformed,
}

impl FromStr for ExportHandle {
    type Err = HandleError;
    fn from_str(s: &str) -> Result<Self, HandleError> {
        let mut parts = s.trim().split('-');
        let node = match parts.next() {
            Some(TEXT_PREFIX) => None,
            Some(NODE_TEXT_PREFIX) => {
                Some(parts.next().and_then(|n| n.parse::<NodeId>().ok()).ok_or(HandleError::Malformed)?)
            }
            _ => return Err(HandleError::Malformed),
        };
        let (Some(r), Some(g), Some(sec), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(HandleError::Malformed);
        };
        let hex_u64 = |t: &str| {
            if t.len() == 16 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
                u64::from_str_radix(t, 16).map_err(|_| HandleError::Malformed)
            } else {
                Err(HandleError::Malformed)
            }
        };
        let region = hex_u64(r)?;
        let generation = hex_u64(g)?;
        if sec.len() != 32 || !sec.is_ascii() {
            return Err(HandleError::Malformed);
        }
        let mut secret = [0u8; 16];
        for (i, byte) in secret.iter_mut().enumerate() {
            let pair = sec.get(2 * i..2 * i + 2).ok_or(HandleError::Malformed)?;
            if !pair.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(HandleError::Malformed);
            }
            *byte = u8::from_str_radix(pair, 16).map_err(|_| HandleError::Malformed)?;
        }
        Ok(ExportHandle { node, region, generation, secret: Secret(secret) })
    }
}
