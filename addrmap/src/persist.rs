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
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::durable::{self, FrameError};
use crate::state::{State, StateError};

/// File magic: like PNG's, it catches text-mode and truncation-to-7-bit damage.
pub const MAGIC: [u8; 8] = *b"\x89GFA\r\n\x1a\n";
/// Current format version.
pub const VERSION: u32 = 1;
/// Payload encoding: JSON.
pub const ENCODING_JSON: u32 = 1;
/// Header length.
pub const HEADER_LEN: usize = durable::FRAME_HEADER_LEN;

/// What is wrong with a state file's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The frame is damaged: truncated, not a state file (bad magic), a checksum
    /// mismatch, bytes after the payload, another format version or encoding.
    #[error(transparent)]
    Frame(#[from] FrameError),
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
    durable::encode_frame(&MAGIC, VERSION, ENCODING_JSON, state.generation, &payload)
}

/// Checks the header; returns (generation, payload) without parsing the payload.
pub fn decode_frame(bytes: &[u8]) -> Result<(u64, &[u8]), DecodeError> {
    Ok(durable::decode_frame(&MAGIC, VERSION, ENCODING_JSON, u64::MAX, bytes)?)
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
    durable::suffixed(path, ".prev")
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
    durable::sync_dir(dir).map_err(|source| PersistError::Write { path: dir.to_owned(), source })
}

/// Writes a state atomically: keeps the old file as `.prev`, then [`durable::write_whole`]
/// (temp file, fsync, rename, fsync of the directory). Refuses to replace a corrupt file.
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
    let image = encode_state(state);
    if existing.is_some() {
        let prev = prev_path(path);
        let prev_tmp = durable::suffixed(path, ".prev.tmp");
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
    // The directory fsync at its end makes the `.prev` rename durable too.
    match durable::write_whole(path, &image) {
        Ok(_) => {}
        // The new state is in place and a later run reads it: the change stands (see
        // `durable::WriteError`); only a power loss before the next save may lose it.
        Err(e) if e.step == durable::WriteStep::SyncDir => {
            tracing::error!(path = %path.display(), error = %e.source, "address map saved, but its directory could not be synced: a power loss before the next save may lose it");
        }
        Err(e) => return Err(PersistError::Write { path: e.path, source: e.source }),
    }
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
    let mut target = durable::suffixed(path, &format!(".corrupt-{tag}"));
    let mut n = 1;
    while target.exists() {
        target = durable::suffixed(path, &format!(".corrupt-{tag}-{n}"));
        n += 1;
    }
    fs::rename(path, &target).map_err(|source| PersistError::Write { path: target.clone(), source })?;
    sync_dir(path.parent().unwrap_or(Path::new("")))?;
    tracing::warn!(from = %path.display(), to = %target.display(), "state file moved aside");
    Ok(Some(target))
}

/// The generation in an intact header, if the header is intact.
fn header_generation(bytes: &[u8]) -> Option<u64> {
    durable::decode_frame_header(&MAGIC, bytes).ok().map(|h| h.generation)
}
