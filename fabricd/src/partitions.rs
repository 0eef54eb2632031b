//! Partition bindings: which uids and gids each partition binds, and the rule that binds a
//! client to partitions.
//!
//! A partition's *devices* live in the address map state, where the map's partition views
//! are built from them; the bindings say who is bound to which partition. Both are saved
//! together in one map record (`crate::store`) before either is published, so a crash can
//! never leave devices bound to a stale set of users.
//!
//! A daemon before the record kept the bindings in `<state dir>/partitions.state`, which
//! the file store still reads (once, to migrate) with [`decode`]. Its layout (integers
//! little-endian):
//!
//! | bytes  | field                                        |
//! |--------|----------------------------------------------|
//! | 0..8   | magic `FBRCPART`                             |
//! | 8..12  | format version (1)                           |
//! | 12..16 | number of bindings                           |
//! | 16..24 | payload length in bytes (at most 4 MiB)      |
//! | 24..28 | CRC-32C of the payload                       |
//! | 28..32 | CRC-32C of bytes 0..28                       |
//! | 32..   | payload: a JSON array of bindings, by name   |
//!
//! A file that fails any check stops the daemon at start: bindings are security state,
//! and silently dropping them would widen what clients see.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

/// File magic.
pub const MAGIC: [u8; 8] = *b"FBRCPART";
/// Current format version.
pub const VERSION: u32 = 1;
/// Header length.
pub const HEADER_LEN: usize = 32;
/// Largest payload accepted.
pub const MAX_PAYLOAD: u64 = 4 << 20;
/// Most bindings (one per partition; the wire allows 1,024 partitions).
pub const MAX_BINDINGS: usize = 1024;
/// Most uids, and most gids, per binding (the wire's bound).
pub const MAX_IDS: usize = 64;
/// Longest partition name in bytes (the wire's `Name`).
pub const MAX_NAME: usize = 64;
/// The file's name in the state directory.
pub const FILE_NAME: &str = "partitions.state";

/// What is wrong with a bindings file's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than its header says.
    #[error("truncated: {len} bytes, need {need}")]
    Truncated {
        /// Bytes present.
        len: u64,
        /// Bytes needed.
        need: u64,
    },
    /// Not a bindings file.
    #[error("bad magic (not a fabricd partition bindings file)")]
    BadMagic,
    /// Header bytes damaged.
    #[error("header checksum mismatch")]
    HeaderChecksum,
    /// Written by an unknown format.
    #[error("unsupported format version {0}")]
    Version(u32),
    /// The payload is larger than any valid one.
    #[error("payload of {0} bytes exceeds the limit")]
    TooLarge(u64),
    /// Bytes after the payload.
    #[error("{0} unexpected bytes after the payload")]
    TrailingBytes(u64),
    /// Payload bytes damaged.
    #[error("payload checksum mismatch")]
    PayloadChecksum,
    /// The payload does not parse.
    #[error("payload does not parse: {0}")]
    Payload(String),
    /// The payload parses but breaks a rule (count, order, bounds).
    #[error("invalid bindings: {0}")]
    Invalid(String),
}

/// Why bindings could not be changed.
#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    /// A binding breaks a bound.
    #[error("{0}")]
    Invalid(String),
}

/// Who one partition binds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binding {
    /// The partition's name.
    pub name: String,
    /// Bound users, sorted, no duplicates.
    pub uids: Vec<u32>,
    /// Bound groups (primary or supplementary), sorted, no duplicates.
    pub gids: Vec<u32>,
}

impl Binding {
    /// A binding with its ids sorted and deduplicated.
    pub fn new(name: &str, uids: &[u32], gids: &[u32]) -> Self {
        let set = |v: &[u32]| v.iter().copied().collect::<BTreeSet<_>>().into_iter().collect();
        Self { name: name.to_owned(), uids: set(uids), gids: set(gids) }
    }

    /// Whether it binds a client with `uid` and `groups` (primary and supplementary).
    pub fn binds(&self, uid: u32, groups: &[u32]) -> bool {
        self.uids.binary_search(&uid).is_ok() || groups.iter().any(|g| self.gids.binary_search(g).is_ok())
    }
}

/// Checks the bounds and order a bindings list keeps: at most [`MAX_BINDINGS`], names of 1 to
/// [`MAX_NAME`] bytes sorted and unique, at most [`MAX_IDS`] sorted, unique ids each.
pub fn validate(bindings: &[Binding]) -> Result<(), String> {
    if bindings.len() > MAX_BINDINGS {
        return Err(format!("{} bindings, at most {MAX_BINDINGS}", bindings.len()));
    }
    for (i, b) in bindings.iter().enumerate() {
        if b.name.is_empty() || b.name.len() > MAX_NAME {
            return Err(format!("binding {i}: name must be 1 to {MAX_NAME} bytes"));
        }
        if b.uids.len() > MAX_IDS || b.gids.len() > MAX_IDS {
            return Err(format!("partition {:?}: at most {MAX_IDS} uids and {MAX_IDS} gids", b.name));
        }
        if !b.uids.windows(2).all(|w| w[0] < w[1]) || !b.gids.windows(2).all(|w| w[0] < w[1]) {
            return Err(format!("partition {:?}: ids are not sorted and unique", b.name));
        }
        if i > 0 && bindings[i - 1].name >= b.name {
            return Err(format!("partition {:?}: names are not sorted and unique", b.name));
        }
    }
    Ok(())
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

/// The legacy file's bytes for `bindings` (sorted by name, as the map record keeps them);
/// what a daemon before the map record wrote (tests and the fuzz target use it).
pub fn encode(bindings: &[Binding]) -> Vec<u8> {
    // Serialising plain structs of strings and integers cannot fail.
    let payload = serde_json::to_vec(bindings).unwrap_or_default();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(bindings.len() as u32).to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    let header_crc = crc32c::crc32c(&out);
    out.extend_from_slice(&header_crc.to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Decodes a file's bytes: total over any input (a value or a typed error, never a
/// panic), and nothing is allocated beyond the bytes given before the checksums pass.
pub fn decode(bytes: &[u8]) -> Result<Vec<Binding>, DecodeError> {
    let len = bytes.len() as u64;
    if bytes.len() < HEADER_LEN {
        if !MAGIC.starts_with(&bytes[..bytes.len().min(MAGIC.len())]) {
            return Err(DecodeError::BadMagic);
        }
        return Err(DecodeError::Truncated { len, need: HEADER_LEN as u64 });
    }
    if bytes[..8] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    if crc32c::crc32c(&bytes[..28]) != u32_at(bytes, 28) {
        return Err(DecodeError::HeaderChecksum);
    }
    let version = u32_at(bytes, 8);
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    let count = u32_at(bytes, 12) as usize;
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[16..24]);
    let payload_len = u64::from_le_bytes(w);
    if payload_len > MAX_PAYLOAD {
        return Err(DecodeError::TooLarge(payload_len));
    }
    let need = HEADER_LEN as u64 + payload_len;
    if len < need {
        return Err(DecodeError::Truncated { len, need });
    }
    if len > need {
        return Err(DecodeError::TrailingBytes(len - need));
    }
    let payload = &bytes[HEADER_LEN..];
    if crc32c::crc32c(payload) != u32_at(bytes, 24) {
        return Err(DecodeError::PayloadChecksum);
    }
    let bindings: Vec<Binding> = serde_json::from_slice(payload).map_err(|e| DecodeError::Payload(e.to_string()))?;
    if bindings.len() != count {
        return Err(DecodeError::Invalid(format!("header counts {count} bindings, payload has {}", bindings.len())));
    }
    validate(&bindings).map_err(DecodeError::Invalid)?;
    Ok(bindings)
}

/// `bindings` with one partition's binding created or replaced; a binding with no uids and
/// no gids is removed instead (it binds nobody). The result is checked ([`validate`]).
pub fn with_binding(bindings: &[Binding], binding: &Binding) -> Result<Vec<Binding>, PartitionError> {
    let binding = Binding::new(&binding.name, &binding.uids, &binding.gids);
    let mut next: Vec<Binding> = bindings.iter().filter(|b| b.name != binding.name).cloned().collect();
    if !binding.uids.is_empty() || !binding.gids.is_empty() {
        next.push(binding);
    }
    next.sort_by(|a, b| a.name.cmp(&b.name));
    validate(&next).map_err(PartitionError::Invalid)?;
    Ok(next)
}

/// `bindings` without one partition's binding, or `None` when it had none.
pub fn without_binding(bindings: &[Binding], name: &str) -> Option<Vec<Binding>> {
    bindings.iter().any(|b| b.name == name).then(|| bindings.iter().filter(|b| b.name != name).cloned().collect())
}

/// The partitions in `bindings` that bind a client: every partition naming its uid or one
/// of its `groups` (primary and supplementary), sorted by name. A client bound to several
/// partitions sees their union.
pub fn bound(bindings: &[Binding], uid: u32, groups: &[u32]) -> Vec<String> {
    bindings.iter().filter(|b| b.binds(uid, groups)).map(|b| b.name.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Binding> {
        vec![Binding::new("a", &[61001, 61000, 61001], &[]), Binding::new("b", &[], &[61200, 7])]
    }

    #[test]
    fn encode_decode_round_trip_and_binding_rule() {
        let s = sample();
        assert_eq!(s[0].uids, vec![61000, 61001], "sorted, deduplicated");
        assert_eq!(decode(&encode(&s)).unwrap(), s);
        assert_eq!(decode(&encode(&[])).unwrap(), Vec::<Binding>::new());
        assert!(s[0].binds(61000, &[]));
        assert!(!s[0].binds(61002, &[61000]), "a uid list does not match gids");
        assert!(s[1].binds(5, &[100, 61200]));
        assert!(!s[1].binds(61200, &[100]));
    }

    #[test]
    fn every_damage_is_a_typed_error() {
        let good = encode(&sample());
        assert_eq!(decode(b"FBRC"), Err(DecodeError::Truncated { len: 4, need: 32 }));
        assert_eq!(decode(b"nope"), Err(DecodeError::BadMagic));
        assert_eq!(
            decode(&good[..good.len() - 1]),
            Err(DecodeError::Truncated { len: good.len() as u64 - 1, need: good.len() as u64 })
        );
        let mut long = good.clone();
        long.push(b' ');
        assert_eq!(decode(&long), Err(DecodeError::TrailingBytes(1)));
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x20;
            assert!(decode(&bad).is_err(), "flipping byte {i} went unnoticed");
        }
        // A well-framed payload that breaks the rules.
        let unsorted = vec![Binding::new("b", &[1], &[]), Binding::new("a", &[1], &[])];
        assert!(matches!(decode(&encode(&unsorted)), Err(DecodeError::Invalid(_))));
        let mut wrong_count = encode(&sample());
        wrong_count[12] = 3;
        let crc = crc32c::crc32c(&wrong_count[..28]).to_le_bytes();
        wrong_count[28..32].copy_from_slice(&crc);
        assert!(matches!(decode(&wrong_count), Err(DecodeError::Invalid(_))));
    }

    /// `fuzz/seeds/partition_bindings` holds files this encoder writes; they must stay
    /// decodable (FABRICD_WRITE_SEEDS=1 rewrites them after a format change).
    #[test]
    fn fuzz_seeds_decode() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/partition_bindings");
        let seeds = [("empty.state", Vec::new()), ("two.state", sample())];
        for (name, bindings) in seeds {
            let path = dir.join(name);
            if std::env::var_os("FABRICD_WRITE_SEEDS").is_some() {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, encode(&bindings)).unwrap();
            }
            assert_eq!(decode(&std::fs::read(&path).unwrap()).unwrap(), bindings, "{name}");
        }
    }

    #[test]
    fn changes_keep_the_rules() {
        let mut list = with_binding(&[], &Binding::new("tenant-b", &[61002], &[])).unwrap();
        list = with_binding(&list, &Binding::new("tenant-a", &[61001], &[61100])).unwrap();
        assert_eq!(bound(&list, 61001, &[]), vec!["tenant-a"]);
        assert_eq!(bound(&list, 5, &[61100]), vec!["tenant-a"]);
        assert!(bound(&list, 61003, &[1, 2]).is_empty());
        let list = without_binding(&list, "tenant-b").unwrap();
        assert!(without_binding(&list, "tenant-b").is_none());
        let list = with_binding(&list, &Binding::new("tenant-a", &[], &[])).unwrap();
        assert!(list.is_empty(), "an empty binding is removed");
        let long = Binding::new(&"x".repeat(MAX_NAME + 1), &[1], &[]);
        assert!(matches!(with_binding(&list, &long), Err(PartitionError::Invalid(_))));
    }
}
