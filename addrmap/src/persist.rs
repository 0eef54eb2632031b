//! The state file: a versioned, checksummed frame around a JSON payload, written
//! atomically with the previous good copy kept beside it.
//!
//! Layout (all integers little-endian; see docs/addrmap.md):
//!
//! | bytes  | field                                   |
//! |--------|-----------------------------------------|
//! | 0..8   | magic `89 47 46 41 0d 0a 1a 0a`         |
//! | 8..12  | format version (1)                      |
//! | 12..16 | payload encoding (1 = JSON)             |
//! | 16..24 | generation (same as in the payload)     |
//! | 24..32 | payload length in bytes                 |
//! | 32..36 | CRC-32C of the payload                  |
//! | 36..40 | CRC-32C of bytes 0..36                  |
//! | 40..   | payload                                 |

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::state::{State, StateError};

/// File magic: like PNG's, it catches text-mode and truncation-to-7-bit damage.
pub const MAGIC: [u8; 8] = *b"\x89GFA\r\n\x1a\n";
/// Current format version.
pub const VERSION: u32 = 1;
/// Payload encoding: JSON.
pub const ENCODING_JSON: u32 = 1;
/// Header length.
pub const HEADER_LEN: usize = 40;

/// What is wrong with a state file's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than its header says (or than a header).
    #[error("truncated: {len} bytes, need {need}")]
    Truncated {
        /// Bytes present.
        len: u64,
        /// Bytes needed.
        need: u64,
    },
    /// Not a state file.
    #[error("bad magic (not a fabric address map state file)")]
    BadMagic,
    /// Header bytes damaged.
    #[error("header checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    HeaderChecksum {
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
    /// Written by a newer (or unknown) format.
    #[error("unsupported format version {0}")]
    Version(u32),
    /// Unknown payload encoding.
    #[error("unsupported payload encoding {0}")]
    Encoding(u32),
    /// Bytes after the payload.
    #[error("{extra} unexpected bytes after the payload")]
    TrailingBytes {
        /// How many.
        extra: u64,
    },
    /// Payload bytes damaged.
    #[error("payload checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    PayloadChecksum {
        /// Stored CRC.
        stored: u32,
        /// Computed CRC.
        computed: u32,
    },
    /// The payload does not parse.
    #[error("payload does not parse: {0}")]
    Payload(String),
    /// Header and payload disagree on the generation.
    #[error("header generation {header} differs from payload generation {payload}")]
    Generation {
        /// In the header.
        header: u64,
        /// In the payload.
        payload: u64,
    },
    /// The payload parses but breaks an invariant.
    #[error("inconsistent state")]
    Invalid(#[source] StateError),
}

/// Errors from reading and writing state files.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// Reading failed.
    #[error("cannot read state file {path}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The file is corrupt; it was left as it is.
    #[error("state file {path} is corrupt (left untouched; see `rebuild`)")]
    Corrupt {
        /// File.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: DecodeError,
    },
    /// Saving would replace a corrupt file, which only `rebuild` may do.
    #[error("refusing to overwrite corrupt state file {path}; run rebuild")]
    RefuseOverwrite {
        /// File.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: DecodeError,
    },
    /// Writing, syncing or renaming failed.
    #[error("cannot write {path}")]
    Write {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The state file is missing but its previous copy exists: a state was lost.
    #[error("state file {path} is missing but {prev} exists; restore or rebuild")]
    MissingWithPrevious {
        /// File.
        path: PathBuf,
        /// The previous copy.
        prev: PathBuf,
    },
}

/// Encodes a state as a framed file image.
pub fn encode_state(state: &State) -> Vec<u8> {
    // Serialising plain data with string keys cannot fail.
    let payload = serde_json::to_vec(state).unwrap_or_default();
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&ENCODING_JSON.to_le_bytes());
    out.extend_from_slice(&state.generation.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    let hcrc = crc32c::crc32c(&out[..36]);
    out.extend_from_slice(&hcrc.to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Checks the header; returns (generation, payload) without parsing the payload.
pub fn decode_frame(bytes: &[u8]) -> Result<(u64, &[u8]), DecodeError> {
    let len = bytes.len() as u64;
    if bytes.len() < HEADER_LEN {
        if !MAGIC.starts_with(&bytes[..bytes.len().min(8)]) {
            return Err(DecodeError::BadMagic);
        }
        return Err(DecodeError::Truncated { len, need: HEADER_LEN as u64 });
    }
    if bytes[..8] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let stored = u32_at(bytes, 36);
    let computed = crc32c::crc32c(&bytes[..36]);
    if stored != computed {
        return Err(DecodeError::HeaderChecksum { stored, computed });
    }
    let version = u32_at(bytes, 8);
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    let encoding = u32_at(bytes, 12);
    if encoding != ENCODING_JSON {
        return Err(DecodeError::Encoding(encoding));
    }
    let generation = u64_at(bytes, 16);
    let plen = u64_at(bytes, 24);
    let need = (HEADER_LEN as u64).saturating_add(plen);
    if len < need {
        return Err(DecodeError::Truncated { len, need });
    }
    if len > need {
        return Err(DecodeError::TrailingBytes { extra: len - need });
    }
    let payload = &bytes[HEADER_LEN..];
    let stored = u32_at(bytes, 32);
    let computed = crc32c::crc32c(payload);
    if stored != computed {
        return Err(DecodeError::PayloadChecksum { stored, computed });
    }
    Ok((generation, payload))
}

/// Decodes and validates a state file image. Pure: suitable for fuzzing.
pub fn decode_state(bytes: &[u8]) -> Result<State, DecodeError> {
    let (generation, payload) = decode_frame(bytes)?;
    let state: State = serde_json::from_slice(payload).map_err(|e| DecodeError::Payload(e.to_string()))?;
    if state.generation != generation {
        return Err(DecodeError::Generation { header: generation, payload: state.generation });
    }
    state.validate().map_err(DecodeError::Invalid)?;
    Ok(state)
}

/// `map.state` -> `map.state.prev`.
pub fn prev_path(path: &Path) -> PathBuf {
    suffixed(path, ".prev")
}

fn suffixed(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Loads and validates a state file; a corrupt file is reported and left as it is.
pub fn load(path: &Path) -> Result<State, PersistError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound && prev_path(path).exists() => {
            return Err(PersistError::MissingWithPrevious { path: path.to_owned(), prev: prev_path(path) });
        }
        Err(source) => return Err(PersistError::Read { path: path.to_owned(), source }),
    };
    decode_state(&bytes).map_err(|source| PersistError::Corrupt { path: path.to_owned(), source })
}

fn sync_dir(dir: &Path) -> Result<(), PersistError> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    File::open(dir).and_then(|d| d.sync_all()).map_err(|source| PersistError::Write { path: dir.to_owned(), source })
}

/// Writes a state atomically: temp file, fsync, keep the old file as `.prev`, rename,
/// fsync the directory. Refuses to replace a corrupt file.
pub fn save(path: &Path, state: &State) -> Result<(), PersistError> {
    let werr = |p: &Path| {
        let p = p.to_owned();
        move |source| PersistError::Write { path: p, source }
    };
    let existing = match fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(source) => return Err(PersistError::Read { path: path.to_owned(), source }),
    };
    if let Some(bytes) = &existing
        && let Err(source) = decode_state(bytes)
    {
        return Err(PersistError::RefuseOverwrite { path: path.to_owned(), source });
    }
    let dir = path.parent().unwrap_or(Path::new(""));
    let tmp = suffixed(path, ".tmp");
    let image = encode_state(state);
    {
        // 0600 whatever the umask (set through the descriptor: an existing temporary keeps
        // its mode on open), and not through a symlink.
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(werr(&tmp))?;
        f.set_permissions(fs::Permissions::from_mode(0o600)).map_err(werr(&tmp))?;
        f.write_all(&image).map_err(werr(&tmp))?;
        f.sync_all().map_err(werr(&tmp))?;
    }
    if existing.is_some() {
        let prev = prev_path(path);
        let prev_tmp = suffixed(path, ".prev.tmp");
        let _ = fs::remove_file(&prev_tmp);
        if fs::hard_link(path, &prev_tmp).is_err() {
            fs::copy(path, &prev_tmp).map_err(werr(&prev_tmp))?;
            File::open(&prev_tmp).and_then(|f| f.sync_all()).map_err(werr(&prev_tmp))?;
        }
        // The previous image is 0600 too (one an earlier version left wider is tightened).
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&prev_tmp)
            .and_then(|f| f.set_permissions(fs::Permissions::from_mode(0o600)))
            .map_err(werr(&prev_tmp))?;
        fs::rename(&prev_tmp, &prev).map_err(werr(&prev))?;
    }
    fs::rename(&tmp, path).map_err(werr(path))?;
    sync_dir(dir)?;
    tracing::info!(path = %path.display(), generation = state.generation, bytes = image.len(), "address map saved");
    Ok(())
}

/// Moves a (corrupt) state file aside to `<path>.corrupt-<generation>` (generation from an
/// intact header) or `<path>.corrupt-t<unix seconds>`; returns the new name, or `None` when
/// there was no file.
pub fn move_aside(path: &Path) -> Result<Option<PathBuf>, PersistError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(PersistError::Read { path: path.to_owned(), source }),
    };
    let tag = match header_generation(&bytes) {
        Some(g) => g.to_string(),
        None => {
            let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            format!("t{secs}")
        }
    };
    let mut target = suffixed(path, &format!(".corrupt-{tag}"));
    let mut n = 1;
    while target.exists() {
        target = suffixed(path, &format!(".corrupt-{tag}-{n}"));
        n += 1;
    }
    fs::rename(path, &target).map_err(|source| PersistError::Write { path: target.clone(), source })?;
    sync_dir(path.parent().unwrap_or(Path::new("")))?;
    tracing::warn!(from = %path.display(), to = %target.display(), "state file moved aside");
    Ok(Some(target))
}

/// The generation in an intact header, if the header is intact.
fn header_generation(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < HEADER_LEN || bytes[..8] != MAGIC || u32_at(bytes, 36) != crc32c::crc32c(&bytes[..36]) {
        return None;
    }
    Some(u64_at(bytes, 16))
}
